#!/usr/bin/env python3
"""Counts the instructions `guardmesh serve` executes per batch, under
valgrind's callgrind: a figure that does not move with the machine's load,
so two builds can be compared on a busy machine.

    build/venv/bin/python scripts/instructions-per-batch.py [--keep DIR] [--policy FILE | --no-guard | --relay] MESH [GUARDS] [N] [IN_FLIGHT]

MESH is the `guardmesh` binary measured; GUARDS the one serving the four
`allow` example guards (default: MESH). The mesh judges a warm-up of 300
batches uninstrumented, then N (default 2000) four-call batches of ~500
bytes of JSON arguments each, IN_FLIGHT (default 16) at a time on one
stream, with instrumentation on. Prints the instructions per batch.
Needs valgrind and the Python kit (scripts/setup-polyglot).

With `--policy FILE` the mesh has one policy guard of FILE and nothing
else; with `--no-guard`, no guard at all. Both send `guardmesh bench`'s
standard batch (four calls to sql.query, http.get, fs.read and shell.exec,
500 bytes of arguments each, a context with model text and metadata), so
`--policy bench/src/bench/policy20.toml` against `--no-guard` (both with
IN_FLIGHT 1) counts what the bench's 20-rule policy guard adds per batch.
With `--relay` the four guards are behind `guardmesh bench-relay` instead
of a mesh: the relay floor of `guardmesh bench` (the mesh's hops, none of
its work), so the two counts side by side are what the mesh's work costs.
With `--keep DIR` the callgrind output is copied to DIR (for
`callgrind_annotate --inclusive=yes`).
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


# `guardmesh bench`'s standard batch (bench/src/bench/mod.rs, `Work::new`).
BENCH_TOOLS = ["sql.query", "http.get", "fs.read", "shell.exec"]
BENCH_FILLER = "The agent asked for this call while working through the user's request; "


def bench_arguments(i, tool):
    """JSON arguments of exactly 500 bytes, as the bench writes them."""
    base = json.dumps({
        "request": i,
        "tool": tool,
        "query": "SELECT id, name, email, created_at FROM customers WHERE region = 'emea' ORDER BY created_at DESC",
        "options": {"timeout_s": 30, "retries": 2, "dry_run": False},
        "note": "",
    }, separators=(",", ":"), sort_keys=True)
    pad = max(0, 500 - len(base))
    note = (BENCH_FILLER * (pad // len(BENCH_FILLER) + 1))[:pad]
    return base.replace('"note":""', f'"note":"{note}"')


def main():
    args = sys.argv[1:]
    keep = None
    if args[:1] == ["--keep"] and len(args) > 1:
        keep, args = os.path.abspath(args[1]), args[2:]
    mode = "guards"
    policy = None
    if args[:1] == ["--policy"] and len(args) > 1:
        mode, policy, args = "policy", os.path.abspath(args[1]), args[2:]
    elif args[:1] == ["--no-guard"]:
        mode, args = "none", args[1:]
    elif args[:1] == ["--relay"]:
        mode, args = "relay", args[1:]
    if not args:
        sys.exit(__doc__)
    mesh_bin = os.path.abspath(args[0])
    guard_bin = os.path.abspath(args[1]) if len(args) > 1 else mesh_bin
    n = int(args[2]) if len(args) > 2 else 2000
    inflight = int(args[3]) if len(args) > 3 else 16
    work = tempfile.mkdtemp(prefix="guardmesh-instructions-")
    procs = []
    try:
        ports = []
        for _ in range(4 if mode in ("guards", "relay") else 0):
            p = subprocess.Popen([guard_bin, "example-guard", "allow"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            ports.append(int(p.stdout.readline().split()[1]))
        config = os.path.join(work, "mesh.toml")
        with open(config, "w") as f:
            for i, port in enumerate(ports):
                f.write(f'[[guard]]\nname = "g{i}"\nendpoint = "http://127.0.0.1:{port}"\n'
                        'timeout_ms = 60000\n\n')
            if policy:
                f.write(f'[[guard]]\nname = "policy20"\npolicy = {json.dumps(policy)}\n')
        out = os.path.join(work, "callgrind.out")
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={out}"]
        if mode == "relay":
            guards = [a for i, p in enumerate(ports)
                      for a in ("--guard", f"g{i}=http://127.0.0.1:{p}")]
            mesh = subprocess.Popen(valgrind + [mesh_bin, "bench-relay"] + guards,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    stderr=open(os.path.join(work, "mesh.log"), "w"))
            procs.append(mesh)
            port = int(mesh.stdout.readline().split()[1])
        else:
            port = free_port()
            mesh = subprocess.Popen(
                valgrind + [mesh_bin, "serve", "--config", config, "--listen", f"127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "mesh.log"), "w"))
            procs.append(mesh)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = pb_grpc.PreToolServiceStub(channel)
        arguments = json.dumps({"query": "x" * 470, "n": 1})

        def batch(i):
            if mode in ("policy", "none"):
                return pb.EvaluateRequest(
                    batch_id=f"b{i}",
                    context=pb.BatchContext(
                        session_id="bench", turn_index=7,
                        model_text="Looking up the customer records and the related files before answering.",
                        metadata={"tenant": "acme", "user": "u-1042", "agent": "support-bot"}),
                    calls=[pb.ToolCall(call_id=f"call-{j}", tool=BENCH_TOOLS[j],
                                       arguments=bench_arguments(j, BENCH_TOOLS[j]))
                           for j in range(4)],
                    timeout_ms=60000)
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

        # Until every guard's link is up (the relay opens them before it
        # prints its port, and answers only on streams).
        for attempt in range(0 if mode == "relay" else 200):
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
        if keep:
            os.makedirs(keep, exist_ok=True)
            for name in os.listdir(work):
                if name.startswith("callgrind.out"):
                    shutil.copy(os.path.join(work, name), keep)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
