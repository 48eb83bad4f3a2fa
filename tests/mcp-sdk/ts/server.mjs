// An upstream MCP server for the gateway's tests, built with the official
// TypeScript SDK (@modelcontextprotocol/sdk) and served over Streamable HTTP
// in stateless mode: the same three tools as upstream.py (delete_file, pay,
// read_file). Every call it executes is appended to LOG as one JSON line
// {"tool": ..., "arguments": ...}. The SDK reads each request body with
// JSON.parse (of two members of one name, the last counts) and accepts
// JSON-RPC batches.
//
// Usage: node server.mjs LOG PORT   (http://127.0.0.1:PORT/mcp)
import { appendFileSync } from "node:fs";
import { createServer } from "node:http";
import { Server } from "@modelcontextprotocol/sdk/server/index.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { CallToolRequestSchema, ListToolsRequestSchema } from "@modelcontextprotocol/sdk/types.js";

const [log, port] = process.argv.slice(2);
const tools = {
  delete_file: (a) => `deleted ${a.path}`,
  pay: (a) => `paid ${a.amount} to ${a.to}`,
  read_file: (a) => `contents of ${a.path}`,
};

function mcpServer() {
  const server = new Server({ name: "guardmesh-test-upstream-ts", version: "0.0.0" }, { capabilities: { tools: {} } });
  server.setRequestHandler(ListToolsRequestSchema, async () => ({
    tools: Object.keys(tools).map((name) => ({ name, inputSchema: { type: "object" } })),
  }));
  server.setRequestHandler(CallToolRequestSchema, async (request) => {
    const { name, arguments: args = {} } = request.params;
    const run = tools[name];
    if (!run) {
      return { content: [{ type: "text", text: `unknown tool ${name}` }], isError: true };
    }
    appendFileSync(log, JSON.stringify({ tool: name, arguments: args }) + "\n");
    return { content: [{ type: "text", text: run(args) }] };
  });
  return server;
}

createServer(async (req, res) => {
  if (req.url !== "/mcp") {
    res.writeHead(404).end();
    return;
  }
  const server = mcpServer();
  const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: true });
  res.on("close", () => {
    transport.close();
    server.close();
  });
  await server.connect(transport);
  await transport.handleRequest(req, res);
}).listen(Number(port), "127.0.0.1");
