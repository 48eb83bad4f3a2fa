//! Approvals (R35): a guard's *ask*, the request a person answers, and the
//! one use of its approval.
//!
//! * An ask fixes its call as a skip does in the chain's order (R3: an
//!   earlier skip wins over a later ask, an earlier ask over a later skip);
//!   its decision is `ask`, never proceed. After judging, [`settle`] makes
//!   the request: an id, and what it is bound to (the call's digest as the
//!   guard judged it, the session, the chain revision, the guard, an
//!   expiry), written to the session store.
//! * An approver answers it ([`answer`]): pending to approved or denied,
//!   by a compare-and-swap on the record, so two answers cannot both win.
//! * A batch that names the approval for a call ([`resolve`], before
//!   judging) has it checked: its session, its chain revision, its state
//!   and expiry. A valid approval stands in for the guard that asked
//!   (which is not consulted again for that call, when the call it would
//!   see has the approved digest); the guards after it judge as usual. A
//!   denied or expired request cancels the call; a pending one asks again
//!   with the same request. Anything else is refused with its reason and
//!   the call is judged as if no approval were named.
//! * When a call proceeds on an approval, [`settle`] records the use by a
//!   compare-and-swap from approved to used before the answer leaves: of
//!   two replicas racing one approval, one writes and the other's call is
//!   cancelled. A store that cannot be read or written never lets a call
//!   through on an approval (R13: could not judge is not proceed).

pub mod record;

use crate::session::{Put, SessionKey, SessionMemory, StoreError};
use guardmesh_proto::v1::{
    Action, ApprovalRequest, ApprovalState, BatchDecision, CallDecision, SkipKind,
};
use record::{Standing, Stored};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tonic::Status;

/// What the mesh holds of approvals: the settings, and counters.
#[derive(Debug)]
pub struct Approvals {
    pub settings: Settings,
    pub stats: Stats,
    metrics: Option<std::sync::Arc<crate::observe::metrics::Metrics>>,
}

/// The `[approvals]` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// How long a request may wait for its answer and its use.
    pub ttl: Duration,
    /// Requests one session may have waiting at once; past it an ask
    /// cancels its call (R25: a flood of asks is bounded).
    pub max_open_per_session: usize,
    /// Requests one identity may have waiting at once over all its
    /// sessions (a flood spread over many sessions is bounded too).
    pub max_open_per_identity: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(600),
            max_open_per_session: 16,
            max_open_per_identity: 256,
        }
    }
}

/// How long a record is kept past its expiry, so that a late or replayed
/// use is refused as used or expired rather than unknown.
const RETENTION: Duration = Duration::from_secs(3600);

/// Counters, read by the metrics.
#[derive(Debug, Default)]
pub struct Stats {
    pub asked: AtomicU64,
    pub approved: AtomicU64,
    pub denied: AtomicU64,
    pub used: AtomicU64,
    pub refused: AtomicU64,
    pub expired: AtomicU64,
    /// Asks turned into cancels: the session's bound, or a store that
    /// could not record them.
    pub unrecorded: AtomicU64,
}

impl Approvals {
    pub fn new(settings: Settings) -> Self {
        Self {
            settings,
            stats: Stats::default(),
            metrics: None,
        }
    }

    /// Counted in `metrics` too (`approvals{event}`).
    pub fn with_metrics(
        mut self,
        metrics: std::sync::Arc<crate::observe::metrics::Metrics>,
    ) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn count(&self, event: &'static str) {
        let counter = match event {
            "asked" => &self.stats.asked,
            "approved" => &self.stats.approved,
            "denied" => &self.stats.denied,
            "used" => &self.stats.used,
            "refused" => &self.stats.refused,
            "expired" => &self.stats.expired,
            _ => &self.stats.unrecorded,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(metrics) = &self.metrics {
            metrics.approval(event);
        }
    }
}

/// What an approval named by a batch comes to for its call, before judging.
#[derive(Debug, Clone)]
pub enum StandIn {
    /// Valid: guard `guard` is not consulted for the call when the call it
    /// would see has `digest`.
    Approved {
        guard: String,
        digest: String,
        id: String,
    },
    /// The call is decided before any guard: denied or expired (a cancel
    /// by `guard`), or still pending (asked again, same request).
    Fixed {
        guard: String,
        content: String,
        kind: SkipKind,
        pending: Option<Box<ApprovalRequest>>,
    },
}

/// One call's approval, resolved: what stands in, or why it does not.
#[derive(Debug, Clone, Default)]
pub struct Resolved {
    /// One per approval that holds (or decides the call), in the order
    /// named.
    pub stand_in: Vec<StandIn>,
    /// Why the others did not hold, `; `-separated.
    pub refused: Option<String>,
}

/// The most approvals one call may name: one per guard that asked about
/// it, comma-separated.
pub const MAX_PER_CALL: usize = 8;

/// Why a batch's approvals map is refused whole (INVALID_ARGUMENT).
pub fn check_map(
    approvals: &HashMap<String, String>,
    call_ids: &[&str],
) -> Result<(), crate::admit::Refusal> {
    for (call_id, ids) in approvals {
        let shown: String = call_id.chars().take(64).collect();
        if ids.split(',').count() > MAX_PER_CALL {
            return Err(crate::admit::Refusal::Invalid(crate::validate::Refusal {
                reason: "approval_too_many",
                status: Status::invalid_argument(format!(
                    "approvals names more than {MAX_PER_CALL} requests for call {shown:?}"
                )),
            }));
        }
        if !call_ids.contains(&call_id.as_str()) {
            return Err(crate::admit::Refusal::Invalid(crate::validate::Refusal {
                reason: "approval_unknown_call",
                status: Status::invalid_argument(format!(
                    "approvals names call {shown:?}, which is not in the batch"
                )),
            }));
        }
    }
    Ok(())
}

/// Resolves the approvals a batch names (R35), one per call in call order,
/// against its session and the chain revision it will be judged under.
pub async fn resolve(
    sessions: &SessionMemory,
    approvals: &Approvals,
    key: &SessionKey,
    named: &HashMap<String, String>,
    call_ids: &[&str],
    revision: u64,
    deadline: tokio::time::Instant,
) -> Vec<Resolved> {
    let mut out = vec![Resolved::default(); call_ids.len()];
    if named.is_empty() {
        return out;
    }
    let session_name = sessions.stored_name(key);
    let prefix = sessions.approval_prefix(key);
    let now = crate::session::now_ms();
    for (i, call_id) in call_ids.iter().enumerate() {
        let Some(ids) = named.get(*call_id) else {
            continue;
        };
        let mut refusals: Vec<String> = Vec::new();
        for id in ids.split(',').map(str::trim) {
            // Within the batch's deadline: a slow store makes approvals
            // refused, never a batch held past its time.
            let one = tokio::time::timeout_at(
                deadline,
                resolve_one(sessions, id, &session_name, &prefix, revision, now),
            )
            .await
            .unwrap_or_else(|_| One {
                stand_in: None,
                refused: Some(
                    "the approval could not be checked before the batch's deadline".into(),
                ),
            });
            if matches!(
                &one.stand_in,
                Some(StandIn::Fixed {
                    pending: None,
                    kind: SkipKind::Cancel,
                    ..
                })
            ) && one.refused.is_some()
            {
                // A request nobody answered in time: its call cancelled.
                approvals.count("expired");
            } else if one.refused.is_some() {
                approvals.count("refused");
            }
            out[i].stand_in.extend(one.stand_in);
            refusals.extend(one.refused);
        }
        if !refusals.is_empty() {
            out[i].refused = Some(refusals.join("; "));
        }
    }
    out
}

/// What one approval named comes to.
struct One {
    stand_in: Option<StandIn>,
    refused: Option<String>,
}

fn refused(why: impl Into<String>) -> One {
    One {
        stand_in: None,
        refused: Some(why.into()),
    }
}

async fn resolve_one(
    sessions: &SessionMemory,
    id: &str,
    session_name: &str,
    prefix: &str,
    revision: u64,
    now: u64,
) -> One {
    if !record::well_formed(id) {
        return refused("not an approval request id (64 lowercase hex digits)");
    }
    // The id carries its session: one of another session (or identity)
    // is refused without a read.
    if id[..32] != *prefix {
        return refused("the approval request belongs to another session");
    }
    let read = sessions
        .bounded(sessions.store().record(&record::name(id)))
        .await;
    let stored = match read {
        Ok(Some(found)) => match Stored::from_json(&found.value) {
            Ok(stored) => stored,
            Err(why) => return refused(format!("the approval cannot be read: {why}")),
        },
        Ok(None) => return refused("no such approval request (never made, or long expired)"),
        Err(error) => return refused(format!("the approval could not be checked: {error}")),
    };
    if stored.id != id || stored.session_name != session_name {
        return refused("the approval request belongs to another session");
    }
    let expired = || {
        format!(
            "Tool call blocked: approval request {} expired before anyone approved it, \
             so the guard {} falls back to its fallback. Ask again if it is still needed.",
            stored.id, stored.guard
        )
    };
    match stored.state(now) {
        ApprovalState::Denied => One {
            stand_in: Some(StandIn::Fixed {
                guard: stored.guard.clone(),
                content: if stored.note.is_empty() {
                    "Tool call blocked: an approver denied it. Do not retry it.".to_owned()
                } else {
                    format!(
                        "Tool call blocked: an approver denied it ({}). Do not retry it.",
                        stored.note
                    )
                },
                kind: SkipKind::Cancel,
                pending: None,
            }),
            refused: None,
        },
        ApprovalState::Expired if stored.standing == Standing::Pending => One {
            stand_in: Some(StandIn::Fixed {
                guard: stored.guard.clone(),
                content: expired(),
                // The guard's fallback (R35): cancel unless it said steer.
                kind: if stored.steer_on_expiry {
                    SkipKind::Steer
                } else {
                    SkipKind::Cancel
                },
                pending: None,
            }),
            refused: Some("the approval request expired unanswered".into()),
        },
        ApprovalState::Expired => refused("the approval expired before it was used"),
        ApprovalState::Used => refused("the approval was already used"),
        _ if stored.chain_revision != revision => refused(format!(
            "the chain changed since the request (revision {}, now {revision}): asked again",
            stored.chain_revision
        )),
        ApprovalState::Pending => One {
            stand_in: Some(StandIn::Fixed {
                guard: stored.guard.clone(),
                content: waiting_content(&stored.guard),
                kind: SkipKind::Cancel,
                pending: Some(Box::new(stored.to_wire(now))),
            }),
            refused: Some("the approval request is not answered yet".into()),
        },
        ApprovalState::Approved => One {
            stand_in: Some(StandIn::Approved {
                guard: stored.guard,
                digest: stored.digest,
                id: stored.id,
            }),
            refused: None,
        },
        ApprovalState::Unspecified => refused("the approval request is in no known state"),
    }
}

/// What the model reads while a call waits for a person.
pub fn waiting_content(guard: &str) -> String {
    format!(
        "Tool call paused: the guard {guard} asks a person to approve it first. \
         It has not run. Wait for the approval, then make the same call again."
    )
}

/// Whether [`settle`] has anything to do: a call ran on an approval, or a
/// guard asked.
pub fn settles(decision: &BatchDecision) -> bool {
    decision.decisions.iter().any(|d| {
        !d.approved_by_request.is_empty()
            || (d.action == Action::Ask as i32
                && d.approval.as_ref().is_some_and(|a| a.id.is_empty()))
    })
}

/// After judging, before the record and the answer (R35, R29): records the
/// use of each approval a proceeding call ran on (a call whose use cannot
/// be recorded is cancelled), then makes the request of each new ask (an
/// ask that cannot be recorded, or past the session's bound, is
/// cancelled).
pub async fn settle(
    sessions: &SessionMemory,
    approvals: &Approvals,
    key: &SessionKey,
    asked_by: &str,
    decision: &mut BatchDecision,
    deadline: tokio::time::Instant,
) {
    let now = crate::session::now_ms();
    // The store's work after judging is bounded by the batch's deadline
    // (at least a moment after judging ends): what cannot be done by then
    // fails closed (a use cancels its call, an ask cancels its call).
    let deadline = deadline.max(tokio::time::Instant::now() + Duration::from_millis(50));
    let late = || "not done before the batch's deadline".to_owned();
    let mut cancelled = false;
    for d in &mut decision.decisions {
        if d.action == Action::Proceed as i32 && !d.approved_by_request.is_empty() {
            // One per guard that asked; all used, or the call does not
            // run (an approval used before one that fails stays used:
            // fail closed).
            let mut used = Ok(());
            for id in d.approved_by_request.split(',') {
                used = tokio::time::timeout_at(deadline, use_approval(sessions, id, now))
                    .await
                    .unwrap_or_else(|_| Err(late()));
                if used.is_err() {
                    break;
                }
            }
            match used {
                Ok(()) => {
                    approvals.count("used");
                }
                Err(why) => {
                    approvals.count("refused");
                    tracing::warn!(call_id = %d.call_id, why = %why, "an approval could not be used");
                    d.action = Action::Cancel as i32;
                    d.content = format!(
                        "Tool call blocked: its approval could not be used ({why}). It did not run."
                    );
                    d.approval_refused = why;
                    d.approved_by_request.clear();
                    d.failure = true;
                    cancelled = true;
                }
            }
        }
    }
    if cancelled {
        let runs: Vec<&CallDecision> = decision
            .decisions
            .iter()
            .filter(|d| d.action == Action::Proceed as i32)
            .collect();
        decision.execute = runs.iter().filter_map(|d| d.call.clone()).collect();
    }
    if !decision.decisions.iter().any(|d| {
        d.action == Action::Ask as i32 && d.approval.as_ref().is_some_and(|a| a.id.is_empty())
    }) {
        return;
    }
    let session_name = sessions.stored_name(key);
    let prefix = sessions.approval_prefix(key);
    // The requests waiting, of this session and of its identity (every
    // session of it): both bounded (R25).
    let (per_session, per_identity) = (
        approvals.settings.max_open_per_session,
        approvals.settings.max_open_per_identity,
    );
    let waiting = |records: Vec<crate::session::store::Record>| {
        records
            .iter()
            .filter_map(|r| Stored::from_json(&r.value).ok())
            .filter(|s| s.state(now) == ApprovalState::Pending)
            .map(|s| s.session_name == session_name)
            .collect::<Vec<bool>>()
    };
    let listed = tokio::time::timeout_at(
        deadline,
        sessions.bounded(sessions.store().records(
            &format!("{}{}", record::PREFIX, &prefix[..16]),
            per_identity.saturating_mul(4).max(64),
        )),
    )
    .await
    .unwrap_or_else(|_| Err(StoreError::Unavailable(late())));
    let mut open = match listed {
        Ok(records) => {
            let waiting = waiting(records);
            Ok((waiting.iter().filter(|mine| **mine).count(), waiting.len()))
        }
        Err(error) => Err(error),
    };
    let session_id = key.session_id.clone();
    for d in &mut decision.decisions {
        let Some(approval) = d.approval.as_mut() else {
            continue;
        };
        if d.action != Action::Ask as i32 || !approval.id.is_empty() {
            continue;
        }
        let unrecorded = |d: &mut CallDecision, why: String| {
            d.action = Action::Cancel as i32;
            d.content = format!(
                "Tool call blocked: the guard {} asks a person to approve it, but {why}. \
                 It did not run.",
                d.decided_by
            );
            d.approval = None;
            d.failure = true;
        };
        let (session_count, identity_count) = match &open {
            Ok(counts) => *counts,
            Err(error) => {
                approvals.count("unrecorded");
                unrecorded(d, format!("the request could not be recorded ({error})"));
                continue;
            }
        };
        let full = if session_count >= per_session {
            Some(format!(
                "this session already has {per_session} approval requests waiting \
                 (approvals.max_open_per_session)"
            ))
        } else if identity_count >= per_identity {
            Some(format!(
                "this caller already has {per_identity} approval requests waiting \
                 over its sessions (approvals.max_open_per_identity)"
            ))
        } else {
            None
        };
        if let Some(why) = full {
            approvals.count("unrecorded");
            unrecorded(d, why);
            continue;
        }
        let call = d.call.clone().unwrap_or_default();
        let stored = Stored {
            id: record::new_id(&prefix),
            guard: approval.guard.clone(),
            reason: record::clip(&approval.reason),
            digest: approval.digest.clone(),
            session_id: session_id.clone(),
            session_name: session_name.clone(),
            chain_revision: decision.chain_revision,
            asked_at_ms: now,
            expires_at_ms: now.saturating_add(
                u64::try_from(approvals.settings.ttl.as_millis()).unwrap_or(u64::MAX),
            ),
            asked_by: asked_by.to_owned(),
            tool: call.tool,
            arguments: call.arguments,
            standing: Standing::Pending,
            answered_by: String::new(),
            note: String::new(),
            answered_at_ms: 0,
            used_at_ms: 0,
            steer_on_expiry: approval.fallback == guardmesh_proto::v1::AskFallback::Steer as i32,
        };
        let written = tokio::time::timeout_at(
            deadline,
            sessions.bounded(sessions.store().put_record(Put {
                name: &record::name(&stored.id),
                version: None,
                value: stored.to_json(),
                ttl: approvals.settings.ttl + RETENTION,
            })),
        )
        .await
        .unwrap_or_else(|_| Err(StoreError::Unavailable(late())));
        match written {
            Ok(true) => {
                approvals.count("asked");
                *approval = stored.to_wire(now);
                if let Ok((session_count, identity_count)) = &mut open {
                    *session_count += 1;
                    *identity_count += 1;
                }
            }
            Ok(false) => {
                approvals.count("unrecorded");
                unrecorded(d, "a request with its id already exists".into());
            }
            Err(error) => {
                approvals.count("unrecorded");
                unrecorded(d, format!("the request could not be recorded ({error})"));
            }
        }
    }
}

/// Approved to used, by compare-and-swap; `Err` with why not.
async fn use_approval(sessions: &SessionMemory, id: &str, now: u64) -> Result<(), String> {
    let name = record::name(id);
    let found = sessions
        .bounded(sessions.store().record(&name))
        .await
        .map_err(|e| format!("the store could not be read: {e}"))?
        .ok_or_else(|| "the approval request is gone".to_owned())?;
    let mut stored = Stored::from_json(&found.value)?;
    match stored.state(now) {
        ApprovalState::Approved => {}
        ApprovalState::Used => return Err("the approval was already used".into()),
        ApprovalState::Expired => return Err("the approval expired before it was used".into()),
        other => return Err(format!("the approval request is {other}")),
    }
    stored.standing = Standing::Used;
    stored.used_at_ms = now;
    let ttl = Duration::from_millis(stored.expires_at_ms.saturating_sub(now)) + RETENTION;
    match sessions
        .bounded(sessions.store().put_record(Put {
            name: &name,
            version: Some(&found.version),
            value: stored.to_json(),
            ttl,
        }))
        .await
    {
        Ok(true) => Ok(()),
        Ok(false) => Err("the approval was already used".into()),
        Err(e) => Err(format!("its use could not be recorded: {e}")),
    }
}

/// A request an approver may answer, as read: checked, not yet written
/// ([`Answerable::apply`]), so that its decision record can be written
/// first (R29).
#[derive(Debug)]
pub struct Answerable {
    stored: Stored,
    version: String,
    now: u64,
}

impl Answerable {
    /// The request as it stands.
    pub fn request(&self) -> ApprovalRequest {
        self.stored.to_wire(self.now)
    }
}

/// Reads request `id` and checks that `approver` (the caller's identity,
/// empty on a mesh without identities) may answer it now (R35): well
/// formed, known, pending, not expired, not asked by the approver.
pub async fn answerable(
    sessions: &SessionMemory,
    approvals: &Approvals,
    id: &str,
    approver: &str,
) -> Result<Answerable, Status> {
    if !record::well_formed(id) {
        return Err(Status::invalid_argument(
            "id: not an approval request id (64 lowercase hex digits)",
        ));
    }
    let now = crate::session::now_ms();
    let found = sessions
        .bounded(sessions.store().record(&record::name(id)))
        .await
        .map_err(store_status)?
        .ok_or_else(|| Status::not_found(format!("no approval request {id}")))?;
    let stored = Stored::from_json(&found.value).map_err(Status::data_loss)?;
    match stored.state(now) {
        ApprovalState::Pending => {}
        ApprovalState::Expired => {
            approvals.count("expired");
            return Err(Status::failed_precondition(format!(
                "approval request {id} expired unanswered"
            )));
        }
        other => {
            return Err(Status::failed_precondition(format!(
                "approval request {id} is already answered: {other}"
            )));
        }
    }
    if !approver.is_empty() && approver == stored.asked_by {
        return Err(Status::permission_denied(format!(
            "{approver} asked for this call and may not approve it too"
        )));
    }
    Ok(Answerable {
        stored,
        version: found.version,
        now,
    })
}

impl Answerable {
    /// Writes the answer: pending to approved or denied, by
    /// compare-and-swap (ABORTED when another answer came first).
    pub async fn apply(
        mut self,
        sessions: &SessionMemory,
        approvals: &Approvals,
        approve: bool,
        note: &str,
        approver: &str,
    ) -> Result<ApprovalRequest, Status> {
        let Self {
            ref mut stored,
            ref version,
            now,
        } = self;
        stored.standing = if approve {
            Standing::Approved
        } else {
            Standing::Denied
        };
        stored.answered_by = approver.to_owned();
        stored.note = record::clip(note);
        stored.answered_at_ms = now;
        let ttl = Duration::from_millis(stored.expires_at_ms.saturating_sub(now)) + RETENTION;
        let written = sessions
            .bounded(sessions.store().put_record(Put {
                name: &record::name(&stored.id),
                version: Some(version),
                value: stored.to_json(),
                ttl,
            }))
            .await
            .map_err(store_status)?;
        if !written {
            return Err(Status::aborted(format!(
                "approval request {} changed while it was answered; read it again",
                stored.id
            )));
        }
        approvals.count(if approve { "approved" } else { "denied" });
        Ok(stored.to_wire(now))
    }
}

/// [`answerable`], then [`Answerable::apply`].
pub async fn answer(
    sessions: &SessionMemory,
    approvals: &Approvals,
    id: &str,
    approve: bool,
    note: &str,
    approver: &str,
) -> Result<ApprovalRequest, Status> {
    answerable(sessions, approvals, id, approver)
        .await?
        .apply(sessions, approvals, approve, note, approver)
        .await
}

/// The requests the store holds, filtered, pending first then newest
/// first, at most `limit`.
pub async fn list(
    sessions: &SessionMemory,
    state: ApprovalState,
    session_id: &str,
    limit: usize,
) -> Result<Vec<ApprovalRequest>, Status> {
    let now = crate::session::now_ms();
    let records = sessions
        .bounded(sessions.store().records(record::PREFIX, 10_000))
        .await
        .map_err(store_status)?;
    let mut found: Vec<Stored> = records
        .iter()
        .filter_map(|r| Stored::from_json(&r.value).ok())
        .filter(|s| state == ApprovalState::Unspecified || s.state(now) == state)
        .filter(|s| session_id.is_empty() || s.session_id == session_id)
        .collect();
    found.sort_by_key(|s| {
        (
            s.state(now) != ApprovalState::Pending,
            std::cmp::Reverse(s.asked_at_ms),
        )
    });
    found.truncate(limit);
    Ok(found.iter().map(|s| s.to_wire(now)).collect())
}

fn store_status(error: StoreError) -> Status {
    Status::unavailable(format!("approvals: {error}"))
}
