//! The hook where a judged result is handed on (R33, for R34): once a
//! request of results is decided and recorded, and before its answer
//! leaves the mesh, every result decision is offered to the mesh's
//! [`ResultReads`], if one is set ([`crate::Mesh::on_result_read`]).
//! Session memory (R34) implements it to learn "this result, of this call,
//! in this session, by this caller, was read".

use guardmesh_proto::v1::{ResultAction, ResultDecision};
use std::sync::Arc;

/// One result the model will read, as the mesh decided it.
#[derive(Debug, Clone, Copy)]
pub struct ResultRead<'a> {
    /// The batch's session (`BatchContext.session_id`; empty when none).
    pub session_id: &'a str,
    /// The authenticated caller that sent the result (the identity the
    /// auth layer gave it), `None` without authentication.
    pub caller: Option<&'a str>,
    /// The coordinator's batch id of the request of results.
    pub batch_id: &'a str,
    /// The decision: its call id, action (pass, rewrite, block), what the
    /// model reads (`result`), and the result as sent (`original`: tool,
    /// server, raw result).
    pub decision: &'a ResultDecision,
}

impl ResultRead<'_> {
    /// Whether the model reads the tool's content (passed or rewritten),
    /// not a block.
    pub fn read(&self) -> bool {
        self.decision.action != ResultAction::Block as i32
    }
}

/// Learns of each result the mesh decided (R33), in request order, once per
/// result, after its decision record is written. Called on the task that
/// answers the coordinator: it must not block (hand the work on).
pub trait ResultReads: Send + Sync + 'static {
    fn result_read(&self, read: ResultRead<'_>);
}

/// The caller's identity and the session a request of results came with.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReadBy {
    pub(crate) session_id: String,
    pub(crate) caller: Option<Arc<str>>,
    pub(crate) batch_id: String,
}

impl crate::Mesh {
    /// Sets the hook told of every result decision (R33); the first one
    /// set stays. False when one was already set.
    pub fn on_result_read(&self, reads: Arc<dyn ResultReads>) -> bool {
        self.result_reads.set(reads).is_ok()
    }

    /// Hands the result decisions of `decision` on: session memory
    /// remembers what the model reads (R34: digests of its values, in the
    /// caller's session), and the hook, if any, is told of each.
    pub(crate) async fn results_read(
        &self,
        by: &ReadBy,
        decision: &guardmesh_proto::v1::BatchDecision,
    ) {
        // Remembered in the caller's session, the empty session id
        // included (its calls are recorded there too: leaving the id out
        // must not escape a flow rule), when a guard of the chain uses
        // session memory at all (otherwise its calls were not recorded
        // either, and there is nothing to learn).
        if Self::chain_uses_session(&self.chain()) {
            let key = crate::session::SessionKey::new(
                by.caller.as_deref().unwrap_or_default(),
                by.session_id.as_str(),
            );
            let results: Vec<crate::session::ResultSeen<'_>> = decision
                .results
                .iter()
                .map(|result| {
                    let (tool, server) = result
                        .original
                        .as_ref()
                        .map_or(("", ""), |o| (o.tool.as_str(), o.server.as_str()));
                    crate::session::ResultSeen {
                        call_id: &result.call_id,
                        tool,
                        server,
                        result_json: &result.result,
                        labels: &[],
                    }
                })
                .collect();
            // One load and one update of the session for the whole
            // request, however many results it holds.
            match self.sessions().results_seen(&key, &results).await {
                Ok(seen) => {
                    for (result, outcome) in decision.results.iter().zip(&seen.outcomes) {
                        if let Err(error) = outcome {
                            tracing::warn!(
                                %error,
                                call_id = %result.call_id,
                                "a result read was not remembered in its session"
                            );
                        }
                    }
                }
                Err(error) => tracing::warn!(
                    %error,
                    results = results.len(),
                    "the results read were not remembered in their session"
                ),
            }
        }
        let Some(reads) = self.result_reads.get() else {
            return;
        };
        for result in &decision.results {
            reads.result_read(ResultRead {
                session_id: &by.session_id,
                caller: by.caller.as_deref(),
                batch_id: &by.batch_id,
                decision: result,
            });
        }
    }
}
