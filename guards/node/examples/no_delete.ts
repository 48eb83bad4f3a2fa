// The minimal Node guard in TypeScript: cancels file deletions, masks
// passwords (as a mutate guard). In a project of your own, with this file
// and examples/tsconfig.json beside it (see the package README):
//   npx tsc && node dist/no_delete.js --port 0 --mesh 127.0.0.1:50051 \
//       --role mutate --grant-tools '*'
// (`npx tsc` type-checks strictly and writes dist/no_delete.js.)
import * as gg from 'guardmesh-guard';

function judge(batch: gg.Batch): gg.Verdict[] {
  const verdicts: gg.Verdict[] = [];
  for (const call of batch.calls) {
    if (call.tool === 'fs.delete') {
      verdicts.push(gg.cancel(call.callId, 'Deleting files is not allowed.'));
    } else if (call.args !== null && 'password' in call.args) {
      verdicts.push(gg.rewrite(call.callId, { ...call.args, password: '***' }));
    }
  }
  return verdicts;
}

void gg.main(judge, { defaults: { name: 'no-delete-ts' } });
