//! One batch through the mesh: the admission stage's mesh checks
//! ([`crate::admit`]), judging ([`crate::judge`]), and an [`Outcome`] for
//! the batch's record ([`super::record`]), which emits what happened once.

use super::Mesh;
use super::record::{BatchLog, Guards, Outcome};
use super::session::BatchSession;
use crate::admit;
use crate::judge::{BatchError, Phase, TraceContext};
use guardmesh_proto::v1::{BatchDecision, EvaluateRequest, GuardTrace, TraceStatus};
use tokio::time::Instant;

impl Mesh {
    /// Judges one batch. `deadline` is the batch's deadline (R14). The
    /// batch's metrics, logs and spans are emitted; no decision record is
    /// written (the services write it, knowing the caller).
    pub async fn evaluate(
        &self,
        mut request: EvaluateRequest,
        deadline: Instant,
        trace: TraceContext,
    ) -> Result<BatchDecision, BatchError> {
        let record = BatchLog::new(self.metrics.clone(), request.batch_id.clone());
        // R33: a request of results is judged as calls and answered as
        // results.
        match admit::results::take(&mut request, &self.config.limits) {
            Ok(None) => record.emit(self.pass(request, deadline, trace).await),
            Ok(Some(results)) => {
                let by = super::results::ReadBy {
                    session_id: request
                        .context
                        .as_ref()
                        .map_or_else(String::new, |c| c.session_id.clone()),
                    caller: trace.caller.clone(),
                    batch_id: request.batch_id.clone(),
                };
                let phase = Phase::Results(results.clone());
                match record.emit(self.pass_phase(request, deadline, trace, phase).await) {
                    Ok(decision) => {
                        let decision = results.answer(decision);
                        self.results_read(&by, &decision).await;
                        Ok(decision)
                    }
                    Err(status) => Err(status),
                }
            }
            Err(refusal) => record.emit(Outcome::refused(refusal.into())),
        }
    }

    /// The mesh's part of a batch's way: its span, the admission checks
    /// that need the mesh (content, registry, R1, batches in flight), then
    /// judging. Emits nothing: the outcome goes to the batch's record.
    pub(crate) async fn pass(
        &self,
        request: EvaluateRequest,
        deadline: Instant,
        trace: TraceContext,
    ) -> Outcome {
        self.pass_phase(request, deadline, trace, Phase::Calls)
            .await
    }

    /// [`Self::pass`] in a phase: calls, or results taken out of the
    /// request by [`admit::results::take`] (R33).
    pub(crate) async fn pass_phase(
        &self,
        request: EvaluateRequest,
        deadline: Instant,
        mut trace: TraceContext,
        phase: Phase,
    ) -> Outcome {
        let span = crate::observe::spans::batch_span(
            trace.unary,
            &request.batch_id,
            request.context.as_ref(),
            request.calls.len(),
            self.served_at(),
        );
        {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let _ = span.set_parent(trace.parent.clone());
        }
        if let Some(own) = guardmesh_client::trace::span_traceparent(&span)
            && let Some((trace_id, _, _)) = guardmesh_client::trace::parse_traceparent(&own)
        {
            trace.trace_id = trace_id.to_owned();
        }
        let mut outcome = tracing::Instrument::instrument(
            self.pass_in(request, deadline, trace, span.clone(), phase),
            span.clone(),
        )
        .await;
        outcome.span = Some(span);
        outcome
    }

    async fn pass_in(
        &self,
        request: EvaluateRequest,
        deadline: Instant,
        trace: TraceContext,
        span: tracing::Span,
        phase: Phase,
    ) -> Outcome {
        let started = Instant::now();
        let chain = self.chain();
        let results_limits;
        let (limits, policy_args) = if phase.is_results() {
            // R33: policy guards judge calls only; a result's size is
            // bounded by `max_result_bytes`, checked when it was taken.
            results_limits = crate::validate::Limits {
                max_argument_bytes: self
                    .config
                    .limits
                    .max_argument_bytes
                    .max(self.config.limits.max_result_bytes),
                ..self.config.limits
            };
            (&results_limits, None)
        } else {
            let policy_args = chain
                .guards
                .iter()
                .filter_map(|g| g.guard.policy.as_ref())
                .map(|p| p.compiled.reads_args())
                .reduce(|a, b| a || b);
            (&self.config.limits, policy_args)
        };
        let members = match admit::content(&request, limits, policy_args)
            .and_then(|members| admit::registry(self.registry()).map(|()| members))
        {
            Ok(members) => members,
            Err(refusal) => return Outcome::refused(refusal),
        };
        let trace_id = trace.trace_id.clone();
        // R1: zero calls contact no guard.
        if !admit::contacts_guards(&request) {
            let decision = BatchDecision {
                decisions: Vec::new(),
                execute: Vec::new(),
                trace: chain
                    .guards
                    .iter()
                    .map(|g| GuardTrace {
                        guard: g.guard.name.clone(),
                        role: g.guard.role as i32,
                        status: TraceStatus::NotApplicable as i32,
                        ..Default::default()
                    })
                    .collect(),
                chain_revision: chain.revision,
                trace_id: trace.trace_id,
                results: Vec::new(),
                judges_results: chain.judges_results(),
            };
            return Outcome::decided(decision, trace_id, started.elapsed());
        }
        let _permit = match admit::inflight(&self.inflight, limits) {
            Ok(permit) => permit,
            Err(refusal) => return Outcome::refused(refusal),
        };
        // R34: the session's memory, read once when a guard reads it.
        let mut session = self.read_session(&chain, &request, &trace, &phase).await;
        // R33: a request of results runs no call; its results are
        // remembered by `results_read`.
        let runs_calls = !phase.is_results();
        let label_session = session
            .is_none()
            .then(|| Self::label_session(&request, &trace));
        let judged = crate::judge::judge_phase(
            &chain,
            limits,
            self.config.unguarded,
            request,
            members,
            deadline,
            trace,
            span,
            phase,
            // Handed to the judge, not kept: the memory read is let go
            // when judging ends, so that the write after it updates a
            // store in this process in place (no copy of the memory).
            session.as_mut().map(BatchSession::take_value),
        )
        .await;
        if let Ok(decision) = &judged.result {
            // R34: the calls that run (when the memory was read) and the
            // labels the guards set, in one write.
            let labels = judged.labels(&chain);
            match &session {
                Some(session) => {
                    self.remember_session(session, decision, labels, runs_calls)
                        .await;
                }
                None => {
                    if let Some(label_session) = &label_session
                        && !labels.is_empty()
                    {
                        self.remember_session(label_session, decision, labels, false)
                            .await;
                    }
                }
            }
        }
        Outcome::judged(
            judged.result,
            Guards {
                chain,
                runs: judged.runs,
                calls: judged.calls,
                unguarded: (self.config.unguarded, judged.unguarded),
            },
            trace_id,
            started.elapsed(),
        )
    }
}

#[allow(dead_code)]
fn _assert_send(mesh: std::sync::Arc<Mesh>) {
    fn is_send<T: Send>(_: T) {}
    is_send(async move {
        let _ = mesh
            .evaluate(
                EvaluateRequest::default(),
                Instant::now(),
                TraceContext::default(),
            )
            .await;
    });
}
