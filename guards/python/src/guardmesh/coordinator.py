"""The coordinator client: ask the mesh about a round of tool calls before
running any of them.

::

    from guardmesh import Coordinator, Proceed

    with Coordinator("127.0.0.1:50051") as mesh:
        session = mesh.session("conversation-42")
        result = session.evaluate([
            {"call_id": "c1", "tool": "fs.read", "arguments": {"path": "a.txt"}},
        ])
        for decision in result.decisions:
            if isinstance(decision, Proceed):
                run(decision.call)            # the call as it must run
            else:                             # Steer or Cancel
                reply(decision.call_id, decision.content)

:class:`AsyncCoordinator` is the same for asyncio (``await session.evaluate``).

Results (R33): once the calls ran, ``session.evaluate_results([...])`` sends
their results (MCP ``CallToolResult`` JSON) through the mesh before the model
reads them; each :class:`ResultDecision` says what the model reads.
A round without calls is answered at once without contacting the mesh (R1).
With OpenTelemetry installed, each batch carries the current span's W3C
trace context, so the mesh and every guard join the agent's trace (R22).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import uuid
from typing import Any, Mapping, Optional, Sequence, Union

import grpc
import grpc.aio

from guardmesh._common import MeshCredentials
from guardmesh._tracing import current_traceparent
from guardmesh.v1 import guardmesh_pb2 as pb
from guardmesh.v1 import guardmesh_pb2_grpc as pb_grpc

__all__ = [
    "AsyncCoordinator",
    "AsyncSession",
    "BatchRefused",
    "BatchResult",
    "Call",
    "CallLike",
    "Cancel",
    "Coordinator",
    "Decision",
    "GuardTrace",
    "Proceed",
    "ResultDecision",
    "Session",
    "Steer",
    "ToolResult",
    "ToolResultLike",
]


@dataclasses.dataclass(frozen=True)
class Call:
    """One tool call: ``arguments`` is a JSON object as text."""

    call_id: str
    tool: str
    arguments: str = "{}"

    @property
    def args(self) -> Any:
        """The arguments, parsed."""
        return json.loads(self.arguments or "{}")

    @classmethod
    def of(cls, call: "CallLike") -> "Call":
        if isinstance(call, Call):
            return call
        if isinstance(call, pb.ToolCall):
            return cls(call.call_id, call.tool, call.arguments)
        unknown = set(call) - {"call_id", "tool", "arguments"}
        if unknown:
            raise TypeError(f"a call has no field(s) {', '.join(sorted(unknown))}; "
                            "expected call_id, tool, arguments")
        arguments = call.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return cls(str(call["call_id"]), str(call["tool"]), arguments)

    def proto(self) -> pb.ToolCall:
        return pb.ToolCall(call_id=self.call_id, tool=self.tool, arguments=self.arguments)


#: A call as :meth:`Session.evaluate` takes it: a :class:`Call`, a
#: ``pb.ToolCall``, or a mapping with ``call_id``, ``tool`` and ``arguments``
#: (a JSON object as text, or a mapping serialized as JSON).
CallLike = Union[Call, "pb.ToolCall", Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The result of a call that ran (R33): ``result`` is the MCP
    ``CallToolResult`` as JSON text (``content``, and optionally
    ``structuredContent``, ``isError``, ``_meta``); ``server`` the server or
    namespace the tool belongs to."""

    call_id: str
    tool: str
    result: str
    server: str = ""

    @classmethod
    def of(cls, result: "ToolResultLike") -> "ToolResult":
        if isinstance(result, ToolResult):
            return result
        if isinstance(result, pb.ToolResult):
            return cls(result.call_id, result.tool, result.result, result.server)
        unknown = set(result) - {"call_id", "tool", "result", "server"}
        if unknown:
            raise TypeError(f"a result has no field(s) {', '.join(sorted(unknown))}; "
                            "expected call_id, tool, result, server")
        text = result["result"]
        if not isinstance(text, str):
            text = json.dumps(text, ensure_ascii=False)
        return cls(str(result["call_id"]), str(result["tool"]), text,
                   str(result.get("server", "")))

    def proto(self) -> pb.ToolResult:
        return pb.ToolResult(call_id=self.call_id, tool=self.tool, server=self.server,
                             result=self.result)


#: A result as :meth:`Session.evaluate_results` takes it: a
#: :class:`ToolResult`, a ``pb.ToolResult``, or a mapping with ``call_id``,
#: ``tool``, ``result`` (JSON text, or a mapping serialized as JSON) and
#: optionally ``server``.
ToolResultLike = Union[ToolResult, "pb.ToolResult", Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ResultDecision:
    """What the model reads of one result (R33)."""

    call_id: str
    #: "pass", "rewrite" or "block".
    action: str
    #: What the model reads: a ``CallToolResult`` as JSON text (the result
    #: as sent, as rewritten, or, blocked, an error result holding
    #: ``content``).
    result: str
    original: ToolResult
    #: For a block: the guard's content and name.
    content: str = ""
    decided_by: str = ""
    #: True when the block comes from a guard's failure (fail_closed, R13).
    failure: bool = False
    rewritten_by: tuple[str, ...] = ()
    bypassed: tuple[str, ...] = ()

    @property
    def blocked(self) -> bool:
        return self.action == "block"

    @property
    def json(self) -> Any:
        """What the model reads, parsed."""
        return json.loads(self.result)


@dataclasses.dataclass(frozen=True)
class Proceed:
    """Run the call: ``call`` is the call as it must run (after rewrites)."""

    call_id: str
    call: Call
    original: Call
    #: The mutate guards that rewrote it, in order (R12).
    rewritten_by: tuple[str, ...] = ()
    #: ``fail_open`` guards that failed and were bypassed (R13).
    bypassed: tuple[str, ...] = ()

    @property
    def rewritten(self) -> bool:
        return self.call != self.original


@dataclasses.dataclass(frozen=True)
class Steer:
    """Do not run the call; the model reads ``content`` as an error result
    ("you did it wrong, fix it") and is expected to retry (R7)."""

    call_id: str
    content: str
    #: The guard whose skip decided.
    decided_by: str
    call: Call
    original: Call
    #: True when the skip comes from a guard's failure (fail_closed, R13).
    failure: bool = False


@dataclasses.dataclass(frozen=True)
class Cancel:
    """Do not run the call; the model reads ``content`` as a benign result
    ("not allowed") and moves on."""

    call_id: str
    content: str
    decided_by: str
    call: Call
    original: Call
    failure: bool = False


Decision = Union[Proceed, Steer, Cancel]


@dataclasses.dataclass(frozen=True)
class GuardTrace:
    """What one guard of the chain did for the batch (R21)."""

    guard: str
    #: "validate" or "mutate".
    role: str
    #: "proceeded", "skipped", "rewrote", "not_applicable", "superseded",
    #: "failed", "timed_out", "malformed", "rejected_rewrite", "dry_run".
    status: str
    latency_us: int
    sent_call_ids: tuple[str, ...]
    skipped_call_ids: tuple[str, ...]
    rewritten_call_ids: tuple[str, ...]
    error: str
    #: For a policy guard (R27): (call id, rule) for each call a rule
    #: skipped, or failed on, in the batch's call order; empty for other
    #: guards.
    rules: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """The mesh's answer for one round."""

    batch_id: str
    #: One decision per call, in the order the calls were given (R2).
    decisions: tuple[Decision, ...]
    #: One entry per guard of the chain (R21); empty for a round without calls.
    trace: tuple[GuardTrace, ...] = ()
    #: The chain revision judged against (R17); None when no RPC was made (R1).
    chain_revision: Optional[int] = None
    #: The OpenTelemetry trace id of the batch, or "".
    trace_id: str = ""
    #: For a batch of results: one decision per result, in order (R33).
    results: tuple[ResultDecision, ...] = ()
    #: Whether the chain judges results (R33): only then is sending the
    #: results of the calls that ran worth a round trip.
    judges_results: bool = False

    @property
    def execute(self) -> tuple[Call, ...]:
        """The calls to run: the final call of every Proceed, in order."""
        return tuple(d.call for d in self.decisions if isinstance(d, Proceed))

    def __getitem__(self, call_id: str) -> Decision:
        for decision in self.decisions:
            if decision.call_id == call_id:
                return decision
        raise KeyError(call_id)


class BatchRefused(Exception):
    """The mesh refused the batch (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, R20),
    a guard with failure policy ``abort`` aborted it (R13), or the mesh could
    not be reached. No call of the batch may run."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def _enum_name(names: Mapping[int, str], prefix: str, value: int) -> str:
    return names.get(value, f"{prefix}{value}")[len(prefix):].lower()


def _decision(d: pb.CallDecision) -> Decision:
    call = Call.of(d.call)
    original = Call.of(d.original) if d.HasField("original") else call
    if d.action == pb.ACTION_PROCEED:
        return Proceed(d.call_id, call, original, tuple(d.rewritten_by), tuple(d.bypassed))
    if d.action == pb.ACTION_CANCEL:
        return Cancel(d.call_id, d.content, d.decided_by, call, original, d.failure)
    if d.action == pb.ACTION_STEER:
        return Steer(d.call_id, d.content, d.decided_by, call, original, d.failure)
    # Never sent by the mesh; a client must not run such a call.
    return Cancel(d.call_id, d.content or f"the mesh gave no action for call {d.call_id!r}",
                  d.decided_by, call, original, True)


_ROLES: dict[int, str] = {int(v): k for k, v in pb.GuardRole.items()}
_STATUSES: dict[int, str] = {int(v): k for k, v in pb.TraceStatus.items()}


def _result(batch_id: str, calls: Sequence[Call], answer: pb.BatchDecision) -> BatchResult:
    decisions = tuple(_decision(d) for d in answer.decisions)
    if [d.call_id for d in decisions] != [c.call_id for c in calls]:
        # R2: exactly one decision per call, in order. Anything else cannot
        # be trusted to say which calls may run.
        raise BatchRefused(grpc.StatusCode.INTERNAL,
                           "the mesh's decisions do not match the calls sent (R2)")
    trace = tuple(
        GuardTrace(t.guard, _enum_name(_ROLES, "GUARD_ROLE_", t.role),
                   _enum_name(_STATUSES, "TRACE_STATUS_", t.status), t.latency_us,
                   tuple(t.sent_call_ids), tuple(t.skipped_call_ids),
                   tuple(t.rewritten_call_ids), t.error,
                   tuple((c.call_id, t.rules[c.call_id]) for c in calls if c.call_id in t.rules))
        for t in answer.trace)
    return BatchResult(batch_id, decisions, trace, answer.chain_revision, answer.trace_id,
                       _result_decisions(answer), answer.judges_results)


_RESULT_ACTIONS: dict[int, str] = {int(v): k for k, v in pb.ResultAction.items()}


def _result_decisions(answer: pb.BatchDecision) -> tuple[ResultDecision, ...]:
    out = []
    for d in answer.results:
        action = _enum_name(_RESULT_ACTIONS, "RESULT_ACTION_", d.action)
        original = ToolResult.of(d.original)
        if action not in ("pass", "rewrite", "block"):
            # Never sent by the mesh; a client must not show such a result.
            action = "block"
        out.append(ResultDecision(d.call_id, action, d.result, original, d.content,
                                  d.decided_by, d.failure, tuple(d.rewritten_by),
                                  tuple(d.bypassed)))
    return tuple(out)


def _results_answer(batch_id: str, results: Sequence[ToolResult],
                    answer: pb.BatchDecision) -> BatchResult:
    batch = _result(batch_id, [], answer)
    if [r.call_id for r in batch.results] != [r.call_id for r in results]:
        raise BatchRefused(grpc.StatusCode.INTERNAL,
                           "the mesh's result decisions do not match the results sent (R33)")
    return batch


class _SessionBase:
    def __init__(self, session_id: str, metadata: Mapping[str, str], timeout: Optional[float]):
        self.session_id = session_id
        self.metadata = dict(metadata)
        self.timeout = timeout
        self.turn_index = 0
        self._batches = itertools.count(1)

    def _request(self, calls: Sequence[CallLike], model_text: str,
                 turn_index: Optional[int], batch_id: Optional[str],
                 ) -> tuple[list[Call], pb.EvaluateRequest]:
        normalized = [Call.of(c) for c in calls]
        turn = self.turn_index if turn_index is None else turn_index
        self.turn_index = turn + 1
        bid = batch_id or f"{self.session_id}-{next(self._batches)}"
        traceparent, tracestate = current_traceparent()
        request = pb.EvaluateRequest(
            batch_id=bid,
            context=pb.BatchContext(session_id=self.session_id, turn_index=turn,
                                    model_text=model_text, metadata=self.metadata),
            calls=[c.proto() for c in normalized],
            traceparent=traceparent, tracestate=tracestate)
        return normalized, request

    def _results_request(self, results: Sequence[ToolResultLike], batch_id: Optional[str],
                         ) -> tuple[list[ToolResult], pb.EvaluateRequest]:
        normalized = [ToolResult.of(r) for r in results]
        bid = batch_id or f"{self.session_id}-{next(self._batches)}"
        traceparent, tracestate = current_traceparent()
        request = pb.EvaluateRequest(
            batch_id=bid,
            context=pb.BatchContext(session_id=self.session_id,
                                    turn_index=max(self.turn_index - 1, 0),
                                    metadata=self.metadata),
            results=[r.proto() for r in normalized],
            traceparent=traceparent, tracestate=tracestate)
        return normalized, request


class Session(_SessionBase):
    """One agent session (conversation) on a :class:`Coordinator`."""

    def __init__(self, coordinator: "Coordinator", session_id: str,
                 metadata: Mapping[str, str], timeout: Optional[float]):
        super().__init__(session_id, metadata, timeout)
        self._coordinator = coordinator

    def evaluate(self, calls: Sequence[CallLike], *, model_text: str = "",
                 turn_index: Optional[int] = None, batch_id: Optional[str] = None,
                 timeout: Optional[float] = None) -> BatchResult:
        """Judges one round of calls; raises :class:`BatchRefused` when the
        batch gets no decision. Without calls, answers at once with no RPC (R1).
        ``turn_index`` defaults to counting the session's rounds from 0."""
        normalized, request = self._request(calls, model_text, turn_index, batch_id)
        if not normalized:
            return BatchResult(request.batch_id, ())
        answer = self._evaluate_batch(request, timeout)
        return _result(request.batch_id, normalized, answer)

    def evaluate_results(self, results: Sequence[ToolResultLike], *,
                         batch_id: Optional[str] = None,
                         timeout: Optional[float] = None) -> BatchResult:
        """Judges the results of calls that ran, before the model reads them
        (R33); ``BatchResult.results`` says what the model reads of each.
        Raises :class:`BatchRefused` when the mesh refuses them (a result
        that is not a CallToolResult, over ``limits.max_result_bytes``...).
        Without results, answers at once with no RPC."""
        normalized, request = self._results_request(results, batch_id)
        if not normalized:
            return BatchResult(request.batch_id, ())
        answer = self._evaluate_batch(request, timeout)
        return _results_answer(request.batch_id, normalized, answer)

    def _evaluate_batch(self, request: pb.EvaluateRequest,
                        timeout: Optional[float]) -> pb.BatchDecision:
        """One ``EvaluateBatch`` call; a gRPC error is the batch refused."""
        coordinator = self._coordinator
        try:
            answer: pb.BatchDecision = coordinator._stub.EvaluateBatch(
                request, timeout=timeout or self.timeout or coordinator.timeout,
                metadata=coordinator.credentials.metadata())
        except grpc.RpcError as err:
            raise BatchRefused(err.code(), err.details() or "") from None
        return answer


class Coordinator:
    """A blocking client of the mesh's ``PreToolService``.

    ``target`` is ``host:port`` (or ``http://`` / ``https://host:port``).
    TLS: ``ca_file`` (the CA of the mesh's certificate), ``cert_file`` and
    ``key_file`` for mTLS, ``tls_domain`` to verify another name. Token:
    ``token``, ``token_file``, else the ``GUARDMESH_TOKEN`` variable. Every
    call carries them (R24). ``timeout`` is each batch's default deadline in
    seconds (R14). Options are keyword-only: a misspelled one is a TypeError.
    """

    def __init__(self, target: str, *, ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None, key_file: Optional[str] = None,
                 token: Optional[str] = None, token_file: Optional[str] = None,
                 tls_domain: Optional[str] = None, timeout: Optional[float] = 30.0,
                 credentials: Optional[MeshCredentials] = None):
        if credentials is not None and any(
                v is not None for v in (ca_file, cert_file, key_file, token, token_file,
                                        tls_domain)):
            raise TypeError("give credentials or the TLS/token options, not both")
        self.credentials = credentials or MeshCredentials.create(
            ca_file=ca_file, cert_file=cert_file, key_file=key_file, token=token,
            token_file=token_file, tls_domain=tls_domain)
        self.target = target
        self.timeout = timeout
        self._channel = self.credentials.channel(target)
        self._stub = pb_grpc.PreToolServiceStub(self._channel)

    def session(self, session_id: Optional[str] = None, *,
                metadata: Optional[Mapping[str, str]] = None,
                timeout: Optional[float] = None) -> Session:
        """A session (a new random id by default); ``metadata`` (tenant,
        user, agent...) goes with every batch to the guards."""
        return Session(self, session_id or uuid.uuid4().hex, metadata or {}, timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSession(_SessionBase):
    """One agent session on an :class:`AsyncCoordinator`."""

    def __init__(self, coordinator: "AsyncCoordinator", session_id: str,
                 metadata: Mapping[str, str], timeout: Optional[float]):
        super().__init__(session_id, metadata, timeout)
        self._coordinator = coordinator

    async def evaluate(self, calls: Sequence[CallLike], *, model_text: str = "",
                       turn_index: Optional[int] = None, batch_id: Optional[str] = None,
                       timeout: Optional[float] = None) -> BatchResult:
        """As :meth:`Session.evaluate`."""
        normalized, request = self._request(calls, model_text, turn_index, batch_id)
        if not normalized:
            return BatchResult(request.batch_id, ())
        coordinator = self._coordinator
        try:
            answer = await coordinator._stub.EvaluateBatch(
                request, timeout=timeout or self.timeout or coordinator.timeout,
                metadata=coordinator.credentials.metadata())
        except grpc.aio.AioRpcError as err:
            raise BatchRefused(err.code(), err.details() or "") from None
        return _result(request.batch_id, normalized, answer)

    async def evaluate_results(self, results: Sequence[ToolResultLike], *,
                               batch_id: Optional[str] = None,
                               timeout: Optional[float] = None) -> BatchResult:
        """As :meth:`Session.evaluate_results`."""
        normalized, request = self._results_request(results, batch_id)
        if not normalized:
            return BatchResult(request.batch_id, ())
        coordinator = self._coordinator
        try:
            answer = await coordinator._stub.EvaluateBatch(
                request, timeout=timeout or self.timeout or coordinator.timeout,
                metadata=coordinator.credentials.metadata())
        except grpc.aio.AioRpcError as err:
            raise BatchRefused(err.code(), err.details() or "") from None
        return _results_answer(request.batch_id, normalized, answer)


class AsyncCoordinator:
    """An asyncio client of the mesh's ``PreToolService``; options as
    :class:`Coordinator`. Create it inside the running event loop."""

    def __init__(self, target: str, *, ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None, key_file: Optional[str] = None,
                 token: Optional[str] = None, token_file: Optional[str] = None,
                 tls_domain: Optional[str] = None, timeout: Optional[float] = 30.0,
                 credentials: Optional[MeshCredentials] = None):
        if credentials is not None and any(
                v is not None for v in (ca_file, cert_file, key_file, token, token_file,
                                        tls_domain)):
            raise TypeError("give credentials or the TLS/token options, not both")
        self.credentials = credentials or MeshCredentials.create(
            ca_file=ca_file, cert_file=cert_file, key_file=key_file, token=token,
            token_file=token_file, tls_domain=tls_domain)
        self.target = target
        self.timeout = timeout
        self._channel = self.credentials.aio_channel(target)
        self._stub = pb_grpc.PreToolServiceStub(self._channel)

    def session(self, session_id: Optional[str] = None, *,
                metadata: Optional[Mapping[str, str]] = None,
                timeout: Optional[float] = None) -> AsyncSession:
        return AsyncSession(self, session_id or uuid.uuid4().hex, metadata or {}, timeout)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncCoordinator":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
