// An upstream MCP server for the gateway's tests, built with the official
// TypeScript SDK v2 (@modelcontextprotocol/server), serving the stateless
// 2026-07-28 revision (and the 2025 era's stateless fallback) over HTTP.
// Its read_file tool mirrors its `path` argument into the `Mcp-Param-Path`
// header (`x-mcp-header`), which the SDK checks against the body. Every
// tools/call the SDK lets through is appended to LOG as one JSON line with
// the routing headers it came with, so a test can assert what ran.
//
// Usage: node server.mjs LOG PORT
import { appendFileSync } from "node:fs";
import { createServer } from "node:http";
import { McpServer, createMcpHandler, fromJsonSchema } from "@modelcontextprotocol/server";

const [log, port] = process.argv.slice(2);
let current = {};

const factory = () => {
  const server = new McpServer({ name: "guardmesh-test-upstream-ts2", version: "0.0.0" });
  const run = (tool, args) => {
    appendFileSync(log, JSON.stringify({ tool, arguments: args, headers: current }) + "\n");
  };
  server.registerTool(
    "read_file",
    {
      description: "Reads a file.",
      inputSchema: fromJsonSchema({
        type: "object",
        properties: { path: { type: "string", "x-mcp-header": "Path" } },
        required: ["path"],
      }),
    },
    async (args) => {
      run("read_file", args);
      return { content: [{ type: "text", text: `contents of ${args.path}` }] };
    },
  );
  server.registerTool(
    "pay",
    {
      description: "Pays someone.",
      inputSchema: fromJsonSchema({
        type: "object",
        properties: { amount: { type: "number" }, to: { type: "string" } },
        required: ["amount", "to"],
      }),
    },
    async (args) => {
      run("pay", args);
      return { content: [{ type: "text", text: `paid ${args.amount} to ${args.to}` }] };
    },
  );
  return server;
};
const handler = createMcpHandler(factory);

createServer(async (req, res) => {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  const headers = new Headers();
  for (const [k, v] of Object.entries(req.headers)) {
    for (const value of Array.isArray(v) ? v : [v]) headers.append(k, value);
  }
  current = Object.fromEntries(
    [...headers].filter(([k]) => k === "mcp-method" || k === "mcp-name" || k.startsWith("mcp-param-")),
  );
  const body = chunks.length ? Buffer.concat(chunks) : undefined;
  const request = new Request(`http://${req.headers.host}${req.url}`, {
    method: req.method,
    headers,
    body: req.method === "GET" || req.method === "HEAD" ? undefined : body,
  });
  const response = await handler.fetch(request);
  res.writeHead(response.status, Object.fromEntries(response.headers));
  if (response.body) {
    for await (const chunk of response.body) res.write(chunk);
  }
  res.end();
}).listen(Number(port), "127.0.0.1");
