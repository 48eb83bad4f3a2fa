"""The guard kit for asyncio: the judge is a coroutine function ::

    async def judge(batch: Batch) -> Iterable[Verdict] | None

or, for a judge that reads the session's memory (R34), with a second
parameter named ``session`` (as in :mod:`guardmesh.guard`) ::

    async def judge(batch: Batch, session: SessionMemory | None) -> ...

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

    if __name__ == "__main__":
        guard_aio.main(judge, name="no-delete")

:func:`main` takes the sync kit's flags (``--port``, ``--mesh``, ``--name``,
``--role``, TLS, ...; ``--workers`` bounds the batches judged at once),
prints ``LISTENING <port>`` once serving and registered, and on SIGTERM or
SIGINT drains (no new streams; each open stream ends once what it was sent
is answered, for up to 5 s) and exits 0. To run the pieces yourself::

    async def serve_it():
        server, port = await guard_aio.serve(judge, name="no-delete")
        await server.register("127.0.0.1:50051", "no-delete")
        await server.wait_for_termination()

(``server.register`` registers the port served, asking for the session's
memory when the judge takes ``session``; :func:`register` takes the port
and ``session_memory`` as options.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Optional,
    Sequence,
    Union,
)

import grpc
import grpc.aio

from guardmesh import _health
from guardmesh._common import MeshCredentials
from guardmesh._tracing import extract_context, install_file_tracing, server_kind, tracer
from guardmesh.guard import (
    GUARD_SERVICE,
    Batch,
    Call,
    PolicyOptions,
    RegisterOptions,
    ServerTls,
    SessionMemory,
    Verdict,
    Verdicts,
    _batch_judge,
    _registration_failed,
    _setup_logging,
    _span_attributes,
    _span_outcome,
    argument_parser,
    conforming,
    credentials_from_args,
    policy_registration,
    reads_session,
    registration,
    registration_from_args,
    server_tls_from_args,
    steer,
)
from guardmesh.v1 import guardmesh_pb2 as pb
from guardmesh.v1 import guardmesh_pb2_grpc as pb_grpc

if sys.version_info >= (3, 11):
    from typing import Unpack
elif TYPE_CHECKING:  # only annotations use it, and they are not evaluated
    from typing_extensions import Unpack

__all__ = ["AsyncGuardServer", "AsyncJudgeFn", "Batch", "Call", "PolicyOptions",
           "RegisterOptions", "SessionMemory", "Verdict", "Verdicts", "argument_parser",
           "deregister", "main", "reads_session", "register", "register_policy", "run", "serve"]

log = logging.getLogger("guardmesh.guard")

#: An asyncio judge: a batch in, verdicts out. One that takes a second
#: parameter named ``session`` reads the session's memory (R34) and is
#: called with it (None when the batch carries none).
AsyncJudgeFn = Union[
    Callable[[Batch], Awaitable[Verdicts]],
    Callable[[Batch, Optional[SessionMemory]], Awaitable[Verdicts]],
]


async def _judge(judge_fn: Callable[[Batch], Awaitable[Verdicts]],
                 batch: Batch) -> pb.JudgeResponse:
    verdicts = [
        steer(c.call_id, f"The arguments of call {c.call_id!r} cannot be read as a JSON "
                         f"object ({c.error}); guard {batch.guard!r} did not judge them. "
                         "Send them as a plain JSON object.")
        for c in batch.unreadable
    ]
    try:
        if batch.calls or batch.results:
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
    def __init__(self, judge_fn: AsyncJudgeFn, name: str, workers: Optional[int] = None):
        self.judge_fn = judge_fn
        #: Whether the judge reads the session's memory (R34).
        self.reads_session = reads_session(judge_fn)
        self.judge_batch: Callable[[Batch], Awaitable[Verdicts]] = _batch_judge(judge_fn)
        self.name = name
        self.slots = asyncio.Semaphore(workers) if workers else None
        self.draining = asyncio.Event()
        #: The outboxes of the open Judge streams.
        self.streams: set[asyncio.Queue[Any]] = set()
        self.streams_changed = asyncio.Condition()

    async def _judge(self, batch: Batch) -> pb.JudgeResponse:
        if self.slots is None:
            return await _judge(self.judge_batch, batch)
        async with self.slots:
            return await _judge(self.judge_batch, batch)

    async def Judge(self, request_iterator: AsyncIterator[pb.JudgeRequest],
                    context: grpc.aio.ServicerContext[pb.JudgeRequest, pb.JudgeResponse],
                    ) -> AsyncIterator[pb.JudgeResponse]:
        if self.draining.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the guard is stopping")
        await context.send_initial_metadata(())
        # Answers, _WAKE (re-check whether draining is done), None (reader done).
        outbox: asyncio.Queue[Any] = asyncio.Queue()
        tasks: dict[int, asyncio.Task[None]] = {}

        async def judge_one(batch: Batch) -> None:
            response = await self._judge(batch)
            # Popping and queueing the answer happen in one step of the loop,
            # so "no task and an empty outbox" means nothing is outstanding.
            if tasks.pop(batch.request_id, None) is not None:
                outbox.put_nowait(response)

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
                outbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        async with self.streams_changed:
            self.streams.add(outbox)
        try:
            while (item := await outbox.get()) is not None:
                if isinstance(item, pb.JudgeResponse):
                    yield item
                if self.draining.is_set() and not tasks and outbox.empty():
                    break  # drained: end the stream with OK
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()
            async with self.streams_changed:
                self.streams.discard(outbox)
                self.streams_changed.notify_all()

    def drain(self) -> None:
        """Ends each stream (with OK) once it has no outstanding request;
        new streams are refused (UNAVAILABLE)."""
        self.draining.set()
        for outbox in self.streams:
            outbox.put_nowait(_WAKE)

    async def wait_drained(self, timeout: Optional[float]) -> bool:
        """Waits until no Judge stream is open; False on timeout."""
        async with self.streams_changed:
            try:
                await asyncio.wait_for(
                    self.streams_changed.wait_for(lambda: not self.streams), timeout)
            except asyncio.TimeoutError:
                return False
        return True


_WAKE = object()


class AsyncGuardServer:
    """A running asyncio guard."""

    def __init__(self, server: grpc.aio.Server, health: _health.Health, port: int, name: str,
                 servicer: Optional[_AsyncGuardServicer] = None, *, host: str = "127.0.0.1",
                 https: bool = False):
        self.grpc_server = server
        self.port = port
        self.name = name
        self.host = host
        #: Whether it serves TLS (its endpoint is then ``https://``).
        self.https = https
        #: ``"read"`` when its judge reads the session's memory (it takes
        #: ``session``), else ``"none"``: the ``session_memory`` it registers
        #: with (R34).
        self.session_memory: str = (
            "read" if servicer is not None and servicer.reads_session else "none")
        self._health = health
        self._servicer = servicer

    def registration(self, name: str, **options: Unpack[RegisterOptions]) -> pb.GuardSpec:
        """The ``GuardSpec`` :meth:`register` sends."""
        return registration(name, self.port, **self._options(options))

    async def register(self, mesh_addr: str, name: str, *, timeout: float = 10.0,
                       credentials: Optional[MeshCredentials] = None,
                       **options: Unpack[RegisterOptions]) -> pb.RegisterResponse:
        """Registers this guard, as :func:`register` does, at the port (and
        address, and TLS) it serves on, asking for the session's memory when
        its judge reads it (``session_memory`` is :attr:`session_memory`
        unless given; R34). Options as there."""
        return await _register(mesh_addr, self.registration(name, **options), timeout,
                               credentials)

    def _options(self, options: RegisterOptions) -> RegisterOptions:
        filled = RegisterOptions(host=self.host, https=self.https,
                                 session_memory=self.session_memory)
        filled.update(options)
        return filled

    def set_serving(self, serving: bool) -> None:
        """Reports SERVING or NOT_SERVING on ``grpc.health.v1.Health`` and
        keeps serving: a mesh sends a NOT_SERVING replica no new requests while
        its other replicas can take them (see ``GuardServer.set_serving``)."""
        status = _health.SERVING if serving else _health.NOT_SERVING
        for service in ("", GUARD_SERVICE):
            self._health.set(service, status)

    async def stop(self, grace: Optional[float] = 5.0) -> None:
        """Stops gracefully: reports NOT_SERVING, refuses new RPCs, lets each
        open Judge stream answer what it was sent (ending it with OK), then
        cancels what is left (health watches, say), at the latest after
        ``grace`` seconds (at once with ``grace`` 0 or None)."""
        self._health.enter_graceful_shutdown()
        if self._servicer is None or not grace:
            await self.grpc_server.stop(grace)
            return
        self._servicer.drain()
        stopping = asyncio.ensure_future(self.grpc_server.stop(grace))  # refuses new RPCs
        await self._servicer.wait_drained(grace)
        await self.grpc_server.stop(None)  # the rest: health watches
        await stopping

    async def wait_for_termination(self, timeout: Optional[float] = None) -> bool:
        return await self.grpc_server.wait_for_termination(timeout)


async def serve(judge_fn: AsyncJudgeFn, port: int = 0, host: str = "127.0.0.1", *,
                name: str = "", tls: Optional[ServerTls] = None,
                workers: Optional[int] = None) -> tuple[AsyncGuardServer, int]:
    """Starts serving ``judge_fn``; returns (server, port). A ``judge_fn``
    with a second parameter ``session`` is called with the batch's session
    memory; register it with :meth:`AsyncGuardServer.register`, which asks
    for the memory (R34). ``port=0`` picks a free port; ``tls`` serves TLS (mTLS with a client CA); ``workers``
    bounds the batches judged at once (default: no bound). Also serves
    ``grpc.health.v1.Health``."""
    server = grpc.aio.server()
    servicer = _AsyncGuardServicer(judge_fn, name, workers)
    pb_grpc.add_GuardServiceServicer_to_server(servicer, server)
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
    guard_server = AsyncGuardServer(server, health, bound, name, servicer, host=host,
                                    https=tls is not None)
    return guard_server, bound


async def register(mesh_addr: str, name: str, port: int, *, timeout: float = 10.0,
                   credentials: Optional[MeshCredentials] = None,
                   **options: Unpack[RegisterOptions]) -> pb.RegisterResponse:
    """As :func:`guardmesh.guard.register` (same keyword options,
    :class:`RegisterOptions`; an unknown one is a TypeError), on an asyncio
    channel."""
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
                          **options: Unpack[PolicyOptions]) -> pb.RegisterResponse:
    """As :func:`guardmesh.guard.register_policy` (same keyword options,
    :class:`PolicyOptions`; an unknown one is a TypeError), on an asyncio
    channel."""
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


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


async def serve_until_signalled(judge_fn: AsyncJudgeFn, args: argparse.Namespace) -> int:
    """:func:`run` inside a running event loop (on the main thread: it
    handles SIGTERM and SIGINT)."""
    _setup_logging(args)
    provider = install_file_tracing(args.otlp_file, args.name) if args.otlp_file else None
    try:
        credentials = credentials_from_args(args)
        tls = server_tls_from_args(args)
    except ValueError as err:
        log.error("%s", err)
        return 2

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        try:
            loop.add_signal_handler(signum, stop.set)
        except NotImplementedError:  # no add_signal_handler (Windows)
            signal.signal(signum, lambda *_: loop.call_soon_threadsafe(stop.set))
    try:
        server, port = await serve(judge_fn, args.port, args.host, name=args.name, tls=tls,
                                   workers=args.workers)
        if args.mesh:
            try:
                await server.register(args.mesh, args.name, credentials=credentials,
                                      **registration_from_args(args, tls))
            except (grpc.RpcError, ValueError) as err:
                _registration_failed(args.mesh, err)
                await server.stop(0)
                return 1
        print(f"LISTENING {port}", flush=True)

        await stop.wait()
        log.info("stopping")
        if args.mesh and args.deregister_on_exit:
            try:
                await deregister(args.mesh, args.name, credentials=credentials)
            except (grpc.RpcError, ValueError) as err:
                log.warning("could not deregister: %s", err)
        await server.stop(grace=5.0)
    finally:
        for signum in signals:
            try:
                loop.remove_signal_handler(signum)
            except NotImplementedError:
                pass
    if provider is not None:
        provider.shutdown()
    log.info("stopped")
    return 0


def run(judge_fn: AsyncJudgeFn, args: argparse.Namespace) -> int:
    """Serves the coroutine function ``judge_fn`` as the parsed flags (those
    of :func:`guardmesh.guard.argument_parser`) say, on a new event loop,
    until SIGTERM or SIGINT: as :func:`guardmesh.guard.run` does. Prints
    ``LISTENING <port>`` once serving (and registered, with ``--mesh``);
    drains on the signal. Returns the exit status: 0 after a graceful stop,
    1 if registration failed, 2 for flags that do not go together. Call it
    from the main thread."""
    return asyncio.run(serve_until_signalled(judge_fn, args))


def main(judge_fn: AsyncJudgeFn, argv: Optional[Sequence[str]] = None,
         **defaults: Any) -> None:
    """Parses the kit's flags (``defaults`` as in
    :func:`guardmesh.guard.argument_parser`), serves ``judge_fn`` and exits
    with :func:`run`'s status."""
    sys.exit(run(judge_fn, argument_parser(**defaults).parse_args(argv)))
