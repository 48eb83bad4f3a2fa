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

mod call_index;
mod chain;
pub(crate) mod fold;
#[cfg(test)]
mod paused_tests;
mod results;
#[cfg(test)]
mod results_tests;
pub(crate) mod verdicts;

use crate::judge::call_index::CallIndex;
use crate::judge::fold::{Decided, Fold, FoldGuard};
use crate::link::{GuardFailure, LinkBusy, LinkEvent, NotSent};
use crate::observe::spans::{SpanFailure, SpanGuard};
use crate::policy::{Args, BatchValues, CallRef, ContextRef, Outcome as PolicyOutcome, Recorded};
use crate::registry::spec::Guard;
use crate::validate::Limits;
use crate::wire::fields::guard_batch;
use crate::wire::write;
pub use chain::{Chain, ChainGuard, Unguarded};
use guardmesh_proto::v1::{
    Action, BatchContext, BatchDecision, CallDecision, EvaluateRequest, GuardBatch, GuardRole,
    GuardTrace, JudgeResponse, Skip, SkipKind, ToolCall, TraceStatus,
};
use prost::bytes::Bytes;
pub(crate) use results::Phase;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Status;
use verdicts::{Malformed, check_verdicts_in};

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
    /// with each result decision (R33, `mesh/results.rs`).
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
    Shed { guard: String, busy: LinkBusy },
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
    }
}

/// What happened at one guard, collected into its trace entry and, by the
/// batch's record, into metrics, logs and spans.
pub(crate) struct GuardRun {
    pub(crate) sent: Vec<bool>,
    pub(crate) sent_any: bool,
    request_id: Option<u64>,
    /// R32: the replica that answered (or failed) the request last.
    pub(crate) replica: Option<Arc<str>>,
    started: Option<Instant>,
    finished: Option<Instant>,
    pub(crate) skipped: Vec<usize>,
    pub(crate) rewritten: Vec<usize>,
    pub(crate) malformed: Vec<Malformed>,
    pub(crate) failure: Option<GuardFailure>,
    superseded: bool,
    answered: Vec<bool>,
    /// The kinds (`SkipKind`) of `skipped`, in the same order.
    skip_kinds: Vec<i32>,
    /// The guard's `apply_guardrail` span, and a remote guard's client span
    /// under it, while the guard is consulted.
    pub(crate) guardrail: Option<tracing::Span>,
    pub(crate) span: Option<tracing::Span>,
    /// For a policy guard (R27): the rule that decided (or failed on) each
    /// call, by call index.
    rules: Vec<(usize, String)>,
    /// Session labels its verdicts (or its policy rules) add (R34), at
    /// most [`MAX_LABELS_PER_GUARD`]; applied only when the guard enforces
    /// and did not fail.
    pub(crate) labels: Vec<String>,
    /// Labels refused: outside the grammar or past a bound.
    pub(crate) refused_labels: usize,
}

/// Labels one guard may add to a session in one batch (R34).
pub(crate) const MAX_LABELS_PER_GUARD: usize = 64;

impl GuardRun {
    fn new(calls: usize) -> Self {
        Self {
            sent: vec![false; calls],
            sent_any: false,
            request_id: None,
            replica: None,
            started: None,
            finished: None,
            skipped: Vec::new(),
            rewritten: Vec::new(),
            malformed: Vec::new(),
            failure: None,
            superseded: false,
            answered: vec![false; calls],
            skip_kinds: Vec::new(),
            guardrail: None,
            span: None,
            rules: Vec::new(),
            labels: Vec::new(),
            refused_labels: 0,
        }
    }

    /// Adds labels a verdict set, within [`MAX_LABELS_PER_GUARD`].
    pub(crate) fn add_labels(&mut self, labels: Vec<String>, refused: usize) {
        self.refused_labels += refused;
        for label in labels {
            if self.labels.contains(&label) {
                continue;
            }
            if self.labels.len() >= MAX_LABELS_PER_GUARD {
                self.refused_labels += 1;
            } else {
                self.labels.push(label);
            }
        }
    }

    /// The labels that apply (R34): those of a guard that enforces and
    /// did not fail (R13, R18).
    pub(crate) fn applied_labels(&self, guard: &Guard) -> &[String] {
        if guard.enforced() && self.failure.is_none() {
            &self.labels
        } else {
            &[]
        }
    }

    /// From sending to the answer or the failure, when both happened.
    pub(crate) fn latency(&self) -> Option<Duration> {
        match (self.started, self.finished) {
            (Some(s), Some(f)) => Some(f - s),
            _ => None,
        }
    }

    /// What the guard said of call `i`, if it was sent it: `proceed`,
    /// `steer`, `cancel` or `rewrite`, `failed` when it failed before
    /// answering it; `None` when its answer was no longer needed (R5).
    pub(crate) fn call_action(&self, i: usize) -> Option<&'static str> {
        if self.sent.get(i) != Some(&true) {
            return None;
        }
        if let Some(k) = self.skipped.iter().position(|&s| s == i) {
            return Some(
                match self.skip_kinds.get(k).map(|&k| SkipKind::try_from(k)) {
                    Some(Ok(SkipKind::Cancel)) => "cancel",
                    _ => "steer",
                },
            );
        }
        if self.rewritten.contains(&i) {
            return Some("rewrite");
        }
        let answered = self.answered.get(i) == Some(&true);
        match &self.failure {
            Some(_) if !answered => Some("failed"),
            None if !answered && self.superseded => None,
            _ => Some("proceed"),
        }
    }

    /// The status this run would have if the guard enforced.
    pub(crate) fn status(&self) -> TraceStatus {
        match &self.failure {
            _ if !self.sent_any => TraceStatus::NotApplicable,
            Some(GuardFailure::TimedOut(_)) => TraceStatus::TimedOut,
            Some(GuardFailure::RejectedRewrite(_)) => TraceStatus::RejectedRewrite,
            Some(_) => TraceStatus::Failed,
            None if self.superseded => TraceStatus::Superseded,
            None if !self.malformed.is_empty() => TraceStatus::Malformed,
            None if !self.skipped.is_empty() => TraceStatus::Skipped,
            None if !self.rewritten.is_empty() => TraceStatus::Rewrote,
            None => TraceStatus::Proceeded,
        }
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
    /// The session's memory as remote guards are sent it, encoded once.
    memory: Option<Bytes>,
}

impl<'a> Judging<'a> {
    fn new(input: JudgeInput<'a>) -> Self {
        let JudgeInput {
            chain,
            limits,
            unguarded,
            mut request,
            members,
            deadline,
            trace,
            span,
            phase,
            session,
        } = input;
        let calls: Vec<Call> = std::mem::take(&mut request.calls)
            .into_iter()
            .map(|call| Call {
                original: call,
                rewritten: None,
                fixed: None,
                rewritten_by: Vec::new(),
                bypassed: Vec::new(),
            })
            .collect();
        let n = calls.len();
        let index_of = CallIndex::new(n, |i| calls[i].original.call_id.as_str());
        Self {
            index_of,
            members,
            limits,
            unguarded,
            unguarded_calls: 0,
            chain,
            context: request.context.take(),
            request,
            calls,
            runs: (0..chain.guards.len()).map(|_| GuardRun::new(n)).collect(),
            encoded: Vec::new(),
            deadline,
            trace,
            span,
            phase,
            session,
            memory: None,
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
            // R33: validate guards judge the raw result first, then mutate
            // guards rewrite it, one after another in chain order.
            self.validate().await?;
            for g in 0..self.chain.guards.len() {
                if self.chain.guards[g].guard.role == GuardRole::Mutate {
                    self.mutate(g).await?;
                }
            }
            return Ok(());
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

    /// The context and the calls guard `g` is sent, encoded: once for every
    /// guard sent the same calls, until a rewrite changes a call.
    fn shared_part(&mut self, g: usize) -> Bytes {
        let calls = self.shared_calls(g);
        if !self.chain.guards[g].guard.wants_session_memory() {
            return calls;
        }
        // R34: the session's memory, encoded once per batch, after the
        // calls (protobuf readers accept fields in any order).
        let Some(memory) = self.memory_part() else {
            return calls;
        };
        let mut bytes = Vec::with_capacity(calls.len() + memory.len());
        bytes.extend_from_slice(&calls);
        bytes.extend_from_slice(&memory);
        Bytes::from(bytes)
    }

    /// `GuardBatch.session` encoded, once per batch: the memory
    /// read for the batch, or why it could not be read (R34).
    fn memory_part(&mut self) -> Option<Bytes> {
        if self.memory.is_none() {
            let mut bytes = Vec::new();
            match self.session.as_ref()? {
                // Written straight from the memory read, not built first.
                crate::policy::SessionVal::Read(view) => {
                    view.encode_for_guard(guard_batch::SESSION, &mut bytes);
                }
                crate::policy::SessionVal::Unavailable(why) => {
                    let memory = guardmesh_proto::v1::SessionMemory {
                        unavailable: why.to_string(),
                        ..Default::default()
                    };
                    write::message(guard_batch::SESSION, &memory, &mut bytes);
                }
            }
            self.memory = Some(Bytes::from(bytes));
        }
        self.memory.clone()
    }

    fn shared_calls(&mut self, g: usize) -> Bytes {
        let sent = &self.runs[g].sent;
        if let Some((_, bytes)) = self.encoded.iter().find(|(set, _)| set == sent) {
            return bytes.clone();
        }
        if let Phase::Results(batch) = &self.phase {
            let bytes = results::shared_part(
                self.context.as_ref(),
                batch,
                self.calls
                    .iter()
                    .zip(sent)
                    .enumerate()
                    .filter(|(_, (_, sent))| **sent)
                    .map(|(i, (call, _))| (i, call.current())),
            );
            self.encoded.push((sent.clone(), bytes.clone()));
            return bytes;
        }
        let bytes = crate::wire::judge_stream::shared_part(
            self.context.as_ref(),
            self.calls
                .iter()
                .zip(sent)
                .filter(|(_, sent)| **sent)
                .map(|(call, _)| call.current()),
        );
        self.encoded.push((sent.clone(), bytes.clone()));
        bytes
    }

    /// The time guard `g` gets: its timeout within what is left of the
    /// batch's deadline (R14).
    fn budget(&self, guard: &Guard, now: Instant) -> Duration {
        guard
            .timeout
            .min(self.deadline.saturating_duration_since(now))
    }

    fn send(
        &mut self,
        g: usize,
        tag: usize,
        events: &mpsc::UnboundedSender<LinkEvent>,
        now: Instant,
    ) -> Result<Instant, NotSent> {
        let chain = self.chain;
        let ChainGuard { guard, link } = &chain.guards[g];
        let Some(link) = link else {
            return Err(GuardFailure::StreamClosed.into());
        };
        let budget = self.budget(guard, now);
        let run = &mut self.runs[g];
        run.started = Some(now);
        let named = span_guard(guard);
        let guardrail = crate::observe::spans::guardrail_span(
            &self.span,
            &named,
            self.context.as_ref().map_or("", |c| c.session_id.as_str()),
            run.sent.iter().filter(|s| **s).count(),
        );
        let span = crate::observe::spans::judge_span(&guardrail, &named);
        run.guardrail = Some(guardrail);
        // R22: the guard's span is parented on this guard's client span.
        let traceparent = guardmesh_client::trace::span_traceparent(&span)
            .unwrap_or_else(|| self.trace.traceparent.clone());
        run.span = Some(span);
        if budget.is_zero() {
            return Err(GuardFailure::TimedOut(Duration::ZERO).into());
        }
        let batch = GuardBatch {
            session: None,
            request_id: 0,
            batch_id: self.request.batch_id.clone(),
            guard: guard.name.clone(),
            context: None,
            calls: Vec::new(),
            deadline_ms: u32::try_from(budget.as_millis()).unwrap_or(u32::MAX),
            traceparent,
            tracestate: self.trace.tracestate.clone(),
            results: Vec::new(),
        };
        let shared = self.shared_part(g);
        // A guard that takes nothing off its stream for its own timeout is
        // not reading (a failure); one that is slow but takes requests is
        // busy, and the batch is shed (R25).
        let id = link.send(
            batch,
            shared,
            tag,
            events,
            self.trace.client,
            guard.timeout,
            now + budget,
        )?;
        self.runs[g].request_id = Some(id);
        Ok(now + budget)
    }

    /// Guard `g`'s link had no room for this batch while the guard was
    /// making progress (R25): the batch is shed whole with
    /// `RESOURCE_EXHAUSTED` to its own client. No call is decided, so no
    /// load turns into a cancel; the requests already out to other guards
    /// are withdrawn, and no circuit hears of it.
    fn shed(&mut self, g: usize, busy: LinkBusy) -> BatchError {
        let guard = &self.chain.guards[g].guard;
        tracing::warn!(
            guard = %guard.name,
            batch_id = %self.request.batch_id,
            trace_id = %self.trace.trace_id,
            error = %busy,
            "batch shed: guard busy"
        );
        let error = BatchError::Shed {
            guard: guard.name.clone(),
            busy,
        };
        // Not sent: neither a failure nor an outcome of that guard.
        self.runs[g].sent_any = false;
        for (run, ChainGuard { link, .. }) in self.runs.iter_mut().zip(&self.chain.guards) {
            if run.finished.is_some() {
                continue;
            }
            if let (Some(id), Some(link)) = (run.request_id, link) {
                let _ = link.cancel(id);
                run.superseded = true;
            }
        }
        error
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

    /// Consults mutate guard `g` and applies what it says (R10, R11, R12).
    /// Its verdicts and its failure go through a one-guard [`Fold`], so the
    /// failure policy (R13) is applied exactly as for validate guards.
    async fn mutate(&mut self, g: usize) -> Result<(), BatchError> {
        let sent = self.select(g);
        if !sent.contains(&true) {
            return Ok(());
        }
        self.runs[g].sent_any = true;
        self.runs[g].sent = sent;
        let mut fold = self.fold_of(&[g]);
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let now = Instant::now();
        // Verdicts arrive in one final answer or in partial ones; a guard
        // that fails after partial answers keeps the skips it sent.
        let mut verdicts = Vec::new();
        let failure = match self.send(g, 0, &events_tx, now) {
            Err(NotSent::Busy(busy)) => return Err(self.shed(g, busy)),
            Err(NotSent::Failed(failure)) => Some(failure),
            Ok(guard_deadline) => loop {
                tokio::select! {
                    event = events.recv() => match event {
                        Some(LinkEvent::Answer { response, replica, .. }) if !response.error.is_empty() => {
                            self.runs[g].replica = Some(replica);
                            break Some(GuardFailure::Refused(response.error));
                        }
                        Some(LinkEvent::Answer { response, replica, .. }) => {
                            self.runs[g].replica = Some(replica);
                            verdicts.extend(response.verdicts);
                            if !response.partial {
                                break None;
                            }
                        }
                        Some(LinkEvent::Failed { failure, replica, .. }) => {
                            self.runs[g].replica = Some(replica);
                            break Some(failure);
                        }
                        None => break Some(GuardFailure::StreamClosed),
                    },
                    () = tokio::time::sleep_until(guard_deadline) => {
                        break Some(GuardFailure::TimedOut(guard_deadline - now));
                    }
                }
            },
        };
        self.runs[g].finished = Some(Instant::now());
        // A guard that answered in full is healthy, even when its answer is
        // then rejected (R11): that is a policy bug, not an outage.
        let answered = failure.is_none();
        if answered && let Some(link) = &self.chain.guards[g].link {
            link.record(self.runs[g].replica.as_deref(), Ok(()));
        }
        let chain = self.chain;
        let guard = &chain.guards[g].guard;
        let run = &mut self.runs[g];
        let checked = check_verdicts_in(
            self.phase.is_results(),
            guard,
            self.limits,
            |i| self.calls[i].current(),
            &self.index_of,
            &run.sent,
            &mut run.answered,
            verdicts,
        );
        let failure = match checked {
            Ok(checked) => {
                run.add_labels(checked.labels, checked.refused_labels);
                run.malformed = checked.malformed;
                run.skipped = checked.skips.iter().map(|(i, _)| *i).collect();
                run.skip_kinds = checked.skips.iter().map(|(_, s)| s.kind).collect();
                for (i, skip) in checked.skips {
                    fold.answer(0, i, Some(skip));
                }
                // The rewrites of a guard that failed before its final
                // answer are not applied: a rewrite stands only as part of
                // a whole, final answer. A dry-run guard's never do (R18).
                if answered {
                    run.rewritten = checked.rewrites.iter().map(|(i, _)| *i).collect();
                    if guard.enforced() {
                        if !checked.rewrites.is_empty() {
                            self.encoded.clear();
                        }
                        for (i, call) in checked.rewrites {
                            self.calls[i].rewritten = Some(call);
                            self.calls[i].rewritten_by.push(guard.name.clone());
                        }
                    }
                }
                failure
            }
            Err(rejection) => Some(GuardFailure::RejectedRewrite(rejection.to_string())),
        };
        match failure {
            None => fold.complete(0),
            Some(failure) => self.guard_failed(g, failure, !answered, &mut fold, 0),
        }
        self.apply(&[g], &mut fold)
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
        let guard = |k: usize| &chain.guards[order[k]].guard;
        for (call, outcome) in self.calls.iter_mut().zip(outcomes) {
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

    /// Consults the validate guards concurrently and folds their verdicts
    /// as if in chain order (R3, R4, R5).
    async fn validate(&mut self) -> Result<(), BatchError> {
        let order: Vec<usize> = (0..self.chain.guards.len())
            .filter(|&g| self.chain.guards[g].guard.role == GuardRole::Validate)
            .collect();
        if order.is_empty() {
            return Ok(());
        }
        for &g in &order {
            let sent = self.select(g);
            self.runs[g].sent_any = sent.contains(&true);
            self.runs[g].sent = sent;
        }
        let mut fold = self.fold_of(&order);
        // The remote guards' answers, on a channel made when one is sent to.
        let mut channel = None;
        let mut deadlines: Vec<Option<Instant>> = vec![None; order.len()];
        let now = Instant::now();
        for (k, &g) in order.iter().enumerate() {
            if !self.runs[g].sent_any || self.chain.guards[g].guard.is_policy() {
                continue;
            }
            let (events_tx, _) = channel.get_or_insert_with(mpsc::unbounded_channel);
            match self.send(g, k, events_tx, now) {
                Ok(at) => deadlines[k] = Some(at),
                Err(NotSent::Busy(busy)) => return Err(self.shed(g, busy)),
                Err(NotSent::Failed(failure)) => {
                    self.guard_failed(g, failure, false, &mut fold, k);
                }
            }
        }
        // Policy guards (R27) answer at once, in the mesh, through the same
        // fold as remote guards, once the remote ones are on their way.
        let policies: Vec<usize> = (0..order.len())
            .filter(|&k| {
                let g = order[k];
                self.runs[g].sent_any && self.chain.guards[g].guard.is_policy()
            })
            .collect();
        if !policies.is_empty() {
            for (k, started, outcomes) in self.evaluate_policies(&order, &policies).await? {
                let order = order.as_slice();
                self.judge_policy(outcomes, started, order, k, &mut fold, &mut deadlines);
            }
        }
        if !fold.done() {
            let events = &mut channel.get_or_insert_with(mpsc::unbounded_channel).1;
            self.collect(&order, events, &mut fold, &mut deadlines, now)
                .await;
        }
        // R5: what is still out can no longer change a decision.
        for (k, &g) in order.iter().enumerate() {
            if deadlines[k].is_some() && fold.pending(k) {
                if let Some(id) = self.runs[g].request_id
                    && let Some(link) = &self.chain.guards[g].link
                {
                    let _ = link.cancel(id);
                }
                self.runs[g].superseded = true;
            }
        }
        self.apply(&order, &mut fold)
    }

    /// Waits for the remote guards' answers (and their deadlines) until
    /// the fold is done: only when something is still out after the policy
    /// guards answered.
    async fn collect(
        &mut self,
        order: &[usize],
        events: &mut mpsc::UnboundedReceiver<LinkEvent>,
        fold: &mut Fold,
        deadlines: &mut [Option<Instant>],
        now: Instant,
    ) {
        // One timer for the batch, moved only when the earliest deadline
        // changes (a guard that answered no longer has one): not a timer
        // registered and dropped per answer.
        let mut armed = deadlines.iter().flatten().min().copied();
        let timer = tokio::time::sleep_until(armed.unwrap_or(now));
        tokio::pin!(timer);
        while !fold.done() {
            let next_deadline = deadlines.iter().flatten().min().copied();
            let event = match next_deadline {
                Some(at) => {
                    if armed != Some(at) {
                        timer.as_mut().reset(at);
                        armed = Some(at);
                    }
                    tokio::select! {
                        event = events.recv() => event,
                        () = &mut timer => None,
                    }
                }
                None => events.recv().await,
            };
            match event {
                Some(LinkEvent::Answer {
                    tag: k,
                    response,
                    replica,
                }) => {
                    self.runs[order[k]].replica = Some(replica);
                    self.on_answer(order, k, response, fold, deadlines);
                }
                Some(LinkEvent::Failed {
                    tag: k,
                    failure,
                    replica,
                }) => {
                    self.runs[order[k]].replica = Some(replica);
                    deadlines[k] = None;
                    self.guard_failed(order[k], failure, false, fold, k);
                }
                None => {
                    let now = Instant::now();
                    for k in 0..order.len() {
                        if let Some(at) = deadlines[k]
                            && at <= now
                        {
                            let g = order[k];
                            deadlines[k] = None;
                            let waited = at - self.runs[g].started.unwrap_or(at);
                            let failure = GuardFailure::TimedOut(waited);
                            self.guard_failed(g, failure, true, fold, k);
                        }
                    }
                }
            }
        }
    }

    fn on_answer(
        &mut self,
        order: &[usize],
        k: usize,
        response: JudgeResponse,
        fold: &mut Fold,
        deadlines: &mut [Option<Instant>],
    ) {
        let g = order[k];
        let chain = self.chain;
        let guard = &chain.guards[g].guard;
        if !response.error.is_empty() {
            deadlines[k] = None;
            let failure = GuardFailure::Refused(response.error);
            self.guard_failed(g, failure, response.partial, fold, k);
            return;
        }
        let final_answer = !response.partial;
        let run = &mut self.runs[g];
        match check_verdicts_in(
            self.phase.is_results(),
            guard,
            self.limits,
            |i| self.calls[i].current(),
            &self.index_of,
            &run.sent,
            &mut run.answered,
            response.verdicts,
        ) {
            Ok(checked) => {
                run.add_labels(checked.labels, checked.refused_labels);
                for i in checked.proceeds {
                    fold.answer(k, i, None);
                }
                for (i, skip) in checked.skips {
                    run.skipped.push(i);
                    run.skip_kinds.push(skip.kind);
                    fold.answer(k, i, Some(skip));
                }
                run.malformed.extend(checked.malformed);
                if final_answer {
                    deadlines[k] = None;
                    run.finished = Some(Instant::now());
                    fold.complete(k);
                    if let Some(link) = &self.chain.guards[g].link {
                        link.record(run.replica.as_deref(), Ok(()));
                    }
                }
            }
            Err(reason) => {
                // R11: a validate guard may not rewrite; the whole answer is
                // rejected and the guard fails per its policy.
                deadlines[k] = None;
                let failure = GuardFailure::RejectedRewrite(reason.to_string());
                self.guard_failed(g, failure, !final_answer, fold, k);
            }
        }
    }

    /// Judges the calls policy guard `order[k]` was sent with its rules
    /// (R27), folding its verdicts as a remote guard's answer is folded
    /// (R3, R4) but without the round trip through verdict messages: the
    /// outcomes are per call index, so no call id is looked up. A call whose
    /// evaluation failed is left unanswered and the guard fails through
    /// [`Self::guard_failed`], so its failure policy (R13) applies to
    /// exactly those calls: never a proceed.
    fn judge_policy(
        &mut self,
        outcomes: Vec<PolicyOutcome>,
        started: Instant,
        order: &[usize],
        k: usize,
        fold: &mut Fold,
        deadlines: &mut [Option<Instant>],
    ) {
        let g = order[k];
        let run = &mut self.runs[g];
        run.started = Some(started);
        run.guardrail = Some(crate::observe::spans::guardrail_span(
            &self.span,
            &span_guard(&self.chain.guards[g].guard),
            self.context.as_ref().map_or("", |c| c.session_id.as_str()),
            run.sent.iter().filter(|s| **s).count(),
        ));
        let mut error = None;
        let mut timed_out = false;
        for (i, outcome) in outcomes.into_iter().enumerate() {
            if !run.sent.get(i).copied().unwrap_or(false) {
                continue;
            }
            let matched = match outcome {
                PolicyOutcome::Proceed => {
                    run.answered[i] = true;
                    fold.answer(k, i, None);
                    None
                }
                // R13: over a bound because of its own content, the call is
                // steered naming the bound, whatever the failure policy.
                PolicyOutcome::Matched(matched) | PolicyOutcome::Bounded(matched) => Some(matched),
                // A rule failed and a later one matched: the guard fails,
                // and the later rule's verdict stands (R27).
                PolicyOutcome::FailedThen(failed, matched) => {
                    error.get_or_insert(failed);
                    Some(matched)
                }
                PolicyOutcome::Error(failed) => {
                    run.rules.push((i, failed.rule().to_owned()));
                    error.get_or_insert(failed);
                    None
                }
                // R14: left unanswered; the guard timed out.
                PolicyOutcome::TimedOut => {
                    timed_out = true;
                    None
                }
            };
            match matched {
                None => {}
                Some(matched) => {
                    // A blank message would read as a malformed skip (R8),
                    // that is a proceed: the rule's name stands in for it.
                    let content = if matched.message.trim().is_empty() {
                        format!("Tool call blocked by policy rule {:?}.", matched.rule)
                    } else {
                        matched.message
                    };
                    let kind = match matched.action {
                        crate::policy::Action::Steer => SkipKind::Steer,
                        crate::policy::Action::Cancel => SkipKind::Cancel,
                    } as i32;
                    run.answered[i] = true;
                    run.add_labels(matched.labels.to_vec(), 0);
                    run.rules.push((i, matched.rule));
                    run.skipped.push(i);
                    run.skip_kinds.push(kind);
                    fold.answer(k, i, Some(Skip { content, kind }));
                }
            }
        }
        deadlines[k] = None;
        if timed_out {
            let waited = started.elapsed();
            self.guard_failed(g, GuardFailure::TimedOut(waited), false, fold, k);
            return;
        }
        match error {
            None => {
                run.finished = Some(Instant::now());
                fold.complete(k);
            }
            Some(failed) => {
                self.guard_failed(g, GuardFailure::Policy(failed.to_string()), false, fold, k);
            }
        }
    }

    /// Evaluates the policy guards at `policies` (positions in `order`)
    /// for the calls each was sent, on the batch as it stands after the
    /// mutate guards, each guard within its timeout and the batch's
    /// deadline (R14), in its lane (`policy::pool`): here, when the
    /// batch's work stays within the inline bound (the meter stops it
    /// there otherwise), else on the pool, off the runtime's threads, in
    /// this client's turn. The calls move to the evaluation thread and back
    /// (no copy). A batch that gets no thread before the first of its
    /// policy guards' time is up, or whose client has its share of batches
    /// waiting, is shed (R25).
    async fn evaluate_policies(
        &mut self,
        order: &[usize],
        policies: &[usize],
    ) -> Result<Vec<(usize, Instant, Vec<PolicyOutcome>)>, BatchError> {
        let now = Instant::now();
        let jobs: Vec<PolicyJob> = policies
            .iter()
            .filter_map(|&k| {
                let g = order[k];
                let guard = &self.chain.guards[g].guard;
                let rules = guard.policy.as_ref()?;
                Some(PolicyJob {
                    k,
                    policy: Arc::clone(&rules.compiled),
                    sent: self.runs[g].sent.clone(),
                    until: now + self.budget(guard, now),
                })
            })
            .collect();
        if self.inline_bytes() <= crate::policy::pool::INLINE_BYTES
            && let Some(_slot) = crate::policy::pool::inline_slot()
        {
            let mut inline = crate::policy::pool::INLINE;
            let values = batch_values(
                &self.calls,
                &self.members,
                self.context.as_ref(),
                &jobs,
                self.session.as_ref(),
            );
            let judged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                evaluate_jobs(&values, &jobs, Some(&mut inline))
            }));
            match judged {
                Ok(Ok(outcomes)) => return Ok(outcomes),
                Ok(Err(crate::policy::OverInline)) => {}
                Err(_) => return Ok(panicked(&jobs, now)),
            }
        }
        // Waiting for a thread is load, not evaluation: a batch still
        // waiting when the first of its policy guards' time is up is shed
        // (R25), as is one whose client has its share waiting already; no
        // guard failed, and no call is cancelled for it.
        let Some(first) = jobs.iter().min_by_key(|job| job.until) else {
            return Ok(Vec::new());
        };
        let lane = match crate::policy::pool::lane(self.trace.client, first.until).await {
            Ok(lane) => lane,
            Err(wait) => {
                let guard = self.chain.guards[order[first.k]].guard.name.clone();
                return Err(self.shed_policy(guard, wait));
            }
        };
        let work = PolicyWork {
            calls: std::mem::take(&mut self.calls),
            members: std::mem::take(&mut self.members),
            context: self.context.take(),
            jobs,
            session: self.session.clone(),
        };
        let first = work.jobs.first().map(|job| job.k);
        match lane.run(move || work.evaluate()).await {
            Ok((work, outcomes)) => {
                self.calls = work.calls;
                self.members = work.members;
                self.context = work.context;
                match outcomes {
                    Some(outcomes) => Ok(outcomes),
                    // A panic in evaluation: every policy guard fails (R13).
                    None => Ok(panicked(&work.jobs, now)),
                }
            }
            // The calls went with the work: the batch cannot be decided.
            Err(interrupted) => Err(BatchError::Aborted {
                guard: first
                    .map(|k| self.chain.guards[order[k]].guard.name.clone())
                    .unwrap_or_default(),
                failure: GuardFailure::Policy(interrupted.to_string()),
            }),
        }
    }

    /// The bytes building the batch's policy values reads: the calls' ids,
    /// tools and arguments as they stand, and the context's text.
    fn inline_bytes(&self) -> usize {
        let calls: usize = self
            .calls
            .iter()
            .map(|call| {
                let call = call.current();
                call.call_id.len() + call.tool.len() + call.arguments.len()
            })
            .sum();
        let context = self.context.as_ref().map_or(0, |c| {
            c.session_id.len()
                + c.model_text.len()
                + c.metadata
                    .iter()
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>()
        });
        calls + context
    }

    /// No thread of the policy pool for this batch (R25): the batch
    /// is shed whole with `RESOURCE_EXHAUSTED` to its own client, nothing is
    /// decided, no guard failed, and the requests already out to remote
    /// guards are withdrawn.
    fn shed_policy(&mut self, guard: String, wait: crate::policy::pool::Wait) -> BatchError {
        tracing::warn!(
            guard = %guard,
            batch_id = %self.request.batch_id,
            trace_id = %self.trace.trace_id,
            error = %wait,
            "batch shed: policy evaluation busy"
        );
        for (run, ChainGuard { link, .. }) in self.runs.iter_mut().zip(&self.chain.guards) {
            if run.finished.is_some() {
                continue;
            }
            if let (Some(id), Some(link)) = (run.request_id, link) {
                let _ = link.cancel(id);
                run.superseded = true;
            }
        }
        BatchError::PolicyBusy { guard, wait }
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
                .any(|(cg, run)| cg.guard.enforced() && run.sent.get(i) == Some(&true));
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
            };
            match call.fixed {
                None => execute.push(current.clone()),
                Some(fixed) => {
                    decision.action = match fixed.kind {
                        SkipKind::Steer => Action::Steer,
                        SkipKind::Cancel => Action::Cancel,
                    } as i32;
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

/// One policy guard's evaluation of a batch, in the policy lane.
struct PolicyJob {
    /// Its position in the validate fold.
    k: usize,
    policy: Arc<crate::policy::Policy>,
    /// The calls it was sent.
    sent: Vec<bool>,
    /// Its timeout within the batch's deadline (R14).
    until: Instant,
}

/// What a batch's policy guards read, moved to an evaluation thread and
/// back.
struct PolicyWork {
    calls: Vec<Call>,
    members: Recorded,
    context: Option<BatchContext>,
    jobs: Vec<PolicyJob>,
    session: Option<crate::policy::SessionVal>,
}

type PolicyOutcomes = Vec<(usize, Instant, Vec<PolicyOutcome>)>;

impl PolicyWork {
    /// Evaluates every job, and gives the work back; `None` for the
    /// outcomes if evaluation panicked.
    fn evaluate(self) -> (Self, Option<PolicyOutcomes>) {
        let outcomes =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.evaluate_all())).ok();
        (self, outcomes)
    }

    /// The batch's CEL values are built once, straight from the calls'
    /// JSON text, and shared by all the policies.
    fn evaluate_all(&self) -> PolicyOutcomes {
        let values = batch_values(
            &self.calls,
            &self.members,
            self.context.as_ref(),
            &self.jobs,
            self.session.as_ref(),
        );
        evaluate_jobs(&values, &self.jobs, None)
            .unwrap_or_else(|crate::policy::OverInline| panicked(&self.jobs, Instant::now()))
    }
}

/// The values of a batch for its policy guards `jobs`, built once and
/// shared by them all.
fn batch_values<'a>(
    calls: &'a [Call],
    members: &'a Recorded,
    context: Option<&'a BatchContext>,
    jobs: &[PolicyJob],
    session: Option<&crate::policy::SessionVal>,
) -> BatchValues<'a> {
    // The calls' arguments are read for the fast path only if one of
    // these policies may read them.
    let args = jobs.iter().any(|job| job.policy.reads_args());
    let mut values = BatchValues::reading_args(
        args,
        ContextRef {
            session_id: context.map_or("", |c| c.session_id.as_str()),
            turn_index: context.map_or(0, |c| c.turn_index),
            model_text: context.map_or("", |c| c.model_text.as_str()),
        },
        context
            .into_iter()
            .flat_map(|c| c.metadata.iter())
            .map(|(k, v)| (k.as_str(), v.as_str())),
        // Arguments were checked as an I-JSON object (R20), rewrites
        // too; absent arguments are `{}`. Should text ever fail to parse
        // here, a rule reading it sees `null` and errors (a guard
        // failure, R13), never an empty object that would let it proceed.
        // A rewritten call's arguments are scanned; the others were
        // recorded by the check.
        calls.iter().enumerate().map(|(i, call)| CallRef {
            call_id: &call.current().call_id,
            tool: &call.current().tool,
            args: match (&call.rewritten, members.call(i), members.largest(i)) {
                (None, Some(members), _) => Args::Recorded {
                    text: &call.original.arguments,
                    members,
                },
                (None, None, Some(largest)) => Args::Counted {
                    text: &call.original.arguments,
                    largest,
                },
                _ => Args::Checked(&call.current().arguments),
            },
        }),
    );
    if let Some(session) = session {
        values.set_session(session.clone());
    }
    values
}

/// Judges every job on `values`; under `inline`, stops at its bound.
fn evaluate_jobs(
    values: &BatchValues<'_>,
    jobs: &[PolicyJob],
    mut inline: Option<&mut crate::policy::Inline>,
) -> Result<PolicyOutcomes, crate::policy::OverInline> {
    jobs.iter()
        .map(|job| {
            let started = Instant::now();
            let deadline = Some(job.until.into_std());
            let outcomes = match inline.as_deref_mut() {
                Some(inline) => {
                    job.policy
                        .evaluate_inline(values, Some(&job.sent), deadline, inline)?
                }
                None => job
                    .policy
                    .evaluate_within(values, Some(&job.sent), deadline),
            };
            Ok((job.k, started, outcomes))
        })
        .collect()
}

/// Every policy guard of `jobs` failed on every call it was sent: its
/// evaluation panicked (R13).
fn panicked(jobs: &[PolicyJob], at: Instant) -> PolicyOutcomes {
    jobs.iter()
        .map(|job| {
            let outcomes = job
                .sent
                .iter()
                .map(|_| {
                    PolicyOutcome::Error(crate::policy::EvalError::Failed {
                        rule: String::new(),
                        field: crate::policy::Field::When,
                        reason: "the evaluation panicked".into(),
                    })
                })
                .collect();
            (job.k, at, outcomes)
        })
        .collect()
}

/// Guard `run`'s trace entry (R21); `ids` are the batch's call ids.
fn trace_entry(guard: &Guard, run: &GuardRun, ids: &[&str]) -> GuardTrace {
    let status = run.status();
    let reported = reported_status(guard, run);
    let pick =
        |indices: &mut dyn Iterator<Item = usize>| indices.map(|i| ids[i].to_owned()).collect();
    GuardTrace {
        guard: guard.name.clone(),
        role: guard.role as i32,
        status: reported as i32,
        latency_us: run
            .latency()
            .map_or(0, |l| u64::try_from(l.as_micros()).unwrap_or(u64::MAX)),
        sent_call_ids: pick(
            &mut run
                .sent
                .iter()
                .enumerate()
                .filter(|(_, s)| **s)
                .map(|(i, _)| i),
        ),
        skipped_call_ids: pick(&mut run.skipped.iter().copied()),
        rewritten_call_ids: pick(&mut run.rewritten.iter().copied()),
        error: error_text(run),
        dry_run_status: if reported == TraceStatus::DryRun {
            status as i32
        } else {
            TraceStatus::Unspecified as i32
        },
        rules: run
            .rules
            .iter()
            .map(|(i, rule)| (ids[*i].to_owned(), rule.clone()))
            .collect(),
        replica: run.replica.as_deref().unwrap_or_default().to_owned(),
        labels: if guard.enforced() {
            run.applied_labels(guard).to_vec()
        } else {
            run.labels.clone()
        },
        refused_labels: u32::try_from(run.refused_labels).unwrap_or(u32::MAX),
    }
}

/// The error a guard's trace entry and span show: its failure, else why
/// verdicts were dropped (R8), else nothing.
pub(crate) fn error_text(run: &GuardRun) -> String {
    match &run.failure {
        Some(failure) => failure.to_string(),
        None if run.malformed.is_empty() => String::new(),
        None => run
            .malformed
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// The status a guard's trace entry shows: a dry-run guard's is `dry_run`
/// unless it was sent nothing (R18).
pub(crate) fn reported_status(guard: &Guard, run: &GuardRun) -> TraceStatus {
    let status = run.status();
    if guard.enforced() || status == TraceStatus::NotApplicable {
        status
    } else {
        TraceStatus::DryRun
    }
}

/// A guard as its spans name it.
pub(crate) fn span_guard(guard: &Guard) -> SpanGuard<'_> {
    SpanGuard {
        name: &guard.name,
        role: guard.role.name(),
        enforced: guard.enforced(),
        policy: guard.is_policy(),
        endpoint: if guard.endpoint.is_empty() {
            guard.replicas.first().map_or("", String::as_str)
        } else {
            &guard.endpoint
        },
        failure_policy: guard.failure_policy,
    }
}

/// A guard's failure as its spans name it: a low-cardinality kind, and the
/// gRPC code of the exchange (`None` when the exchange itself went through
/// and the answer was then refused).
pub(crate) fn span_failure(failure: &GuardFailure) -> SpanFailure {
    use crate::observe::spans::code_name;
    use tonic::Code;
    #[allow(unreachable_patterns)]
    let (kind, code) = match failure {
        GuardFailure::TimedOut(_) => ("timeout", Some(Code::DeadlineExceeded)),
        GuardFailure::Status { code, .. } => (code_name(*code), Some(*code)),
        GuardFailure::Refused(_) => ("refused", Some(Code::Unknown)),
        GuardFailure::Unreachable(_) => ("unreachable", Some(Code::Unavailable)),
        GuardFailure::StreamClosed => ("stream_closed", Some(Code::Unavailable)),
        GuardFailure::CircuitOpen { .. } => ("circuit_open", Some(Code::Unavailable)),
        GuardFailure::NotReading { .. } => ("not_reading", Some(Code::Unavailable)),
        GuardFailure::RejectedRewrite(_) => ("rejected_rewrite", None),
        GuardFailure::UnknownVerdictField(_) => ("unknown_verdict_field", None),
        GuardFailure::Policy(_) => ("policy_error", None),
        _ => ("_OTHER", Some(Code::Unknown)),
    };
    SpanFailure { kind, code }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{GuardMode, GuardSpec};
    use verdicts::{Malformed, Rejection};

    fn guard(mode: GuardMode) -> Guard {
        let spec = GuardSpec {
            name: "g".into(),
            endpoint: "127.0.0.1:9".into(),
            mode: mode as i32,
            ..Default::default()
        };
        Guard::from_spec(&spec, Duration::from_secs(1)).unwrap()
    }

    /// A run of a guard that was sent the first of two calls.
    fn run() -> GuardRun {
        let mut run = GuardRun::new(2);
        run.sent = vec![true, false];
        run.sent_any = true;
        let now = Instant::now();
        run.started = Some(now);
        run.finished = Some(now + Duration::from_micros(250));
        run
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

    #[test]
    fn r11_trace_entry_names_the_rejection() {
        let mut run = run();
        let rejection = Rejection::ArgumentsNotObject {
            call_id: "a".into(),
        };
        run.failure = Some(GuardFailure::RejectedRewrite(rejection.to_string()));
        let entry = trace_entry(&guard(GuardMode::Enforce), &run, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::RejectedRewrite as i32);
        assert!(entry.error.contains("not a JSON object"), "{}", entry.error);
        assert_eq!(entry.sent_call_ids, vec!["a".to_owned()]);
        assert_eq!(entry.latency_us, 250);
    }

    #[test]
    fn r8_trace_entry_lists_dropped_verdicts() {
        let mut run = run();
        run.malformed = vec![
            Malformed::BlankSkip {
                call_id: "a".into(),
            },
            Malformed::UnknownCall {
                call_id: "zz".into(),
            },
        ];
        let entry = trace_entry(&guard(GuardMode::Enforce), &run, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::Malformed as i32);
        assert_eq!(
            entry.error,
            format!("{}; {}", run.malformed[0], run.malformed[1]),
            "every dropped verdict is named, in order"
        );
        assert!(entry.error.contains("blank content"));
        assert!(entry.error.contains("\"zz\""));
    }

    #[test]
    fn r18_dry_run_trace_says_what_it_would_have_done() {
        let mut run = run();
        run.skipped = vec![0];
        let entry = trace_entry(&guard(GuardMode::DryRun), &run, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::DryRun as i32);
        assert_eq!(entry.dry_run_status, TraceStatus::Skipped as i32);
        assert_eq!(entry.skipped_call_ids, vec!["a".to_owned()]);
        let mut idle = GuardRun::new(2);
        idle.sent_any = false;
        let entry = trace_entry(&guard(GuardMode::DryRun), &idle, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::NotApplicable as i32);
        assert_eq!(entry.dry_run_status, TraceStatus::Unspecified as i32);
    }
}
