// An MCP client for the gateway's tests, built with the official TypeScript
// SDK (@modelcontextprotocol/sdk): lists the tools, then calls each step's
// tool with `client.callTool`, which checks a result against the tool's
// declared output schema and throws when it does not conform. Prints one
// JSON line per step on stdout.
//
// Usage: node client.mjs SCENARIO_JSON stdio COMMAND [ARGS...]
//        node client.mjs SCENARIO_JSON http URL
//
// SCENARIO_JSON: {"steps": [{"op": "list_tools"},
//                           {"op": "call", "name": ..., "arguments": {...}}]}
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [scenarioText, kind, ...target] = process.argv.slice(2);
const scenario = JSON.parse(scenarioText);
const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

const transport =
  kind === "stdio"
    ? new StdioClientTransport({ command: target[0], args: target.slice(1), stderr: "inherit" })
    : new StreamableHTTPClientTransport(new URL(target[0]));
const client = new Client({ name: "guardmesh-test-client-ts", version: "0.0.0" });
await client.connect(transport);
out({ op: "connected" });
for (const step of scenario.steps) {
  if (step.op === "list_tools") {
    const { tools } = await client.listTools();
    out({ op: "list_tools", tools });
  } else if (step.op === "call") {
    try {
      const result = await client.callTool({ name: step.name, arguments: step.arguments ?? {} });
      out({
        op: "call",
        isError: Boolean(result.isError),
        text: (result.content ?? []).filter((c) => c.type === "text").map((c) => c.text),
        structured: result.structuredContent ?? null,
      });
    } catch (error) {
      // A JSON-RPC error the gateway answered is an answer; anything else
      // (a result the SDK refuses) is the failure this client exists to see.
      out({ op: "call", error: { code: error.code ?? null, message: String(error.message ?? error) } });
    }
  }
}
await client.close();
