"""An upstream MCP server for the gateway tests (tests/mcp.rs), built with the
official Python SDK: four tools (one deletes, one pays, one reads, one
writes and declares an output schema). Every
call it actually executes is appended to LOG as one JSON line, so a test can
assert what ran and with which arguments.

Usage: upstream.py LOG stdio
       upstream.py LOG http PORT      (Streamable HTTP on 127.0.0.1:PORT/mcp)
       upstream.py LOG exit-after N   (stdio; exits after N tool calls)
       upstream.py LOG noisy          (stdio; writes much to stderr, with
                                       lines that look like JSON-RPC)
       upstream.py LOG split-stderr   (stdio; read_file writes half a stderr
                                       line, a line that is not JSON on
                                       stdout, waits, then the other half)
"""

import json
import os
import sys
import time
from typing import TypedDict

from mcp.server.mcpserver import MCPServer

LOG = sys.argv[1]
MODE = sys.argv[2]
EXIT_AFTER = int(sys.argv[3]) if MODE == "exit-after" else None
NOISY = MODE == "noisy"
# The MCP wire, before the SDK diverts fd 1 to stderr while serving: lets
# split-stderr write a line that is not JSON where the client would read it.
WIRE = os.dup(1)
calls = 0


def noise(text):
    """A stderr line, and one that would corrupt the MCP stream on stdout."""
    if NOISY:
        print(f"upstream: {text}", file=sys.stderr, flush=True)
        print(json.dumps({"jsonrpc": "2.0", "id": 999, "result": {"noise": text}}), file=sys.stderr, flush=True)

server = MCPServer("guardmesh-test-upstream")


def record(tool, arguments):
    global calls
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")
    noise(f"ran {tool}")
    calls += 1
    if EXIT_AFTER is not None and calls >= EXIT_AFTER:
        # Ends the process once the answer is out.
        import threading

        threading.Timer(0.2, lambda: os._exit(0)).start()


@server.tool(structured_output=False)
def delete_file(path: str) -> str:
    """Deletes a file."""
    record("delete_file", {"path": path})
    return f"deleted {path}"


@server.tool(structured_output=False)
def pay(amount: float, to: str) -> str:
    """Pays someone."""
    record("pay", {"amount": amount, "to": to})
    return f"paid {amount} to {to}"


@server.tool(structured_output=False)
def read_file(path: str) -> str:
    """Reads a file."""
    if MODE == "split-stderr":
        sys.stderr.write("upstream: first half, ")
        sys.stderr.flush()
        os.write(WIRE, b"this line is not JSON\n")
        time.sleep(0.5)
        sys.stderr.write("second half\n")
        sys.stderr.flush()
    record("read_file", {"path": path})
    return f"contents of {path}"


class Written(TypedDict):
    path: str
    chars: int


@server.tool()
def write_note(path: str, text: str) -> Written:
    """Writes a note. Declares an output schema: every result that is not
    an error must carry structured content that conforms to it."""
    record("write_note", {"path": path, "text": text})
    return {"path": path, "chars": len(text)}


if NOISY:
    # More than a pipe holds: the upstream blocks unless its stderr is read.
    for i in range(400):
        print(f"upstream: starting, line {i} " + "." * 500, file=sys.stderr, flush=True)
    noise("started")

if MODE == "http":
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]))
else:
    server.run("stdio")
