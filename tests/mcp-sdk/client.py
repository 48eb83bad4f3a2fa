"""An MCP client for the gateway tests (tests/mcp.rs), built with the official
Python SDK. Runs a scenario and prints one JSON line per step on stdout.

Usage: client.py SCENARIO_JSON stdio COMMAND [ARGS...]
       client.py SCENARIO_JSON http URL

SCENARIO_JSON: {"mode": "legacy" | "auto", "ca": CA_PEM_FILE (https only),
                "env": {...} (stdio only: the server's extra environment),
                "elicit": ["accept" | "decline" | "cancel" | "error" | "hang", ...]
                  (declares elicitation; each elicitation request is printed
                  as {"op": "elicited", ...} and answered with the next
                  action in turn: "hang" never answers),
                "sample": [[BLOCK, ...], ...]
                  (declares sampling with tools; each sampling request is
                  printed as {"op": "sampled", "tools": [...], "messages":
                  [...]} and answered with the next list of content
                  blocks, as the model's answer),
                "steps": [
  {"op": "list_tools"},
  {"op": "call", "name": "pay", "arguments": {...}, "meta": {...}},
  {"op": "prompt", "name": "report", "arguments": {...}},
  {"op": "wait", "path": FILE} (until FILE exists, at most 60 s)]}
"""

import asyncio
import contextlib
import json
import os
import ssl
import sys

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError


def out(obj):
    print(json.dumps(obj), flush=True)


async def main():
    scenario = json.loads(sys.argv[1])
    async with contextlib.AsyncExitStack() as stack:
        if sys.argv[2] == "stdio":
            server = StdioServerParameters(command=sys.argv[3], args=sys.argv[4:], env=scenario.get("env"))
        elif "ca" in scenario:
            # HTTPS trusting only the given CA.
            http = await stack.enter_async_context(httpx2.AsyncClient(
                verify=ssl.create_default_context(cafile=scenario["ca"]),
                follow_redirects=True,
                timeout=httpx2.Timeout(30, read=300),
            ))
            server = streamable_http_client(sys.argv[3], http_client=http)
        else:
            server = sys.argv[3]
        await run(scenario, server)


def elicitation_callback(actions):
    """Answers each elicitation with the next of `actions`, printing it."""
    actions = list(actions)

    async def callback(context, params):
        action = actions.pop(0) if actions else "decline"
        out({
            "op": "elicited",
            "message": params.message,
            "schema": schema if isinstance(schema := params.requested_schema, dict)
            else schema.model_dump(mode="json", by_alias=True, exclude_none=True),
            "answer": action,
        })
        if action == "hang":
            await anyio.sleep(3600)
        if action == "error":
            return types.ErrorData(code=types.INVALID_REQUEST, message="the user cannot be asked now")
        return types.ElicitResult(action=action, content={} if action == "accept" else None)

    return callback


def sampling_callback(answers):
    """Answers each sampling request with the next of `answers` (lists of
    content blocks, as JSON), printing the request."""
    answers = list(answers)

    async def callback(context, params):
        blocks = answers.pop(0) if answers else [{"type": "text", "text": "nothing more"}]
        out({"op": "sampled", "tools": [t.name for t in params.tools or []],
             "messages": [m.model_dump(mode="json", by_alias=True, exclude_none=True)
                          for m in params.messages]})
        uses = any(b.get("type") == "tool_use" for b in blocks)
        return types.CreateMessageResultWithTools.model_validate({
            "role": "assistant", "content": blocks, "model": "scripted",
            "stopReason": "toolUse" if uses else "endTurn"})

    return callback


async def run(scenario, server):
    options = {}
    if "elicit" in scenario:
        options["elicitation_callback"] = elicitation_callback(scenario["elicit"])
    if "sample" in scenario:
        options["sampling_callback"] = sampling_callback(scenario["sample"])
        options["sampling_capabilities"] = types.SamplingCapability(tools=types.SamplingToolsCapability())
    async with Client(server, mode=scenario.get("mode", "legacy"), **options) as client:
        out({"op": "connected", "protocol": client.protocol_version})
        for step in scenario["steps"]:
            if step["op"] == "list_tools":
                tools = await client.list_tools()
                out({"op": "list_tools", "tools": [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tools.tools]})
            elif step["op"] == "wait":
                for _ in range(600):
                    if os.path.exists(step["path"]):
                        break
                    await anyio.sleep(0.1)
                out({"op": "waited"})
            elif step["op"] == "prompt":
                try:
                    result = await client.get_prompt(step["name"], step.get("arguments"))
                    out({"op": "prompt", "messages": [m.model_dump(mode="json", by_alias=True, exclude_none=True)
                                                      for m in result.messages]})
                except MCPError as e:
                    out({"op": "prompt", "error": {"code": e.code, "message": e.message}})
            elif step["op"] == "call":
                try:
                    result = await client.call_tool(step["name"], step.get("arguments"), meta=step.get("meta"))
                    out({
                        "op": "call",
                        "isError": bool(result.is_error),
                        "text": [c.text for c in result.content if getattr(c, "type", "") == "text"],
                        "structured": result.structured_content,
                    })
                except MCPError as e:
                    out({"op": "call", "error": {"code": e.code, "message": e.message}})


asyncio.run(main())
