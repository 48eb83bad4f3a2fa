//! The hook where a judged result is handed on (R33): once a request of
//! results is decided and recorded, and before its answer leaves the
//! mesh, every result decision is offered to the mesh's [`ResultReads`],
//! if one is set ([`crate::Mesh::on_result_read`]), to learn "this result,
//! of this call, in this session, by this caller, was read". Session
//! memory (R34) does not wait for it: a result is remembered before its
//! record is written (`mesh/batch_session.rs`).

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

    /// Hands the result decisions of `decision` on to the hook, if any,
    /// one by one. (Session memory remembered them before the record was
    /// written, `mesh/batch_session.rs`.)
    pub(crate) fn results_read(&self, by: &ReadBy, decision: &guardmesh_proto::v1::BatchDecision) {
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
