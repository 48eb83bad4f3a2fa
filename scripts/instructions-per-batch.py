#!/usr/bin/env python3
"""Counts the instructions `guardmesh serve` executes per batch, under
valgrind's callgrind: a figure that does not move with the machine's load,
so two builds can be compared on a busy machine.

    build/venv/bin/python scripts/instructions-per-batch.py MESH [GUARDS] [N] [IN_FLIGHT]

MESH is the `guardmesh` binary measured; GUARDS the one serving the four
`allow` example guards (default: MESH). The mesh judges a warm-up of 300
batches uninstrumented, then N (default 2000) four-call batches of ~500
bytes of JSON arguments each, IN_FLIGHT (default 16) at a time on one
stream, with instrumentation on. Prints the instructions per batch.
Needs valgrind and the Python kit (scripts/setup-polyglot).
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from guardmesh.v1 import guardmesh_pb2 as pb
from guardmesh.v1 import guardmesh_pb2_grpc as pb_grpc


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    mesh_bin = os.path.abspath(sys.argv[1])
    guard_bin = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else mesh_bin
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    inflight = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    work = tempfile.mkdtemp(prefix="guardmesh-instructions-")
    procs = []
    try:
        ports = []
        for _ in range(4):
            p = subprocess.Popen([guard_bin, "example-guard", "allow"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            ports.append(int(p.stdout.readline().split()[1]))
        config = os.path.join(work, "mesh.toml")
        with open(config, "w") as f:
            for i, port in enumerate(ports):
                f.write(f'[[guard]]\nname = "g{i}"\nendpoint = "http://127.0.0.1:{port}"\n'
                        'timeout_ms = 60000\n\n')
        port = free_port()
        out = os.path.join(work, "callgrind.out")
        mesh = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             mesh_bin, "serve", "--config", config, "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "mesh.log"), "w"))
        procs.append(mesh)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = pb_grpc.PreToolServiceStub(channel)
        arguments = json.dumps({"query": "x" * 470, "n": 1})

        def batch(i):
            return pb.EvaluateRequest(
                batch_id=f"b{i}",
                context=pb.BatchContext(session_id="s", turn_index=1, model_text="t"),
                calls=[pb.ToolCall(call_id=f"c{j}", tool=f"tool.{j}", arguments=arguments)
                       for j in range(4)],
                timeout_ms=60000)

        def run(start, count):
            slots = threading.Semaphore(inflight)

            def requests():
                for i in range(start, start + count):
                    slots.acquire()
                    yield batch(i)

            answered = 0
            for response in stub.Evaluate(requests()):
                if not response.HasField("decision") or len(response.decision.decisions) != 4:
                    sys.exit(f"unexpected answer: {response}")
                answered += 1
                slots.release()
            if answered != count:
                sys.exit(f"{answered} answers for {count} batches")

        # Until every guard's link is up.
        for attempt in range(200):
            trace = stub.EvaluateBatch(batch(10**9 + attempt), timeout=60).trace
            if all(t.status == pb.TRACE_STATUS_PROCEEDED for t in trace):
                break
            time.sleep(0.2)
        run(0, 300)
        control = ["callgrind_control"]
        subprocess.run(control + ["-i", "on", str(mesh.pid)], check=True, stdout=subprocess.DEVNULL)
        run(1000, n)
        subprocess.run(control + ["-i", "off", str(mesh.pid)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(control + ["-d", str(mesh.pid)], check=True, stdout=subprocess.DEVNULL)
        time.sleep(1)
        total = 0
        for name in os.listdir(work):
            if name.startswith("callgrind.out"):
                for line in open(os.path.join(work, name)):
                    m = re.match(r"^(summary|totals): (\d+)", line)
                    if m:
                        total = max(total, int(m.group(2)))
        if total == 0:
            sys.exit("callgrind recorded nothing")
        print(f"{os.path.basename(mesh_bin)}: {total / n:,.0f} instructions per batch "
              f"({total:,} for {n} batches, {inflight} in flight)")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
