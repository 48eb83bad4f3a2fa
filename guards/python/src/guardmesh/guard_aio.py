"""The guard kit for asyncio: the judge is a coroutine function ::

    async def judge(batch: Batch) -> Iterable[Verdict] | None

Each batch of a Judge stream is judged in its own task, so batches are
judged concurrently and answered in whatever order they finish, each exactly
once; a ``CancelBatch`` cancels its task (R5), and the answer is not sent.
Verdicts, argument checks (unreadable arguments are steered, never shown to
the judge), tracing (R22), health and registration are those of
:mod:`guardmesh.guard`::

    import asyncio
    from guardmesh import guard, guard_aio

    async def judge(batch):
        return [guard.cancel(c.call_id, "No deletes.")
                for c in batch.calls if c.tool == "fs.delete"]

    async def main():
        server, port = await guard_aio.serve(judge, name="no-delete")
        await guard_aio.register("127.0.0.1:50051", "no-delete", port)
        await server.wait_for_termination()

    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import grpc
import grpc.aio

from guardmesh import _health
from guardmesh._common import MeshCredentials
from guardmesh._tracing import extract_context, server_kind, tracer
from guardmesh.guard import (
    GUARD_SERVICE,
    Batch,
    ServerTls,
    Verdicts,
    _span_attributes,
    _span_outcome,
    conforming,
    policy_registration,
    registration,
    steer,
)
from guardmesh.v1 import guardmesh_pb2 as pb
from guardmesh.v1 import guardmesh_pb2_grpc as pb_grpc

__all__ = ["AsyncGuardServer", "AsyncJudgeFn", "deregister", "register", "register_policy",
           "serve"]

log = logging.getLogger("guardmesh.guard")

#: An asyncio judge: a batch in, verdicts out.
AsyncJudgeFn = Callable[[Batch], Awaitable[Verdicts]]


async def _judge(judge_fn: AsyncJudgeFn, batch: Batch) -> pb.JudgeResponse:
    verdicts = [
        steer(c.call_id, f"The arguments of call {c.call_id!r} cannot be read as a JSON "
                         f"object ({c.error}); guard {batch.guard!r} did not judge them. "
                         "Send them as a plain JSON object.")
        for c in batch.unreadable
    ]
    try:
        if batch.calls:
            span_tracer = tracer("guardmesh.guard")
            if span_tracer is None:
                verdicts += conforming(batch, await judge_fn(batch))
            else:
                parent = extract_context(batch.traceparent, batch.tracestate)
                with span_tracer.start_as_current_span(
                        "guard.judge", context=parent, kind=server_kind(),
                        attributes=_span_attributes(batch)) as span:
                    judged = conforming(batch, await judge_fn(batch))
                    _span_outcome(span, batch, judged)
                    verdicts += judged
    except asyncio.CancelledError:
        raise
    except Exception as err:
        log.exception("judge failed on batch %r (request %d)", batch.batch_id, batch.request_id)
        return pb.JudgeResponse(request_id=batch.request_id, error=f"{type(err).__name__}: {err}")
    return pb.JudgeResponse(request_id=batch.request_id, verdicts=verdicts)


class _AsyncGuardServicer(pb_grpc.GuardServiceServicer):
    def __init__(self, judge_fn: AsyncJudgeFn, name: str):
        self.judge_fn = judge_fn
        self.name = name

    async def Judge(self, request_iterator: AsyncIterator[pb.JudgeRequest],
                    context: grpc.aio.ServicerContext[pb.JudgeRequest, pb.JudgeResponse],
                    ) -> AsyncIterator[pb.JudgeResponse]:
        await context.send_initial_metadata(())
        outbox: asyncio.Queue[Optional[pb.JudgeResponse]] = asyncio.Queue()
        tasks: dict[int, asyncio.Task[None]] = {}

        async def judge_one(batch: Batch) -> None:
            response = await _judge(self.judge_fn, batch)
            if tasks.pop(batch.request_id, None) is not None:
                await outbox.put(response)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    kind = request.WhichOneof("kind")
                    if kind == "batch":
                        batch = Batch(request.batch, self.name)
                        if batch.request_id in tasks:
                            log.warning("ignoring request %d: already outstanding",
                                        batch.request_id)
                            continue
                        tasks[batch.request_id] = asyncio.ensure_future(judge_one(batch))
                    elif kind == "cancel":
                        task = tasks.pop(request.cancel.request_id, None)
                        if task is not None:
                            task.cancel()
            finally:
                if tasks:
                    await asyncio.gather(*tasks.values(), return_exceptions=True)
                await outbox.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await outbox.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()


class AsyncGuardServer:
    """A running asyncio guard."""

    def __init__(self, server: grpc.aio.Server, health: _health.Health, port: int, name: str):
        self.grpc_server = server
        self.port = port
        self.name = name
        self._health = health

    async def stop(self, grace: Optional[float] = 5.0) -> None:
        """Reports NOT_SERVING, then stops, letting streams finish for
        ``grace`` seconds."""
        self._health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)

    async def wait_for_termination(self, timeout: Optional[float] = None) -> bool:
        return await self.grpc_server.wait_for_termination(timeout)


async def serve(judge_fn: AsyncJudgeFn, port: int = 0, host: str = "127.0.0.1", *,
                name: str = "", tls: Optional[ServerTls] = None) -> tuple[AsyncGuardServer, int]:
    """Starts serving ``judge_fn``; returns (server, port). ``port=0`` picks
    a free port; ``tls`` serves TLS (mTLS with a client CA). Also serves
    ``grpc.health.v1.Health``."""
    server = grpc.aio.server()
    pb_grpc.add_GuardServiceServicer_to_server(_AsyncGuardServicer(judge_fn, name), server)
    health = _health.Health()
    server.add_generic_rpc_handlers((health.aio_handler(),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = (server.add_insecure_port(address) if tls is None
             else server.add_secure_port(address, tls.credentials()))
    if not bound:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    for service in ("", GUARD_SERVICE):
        health.set(service, _health.SERVING)
    log.info("guard %r serving on %s:%d", name, host, bound)
    return AsyncGuardServer(server, health, bound, name), bound


async def register(mesh_addr: str, name: str, port: int, *, timeout: float = 10.0,
                   credentials: Optional[MeshCredentials] = None,
                   **options: Any) -> pb.RegisterResponse:
    """As :func:`guardmesh.guard.register` (same keyword options; an unknown
    one is a TypeError), on an asyncio channel."""
    return await _register(mesh_addr, registration(name, port, **options), timeout,
                           credentials)


async def _register(mesh_addr: str, spec: pb.GuardSpec, timeout: float,
                    credentials: Optional[MeshCredentials]) -> pb.RegisterResponse:
    """Sends ``spec`` to the mesh's ``GuardRegistry.Register``."""
    credentials = credentials or MeshCredentials()
    async with credentials.aio_channel(mesh_addr) as channel:
        stub = pb_grpc.GuardRegistryStub(channel)
        response: pb.RegisterResponse = await stub.Register(
            pb.RegisterRequest(guard=spec), timeout=timeout, wait_for_ready=True,
            metadata=credentials.metadata())
    return response


async def register_policy(mesh_addr: str, name: str, source: str, *,
                          timeout: float = 10.0,
                          credentials: Optional[MeshCredentials] = None,
                          **options: Any) -> pb.RegisterResponse:
    """As :func:`guardmesh.guard.register_policy` (same keyword options; an
    unknown one is a TypeError), on an asyncio channel."""
    return await _register(mesh_addr, policy_registration(name, source, **options), timeout,
                           credentials)


async def deregister(mesh_addr: str, name: str, *, timeout: float = 5.0,
                     credentials: Optional[MeshCredentials] = None) -> bool:
    """Removes the guard ``name`` from the chain; True if it was there."""
    credentials = credentials or MeshCredentials()
    async with credentials.aio_channel(mesh_addr) as channel:
        stub = pb_grpc.GuardRegistryStub(channel)
        response: pb.DeregisterResponse = await stub.Deregister(
            pb.DeregisterRequest(name=name), timeout=timeout, metadata=credentials.metadata())
    return response.removed
