// The steps of a scenario as the TypeScript SDK clients (ts/client.mjs and
// ts2/client.mjs) run them: `list_tools` lists the tools, `call` calls the
// step's tool with `client.callTool`, which checks a result against the
// tool's declared output schema and throws when it does not conform. Prints
// one JSON line per step through `out`. `around.before(step)` and
// `around.after(step)`, when given, run around each call.
export async function runSteps(client, steps, out, around = {}) {
  for (const step of steps) {
    if (step.op === "list_tools") {
      const { tools } = await client.listTools();
      out({ op: "list_tools", tools });
    } else if (step.op === "call") {
      around.before?.(step);
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
        // (a result the SDK refuses) is the failure these clients exist to see.
        out({ op: "call", error: { code: error.code ?? null, message: String(error.message ?? error) } });
      }
      around.after?.(step);
    }
  }
}
