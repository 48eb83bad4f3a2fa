"""A deliberately non-conforming guard, for testing the mesh's defences.

It implements ``GuardService.Judge`` on the raw stubs, bypassing the kit's
safety nets, and breaks the protocol the way ``--mode`` says:

=================  ==========================================================
``answer-twice``   answers each request twice: first steering every call
                   ("broken-guard: first answer"), then cancelling every call
                   ("broken-guard: second answer"). The mesh must keep the
                   first and ignore the second (R8, R19).
``unknown-call-id`` skips call ids it was never sent (``<call_id>-unknown``)
                   and says nothing about the real ones: malformed, the real
                   calls proceed (R8).
``blank-skip``     skips every call with blank content: malformed, counted as
                   proceed (R8).
``never-answer``   reads batches and never answers; the stream stays open:
                   the mesh must time it out (R13, R14).
``close-stream``   ends the stream with OK, unanswered, at its first batch (R13).
``grpc-error``     ends the stream with INTERNAL at its first batch (R13).
``bad-rewrite``    rewrites every call's arguments to ``[1, 2]``, not a JSON
                   object: rejected whole (R11).
=================  ==========================================================

Run::

    python guards/python/examples/broken_guard.py \\
        --mode answer-twice --port 0 [--mesh 127.0.0.1:50051] [--delay-ms N]

Flags: the kit's (``--help``; ``--workers`` and ``--otlp-file`` are ignored)
plus ``--mode`` (required) and ``--delay-ms N`` (wait N ms before
misbehaving on each batch). Prints ``LISTENING <port>`` like any guard.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import signal
import sys
import threading
import time

import grpc

from guardmesh import guard as gg
from guardmesh.guard import pb, pb_grpc

MODES = ["answer-twice", "unknown-call-id", "blank-skip", "never-answer",
         "close-stream", "grpc-error", "bad-rewrite"]
log = logging.getLogger("guardmesh.broken")

_END = object()


def _skip(call_id: str, content: str, kind=pb.SKIP_KIND_STEER):
    return pb.Verdict(call_id=call_id, skip=pb.Skip(content=content, kind=kind))


class BrokenGuard(pb_grpc.GuardServiceServicer):
    def __init__(self, mode: str, delay_ms: int):
        self.mode = mode
        self.delay = delay_ms / 1000.0

    def answers(self, batch):
        """What this mode sends for one batch: responses, or a stream end."""
        ids = [c.call_id for c in batch.calls]
        rid = batch.request_id
        if self.mode == "answer-twice":
            return [
                pb.JudgeResponse(request_id=rid, verdicts=[
                    _skip(i, "broken-guard: first answer") for i in ids]),
                pb.JudgeResponse(request_id=rid, verdicts=[
                    _skip(i, "broken-guard: second answer", pb.SKIP_KIND_CANCEL)
                    for i in ids]),
            ]
        if self.mode == "unknown-call-id":
            return [pb.JudgeResponse(request_id=rid, verdicts=[
                _skip(f"{i}-unknown", "broken-guard: unknown call id") for i in ids])]
        if self.mode == "blank-skip":
            return [pb.JudgeResponse(request_id=rid, verdicts=[_skip(i, "   ") for i in ids])]
        if self.mode == "bad-rewrite":
            return [pb.JudgeResponse(request_id=rid, verdicts=[
                pb.Verdict(call_id=i, rewrite=pb.Rewrite(arguments="[1, 2]")) for i in ids])]
        if self.mode == "close-stream":
            return [_END]
        if self.mode == "grpc-error":
            return [grpc.StatusCode.INTERNAL]
        return []  # never-answer

    def Judge(self, request_iterator, context):
        context.send_initial_metadata(())
        out: queue.SimpleQueue = queue.SimpleQueue()
        context.add_callback(lambda: out.put(_END))

        def misbehave(batch):
            time.sleep(self.delay)
            for item in self.answers(batch):
                out.put(item)

        def read():
            try:
                for request in request_iterator:
                    if request.WhichOneof("kind") == "batch":
                        log.info("batch %r (request %d): %s", request.batch.batch_id,
                                 request.batch.request_id, self.mode)
                        threading.Thread(target=misbehave, args=(request.batch,),
                                         daemon=True).start()
            except Exception:  # the RPC ended
                pass
            if self.mode != "never-answer":
                # Ends the stream once the mesh half-closes (answers racing this
                # are lost: that is fine for a broken guard).
                time.sleep(self.delay + 0.1)
                out.put(_END)

        threading.Thread(target=read, daemon=True).start()
        while True:
            item = out.get()
            if item is _END:
                return
            if isinstance(item, grpc.StatusCode):
                context.abort(item, "broken-guard: failing on purpose")
            yield item


def main() -> None:
    parser = gg.argument_parser(__doc__.splitlines()[0], name="broken-guard")
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--delay-ms", type=int, default=0,
                        help="wait this long before misbehaving on a batch")
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {args.name}: %(message)s")

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=20))
    pb_grpc.add_GuardServiceServicer_to_server(BrokenGuard(args.mode, args.delay_ms), server)
    health_servicer = gg.Health()
    server.add_generic_rpc_handlers((health_servicer.handler(),))
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    health_servicer.set("", gg.SERVING)
    health_servicer.set(gg.GUARD_SERVICE, gg.SERVING)

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.mesh:
        try:
            gg.register(args.mesh, args.name, port, host=args.host, endpoint=args.endpoint,
                        role=args.role, tools=args.tools, failure_policy=args.failure_policy,
                        timeout_ms=args.timeout_ms, priority=args.priority,
                        mode="dry_run" if args.dry_run else "enforce",
                        grant_tools=args.grant_tools, may_rename=args.may_rename,
                        credentials=gg.credentials_from_args(args))
        except (grpc.RpcError, ValueError) as err:
            log.error("could not register with the mesh at %s: %s", args.mesh, err)
            sys.exit(1)
    print(f"LISTENING {port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop(1.0).wait()
    sys.exit(0)


if __name__ == "__main__":
    main()
