//! The record of one batch (R29, R21, R13): made when the batch arrives,
//! given the batch's [`Outcome`] once, and on finishing emitting from this
//! one place the metrics, the log lines, the spans' outcomes and the
//! decision record. The auth layer's refusals are recorded here too
//! ([`refusals`]): the layer hands them over and writes no record itself.

use super::Mesh;
use crate::admit::Refusal;
use crate::decision_log::{self, BatchRecord, ChangeKind, Held, MeshLog, from_mesh};
use crate::judge::{BatchError, Chain, ChainGuard, GuardRun, Unguarded};
use crate::observe::metrics::Metrics;
use crate::observe::spans;
use crate::security::auth::{self, AuthRefusal, RecordRefusal, RefusedKind, Role};
use guardmesh_proto::v1::{Action, BatchDecision, EvaluateRequest, ToolCall, TraceStatus};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tonic::Status;

/// Who sent a batch or made a change, as the decision log names it.
pub(crate) type LogCaller = Arc<decision_log::Caller>;

/// The caller as the log names it.
pub(crate) fn caller(
    auth: Option<&auth::Caller>,
    peer: Option<SocketAddr>,
) -> decision_log::Caller {
    let (id, roles) = match auth {
        Some(caller) => {
            let mut roles: Vec<String> = caller
                .roles
                .iter()
                .map(|role| {
                    match role {
                        Role::Evaluate => "evaluate",
                        Role::Register => "register",
                        Role::Admin => "admin",
                        Role::Approver => "approver",
                    }
                    .to_owned()
                })
                .collect();
            roles.sort();
            (Some(caller.id.clone()), roles)
        }
        None => (None, Vec::new()),
    };
    decision_log::Caller {
        id,
        roles,
        peer: peer.map(|p| p.to_string()),
    }
}

/// What happened at the guards of a judged batch.
pub(crate) struct Guards {
    pub(crate) chain: Arc<Chain>,
    /// Per guard, in chain order.
    pub(crate) runs: Vec<GuardRun>,
    /// The calls as sent, of a batch that got no decision.
    pub(crate) calls: Vec<ToolCall>,
    /// The mesh's setting for unguarded calls (R28), and how many there
    /// were.
    pub(crate) unguarded: (Unguarded, usize),
}

/// What became of a batch: handed to its record once.
pub(crate) struct Outcome {
    pub(crate) result: Result<BatchDecision, BatchError>,
    /// The batch's span, once it was opened.
    pub(crate) span: Option<tracing::Span>,
    trace_id: String,
    /// From admission to the answer, for the latency histogram.
    elapsed: Duration,
    guards: Option<Guards>,
}

impl Outcome {
    /// Refused by the admission stage.
    pub(crate) fn refused(refusal: Refusal) -> Self {
        Self {
            result: Err(BatchError::Refused(refusal)),
            span: None,
            trace_id: String::new(),
            elapsed: Duration::ZERO,
            guards: None,
        }
    }

    /// Decided without judging (R1).
    pub(crate) fn decided(decision: BatchDecision, trace_id: String, elapsed: Duration) -> Self {
        Self {
            result: Ok(decision),
            span: None,
            trace_id,
            elapsed,
            guards: None,
        }
    }

    /// Judged by the guards of a chain.
    pub(crate) fn judged(
        result: Result<BatchDecision, BatchError>,
        guards: Guards,
        trace_id: String,
        elapsed: Duration,
    ) -> Self {
        Self {
            result,
            span: None,
            trace_id,
            elapsed,
            guards: Some(guards),
        }
    }
}

/// The decision record of a batch, taken when it arrives: only made when a
/// decision log is attached and the caller is known.
struct Decision {
    log: MeshLog,
    caller: LogCaller,
    batch: BatchRecord,
    /// The batch's masked values, scrubbed from log lines and spans while
    /// it is judged (R29).
    _held: Held,
}

/// The record of one batch.
pub(crate) struct BatchLog {
    metrics: Arc<Metrics>,
    /// The batch's id as log lines show it.
    batch_id: String,
    decision: Option<Decision>,
}

impl BatchLog {
    /// The record of a batch arriving at `mesh` from `caller` (`None`
    /// without a decision log). `batch`: the batch as read; `None` for one
    /// refused before it could be read, known by its id alone. `batch_id`:
    /// its id as log lines show it.
    pub(crate) fn arrived(
        mesh: &Mesh,
        caller: Option<&LogCaller>,
        batch: Option<&EvaluateRequest>,
        batch_id: String,
    ) -> Self {
        let decision = match (mesh.decision_log(), caller) {
            (Some(log), Some(caller)) => {
                let record = match batch {
                    Some(batch) => from_mesh::batch(batch),
                    None => from_mesh::batch_id_only(&batch_id),
                };
                let held = log.hold(&record);
                Some(Decision {
                    log: log.clone(),
                    caller: caller.clone(),
                    batch: record,
                    _held: held,
                })
            }
            _ => None,
        };
        Self {
            metrics: mesh.metrics.clone(),
            batch_id,
            decision,
        }
    }

    /// Whether finishing writes a decision record (and so must be awaited).
    pub(crate) fn writes(&self) -> bool {
        self.decision.is_some()
    }

    /// Emits the outcome's metrics, logs and spans; the answer.
    pub(crate) fn emit(self, outcome: Outcome) -> Result<BatchDecision, BatchError> {
        let Outcome {
            result,
            span,
            trace_id,
            elapsed,
            guards,
        } = outcome;
        if let Some(guards) = &guards {
            let emit = || self.guards(guards, result.as_ref().ok(), &trace_id);
            match &span {
                Some(span) => span.in_scope(emit),
                None => emit(),
            }
        }
        let elapsed = elapsed.as_secs_f64();
        match &result {
            Ok(_) => self.metrics.batch("decided", elapsed),
            Err(BatchError::Refused(refusal)) => {
                self.metrics.refused(refusal.reason());
                self.metrics.batch("refused", 0.0);
                self.refusal_line(refusal);
            }
            Err(BatchError::Shed { guard, .. }) => {
                self.metrics.refused("guard_busy");
                self.metrics.guard_shed(guard);
                self.metrics.batch("refused", elapsed);
            }
            Err(BatchError::PolicyBusy { .. }) => {
                self.metrics.refused("policy_busy");
                self.metrics.batch("refused", elapsed);
            }
            Err(BatchError::Aborted { .. }) => self.metrics.batch("aborted", elapsed),
        }
        if let Some(span) = &span {
            match &result {
                Ok(decision) => spans::batch_done(span, Ok(decision)),
                Err(error) => spans::batch_done(span, Err(&error.status())),
            }
        }
        result
    }

    /// Finishes the batch: emits its outcome at once, then writes its
    /// decision record (R29: before the answer leaves); the answer, or the
    /// status to send instead when the record cannot be written and the
    /// log's policy is `refuse`.
    pub(crate) fn finish(
        mut self,
        outcome: Outcome,
    ) -> impl Future<Output = Result<BatchDecision, Status>> + Send + 'static {
        let decision = self.decision.take();
        let result = self.emit(outcome);
        async move {
            let Some(decision) = decision else {
                return result.map_err(|error| error.status());
            };
            let caller = Arc::unwrap_or_clone(decision.caller);
            match result {
                Ok(answer) => {
                    let record = from_mesh::decided(caller, decision.batch, &answer);
                    decision.log.batch(record).await?;
                    Ok(answer)
                }
                Err(error) => {
                    let status = error.status();
                    let aborted = matches!(error, BatchError::Aborted { .. });
                    let record = from_mesh::not_decided(caller, decision.batch, &status, aborted);
                    Err(match decision.log.batch(record).await {
                        Ok(()) => status,
                        Err(unavailable) => unavailable,
                    })
                }
            }
        }
    }

    /// Finishes a batch the admission stage refused; the status to answer.
    pub(crate) fn refuse(self, refusal: Refusal) -> impl Future<Output = Status> + Send + 'static {
        let finished = self.finish(Outcome::refused(refusal));
        async move {
            match finished.await {
                Ok(_) => Status::internal("a refused batch was decided"),
                Err(status) => status,
            }
        }
    }

    /// The log line of a refused batch.
    fn refusal_line(&self, refusal: &Refusal) {
        let batch_id = &self.batch_id;
        match refusal {
            Refusal::RegistryUnavailable(error) => {
                tracing::warn!(batch_id = %batch_id, %error, "batch refused: registry unavailable");
            }
            Refusal::Overloaded(limit) => {
                tracing::warn!(batch_id = %batch_id, limit, "batch refused: mesh overloaded");
            }
            _ => tracing::info!(
                batch_id = %batch_id,
                reason = refusal.reason(),
                "batch refused: {refusal}"
            ),
        }
    }

    /// What happened at each guard of a judged batch, decided (`Some`) or
    /// not: the calls' outcomes, and per guard its dropped verdicts (R8),
    /// what a dry-run guard would have done (R18), its outcome and
    /// latency, and its spans' fields. Of a batch that got no decision, the
    /// guards never reached are not counted. (A guard's failure is logged
    /// when it happens, R13.)
    fn guards(&self, guards: &Guards, decision: Option<&BatchDecision>, trace_id: &str) {
        let metrics = &self.metrics;
        let batch_id = &self.batch_id;
        if decision.is_some() {
            let (unguarded, count) = guards.unguarded;
            let label = match unguarded {
                Unguarded::Proceed => "proceed",
                Unguarded::Cancel => "cancel",
            };
            for _ in 0..count {
                metrics.unguarded(label);
            }
        }
        let ids: Vec<&str> = match decision {
            Some(decision) => {
                for d in &decision.decisions {
                    for name in &d.bypassed {
                        metrics.bypassed(name);
                    }
                    metrics.call(match Action::try_from(d.action) {
                        Ok(Action::Steer) => "steer",
                        Ok(Action::Cancel) => "cancel",
                        Ok(Action::Ask) => "ask",
                        _ => "proceed",
                    });
                }
                decision
                    .decisions
                    .iter()
                    .map(|d| d.call_id.as_str())
                    .collect()
            }
            None => guards.calls.iter().map(|c| c.call_id.as_str()).collect(),
        };
        // The tool of call `i`, as the agent named it.
        let tools = |i: usize| -> &str {
            match decision {
                Some(decision) => decision
                    .decisions
                    .get(i)
                    .and_then(|d| d.original.as_ref())
                    .map_or("", |c| c.tool.as_str()),
                None => guards.calls.get(i).map_or("", |c| c.tool.as_str()),
            }
        };
        for (ChainGuard { guard, .. }, run) in guards.chain.guards.iter().zip(&guards.runs) {
            if decision.is_none() && !run.sent_any {
                continue;
            }
            let status = run.status();
            let reported = crate::judge::reported_status(guard, run);
            let error = crate::judge::error_text(run);
            if run.failure.is_none() && !run.malformed.is_empty() {
                tracing::warn!(
                    guard = %guard.name,
                    batch_id = %batch_id,
                    trace_id = %trace_id,
                    "malformed verdicts dropped: {error}"
                );
            }
            if !guard.enforced() && status != TraceStatus::NotApplicable {
                tracing::info!(
                    guard = %guard.name,
                    batch_id = %batch_id,
                    would = status.name(),
                    would_skip = ?run.skipped.iter().map(|&i| ids[i]).collect::<Vec<_>>(),
                    would_rewrite = ?run.rewritten.iter().map(|&i| ids[i]).collect::<Vec<_>>(),
                    "dry-run guard"
                );
            }
            metrics.guard_outcome(
                &guard.name,
                reported.name(),
                run.latency().map(|l| l.as_secs_f64()),
            );
            if !guard.enforced() {
                for i in 0..ids.len() {
                    if let Some(would) = run.call_action(i) {
                        metrics.dry_run_call(&guard.name, would);
                    }
                }
            }
            if let Some(guardrail) = &run.guardrail {
                spans::guard_done(
                    guardrail,
                    run.span.as_ref(),
                    &spans::GuardOutcome {
                        guard: crate::judge::span_guard(guard),
                        status: reported.name(),
                        failure: run.failure.as_ref().map(crate::judge::span_failure),
                        error: &error,
                        skipped: run.skipped.len(),
                        rewritten: run.rewritten.len(),
                    },
                );
                if !guardrail.is_disabled() {
                    for (i, id) in ids.iter().enumerate() {
                        if let Some(action) = run.call_action(i) {
                            spans::call_event(guardrail, tools(i), id, action);
                        }
                    }
                }
            }
        }
    }
}

/// Counts and logs a coordinator stream the admission stage refused (not a
/// batch: no batch is counted or recorded); the status to answer.
pub(crate) fn stream_refused(metrics: &Metrics, refusal: &Refusal) -> Status {
    metrics.refused(refusal.reason());
    if let Refusal::TooManyStreams(limit) = refusal {
        tracing::warn!(limit, "coordinator stream refused: too many streams open");
    }
    refusal.status()
}

/// The auth layer's refusals, recorded in the mesh's decision log when one
/// is attached (it may be attached after the listener starts).
pub(crate) fn refusals(mesh: Arc<Mesh>) -> Arc<dyn RecordRefusal> {
    Arc::new(Refusals(mesh))
}

struct Refusals(Arc<Mesh>);

impl RecordRefusal for Refusals {
    fn record(&self, refusal: AuthRefusal) -> Option<futures::future::BoxFuture<'static, Status>> {
        let log = self.0.decision_log()?.clone();
        let AuthRefusal {
            kind,
            caller: who,
            remote,
            status,
        } = refusal;
        let caller = caller(who.as_ref(), remote);
        Some(Box::pin(async move {
            let written = match kind {
                RefusedKind::Batch => {
                    let record = from_mesh::not_decided(
                        caller,
                        from_mesh::batch_id_only(""),
                        &status,
                        false,
                    );
                    log.batch(record).await
                }
                RefusedKind::Register | RefusedKind::Deregister => {
                    let change = match kind {
                        RefusedKind::Register => ChangeKind::Register,
                        _ => ChangeKind::Deregister,
                    };
                    let record = decision_log::ChainChangeRecord {
                        caller,
                        change,
                        guard: None,
                        spec: None,
                        old_revision: None,
                        new_revision: None,
                        outcome: decision_log::ChangeOutcome::refused(
                            status.code() as i32,
                            status.message(),
                        ),
                    };
                    log.change_before(record).await
                }
            };
            match written {
                Ok(()) => status,
                Err(unavailable) => unavailable,
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryRegistry, MeshConfig};
    use guardmesh_proto::v1::ToolCall;

    fn line<'a>(text: &'a str, series: &str) -> Option<&'a str> {
        text.lines()
            .find(|l| l.starts_with(series))
            .map(|l| l[series.len()..].trim())
    }

    fn mesh() -> Arc<Mesh> {
        Mesh::new(
            MeshConfig::default(),
            Arc::new(MemoryRegistry::new(Duration::from_secs(1))),
        )
    }

    #[tokio::test]
    async fn r20_a_refused_batch_is_counted_once_by_its_record() {
        let mesh = mesh();
        let batch = EvaluateRequest {
            batch_id: "b".into(),
            calls: vec![ToolCall {
                call_id: "c".into(),
                tool: "t".into(),
                arguments: "[1]".into(),
            }],
            ..Default::default()
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        let error = mesh
            .evaluate_unrecorded(batch, deadline, Default::default())
            .await
            .unwrap_err();
        assert_eq!(error.status().code(), tonic::Code::InvalidArgument);
        let text = mesh.metrics.encode_prometheus();
        assert_eq!(
            line(&text, r#"guardmesh_batches_total{outcome="refused"}"#),
            Some("1"),
            "{text}"
        );
        let refused: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("guardmesh_batches_refused_total{"))
            .collect();
        assert_eq!(refused.len(), 1, "{text}");
        assert!(refused[0].ends_with(" 1"), "{text}");
    }

    #[tokio::test]
    async fn r1_a_zero_call_batch_is_decided_at_once_and_counted_once() {
        let mesh = mesh();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        let decision = mesh
            .evaluate_unrecorded(
                EvaluateRequest {
                    batch_id: "b".into(),
                    ..Default::default()
                },
                deadline,
                Default::default(),
            )
            .await
            .unwrap();
        assert!(decision.decisions.is_empty());
        let text = mesh.metrics.encode_prometheus();
        assert_eq!(
            line(&text, r#"guardmesh_batches_total{outcome="decided"}"#),
            Some("1"),
            "{text}"
        );
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("guardmesh_batches_refused_total{")),
            "{text}"
        );
    }

    #[tokio::test]
    async fn r29_refusals_of_the_auth_layer_are_not_recorded_without_a_log() {
        let refusals = refusals(mesh());
        let recorded = refusals.record(AuthRefusal {
            kind: RefusedKind::Batch,
            caller: None,
            remote: None,
            status: Status::unauthenticated("no"),
        });
        assert!(recorded.is_none());
    }
}
