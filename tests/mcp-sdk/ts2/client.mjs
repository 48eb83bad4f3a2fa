// An MCP client for the gateway's tests, built with the official TypeScript
// SDK v2 (@modelcontextprotocol/client), pinned to the stateless 2026-07-28
// revision: no initialize, no Mcp-Session-Id; each request carries the
// routing headers (Mcp-Method, Mcp-Name, Mcp-Param-*) the SDK writes.
// Prints one JSON line per step on stdout.
//
// Usage: node client.mjs SCENARIO_JSON URL
//
// SCENARIO_JSON: {"steps": [{"op": "list_tools"},
//                           {"op": "call", "name": ..., "arguments": {...},
//                            "tamper": {"Mcp-Name": "other"}}]}
// `tamper` overwrites headers of that call's request after the SDK wrote
// them (a client whose headers disagree with its body).
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { runSteps } from "../steps.mjs";

const [scenarioText, url] = process.argv.slice(2);
const scenario = JSON.parse(scenarioText);
const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

let tamper = null;
const sent = [];
const fetchWith = async (input, init = {}) => {
  const headers = new Headers(init.headers);
  if (tamper && headers.get("mcp-method") === "tools/call") {
    for (const [k, v] of Object.entries(tamper)) headers.set(k, v);
  }
  sent.push({
    sessionId: headers.get("mcp-session-id"),
    method: headers.get("mcp-method"),
    body: typeof init.body === "string" ? JSON.parse(init.body).method ?? null : null,
  });
  return fetch(input, { ...init, headers });
};

const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: fetchWith });
const client = new Client(
  { name: "guardmesh-test-client-ts2", version: "0.0.0" },
  { versionNegotiation: { mode: { pin: "2026-07-28" } } },
);
await client.connect(transport);
out({ op: "connected", protocol: client.getNegotiatedProtocolVersion?.() ?? null });
await runSteps(client, scenario.steps, out, {
  before: (step) => {
    tamper = step.tamper ?? null;
  },
  after: () => {
    tamper = null;
  },
});
out({ op: "sent", requests: sent });
await client.close();
