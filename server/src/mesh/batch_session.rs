//! Session memory in a batch's way (R34): read before the guards are
//! consulted, when a guard of the chain reads it, and the calls that run
//! recorded after the decision. Kept apart from the pipeline so that the
//! pipeline's part is two calls.

use super::Mesh;
use crate::judge::{Chain, Phase, TraceContext};
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

impl BatchSession {
    /// What the guards read, taken out: the batch keeps only the key and
    /// server it writes to.
    pub(crate) fn take_value(&mut self) -> SessionVal {
        std::mem::replace(
            &mut self.value,
            SessionVal::Unavailable(Arc::from("handed to the judge")),
        )
    }
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
    /// of whose rules names `session`.
    pub(crate) fn chain_reads_session(chain: &Chain) -> bool {
        chain
            .guards
            .iter()
            .filter_map(|g| g.guard.policy.as_ref())
            .any(|p| p.compiled.reads_session())
    }

    /// Whether a guard of `chain` uses session memory at all: a policy
    /// guard reads `session`, or a remote guard asked for the memory.
    pub(crate) fn chain_uses_session(chain: &Chain) -> bool {
        Self::chain_reads_session(chain)
            || chain.guards.iter().any(|g| g.guard.wants_session_memory())
    }

    /// Whether this batch needs the session's memory (R34): a policy guard
    /// reads `session`, or a remote guard that asked for the memory
    /// (`session_memory = read`) judges this phase and applies to one of
    /// the batch's calls. Otherwise nothing is read for the batch.
    pub(crate) fn batch_needs_session(
        chain: &Chain,
        request: &EvaluateRequest,
        phase: &Phase,
    ) -> bool {
        Self::chain_reads_session(chain)
            || chain.guards.iter().any(|g| {
                g.guard.wants_session_memory()
                    && phase.reaches(&g.guard)
                    && request.calls.iter().any(|c| g.guard.tools.matches(&c.tool))
            })
    }

    /// The key of the batch's session: the caller's identity and the
    /// batch's session id.
    pub(crate) fn session_key(request: &EvaluateRequest, trace: &TraceContext) -> SessionKey {
        SessionKey::new(
            trace.identity.as_ref(),
            request
                .context
                .as_ref()
                .map_or("", |c| c.session_id.as_str()),
        )
    }

    /// Reads the batch's session before judging, when it needs it.
    /// A store that cannot answer gives [`SessionVal::Unavailable`]: the
    /// rules that read it fail per their guard's policy (R13), and remote
    /// guards are sent why it could not be read.
    pub(crate) async fn read_session(
        &self,
        chain: &Chain,
        request: &EvaluateRequest,
        trace: &TraceContext,
        phase: &Phase,
        busy: Option<Arc<str>>,
    ) -> Option<BatchSession> {
        if !Self::batch_needs_session(chain, request, phase) {
            return None;
        }
        let key = Self::session_key(request, trace);
        let server = Self::metadata_server(request);
        // R34: without its turn the memory is not read; the rules that need
        // it fail per their guard's policy.
        let value = match busy {
            Some(why) => SessionVal::Unavailable(why),
            None => match self.sessions().read(&key).await {
                Ok(view) => SessionVal::Read(view),
                Err(error) => SessionVal::Unavailable(Arc::from(error.to_string())),
            },
        };
        Some(BatchSession { key, value, server })
    }

    fn metadata_server(request: &EvaluateRequest) -> Option<String> {
        request
            .context
            .as_ref()
            .and_then(|c| c.metadata.get("server"))
            .filter(|s| !s.is_empty())
            .cloned()
    }

    /// The session a batch that read no memory writes labels to (R34): a
    /// guard set labels though no guard read the memory.
    pub(crate) fn label_session(request: &EvaluateRequest, trace: &TraceContext) -> BatchSession {
        BatchSession {
            key: Self::session_key(request, trace),
            value: SessionVal::Unavailable(Arc::from("not read")),
            server: Self::metadata_server(request),
        }
    }

    /// Records the calls that run (and the labels set) in the session.
    /// A write that fails is logged and counted; the next batch's read
    /// fails the same way, so the rules that need memory fail closed then.
    pub(crate) async fn remember_session(
        &self,
        session: &BatchSession,
        decision: &BatchDecision,
        labels: Vec<String>,
        calls: bool,
    ) -> Option<Applied> {
        let sessions = self.sessions();
        let calls = decision
            .execute
            .iter()
            .filter(|_| calls)
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
