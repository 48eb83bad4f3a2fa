//! A guard run as several replicas (R32), seen from the coordinator: the
//! deny-list guards' decision, the replica each trace names, and the
//! replicas that judged a load, counted.

use super::*;

/// A one-call batch (`c`, tool `t`) of turn `round`, with a 10 s timeout:
/// what a proceeding guard's replicas judge under load.
pub(crate) fn one_call(round: usize) -> guardmesh_client::Batch {
    guardmesh_client::Batch::new(u32::try_from(round).unwrap())
        .call("c", "t", "{}")
        .timeout(Duration::from_secs(10))
}

/// Whether `d` is what a live deny-list guard `guard` decides for a batch
/// of a `del` (`fs.delete`) and a `read` (`fs.read`) call: the delete
/// cancelled by the guard itself (not by its failure), the read run.
pub(crate) fn deny_list_decided(d: &guardmesh_client::BatchDecision, guard: &str) -> bool {
    let [del, read] = d.calls.as_slice() else {
        return false;
    };
    matches!(del.outcome, guardmesh_client::Outcome::Cancel { .. })
        && !del.failure
        && del.decided_by.as_deref() == Some(guard)
        && read.proceeds()
        && !read.failure
}

/// The replica of `guard` that judged `d`, from its trace entry (R32);
/// empty when the trace names none.
pub(crate) fn replica_of(d: &guardmesh_client::BatchDecision, guard: &str) -> String {
    d.trace
        .iter()
        .find(|t| t.guard == guard)
        .map(|t| t.replica.clone())
        .unwrap_or_default()
}

/// The decisions of load tasks, each a list of (replica, whether it was
/// right), gathered within 30 s each: the replicas counted, and how many
/// decisions were wrong.
pub(crate) async fn count_replicas(
    tasks: Vec<JoinHandle<Vec<(String, bool)>>>,
) -> (std::collections::HashMap<String, usize>, usize) {
    let mut counts = std::collections::HashMap::new();
    let mut wrong = 0;
    for task in tasks {
        for (replica, ok) in tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("every batch answered")
            .unwrap()
        {
            *counts.entry(replica).or_default() += 1;
            wrong += usize::from(!ok);
        }
    }
    (counts, wrong)
}

/// The Python script of a kit guard (grpcio, default server options) named
/// `name` that cancels `fs.delete` as `no_delete.py` does and answers its
/// stdin: `prelude` (more imports, its state) comes after the kit's import,
/// `work` runs at the start of every batch it judges, and `answer` once for
/// each line on its stdin, stripped as `command`; both indented by four
/// spaces.
pub(crate) fn deny_list_script(prelude: &str, work: &str, name: &str, answer: &str) -> String {
    format!(
        r#"
import sys
from guardmesh import guard as gg
{prelude}
def judge(batch):
{work}
    for call in batch.calls:
        if call.tool == "fs.delete":
            yield gg.cancel(call.call_id, "Deleting files is not allowed.")

server, port = gg.serve(judge, port=0, name="{name}")
print(f"LISTENING {{port}}", flush=True)
for line in sys.stdin:
    command = line.strip()
{answer}
"#
    )
}
