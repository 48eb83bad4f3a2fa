"""guardmesh guard kit for Python.

A *guard* is a gRPC service that judges an AI agent's tool calls before they
run. The mesh keeps one long-lived ``GuardService.Judge`` stream open to each
guard and sends it many batches on it, concurrently. This module hides that
stream: a guard author writes one function ::

    def judge(batch: Batch) -> Iterable[Verdict] | None

(``Verdict`` is exported here, as are :class:`Batch` and :class:`Call`)
and returns (or yields) a verdict for the calls it does not want to run as
they are. A call without a verdict proceeds. Verdicts are built with the
helpers :func:`steer`, :func:`cancel`, :func:`rewrite`, :func:`proceed` and
:func:`ask` (a person approves the call first, R35).

A judge that reads the session's memory (R34: what earlier batches of the
session did, as labels, counts and digests) says so by taking it as a
second parameter named ``session`` ::

    def judge(batch: Batch, session: SessionMemory | None) -> ...

Its server then says ``session_memory == "read"``, :meth:`GuardServer.register`
(and :func:`main`) registers it asking for the memory, and it is called with
the batch's memory. A judge of one parameter asks for none and is sent none.

A complete guard::

    from guardmesh import guard as gg

    def judge(batch):
        for call in batch.calls:
            if call.tool == "fs.delete":
                yield gg.cancel(call.call_id, "Deleting files is not allowed.")

    if __name__ == "__main__":
        gg.main(judge, name="no-delete")

Run it with ``python my_guard.py --port 0 --mesh 127.0.0.1:50051``:
it serves, registers with the mesh, and prints ``LISTENING <port>``.

What the kit does for the author:

* judges the batches of one stream concurrently, on a thread pool, and answers
  each request exactly once, in whatever order the judgements finish;
* sends only verdicts for call ids it was sent, at most one per call, and no
  skip with blank content (each dropped with a warning, see docs/behaviour.md R8);
* honours ``CancelBatch``: a cancelled request is not answered, and
  :attr:`Batch.cancelled` / :meth:`Batch.sleep` let a slow judge stop early;
* sends the stream's response headers as soon as it opens;
* serves ``grpc.health.v1.Health`` (and server reflection when
  ``grpcio-reflection`` is installed);
* joins the coordinator's trace (docs/behaviour.md R22): when ``opentelemetry`` is
  installed and a TracerProvider is configured, each batch is judged inside a
  span ``guard.judge`` whose parent is the batch's ``traceparent``;
* skips (steer) every call whose arguments it cannot read as an I-JSON
  object, without showing it to the judge: unreadable is never "proceed";
* registers the guard with the mesh (``GuardRegistry.Register``), sending the
  TLS settings, client certificate and token it is given on every call;
* stops gracefully on SIGTERM and SIGINT.

A judge that raises fails that request only: the kit answers it with
``JudgeResponse.error`` set to the exception, the mesh applies the guard's
failure policy to its calls (docs/behaviour.md R13), and the stream and the other
requests on it go on.

The wire types are ``guardmesh.v1.guardmesh_pb2`` (re-exported here as
``pb``), generated from the ``guardmesh/v1/guardmesh.proto`` that ships in
the package. For asyncio guards see :mod:`guardmesh.guard_aio`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import queue
import signal
import sys
import threading
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Sequence,
    TypedDict,
    TypeVar,
    Union,
    cast,
)

import grpc

from guardmesh import _health
from guardmesh._common import (
    ArgumentsError,
    MeshCredentials,
    as_list,
    enum_value,
    parse_arguments,
    read_file,
)
from guardmesh._tracing import extract_context, install_file_tracing, tracer
from guardmesh.v1 import guardmesh_pb2 as pb
from guardmesh.v1 import guardmesh_pb2_grpc as pb_grpc

if sys.version_info >= (3, 11):
    from typing import Unpack
elif TYPE_CHECKING:  # only annotations use it, and they are not evaluated
    from typing_extensions import Unpack

__all__ = [
    "ArgumentsError",
    "Batch",
    "Call",
    "Result",
    "block_result",
    "rewrite_result",
    "GUARD_SERVICE",
    "GuardServer",
    "Health",
    "SERVING",
    "credentials_from_args",
    "registration_from_args",
    "server_tls_from_args",
    "pb_grpc",
    "JudgeFn",
    "MeshCredentials",
    "PolicyOptions",
    "RegisterOptions",
    "ServerTls",
    "SessionMemory",
    "Verdict",
    "Verdicts",
    "argument_parser",
    "ask",
    "cancel",
    "deregister",
    "install_file_tracing",
    "main",
    "parse_arguments",
    "pb",
    "proceed",
    "reads_session",
    "register",
    "register_policy",
    "rewrite",
    "run",
    "serve",
    "steer",
]

log = logging.getLogger("guardmesh.guard")

GUARD_SERVICE: str = pb.DESCRIPTOR.services_by_name["GuardService"].full_name
#: ``grpc.health.v1.Health`` as the kit serves it, for guards that build
#: their own server: ``server.add_generic_rpc_handlers((Health().handler(),))``.
Health = _health.Health
SERVING = _health.SERVING
NOT_SERVING = _health.NOT_SERVING

#: A session's memory as a guard is sent it (R34; the wire type
#: ``guardmesh.v1.SessionMemory``): ``labels``, ``counts`` (calls per tool),
#: ``recent`` (the latest calls: ``tool``, ``server``, ``args_digest``,
#: ``at_ms``), ``calls_total``, ``results_total``, ``evicted``,
#: ``truncated``, and ``unavailable`` (set, alone, when the memory could
#: not be read: the session is unknown, never empty). Digests only, never a
#: value.
SessionMemory = pb.SessionMemory


@dataclasses.dataclass(frozen=True)
class Call:
    """One tool call of a batch, as the mesh sent it."""

    call_id: str
    tool: str
    #: The arguments as sent: a JSON object, as text ("" means ``{}``).
    arguments: str
    #: The arguments parsed; ``None`` when they cannot be read (see ``error``).
    args: Optional[dict[str, Any]]
    #: Why the arguments cannot be read as an I-JSON object, if they cannot.
    #: Such a call is never shown to the judge: the kit skips it.
    error: Optional[str] = None

    @classmethod
    def from_proto(cls, call: "pb.ToolCall") -> "Call":
        try:
            return cls(call.call_id, call.tool, call.arguments, parse_arguments(call.arguments))
        except ArgumentsError as err:
            return cls(call.call_id, call.tool, call.arguments, None, str(err))


@dataclasses.dataclass(frozen=True)
class Result:
    """The result of a call that ran (R33), sent to a guard that registered
    the results phase."""

    call_id: str
    tool: str
    #: The server or namespace the tool belongs to ("" when unknown).
    server: str
    #: The MCP ``CallToolResult`` as JSON text.
    result: str

    @property
    def json(self) -> Any:
        """The result, parsed (a dict with ``content``...)."""
        return json.loads(self.result)

    @property
    def text(self) -> str:
        """The text of its ``text`` content blocks, joined by newlines."""
        blocks = self.json.get("content", [])
        return "\n".join(b.get("text", "") for b in blocks
                         if isinstance(b, dict) and b.get("type") == "text")


class Batch:
    """The part of a batch this guard is asked to judge (a ``GuardBatch``).

    The judge function may check :attr:`cancelled` (or wait with
    :meth:`sleep`) to give up early on a batch the mesh no longer needs.
    """

    def __init__(self, request: "pb.GuardBatch", guard_name: str = ""):
        self.raw: pb.GuardBatch = request
        self.request_id: int = request.request_id
        self.batch_id: str = request.batch_id
        #: The name the guard is registered under (the kit's name if unset).
        self.guard: str = request.guard or guard_name
        self.context: pb.BatchContext = request.context
        calls = [Call.from_proto(c) for c in request.calls]
        #: The calls to judge: those whose arguments the kit could read.
        self.calls: list[Call] = [c for c in calls if c.error is None]
        #: Calls whose arguments are not an I-JSON object; the kit skips them
        #: (steer), never lets them proceed, and the judge does not see them.
        self.unreadable: list[Call] = [c for c in calls if c.error is not None]
        #: For a batch of results (R33): the results to judge; ``calls`` is
        #: then empty. A guard is sent results only if it registered the
        #: results phase (``phases="results"`` or ``"both"``).
        self.results: list[Result] = [
            Result(r.call_id, r.tool, r.server, r.result) for r in request.results]
        self.deadline_ms: int = request.deadline_ms
        self.traceparent: str = request.traceparent
        self.tracestate: str = request.tracestate
        self.received_at: float = time.monotonic()
        self._cancelled = threading.Event()

    @property
    def session_id(self) -> str:
        return self.context.session_id

    @property
    def session(self) -> Optional[SessionMemory]:
        """The session's memory as it was when the batch arrived (R34), or
        None: it is sent only to a guard registered as reading it
        (``session_memory="read"``, which :meth:`GuardServer.register` sends
        for a judge that takes ``session``)."""
        return self.raw.session if self.raw.HasField("session") else None

    @property
    def turn_index(self) -> int:
        return self.context.turn_index

    @property
    def model_text(self) -> str:
        return self.context.model_text

    @property
    def metadata(self) -> Mapping[str, str]:
        return self.context.metadata

    @property
    def deadline(self) -> Optional[float]:
        """The answer's deadline on the ``time.monotonic()`` clock, if any."""
        if not self.deadline_ms:
            return None
        return self.received_at + self.deadline_ms / 1000.0

    @property
    def cancelled(self) -> bool:
        """True once the mesh cancelled this request (or the stream ended)."""
        return self._cancelled.is_set()

    def sleep(self, seconds: float) -> bool:
        """Sleeps, waking early on cancellation. True if it slept fully."""
        return not self._cancelled.wait(seconds)

    def call(self, call_id: str) -> Call:
        """The call with this id (KeyError if it was not sent)."""
        for c in self.calls:
            if c.call_id == call_id:
                return c
        raise KeyError(call_id)

    @property
    def phase(self) -> str:
        """``"results"`` for a batch of results (R33), else ``"calls"``."""
        return "results" if self.results else "calls"

    def result(self, call_id: str) -> Result:
        """The result with this id (KeyError if it was not sent)."""
        for r in self.results:
            if r.call_id == call_id:
                return r
        raise KeyError(call_id)

    def __repr__(self) -> str:
        return (
            f"Batch(request_id={self.request_id}, batch_id={self.batch_id!r}, "
            f"calls={[c.call_id for c in self.calls]})"
        )


#: One verdict on one call (the wire type ``guardmesh.v1.Verdict``), as the
#: helpers :func:`steer`, :func:`cancel`, :func:`rewrite` and :func:`proceed`
#: build it.
Verdict = pb.Verdict
#: What a judge returns: verdicts (a list, a generator), one verdict, or None.
Verdicts = Optional[Union[Verdict, Iterable[Verdict]]]
#: A judge function: a batch in, verdicts out (a list, a generator, one
#: verdict, or None for "all proceed"). It runs on a worker thread. One that
#: takes a second parameter named ``session`` reads the session's memory
#: (R34) and is called with it (None when the batch carries none).
JudgeFn = Union[
    Callable[[Batch], Verdicts],
    Callable[[Batch, Optional[SessionMemory]], Verdicts],
]

_R = TypeVar("_R")


def _session_parameter(judge_fn: Callable[..., Any]) -> Optional[inspect.Parameter]:
    """The judge's second parameter if it is named ``session``."""
    try:
        parameters = list(inspect.signature(judge_fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return None
    if len(parameters) < 2:
        return None
    second = parameters[1]
    if second.name != "session" or second.kind in (inspect.Parameter.VAR_POSITIONAL,
                                                   inspect.Parameter.VAR_KEYWORD):
        return None
    return second


def reads_session(judge_fn: Callable[..., Any]) -> bool:
    """True when ``judge_fn`` reads the session's memory (R34): it is
    declared with a second parameter named ``session`` (keyword-only or
    with a default, too). The kit calls such a judge with the batch's
    memory and registers it asking for it; it calls any other judge with
    the batch alone, and registers it asking for none."""
    return _session_parameter(judge_fn) is not None


def _batch_judge(judge_fn: Callable[..., _R]) -> Callable[[Batch], _R]:
    """``judge_fn`` as a function of the batch alone: a judge that reads the
    session's memory is called with it too."""
    second = _session_parameter(judge_fn)
    if second is None:
        return cast(Callable[[Batch], _R], judge_fn)
    if second.kind is inspect.Parameter.KEYWORD_ONLY:
        return lambda batch: judge_fn(batch, session=batch.session)
    return lambda batch: judge_fn(batch, batch.session)


# ---------------------------------------------------------------------------
# Verdict helpers
# ---------------------------------------------------------------------------


def _skip(call_id: str, content: str, kind: "pb.SkipKind.ValueType") -> Verdict:
    if not content or not content.strip():
        raise ValueError(f"skip of call {call_id!r} needs non-blank content (R8)")
    return pb.Verdict(call_id=call_id, skip=pb.Skip(content=content, kind=kind))


def steer(call_id: str, content: str) -> Verdict:
    """Skip the call as an error the model should fix and retry (R7)."""
    return _skip(call_id, content, pb.SKIP_KIND_STEER)


def cancel(call_id: str, content: str) -> Verdict:
    """Skip the call with a benign "not allowed" result; the model moves on."""
    return _skip(call_id, content, pb.SKIP_KIND_CANCEL)


def ask(call_id: str, reason: str, content: str = "") -> Verdict:
    """Ask a person first (R35): the call does not run now. The mesh makes
    an approval request carrying ``reason`` for the approver; the call runs
    only when the same call comes back with that request approved (and the
    guards after this one let it). The model reads ``content`` meanwhile
    (empty: the mesh's own text saying the call waits for an approval)."""
    return pb.Verdict(call_id=call_id, ask=pb.Ask(reason=reason, content=content))


def rewrite(
    call_id: str,
    arguments: Union[Mapping[str, Any], str, None] = None,
    tool: Optional[str] = None,
) -> Verdict:
    """Run the call changed (mutate guards, within their grant: R11).

    ``arguments`` replaces the call's arguments whole: a mapping (serialized
    as JSON) or JSON object text. ``tool`` renames the call (needs
    ``may_rename``). Whatever is None is left as it was.
    """
    change = pb.Rewrite()
    if arguments is not None:
        if isinstance(arguments, str):
            try:
                parse_arguments(arguments)
            except ArgumentsError as err:
                raise ValueError(
                    f"rewrite of call {call_id!r}: arguments must be a JSON object: {err}"
                ) from None
            change.arguments = arguments
        else:
            change.arguments = json.dumps(dict(arguments), ensure_ascii=False)
    if tool is not None:
        if not tool:
            raise ValueError(f"rewrite of call {call_id!r}: tool name must not be empty")
        change.tool = tool
    return pb.Verdict(call_id=call_id, rewrite=change)


def block_result(call_id: str, content: str) -> Verdict:
    """Block a result (R33): the model reads ``content`` as an error result
    instead of what the tool returned."""
    return _skip(call_id, content, pb.SKIP_KIND_STEER)


def rewrite_result(call_id: str, result: Union[Mapping[str, Any], str]) -> Verdict:
    """Replace a result (R33; mutate guards, within their result grant):
    ``result`` is the whole new MCP ``CallToolResult`` (a mapping, or JSON
    object text with ``content``), carried in ``Rewrite.arguments``."""
    if isinstance(result, str):
        try:
            parsed = parse_arguments(result)
        except ArgumentsError as err:
            raise ValueError(
                f"rewrite of result {call_id!r}: not a JSON object: {err}") from None
        text = result
    else:
        parsed = dict(result)
        text = json.dumps(parsed, ensure_ascii=False)
    if not isinstance(parsed.get("content"), list):
        raise ValueError(f"rewrite of result {call_id!r}: a CallToolResult needs a "
                         "`content` array")
    return pb.Verdict(call_id=call_id, rewrite=pb.Rewrite(arguments=text))


def proceed(call_id: str) -> Verdict:
    """An explicit "run it": the same as sending no verdict for the call."""
    return pb.Verdict(call_id=call_id)


def conforming(batch: Batch, result: Verdicts) -> list[Verdict]:
    """The verdicts of a judge's result that the protocol allows (R8)."""
    if result is None:
        return []
    if isinstance(result, pb.Verdict):
        result = [result]
    sent = {c.call_id for c in batch.calls} | {r.call_id for r in batch.results}
    seen: set[str] = set()
    verdicts = []
    for verdict in result:
        if not isinstance(verdict, pb.Verdict):
            raise TypeError(
                f"judge produced {type(verdict).__name__}, expected a Verdict "
                "(build verdicts with steer, cancel, rewrite, ask or proceed)"
            )
        where = f"batch {batch.batch_id!r} (request {batch.request_id})"
        if verdict.call_id not in sent:
            log.warning("%s: dropping a verdict for call %r, which was not sent",
                        where, verdict.call_id)
            continue
        if verdict.call_id in seen:
            log.warning("%s: dropping a second verdict for call %r", where, verdict.call_id)
            continue
        if verdict.WhichOneof("outcome") == "skip" and not verdict.skip.content.strip():
            log.warning("%s: dropping a skip with blank content for call %r",
                        where, verdict.call_id)
            continue
        seen.add(verdict.call_id)
        verdicts.append(verdict)
    return verdicts


# ---------------------------------------------------------------------------
# The Judge stream
# ---------------------------------------------------------------------------

_WAKE = object()  # something changed: re-check whether the stream is done
_CLOSED = object()  # the RPC terminated (cancelled by the peer or the server)


class _Stream:
    """One open Judge stream: its outstanding requests and its outbox.

    A reader thread takes requests off the stream; batches are judged on the
    kit's executor; the RPC's own thread (the response generator) sends what
    lands in the outbox. A request stays in ``pending`` from its arrival until
    its answer is sent or it is cancelled, which is what makes every request
    answered exactly once and a cancelled one never.
    """

    def __init__(self, servicer: "_GuardServicer"):
        self.servicer = servicer
        self.outbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending: dict[int, Batch] = {}
        self.reading = True

    # -- reader thread ------------------------------------------------------

    def read(self, requests: Iterable["pb.JudgeRequest"]) -> None:
        try:
            for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "batch":
                    self._start(request.batch)
                elif kind == "cancel":
                    self._cancel(request.cancel.request_id)
                else:
                    log.warning("ignoring a JudgeRequest with neither batch nor cancel")
        except Exception as err:  # the RPC ended under the iterator
            log.debug("judge stream read ended: %r", err)
        finally:
            with self.lock:
                self.reading = False
            self.outbox.put(_WAKE)

    def _start(self, request: "pb.GuardBatch") -> None:
        batch = Batch(request, self.servicer.name)
        with self.lock:
            if batch.request_id in self.pending:
                log.warning("ignoring request %d: already outstanding on this stream",
                            batch.request_id)
                return
            self.pending[batch.request_id] = batch
        try:
            self.servicer.executor.submit(self._judge, batch)
        except RuntimeError:  # the executor shut down: the server is stopping
            self._forget(batch.request_id)

    def _cancel(self, request_id: int) -> None:
        batch = self._forget(request_id)
        if batch is None:
            log.debug("cancel of request %d, which is not outstanding", request_id)
        else:
            log.debug("request %d (batch %r) cancelled", request_id, batch.batch_id)

    def _forget(self, request_id: int) -> Optional[Batch]:
        with self.lock:
            batch = self.pending.pop(request_id, None)
        if batch is not None:
            batch._cancelled.set()
            self.outbox.put(_WAKE)
        return batch

    # -- worker threads -----------------------------------------------------

    def _judge(self, batch: Batch) -> None:
        if batch.cancelled:
            return
        try:
            response = pb.JudgeResponse(request_id=batch.request_id,
                                        verdicts=self.servicer.judge(batch))
        except Exception as err:
            log.exception("judge failed on batch %r (request %d)", batch.batch_id, batch.request_id)
            # Fails this request alone (R13); the stream stays up.
            response = pb.JudgeResponse(request_id=batch.request_id,
                                        error=f"{type(err).__name__}: {err}")
        with self.lock:
            if batch.request_id in self.pending:
                self.outbox.put(response)
            else:
                log.debug("request %d was cancelled; its answer is dropped", batch.request_id)

    # -- the RPC's thread ---------------------------------------------------

    def responses(self) -> Iterable["pb.JudgeResponse"]:
        """The response stream: yields answers until the stream is done."""
        while True:
            item = self.outbox.get()
            if item is _CLOSED:
                self._cancel_all()
                return
            if isinstance(item, pb.JudgeResponse):
                with self.lock:
                    live = self.pending.pop(item.request_id, None) is not None
                if live:
                    yield item
            with self.lock:
                idle = not self.pending
                done = idle and (not self.reading or self.servicer.draining.is_set())
            if done:
                return

    def close(self) -> None:
        self.outbox.put(_CLOSED)

    def wake(self) -> None:
        self.outbox.put(_WAKE)

    def _cancel_all(self) -> None:
        with self.lock:
            batches = list(self.pending.values())
            self.pending.clear()
        for batch in batches:
            batch._cancelled.set()


class _GuardServicer(pb_grpc.GuardServiceServicer):
    def __init__(self, judge_fn: JudgeFn, name: str, workers: int):
        self.judge_fn = judge_fn
        #: Whether the judge reads the session's memory (R34).
        self.reads_session = reads_session(judge_fn)
        self.judge_batch: Callable[[Batch], Verdicts] = _batch_judge(judge_fn)
        self.name = name
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="guard-judge")
        self.draining = threading.Event()
        self.streams: set[_Stream] = set()
        self.streams_changed = threading.Condition()

    def Judge(self, request_iterator: Iterator[pb.JudgeRequest],
              context: grpc.ServicerContext) -> Iterator[pb.JudgeResponse]:
        if self.draining.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the guard is stopping")
        # The sync server would otherwise hold the headers back until the first
        # answer; send them now, so a peer waiting for them is not stalled.
        context.send_initial_metadata(())
        stream = _Stream(self)
        context.add_callback(stream.close)
        with self.streams_changed:
            self.streams.add(stream)
        reader = threading.Thread(target=stream.read, args=(request_iterator,),
                                  name="guard-judge-reader", daemon=True)
        reader.start()
        try:
            yield from stream.responses()
        finally:
            with self.streams_changed:
                self.streams.discard(stream)
                self.streams_changed.notify_all()

    def drain(self) -> None:
        """Ends each stream (with OK) once it has no outstanding request."""
        self.draining.set()
        with self.streams_changed:
            streams = list(self.streams)
        for stream in streams:
            stream.wake()

    def wait_drained(self, timeout: Optional[float]) -> bool:
        """Waits until no Judge stream is open; False on timeout."""
        with self.streams_changed:
            return self.streams_changed.wait_for(lambda: not self.streams, timeout)

    def judge(self, batch: Batch) -> list[pb.Verdict]:
        """Skips the calls whose arguments cannot be read, and runs the judge
        function on the others (in a span when tracing)."""
        skipped = [
            steer(c.call_id, f"The arguments of call {c.call_id!r} cannot be read as a JSON "
                             f"object ({c.error}); guard {batch.guard!r} did not judge them. "
                             "Send them as a plain JSON object.")
            for c in batch.unreadable
        ]
        for c in batch.unreadable:
            log.warning("batch %r: skipping call %r, its arguments cannot be read: %s",
                        batch.batch_id, c.call_id, c.error)
        if not batch.calls and not batch.results:
            return skipped
        return skipped + self._judge_calls(batch)

    def _judge_calls(self, batch: Batch) -> list[pb.Verdict]:
        span_tracer = tracer("guardmesh.guard")
        if span_tracer is None:
            return conforming(batch, self.judge_batch(batch))
        return judge_traced(batch, span_tracer, lambda: self.judge_batch(batch))


def _span_attributes(batch: Batch) -> dict[str, Any]:
    return {
        "guardmesh.guard": batch.guard,
        "guardmesh.batch_id": batch.batch_id,
        "guardmesh.request_id": batch.request_id,
        "guardmesh.calls": len(batch.calls),
        "guardmesh.call_ids": [c.call_id for c in batch.calls],
    }


def _span_outcome(span: Any, batch: Batch, verdicts: list[pb.Verdict]) -> None:
    outcomes = [v.WhichOneof("outcome") for v in verdicts]
    span.set_attribute("guardmesh.skipped", outcomes.count("skip"))
    span.set_attribute("guardmesh.rewritten", outcomes.count("rewrite"))
    span.set_attribute("guardmesh.asked", outcomes.count("ask"))
    span.set_attribute("guardmesh.cancelled", batch.cancelled)


def judge_traced(batch: Batch, span_tracer: Any,
                 judge: Callable[[], Verdicts]) -> list[pb.Verdict]:
    """The conforming verdicts of ``judge()``, inside a span ``guard.judge``
    whose parent is the batch's traceparent (R22)."""
    parent = extract_context(batch.traceparent, batch.tracestate)
    from guardmesh._tracing import server_kind

    with span_tracer.start_as_current_span("guard.judge", context=parent, kind=server_kind(),
                                           attributes=_span_attributes(batch)) as span:
        verdicts = conforming(batch, judge())
        _span_outcome(span, batch, verdicts)
        return verdicts


# ---------------------------------------------------------------------------
# Serving and registering
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """TLS for the guard's own listener (its endpoint is then ``https://``)."""

    #: The guard's PEM certificate chain and key.
    cert_file: str
    key_file: str
    #: With it, the mesh must present a client certificate from this CA.
    client_ca_file: Optional[str] = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = read_file(self.client_ca_file, "client CA file") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(read_file(self.key_file, "key file"), read_file(self.cert_file, "certificate file"))],
            root_certificates=ca, require_client_auth=ca is not None)


class GuardServer:
    """A running guard: the gRPC server plus the kit's worker pool."""

    def __init__(self, grpc_server: grpc.Server, servicer: _GuardServicer,
                 health_servicer: _health.Health, port: int, *, host: str = "127.0.0.1",
                 https: bool = False):
        self.grpc_server = grpc_server
        self.port = port
        self.name = servicer.name
        self.host = host
        #: Whether it serves TLS (its endpoint is then ``https://``).
        self.https = https
        #: ``"read"`` when its judge reads the session's memory (it takes
        #: ``session``), else ``"none"``: the ``session_memory`` it registers
        #: with (R34).
        self.session_memory: str = "read" if servicer.reads_session else "none"
        self._servicer = servicer
        self._health = health_servicer

    def registration(self, name: str, **options: Unpack[RegisterOptions]) -> pb.GuardSpec:
        """The ``GuardSpec`` :meth:`register` sends."""
        return registration(name, self.port, **self._options(options))

    def register(self, mesh_addr: str, name: str, *, timeout: float = 10.0,
                 credentials: Optional[MeshCredentials] = None,
                 **options: Unpack[RegisterOptions]) -> "pb.RegisterResponse":
        """Registers this guard with the mesh, as :func:`register` does, at
        the port (and address, and TLS) it serves on, asking for the
        session's memory when its judge reads it (``session_memory`` is
        :attr:`session_memory` unless given; R34). Options as there."""
        return register(mesh_addr, name, self.port, timeout=timeout, credentials=credentials,
                        **self._options(options))

    def _options(self, options: RegisterOptions) -> RegisterOptions:
        filled = RegisterOptions(host=self.host, https=self.https,
                                 session_memory=self.session_memory)
        filled.update(options)
        return filled

    def set_serving(self, serving: bool) -> None:
        """Reports SERVING or NOT_SERVING on ``grpc.health.v1.Health`` (the
        server's and the guard service's status) and keeps serving: a mesh
        sends a NOT_SERVING replica no new requests while its other replicas
        can take them, lets it finish the ones it holds, and sends it requests
        again once it reports SERVING. For a replica taken out of rotation
        (warming up, reloading a model) without stopping it."""
        status = _health.SERVING if serving else _health.NOT_SERVING
        for service in ("", GUARD_SERVICE):
            self._health.set(service, status)

    def stop(self, grace: Optional[float] = 5.0) -> threading.Event:
        """Stops gracefully: reports NOT_SERVING, refuses new RPCs, lets each
        open Judge stream finish its outstanding requests (ending it with OK),
        then cancels what is left (health watches, say), at the latest after
        ``grace`` seconds. Returns an event set once stopped."""
        self._health.enter_graceful_shutdown()
        self._servicer.drain()
        self.grpc_server.stop(grace)  # refuses new RPCs from now on
        servicer = self._servicer
        stopped = threading.Event()

        def finish() -> None:
            servicer.wait_drained(grace)
            self.grpc_server.stop(None).wait()
            servicer.executor.shutdown(wait=False, cancel_futures=True)
            stopped.set()

        threading.Thread(target=finish, name="guard-stop", daemon=True).start()
        return stopped

    def wait_for_termination(self, timeout: Optional[float] = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def serve(
    judge_fn: JudgeFn,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    name: str = "",
    workers: int = 32,
    max_streams: int = 16,
    reflection: bool = True,
    tls: Optional[ServerTls] = None,
) -> tuple[GuardServer, int]:
    """Starts serving ``judge_fn`` as a GuardService; returns (server, port).

    A ``judge_fn`` with a second parameter ``session`` is called with the
    batch's session memory (:func:`reads_session`); register it with
    :meth:`GuardServer.register`, which asks for the memory (R34).
    ``port=0`` picks a free port. ``name`` is used when a batch does not say
    which guard it is for (logs and spans). ``workers`` bounds the batches
    judged at once across all streams. Each open Judge stream holds one of
    the server's ``max_streams + 4`` RPC threads for its lifetime (the 4 are
    room for health checks); RPCs beyond that are refused with
    RESOURCE_EXHAUSTED rather than queued. Also serves ``grpc.health.v1.Health``, with
    the overall and the GuardService status SERVING, and, when
    ``grpcio-reflection`` is installed and ``reflection`` is true, server
    reflection. With ``tls`` it serves TLS (mTLS with a client CA).
    """
    servicer = _GuardServicer(judge_fn, name, workers)
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=max_streams + 4,
                                              thread_name_prefix="guard-rpc"),
        maximum_concurrent_rpcs=max_streams + 4,
    )
    pb_grpc.add_GuardServiceServicer_to_server(servicer, server)
    health_servicer = _health.Health()
    server.add_generic_rpc_handlers((health_servicer.handler(),))
    service_names = [GUARD_SERVICE, _health.SERVICE_NAME]
    if reflection:
        try:
            from grpc_reflection.v1alpha import (  # type: ignore[import-untyped,unused-ignore]
                reflection as grpc_reflection,
            )
        except ImportError:
            log.debug("grpcio-reflection not installed: no server reflection")
        else:
            service_names.append(grpc_reflection.SERVICE_NAME)
            grpc_reflection.enable_server_reflection(service_names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.credentials())
    if not bound:
        raise RuntimeError(f"could not bind {address}")
    server.start()
    for service in ("", GUARD_SERVICE):
        health_servicer.set(service, _health.SERVING)
    log.info("guard %r serving on %s:%d", name, host, bound)
    guard_server = GuardServer(server, servicer, health_servicer, bound, host=host,
                               https=tls is not None)
    return guard_server, bound


class PolicyOptions(TypedDict, total=False):
    """The keyword options of :func:`register_policy` (all optional).

    Enum options take a short name (``"fail_open"``, ``"dry_run"``), a full
    one or the number; list options a sequence or comma-separated text. A
    type checker (``mypy --strict``) flags a misspelt option; at run time an
    unknown one is a TypeError and an unknown enum name a ValueError.
    """

    #: The tools judged: names or globs (default: all).
    tools: Union[str, Sequence[str], None]
    #: ``fail_closed`` (default), ``fail_open`` or ``abort`` (R13).
    failure_policy: Union[str, int]
    #: Chain position: lower first (default 0).
    priority: int
    #: ``enforce`` (default) or ``dry_run``: consulted and traced, never applied.
    mode: Union[str, int]


class RegisterOptions(PolicyOptions, total=False):
    """The keyword options of :func:`register` (all optional): those of
    :class:`PolicyOptions` and these."""

    #: The address the guard serves on (default 127.0.0.1); a wildcard one
    #: registers 127.0.0.1.
    host: str
    #: The endpoint registered (default ``http://HOST:PORT``).
    endpoint: Optional[str]
    #: ``validate`` (default) or ``mutate``.
    role: Union[str, int]
    #: Time to answer a batch in ms; 0 (default): the mesh's default.
    timeout_ms: int
    #: Mutate guards: the tools it may rewrite.
    grant_tools: Union[str, Sequence[str], None]
    #: Mutate guards: may change a call's tool name.
    may_rename: bool
    #: Register ``https://`` (the guard serves TLS).
    https: bool
    #: The phases judged (R33): ``calls`` (default), ``results`` or ``both``.
    phases: Union[str, int]
    #: Mutate guards judging results: the tools whose results it may rewrite.
    result_grant_tools: Union[str, Sequence[str], None]
    #: The name the mesh verifies the guard's certificate against.
    server_identity: str
    #: More replicas of this guard (``http://host:port`` each, R32): the
    #: mesh spreads requests over ``endpoint`` and these.
    replicas: Union[str, Sequence[str], None]
    #: Whether the guard reads the session's memory (R34): ``read`` sends
    #: it with each batch; ``none`` or unset (the default) sends none.
    #: :meth:`GuardServer.register` sets it from the judge.
    session_memory: Union[str, int, None]


def registration(
    name: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    endpoint: Optional[str] = None,
    role: Union[str, int] = "validate",
    tools: Union[str, Sequence[str], None] = None,
    failure_policy: Union[str, int] = "fail_closed",
    timeout_ms: int = 0,
    priority: int = 0,
    mode: Union[str, int] = "enforce",
    grant_tools: Union[str, Sequence[str], None] = None,
    may_rename: bool = False,
    https: bool = False,
    server_identity: str = "",
    replicas: Union[str, Sequence[str], None] = None,
    phases: Union[str, int] = "calls",
    result_grant_tools: Union[str, Sequence[str], None] = None,
    session_memory: Union[str, int, None] = None,
) -> pb.GuardSpec:
    """The ``GuardSpec`` :func:`register` sends (options as there)."""
    if endpoint is None:
        reach = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
        scheme = "https" if https else "http"
        endpoint = (f"{scheme}://[{reach}]:{port}" if ":" in reach
                    else f"{scheme}://{reach}:{port}")
    return pb.GuardSpec(
        name=name,
        endpoint=endpoint,
        role=pb.GuardRole.ValueType(enum_value(dict(pb.GuardRole.items()), "GUARD_ROLE_", role)),
        tools=as_list(tools),
        timeout_ms=timeout_ms,
        failure_policy=pb.FailurePolicy.ValueType(
            enum_value(dict(pb.FailurePolicy.items()), "FAILURE_POLICY_", failure_policy)),
        priority=priority,
        mode=pb.GuardMode.ValueType(enum_value(dict(pb.GuardMode.items()), "GUARD_MODE_", mode)),
        grant=pb.RewriteGrant(tools=as_list(grant_tools), may_rename=may_rename),
        server_identity=server_identity,
        replicas=as_list(replicas),
        phases=pb.GuardPhases.ValueType(
            enum_value(dict(pb.GuardPhases.items()), "GUARD_PHASES_", phases)),
        result_grant=pb.ResultGrant(tools=as_list(result_grant_tools)),
        session_memory=pb.SessionMemoryUse.ValueType(
            0 if session_memory is None else
            enum_value(dict(pb.SessionMemoryUse.items()), "SESSION_MEMORY_USE_", session_memory)),
    )


def register(
    mesh_addr: str,
    name: str,
    port: int,
    *,
    timeout: float = 10.0,
    credentials: Optional[MeshCredentials] = None,
    **options: Unpack[RegisterOptions],
) -> "pb.RegisterResponse":
    """Registers (or updates) this guard with the mesh at ``mesh_addr``.

    Options (keyword-only, typed by :class:`RegisterOptions`; an unknown
    one is a TypeError): ``host``,
    ``endpoint`` (default ``http://HOST:PORT``, with 127.0.0.1 for a
    wildcard host, ``https://`` with ``https=True``), ``role``, ``tools``,
    ``failure_policy``, ``timeout_ms``, ``priority``, ``mode``,
    ``grant_tools``, ``may_rename``, ``server_identity``, ``replicas``
    (more replicas of this guard, R32), ``phases``, ``result_grant_tools``,
    ``session_memory`` (``"read"`` to be sent the session's memory with
    each batch, R34; unset or ``"none"``: sent none; a served guard's
    :meth:`GuardServer.register` sets it from its judge). Enum options take
    short names (``"mutate"``, ``"fail_open"``, ``"dry_run"``); list options
    a sequence or comma-separated text. Waits up to ``timeout`` seconds for
    the mesh to be reachable; raises ``grpc.RpcError`` if registration
    fails. ``credentials`` (TLS, client certificate, token) go on the call.
    """
    spec = registration(name, port, **options)
    return _register(mesh_addr, spec, f"guard {name!r} ({spec.endpoint})", timeout, credentials)


def _register(mesh_addr: str, spec: pb.GuardSpec, what: str, timeout: float,
              credentials: Optional[MeshCredentials]) -> "pb.RegisterResponse":
    """Sends ``spec`` to the mesh's ``GuardRegistry.Register``; logs it as ``what``."""
    credentials = credentials or MeshCredentials()
    with credentials.channel(mesh_addr) as channel:
        stub = pb_grpc.GuardRegistryStub(channel)
        response = stub.Register(pb.RegisterRequest(guard=spec), timeout=timeout,
                                 wait_for_ready=True, metadata=credentials.metadata())
    log.info("registered %s with %s: revision %d, position %d, %s",
             what, mesh_addr, response.revision, response.position,
             "created" if response.created else "updated")
    return response


def policy_registration(
    name: str,
    source: str,
    *,
    tools: Union[str, Sequence[str], None] = None,
    failure_policy: Union[str, int] = "fail_closed",
    priority: int = 0,
    mode: Union[str, int] = "enforce",
) -> pb.GuardSpec:
    """The ``GuardSpec`` :func:`register_policy` sends (options as there)."""
    if not isinstance(source, str) or not source.strip():
        raise TypeError("register_policy: source must be the text of a policy file")
    return pb.GuardSpec(
        name=name,
        policy=source,
        role=pb.GuardRole.ValueType(enum_value(dict(pb.GuardRole.items()), "GUARD_ROLE_",
                                               "validate")),
        tools=as_list(tools),
        failure_policy=pb.FailurePolicy.ValueType(
            enum_value(dict(pb.FailurePolicy.items()), "FAILURE_POLICY_", failure_policy)),
        priority=priority,
        mode=pb.GuardMode.ValueType(enum_value(dict(pb.GuardMode.items()), "GUARD_MODE_", mode)),
    )


def register_policy(
    mesh_addr: str,
    name: str,
    source: str,
    *,
    timeout: float = 10.0,
    credentials: Optional[MeshCredentials] = None,
    **options: Unpack[PolicyOptions],
) -> "pb.RegisterResponse":
    """Registers (or updates) a policy guard (docs/behaviour.md R27) with the mesh at
    ``mesh_addr``: ``source`` is the text of a policy file (CEL rules), sent
    whole and judged inside the mesh; there is no process to run.

    Options (keyword-only, typed by :class:`PolicyOptions`; an unknown one
    is a TypeError): ``tools``, ``failure_policy``, ``priority``, ``mode``
    (as :func:`register`). A
    policy that does not compile is refused: ``grpc.RpcError`` with
    ``INVALID_ARGUMENT`` and the line and reason in its details (check it
    first with ``guardmesh policy check FILE``).
    """
    spec = policy_registration(name, source, **options)
    return _register(mesh_addr, spec, f"policy guard {name!r}", timeout, credentials)


def deregister(mesh_addr: str, name: str, timeout: float = 5.0, *,
               credentials: Optional[MeshCredentials] = None) -> bool:
    """Removes the guard ``name`` from the mesh's chain; True if it was there."""
    credentials = credentials or MeshCredentials()
    with credentials.channel(mesh_addr) as channel:
        stub = pb_grpc.GuardRegistryStub(channel)
        response = stub.Deregister(pb.DeregisterRequest(name=name), timeout=timeout,
                                   metadata=credentials.metadata())
    log.info("deregistered guard %r from %s (removed: %s)", name, mesh_addr, response.removed)
    return response.removed


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def argument_parser(description: Optional[str] = None, *, name: str = "guard",
                    role: str = "validate", **defaults: Any) -> argparse.ArgumentParser:
    """The kit's command-line flags; add a guard's own flags to it.

    ``name``, ``role`` and any other ``defaults`` (by destination, e.g.
    ``grant_tools="*"``) become the flags' defaults.
    """
    parser = argparse.ArgumentParser(description=description)
    kit = parser.add_argument_group("guard kit")
    choice = lambda s: s.strip().lower().replace("-", "_")  # noqa: E731
    kit.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    kit.add_argument("--port", type=int, default=0, help="port to serve on; 0 picks one (default)")
    kit.add_argument("--mesh", metavar="ADDR",
                     help="register with the mesh at ADDR (host:port) once serving")
    kit.add_argument("--name", default=name, help=f"registered guard name (default {name})")
    kit.add_argument("--role", type=choice, choices=["validate", "mutate"], default=role)
    kit.add_argument("--tools", default="",
                     help="comma-separated tools judged, names or globs (default: all)")
    kit.add_argument("--failure-policy", type=choice, default="fail_closed",
                     choices=["fail_closed", "fail_open", "abort"])
    kit.add_argument("--timeout-ms", type=int, default=0,
                     help="time to answer a batch; 0: the mesh's default")
    kit.add_argument("--priority", type=int, default=0, help="chain position: lower first")
    kit.add_argument("--dry-run", action="store_true",
                     help="register in mode dry_run: consulted and traced, never applied")
    kit.add_argument("--grant-tools", default="",
                     help="mutate guards: comma-separated tools it may rewrite")
    kit.add_argument("--may-rename", action="store_true",
                     help="mutate guards: may change a call's tool name")
    kit.add_argument("--phases", type=choice, choices=["calls", "results", "both"],
                     default="calls",
                     help="what the guard judges (R33): calls (default), results, or both")
    kit.add_argument("--result-grant-tools", default="",
                     help="mutate guards judging results: comma-separated tools whose "
                          "results it may rewrite")
    kit.add_argument("--endpoint",
                     help="endpoint to register (default http://HOST:PORT)")
    kit.add_argument("--mesh-ca-file", metavar="PATH",
                     help="TLS to the mesh: PEM of the CA that signed its certificate")
    kit.add_argument("--mesh-cert-file", metavar="PATH",
                     help="this guard's PEM client certificate, for a mesh requiring mTLS")
    kit.add_argument("--mesh-key-file", metavar="PATH", help="the key of --mesh-cert-file")
    kit.add_argument("--mesh-token-file", metavar="PATH",
                     help="file holding the bearer token sent to the mesh "
                          "(default: the GUARDMESH_TOKEN variable, if set)")
    kit.add_argument("--mesh-tls-domain", metavar="NAME",
                     help="name to verify the mesh's certificate against")
    kit.add_argument("--tls-cert-file", metavar="PATH",
                     help="serve TLS with this PEM certificate (registers https://)")
    kit.add_argument("--tls-key-file", metavar="PATH", help="the key of --tls-cert-file")
    kit.add_argument("--tls-client-ca-file", metavar="PATH",
                     help="require the mesh to present a certificate from this CA (mTLS)")
    kit.add_argument("--deregister-on-exit", action="store_true",
                     help="deregister from the mesh on SIGTERM/SIGINT (default: stay, R15)")
    kit.add_argument("--otlp-file", metavar="PATH",
                     help="append each finished span to PATH as a JSON line")
    kit.add_argument("--workers", type=int, default=32, help="batches judged at once")
    kit.add_argument("--log-level", default="info", help="stderr log level (default info)")
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(defaults) - known)
    if unknown:
        raise TypeError(f"argument_parser: unknown default(s) {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(known - {'help'}))}")
    parser.set_defaults(**defaults)
    return parser


def credentials_from_args(args: argparse.Namespace) -> MeshCredentials:
    """The credentials the kit's ``--mesh-*`` flags give (the token from
    ``--mesh-token-file``, else the ``GUARDMESH_TOKEN`` variable)."""
    return MeshCredentials.create(
        ca_file=args.mesh_ca_file, cert_file=args.mesh_cert_file,
        key_file=args.mesh_key_file, token_file=args.mesh_token_file,
        tls_domain=args.mesh_tls_domain)


def _setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {args.name}: %(message)s")


def server_tls_from_args(args: argparse.Namespace) -> Optional[ServerTls]:
    """The TLS the kit's ``--tls-*`` flags give the guard's listener (None:
    plaintext); ValueError if they do not go together."""
    if args.tls_cert_file or args.tls_key_file:
        if not (args.tls_cert_file and args.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        return ServerTls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    if args.tls_client_ca_file:
        raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    return None


def registration_from_args(args: argparse.Namespace, tls: Optional[ServerTls]) -> RegisterOptions:
    """The :func:`register` options the kit's flags give."""
    return RegisterOptions(
        host=args.host, endpoint=args.endpoint, role=args.role, tools=args.tools,
        failure_policy=args.failure_policy, timeout_ms=args.timeout_ms,
        priority=args.priority, mode="dry_run" if args.dry_run else "enforce",
        grant_tools=args.grant_tools, may_rename=args.may_rename, https=tls is not None,
        phases=args.phases, result_grant_tools=args.result_grant_tools)


def _registration_failed(mesh: str, err: Exception) -> None:
    detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
    code = err.code().name if isinstance(err, grpc.RpcError) else "INVALID"
    log.error("could not register with the mesh at %s: %s: %s", mesh, code, detail)


def run(judge_fn: JudgeFn, args: argparse.Namespace) -> int:
    """Serves ``judge_fn`` as the parsed flags say, until SIGTERM or SIGINT.

    Prints exactly one line to stdout, ``LISTENING <port>``, once serving
    (and registered, with ``--mesh``, asking for the session's memory when
    ``judge_fn`` takes ``session``). Logs go to stderr. On the signal it
    drains: stops taking new streams, answers what is outstanding (for up
    to 5 s), then stops. Returns the exit status: 0 after a graceful stop,
    1 if registration failed, 2 for flags that do not go together. Call it
    from the main thread (it installs signal handlers).
    """
    _setup_logging(args)
    provider = install_file_tracing(args.otlp_file, args.name) if args.otlp_file else None

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    try:
        credentials = credentials_from_args(args)
        tls = server_tls_from_args(args)
    except ValueError as err:
        log.error("%s", err)
        return 2
    server, port = serve(judge_fn, args.port, args.host, name=args.name, workers=args.workers,
                         tls=tls)
    if args.mesh:
        try:
            server.register(args.mesh, args.name, credentials=credentials,
                            **registration_from_args(args, tls))
        except (grpc.RpcError, ValueError) as err:
            _registration_failed(args.mesh, err)
            server.stop(0).wait()
            return 1
    print(f"LISTENING {port}", flush=True)

    while not stop.wait(0.5):
        pass
    log.info("stopping")
    if args.mesh and args.deregister_on_exit:
        try:
            deregister(args.mesh, args.name, credentials=credentials)
        except (grpc.RpcError, ValueError) as err:
            log.warning("could not deregister: %s", err)
    server.stop(grace=5.0).wait()
    if provider is not None:
        provider.shutdown()
    log.info("stopped")
    return 0


def main(judge_fn: JudgeFn, argv: Optional[Sequence[str]] = None, **defaults: Any) -> None:
    """Parses the kit's flags (``defaults`` as in :func:`argument_parser`),
    serves ``judge_fn`` and exits with :func:`run`'s status."""
    sys.exit(run(judge_fn, argument_parser(**defaults).parse_args(argv)))
