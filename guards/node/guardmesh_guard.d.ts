// Type declarations for guardmesh-guard, the Node kit for guardmesh guards.
// Hand-written; checked with `tsc --strict` on examples/no_delete.ts.
// Option names are camelCase; an unknown option is refused with a TypeError.

import type * as grpc from '@grpc/grpc-js';

/** Arguments that are not an I-JSON object (RFC 7493). */
export class ArgumentsError extends Error {}

/** A JSON value, as the kit parses call arguments. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** One tool call of a batch, as the mesh sent it. */
export class Call {
  readonly callId: string;
  readonly tool: string;
  /** The arguments as sent: a JSON object, as text ('' means {}). */
  readonly arguments: string;
  /** The arguments parsed; null when they cannot be read (see `error`). */
  readonly args: { [key: string]: Json } | null;
  /** Why the arguments cannot be read, or null. The judge never sees such calls. */
  readonly error: string | null;
}

/** The turn a batch belongs to (wire field names). */
export interface BatchContext {
  session_id: string;
  turn_index: number;
  model_text: string;
  metadata: { [key: string]: string };
}

/** A call that ran in a session (R34; wire field names). */
export interface SessionCall {
  /** The tool that ran (its final name). */
  tool: string;
  /** The server the tool belongs to. */
  server: string;
  /** Keyed digest of the call's final arguments, 32 hex digits; never the arguments. */
  args_digest: string;
  /** When it was judged to run, ms since the Unix epoch (uint64, as decimal text). */
  at_ms: string;
}

/**
 * A session's memory as a guard is sent it (R34; wire field names): what
 * earlier batches of the session did. Digests only, never a value.
 */
export interface SessionMemory {
  /** The session's labels (`secret:fs`), oldest first. */
  labels: string[];
  /** Calls remembered per tool. */
  counts: { [tool: string]: number };
  /** The most recent calls that ran, oldest first. */
  recent: SessionCall[];
  /** Calls recorded since the session began (uint64, as decimal text). */
  calls_total: string;
  /** Results recorded since the session began (uint64, as decimal text). */
  results_total: string;
  /** The session's bounds dropped entries: a strict guard may treat it as tainted. */
  evicted: boolean;
  /** This message left out calls or labels to stay within its bounds. */
  truncated: boolean;
  /**
   * Set (to the reason), alone, when the memory could not be read: the
   * session is unknown, never empty.
   */
  unavailable: string;
}

/** The result of a call that ran (R33). */
export class Result {
  readonly callId: string;
  readonly tool: string;
  /** The server or namespace the tool belongs to ('' when unknown). */
  readonly server: string;
  /** The MCP CallToolResult as JSON text. */
  readonly result: string;
  /** The result, parsed. */
  readonly json: { [key: string]: Json };
  /** The text of its `text` content blocks, joined by newlines. */
  readonly text: string;
}

/** The part of a batch this guard is asked to judge. */
export class Batch {
  readonly raw: unknown;
  /** uint64, as decimal text. */
  readonly requestId: string;
  readonly batchId: string;
  readonly guard: string;
  readonly context: BatchContext;
  /** The calls to judge: those whose arguments the kit could read. */
  readonly calls: Call[];
  /** Calls whose arguments cannot be read; the kit steers them. */
  readonly unreadable: Call[];
  /** For a batch of results (R33): the results to judge (`calls` is then empty). */
  readonly results: Result[];
  /**
   * The session's memory when the batch arrived (R34), or null: sent only
   * to a guard registered as reading it (`sessionMemory: 'read'`).
   */
  readonly session: SessionMemory | null;
  /** 'results' for a batch of results, else 'calls'. */
  readonly phase: 'calls' | 'results';
  readonly deadlineMs: number;
  readonly traceparent: string;
  readonly tracestate: string;
  readonly receivedAt: number;
  /** Aborts when the mesh cancels the request or the stream ends. */
  readonly signal: AbortSignal;
  readonly sessionId: string;
  readonly turnIndex: number;
  readonly modelText: string;
  readonly metadata: { [key: string]: string };
  /** The answer's deadline (epoch ms), or null. */
  readonly deadline: number | null;
  readonly cancelled: boolean;
  /** Resolves after `ms`: true, or false early on cancellation. */
  sleep(ms: number): Promise<boolean>;
  call(callId: string): Call | undefined;
  result(callId: string): Result | undefined;
}

/** A verdict on one call (wire shape); build it with steer, cancel, rewrite, ask, proceed. */
export interface Verdict {
  call_id: string;
  skip?: { content: string; kind: 'SKIP_KIND_STEER' | 'SKIP_KIND_CANCEL' };
  rewrite?: { tool?: string; arguments?: string };
  /** R35: ask a person first; `reason` is for the approver, `content` for the model meanwhile. */
  ask?: { reason: string; content: string };
}

/** What a judge returns: verdicts (any iterable), one verdict, or nothing (all proceed). */
export type Verdicts = Iterable<Verdict> | Verdict | null | undefined | void;

/**
 * A judge function: may be async. One of two parameters reads the session's
 * memory (R34): it is registered asking for it (`server.register`, `main`)
 * and called with it (null when the batch carries none). A parameter with a
 * default does not count (the function's `length`).
 */
export type JudgeFn = (batch: Batch, session: SessionMemory | null) => Verdicts | Promise<Verdicts>;

/** Skip the call as an error the model should fix and retry (R7). */
export function steer(callId: string, content: string): Verdict;
/** Skip the call with a benign "not allowed" result. */
export function cancel(callId: string, content: string): Verdict;
/** Run the call changed (mutate guards, within their grant). */
export function rewrite(callId: string, args?: { [key: string]: Json } | string | null, tool?: string | null): Verdict;
/** An explicit "run it". */
export function proceed(callId: string): Verdict;
/**
 * Ask a person first (R35): the call runs only once the same call comes back
 * with its approval request approved. `content` is what the model reads
 * meanwhile (empty: the mesh's own text).
 */
export function ask(callId: string, reason: string, content?: string): Verdict;
/** Block a result (R33): the model reads `content` as an error result. */
export function blockResult(callId: string, content: string): Verdict;
/** Replace a result (R33; mutate guards within their result grant): a whole CallToolResult. */
export function rewriteResult(callId: string, result: { [key: string]: Json } | string): Verdict;

/** Parses call arguments strictly (R20); throws ArgumentsError. */
export function parseArguments(text: string): { [key: string]: Json };

/** TLS for the guard's own listener. */
export interface ServerTlsOptions {
  certFile: string;
  keyFile: string;
  /** Require the mesh to present a certificate from this CA (mTLS). */
  clientCaFile?: string;
}

export interface ServeOptions {
  /** 0 (default) picks a free port. */
  port?: number;
  host?: string;
  name?: string;
  tls?: ServerTlsOptions | null;
}

export interface GuardServer {
  readonly grpcServer: grpc.Server;
  readonly port: number;
  readonly name: string;
  /** 'read' when the judge takes two parameters (it reads session memory), else 'none'. */
  readonly sessionMemory: SessionMemoryUse;
  /**
   * Registers this guard as `register` does, at the port (and host, and
   * TLS) it serves on, with its `sessionMemory` unless `options` says it.
   */
  register(meshAddr: string, name: string, options?: RegisterOptions): Promise<RegisterResponse>;
  /** Stops gracefully; resolves once stopped. */
  stop(graceMs?: number): Promise<void>;
}

/** Starts serving `judgeFn` as a GuardService, with grpc.health.v1. */
export function serve(judgeFn: JudgeFn, options?: ServeOptions): Promise<{
  server: GuardServer;
  port: number;
  /** As `server.sessionMemory`. */
  sessionMemory: SessionMemoryUse;
}>;

/** How the kit reaches the mesh (R24: every call carries them). */
export interface CredentialOptions {
  /** TLS: the CA of the mesh's certificate. */
  caFile?: string | null;
  /** This guard's client certificate and key, for mTLS. */
  certFile?: string | null;
  keyFile?: string | null;
  /** A bearer token (default: the GUARDMESH_TOKEN variable). */
  token?: string | null;
  tokenFile?: string | null;
  /** The name to verify the mesh's certificate against. */
  tlsDomain?: string | null;
}

export type Role = 'validate' | 'mutate';
export type FailurePolicy = 'fail_closed' | 'fail_open' | 'abort';
export type Mode = 'enforce' | 'dry_run';
export type Phases = 'calls' | 'results' | 'both';
/** Whether a guard reads the session's memory (R34). */
export type SessionMemoryUse = 'read' | 'none';

export interface RegisterOptions extends CredentialOptions {
  host?: string;
  /** Default http://HOST:PORT (https:// with `https: true`). */
  endpoint?: string | null;
  role?: Role;
  /** Names or globs; an array or comma-separated text. Default: all tools. */
  tools?: string[] | string;
  failurePolicy?: FailurePolicy;
  timeoutMs?: number;
  priority?: number;
  mode?: Mode;
  grantTools?: string[] | string;
  mayRename?: boolean;
  /** What the guard judges (R33): calls (default), results or both. */
  phases?: Phases;
  /** Mutate guards judging results: the tools whose results it may rewrite. */
  resultGrantTools?: string[] | string;
  /** How long to wait for the mesh (default 10000). */
  waitMs?: number;
  https?: boolean;
  /**
   * More replicas of this guard (`http://host:port` each; an array or
   * comma-separated text): the mesh spreads requests over the endpoint and
   * these (R32). Default: the endpoint alone.
   */
  replicas?: string[] | string;
  /**
   * 'read': the guard is sent the session's memory with each batch (R34);
   * 'none' or unset (the default): it is sent none. `server.register` sets
   * it from the judge.
   */
  sessionMemory?: SessionMemoryUse | null;
}

export interface RegisterResponse {
  revision: string;
  position: number;
  created: boolean;
}

/** Registers (or updates) this guard with the mesh at `meshAddr`. */
export function register(meshAddr: string, name: string, port: number, options?: RegisterOptions): Promise<RegisterResponse>;

export interface PolicyOptions extends CredentialOptions {
  /** Names or globs; an array or comma-separated text. Default: all tools. */
  tools?: string[] | string;
  failurePolicy?: FailurePolicy;
  priority?: number;
  mode?: Mode;
  /** How long to wait for the mesh (default 10000). */
  waitMs?: number;
}

/**
 * Registers (or updates) a policy guard (R27): `source` is the text of a
 * policy file (CEL rules), judged inside the mesh. A policy that does not
 * compile is refused with INVALID_ARGUMENT naming the line.
 */
export function registerPolicy(meshAddr: string, name: string, source: string, options?: PolicyOptions): Promise<RegisterResponse>;

export interface DeregisterOptions extends CredentialOptions {
  waitMs?: number;
}

/** Removes the guard `name` from the chain; resolves true if it was there. */
export function deregister(meshAddr: string, name: string, options?: DeregisterOptions | number): Promise<boolean>;

/** The kit's flags plus a guard's own, parsed (kebab-case names as given). */
export type Flags = { [flag: string]: string | number | boolean | undefined };

export interface FlagOptions {
  /** A guard's own flags, in util.parseArgs form. */
  options?: { [flag: string]: { type: 'string' | 'boolean'; default?: string | boolean; short?: string } };
  /** Flag defaults by flag name, e.g. { name: 'my-guard' }. */
  defaults?: { [flag: string]: string | boolean };
  usage?: string;
}

export function parseFlags(argv?: string[], settings?: FlagOptions): Flags;

/** Serves `judgeFn` as the flags say until SIGTERM/SIGINT; exits the process. */
export function run(judgeFn: JudgeFn, flags: Flags): Promise<void>;

/** Parses the flags, then serves: `node guard.js --port 0 --mesh 127.0.0.1:50051`. */
export function main(judgeFn: JudgeFn, settings?: FlagOptions & { argv?: string[] }): Promise<void>;

/** Writes each finished span to `file` as a JSON line (needs an OpenTelemetry SDK). */
export function installFileTracing(file: string, serviceName?: string): unknown;

/** The kit's stderr logger. */
export const log: {
  level: number;
  name: string;
  debug(...args: unknown[]): void;
  info(...args: unknown[]): void;
  warn(...args: unknown[]): void;
  error(...args: unknown[]): void;
};

/** The loaded guardmesh.v1 package (grpc-js service constructors). */
export const pb: grpc.GrpcObject;
