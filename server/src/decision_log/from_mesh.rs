//! The decision log as the mesh writes it (R29): the one place where the
//! mesh's own types (the wire messages, the authenticated caller) become
//! records, and [`MeshLog`], the log with the mesh's failure policy.
//!
//! The batch path pays for the log only when one is configured: the mesh
//! holds an `Option`, and without a log nothing here is called. With one,
//! the batch's calls are read into a record before the batch is judged
//! (parsing each call's arguments once: the copy masking needs), and the
//! decisions and traces are read from the answer by reference.

use std::sync::Arc;

use guardmesh_proto::v1::{
    self as pb, BatchDecision, CallDecision, EvaluateRequest, GuardSpec, GuardTrace, ToolCall,
};
use serde_json::Value;
use tonic::Status;

use super::record::{
    Action, BatchRecord, CallDecisionRecord, CallRecord, Caller, ChainChangeRecord, ChangeKind,
    ChangeOutcome, DecisionRecord, Entry, GuardRole, GuardTraceRecord, Outcome, TraceStatus,
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

/// The decision log of a mesh.
#[derive(Debug, Clone)]
pub struct MeshLog {
    log: DecisionLog,
    on_failure: OnLogFailure,
    metrics: Arc<Metrics>,
}

impl MeshLog {
    pub fn new(log: DecisionLog, on_failure: OnLogFailure, metrics: Arc<Metrics>) -> Self {
        MeshLog {
            log,
            on_failure,
            metrics,
        }
    }

    /// The log itself (for closing it at shutdown).
    pub fn log(&self) -> &DecisionLog {
        &self.log
    }

    /// Appends the record of one batch answered. `Err` is the status the
    /// batch must be answered with instead (UNAVAILABLE, naming the log),
    /// when the record could not be written and the policy is `refuse`.
    pub async fn batch(&self, record: DecisionRecord) -> Result<(), Status> {
        match self.log.append(Entry::Decision(record)).await {
            Ok(_) => {
                self.metrics.decision_log_record("decision");
                Ok(())
            }
            Err(error) => {
                self.metrics.decision_log_failure("decision");
                match self.on_failure {
                    OnLogFailure::Refuse => {
                        tracing::error!(%error, "batch refused: its decision record cannot be written");
                        Err(Status::unavailable(format!(
                            "the decision could not be recorded, so it is not answered (on_log_failure = \"refuse\"): {error}"
                        )))
                    }
                    OnLogFailure::Answer => {
                        tracing::error!(%error, "decision record lost; the batch is answered (on_log_failure = \"answer\")");
                        Ok(())
                    }
                }
            }
        }
    }

    /// Whether a record that cannot be written refuses what it records
    /// (`on_log_failure = "refuse"`).
    pub fn refuses(&self) -> bool {
        self.on_failure == OnLogFailure::Refuse
    }

    /// Appends the record of a chain change before it is applied (or
    /// refused): `Err` is the status to answer instead, UNAVAILABLE naming
    /// the log, when it cannot be written and the policy is `refuse`; the
    /// change must then not be applied.
    pub async fn change_before(&self, record: ChainChangeRecord) -> Result<(), Status> {
        match self.log.append(Entry::ChainChange(record)).await {
            Ok(_) => {
                self.metrics.decision_log_record("chain_change");
                Ok(())
            }
            Err(error) => {
                self.metrics.decision_log_failure("chain_change");
                match self.on_failure {
                    OnLogFailure::Refuse => {
                        tracing::error!(%error, "chain change refused: its record cannot be written");
                        Err(Status::unavailable(format!(
                            "the chain change could not be recorded in the decision log, so it is not applied (on_log_failure = \"refuse\"): {error}"
                        )))
                    }
                    OnLogFailure::Answer => {
                        tracing::error!(%error, "chain change record lost (on_log_failure = \"answer\")");
                        Ok(())
                    }
                }
            }
        }
    }

    /// Appends the record of one chain change already applied (or
    /// refused): a failure is logged and counted.
    pub async fn change(&self, record: ChainChangeRecord) {
        match self.log.append(Entry::ChainChange(record)).await {
            Ok(_) => self.metrics.decision_log_record("chain_change"),
            Err(error) => {
                self.metrics.decision_log_failure("chain_change");
                tracing::error!(%error, "chain change record lost");
            }
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

/// The caller as the log names it.
pub fn caller(
    auth: Option<&crate::security::auth::Caller>,
    peer: Option<std::net::SocketAddr>,
) -> Caller {
    let (id, roles) = match auth {
        Some(caller) => {
            let mut roles: Vec<String> = caller
                .roles
                .iter()
                .map(|role| {
                    match role {
                        crate::security::auth::Role::Evaluate => "evaluate",
                        crate::security::auth::Role::Register => "register",
                        crate::security::auth::Role::Admin => "admin",
                    }
                    .to_owned()
                })
                .collect();
            roles.sort();
            (Some(caller.id.clone()), roles)
        }
        None => (None, Vec::new()),
    };
    Caller {
        id,
        roles,
        peer: peer.map(|p| p.to_string()),
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
/// arguments). The policy source is left out: it can be long, and the
/// registry holds it.
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
        "policy": !spec.policy.is_empty(),
    })
}

/// The record of a chain change about to be applied (`on_log_failure =
/// "refuse"`): written first, so that no change is applied unrecorded.
pub fn requested(
    caller: Caller,
    kind: ChangeKind,
    guard: &str,
    spec: Option<Value>,
    old_revision: u64,
) -> ChainChangeRecord {
    ChainChangeRecord {
        caller,
        change: kind,
        guard: some(guard),
        spec,
        old_revision: Some(old_revision),
        new_revision: None,
        outcome: ChangeOutcome::requested(),
    }
}

/// The record of a chain change.
pub fn change(
    caller: Caller,
    kind: ChangeKind,
    guard: &str,
    spec: Option<Value>,
    old_revision: u64,
    result: Result<u64, &Status>,
) -> ChainChangeRecord {
    let (new_revision, outcome) = match result {
        Ok(revision) => (Some(revision), ChangeOutcome::applied()),
        Err(status) => (
            None,
            ChangeOutcome::refused(status.code() as i32, status.message()),
        ),
    };
    ChainChangeRecord {
        caller,
        change: kind,
        guard: some(guard),
        spec,
        old_revision: Some(old_revision),
        new_revision,
        outcome,
    }
}
