"""A scripted MCP upstream (stdio, raw JSON-RPC lines) for the gateway's tests
of how many sampling messages it judges at once, and in which order it
relays them (tests/mcp_sampling.rs). Every line it reads is appended to LOG
as one JSON line, {"received": MESSAGE}, so a test can see the order in
which the gateway forwarded them.

Prompts (`prompts/get`, arguments as strings):
  ask    {n}   sends n sampling requests (ids "s1".."sn", one text
               message each) at once, then answers the prompt once every
               one of them is answered: "answered n"
  flood  {n}   sends the sampling request "s0" and waits for its answer
               (the client's model is to ask for a tool, `tool_use` id
               "u1"); then sends n sampling requests at once ("f1".."fn"),
               each holding a `tool_result` for "u1" ("rows i"), then the
               log message "after the flood", then answers the prompt
               "flooded n"
A `ping` is answered. Anything else is only logged.

Usage: flood_upstream.py LOG
"""

import json
import sys

LOG = sys.argv[1]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def record(entry):
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps(entry) + "\n")


def sampling(id_, messages):
    send({"jsonrpc": "2.0", "id": id_, "method": "sampling/createMessage",
          "params": {"messages": messages, "maxTokens": 10,
                     "tools": [{"name": "read_db", "inputSchema": {"type": "object"}}]}})


def text(role, t):
    return {"role": role, "content": {"type": "text", "text": t}}


def prompt_answer(id_, t):
    send({"jsonrpc": "2.0", "id": id_, "result": {
        "messages": [{"role": "user", "content": {"type": "text", "text": t}}]}})


# The prompt being answered: (its id, its name, n, answers still awaited).
prompt = None

for line in sys.stdin:
    try:
        message = json.loads(line)
    except ValueError:
        continue
    record({"received": message})
    method = message.get("method")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": message["id"], "result": {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"prompts": {}},
            "serverInfo": {"name": "flood-upstream", "version": "0"}}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": message["id"], "result": {}})
    elif method == "prompts/get":
        name = message["params"]["name"]
        n = int(message["params"].get("arguments", {}).get("n", "1"))
        if name == "ask":
            prompt = (message["id"], name, n, n)
            for i in range(1, n + 1):
                sampling(f"s{i}", [text("user", f"ask {i}")])
        elif name == "flood":
            prompt = (message["id"], name, n, 1)
            sampling("s0", [text("user", "read the table")])
    elif method is None and prompt is not None and "id" in message:
        id_, name, n, left = prompt
        left -= 1
        prompt = (id_, name, n, left)
        if left > 0:
            continue
        prompt = None
        if name == "ask":
            prompt_answer(id_, f"answered {n}")
        else:
            use = {"type": "tool_use", "id": "u1", "name": "read_db", "input": {}}
            for i in range(1, n + 1):
                result = {"type": "tool_result", "toolUseId": "u1",
                          "content": [{"type": "text", "text": f"rows {i}"}]}
                sampling(f"f{i}", [text("user", f"flood {i}"),
                                   {"role": "assistant", "content": [use]},
                                   {"role": "user", "content": [result]}])
            send({"jsonrpc": "2.0", "method": "notifications/message",
                  "params": {"level": "info", "data": "after the flood"}})
            prompt_answer(id_, f"flooded {n}")
