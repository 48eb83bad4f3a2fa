//! The mesh's part of a batch's way (`pipeline.rs` owns the whole way):
//! the admission stage's mesh checks ([`crate::admit`]), the session read,
//! judging ([`crate::judge`]), the session write, and an [`Outcome`] for
//! the batch's record ([`super::record`]), which emits what happened once.

use super::Mesh;
use super::batch_session::{BatchSession, Unremembered};
use super::pipeline::{Judges, Pass};
use super::record::{Guards, Outcome};
use crate::admit;
use crate::judge::{Phase, TraceContext, Unguarded};
use guardmesh_proto::v1::{BatchDecision, EvaluateRequest, GuardTrace, TraceStatus};
use tokio::time::Instant;

impl Mesh {
    /// The mesh's part of a batch's way (`pipeline.rs`): its span, the
    /// admission checks that need the mesh (content, registry, R1, batches
    /// in flight), the session read, judging by `judges` in a phase (calls,
    /// or results taken out of the request by [`admit::result_batch::take`],
    /// R33), the session write. Emits nothing: the outcome goes to the
    /// batch's record.
    pub(crate) async fn pass_phase(
        &self,
        request: EvaluateRequest,
        deadline: Instant,
        mut trace: TraceContext,
        pass: Pass<'_>,
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
        // Boxed under the span: the judging future is several KiB, and
        // unboxed it was copied into the span's wrapper and again into
        // each future that awaits it, per batch.
        let mut outcome = tracing::Instrument::instrument(
            Box::pin(self.pass_in(request, deadline, trace, span.clone(), pass)),
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
        pass: Pass<'_>,
    ) -> Outcome {
        let Pass {
            phase,
            chain,
            judges,
            busy,
            approvals,
        } = pass;
        let started = Instant::now();
        let unguarded = match judges {
            Judges::Chain => self.config.unguarded,
            Judges::Alone(_) => Unguarded::Proceed,
        };
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
        let how = How {
            chain: &chain,
            limits,
            unguarded,
            remembers: judges.remembers(),
            deadline,
            busy,
        };
        // R34: where replicas share the session's memory and another wrote
        // it between this batch's read and its write, the batch is judged
        // again on the memory as it is now, a bounded number of times, so
        // that two batches of one session are judged as if one ran after
        // the other; then its calls fail per the reading guards' policy
        // (R13).
        let may_change =
            how.remembers && Self::chain_uses_session(&chain) && self.sessions().store().shared();
        let mut input = Judgeable {
            request,
            members,
            trace,
            phase,
            approvals,
        };
        let mut again = 0;
        let (mut judged, unremembered, runs_calls) = loop {
            let spare = (may_change && again < JUDGED_AGAIN).then(|| input.clone());
            let step = match self.judge_remembered(&how, input, span.clone()).await {
                Ok(step) => step,
                Err(refused) => return refused,
            };
            match step {
                Step::Changed(judged, affected, runs_calls) => match spare {
                    Some(spare) if Instant::now() < deadline => {
                        again += 1;
                        tracing::debug!(
                            again,
                            "the session's memory changed since the batch read it: judged again"
                        );
                        input = spare;
                    }
                    _ => {
                        break (
                            judged,
                            Some((Unremembered::Changed.why(), affected)),
                            runs_calls,
                        );
                    }
                },
                Step::Done(judged, unremembered, runs_calls) => {
                    break (judged, unremembered, runs_calls);
                }
            }
        };
        if let Some((why, affected)) = unremembered {
            crate::judge::unremembered(&mut judged, &chain, &affected, &why, !runs_calls);
        }
        Outcome::judged(
            judged.result,
            Guards {
                chain,
                runs: judged.runs,
                calls: judged.calls,
                unguarded: (unguarded, judged.unguarded),
            },
            trace_id,
            started.elapsed(),
        )
    }

    /// Reads the session (when a guard reads it), judges, and remembers
    /// what runs or is read (R34), once. `Err`: the batch refused.
    async fn judge_remembered(
        &self,
        how: &How<'_>,
        input: Judgeable,
        span: tracing::Span,
    ) -> Result<Step, Outcome> {
        let Judgeable {
            request,
            members,
            trace,
            mut phase,
            approvals,
        } = input;
        let chain = how.chain;
        // R34: the session's memory, read once when a guard reads it.
        let mut session = self
            .read_session(chain, &request, &trace, &phase, how.busy.clone())
            .await;
        // R33: a request of results runs no call; its results are
        // remembered from the servers of the calls they answer (R34).
        let runs_calls = !phase.is_results();
        let remembers = how.remembers;
        let mut results_session = None;
        if let Phase::Results(results) = &mut phase
            && remembers
            && Self::chain_uses_session(chain)
        {
            match self
                .results_session(session.as_ref(), &request, &trace, results)
                .await
            {
                Ok(found) => results_session = Some(found),
                Err(refusal) => return Err(Outcome::refused(refusal.into())),
            }
        }
        let label_session = (session.is_none() && results_session.is_none() && remembers)
            .then(|| Self::label_session(&request, &trace));
        let judged = crate::judge::judge_phase(crate::judge::JudgeInput {
            chain,
            limits: how.limits,
            unguarded: how.unguarded,
            request,
            members,
            deadline: how.deadline,
            trace,
            span,
            phase,
            // Handed to the judge, not kept: the memory read is let go
            // when judging ends, so that the write after it updates a
            // store in this process in place (no copy of the memory).
            session: session.as_mut().map(BatchSession::take_value),
            identity: session.as_mut().and_then(BatchSession::take_identity),
            approvals,
        })
        .await;
        let Ok(decision) = &judged.result else {
            return Ok(Step::Done(judged, None, runs_calls));
        };
        // R34, R13: what cannot be remembered is not passed. The calls
        // that run (when the memory was read), or what the model reads of
        // the results, and the labels the guards set, in one write, before
        // the answer leaves.
        let labels = judged.labels(chain);
        let (written, affected) = match (&session, results_session) {
            (_, Some(results_session)) => {
                let affected = results_session.affected(decision.decisions.len());
                let written = self
                    .remember_results(results_session, decision, labels)
                    .await;
                (written, affected)
            }
            (Some(session), None) if remembers => {
                let written = self
                    .remember_session(session, decision, labels, runs_calls)
                    .await;
                // A request of results that read no memory: nothing of
                // its calls to remember, so nothing fails for it.
                if !runs_calls && !matches!(written, Err(Unremembered::Changed)) {
                    return Ok(Step::Done(judged, None, runs_calls));
                }
                (written, vec![true; decision.decisions.len()])
            }
            _ => {
                // Labels alone, in a batch that read no memory: a failed
                // write is logged and counted by the store.
                if let Some(label_session) = &label_session
                    && !labels.is_empty()
                {
                    let _ = self
                        .remember_session(label_session, decision, labels, false)
                        .await;
                }
                return Ok(Step::Done(judged, None, runs_calls));
            }
        };
        Ok(match written {
            Ok(_) => Step::Done(judged, None, runs_calls),
            Err(Unremembered::Changed) => Step::Changed(judged, affected, runs_calls),
            Err(Unremembered::Failed(why)) => Step::Done(judged, Some((why, affected)), runs_calls),
        })
    }
}

/// Times a batch is judged again when the session's memory replicas share
/// changed between its read and its write (R34); after that its calls fail
/// per the reading guards' policy (R13).
const JUDGED_AGAIN: u32 = 3;

/// How a batch is judged, the same each time it is.
struct How<'a> {
    chain: &'a crate::judge::Chain,
    limits: &'a crate::validate::Limits,
    unguarded: Unguarded,
    remembers: bool,
    deadline: Instant,
    busy: Option<std::sync::Arc<str>>,
}

/// What one judging of a batch consumes: kept aside when it may be judged
/// again.
#[derive(Clone)]
struct Judgeable {
    request: EvaluateRequest,
    members: crate::validate::ijson::Recorded,
    trace: TraceContext,
    phase: Phase,
    approvals: Vec<crate::approval::Resolved>,
}

/// A batch judged and its memory written, or found changed.
enum Step {
    /// Judged; `Some` with why and the calls affected when what it let run
    /// could not be remembered; whether it ran calls (not results).
    Done(
        crate::judge::Judged,
        Option<(std::sync::Arc<str>, Vec<bool>)>,
        bool,
    ),
    /// Judged, but another replica wrote the memory after it was read:
    /// nothing was written; the calls affected; whether it ran calls.
    Changed(crate::judge::Judged, Vec<bool>, bool),
}

#[allow(dead_code)]
fn _assert_send(mesh: std::sync::Arc<Mesh>) {
    fn is_send<T: Send>(_: T) {}
    is_send(async move {
        let _ = mesh
            .evaluate_unrecorded(
                EvaluateRequest::default(),
                Instant::now(),
                TraceContext::default(),
            )
            .await;
    });
}
