"""An MCP client for the gateway tests (tests/mcp.rs), built with the official
Python SDK. Runs a scenario and prints one JSON line per step on stdout.

Usage: client.py SCENARIO_JSON stdio COMMAND [ARGS...]
       client.py SCENARIO_JSON http URL

SCENARIO_JSON: {"mode": "legacy" | "auto", "steps": [
  {"op": "list_tools"},
  {"op": "call", "name": "pay", "arguments": {...}, "meta": {...}}]}
"""

import asyncio
import json
import sys

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError


def out(obj):
    print(json.dumps(obj), flush=True)


async def main():
    scenario = json.loads(sys.argv[1])
    if sys.argv[2] == "stdio":
        server = StdioServerParameters(command=sys.argv[3], args=sys.argv[4:])
    else:
        server = sys.argv[3]
    async with Client(server, mode=scenario.get("mode", "legacy")) as client:
        out({"op": "connected", "protocol": client.protocol_version})
        for step in scenario["steps"]:
            if step["op"] == "list_tools":
                tools = await client.list_tools()
                out({"op": "list_tools", "tools": [t.model_dump(mode="json", exclude_none=True) for t in tools.tools]})
            elif step["op"] == "call":
                try:
                    result = await client.call_tool(step["name"], step.get("arguments"), meta=step.get("meta"))
                    out({
                        "op": "call",
                        "isError": bool(result.is_error),
                        "text": [c.text for c in result.content if getattr(c, "type", "") == "text"],
                    })
                except MCPError as e:
                    out({"op": "call", "error": {"code": e.code, "message": e.message}})


asyncio.run(main())
