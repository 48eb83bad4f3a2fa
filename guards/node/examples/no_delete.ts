// The minimal Node guard in TypeScript: cancels file deletions, masks
// passwords. Checked with `tsc --strict` (examples/tsconfig.json); in a
// project of your own, import from 'guardmesh-guard' instead.
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
