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
            else:                             # Steer, Cancel or Ask
                reply(decision.call_id, decision.content)

:class:`AsyncCoordinator` is the same for asyncio (``await session.evaluate``).

Approvals (R35): a guard may *ask* a person first. The call's decision is
then an :class:`Ask` carrying its :class:`ApprovalRequest`; once an approver
(:class:`Approver`, or ``guardmesh approvals approve ID``) approves it,
``session.resubmit(ask)`` sends the same call again naming the approval, and
it proceeds (once) if the guards after the one that asked let it.

Results (R33): once the calls ran, ``session.evaluate_results([...])`` sends
their results (MCP ``CallToolResult`` JSON) through the mesh before the model
reads them; each :class:`ResultDecision` says what the model reads.
A round without calls is answered at once without contacting the mesh (R1).
With OpenTelemetry installed, each batch carries the current span's W3C
trace context, so the mesh and every guard join the agent's trace (R22).
"""

from __future__ import annotations

import builtins
import dataclasses
import itertools
import json
import uuid
from typing import Any, Mapping, Optional, Sequence, Union, cast

import grpc
import grpc.aio

from guardmesh._common import MeshCredentials
from guardmesh._tracing import current_traceparent
from guardmesh.v1 import guardmesh_pb2 as pb
from guardmesh.v1 import guardmesh_pb2_grpc as pb_grpc

__all__ = [
    "ApprovalRefused",
    "ApprovalRequest",
    "Approver",
    "Ask",
    "AsyncApprover",
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
    #: When the batch named an approval for this call that did not hold:
    #: why (R35); the approval was not used.
    approval_refused: str = ""
    #: When an approval stood in for a guard's ask: the approval request's
    #: id, now used (R35).
    approved_by_request: str = ""

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
    #: When the batch named an approval for this call that did not hold:
    #: why (R35); the approval was not used.
    approval_refused: str = ""


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
    #: When the batch named an approval for this call that did not hold:
    #: why (R35); the approval was not used.
    approval_refused: str = ""


@dataclasses.dataclass(frozen=True)
class ApprovalRequest:
    """What a person is asked to approve (R35), and everything its approval
    is bound to: the call's digest, the session, the chain revision, the
    guard that asked and the expiry."""

    #: The request's id: what an approver answers, and what
    #: :meth:`Session.resubmit` sends back.
    id: str
    #: The guard that asked, and its reason.
    guard: str
    reason: str
    #: SHA-256 (hex) of the call as the guard judged it (tool and canonical
    #: arguments).
    digest: str
    session_id: str
    chain_revision: int
    #: When the request expires, in milliseconds since the Unix epoch.
    expires_at_ms: int
    #: "pending", "approved", "denied", "used" or "expired".
    state: str
    #: The call as the guard judged it, or None when the mesh sent none.
    call: Optional[Call] = None
    asked_at_ms: int = 0
    #: The identity that asked (empty on a mesh without identities).
    asked_by: str = ""
    #: For an answered request: the approver's identity and note.
    answered_by: str = ""
    note: str = ""

    @classmethod
    def of(cls, request: pb.ApprovalRequest) -> "ApprovalRequest":
        return cls(request.id, request.guard, request.reason, request.digest,
                   request.session_id, request.chain_revision, request.expires_at_ms,
                   _enum_name(_APPROVAL_STATES, "APPROVAL_STATE_", request.state),
                   Call.of(request.call) if request.HasField("call") else None,
                   request.asked_at_ms, request.asked_by, request.answered_by, request.note)


@dataclasses.dataclass(frozen=True)
class Ask:
    """Do not run the call yet: a guard asks a person to approve it (R35).
    The model reads ``content`` meanwhile. Once ``approval`` is approved,
    :meth:`Session.resubmit` sends the same call again naming it. An ask is
    never a proceed: the call is not in :attr:`BatchResult.execute`."""

    call_id: str
    content: str
    #: The guard that asked.
    decided_by: str
    call: Call
    original: Call
    approval: ApprovalRequest
    #: When the batch named an approval for this call that did not hold
    #: (used, expired, another session...): why; the guard asked again.
    approval_refused: str = ""


Decision = Union[Proceed, Steer, Cancel, Ask]


@dataclasses.dataclass(frozen=True)
class GuardTrace:
    """What one guard of the chain did for the batch (R21)."""

    guard: str
    #: "validate" or "mutate".
    role: str
    #: "proceeded", "skipped", "rewrote", "not_applicable", "superseded",
    #: "failed", "timed_out", "malformed", "rejected_rewrite", "dry_run",
    #: "asked" (R35).
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
    #: R35: the calls it asked about (also in ``skipped_call_ids``), and
    #: the calls it was not sent because an approval of its ask stood in.
    asked_call_ids: tuple[str, ...] = ()
    approved_call_ids: tuple[str, ...] = ()


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
        """The calls to run: the final call of every Proceed, in order (never
        a call of an :class:`Ask`)."""
        return tuple(d.call for d in self.decisions if isinstance(d, Proceed))

    def __getitem__(self, call_id: str) -> Decision:
        for decision in self.decisions:
            if decision.call_id == call_id:
                return decision
        raise KeyError(call_id)


class ApprovalRefused(Exception):
    """The mesh refused an approver's call (R35): NOT_FOUND for an unknown
    id, FAILED_PRECONDITION for a request already answered or expired,
    PERMISSION_DENIED for the identity that asked (or a caller without the
    approver role), UNAVAILABLE when the store or the mesh cannot be
    reached. Nothing was approved or denied."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


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


_APPROVAL_STATES: dict[int, str] = {int(v): k for k, v in pb.ApprovalState.items()}


def _decision(d: pb.CallDecision) -> Decision:
    call = Call.of(d.call)
    original = Call.of(d.original) if d.HasField("original") else call
    refused = d.approval_refused
    if d.action == pb.ACTION_PROCEED:
        return Proceed(d.call_id, call, original, tuple(d.rewritten_by), tuple(d.bypassed),
                       refused, d.approved_by_request)
    if d.action == pb.ACTION_CANCEL:
        return Cancel(d.call_id, d.content, d.decided_by, call, original, d.failure, refused)
    if d.action == pb.ACTION_STEER:
        return Steer(d.call_id, d.content, d.decided_by, call, original, d.failure, refused)
    if d.action == pb.ACTION_ASK:
        if d.HasField("approval") and d.approval.id:
            return Ask(d.call_id, d.content, d.decided_by, call, original,
                       ApprovalRequest.of(d.approval), refused)
        # An ask is never a proceed (R35); without its request there is
        # nothing to approve.
        return Cancel(d.call_id, d.content or
                      f"the mesh asked about call {d.call_id!r} without an approval request",
                      d.decided_by, call, original, True, refused)
    # Never sent by the mesh; a client must not run such a call.
    return Cancel(d.call_id, d.content or f"the mesh gave no action for call {d.call_id!r}",
                  d.decided_by, call, original, True, refused)


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
                   tuple((c.call_id, t.rules[c.call_id]) for c in calls if c.call_id in t.rules),
                   tuple(t.asked_call_ids), tuple(t.approved_call_ids))
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


def _credentials(credentials: Optional[MeshCredentials], *, ca_file: Optional[str],
                 cert_file: Optional[str], key_file: Optional[str], token: Optional[str],
                 token_file: Optional[str], tls_domain: Optional[str]) -> MeshCredentials:
    """A client's credentials: ``credentials``, or made from the options."""
    if credentials is not None and any(
            v is not None for v in (ca_file, cert_file, key_file, token, token_file,
                                    tls_domain)):
        raise TypeError("give credentials or the TLS/token options, not both")
    return credentials or MeshCredentials.create(
        ca_file=ca_file, cert_file=cert_file, key_file=key_file, token=token,
        token_file=token_file, tls_domain=tls_domain)


class _SessionBase:
    def __init__(self, session_id: str, metadata: Mapping[str, str], timeout: Optional[float]):
        self.session_id = session_id
        self.metadata = dict(metadata)
        self.timeout = timeout
        self.turn_index = 0
        self._batches = itertools.count(1)

    def _request(self, calls: Sequence[CallLike], model_text: str,
                 turn_index: Optional[int], batch_id: Optional[str],
                 approvals: Optional[Mapping[str, str]] = None,
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
            traceparent=traceparent, tracestate=tracestate,
            approvals=dict(approvals or {}))
        return normalized, request

    @staticmethod
    def _resubmission(ask: Ask) -> tuple[list[CallLike], dict[str, str]]:
        if not isinstance(ask, Ask):
            raise TypeError(f"resubmit takes an Ask decision, not {type(ask).__name__}")
        return [ask.original], {ask.call_id: ask.approval.id}

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
                 timeout: Optional[float] = None,
                 approvals: Optional[Mapping[str, str]] = None) -> BatchResult:
        """Judges one round of calls; raises :class:`BatchRefused` when the
        batch gets no decision. Without calls, answers at once with no RPC (R1).
        ``turn_index`` defaults to counting the session's rounds from 0.

        ``approvals`` (R35) names, by call id, the approval request an
        earlier :class:`Ask` of that same call carried, once a person
        approved it: the guard that asked is then not consulted again for
        it. An approval that does not hold is not used, and the call's
        decision says why in ``approval_refused``; a call id that is not in
        the batch refuses it (INVALID_ARGUMENT)."""
        normalized, request = self._request(calls, model_text, turn_index, batch_id,
                                            approvals)
        if not normalized:
            return BatchResult(request.batch_id, ())
        answer = self._evaluate_batch(request, timeout)
        return _result(request.batch_id, normalized, answer)

    def resubmit(self, ask: Ask, *, model_text: str = "",
                 turn_index: Optional[int] = None, batch_id: Optional[str] = None,
                 timeout: Optional[float] = None) -> BatchResult:
        """Sends the call an :class:`Ask` was about again (its call id, tool
        and arguments as first sent), naming its approval request (R35).
        Approved and unused: the call proceeds if the guards after the one
        that asked let it (``Proceed.approved_by_request`` is the request's
        id). Denied or expired: cancelled. Still pending: an :class:`Ask`
        again. Used, or otherwise not holding: judged afresh, with
        ``approval_refused`` saying why."""
        calls, approvals = self._resubmission(ask)
        return self.evaluate(calls, model_text=model_text, turn_index=turn_index,
                             batch_id=batch_id, timeout=timeout, approvals=approvals)

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
        self.credentials = _credentials(credentials, ca_file=ca_file, cert_file=cert_file,
                                        key_file=key_file, token=token,
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
                       timeout: Optional[float] = None,
                       approvals: Optional[Mapping[str, str]] = None) -> BatchResult:
        """As :meth:`Session.evaluate`."""
        normalized, request = self._request(calls, model_text, turn_index, batch_id,
                                            approvals)
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

    async def resubmit(self, ask: Ask, *, model_text: str = "",
                       turn_index: Optional[int] = None, batch_id: Optional[str] = None,
                       timeout: Optional[float] = None) -> BatchResult:
        """As :meth:`Session.resubmit`."""
        calls, approvals = self._resubmission(ask)
        return await self.evaluate(calls, model_text=model_text, turn_index=turn_index,
                                   batch_id=batch_id, timeout=timeout, approvals=approvals)

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
        self.credentials = _credentials(credentials, ca_file=ca_file, cert_file=cert_file,
                                        key_file=key_file, token=token,
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


# ---------------------------------------------------------------------------
# Approvers (R35)
# ---------------------------------------------------------------------------

_APPROVAL_STATE_VALUES: dict[str, int] = {k: int(v) for k, v in pb.ApprovalState.items()}


def _list_request(state: Optional[str], session_id: str, limit: int) -> pb.ApprovalListRequest:
    value = 0
    if state:
        key = "APPROVAL_STATE_" + state.strip().upper()
        if key not in _APPROVAL_STATE_VALUES or key == "APPROVAL_STATE_UNSPECIFIED":
            choices = ", ".join(k[len("APPROVAL_STATE_"):].lower()
                                for k in _APPROVAL_STATE_VALUES if not k.endswith("UNSPECIFIED"))
            raise ValueError(f"unknown approval state {state!r}: expected one of {choices}")
        value = _APPROVAL_STATE_VALUES[key]
    if limit < 0:
        raise ValueError("limit must not be negative")
    return pb.ApprovalListRequest(state=cast("pb.ApprovalState.ValueType", value),
                                  session_id=session_id, limit=limit)


def _answered(response: pb.ApproveResponse) -> ApprovalRequest:
    if not response.HasField("request"):
        raise ApprovalRefused(grpc.StatusCode.INTERNAL,
                              "the mesh answered an approval without its request")
    return ApprovalRequest.of(response.request)


class Approver:
    """A blocking client of the mesh's ``ApprovalService`` (R35): where a
    person (or the tool they use) answers guards' asks. On a mesh with
    principals its credentials must carry the ``approver`` role (or
    ``admin``), and the identity that asked may not approve its own request.
    Options as :class:`Coordinator` (``timeout`` is each call's deadline).
    A refused call raises :class:`ApprovalRefused`. ::

        with Approver("127.0.0.1:50051") as approver:
            for request in approver.pending():
                approver.approve(request.id, note="checked with the customer")
    """

    def __init__(self, target: str, *, ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None, key_file: Optional[str] = None,
                 token: Optional[str] = None, token_file: Optional[str] = None,
                 tls_domain: Optional[str] = None, timeout: Optional[float] = 30.0,
                 credentials: Optional[MeshCredentials] = None):
        self.credentials = _credentials(credentials, ca_file=ca_file, cert_file=cert_file,
                                        key_file=key_file, token=token,
                                        token_file=token_file, tls_domain=tls_domain)
        self.target = target
        self.timeout = timeout
        self._channel = self.credentials.channel(target)
        self._stub = pb_grpc.ApprovalServiceStub(self._channel)

    def approve(self, id: str, note: str = "") -> ApprovalRequest:
        """Approves the pending request ``id``: the same call may then run
        once. Returns the request as it now stands."""
        return self._answer(id, True, note)

    def deny(self, id: str, note: str = "") -> ApprovalRequest:
        """Denies the pending request ``id``: the call is cancelled when it
        comes back with it."""
        return self._answer(id, False, note)

    def _answer(self, id: str, approve: bool, note: str) -> ApprovalRequest:
        try:
            response: pb.ApproveResponse = self._stub.Approve(
                pb.ApproveRequest(id=id, approve=approve, note=note), timeout=self.timeout,
                metadata=self.credentials.metadata())
        except grpc.RpcError as err:
            raise ApprovalRefused(err.code(), err.details() or "") from None
        return _answered(response)

    def pending(self) -> builtins.list[ApprovalRequest]:
        """The requests waiting for a person, newest first."""
        return self.list("pending")

    def list(self, state: Optional[str] = None, session_id: str = "",
             limit: int = 0) -> builtins.list[ApprovalRequest]:
        """The requests in ``state`` ("pending", "approved", "denied",
        "used", "expired"; None: all) of ``session_id`` (empty: all
        sessions), at most ``limit`` (0: the mesh's default of 100),
        pending first, newest first."""
        request = _list_request(state, session_id, limit)
        try:
            response: pb.ApprovalListResponse = self._stub.List(
                request, timeout=self.timeout, metadata=self.credentials.metadata())
        except grpc.RpcError as err:
            raise ApprovalRefused(err.code(), err.details() or "") from None
        return [ApprovalRequest.of(r) for r in response.requests]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Approver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncApprover:
    """An asyncio :class:`Approver`; options as :class:`Coordinator`.
    Create it inside the running event loop."""

    def __init__(self, target: str, *, ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None, key_file: Optional[str] = None,
                 token: Optional[str] = None, token_file: Optional[str] = None,
                 tls_domain: Optional[str] = None, timeout: Optional[float] = 30.0,
                 credentials: Optional[MeshCredentials] = None):
        self.credentials = _credentials(credentials, ca_file=ca_file, cert_file=cert_file,
                                        key_file=key_file, token=token,
                                        token_file=token_file, tls_domain=tls_domain)
        self.target = target
        self.timeout = timeout
        self._channel = self.credentials.aio_channel(target)
        self._stub = pb_grpc.ApprovalServiceStub(self._channel)

    async def approve(self, id: str, note: str = "") -> ApprovalRequest:
        """As :meth:`Approver.approve`."""
        return await self._answer(id, True, note)

    async def deny(self, id: str, note: str = "") -> ApprovalRequest:
        """As :meth:`Approver.deny`."""
        return await self._answer(id, False, note)

    async def _answer(self, id: str, approve: bool, note: str) -> ApprovalRequest:
        try:
            response = await self._stub.Approve(
                pb.ApproveRequest(id=id, approve=approve, note=note), timeout=self.timeout,
                metadata=self.credentials.metadata())
        except grpc.aio.AioRpcError as err:
            raise ApprovalRefused(err.code(), err.details() or "") from None
        return _answered(response)

    async def pending(self) -> builtins.list[ApprovalRequest]:
        """As :meth:`Approver.pending`."""
        return await self.list("pending")

    async def list(self, state: Optional[str] = None, session_id: str = "",
                   limit: int = 0) -> builtins.list[ApprovalRequest]:
        """As :meth:`Approver.list`."""
        request = _list_request(state, session_id, limit)
        try:
            response = await self._stub.List(
                request, timeout=self.timeout, metadata=self.credentials.metadata())
        except grpc.aio.AioRpcError as err:
            raise ApprovalRefused(err.code(), err.details() or "") from None
        return [ApprovalRequest.of(r) for r in response.requests]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncApprover":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
