'use strict';
/**
 * Example validate guard: cancels every call to a tool on a deny list.
 *
 * A call whose tool is on the list is *cancelled* (not allowed, the model
 * moves on); every other call proceeds (no verdict).
 *
 *     node guards/node/examples/deny_list_guard.js --port 0 \
 *         [--mesh 127.0.0.1:50051] [--deny fs.delete,payments.transfer] [--delay-ms 200]
 *
 * Flags: the kit's (--help) plus
 *   --deny LIST     comma-separated tool names (default fs.delete,payments.transfer)
 *   --delay-ms N    wait N ms before answering, waking early if the mesh cancels
 */

const gg = require('../guardmesh_guard');

const flags = gg.parseFlags(process.argv.slice(2), {
  usage: 'deny_list_guard.js: cancels calls to the tools on a deny list.\n'
    + '  --deny LIST     comma-separated tool names (default fs.delete,payments.transfer)\n'
    + '  --delay-ms N    wait N ms before answering (for tests)',
  options: {
    deny: { type: 'string', default: 'fs.delete,payments.transfer' },
    'delay-ms': { type: 'string', default: '0' },
  },
  defaults: { name: 'deny-list-guard' },
});

const denied = new Set(flags.deny.split(',').map((tool) => tool.trim()).filter(Boolean));
const delayMs = Number.parseInt(flags['delay-ms'], 10) || 0;

async function judge(batch) {
  if (delayMs > 0 && !(await batch.sleep(delayMs))) return []; // cancelled: dropped anyway
  return batch.calls
    .filter((call) => denied.has(call.tool))
    .map((call) => gg.cancel(call.callId,
      `The tool ${call.tool} is on this guard's deny list; the call was not run. Do not retry it.`));
}

gg.run(judge, flags);
