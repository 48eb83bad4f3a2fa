//! Session memory in a batch's way (R34): read before the guards are
//! consulted, when a guard of the chain reads it, and the calls that run
//! recorded after the decision. Kept apart from the pipeline so that the
//! pipeline's part is two calls.

use super::Mesh;
use crate::judge::{Chain, TraceContext};
use crate::policy::SessionVal;
use crate::session::{Applied, SessionKey, SessionMemory, Update};
use guardmesh_proto::v1::{BatchDecision, EvaluateRequest};
use std::sync::Arc;

/// The session a batch reads and writes, when its chain needs memory.
pub(crate) struct BatchSession {
    pub(crate) key: SessionKey,
    /// What the policy guards read: the memory, or why it cannot be read.
    pub(crate) value: SessionVal,
    /// The metadata `server` of the batch, if given (the tool's server).
    server: Option<String>,
}

impl Mesh {
    /// Session memory: a shared store attached with
    /// [`Mesh::attach_sessions`], else this mesh's own memory.
    pub fn sessions(&self) -> &Arc<SessionMemory> {
        self.sessions
            .get_or_init(|| Arc::new(SessionMemory::in_memory(self.config.sessions)))
    }

    /// Attaches session memory kept in a shared store (replicas, R34).
    /// Once per mesh, before its first batch; a second is refused
    /// (returned).
    pub fn attach_sessions(&self, sessions: Arc<SessionMemory>) -> Result<(), Arc<SessionMemory>> {
        self.sessions.set(sessions)
    }

    /// Whether a guard of `chain` reads session memory: a policy guard one
    /// of whose rules names `session`. Otherwise nothing is read or
    /// written for the batch.
    pub(crate) fn chain_reads_session(chain: &Chain) -> bool {
        chain
            .guards
            .iter()
            .filter_map(|g| g.guard.policy.as_ref())
            .any(|p| p.compiled.reads_session())
    }

    /// Reads the batch's session before judging, when its chain needs it.
    /// A store that cannot answer gives [`SessionVal::Unavailable`]: the
    /// rules that read it fail per their guard's policy (R13).
    pub(crate) async fn read_session(
        &self,
        chain: &Chain,
        request: &EvaluateRequest,
        trace: &TraceContext,
    ) -> Option<BatchSession> {
        if !Self::chain_reads_session(chain) {
            return None;
        }
        let context = request.context.as_ref();
        let key = SessionKey::new(
            trace.identity.as_ref(),
            context.map_or("", |c| c.session_id.as_str()),
        );
        let server = context
            .and_then(|c| c.metadata.get("server"))
            .filter(|s| !s.is_empty())
            .cloned();
        let value = match self.sessions().read(&key).await {
            Ok(view) => SessionVal::Read(view),
            Err(error) => SessionVal::Unavailable(Arc::from(error.to_string())),
        };
        Some(BatchSession { key, value, server })
    }

    /// Records the calls that run (and the labels set) in the session.
    /// A write that fails is logged and counted; the next batch's read
    /// fails the same way, so the rules that need memory fail closed then.
    pub(crate) async fn remember_session(
        &self,
        session: &BatchSession,
        decision: &BatchDecision,
        labels: Vec<String>,
    ) -> Option<Applied> {
        let sessions = self.sessions();
        let calls = decision
            .execute
            .iter()
            .map(|call| {
                let server = SessionMemory::server_of(&call.tool, session.server.as_deref());
                sessions.call(&call.call_id, &call.tool, server, &call.arguments)
            })
            .collect();
        let update = Update {
            calls,
            labels,
            ..Update::default()
        };
        if update.is_empty() {
            return None;
        }
        sessions.record(&session.key, &update).await.ok()
    }
}
