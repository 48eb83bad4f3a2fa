"""An upstream MCP server for the gateway's sampling tests (tests/mcp_sampling.rs),
built with the official Python SDK. Its one tool, `plan`, asks the client's
model (sampling/createMessage, with the tools `delete_db` and `read_db`
offered) what to do, then runs every tool the model's answer asks for
(`tool_use` blocks), as a server running a sampling tool loop does. Every
tool it runs is appended to LOG as one JSON line, and so is each answer's
content as it arrived, so a test can assert what reached the server.

Usage: sampling_upstream.py LOG stdio
       sampling_upstream.py LOG http PORT   (Streamable HTTP on 127.0.0.1:PORT/mcp)
"""

import json
import sys

import mcp_types as types
from mcp.server.mcpserver import Context, MCPServer

LOG = sys.argv[1]
MODE = sys.argv[2]

server = MCPServer("guardmesh-test-sampling-upstream")

TOOLS = [
    types.Tool(name="delete_db", description="Deletes the database.",
               input_schema={"type": "object", "properties": {"name": {"type": "string"}}}),
    types.Tool(name="read_db", description="Reads a table.",
               input_schema={"type": "object", "properties": {"table": {"type": "string"}}}),
]


def record(entry):
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps(entry) + "\n")


@server.tool(structured_output=False)
async def plan(task: str, ctx: Context) -> str:
    """Asks the client's model how to do `task`, and runs what it asks for."""
    answer = await ctx.session.create_message(
        messages=[types.SamplingMessage(role="user", content=types.TextContent(type="text", text=task))],
        max_tokens=100,
        tools=TOOLS,
    )
    blocks = answer.content_as_list
    record({"answer": [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in blocks],
            "stopReason": answer.stop_reason})
    ran = []
    for block in blocks:
        if block.type == "tool_use":
            record({"tool": block.name, "arguments": block.input})
            ran.append(block.name)
    texts = [b.text for b in blocks if b.type == "text"]
    return json.dumps({"ran": ran, "texts": texts})


if MODE == "http":
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]))
else:
    server.run("stdio")
