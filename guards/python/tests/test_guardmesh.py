"""The Python package against a real ``guardmesh serve`` process: guards
(sync and asyncio) and coordinators (sync and asyncio), no mocks. Rule
numbers refer to SPEC.md."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any, Iterator, Optional

import grpc
import pytest

from conftest import Mesh
from guardmesh import (
    AsyncCoordinator,
    BatchRefused,
    Cancel,
    Coordinator,
    MeshCredentials,
    Proceed,
    Steer,
)
from guardmesh import guard as gg
from guardmesh import guard_aio


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def no_delete(batch: gg.Batch) -> Iterator[gg.pb.Verdict]:
    """Cancels fs.delete, steers calls without a path, proceeds otherwise."""
    for call in batch.calls:
        if call.tool == "fs.delete":
            yield gg.cancel(call.call_id, "Deleting files is not allowed.")
        elif call.args is not None and "path" not in call.args:
            yield gg.steer(call.call_id, "Give a path.")


@pytest.fixture
def sync_guard(mesh: Mesh) -> Iterator[gg.GuardServer]:
    server, port = gg.serve(no_delete, name="py-no-delete")
    gg.register(mesh.addr, "py-no-delete", port, timeout_ms=5000)
    yield server
    server.stop(0).wait(5)


CALLS: list[dict[str, Any]] = [
    {"call_id": "c1", "tool": "fs.read", "arguments": {"path": "a.txt"}},
    {"call_id": "c2", "tool": "fs.delete", "arguments": '{"path": "a.txt"}'},
    {"call_id": "c3", "tool": "fs.read", "arguments": {}},
]


def check_decisions(result: Any, guard: str) -> None:
    # R2: one decision per call, in order; R3/R6: per call; R7: steer kind.
    assert [d.call_id for d in result.decisions] == ["c1", "c2", "c3"]
    c1, c2, c3 = result.decisions
    assert isinstance(c1, Proceed) and c1.call.tool == "fs.read"
    assert json.loads(c1.call.arguments) == {"path": "a.txt"}
    assert isinstance(c2, Cancel) and c2.content == "Deleting files is not allowed."
    assert c2.decided_by == guard and not c2.failure
    assert isinstance(c3, Steer) and c3.content == "Give a path." and c3.decided_by == guard
    assert [c.call_id for c in result.execute] == ["c1"]
    # R21: one trace entry per guard of the chain.
    assert [(t.guard, t.status) for t in result.trace] == [(guard, "skipped")]
    assert result.trace[0].skipped_call_ids == ("c2", "c3")
    assert result.chain_revision is not None and result.chain_revision >= 1


def test_sync_coordinator_gets_typed_decisions_from_a_sync_guard(
        mesh: Mesh, sync_guard: gg.GuardServer) -> None:
    """R2, R3, R6, R7, R21 through the sync guard kit and the sync client."""
    with Coordinator(mesh.addr) as coordinator:
        session = coordinator.session("s-1", metadata={"tenant": "t"})
        check_decisions(session.evaluate(CALLS), "py-no-delete")
        assert session.turn_index == 1


def test_async_coordinator_gets_typed_decisions_from_an_asyncio_guard(mesh: Mesh) -> None:
    """R2, R3, R7 through guardmesh.guard_aio and AsyncCoordinator; a batch
    cancelled by the mesh is not answered (the kit cancels its task)."""
    async def judge(batch: gg.Batch) -> list[gg.pb.Verdict]:
        await asyncio.sleep(0.01)  # judged in its own task
        return list(no_delete(batch))

    async def scenario() -> None:
        server, port = await guard_aio.serve(judge, name="aio-no-delete")
        try:
            response = await guard_aio.register(mesh.addr, "aio-no-delete", port)
            assert response.created
            async with AsyncCoordinator(mesh.addr) as coordinator:
                session = coordinator.session()
                results = await asyncio.gather(
                    *(session.evaluate(CALLS, batch_id=f"b{i}") for i in range(5)))
                for result in results:
                    check_decisions(result, "aio-no-delete")
            assert await guard_aio.deregister(mesh.addr, "aio-no-delete")
        finally:
            await server.stop(0)

    asyncio.run(scenario())


POLICY = """
[[rule]]
name = "no-deletes"
tools = ["fs.*"]
when = "call.tool == 'fs.delete'"
action = "cancel"
message = "'no deletes: ' + call.args.path"
"""


def test_policy_guard_registered_from_python_judges_in_the_mesh(mesh: Mesh) -> None:
    """R27: a policy team registers rules, not a service; the trace names
    the rule. A policy that does not compile is refused, naming the line."""
    response = gg.register_policy(mesh.addr, "py-policy", POLICY, tools="fs.*")
    assert response.created
    with Coordinator(mesh.addr) as coordinator:
        result = coordinator.session().evaluate(CALLS[:2])
    c1, c2 = result.decisions
    assert isinstance(c1, Proceed)
    assert isinstance(c2, Cancel) and c2.content == "no deletes: a.txt"
    assert c2.decided_by == "py-policy"
    assert [(t.guard, t.status, t.rules) for t in result.trace] == [
        ("py-policy", "skipped", (("c2", "no-deletes"),))]

    with pytest.raises(grpc.RpcError) as refused:
        gg.register_policy(mesh.addr, "py-broken",
                           POLICY.replace("call.tool ==", "call.tool.startswith('fs') &&"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "line 5" in details, details
    assert 'did you mean "startsWith"' in details, details
    with pytest.raises(TypeError):
        gg.register_policy(mesh.addr, "g", POLICY, endpoint="http://x")
    with pytest.raises(TypeError):
        gg.register_policy(mesh.addr, "g", "  \n")

    async def asynchronously() -> None:
        updated = await guard_aio.register_policy(mesh.addr, "py-policy", POLICY,
                                                  mode="dry_run")
        assert not updated.created
        assert await guard_aio.deregister(mesh.addr, "py-policy")

    asyncio.run(asynchronously())


def test_zero_calls_are_answered_without_an_rpc() -> None:
    """R1: a round without calls contacts nothing: here nothing listens at
    the target, and the answer still comes, empty, at once."""
    target = closed_port()
    with Coordinator(target, timeout=2) as coordinator:
        result = coordinator.session().evaluate([])
        assert result.decisions == () and result.execute == () and result.trace == ()
        assert result.chain_revision is None
        with pytest.raises(BatchRefused) as refused:  # a real call does fail there
            coordinator.session().evaluate(CALLS[:1])
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE

    async def scenario() -> None:
        async with AsyncCoordinator(target, timeout=2) as coordinator:
            result = await coordinator.session().evaluate([])
            assert result.decisions == () and result.chain_revision is None

    asyncio.run(scenario())


def test_mutate_guard_rewrite_is_the_call_to_run(mesh: Mesh) -> None:
    """R10, R12: the decision carries the original and the final call and
    names the guard that rewrote it."""
    def mask(batch: gg.Batch) -> Iterator[gg.pb.Verdict]:
        for call in batch.calls:
            if call.args and "password" in call.args:
                yield gg.rewrite(call.call_id, arguments={**call.args, "password": "***"})

    server, port = gg.serve(mask, name="masker")
    try:
        gg.register(mesh.addr, "masker", port, role="mutate", grant_tools="*")
        with Coordinator(mesh.addr) as coordinator:
            result = coordinator.session().evaluate(
                [{"call_id": "c1", "tool": "login", "arguments": {"password": "hunter2"}}])
        (decision,) = result.decisions
        assert isinstance(decision, Proceed) and decision.rewritten
        assert decision.call.args == {"password": "***"}
        assert decision.original.args == {"password": "hunter2"}
        assert decision.rewritten_by == ("masker",)
        assert result.trace[0].status == "rewrote"
    finally:
        server.stop(0).wait(5)


def test_refused_batch_raises_and_names_the_call(mesh: Mesh) -> None:
    """R20: duplicate call ids and non-object arguments are refused with
    INVALID_ARGUMENT; no decision is invented."""
    with Coordinator(mesh.addr) as coordinator:
        session = coordinator.session()
        with pytest.raises(BatchRefused) as refused:
            session.evaluate([{"call_id": "x", "tool": "a"}, {"call_id": "x", "tool": "b"}])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(BatchRefused) as refused:
            session.evaluate([{"call_id": "y", "tool": "a", "arguments": "[1]"}])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "y" in refused.value.message


def test_traceparent_comes_from_the_current_span(mesh: Mesh) -> None:
    """R22: the coordinator sends the current OpenTelemetry span's W3C
    context; the guard's batch carries the same trace id."""
    trace_api = pytest.importorskip("opentelemetry.trace")
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    seen: list[str] = []

    def record(batch: gg.Batch) -> None:
        seen.append(batch.traceparent)

    server, port = gg.serve(record, name="recorder")
    try:
        gg.register(mesh.addr, "recorder", port)
        tracer = sdk.TracerProvider().get_tracer("test")
        with tracer.start_as_current_span("agent.round") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            with Coordinator(mesh.addr) as coordinator:
                result = coordinator.session().evaluate([{"call_id": "c", "tool": "t"}])
        assert isinstance(result.decisions[0], Proceed)
        assert len(seen) == 1 and seen[0].split("-")[1] == trace_id, (seen, trace_id)
        assert trace_api is not None
    finally:
        server.stop(0).wait(5)


def test_misspelled_options_are_errors(mesh: Mesh) -> None:
    """Options are checked: a misspelling is a TypeError, never ignored."""
    with pytest.raises(TypeError):
        Coordinator(mesh.addr, tokn="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        gg.register(mesh.addr, "g", 1, rol="mutate")
    with pytest.raises(TypeError):
        gg.argument_parser(nmae="x")
    with pytest.raises(ValueError):
        gg.register(mesh.addr, "g", 1, failure_policy="fail_opne")
    with pytest.raises(TypeError):
        with Coordinator(mesh.addr) as coordinator:
            coordinator.session().evaluate([{"call_id": "c", "tool": "t", "args": "{}"}])
    with pytest.raises(ValueError):
        MeshCredentials(cert_file="c.pem", key_file="k.pem")  # mTLS without TLS


def test_guard_serves_grpc_health(sync_guard: gg.GuardServer) -> None:
    """The kit serves grpc.health.v1.Health (overall and GuardService)."""
    with grpc.insecure_channel(f"127.0.0.1:{sync_guard.port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        assert check(b"", timeout=5) == b"\x08\x01"  # SERVING
        service = gg.GUARD_SERVICE.encode()
        assert check(b"\x0a" + bytes([len(service)]) + service, timeout=5) == b"\x08\x01"
        with pytest.raises(grpc.RpcError) as err:
            check(b"\x0a\x03nope", timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def mtls_config(certs: Path, token: Optional[str] = None) -> str:
    return f"""
[tls]
cert_file = "{certs}/mesh.pem"
key_file = "{certs}/mesh-key.pem"
client_ca_file = "{certs}/ca.pem"

[auth]
[[auth.principal]]
id = "spiffe://guardmesh.local/coordinator"
roles = ["evaluate"]

[[auth.principal]]
id = "spiffe://guardmesh.local/registrar"
roles = ["register"]
"""


def test_mtls_for_registering_and_evaluating(certs: Path) -> None:
    """R24: with a client CA, the registrar's and the coordinator's
    certificates are sent on every call; without one the call is refused."""
    mesh = Mesh(mtls_config(certs))
    try:
        ca = str(certs / "ca.pem")
        registrar = MeshCredentials(ca_file=ca, cert_file=str(certs / "registrar.pem"),
                                    key_file=str(certs / "registrar-key.pem"),
                                    tls_domain="localhost")
        server, port = gg.serve(no_delete, name="tls-guard")
        try:
            gg.register(mesh.addr, "tls-guard", port, credentials=registrar)
            with Coordinator(mesh.addr, ca_file=ca, cert_file=str(certs / "coordinator.pem"),
                             key_file=str(certs / "coordinator-key.pem"),
                             tls_domain="localhost") as coordinator:
                check_decisions(coordinator.session().evaluate(CALLS), "tls-guard")
            with Coordinator(mesh.addr, ca_file=ca, tls_domain="localhost",
                             timeout=5) as anonymous:
                with pytest.raises(BatchRefused):
                    anonymous.session().evaluate(CALLS)
        finally:
            server.stop(0).wait(5)
    finally:
        mesh.stop()


def test_bearer_token_for_registering_and_evaluating(tmp_path: Path) -> None:
    """R24: a token principal; the token goes on register and evaluate,
    and a call without it is refused."""
    (tmp_path / "ci.token").write_text("a-long-random-token-for-tests\n")
    mesh = Mesh(f"""
[auth]
plaintext_tokens_on_loopback = true
[[auth.principal]]
id = "ci"
token_file = "{tmp_path}/ci.token"
roles = ["evaluate", "register"]
""")
    try:
        token_file = str(tmp_path / "ci.token")
        server, port = gg.serve(no_delete, name="token-guard")
        try:
            with pytest.raises(grpc.RpcError):
                gg.register(mesh.addr, "token-guard", port, timeout=5)
            gg.register(mesh.addr, "token-guard", port,
                        credentials=MeshCredentials.create(token_file=token_file))
            with Coordinator(mesh.addr, token_file=token_file) as coordinator:
                check_decisions(coordinator.session().evaluate(CALLS), "token-guard")
            with Coordinator(mesh.addr, timeout=5,
                             credentials=MeshCredentials(token=None)) as anonymous:
                with pytest.raises(BatchRefused) as refused:
                    anonymous.session().evaluate(CALLS)
                assert refused.value.code in (grpc.StatusCode.UNAUTHENTICATED,
                                              grpc.StatusCode.PERMISSION_DENIED)
        finally:
            server.stop(0).wait(5)
    finally:
        mesh.stop()
