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
import { runSteps } from "../steps.mjs";

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
await runSteps(client, scenario.steps, out);
await client.close();
