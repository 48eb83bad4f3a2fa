//! Judging one batch: mutate guards one after another (R10), then validate
//! guards concurrently through the [`Fold`] (R3, R4, R5), then one decision
//! per call (R2) and one trace entry per guard (R21).
//!
//! * [`verdicts`]: a guard's verdicts checked before they count (R8, R11),
//!   with typed reasons for what is dropped or rejected.
//! * Failures take one path (R13): `guard_failed` is the one sequence for
//!   every failure, [`FoldGuard::on_failure`] the one reading of the policy,
//!   and `apply` the one place a fold's outcome reaches the calls. Each
//!   mutate guard is judged through a one-guard fold, the validate guards
//!   through one fold together.
//! * Judging only consults guards and folds: [`judge_phase`] returns a
//!   [`Judged`] outcome (the answer, and what happened at each guard) and
//!   writes no metrics, spans' outcomes or records; the batch's record
//!   ([`crate::mesh::record`]) does, once. The log lines written here are
//!   a guard's failure and a batch shed, when they happen (R13: never
//!   silent, even if the batch is then dropped).
//!
//! Here are the batch's types, the entry [`judge_phase`] and the steps
//! every guard goes through (selecting its calls, its fold, failures, the
//! decisions); the rest, by concern:
//!
//! * `remote`: the guards consulted over their links: the batch encoded
//!   once and sent, mutate guards one by one, the validate fold, answers
//!   and deadlines collected.
//! * `lanes`: the policy guards (R27), evaluated in the mesh, inline or on
//!   the policy pool's lanes, and folded as a remote guard's answer is.
//! * `results`: the results phase (R33): which guards it reaches, its
//!   order, how results are put on the wire.
//! * `guard_run`: what happened at one guard, and its trace entry (R21).
//! * `unremembered`: a decided batch whose calls or results its session
//!   could not record, failed per the policy of the guards that read
//!   sessions (R34, R13).

#[cfg(test)]
mod ask_properties;
mod call_index;
mod chain;
pub(crate) mod fold;
mod guard_run;
mod lanes;
#[cfg(test)]
mod paused_tests;
mod remote;
mod results_phase;
#[cfg(test)]
mod results_phase_tests;
mod unremembered;
pub(crate) mod verdicts;

use crate::judge::call_index::CallIndex;
use crate::judge::fold::{Decided, Fold, FoldGuard};
use crate::link::{Busy, GuardFailure};
use crate::policy::Recorded;
use crate::registry::spec::Guard;
use crate::validate::Limits;
pub use chain::{Chain, ChainGuard, Unguarded};
use guard_run::trace_entry;
pub(crate) use guard_run::{GuardRun, error_text, reported_status, span_failure, span_guard};
use guardmesh_proto::v1::{
    Action, ApprovalRequest, BatchContext, BatchDecision, CallDecision, EvaluateRequest, GuardRole,
    SkipKind, ToolCall,
};
use prost::bytes::Bytes;
pub(crate) use results_phase::Phase;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Status;
pub(crate) use unremembered::unremembered;

/// The coordinator's W3C trace context for a batch (R22).
#[derive(Debug, Clone, Default)]
pub struct TraceContext {
    /// The parent of the batch's span.
    pub parent: opentelemetry::Context,
    pub traceparent: String,
    pub tracestate: String,
    /// 32 hex digits, or empty when there is no trace.
    pub trace_id: String,
    /// `EvaluateBatch` for unary calls; `Evaluate` otherwise.
    pub unary: bool,
    /// Which client sent the batch: a key per coordinator connection, by
    /// which a guard link shares its queue between clients (R25); 0 when
    /// unknown.
    pub client: u64,
    /// The authenticated caller's identity, when there is one: handed on
    /// with each result decision (R33, `mesh/result_reads.rs`).
    pub caller: Option<Arc<str>>,
    /// The caller's identity as the auth layer established it; empty on a
    /// mesh without principals. Session memory is keyed by it (R34).
    pub identity: Arc<str>,
}

impl TraceContext {
    /// Reads a `traceparent`/`tracestate` pair; empty when invalid.
    pub fn from_w3c(traceparent: &str, tracestate: &str) -> Self {
        match guardmesh_client::trace::parse_traceparent(traceparent) {
            Some((trace_id, _, _)) => Self {
                parent: guardmesh_client::trace::parent_context(traceparent, tracestate),
                traceparent: traceparent.trim().to_owned(),
                tracestate: tracestate.to_owned(),
                trace_id: trace_id.to_ascii_lowercase(),
                unary: false,
                client: 0,
                caller: None,
                identity: Arc::from(""),
            },
            None => Self::default(),
        }
    }
}

/// Why a batch got no decision.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Refused before any guard was contacted (R20, R25), by the admission
    /// stage.
    #[error("batch refused: {0}")]
    Refused(crate::admit::Refusal),
    /// A guard with failure policy `abort` failed (R13).
    #[error("batch aborted: guard {guard:?} failed ({failure}) and its failure policy is abort")]
    Aborted {
        guard: String,
        failure: GuardFailure,
    },
    /// A guard's link had no room for the batch while the guard was making
    /// progress (R25): the whole batch is shed, nothing was decided, and
    /// the guard did not fail.
    #[error("batch shed: guard {guard:?} {busy}")]
    Shed { guard: String, busy: Busy },
    /// The client already had its share of batches waiting for a policy
    /// evaluation thread (R25): shed as [`Self::Shed`] is.
    #[error("batch shed: policy guard {guard:?}: {wait}")]
    PolicyBusy {
        guard: String,
        wait: crate::policy::pool::Wait,
    },
}

impl BatchError {
    /// The gRPC status the coordinator gets.
    pub fn status(&self) -> Status {
        match self {
            Self::Refused(refusal) => refusal.status(),
            Self::Aborted { .. } => Status::unavailable(self.to_string()),
            Self::Shed { .. } | Self::PolicyBusy { .. } => {
                Status::resource_exhausted(self.to_string())
            }
        }
    }
}

/// A call being judged.
struct Call {
    original: ToolCall,
    /// The call as the mutate guards rewrote it, if one did.
    rewritten: Option<ToolCall>,
    fixed: Option<Fixed>,
    rewritten_by: Vec<String>,
    bypassed: Vec<String>,
    /// R35: the approvals the batch named for it, resolved (one per guard
    /// that asked): an approved one stands in for its guard until
    /// [`Judging::stand_in`] uses it.
    stand_in: Vec<crate::approval::StandIn>,
    /// R35: why the approval named for it did not hold.
    approval_refused: Option<String>,
    /// R35: the approval requests that stood in for their guards.
    approved: Vec<String>,
}

impl Call {
    /// The call as it stands: rewritten, or as the coordinator sent it.
    fn current(&self) -> &ToolCall {
        self.rewritten.as_ref().unwrap_or(&self.original)
    }
}

/// A skip that fixed a call.
struct Fixed {
    content: String,
    kind: SkipKind,
    by: String,
    failure: bool,
    /// R35: an ask, not a skip: the reason, or the request still pending.
    ask: Option<Ask>,
}

/// An ask that fixed a call (R35).
enum Ask {
    /// A guard asked in this batch: the request is made after judging.
    New(String),
    /// The request the batch named is still waiting for its answer.
    Pending(Box<ApprovalRequest>),
}

fn unavailable(guard: &Guard) -> Fixed {
    Fixed {
        content: format!(
            "Tool call blocked: guard {} is unavailable, so this call cannot be checked. Do not retry it now.",
            guard.name
        ),
        kind: SkipKind::Cancel,
        by: guard.name.clone(),
        failure: true,
        ask: None,
    }
}

/// What judging a batch came to: the answer, and what happened at each
/// guard (in chain order), for the batch's record.
pub(crate) struct Judged {
    pub(crate) result: Result<BatchDecision, BatchError>,
    pub(crate) runs: Vec<GuardRun>,
    /// The calls as sent, of a batch that got no decision (empty once
    /// decided: the decision holds them).
    pub(crate) calls: Vec<ToolCall>,
    /// Calls no enforced guard applied to (R28), counted by the record.
    pub(crate) unguarded: usize,
}

impl Judged {
    /// The session labels the batch's guards added (R34): of those that
    /// enforce and did not fail, in chain order, each once.
    pub(crate) fn labels(&self, chain: &Chain) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (g, run) in chain.guards.iter().zip(&self.runs) {
            for label in run.applied_labels(&g.guard) {
                if !out.contains(label) {
                    out.push(label.clone());
                }
            }
        }
        out
    }
}

/// What a batch is judged with ([`judge_phase`]).
pub(crate) struct JudgeInput<'a> {
    /// The chain's snapshot the batch is judged against (R17).
    pub(crate) chain: &'a Chain,
    pub(crate) limits: &'a Limits,
    /// What becomes of a call no enforced guard applies to (R28).
    pub(crate) unguarded: Unguarded,
    pub(crate) request: EvaluateRequest,
    /// What the admission stage recorded of the calls' arguments for the
    /// policy guards (R27).
    pub(crate) members: Recorded,
    pub(crate) deadline: Instant,
    pub(crate) trace: TraceContext,
    /// The batch's span, under which each guard's span opens.
    pub(crate) span: tracing::Span,
    /// A batch of calls, or of results as calls (R33).
    pub(crate) phase: Phase,
    /// The session's memory for the guards that read it (R34).
    pub(crate) session: Option<crate::policy::SessionVal>,
    /// The memory of the caller's identity for the policy rules that read
    /// it (R34).
    pub(crate) identity: Option<crate::policy::SessionVal>,
    /// R35: the approvals the batch named, resolved, one per call (empty:
    /// none named).
    pub(crate) approvals: Vec<crate::approval::Resolved>,
}

/// Judges one admitted batch against its chain: consults the guards, folds
/// their verdicts and decides (R2..R18).
pub(crate) async fn judge_phase(input: JudgeInput<'_>) -> Judged {
    let mut judging = Judging::new(input);
    let result = judging.run().await;
    Judged {
        result,
        calls: judging.calls.into_iter().map(|c| c.original).collect(),
        runs: judging.runs,
        unguarded: judging.unguarded_calls,
    }
}

/// The state of one batch being judged.
struct Judging<'a> {
    limits: &'a Limits,
    unguarded: Unguarded,
    /// Calls no enforced guard applied to (R28).
    unguarded_calls: usize,
    chain: &'a Chain,
    request: EvaluateRequest,
    context: Option<BatchContext>,
    calls: Vec<Call>,
    /// Call id to index; ids never change, not even by rewrites.
    index_of: CallIndex,
    /// The top-level members of each call's arguments as sent, recorded by
    /// the check when a policy guard will read them (else empty).
    members: Recorded,
    runs: Vec<GuardRun>,
    /// The batch's context and calls as guards are sent them, encoded once
    /// per set of calls sent (by which calls), while no call changes.
    encoded: Vec<(Vec<bool>, Bytes)>,
    deadline: Instant,
    trace: TraceContext,
    span: tracing::Span,
    /// Calls, or results (R33).
    phase: Phase,
    /// The session's memory for the guards that read it (R34).
    session: Option<crate::policy::SessionVal>,
    /// The identity's memory for the policy rules that read it (R34).
    identity: Option<crate::policy::SessionVal>,
    /// The session's memory as remote guards are sent it, encoded once.
    memory: Option<Bytes>,
    /// Who sent the batch, as the guards' fair queues know it (R25):
    /// worked out at the first request to a remote guard, then reused.
    sender: Option<crate::link::fair::Sender>,
}

impl<'a> Judging<'a> {
    fn new(input: JudgeInput<'a>) -> Self {
        let JudgeInput {
            chain,
            mut request,
            approvals,
            ..
        } = input;
        let mut approvals = approvals.into_iter();
        let calls: Vec<Call> = std::mem::take(&mut request.calls)
            .into_iter()
            .map(|call| {
                let resolved = approvals.next().unwrap_or_default();
                let mut call = Call {
                    original: call,
                    rewritten: None,
                    fixed: None,
                    rewritten_by: Vec::new(),
                    bypassed: Vec::new(),
                    stand_in: resolved.stand_in,
                    approval_refused: resolved.refused,
                    approved: Vec::new(),
                };
                // R35: denied, expired or still pending: decided before
                // any guard is consulted.
                if let Some(at) = call
                    .stand_in
                    .iter()
                    .position(|s| matches!(s, crate::approval::StandIn::Fixed { .. }))
                    && let crate::approval::StandIn::Fixed {
                        guard,
                        content,
                        kind,
                        pending,
                    } = call.stand_in.swap_remove(at)
                {
                    call.fixed = Some(Fixed {
                        content,
                        kind,
                        by: guard,
                        failure: false,
                        ask: pending.map(Ask::Pending),
                    });
                }
                call
            })
            .collect();
        let n = calls.len();
        let index_of = CallIndex::new(n, |i| calls[i].original.call_id.as_str());
        Self {
            index_of,
            members: input.members,
            limits: input.limits,
            unguarded: input.unguarded,
            unguarded_calls: 0,
            chain,
            context: request.context.take(),
            request,
            calls,
            runs: (0..chain.guards.len()).map(|_| GuardRun::new()).collect(),
            encoded: Vec::new(),
            deadline: input.deadline,
            trace: input.trace,
            span: input.span,
            phase: input.phase,
            session: input.session,
            identity: input.identity,
            memory: None,
            sender: None,
        }
    }

    /// Consults the guards, then decides; what happened is recorded by the
    /// batch's record, not here.
    async fn run(&mut self) -> Result<BatchDecision, BatchError> {
        self.consult().await?;
        self.unguarded();
        Ok(self.decide())
    }

    async fn consult(&mut self) -> Result<(), BatchError> {
        if self.phase.is_results() {
            return self.consult_results().await;
        }
        // R10: mutate guards first, one after another, in chain order.
        for g in 0..self.chain.guards.len() {
            if self.chain.guards[g].guard.role == GuardRole::Mutate {
                self.mutate(g).await?;
            }
        }
        self.validate().await
    }

    /// Which calls guard `g` is sent: those it applies to and that are not
    /// already fixed (R9).
    fn select(&self, g: usize) -> Vec<bool> {
        let guard = &self.chain.guards[g].guard;
        self.calls
            .iter()
            .map(|call| {
                call.fixed.is_none()
                    && self.phase.reaches(guard)
                    && guard.tools.matches(&call.current().tool)
            })
            .collect()
    }

    /// R35: an approval stands in for guard `g` on a call it asked about:
    /// the call is not sent to it when the call it would see has the
    /// approved digest; otherwise it is sent, and the approval is refused
    /// (a renamed or rewritten call is another call).
    fn stand_in(&mut self, g: usize, sent: &mut [bool]) {
        let name = &self.chain.guards[g].guard.name;
        for (i, call) in self.calls.iter_mut().enumerate() {
            let Some(at) = call.stand_in.iter().position(
                |s| matches!(s, crate::approval::StandIn::Approved { guard, .. } if guard == name),
            ) else {
                continue;
            };
            let crate::approval::StandIn::Approved { digest, id, .. } =
                call.stand_in.swap_remove(at)
            else {
                continue;
            };
            let current = call.current();
            if crate::approval::record::digest(&current.tool, &current.arguments) == digest {
                if sent[i] {
                    sent[i] = false;
                    self.runs[g].approved.push(i);
                }
                call.approved.push(id);
            } else {
                let why = "the call is not the one approved (its digest differs): asked again";
                call.approval_refused = Some(match call.approval_refused.take() {
                    Some(before) => format!("{before}; {why}"),
                    None => why.to_owned(),
                });
            }
        }
    }

    /// The time guard `g` gets: its timeout within what is left of the
    /// batch's deadline (R14).
    fn budget(&self, guard: &Guard, now: Instant) -> Duration {
        guard
            .timeout
            .min(self.deadline.saturating_duration_since(now))
    }

    /// A fold over the guards `order` (chain indices, in chain order), each
    /// over the calls it was sent. A mutate guard gets a fold of its own.
    fn fold_of(&self, order: &[usize]) -> Fold {
        let guards = order
            .iter()
            .map(|&g| FoldGuard {
                enforced: self.chain.guards[g].guard.enforced(),
                policy: self.chain.guards[g].guard.failure_policy,
            })
            .collect();
        let runs = &self.runs;
        Fold::new(guards, self.calls.len(), |k, c| runs[order[k]].sent[c])
    }

    /// Writes what a fold over the guards `order` decided into the calls:
    /// skips (R3), and what the failure policy (R13) made of failures:
    /// cancels, bypass records, or the batch's abort. `order[k]` is the
    /// chain index of the fold's guard `k`.
    fn apply(&mut self, order: &[usize], fold: &mut Fold) -> Result<(), BatchError> {
        let outcomes = match fold.outcomes() {
            Ok(outcomes) => outcomes,
            Err(k) => {
                let g = order[k];
                return Err(BatchError::Aborted {
                    guard: self.chain.guards[g].guard.name.clone(),
                    failure: self.runs[g]
                        .failure
                        .clone()
                        .unwrap_or(GuardFailure::StreamClosed),
                });
            }
        };
        let chain = self.chain;
        let runs = &self.runs;
        let guard = |k: usize| &chain.guards[order[k]].guard;
        for (c, (call, outcome)) in self.calls.iter_mut().zip(outcomes).enumerate() {
            if call.fixed.is_some() {
                continue;
            }
            for k in outcome.bypassed {
                call.bypassed.push(guard(k).name.clone());
            }
            call.fixed = outcome.decided.map(|decided| match decided {
                Decided::Skip { guard: k, skip } => Fixed {
                    content: skip.content,
                    kind: SkipKind::try_from(skip.kind).unwrap_or(SkipKind::Steer),
                    by: guard(k).name.clone(),
                    failure: false,
                    ask: runs[order[k]]
                        .ask_of(c)
                        .map(|reason| Ask::New(reason.to_owned())),
                },
                Decided::Unavailable { guard: k } => unavailable(guard(k)),
            });
        }
        Ok(())
    }

    /// Guard `g`, the fold's guard `k`, failed: the one sequence for every
    /// failure (R13). Its request is cancelled when it may still be out
    /// (`cancel`), its circuit breaker hears of it, the failure is kept for
    /// the trace and the batch's record, and the fold applies the guard's
    /// failure policy to the calls it has not answered.
    fn guard_failed(
        &mut self,
        g: usize,
        failure: GuardFailure,
        cancel: bool,
        fold: &mut Fold,
        k: usize,
    ) {
        let ChainGuard { guard, link } = &self.chain.guards[g];
        // Logged when it happens (R13: never silent), even if the batch is
        // then dropped because its coordinator went away.
        tracing::warn!(
            guard = %guard.name,
            batch_id = %self.request.batch_id,
            trace_id = %self.trace.trace_id,
            policy = ?guard.failure_policy,
            dry_run = !guard.enforced(),
            error = %failure,
            "guard failed"
        );
        let run = &mut self.runs[g];
        run.finished.get_or_insert_with(Instant::now);
        if let Some(link) = link {
            if cancel
                && let Some(id) = run.request_id
                && let Some(replica) = link.cancel(id)
            {
                run.replica = Some(replica);
            }
            link.record(run.replica.as_deref(), Err(&failure));
        }
        run.failure = Some(failure);
        fold.fail(k);
    }

    /// R28: a call that no enforced guard applies to, and that nothing
    /// skipped, proceeds or, with `unguarded = "cancel"`, is cancelled with
    /// content naming its tool; counted either way.
    fn unguarded(&mut self) {
        // R33: a result no guard judges is read as the tool returned it;
        // R28 is about calls that would run.
        if self.phase.is_results() {
            return;
        }
        let chain = self.chain;
        let runs = &self.runs;
        for (i, call) in self.calls.iter_mut().enumerate() {
            if call.fixed.is_some() {
                continue;
            }
            // A guard applies to a call when the call was sent to it (R9),
            // at its step: a mutate guard before any rename, a validate
            // guard after.
            let guarded = chain
                .guards
                .iter()
                .zip(runs)
                .any(|(cg, run)| cg.guard.enforced() && run.sent.get(i) == Some(&true))
                // R35: an approval stood in for a guard that applies.
                || !call.approved.is_empty();
            if guarded {
                continue;
            }
            self.unguarded_calls += 1;
            match self.unguarded {
                Unguarded::Proceed => {}
                Unguarded::Cancel => {
                    call.fixed = Some(Fixed {
                        content: format!(
                            "Tool call blocked: no guard checks the tool {:?}, and this mesh \
                             cancels unguarded calls. Do not retry it.",
                            call.current().tool
                        ),
                        kind: SkipKind::Cancel,
                        by: String::new(),
                        failure: false,
                        ask: None,
                    });
                }
            }
        }
    }

    /// One decision per call (R2) and one trace entry per guard (R21).
    fn decide(&mut self) -> BatchDecision {
        let mut decisions = Vec::with_capacity(self.calls.len());
        let mut execute = Vec::new();
        for call in std::mem::take(&mut self.calls) {
            let current = call.rewritten.unwrap_or_else(|| call.original.clone());
            let mut decision = CallDecision {
                call_id: call.original.call_id.clone(),
                action: Action::Proceed as i32,
                call: None,
                original: Some(call.original),
                content: String::new(),
                decided_by: String::new(),
                failure: false,
                rewritten_by: call.rewritten_by,
                bypassed: call.bypassed,
                approval: None,
                approval_refused: call.approval_refused.unwrap_or_default(),
                approved_by_request: String::new(),
            };
            match call.fixed {
                None => {
                    decision.approved_by_request = call.approved.join(",");
                    execute.push(current.clone());
                }
                Some(fixed) => {
                    decision.action = match (&fixed.ask, fixed.kind) {
                        (Some(_), _) => Action::Ask,
                        (None, SkipKind::Steer) => Action::Steer,
                        (None, SkipKind::Cancel) => Action::Cancel,
                    } as i32;
                    // R35: the request is made after judging (its id
                    // empty until then), bound to the call as judged.
                    decision.approval = match fixed.ask {
                        None => None,
                        Some(Ask::Pending(request)) => Some(*request),
                        Some(Ask::New(reason)) => Some(ApprovalRequest {
                            guard: fixed.by.clone(),
                            fallback: self
                                .chain
                                .guards
                                .iter()
                                .find(|g| g.guard.name == fixed.by)
                                .map_or(0, |g| g.guard.ask_fallback as i32),
                            reason,
                            digest: crate::approval::record::digest(
                                &current.tool,
                                &current.arguments,
                            ),
                            chain_revision: self.chain.revision,
                            ..Default::default()
                        }),
                    };
                    decision.content = fixed.content;
                    decision.decided_by = fixed.by;
                    decision.failure = fixed.failure;
                }
            }
            decision.call = Some(current);
            decisions.push(decision);
        }
        let ids: Vec<&str> = decisions.iter().map(|d| d.call_id.as_str()).collect();
        let trace = self
            .chain
            .guards
            .iter()
            .zip(&self.runs)
            .map(|(ChainGuard { guard, .. }, run)| trace_entry(guard, run, &ids))
            .collect();
        BatchDecision {
            decisions,
            execute,
            trace,
            chain_revision: self.chain.revision,
            trace_id: self.trace.trace_id.clone(),
            results: Vec::new(),
            judges_results: self.chain.judges_results(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{GuardMode, GuardSpec};

    /// A guard named `g` in `mode`.
    pub(super) fn guard(mode: GuardMode) -> Guard {
        let spec = GuardSpec {
            name: "g".into(),
            endpoint: "127.0.0.1:9".into(),
            mode: mode as i32,
            ..Default::default()
        };
        Guard::from_spec(&spec, Duration::from_secs(1)).unwrap()
    }

    #[test]
    fn r13_abort_status_names_the_guard_and_the_cause() {
        let status = BatchError::Aborted {
            guard: "pii".into(),
            failure: GuardFailure::StreamClosed,
        }
        .status();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        for needle in ["\"pii\"", "closed its stream", "abort"] {
            assert!(status.message().contains(needle), "{}", status.message());
        }
    }

    #[test]
    fn r13_fail_closed_content_names_the_guard() {
        let fixed = unavailable(&guard(GuardMode::Enforce));
        assert!(fixed.content.contains("guard g is unavailable"));
        assert_eq!(fixed.kind, SkipKind::Cancel);
        assert!(fixed.failure);
    }
}
