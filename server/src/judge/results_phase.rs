//! The results phase of judging (R33), kept apart from the calls' path: a
//! result is judged as a call whose `arguments` are its `CallToolResult`
//! JSON, through the same fold, failure policies, deadlines, dry run and
//! traces. What differs is here: which guards a phase reaches, the order
//! (validate guards first, on the raw result; then mutate guards), the
//! grant a rewrite is held to, and how the results are put on the wire.

use crate::admit::result_batch::ResultBatch;
use crate::registry::spec::Guard;
use crate::wire::fields::guard_batch;
use crate::wire::write;
use guardmesh_proto::v1::{BatchContext, GuardRole, ToolCall, ToolResult};
use prost::bytes::Bytes;

/// What a batch carries: calls before they run, or results before the
/// model reads them (R33).
#[derive(Debug, Clone, Default)]
pub(crate) enum Phase {
    #[default]
    Calls,
    Results(ResultBatch),
}

impl Phase {
    /// Whether `guard` is consulted in this phase.
    pub(crate) fn reaches(&self, guard: &Guard) -> bool {
        match self {
            Self::Calls => guard.judges_calls(),
            Self::Results(_) => guard.judges_results(),
        }
    }

    pub(crate) fn is_results(&self) -> bool {
        matches!(self, Self::Results(_))
    }
}

/// The context and the results a guard is sent, encoded as the tail of a
/// `GuardBatch` (the part every guard sent the same results shares): the
/// results as they stand (`calls`, with their servers).
pub(crate) fn shared_part<'a>(
    context: Option<&BatchContext>,
    results: &ResultBatch,
    calls: impl Iterator<Item = (usize, &'a ToolCall)>,
) -> Bytes {
    let mut buf = Vec::new();
    if let Some(context) = context {
        write::message(guard_batch::CONTEXT, context, &mut buf);
    }
    for (i, call) in calls {
        let result = ToolResult {
            call_id: call.call_id.clone(),
            tool: call.tool.clone(),
            server: results.servers().get(i).cloned().unwrap_or_default(),
            result: call.arguments.clone(),
        };
        write::message(guard_batch::RESULTS, &result, &mut buf);
    }
    Bytes::from(buf)
}

impl super::Judging<'_> {
    /// Consults the guards of a batch of results (R33): validate guards
    /// judge the raw result first, then mutate guards rewrite it, one after
    /// another in chain order.
    pub(super) async fn consult_results(&mut self) -> Result<(), super::BatchError> {
        self.validate().await?;
        for g in 0..self.chain.guards.len() {
            if self.chain.guards[g].guard.role == GuardRole::Mutate {
                self.mutate(g).await?;
            }
        }
        Ok(())
    }
}

impl super::Chain {
    /// Whether a guard of the chain (enforced or dry run) judges results:
    /// only then is a result worth the round trip (R33).
    pub fn judges_results(&self) -> bool {
        self.guards.iter().any(|g| g.guard.judges_results())
    }
}
