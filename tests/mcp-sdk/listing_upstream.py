"""A scripted MCP upstream for the gateway's tool visibility tests
(tests/mcp_visibility.rs): a hostile listing, written as raw JSON-RPC
lines on stdio.

Usage: listing_upstream.py LOG COUNT

`tools/list` answers, in this order: a tool whose name is 300 bytes long,
`delete_file`, `DELETE_FILE` (the same tool to a guard, R9), then COUNT
tools `t0`, `t1`, ... Every `tools/call` is appended to LOG as
{"tool": NAME} and answered "ran NAME".
"""

import json
import sys

LOG = sys.argv[1]
COUNT = int(sys.argv[2])


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def tool(name):
    return {"name": name, "inputSchema": {"type": "object"}}


for line in sys.stdin:
    if not line.strip():
        continue
    msg = json.loads(line)
    method, id_ = msg.get("method"), msg.get("id")
    if id_ is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": id_, "result": {
            "protocolVersion": msg["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "listing", "version": "0"}}})
    elif method == "tools/list":
        tools = [tool("h" * 300), tool("delete_file"), tool("DELETE_FILE")]
        tools += [tool(f"t{i}") for i in range(COUNT)]
        send({"jsonrpc": "2.0", "id": id_, "result": {"tools": tools}})
    elif method == "tools/call":
        name = msg["params"]["name"]
        with open(LOG, "a") as log:
            log.write(json.dumps({"tool": name}) + "\n")
        send({"jsonrpc": "2.0", "id": id_, "result": {
            "content": [{"type": "text", "text": f"ran {name}"}]}})
    else:
        send({"jsonrpc": "2.0", "id": id_, "result": {}})
