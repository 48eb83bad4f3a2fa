//! The decision log as the mesh writes it (R29): the one place where the
//! mesh's own types (the wire messages, the authenticated caller) become
//! records, and [`MeshLog`], the log with the mesh's failure policy.
//!
//! The batch path pays for the log only when one is configured: the mesh
//! holds an `Option`, and without a log nothing here is called. With one,
//! the batch's calls are read into a record before the batch is judged
//! (parsing each call's arguments once: the copy masking needs), and the
//! decisions and traces are read from the answer by reference.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use guardmesh_proto::v1::{
    self as pb, BatchDecision, CallDecision, EvaluateRequest, GuardSpec, GuardTrace, ToolCall,
};
use serde_json::Value;
use tonic::Status;

use super::budget::{self, BudgetReached, DirBudget};
use super::mask::{self, Held, Secrets};
use super::record::{
    Action, ApprovalAnswerRecord, ApprovalAsked, BatchRecord, CallDecisionRecord, CallRecord,
    Caller, ChainChangeRecord, ChangeKind, ChangeOutcome, ChangeStatus, DecisionRecord, Entry,
    GuardRole, GuardTraceRecord, Outcome, OutcomeStatus, PeerCount, RefusalSummaryRecord,
    SUMMARY_PEERS, TraceStatus,
};
use super::writer::DecisionLog;
use crate::observe::metrics::Metrics;

/// What the mesh does when a record cannot be written
/// (`[decision_log] on_log_failure`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnLogFailure {
    /// The batch is refused `UNAVAILABLE`, naming the log: no decision
    /// leaves the mesh unrecorded (the default).
    #[default]
    Refuse,
    /// The batch is answered, and the lost record counted
    /// (`guardmesh_decision_log_failures_total`) and logged.
    Answer,
}

/// The bounds on the records that refused peers make the log write
/// (`[decision_log] refusal_*`, R29): per interval, per peer (its address
/// without the port) and for the whole mesh, at most so many refusal
/// records and bytes. A refusal past a bound is answered as always, but its
/// record is left out and counted; one `refusal_summary` record per
/// interval in which something was left out says how many, from whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusalLimits {
    pub interval: Duration,
    pub records_per_peer: u32,
    pub bytes_per_peer: u64,
    pub records: u32,
    pub bytes: u64,
}

impl Default for RefusalLimits {
    /// Per 10 s: 20 records and 32 KiB per peer, 200 records and 256 KiB
    /// for the mesh.
    fn default() -> Self {
        RefusalLimits {
            interval: Duration::from_secs(10),
            records_per_peer: 20,
            bytes_per_peer: 32 * 1024,
            records: 200,
            bytes: 256 * 1024,
        }
    }
}

/// The bounds of a mesh's log: refusals, and the directory's budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogLimits {
    pub refusals: RefusalLimits,
    /// `max_dir_bytes`; `None`: no budget (see [`super::budget`]).
    pub max_dir_bytes: Option<u64>,
}

/// The most peers tracked in one interval; later peers share one count.
const MAX_PEERS: usize = 4096;

/// The decision log of a mesh.
#[derive(Debug, Clone)]
pub struct MeshLog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    log: DecisionLog,
    on_failure: OnLogFailure,
    metrics: Arc<Metrics>,
    limits: RefusalLimits,
    window: Mutex<Window>,
    budget: Option<DirBudget>,
}

/// What refused peers wrote in the current interval, and what was left out.
#[derive(Debug)]
struct Window {
    started: Instant,
    from: String,
    records: u32,
    bytes: u64,
    peers: HashMap<String, PeerUse>,
    left_out: u64,
    left_out_bytes: u64,
}

#[derive(Debug, Default)]
struct PeerUse {
    records: u32,
    bytes: u64,
    left_out: u64,
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

impl Window {
    fn new() -> Self {
        Window {
            started: Instant::now(),
            from: now_rfc3339(),
            records: 0,
            bytes: 0,
            peers: HashMap::new(),
            left_out: 0,
            left_out_bytes: 0,
        }
    }

    /// Starts a new window if this one is over (or `force`); the summary of
    /// the one that ends, if anything was left out.
    fn roll(&mut self, interval: Duration, force: bool) -> Option<RefusalSummaryRecord> {
        if !force && self.started.elapsed() < interval {
            return None;
        }
        let old = std::mem::replace(self, Window::new());
        if old.left_out == 0 {
            return None;
        }
        let mut peers: Vec<PeerCount> = old
            .peers
            .into_iter()
            .filter(|(_, u)| u.left_out > 0)
            .map(|(peer, u)| PeerCount {
                peer,
                left_out: u.left_out,
            })
            .collect();
        peers.sort_by(|a, b| b.left_out.cmp(&a.left_out).then(a.peer.cmp(&b.peer)));
        let other = peers.iter().skip(SUMMARY_PEERS).map(|p| p.left_out).sum();
        peers.truncate(SUMMARY_PEERS);
        Some(RefusalSummaryRecord {
            from: old.from,
            to: self.from.clone(),
            left_out: old.left_out,
            left_out_bytes: old.left_out_bytes,
            peers,
            other_peers_left_out: other,
        })
    }

    /// Whether a refusal record of `bytes` from `peer` is within the
    /// bounds; counts it either way. `room`: the directory's budget has
    /// room for it.
    fn admit(&mut self, limits: &RefusalLimits, peer: String, bytes: u64, room: bool) -> bool {
        let peer = if self.peers.len() >= MAX_PEERS && !self.peers.contains_key(&peer) {
            "other".to_owned()
        } else {
            peer
        };
        let within_mesh =
            self.records < limits.records && self.bytes.saturating_add(bytes) <= limits.bytes;
        let usage = self.peers.entry(peer).or_default();
        let within_peer = usage.records < limits.records_per_peer
            && usage.bytes.saturating_add(bytes) <= limits.bytes_per_peer;
        if room && within_mesh && within_peer {
            usage.records += 1;
            usage.bytes += bytes;
            self.records += 1;
            self.bytes += bytes;
            true
        } else {
            usage.left_out += 1;
            self.left_out += 1;
            self.left_out_bytes += bytes;
            false
        }
    }
}

/// The peer's address without its port ("unknown" when not known).
fn peer_key(caller: &Caller) -> String {
    match caller.peer.as_deref() {
        Some(peer) => match peer.parse::<std::net::SocketAddr>() {
            Ok(addr) => addr.ip().to_string(),
            Err(_) => peer.to_owned(),
        },
        None => "unknown".to_owned(),
    }
}

/// A record's size as a line, estimated (see [`budget::RECORD_MARGIN`]).
fn estimate(entry: &Entry) -> u64 {
    serde_json::to_vec(entry).map_or(0, |v| v.len() as u64) + budget::RECORD_MARGIN
}

/// Why a record was not written.
#[derive(Debug, thiserror::Error)]
enum NotWritten {
    #[error(transparent)]
    Log(#[from] super::error::LogError),
    #[error(transparent)]
    Budget(#[from] BudgetReached),
}

impl MeshLog {
    /// The log with the default bounds on refusal records and no
    /// directory budget.
    pub fn new(log: DecisionLog, on_failure: OnLogFailure, metrics: Arc<Metrics>) -> Self {
        Self::build(log, on_failure, metrics, LogLimits::default())
    }

    /// The same log with these bounds.
    pub fn with_limits(self, limits: LogLimits) -> Self {
        Self::build(
            self.inner.log.clone(),
            self.inner.on_failure,
            self.inner.metrics.clone(),
            limits,
        )
    }

    fn build(
        log: DecisionLog,
        on_failure: OnLogFailure,
        metrics: Arc<Metrics>,
        limits: LogLimits,
    ) -> Self {
        log.attach_metrics(metrics.clone());
        let budget = limits
            .max_dir_bytes
            .map(|max| DirBudget::new(log.dir(), max));
        let inner = Arc::new(Inner {
            log,
            on_failure,
            metrics,
            limits: limits.refusals,
            window: Mutex::new(Window::new()),
            budget,
        });
        // Summaries are written when their interval ends, even when no
        // refusal comes after it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(summaries(Arc::downgrade(&inner)));
        }
        MeshLog { inner }
    }

    /// The log itself.
    pub fn log(&self) -> &DecisionLog {
        &self.inner.log
    }

    /// Writes the summary of the refusals left out so far, then syncs and
    /// closes the log.
    pub async fn close(&self) -> Result<(), super::error::LogError> {
        let summary = self.window().roll(self.inner.limits.interval, true);
        if let Some(summary) = summary {
            self.summary(summary).await;
        }
        self.inner.log.close().await
    }

    /// Holds the masked values of `batch` in the process-wide set that log
    /// lines and exported spans are scrubbed against, while the returned
    /// guard lives (see [`super::mask`]).
    pub fn hold(&self, batch: &BatchRecord) -> Held {
        let rules = self.inner.log.mask_rules();
        if rules.is_empty() {
            return Held::default();
        }
        let mut secrets = Secrets::default();
        rules.batch_secrets(batch, &mut secrets);
        crate::observe::scrub::install(mask::scrub_live);
        mask::hold(&secrets)
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        self.inner
            .window
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends `entry` within the directory's budget.
    async fn write(&self, entry: Entry, kind: &'static str) -> Result<(), NotWritten> {
        let size = self.inner.budget.as_ref().map(|budget| {
            let size = estimate(&entry);
            (budget, size)
        });
        if let Some((budget, size)) = size {
            budget.admit(size, false)?;
        }
        self.inner.log.append(entry).await?;
        if let Some((budget, size)) = size {
            budget.wrote(size);
        }
        self.inner.metrics.decision_log_record(kind);
        Ok(())
    }

    /// Whether the record of a refusal (a peer refused before it was
    /// judged) is within the bounds; if not, it is counted for the
    /// interval's summary instead of written.
    async fn refusal_admitted(&self, caller: &Caller, entry: &Entry) -> bool {
        let size = estimate(entry);
        let room = self
            .inner
            .budget
            .as_ref()
            .is_none_or(|budget| budget.admit(size, true).is_ok());
        let limits = self.inner.limits;
        let (admitted, summary) = {
            let mut window = self.window();
            let summary = window.roll(limits.interval, false);
            let admitted = window.admit(&limits, peer_key(caller), size, room);
            (admitted, summary)
        };
        if let Some(summary) = summary {
            self.summary(summary).await;
        }
        admitted
    }

    /// Appends a summary record; a failure is logged and counted.
    async fn summary(&self, summary: RefusalSummaryRecord) {
        let left_out = summary.left_out;
        if let Err(error) = self
            .write(Entry::RefusalSummary(summary), "refusal_summary")
            .await
        {
            self.inner.metrics.decision_log_failure("refusal_summary");
            tracing::error!(%error, left_out, "refusal summary record lost");
        }
    }

    /// Appends the record of one batch answered. `Err` is the status the
    /// batch must be answered with instead (UNAVAILABLE, naming the log),
    /// when the record could not be written and the policy is `refuse`.
    /// The record of a refused batch past the bounds on refusals is left
    /// out and counted in a summary record.
    pub async fn batch(&self, record: DecisionRecord) -> Result<(), Status> {
        self.write_before(Entry::Decision(record), "decision", &DECISION_UNWRITTEN)
            .await
    }

    /// Whether a record that cannot be written refuses what it records
    /// (`on_log_failure = "refuse"`).
    pub fn refuses(&self) -> bool {
        self.inner.on_failure == OnLogFailure::Refuse
    }

    /// Appends the record of a chain change before it is applied (or
    /// refused): `Err` is the status to answer instead, UNAVAILABLE naming
    /// the log, when it cannot be written and the policy is `refuse`; the
    /// change must then not be applied. The record of a change refused
    /// before it reached the registry (by authentication) is bounded like
    /// a refused batch's.
    pub async fn change_before(&self, record: ChainChangeRecord) -> Result<(), Status> {
        self.write_before(
            Entry::ChainChange(record),
            "chain_change",
            &CHANGE_UNWRITTEN,
        )
        .await
    }

    /// Appends the record of an approver's answer before it is applied
    /// (R35): `Err` is the status to answer instead when it cannot be
    /// written and the policy is `refuse`.
    pub async fn approval_before(&self, record: ApprovalAnswerRecord) -> Result<(), Status> {
        self.write_before(Entry::Approval(record), "approval", &APPROVAL_UNWRITTEN)
            .await
    }

    /// Appends `entry`, a record written before what it records is
    /// answered: `Err` is the status to answer instead when it cannot be
    /// written and the policy is `refuse`. The record of a refusal past the
    /// bounds on refusals is left out and counted in a summary record.
    async fn write_before(
        &self,
        entry: Entry,
        kind: &'static str,
        words: &Unwritten,
    ) -> Result<(), Status> {
        if let Some(caller) = refused_caller(&entry)
            && !self.refusal_admitted(caller, &entry).await
        {
            return Ok(());
        }
        let Err(error) = self.write(entry, kind).await else {
            return Ok(());
        };
        self.inner.metrics.decision_log_failure(kind);
        match self.inner.on_failure {
            OnLogFailure::Refuse => {
                tracing::error!(%error, "{}", words.refused);
                Err(Status::unavailable(format!(
                    "{} (on_log_failure = \"refuse\"): {error}",
                    words.status
                )))
            }
            OnLogFailure::Answer => {
                tracing::error!(%error, "{} (on_log_failure = \"answer\")", words.answered);
                Ok(())
            }
        }
    }

    /// Appends the record of one chain change already applied (or
    /// refused): a failure is logged and counted.
    pub async fn change(&self, record: ChainChangeRecord) {
        if let Err(error) = self.write(Entry::ChainChange(record), "chain_change").await {
            self.inner.metrics.decision_log_failure("chain_change");
            tracing::error!(%error, "chain change record lost");
        }
    }
}

/// What the log says of a record that cannot be written before its answer
/// (see [`MeshLog::write_before`]).
struct Unwritten {
    /// Logged when the answer is refused.
    refused: &'static str,
    /// The refused answer's status message, before the policy and error.
    status: &'static str,
    /// Logged when it is answered all the same, before the policy.
    answered: &'static str,
}

/// The caller of `entry` when it records a refusal: such records are
/// bounded per caller.
fn refused_caller(entry: &Entry) -> Option<&Caller> {
    match entry {
        Entry::Decision(r) if r.outcome.status == OutcomeStatus::Refused => Some(&r.caller),
        Entry::ChainChange(r) if r.outcome.status == ChangeStatus::Refused => Some(&r.caller),
        _ => None,
    }
}

const DECISION_UNWRITTEN: Unwritten = Unwritten {
    refused: "batch refused: its decision record cannot be written",
    status: "the decision could not be recorded, so it is not answered",
    answered: "decision record lost; the batch is answered",
};

const APPROVAL_UNWRITTEN: Unwritten = Unwritten {
    refused: "approval refused: its record cannot be written",
    status: "the approval's decision record cannot be written",
    answered: "an approval's record lost",
};

const CHANGE_UNWRITTEN: Unwritten = Unwritten {
    refused: "chain change refused: its record cannot be written",
    status: "the chain change could not be recorded in the decision log, so it is not applied",
    answered: "chain change record lost",
};

/// Writes each interval's summary once it ends; stops with the log.
async fn summaries(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(inner) => {
            (inner.limits.interval / 2).clamp(Duration::from_millis(50), Duration::from_secs(5))
        }
        None => return,
    };
    loop {
        tokio::time::sleep(period).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let log = MeshLog { inner };
        if let Some(budget) = &log.inner.budget {
            budget.measure_if_due();
        }
        let summary = log.window().roll(log.inner.limits.interval, false);
        if let Some(summary) = summary {
            log.summary(summary).await;
        }
    }
}

impl MeshLog {
    /// Records the guards of the config file, registered at start, as one
    /// `config_reload` change each (no caller: the operator's file).
    pub async fn config_guards(&self, guards: &[GuardSpec], revision: u64) {
        for guard in guards {
            self.change(ChainChangeRecord {
                caller: Caller::default(),
                change: ChangeKind::ConfigReload,
                guard: some(&guard.name),
                spec: Some(spec(guard)),
                old_revision: None,
                new_revision: Some(revision),
                outcome: ChangeOutcome::applied(),
            })
            .await;
        }
    }
}

fn call(call: &ToolCall) -> CallRecord {
    CallRecord::from_text(call.call_id.clone(), call.tool.clone(), &call.arguments)
}

/// The batch as sent, before it is judged.
pub fn batch(request: &EvaluateRequest) -> BatchRecord {
    let context = request.context.as_ref();
    BatchRecord {
        batch_id: request.batch_id.clone(),
        session_id: context.map(|c| c.session_id.clone()).unwrap_or_default(),
        turn_index: context.map_or(0, |c| c.turn_index),
        model_text: context
            .map(|c| c.model_text.clone())
            .filter(|t| !t.is_empty()),
        metadata: context
            .map(|c| {
                c.metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default(),
        timeout_ms: (request.timeout_ms > 0).then_some(request.timeout_ms),
        calls: request.calls.iter().map(call).collect(),
    }
}

/// A batch known only by its id (refused before it could be read whole).
pub fn batch_id_only(batch_id: &str) -> BatchRecord {
    BatchRecord {
        batch_id: batch_id.to_owned(),
        session_id: String::new(),
        turn_index: 0,
        model_text: None,
        metadata: Default::default(),
        timeout_ms: None,
        calls: Vec::new(),
    }
}

fn action(value: i32) -> Action {
    match pb::Action::try_from(value) {
        Ok(pb::Action::Steer) => Action::Steer,
        Ok(pb::Action::Cancel) => Action::Cancel,
        Ok(pb::Action::Ask) => Action::Ask,
        _ => Action::Proceed,
    }
}

fn trace_status(value: i32) -> TraceStatus {
    use pb::TraceStatus as S;
    match S::try_from(value).unwrap_or(S::Unspecified) {
        S::Proceeded | S::Unspecified => TraceStatus::Proceeded,
        S::Skipped => TraceStatus::Skipped,
        S::Rewrote => TraceStatus::Rewrote,
        S::NotApplicable => TraceStatus::NotApplicable,
        S::Superseded => TraceStatus::Superseded,
        S::Failed => TraceStatus::Failed,
        S::TimedOut => TraceStatus::TimedOut,
        S::Malformed => TraceStatus::Malformed,
        S::RejectedRewrite => TraceStatus::RejectedRewrite,
        S::DryRun => TraceStatus::DryRun,
        S::Asked => TraceStatus::Asked,
    }
}

fn some(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_owned())
}

fn guard_trace(trace: &GuardTrace) -> GuardTraceRecord {
    let status = trace_status(trace.status);
    GuardTraceRecord {
        guard: trace.guard.clone(),
        role: if trace.role == pb::GuardRole::Mutate as i32 {
            GuardRole::Mutate
        } else {
            GuardRole::Validate
        },
        status,
        latency_us: trace.latency_us,
        sent_call_ids: trace.sent_call_ids.clone(),
        skipped_call_ids: trace.skipped_call_ids.clone(),
        rewritten_call_ids: trace.rewritten_call_ids.clone(),
        error: some(&trace.error),
        dry_run_status: (status == TraceStatus::DryRun).then(|| trace_status(trace.dry_run_status)),
        replica: some(&trace.replica),
        labels: trace.labels.clone(),
        refused_labels: trace.refused_labels,
    }
}

fn call_decision(decision: &CallDecision, traces: &[GuardTrace]) -> CallDecisionRecord {
    let rule = traces
        .iter()
        .find(|t| t.guard == decision.decided_by)
        .and_then(|t| t.rules.get(&decision.call_id))
        .cloned();
    CallDecisionRecord {
        call_id: decision.call_id.clone(),
        action: action(decision.action),
        call: if decision.rewritten_by.is_empty() {
            None
        } else {
            decision.call.as_ref().map(call)
        },
        content: some(&decision.content),
        decided_by: some(&decision.decided_by),
        rule,
        failure: decision.failure,
        rewritten_by: decision.rewritten_by.clone(),
        bypassed: decision.bypassed.clone(),
        approval: decision.approval.as_ref().map(|a| ApprovalAsked {
            id: a.id.clone(),
            guard: a.guard.clone(),
            reason: a.reason.clone(),
            digest: a.digest.clone(),
            expires_at_ms: a.expires_at_ms,
        }),
        approval_refused: some(&decision.approval_refused),
        approved_by_request: some(&decision.approved_by_request),
    }
}

/// The record of a batch judged and answered.
pub fn decided(caller: Caller, batch: BatchRecord, decision: &BatchDecision) -> DecisionRecord {
    DecisionRecord {
        caller,
        batch,
        chain_revision: Some(decision.chain_revision),
        decisions: decision
            .decisions
            .iter()
            .map(|d| call_decision(d, &decision.trace))
            .collect(),
        trace: decision.trace.iter().map(guard_trace).collect(),
        trace_id: some(&decision.trace_id),
        outcome: Outcome::decided(),
    }
}

/// The record of a batch refused (`aborted == false`) or aborted.
pub fn not_decided(
    caller: Caller,
    batch: BatchRecord,
    status: &Status,
    aborted: bool,
) -> DecisionRecord {
    let code = status.code() as i32;
    let message = status.message().to_owned();
    DecisionRecord {
        caller,
        batch,
        chain_revision: None,
        decisions: Vec::new(),
        trace: Vec::new(),
        trace_id: None,
        outcome: if aborted {
            Outcome::aborted(code, message)
        } else {
            Outcome::refused(code, message)
        },
    }
}

/// A guard's registration as the log shows it (masked by the writer like
/// arguments). A policy guard's policy is named by the SHA-256 of its
/// source (lowercase hex) and the source itself (`policy.sha256`,
/// `policy.source`; a mask rule such as `$.policy.source` masks the text
/// and keeps the digest); `null` for a remote guard.
pub fn spec(spec: &GuardSpec) -> Value {
    serde_json::json!({
        "name": spec.name,
        "endpoint": spec.endpoint,
        "role": pb::GuardRole::try_from(spec.role).map_or("unknown", |r| r.as_str_name()),
        "tools": spec.tools,
        "timeout_ms": spec.timeout_ms,
        "failure_policy": pb::FailurePolicy::try_from(spec.failure_policy).map_or("unknown", |f| f.as_str_name()),
        "priority": spec.priority,
        "mode": pb::GuardMode::try_from(spec.mode).map_or("unknown", |m| m.as_str_name()),
        "policy": if spec.policy.is_empty() {
            Value::Null
        } else {
            serde_json::json!({
                "sha256": super::chain::sha256_hex(spec.policy.as_bytes()),
                "source": spec.policy,
            })
        },
    })
}

/// A registry change (register, deregister) as its records name it.
#[derive(Debug, Clone)]
pub struct RegistryChange {
    pub kind: ChangeKind,
    /// The guard concerned.
    pub guard: String,
    /// Its registration as submitted, masked as records show it ([`spec`]).
    pub spec: Option<Value>,
    /// The chain revision before the change.
    pub old_revision: u64,
}

impl RegistryChange {
    /// The record of the change requested, written before it is applied.
    pub fn requested(&self, caller: Caller) -> ChainChangeRecord {
        ChainChangeRecord {
            caller,
            change: self.kind,
            guard: some(&self.guard),
            spec: self.spec.clone(),
            old_revision: Some(self.old_revision),
            new_revision: None,
            outcome: ChangeOutcome::requested(),
        }
    }

    /// The record of the change applied (`Ok`: the new revision) or
    /// refused.
    pub fn ended(&self, caller: Caller, result: Result<u64, &Status>) -> ChainChangeRecord {
        let (new_revision, outcome) = match result {
            Ok(revision) => (Some(revision), ChangeOutcome::applied()),
            Err(status) => (
                None,
                ChangeOutcome::refused(status.code() as i32, status.message()),
            ),
        };
        ChainChangeRecord {
            new_revision,
            outcome,
            ..self.requested(caller)
        }
    }
}
