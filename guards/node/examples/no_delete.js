'use strict';
// The minimal Node guard of the README: cancels file deletions. Run:
//   node guards/node/examples/no_delete.js --port 0 --mesh 127.0.0.1:50051
const gg = require('../guardmesh_guard');

async function judge(batch) {
  return batch.calls
    .filter((call) => call.tool === 'fs.delete')
    .map((call) => gg.cancel(call.callId, 'Deleting files is not allowed.'));
}

gg.main(judge, { defaults: { name: 'no-delete-js' } });
