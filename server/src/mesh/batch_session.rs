//! Session memory in a batch's way (R34): read before the guards are
//! consulted, when a guard of the chain reads it, and the calls that run
//! recorded after the decision. Kept apart from the pipeline so that the
//! pipeline's part is two calls.

use super::Mesh;
use crate::admit::result_batch::{self, ResultBatch};
use crate::judge::{Chain, Phase, TraceContext};
use crate::policy::{Policy, SessionVal};
use crate::session::{
    Applied, Mismatch, ResultError, ResultSeen, SessionKey, SessionMemory, StoreError, Update,
};
use crate::validate;
use guardmesh_proto::v1::{BatchDecision, EvaluateRequest};
use std::sync::Arc;

/// The session a batch reads and writes, when its chain needs memory.
pub(crate) struct BatchSession {
    pub(crate) key: SessionKey,
    /// What the policy guards read: the memory, or why it cannot be read.
    pub(crate) value: SessionVal,
    /// The metadata `server` of the batch, if given (the tool's server).
    server: Option<String>,
    /// The memory's updates when it was read, when the store is shared by
    /// replicas: the batch's write is applied only if no other replica
    /// wrote meanwhile (R34, [`Update::read_at`]).
    read_at: Option<u64>,
    /// The memory of the caller's identity across its sessions, when a
    /// policy rule of the chain reads `identity` (R34).
    pub(crate) identity: Option<IdentityMemory>,
}

/// The memory of a batch's caller across its sessions (R34), kept in the
/// same store as sessions under [`SessionKey::identity`]: read with the
/// session's, and written before it with the same calls, labels and
/// values seen.
pub(crate) struct IdentityMemory {
    key: SessionKey,
    /// What the policy rules read as `identity`.
    value: SessionVal,
    /// As [`BatchSession::read_at`], of the identity's memory.
    read_at: Option<u64>,
}

/// A request of results in its session (R33, R34): the session its
/// results are remembered in, and the calls they answer as the session
/// recorded them.
pub(crate) struct ResultsSession {
    key: SessionKey,
    /// Per result, in request order: the server its call was recorded
    /// with, or why it is not remembered (a call that did not run in the
    /// session). `Err` with why when the memory could not be read.
    calls: Result<Vec<Result<String, ResultError>>, Arc<str>>,
    /// As [`BatchSession::read_at`], of the memory the calls were looked
    /// up in.
    read_at: Option<u64>,
    /// The identity's memory the results are remembered in too, and its
    /// `read_at` (R34).
    identity: Option<(SessionKey, Option<u64>)>,
}

impl ResultsSession {
    /// Per result of the `n`, whether it was to be remembered: its call
    /// ran in the session, or the memory could not be read to tell (then
    /// every one).
    pub(crate) fn affected(&self, n: usize) -> Vec<bool> {
        match &self.calls {
            Ok(calls) => calls.iter().map(Result::is_ok).collect(),
            Err(_) => vec![true; n],
        }
    }
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

    /// What the policy rules read as `identity`, taken out as
    /// [`Self::take_value`].
    pub(crate) fn take_identity(&mut self) -> Option<SessionVal> {
        self.identity.as_mut().map(|identity| {
            std::mem::replace(
                &mut identity.value,
                SessionVal::Unavailable(Arc::from("handed to the judge")),
            )
        })
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
        Self::chain_has_policy(chain, Policy::reads_session)
    }

    /// Whether a guard of `chain` reads the memory of the caller's
    /// identity: a policy guard one of whose rules names `identity` (R34).
    pub(crate) fn chain_reads_identity(chain: &Chain) -> bool {
        Self::chain_has_policy(chain, Policy::reads_identity)
    }

    /// Whether a policy guard of `chain` has a policy that `holds`.
    fn chain_has_policy(chain: &Chain, holds: impl Fn(&Policy) -> bool) -> bool {
        chain
            .guards
            .iter()
            .filter_map(|g| g.guard.policy.as_ref())
            .any(|p| holds(&p.compiled))
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
        let value = match busy.clone() {
            Some(why) => SessionVal::Unavailable(why),
            None => match self.sessions().read(&key).await {
                Ok(view) => SessionVal::Read(view),
                Err(error) => SessionVal::Unavailable(Arc::from(error.to_string())),
            },
        };
        let read_at = match &value {
            SessionVal::Read(view) => self.read_at(view),
            SessionVal::Unavailable(_) => None,
        };
        let identity = if Self::chain_reads_identity(chain) {
            Some(self.read_identity(trace, busy).await)
        } else {
            None
        };
        Some(BatchSession {
            key,
            value,
            server,
            read_at,
            identity,
        })
    }

    /// Reads the memory of the batch's caller across its sessions (R34):
    /// keyed by the identity the mesh authenticated (on a mesh without
    /// principals every caller is the identity `""`, R24). Never an empty
    /// memory in place of one that cannot be read: the rules that read it
    /// fail (R13).
    async fn read_identity(&self, trace: &TraceContext, busy: Option<Arc<str>>) -> IdentityMemory {
        let key = SessionKey::identity(trace.identity.as_ref());
        let value = match busy {
            Some(why) => SessionVal::Unavailable(why),
            None => match self.sessions().read(&key).await {
                Ok(view) => SessionVal::Read(view),
                Err(error) => {
                    SessionVal::Unavailable(Arc::from(format!("the identity's memory: {error}")))
                }
            },
        };
        let read_at = match &value {
            SessionVal::Read(view) => self.read_at(view),
            SessionVal::Unavailable(_) => None,
        };
        IdentityMemory {
            key,
            value,
            read_at,
        }
    }

    /// What a batch judged on `view` writes with, when the store is
    /// shared by replicas (a store of one mesh keeps a batch's read and
    /// write together with the mesh's session turns).
    fn read_at(&self, view: &crate::session::SessionView) -> Option<u64> {
        self.sessions().store().shared().then(|| view.writes())
    }

    /// The calls the results of `request` answer, looked up in the
    /// session's memory (R34: a result belongs to the server of the call
    /// it answers, as the mesh recorded it): each result whose call ran
    /// in the session is attributed to that call's server in `results`
    /// (guards are sent it, and its values are remembered from it),
    /// whatever server it named, empty included; a result naming another
    /// server refuses the request, naming both. `session`: the memory the
    /// batch read for its guards, if it read it; otherwise it is read
    /// here.
    pub(crate) async fn results_session(
        &self,
        session: Option<&BatchSession>,
        request: &EvaluateRequest,
        trace: &TraceContext,
        results: &mut ResultBatch,
    ) -> Result<ResultsSession, validate::Refusal> {
        let key = session.map_or_else(|| Self::session_key(request, trace), |s| s.key.clone());
        let identity = session
            .and_then(|s| s.identity.as_ref())
            .map(|i| (i.key.clone(), i.read_at));
        let read;
        let view = match session.map(|s| &s.value) {
            Some(SessionVal::Read(view)) => view,
            Some(SessionVal::Unavailable(why)) => {
                return Ok(ResultsSession {
                    key,
                    calls: Err(why.clone()),
                    read_at: None,
                    identity,
                });
            }
            None => {
                read = self.sessions().read(&key).await;
                match &read {
                    Ok(view) => view,
                    Err(error) => {
                        return Ok(ResultsSession {
                            key,
                            calls: Err(Arc::from(error.to_string())),
                            read_at: None,
                            identity,
                        });
                    }
                }
            }
        };
        let read_at = self.read_at(view);
        let mut calls = Vec::with_capacity(request.calls.len());
        for (i, call) in request.calls.iter().enumerate() {
            let sent = results.servers().get(i).map_or("", String::as_str);
            match view.call_answered(&call.call_id, &call.tool, sent) {
                Ok(server) => {
                    let server = server.to_owned();
                    results.attribute(i, &server);
                    calls.push(Ok(server));
                }
                Err(ResultError::OtherServer(Mismatch { sent, recorded, .. })) => {
                    return Err(result_batch::other_server(
                        i,
                        &call.call_id,
                        &call.tool,
                        &sent,
                        &recorded,
                    ));
                }
                Err(ResultError::OtherTool(Mismatch { sent, recorded, .. })) => {
                    return Err(result_batch::other_tool(i, &call.call_id, &sent, &recorded));
                }
                Err(other) => calls.push(Err(other)),
            }
        }
        Ok(ResultsSession {
            key,
            calls: Ok(calls),
            read_at,
            identity,
        })
    }

    /// Remembers what the model reads of each result of `decision` whose
    /// call ran in the session, from that call's server, with the labels
    /// the guards set: one write. A result for a call that did not run in
    /// the session teaches nothing (counted in a log line). `Err` with why
    /// when the memory could not be read or written.
    pub(crate) async fn remember_results(
        &self,
        session: ResultsSession,
        decision: &BatchDecision,
        labels: Vec<String>,
    ) -> Result<Option<Applied>, Unremembered> {
        let calls = session.calls.map_err(Unremembered::Failed)?;
        let reads: Vec<std::borrow::Cow<'_, str>> = decision
            .decisions
            .iter()
            .map(result_batch::model_reads)
            .collect();
        let results: Vec<ResultSeen<'_>> = decision
            .decisions
            .iter()
            .zip(&reads)
            .map(|(d, read)| ResultSeen {
                call_id: &d.call_id,
                tool: d.original.as_ref().map_or("", |c| c.tool.as_str()),
                server: "",
                result_json: read,
                labels: &[],
            })
            .collect();
        // R34: the identity's memory first (one order of writes), with the
        // same values seen and labels.
        if let Some((key, read_at)) = &session.identity {
            self.sessions()
                .remember_results(key, &results, calls.clone(), labels.clone(), *read_at)
                .await
                .map_err(Unremembered::from)?;
        }
        let seen = self
            .sessions()
            .remember_results(&session.key, &results, calls, labels, session.read_at)
            .await
            .map_err(Unremembered::from)?;
        // Counted, not named: a forged result's id is the caller's text,
        // perhaps a secret, and log lines are not masked as records are.
        let forgotten = seen.outcomes.iter().filter(|o| o.is_err()).count();
        if forgotten > 0 {
            tracing::warn!(
                results = forgotten,
                "results for calls that did not run in this session were not remembered"
            );
        }
        Ok(seen.applied)
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
            read_at: None,
            identity: None,
        }
    }

    /// Records the calls that run (and the labels set) in the session,
    /// before their proceed leaves the mesh. `Err` with why when the write
    /// failed (logged and counted): the calls then fail per the policy of
    /// the guards that read sessions (R34, R13; `judge::unremembered`).
    pub(crate) async fn remember_session(
        &self,
        session: &BatchSession,
        decision: &BatchDecision,
        labels: Vec<String>,
        calls: bool,
    ) -> Result<Option<Applied>, Unremembered> {
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
            read_at: session.read_at,
            ..Update::default()
        };
        // Nothing let run: nothing to serialize (a batch that only
        // cancelled on an older memory let nothing through).
        if update.is_empty() {
            return Ok(None);
        }
        // R34: the identity's memory first, with the same calls and
        // labels: a failure leaves the session unwritten, and the calls
        // fail per the readers' policy. Should the session's write then
        // find its memory changed by another replica, the batch is judged
        // again with its calls already in the identity's memory: counted
        // twice there, the safe side.
        if let Some(identity) = &session.identity {
            let update = Update {
                read_at: identity.read_at,
                ..update.clone()
            };
            sessions
                .record(&identity.key, &update)
                .await
                .map_err(Unremembered::from)?;
        }
        sessions
            .record(&session.key, &update)
            .await
            .map(Some)
            .map_err(Unremembered::from)
    }
}

/// Why what a batch let run or read was not remembered.
#[derive(Debug)]
pub(crate) enum Unremembered {
    /// Another replica wrote the session's memory after the batch read it:
    /// the batch is judged again on the memory as it is now (R34).
    Changed,
    /// The memory could not be read or written: why.
    Failed(Arc<str>),
}

impl From<StoreError> for Unremembered {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Changed => Self::Changed,
            other => Self::Failed(Arc::from(other.to_string())),
        }
    }
}

impl Unremembered {
    /// Why, for a batch that is not judged again.
    pub(crate) fn why(self) -> Arc<str> {
        match self {
            Self::Changed => Arc::from(StoreError::Changed.to_string()),
            Self::Failed(why) => why,
        }
    }
}
