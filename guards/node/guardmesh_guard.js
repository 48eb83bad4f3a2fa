'use strict';
/**
 * guardmesh guard kit for Node.js.
 *
 * A *guard* is a gRPC service that judges an AI agent's tool calls before they
 * run. The mesh keeps one long-lived `GuardService.Judge` stream open to each
 * guard and sends it many batches on it, concurrently. This module hides that
 * stream: a guard author writes one function
 *
 *     judge(batch) -> verdicts | Promise<verdicts>
 *
 * returning (an array or iterable of) verdicts for the calls it does not want
 * to run as they are; a call without a verdict proceeds. Verdicts are built
 * with `steer`, `cancel`, `rewrite`, `proceed` and `ask` (a person approves
 * the call first, R35).
 *
 * A complete guard:
 *
 *     const gg = require('guardmesh-guard');
 *     gg.main((batch) => batch.calls
 *       .filter((call) => call.tool === 'fs.delete')
 *       .map((call) => gg.cancel(call.callId, 'Deleting files is not allowed.')),
 *       { defaults: { name: 'no-delete' } });
 *
 * `node my_guard.js --port 0 --mesh 127.0.0.1:50051` serves, registers with
 * the mesh and prints `LISTENING <port>`.
 *
 * A judge that reads the session's memory (R34: what earlier batches of the
 * session did, as labels, counts and digests) says so by taking it as a
 * second parameter: `judge(batch, session)` (a function of two parameters,
 * `judgeFn.length >= 2`; a parameter with a default does not count). Its
 * server then says `sessionMemory: 'read'`, `server.register()` (and
 * `main()`) registers it asking for the memory, and it is called with the
 * batch's memory (null when the batch carries none). A judge of one
 * parameter asks for none and is sent none.
 *
 * What the kit does for the author:
 *  - judges the batches of one stream concurrently (each judge call is its own
 *    promise) and answers each request exactly once, in whatever order the
 *    judgements finish;
 *  - sends only verdicts for call ids it was sent, at most one per call, and no
 *    skip with blank content (each dropped with a warning, docs/behaviour.md R8);
 *  - honours `CancelBatch`: a cancelled request is not answered, and
 *    `batch.signal` / `batch.cancelled` / `batch.sleep()` let a slow judge
 *    stop early;
 *  - sends the stream's response headers as soon as it opens;
 *  - serves `grpc.health.v1.Health` (through the `grpc-health-check` package);
 *  - joins the coordinator's trace (docs/behaviour.md R22): each batch is judged inside
 *    an `@opentelemetry/api` span `guard.judge` whose parent is the batch's
 *    `traceparent` (recorded only when a tracer provider is registered; no
 *    SDK needed);
 *  - skips (steer) every call whose arguments it cannot read as an I-JSON
 *    object, without showing it to the judge: unreadable is never "proceed";
 *  - registers the guard with the mesh (`GuardRegistry.Register`), sending the
 *    TLS settings, client certificate and token it is given on every call;
 *  - stops gracefully on SIGTERM and SIGINT.
 *
 * A judge that throws (or rejects) fails that request only: the kit answers
 * it with `JudgeResponse.error` set to the error's message, the mesh applies
 * the guard's failure policy to its calls (docs/behaviour.md R13), and the stream and
 * the other requests on it go on. A judge that computes synchronously blocks
 * the event loop while it runs; make slow work asynchronous.
 *
 * The wire types are loaded at run time from the package's own
 * `proto/guardmesh/v1/guardmesh.proto` (or from `$GUARDMESH_PROTO_ROOT`).
 */

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { HealthImplementation } = require('grpc-health-check');

/** `@opentelemetry/api`, or null when it is not installed. */
const otel = (() => {
  try {
    return require('@opentelemetry/api');
  } catch {
    return null;
  }
})();

// The proto ships in the package (proto/guardmesh/v1/guardmesh.proto, a copy
// of the repository's, kept equal by scripts/test-kits).
const PROTO_ROOT = process.env.GUARDMESH_PROTO_ROOT || path.join(__dirname, 'proto');
const LOADER_OPTIONS = {
  keepCase: true, // field names as in the .proto: call_id, request_id...
  longs: String, // uint64 request ids stay exact
  enums: String,
  defaults: true,
  oneofs: true, // JudgeRequest.kind is 'batch' or 'cancel'
  includeDirs: [PROTO_ROOT],
};

/** The `guardmesh.v1` package: message and service constructors. */
const pb = grpc.loadPackageDefinition(
  protoLoader.loadSync('guardmesh/v1/guardmesh.proto', LOADER_OPTIONS),
).guardmesh.v1;

const GUARD_SERVICE = 'guardmesh.v1.GuardService';

// ---------------------------------------------------------------------------
// Logging (stderr; stdout carries only the LISTENING line)
// ---------------------------------------------------------------------------

const LEVELS = { debug: 10, info: 20, warn: 30, warning: 30, error: 40 };
const log = {
  level: LEVELS.info,
  name: 'guard',
  write(level, args) {
    if (LEVELS[level] < this.level) return;
    const text = args.map((a) => (typeof a === 'string' ? a : (a && a.stack) || String(a))).join(' ');
    process.stderr.write(`${new Date().toISOString()} ${level.toUpperCase()} ${this.name}: ${text}\n`);
  },
  debug(...args) { this.write('debug', args); },
  info(...args) { this.write('info', args); },
  warn(...args) { this.write('warn', args); },
  error(...args) { this.write('error', args); },
};

// ---------------------------------------------------------------------------
// What a judge function sees
// ---------------------------------------------------------------------------

/** One tool call of a batch, as the mesh sent it. */
class Call {
  constructor(call) {
    /** @type {string} */ this.callId = call.call_id;
    /** @type {string} */ this.tool = call.tool;
    /** The arguments as sent: a JSON object, as text ('' means {}). */
    this.arguments = call.arguments;
    /** The arguments parsed; null when they cannot be read (see `error`). */
    this.args = null;
    /**
     * Why the arguments cannot be read as an I-JSON object, if they cannot
     * (null otherwise). Such a call is never shown to the judge: the kit
     * skips it.
     */
    this.error = null;
    try {
      this.args = parseArguments(call.arguments);
    } catch (err) {
      if (!(err instanceof ArgumentsError)) throw err;
      this.error = err.message;
    }
  }
}

/** Arguments that are not an I-JSON object (RFC 7493): parsers would read them differently. */
class ArgumentsError extends Error {
  constructor(message) {
    super(message);
    this.name = 'ArgumentsError';
  }
}

/**
 * The first member name that occurs twice in one object of `text` (valid
 * JSON), or null. JSON.parse keeps the last silently; other parsers keep the
 * first or refuse, so what a guard judged would not be what runs.
 */
function duplicateMember(text) {
  const stack = [];
  for (let i = 0; i < text.length; i += 1) {
    const ch = text[i];
    if (ch === '"') {
      let j = i + 1;
      while (text[j] !== '"') j += text[j] === '\\' ? 2 : 1;
      const top = stack[stack.length - 1];
      if (top && top.keys && top.expectKey) {
        const key = JSON.parse(text.slice(i, j + 1));
        if (top.keys.has(key)) return key;
        top.keys.add(key);
        top.expectKey = false;
      }
      i = j;
    } else if (ch === '{') {
      stack.push({ keys: new Set(), expectKey: true });
    } else if (ch === '[') {
      stack.push({ keys: null });
    } else if (ch === '}' || ch === ']') {
      stack.pop();
    } else if (ch === ',') {
      const top = stack[stack.length - 1];
      if (top && top.keys) top.expectKey = true;
    }
  }
  return null;
}

/** Throws on a number a double cannot hold or a string with a lone surrogate. */
function checkValues(value) {
  const stack = [value];
  while (stack.length) {
    const item = stack.pop();
    if (typeof item === 'number') {
      if (!Number.isFinite(item)) throw new ArgumentsError('a number does not fit a double');
    } else if (typeof item === 'string') {
      if (!item.isWellFormed()) throw new ArgumentsError('a string holds a lone surrogate (\\ud800...)');
    } else if (Array.isArray(item)) {
      for (const member of item) stack.push(member);
    } else if (item !== null && typeof item === 'object') {
      for (const [key, member] of Object.entries(item)) {
        if (!key.isWellFormed()) throw new ArgumentsError('a member name holds a lone surrogate');
        stack.push(member);
      }
    }
  }
}

/**
 * Parses a call's arguments: a JSON object, as text ('' is {}). Strict, as
 * the mesh's gate is (docs/behaviour.md R20): throws ArgumentsError for anything that
 * is not an I-JSON object (invalid JSON, not an object, duplicate member
 * names, numbers a double cannot hold, lone surrogates, nesting too deep).
 */
function parseArguments(text) {
  if (!text || !text.trim()) return {};
  let value;
  try {
    value = JSON.parse(text);
  } catch (err) {
    if (err instanceof RangeError) throw new ArgumentsError('nested too deep');
    throw new ArgumentsError(`not JSON: ${String(err.message).slice(0, 120)}`);
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    throw new ArgumentsError(`a JSON ${Array.isArray(value) ? 'array' : typeof value}, not an object`);
  }
  const duplicate = duplicateMember(text);
  if (duplicate !== null) {
    throw new ArgumentsError(`duplicate member name ${JSON.stringify(duplicate.slice(0, 64))}`);
  }
  checkValues(value);
  return value;
}

/**
 * The part of a batch this guard is asked to judge (a `GuardBatch`).
 * `signal` aborts when the mesh cancels the request or the stream ends.
 */
class Batch {
  constructor(request, guardName) {
    this.raw = request;
    /** @type {string} uint64, as decimal text */ this.requestId = request.request_id;
    this.batchId = request.batch_id;
    /** The name the guard is registered under (the kit's name if unset). */
    this.guard = request.guard || guardName;
    /** The turn's context: {session_id, turn_index, model_text, metadata}. */
    this.context = request.context || { session_id: '', turn_index: 0, model_text: '', metadata: {} };
    const calls = (request.calls || []).map((c) => new Call(c));
    /** The calls to judge: those whose arguments the kit could read. */
    this.calls = calls.filter((c) => c.error === null);
    /**
     * Calls whose arguments are not an I-JSON object; the kit skips them
     * (steer), never lets them proceed, and the judge does not see them.
     */
    this.unreadable = calls.filter((c) => c.error !== null);
    /**
     * For a batch of results (R33): the results to judge, each
     * {callId, tool, server, result (CallToolResult JSON text), json (parsed)};
     * `calls` is then empty. Sent only to guards that registered the results
     * phase (`phases: 'results'` or `'both'`).
     */
    this.results = (request.results || []).map((r) => new Result(r));
    /**
     * The session's memory as it was when the batch arrived (R34; wire
     * field names: labels, counts, recent, calls_total, results_total,
     * evicted, truncated, unavailable), or null: it is sent only to a guard
     * registered as reading it (`sessionMemory: 'read'`, which
     * `server.register()` sends for a judge of two parameters).
     */
    this.session = request.session || null;
    this.deadlineMs = request.deadline_ms;
    this.traceparent = request.traceparent;
    this.tracestate = request.tracestate;
    this.receivedAt = Date.now();
    this._controller = new AbortController();
    /** @type {AbortSignal} */ this.signal = this._controller.signal;
  }

  get sessionId() { return this.context.session_id; }

  get turnIndex() { return this.context.turn_index; }

  get modelText() { return this.context.model_text; }

  get metadata() { return this.context.metadata || {}; }

  /** The answer's deadline (epoch ms), or null when none was given. */
  get deadline() { return this.deadlineMs ? this.receivedAt + this.deadlineMs : null; }

  /** True once the mesh cancelled this request (or the stream ended). */
  get cancelled() { return this.signal.aborted; }

  /** Resolves after `ms` milliseconds: true, or false early on cancellation. */
  sleep(ms) {
    if (this.cancelled) return Promise.resolve(false);
    return new Promise((resolve) => {
      const onAbort = () => { clearTimeout(timer); resolve(false); };
      const timer = setTimeout(() => { this.signal.removeEventListener('abort', onAbort); resolve(true); }, ms);
      this.signal.addEventListener('abort', onAbort, { once: true });
    });
  }

  /** The call with this id, or undefined. */
  call(callId) { return this.calls.find((c) => c.callId === callId); }

  /** 'results' for a batch of results (R33), else 'calls'. */
  get phase() { return this.results.length ? 'results' : 'calls'; }

  /** The result with this id, or undefined. */
  result(callId) { return this.results.find((r) => r.callId === callId); }

  _cancel() { this._controller.abort(); }
}

/** The result of a call that ran (R33). */
class Result {
  constructor(result) {
    this.callId = result.call_id;
    this.tool = result.tool;
    /** The server or namespace the tool belongs to ('' when unknown). */
    this.server = result.server || '';
    /** The MCP CallToolResult as JSON text. */
    this.result = result.result;
  }

  /** The result, parsed. */
  get json() { return JSON.parse(this.result); }

  /** The text of its `text` content blocks, joined by newlines. */
  get text() {
    const blocks = (this.json && this.json.content) || [];
    return blocks.filter((b) => b && b.type === 'text').map((b) => b.text || '').join('\n');
  }
}

// ---------------------------------------------------------------------------
// Verdict helpers
// ---------------------------------------------------------------------------

function skip(callId, content, kind) {
  if (typeof content !== 'string' || !content.trim()) {
    throw new TypeError(`skip of call ${JSON.stringify(callId)} needs non-blank content (R8)`);
  }
  return { call_id: callId, skip: { content, kind } };
}

/** Skip the call as an error the model should fix and retry (R7). */
function steer(callId, content) { return skip(callId, content, 'SKIP_KIND_STEER'); }

/** Skip the call with a benign "not allowed" result; the model moves on. */
function cancel(callId, content) { return skip(callId, content, 'SKIP_KIND_CANCEL'); }

/**
 * Run the call changed (mutate guards, within their grant: R11).
 * `args` replaces the arguments whole: an object (serialized as JSON) or JSON
 * object text; `tool` renames the call (needs may_rename). null/undefined
 * leaves that part as it was.
 */
function rewrite(callId, args = null, tool = null) {
  const change = {};
  if (args !== null && args !== undefined) {
    if (typeof args === 'string') {
      try {
        parseArguments(args);
      } catch (err) {
        throw new TypeError(`rewrite of call ${JSON.stringify(callId)}: arguments must be a JSON object: ${err.message}`);
      }
      change.arguments = args;
    } else if (typeof args === 'object' && !Array.isArray(args)) {
      change.arguments = JSON.stringify(args);
    } else {
      throw new TypeError(`rewrite of call ${JSON.stringify(callId)}: arguments must be an object`);
    }
  }
  if (tool !== null && tool !== undefined) {
    if (!tool) throw new TypeError(`rewrite of call ${JSON.stringify(callId)}: tool name must not be empty`);
    change.tool = tool;
  }
  return { call_id: callId, rewrite: change };
}

/** An explicit "run it": the same as sending no verdict for the call. */
function proceed(callId) { return { call_id: callId }; }

/**
 * Ask a person first (R35): the call does not run now. The mesh makes an
 * approval request carrying `reason` for the approver; the call runs only
 * when the same call comes back with that request approved (and the guards
 * after this one let it). The model reads `content` meanwhile (empty: the
 * mesh's own text saying the call waits for an approval).
 */
function ask(callId, reason, content = '') {
  if (typeof reason !== 'string') {
    throw new TypeError(`ask of call ${JSON.stringify(callId)}: reason must be a string`);
  }
  if (typeof content !== 'string') {
    throw new TypeError(`ask of call ${JSON.stringify(callId)}: content must be a string`);
  }
  return { call_id: callId, ask: { reason, content } };
}

/**
 * Block a result (R33): the model reads `content` as an error result instead
 * of what the tool returned.
 */
function blockResult(callId, content) { return skip(callId, content, 'SKIP_KIND_STEER'); }

/**
 * Replace a result (R33; mutate guards, within their result grant): `result`
 * is the whole new MCP CallToolResult (an object with a `content` array, or
 * its JSON text), carried in `Rewrite.arguments`.
 */
function rewriteResult(callId, result) {
  let parsed = result;
  if (typeof result === 'string') {
    try {
      parsed = parseArguments(result);
    } catch (err) {
      throw new TypeError(`rewrite of result ${JSON.stringify(callId)}: not a JSON object: ${err.message}`);
    }
  }
  if (!parsed || typeof parsed !== 'object' || !Array.isArray(parsed.content)) {
    throw new TypeError(`rewrite of result ${JSON.stringify(callId)}: a CallToolResult needs a \`content\` array`);
  }
  const text = typeof result === 'string' ? result : JSON.stringify(result);
  return { call_id: callId, rewrite: { arguments: text } };
}

/** The verdicts of a judge's result that the protocol allows (R8). */
function conforming(batch, result) {
  if (result === null || result === undefined) return [];
  const items = typeof result[Symbol.iterator] === 'function' ? [...result] : [result];
  const sent = new Set([...batch.calls.map((c) => c.callId), ...batch.results.map((r) => r.callId)]);
  const seen = new Set();
  const verdicts = [];
  const where = `batch ${JSON.stringify(batch.batchId)} (request ${batch.requestId})`;
  for (const verdict of items) {
    if (!verdict || typeof verdict !== 'object' || typeof verdict.call_id !== 'string') {
      throw new TypeError(`judge produced ${JSON.stringify(verdict)}, expected a verdict `
        + '(build verdicts with steer, cancel, rewrite, ask or proceed)');
    }
    if (!sent.has(verdict.call_id)) {
      log.warn(`${where}: dropping a verdict for call ${JSON.stringify(verdict.call_id)}, which was not sent`);
    } else if (seen.has(verdict.call_id)) {
      log.warn(`${where}: dropping a second verdict for call ${JSON.stringify(verdict.call_id)}`);
    } else if (verdict.skip && !(verdict.skip.content || '').trim()) {
      log.warn(`${where}: dropping a skip with blank content for call ${JSON.stringify(verdict.call_id)}`);
    } else {
      seen.add(verdict.call_id);
      verdicts.push(verdict);
    }
  }
  return verdicts;
}

// ---------------------------------------------------------------------------
// Tracing (R22)
// ---------------------------------------------------------------------------

const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/** The context a batch's span starts in: its W3C trace context, if any. */
function parentContext(batch) {
  const root = otel.ROOT_CONTEXT;
  if (!batch.traceparent) return root;
  const carrier = { traceparent: batch.traceparent };
  if (batch.tracestate) carrier.tracestate = batch.tracestate;
  // The registered propagator (an SDK registers W3C trace context) first...
  const extracted = otel.propagation.extract(root, carrier);
  if (otel.trace.getSpanContext(extracted)) return extracted;
  // ...else, with no SDK, read the W3C header ourselves.
  const m = TRACEPARENT.exec(batch.traceparent.trim());
  if (!m || m[1] === 'ff') return root;
  const spanContext = {
    traceId: m[2], spanId: m[3], traceFlags: parseInt(m[4], 16) & 1, isRemote: true,
  };
  if (!otel.isSpanContextValid(spanContext)) return root;
  if (batch.tracestate) spanContext.traceState = otel.createTraceState(batch.tracestate);
  return otel.trace.setSpanContext(root, spanContext);
}

/** Runs the judge function on a batch inside a `guard.judge` span. */
async function judgeTraced(judgeFn, batch) {
  if (!otel) return conforming(batch, await judgeFn(batch));
  const parent = parentContext(batch);
  const span = otel.trace.getTracer('guardmesh.guard').startSpan('guard.judge', {
    kind: otel.SpanKind.SERVER,
    attributes: {
      'guardmesh.guard': batch.guard,
      'guardmesh.batch_id': batch.batchId,
      'guardmesh.request_id': batch.requestId,
      'guardmesh.calls': batch.calls.length,
      'guardmesh.call_ids': batch.calls.map((c) => c.callId),
    },
  }, parent);
  try {
    const result = await otel.context.with(otel.trace.setSpan(parent, span), () => judgeFn(batch));
    const verdicts = conforming(batch, result);
    span.setAttribute('guardmesh.skipped', verdicts.filter((v) => v.skip).length);
    span.setAttribute('guardmesh.rewritten', verdicts.filter((v) => v.rewrite).length);
    span.setAttribute('guardmesh.asked', verdicts.filter((v) => v.ask).length);
    span.setAttribute('guardmesh.cancelled', batch.cancelled);
    return verdicts;
  } catch (err) {
    span.recordException(err);
    span.setStatus({ code: otel.SpanStatusCode.ERROR, message: String(err && err.message) });
    throw err;
  } finally {
    span.end();
  }
}

/**
 * Registers a global tracer provider that appends each finished span to
 * `file` as one JSON line: {name, trace_id, span_id, parent_span_id,
 * attributes, ...}. A minimal stand-in for an SDK, for tests that check trace
 * ids without an OTLP receiver. Returns the provider.
 */
function installFileTracing(file, serviceName = 'guardmesh-guard') {
  if (!otel) throw new Error('--otlp-file needs @opentelemetry/api');
  const { performance } = require('node:perf_hooks');
  // Epoch nanoseconds as decimal text (as OTLP/JSON writes uint64s).
  const hrNanos = () => (BigInt(Math.round(performance.timeOrigin * 1000))
    * 1000n + BigInt(Math.round(performance.now() * 1e6))).toString();

  class FileSpan {
    constructor(name, options, parentSpanContext) {
      this.name = name;
      this.kind = options.kind ?? otel.SpanKind.INTERNAL;
      this.attributes = { ...(options.attributes || {}) };
      this.events = [];
      this.status = { code: otel.SpanStatusCode.UNSET };
      this.parentSpanId = parentSpanContext ? parentSpanContext.spanId : null;
      this.context = {
        traceId: parentSpanContext ? parentSpanContext.traceId : crypto.randomBytes(16).toString('hex'),
        spanId: crypto.randomBytes(8).toString('hex'),
        traceFlags: otel.TraceFlags.SAMPLED,
        traceState: parentSpanContext ? parentSpanContext.traceState : undefined,
      };
      this.start = hrNanos();
      this.ended = false;
    }

    spanContext() { return this.context; }

    setAttribute(key, value) { this.attributes[key] = value; return this; }

    setAttributes(attributes) { Object.assign(this.attributes, attributes); return this; }

    addEvent(name, attributes) { this.events.push({ name, attributes }); return this; }

    addLink() { return this; }

    addLinks() { return this; }

    setStatus(status) { this.status = status; return this; }

    updateName(name) { this.name = name; return this; }

    isRecording() { return !this.ended; }

    recordException(err) {
      return this.addEvent('exception', { 'exception.message': String(err && err.message) });
    }

    end() {
      if (this.ended) return;
      this.ended = true;
      fs.appendFileSync(file, `${JSON.stringify({
        name: this.name,
        trace_id: this.context.traceId,
        span_id: this.context.spanId,
        parent_span_id: this.parentSpanId,
        kind: otel.SpanKind[this.kind],
        service: serviceName,
        start_time_unix_nano: this.start,
        end_time_unix_nano: hrNanos(),
        status: otel.SpanStatusCode[this.status.code],
        attributes: this.attributes,
      })}\n`);
    }
  }

  const tracer = {
    startSpan(name, options = {}, ctx = otel.context.active()) {
      const parent = options.root ? undefined : otel.trace.getSpanContext(ctx);
      return new FileSpan(name, options, parent && otel.isSpanContextValid(parent) ? parent : undefined);
    },
    startActiveSpan(name, ...rest) {
      const fn = rest.pop();
      const [options = {}, ctx = otel.context.active()] = rest;
      const span = this.startSpan(name, options, ctx);
      return otel.context.with(otel.trace.setSpan(ctx, span), fn, undefined, span);
    },
  };
  const provider = { getTracer: () => tracer };
  otel.trace.setGlobalTracerProvider(provider);
  return provider;
}

// ---------------------------------------------------------------------------
// The Judge stream
// ---------------------------------------------------------------------------

/**
 * Serves one Judge stream. A request stays in `pending` from its arrival
 * until its answer is written or it is cancelled: that is what makes every
 * request answered exactly once and a cancelled one never.
 */
function judgeStream(call, judgeFn, guardName, streams, draining) {
  // grpc-js would otherwise hold the headers back until the first answer.
  call.sendMetadata(new grpc.Metadata());
  const pending = new Map(); // request id -> Batch
  let reading = true;
  let ended = false;

  const stream = {
    /** Ends the stream (OK) once it is idle and read out, or draining. */
    maybeEnd() {
      if (!ended && pending.size === 0 && (!reading || draining.value)) {
        ended = true;
        call.end();
      }
    },
  };
  streams.add(stream);

  const finish = () => {
    for (const batch of pending.values()) batch._cancel();
    pending.clear();
    ended = true;
    streams.delete(stream);
  };

  /** Sends the one answer of a request, unless it was cancelled meanwhile. */
  const answer = (batch, response) => {
    if (pending.get(batch.requestId) !== batch) {
      log.debug(`request ${batch.requestId} was cancelled; its answer is dropped`);
      return;
    }
    pending.delete(batch.requestId);
    if (!ended) call.write({ request_id: batch.requestId, partial: false, ...response });
    stream.maybeEnd();
  };

  const start = (request) => {
    const batch = new Batch(request, guardName);
    if (pending.has(batch.requestId)) {
      log.warn(`ignoring request ${batch.requestId}: already outstanding on this stream`);
      return;
    }
    pending.set(batch.requestId, batch);
    // Arguments the kit cannot read are a reason to skip, never to proceed.
    const skipped = batch.unreadable.map((c) => {
      log.warn(`batch ${JSON.stringify(batch.batchId)}: skipping call ${JSON.stringify(c.callId)}, `
        + `its arguments cannot be read: ${c.error}`);
      return steer(c.callId, `The arguments of call ${JSON.stringify(c.callId)} cannot be read as a `
        + `JSON object (${c.error}); guard ${JSON.stringify(batch.guard)} did not judge them. `
        + 'Send them as a plain JSON object.');
    });
    const judged = batch.calls.length || batch.results.length
      ? judgeTraced(judgeFn, batch) : Promise.resolve([]);
    judged.then(
      (verdicts) => answer(batch, { verdicts: [...skipped, ...verdicts] }),
      (err) => {
        log.error(`judge failed on batch ${JSON.stringify(batch.batchId)} (request ${batch.requestId}):`, err);
        // Fails this request alone (R13); the stream stays up.
        const message = err instanceof Error ? `${err.name}: ${err.message}` : String(err);
        answer(batch, { verdicts: [], error: message });
      },
    );
  };

  const cancelRequest = (requestId) => {
    const batch = pending.get(requestId);
    if (!batch) {
      log.debug(`cancel of request ${requestId}, which is not outstanding`);
      return;
    }
    pending.delete(requestId);
    batch._cancel();
    log.debug(`request ${requestId} (batch ${JSON.stringify(batch.batchId)}) cancelled`);
    stream.maybeEnd();
  };

  call.on('data', (request) => {
    if (request.kind === 'batch') start(request.batch);
    else if (request.kind === 'cancel') cancelRequest(request.cancel.request_id);
    else log.warn('ignoring a JudgeRequest with neither batch nor cancel');
  });
  call.on('end', () => { reading = false; stream.maybeEnd(); });
  call.on('cancelled', finish);
  call.on('close', finish);
}

// ---------------------------------------------------------------------------
// Health (grpc.health.v1), from the grpc-health-check package
// ---------------------------------------------------------------------------

/** grpc.health.v1.Health with settable statuses, and a graceful stop. */
class Health {
  constructor() {
    this.impl = new HealthImplementation({});
    this.services = new Set();
  }

  set(service, status) {
    this.services.add(service);
    this.impl.setStatus(service, status);
  }

  /** Reports NOT_SERVING for every service, for a graceful stop. */
  shutdown() {
    for (const service of this.services) this.impl.setStatus(service, 'NOT_SERVING');
  }

  addToServer(server) {
    this.impl.addToServer(server);
  }
}

// ---------------------------------------------------------------------------
// Serving and registering
// ---------------------------------------------------------------------------

/** Throws when `options` has a key outside `known` (a typo would otherwise be ignored). */
function refuseUnknown(what, options, known) {
  if (options === null || typeof options !== 'object') {
    throw new TypeError(`${what}: options must be an object`);
  }
  const unknown = Object.keys(options).filter((key) => !known.includes(key));
  if (unknown.length) {
    throw new TypeError(`${what}: unknown option${unknown.length > 1 ? 's' : ''} `
      + `${unknown.map((k) => JSON.stringify(k)).join(', ')} (known: ${known.join(', ')})`);
  }
}

function readFile(file, what) {
  try {
    return fs.readFileSync(file);
  } catch (err) {
    throw new Error(`cannot read the ${what} ${file}: ${err.code || err.message}`);
  }
}

const SERVE_OPTIONS = ['port', 'host', 'name', 'tls'];
const SERVER_TLS_OPTIONS = ['certFile', 'keyFile', 'clientCaFile'];

/** Server credentials: insecure, or TLS ({certFile, keyFile, clientCaFile}). */
function serverCredentials(tls) {
  if (!tls) return grpc.ServerCredentials.createInsecure();
  refuseUnknown('serve tls', tls, SERVER_TLS_OPTIONS);
  if (!tls.certFile || !tls.keyFile) throw new TypeError('serve tls: certFile and keyFile are required');
  const ca = tls.clientCaFile ? readFile(tls.clientCaFile, 'client CA file') : null;
  return grpc.ServerCredentials.createSsl(
    ca,
    [{ cert_chain: readFile(tls.certFile, 'certificate file'), private_key: readFile(tls.keyFile, 'key file') }],
    ca !== null,
  );
}

/**
 * Starts serving `judgeFn` as a GuardService, with grpc.health.v1 (overall and
 * GuardService SERVING). Options: `port` (0 picks one), `host`, `name`, and
 * `tls` ({certFile, keyFile, clientCaFile}: serve TLS, mTLS with a client CA).
 * Unknown options are refused. Resolves to {server, port, sessionMemory}:
 * `sessionMemory` is 'read' when `judgeFn` takes two parameters (it is then
 * called as `judgeFn(batch, session)`), else 'none' (R34).
 * `server.register(meshAddr, name, options)` registers it at the port (and
 * host, and TLS) it serves on with that `sessionMemory`, as `register` does;
 * `server.stop(graceMs)` stops gracefully (NOT_SERVING, each stream ends
 * once its outstanding requests are answered, the rest is cancelled after
 * `graceMs`).
 */
async function serve(judgeFn, options = {}) {
  refuseUnknown('serve', options, SERVE_OPTIONS);
  if (typeof judgeFn !== 'function') throw new TypeError('serve: judgeFn must be a function');
  const { port = 0, host = '127.0.0.1', name = '', tls = null } = options;
  // A judge of two parameters reads the session's memory (R34).
  const sessionMemory = judgeFn.length >= 2 ? 'read' : 'none';
  const judge = sessionMemory === 'read' ? (batch) => judgeFn(batch, batch.session) : judgeFn;
  const credentials = serverCredentials(tls);
  const grpcServer = new grpc.Server();
  const streams = new Set();
  const draining = { value: false };
  const health = new Health();
  grpcServer.addService(pb.GuardService.service, {
    Judge: (call) => {
      if (draining.value) call.emit('error', { code: grpc.status.UNAVAILABLE, details: 'the guard is stopping' });
      else judgeStream(call, judge, name, streams, draining);
    },
  });
  health.addToServer(grpcServer);
  const address = host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`;
  const bound = await new Promise((resolve, reject) => {
    grpcServer.bindAsync(address, credentials,
      (err, p) => (err ? reject(err) : resolve(p)));
  });
  health.set('', 'SERVING');
  health.set(GUARD_SERVICE, 'SERVING');
  log.info(`guard ${JSON.stringify(name)} serving on ${host}:${bound}`);

  const server = {
    grpcServer,
    port: bound,
    name,
    /** 'read' when the judge reads the session's memory, else 'none' (R34). */
    sessionMemory,
    /**
     * Registers this guard as `register` does, at the port (and host, and
     * TLS) it serves on, with `sessionMemory` unless `options` says it.
     */
    register(meshAddr, guardName, registerOptions = {}) {
      return register(meshAddr, guardName, bound,
        { host, https: tls !== null, sessionMemory, ...registerOptions });
    },
    /** Stops gracefully; resolves once stopped. */
    stop(graceMs = 5000) {
      health.shutdown();
      draining.value = true;
      for (const stream of [...streams]) stream.maybeEnd();
      return new Promise((resolve) => {
        const timer = setTimeout(() => { grpcServer.forceShutdown(); resolve(); }, graceMs);
        grpcServer.tryShutdown(() => { clearTimeout(timer); resolve(); });
      });
    },
  };
  return { server, port: bound, sessionMemory };
}

const ENUMS = {
  role: ['GUARD_ROLE_', ['validate', 'mutate']],
  failurePolicy: ['FAILURE_POLICY_', ['fail_closed', 'fail_open', 'abort']],
  mode: ['GUARD_MODE_', ['enforce', 'dry_run']],
  phases: ['GUARD_PHASES_', ['calls', 'results', 'both']],
  sessionMemory: ['SESSION_MEMORY_USE_', ['none', 'read']],
};

function enumName(kind, value) {
  const [prefix, names] = ENUMS[kind];
  let key = String(value).trim().toLowerCase().replace(/-/g, '_');
  if (key.startsWith(prefix.toLowerCase())) key = key.slice(prefix.length);
  if (!names.includes(key)) {
    throw new TypeError(`unknown ${kind} ${JSON.stringify(value)}: expected one of ${names.join(', ')}`);
  }
  return prefix + key.toUpperCase();
}

function list(value) {
  if (value === null || value === undefined) return [];
  if (Array.isArray(value)) return value;
  return String(value).split(',').map((s) => s.trim()).filter(Boolean);
}

function channelTarget(address) {
  return address.replace(/^(https?|grpc):\/\//, '').replace(/\/+$/, '');
}

/** Options that say how to reach the mesh (R24: every call carries them). */
const CREDENTIAL_OPTIONS = ['caFile', 'certFile', 'keyFile', 'token', 'tokenFile', 'tlsDomain'];

/**
 * How the kit reaches the mesh's GuardRegistry: `caFile` (TLS: the CA of the
 * mesh's certificate), `certFile`/`keyFile` (this guard's client certificate,
 * for mTLS), `token` or `tokenFile` (a bearer token; default: the
 * GUARDMESH_TOKEN variable), `tlsDomain` (the name to verify the mesh's
 * certificate against). Returns {channel credentials, metadata, options}.
 */
function meshCredentials(meshAddr, {
  caFile = null, certFile = null, keyFile = null, token = null, tokenFile = null, tlsDomain = null,
} = {}) {
  if (!certFile !== !keyFile) throw new TypeError('a client certificate needs both certFile and keyFile');
  if (certFile && !caFile) throw new TypeError('a client certificate needs TLS: set caFile too');
  if (/^https:\/\//.test(meshAddr) && !caFile) {
    throw new TypeError(`${meshAddr} is https://: set caFile to the CA of the mesh's certificate`);
  }
  let bearer = token;
  if (tokenFile) {
    bearer = String(readFile(tokenFile, 'token file')).split(/\r?\n/)[0].trim();
    if (!bearer) throw new TypeError(`the token file ${tokenFile} is empty`);
  } else if (bearer === null && (process.env.GUARDMESH_TOKEN || '').trim()) {
    bearer = process.env.GUARDMESH_TOKEN.trim();
  }
  if (bearer !== null && (typeof bearer !== 'string' || !bearer.trim() || /[\r\n]/.test(bearer.trim()))) {
    throw new TypeError('the token must be one non-empty line');
  }
  const metadata = new grpc.Metadata();
  if (bearer !== null) metadata.set('authorization', `Bearer ${bearer.trim()}`);
  const channel = caFile
    ? grpc.credentials.createSsl(
      readFile(caFile, 'CA file'),
      keyFile ? readFile(keyFile, 'key file') : null,
      certFile ? readFile(certFile, 'certificate file') : null,
    )
    : grpc.credentials.createInsecure();
  const options = tlsDomain ? { 'grpc.ssl_target_name_override': tlsDomain } : {};
  return { channel, metadata, options };
}

function registryClient(meshAddr, credentials) {
  return new pb.GuardRegistry(channelTarget(meshAddr), credentials.channel, credentials.options);
}

function unary(client, method, request, timeoutMs, metadata) {
  const deadline = Date.now() + timeoutMs;
  return new Promise((resolve, reject) => {
    client.waitForReady(deadline, (readyErr) => {
      if (readyErr) { reject(readyErr); return; }
      client[method](request, metadata.clone(), { deadline },
        (err, response) => (err ? reject(err) : resolve(response)));
    });
  });
}

const REGISTER_OPTIONS = [
  'host', 'endpoint', 'role', 'tools', 'failurePolicy', 'timeoutMs', 'priority', 'mode',
  'grantTools', 'mayRename', 'waitMs', 'https', 'replicas', 'phases', 'resultGrantTools',
  'sessionMemory', ...CREDENTIAL_OPTIONS,
];

/** Picks the credential options out of `options`. */
function credentialOptions(options) {
  return Object.fromEntries(Object.entries(options).filter(([k]) => CREDENTIAL_OPTIONS.includes(k)));
}

/**
 * Registers (or updates) this guard with the mesh at `meshAddr`. The endpoint
 * is `endpoint` or `http://HOST:PORT` (`https://` with `https: true`;
 * 127.0.0.1 for a wildcard host). Enum options take short names ('mutate',
 * 'fail_open', 'dry_run'); list options an array or comma-separated text.
 * `replicas` lists more replicas of this guard (`http://host:port` each,
 * R32): the mesh spreads requests over the endpoint and these.
 * `sessionMemory: 'read'` asks for the session's memory with each batch
 * (R34); 'none' or unset (the default) asks for none. A served guard's
 * `server.register()` sets it from its judge (`serve` resolves to it too).
 * Waits up to `waitMs` for the mesh. The credential options (`caFile`,
 * `certFile`, `keyFile`, `token`, `tokenFile`, `tlsDomain`: see
 * meshCredentials) go on the call. Unknown options are refused. Resolves to
 * the RegisterResponse.
 */
async function register(meshAddr, name, port, options = {}) {
  refuseUnknown('register', options, REGISTER_OPTIONS);
  const {
    host = '127.0.0.1', role = 'validate', tools = [], failurePolicy = 'fail_closed',
    timeoutMs = 0, priority = 0, mode = 'enforce', grantTools = [], mayRename = false,
    waitMs = 10000, https = false, replicas = [], phases = 'calls', resultGrantTools = [],
    sessionMemory = null,
  } = options;
  let { endpoint = null } = options;
  const credentials = meshCredentials(meshAddr, credentialOptions(options));
  if (!endpoint) {
    const reach = ['', '0.0.0.0', '::', '[::]'].includes(host) ? '127.0.0.1' : host;
    const scheme = https ? 'https' : 'http';
    endpoint = reach.includes(':') ? `${scheme}://[${reach}]:${port}` : `${scheme}://${reach}:${port}`;
  }
  const guard = {
    name,
    endpoint,
    role: enumName('role', role),
    tools: list(tools),
    timeout_ms: timeoutMs,
    failure_policy: enumName('failurePolicy', failurePolicy),
    priority,
    mode: enumName('mode', mode),
    grant: { tools: list(grantTools), may_rename: mayRename },
    replicas: list(replicas),
    phases: enumName('phases', phases),
    result_grant: { tools: list(resultGrantTools) },
  };
  if (sessionMemory !== null && sessionMemory !== undefined) {
    guard.session_memory = enumName('sessionMemory', sessionMemory);
  }
  const client = registryClient(meshAddr, credentials);
  try {
    const response = await unary(client, 'Register', { guard }, waitMs, credentials.metadata);
    log.info(`registered guard ${JSON.stringify(name)} (${endpoint}) with ${meshAddr}: `
      + `revision ${response.revision}, position ${response.position}, `
      + `${response.created ? 'created' : 'updated'}`);
    return response;
  } finally {
    client.close();
  }
}

const POLICY_OPTIONS = ['tools', 'failurePolicy', 'priority', 'mode', 'waitMs', ...CREDENTIAL_OPTIONS];

/**
 * Registers (or updates) a policy guard (docs/behaviour.md R27) with the mesh at
 * `meshAddr`: `source` is the text of a policy file (CEL rules), sent whole
 * and judged inside the mesh; there is no process to run. Options: `tools`,
 * `failurePolicy`, `priority`, `mode`, `waitMs` and the credential options, as
 * for register; unknown ones are refused. A policy that does not compile is
 * refused with INVALID_ARGUMENT, the line and the reason in its details
 * (check it first with `guardmesh policy check FILE`). Resolves to the
 * RegisterResponse.
 */
async function registerPolicy(meshAddr, name, source, options = {}) {
  refuseUnknown('registerPolicy', options, POLICY_OPTIONS);
  if (typeof source !== 'string' || source.trim() === '') {
    throw new TypeError('registerPolicy: source must be the text of a policy file');
  }
  const {
    tools = [], failurePolicy = 'fail_closed', priority = 0, mode = 'enforce', waitMs = 10000,
  } = options;
  const credentials = meshCredentials(meshAddr, credentialOptions(options));
  const guard = {
    name,
    policy: source,
    role: enumName('role', 'validate'),
    tools: list(tools),
    failure_policy: enumName('failurePolicy', failurePolicy),
    priority,
    mode: enumName('mode', mode),
  };
  const client = registryClient(meshAddr, credentials);
  try {
    const response = await unary(client, 'Register', { guard }, waitMs, credentials.metadata);
    log.info(`registered policy guard ${JSON.stringify(name)} with ${meshAddr}: `
      + `revision ${response.revision}, position ${response.position}, `
      + `${response.created ? 'created' : 'updated'}`);
    return response;
  } finally {
    client.close();
  }
}

/**
 * Removes the guard `name` from the mesh's chain; resolves true if it was
 * there. `options`: `waitMs` (default 5000; a number is read as it) and the
 * credential options of register.
 */
async function deregister(meshAddr, name, options = {}) {
  const opts = typeof options === 'number' ? { waitMs: options } : options;
  refuseUnknown('deregister', opts, ['waitMs', ...CREDENTIAL_OPTIONS]);
  const { waitMs = 5000 } = opts;
  const credentials = meshCredentials(meshAddr, credentialOptions(opts));
  const client = registryClient(meshAddr, credentials);
  try {
    const response = await unary(client, 'Deregister', { name }, waitMs, credentials.metadata);
    log.info(`deregistered guard ${JSON.stringify(name)} from ${meshAddr} (removed: ${response.removed})`);
    return response.removed;
  } finally {
    client.close();
  }
}

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

/** The kit's flags, in `util.parseArgs` form. All values are strings or booleans. */
const KIT_OPTIONS = {
  host: { type: 'string', default: '127.0.0.1' },
  port: { type: 'string', default: '0' },
  mesh: { type: 'string' },
  name: { type: 'string', default: 'guard' },
  role: { type: 'string', default: 'validate' },
  tools: { type: 'string', default: '' },
  'failure-policy': { type: 'string', default: 'fail_closed' },
  'timeout-ms': { type: 'string', default: '0' },
  priority: { type: 'string', default: '0' },
  'dry-run': { type: 'boolean', default: false },
  'grant-tools': { type: 'string', default: '' },
  'may-rename': { type: 'boolean', default: false },
  phases: { type: 'string', default: 'calls' },
  'result-grant-tools': { type: 'string', default: '' },
  endpoint: { type: 'string' },
  'mesh-ca-file': { type: 'string' },
  'mesh-cert-file': { type: 'string' },
  'mesh-key-file': { type: 'string' },
  'mesh-token-file': { type: 'string' },
  'mesh-tls-domain': { type: 'string' },
  'tls-cert-file': { type: 'string' },
  'tls-key-file': { type: 'string' },
  'tls-client-ca-file': { type: 'string' },
  'deregister-on-exit': { type: 'boolean', default: false },
  'otlp-file': { type: 'string' },
  'log-level': { type: 'string', default: 'info' },
  help: { type: 'boolean', short: 'h', default: false },
};

const KIT_HELP = `guard kit flags:
  --host ADDR             address to serve on (default 127.0.0.1)
  --port N                port to serve on; 0 picks one (default)
  --mesh ADDR             register with the mesh at ADDR (host:port) once serving
  --name NAME             registered guard name
  --role validate|mutate  (default validate)
  --tools LIST            comma-separated tools judged, names or globs (default: all)
  --failure-policy P      fail_closed (default), fail_open or abort
  --timeout-ms N          time to answer a batch; 0: the mesh's default
  --priority N            chain position: lower first (default 0)
  --dry-run               register in mode dry_run: consulted, never applied
  --grant-tools LIST      mutate guards: comma-separated tools it may rewrite
  --may-rename            mutate guards: may change a call's tool name
  --phases P              what it judges (R33): calls (default), results or both
  --result-grant-tools L  mutate guards judging results: tools whose results it may rewrite
  --endpoint URL          endpoint to register (default http://HOST:PORT)
  --mesh-ca-file PATH     TLS to the mesh: PEM of the CA that signed its certificate
  --mesh-cert-file PATH   this guard's PEM client certificate, for a mesh requiring mTLS
  --mesh-key-file PATH    the key of --mesh-cert-file
  --mesh-token-file PATH  file holding the bearer token sent to the mesh
                          (default: the GUARDMESH_TOKEN variable, if set)
  --mesh-tls-domain NAME  name to verify the mesh's certificate against
  --tls-cert-file PATH    serve TLS with this PEM certificate (registers https://)
  --tls-key-file PATH     the key of --tls-cert-file
  --tls-client-ca-file P  require the mesh to present a certificate from this CA
  --deregister-on-exit    deregister on SIGTERM/SIGINT (default: stay, R15)
  --otlp-file PATH        append each finished span to PATH as a JSON line
  --log-level LEVEL       stderr log level: debug, info (default), warn, error`;

function integer(flag, text) {
  if (!/^-?\d+$/.test(String(text).trim())) throw new TypeError(`--${flag}: not an integer: ${text}`);
  return Number.parseInt(text, 10);
}

/**
 * Parses the kit's flags plus a guard's own (`options`, in `util.parseArgs`
 * form, e.g. {'delay-ms': {type: 'string', default: '0'}}); `defaults`
 * overrides flag defaults by flag name (e.g. {name: 'my-guard'}). Prints
 * usage and exits on --help or a bad flag. Returns the flags with numbers
 * parsed and kebab-case names as given.
 */
function parseFlags(argv = process.argv.slice(2), settings = {}) {
  refuseUnknown('parseFlags', settings, ['options', 'defaults', 'usage']);
  const { options = {}, defaults = {}, usage = '' } = settings;
  const all = { ...KIT_OPTIONS, ...options };
  refuseUnknown('parseFlags defaults', defaults, Object.keys(all));
  for (const [flag, value] of Object.entries(defaults)) {
    all[flag] = { ...all[flag], default: value };
  }
  const help = () => `${usage ? `${usage}\n\n` : ''}${KIT_HELP}`;
  // util.parseArgs reads "--priority -3" as a missing value: join such pairs.
  const args = [];
  for (let i = 0; i < argv.length; i += 1) {
    const option = all[argv[i].startsWith('--') ? argv[i].slice(2) : ''];
    if (option && option.type === 'string' && /^-\d/.test(argv[i + 1] || '')) {
      args.push(`${argv[i]}=${argv[i + 1]}`);
      i += 1;
    } else {
      args.push(argv[i]);
    }
  }
  let values;
  try {
    ({ values } = parseArgs({ args, options: all, strict: true, allowPositionals: false }));
    if (values.help) {
      process.stdout.write(`${help()}\n`);
      process.exit(0);
    }
    for (const flag of ['port', 'timeout-ms', 'priority']) values[flag] = integer(flag, values[flag]);
    enumName('role', values.role);
    enumName('failurePolicy', values['failure-policy']);
    enumName('phases', values.phases);
    if (!(values['log-level'] in LEVELS)) throw new TypeError(`--log-level: unknown level ${values['log-level']}`);
  } catch (err) {
    process.stderr.write(`${err.message}\n\n${help()}\n`);
    process.exit(2);
  }
  return values;
}

/**
 * Serves `judgeFn` as the parsed flags say, until SIGTERM or SIGINT. Prints
 * exactly one line to stdout, `LISTENING <port>`, once serving (and
 * registered, with --mesh, asking for the session's memory when `judgeFn`
 * takes two parameters); logs go to stderr. Exits the process: 0 after a
 * graceful stop, 1 if serving or registration failed.
 */
async function run(judgeFn, flags) {
  log.name = flags.name;
  log.level = LEVELS[flags['log-level']];
  if (flags['otlp-file']) installFileTracing(flags['otlp-file'], flags.name);
  const credentials = {
    caFile: flags['mesh-ca-file'] ?? null,
    certFile: flags['mesh-cert-file'] ?? null,
    keyFile: flags['mesh-key-file'] ?? null,
    tokenFile: flags['mesh-token-file'] ?? null,
    tlsDomain: flags['mesh-tls-domain'] ?? null,
  };
  let tls = null;
  if (flags['tls-cert-file'] || flags['tls-key-file'] || flags['tls-client-ca-file']) {
    tls = {
      certFile: flags['tls-cert-file'],
      keyFile: flags['tls-key-file'],
      clientCaFile: flags['tls-client-ca-file'] ?? null,
    };
  }
  let server;
  try {
    ({ server } = await serve(judgeFn, {
      port: flags.port, host: flags.host, name: flags.name, tls,
    }));
    if (flags.mesh) {
      await server.register(flags.mesh, flags.name, {
        host: flags.host,
        endpoint: flags.endpoint,
        role: flags.role,
        tools: flags.tools,
        failurePolicy: flags['failure-policy'],
        timeoutMs: flags['timeout-ms'],
        priority: flags.priority,
        mode: flags['dry-run'] ? 'dry_run' : 'enforce',
        grantTools: flags['grant-tools'],
        mayRename: flags['may-rename'],
        phases: flags.phases,
        resultGrantTools: flags['result-grant-tools'],
        https: tls !== null,
        ...credentials,
      });
    }
  } catch (err) {
    log.error(flags.mesh ? `could not serve or register with the mesh at ${flags.mesh}:` : 'could not serve:', err);
    if (server) server.grpcServer.forceShutdown();
    process.exit(1);
  }
  process.stdout.write(`LISTENING ${server.port}\n`);

  let stopping = false;
  const stop = async () => {
    if (stopping) return;
    stopping = true;
    log.info('stopping');
    if (flags.mesh && flags['deregister-on-exit']) {
      await deregister(flags.mesh, flags.name, credentials).catch((err) => log.warn('could not deregister:', err));
    }
    await server.stop(5000);
    log.info('stopped');
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

/**
 * Parses the kit's flags (plus `options`, with `defaults`: see parseFlags),
 * then serves `judgeFn`: see run.
 */
function main(judgeFn, settings = {}) {
  refuseUnknown('main', settings, ['argv', 'options', 'defaults', 'usage']);
  const { argv, ...rest } = settings;
  return run(judgeFn, parseFlags(argv, rest));
}

module.exports = {
  ArgumentsError,
  Batch,
  Call,
  Result,
  ask,
  blockResult,
  cancel,
  deregister,
  installFileTracing,
  log,
  main,
  parseArguments,
  parseFlags,
  pb,
  proceed,
  register,
  registerPolicy,
  rewrite,
  rewriteResult,
  run,
  serve,
  steer,
};
