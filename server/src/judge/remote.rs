//! The guards judging consults over their links: the batch's parts
//! encoded once and sent to each remote guard (R22, R25, R34), mutate
//! guards one after another (R10, R11, R12), validate guards concurrently
//! through one fold with the policy guards (R3, R4, R5), and their answers,
//! failures and deadlines collected (R13, R14).

use super::fold::Fold;
use super::results_phase::{self, Phase};
use super::verdicts::{Checked, Rejection, check_verdicts_in};
use super::{BatchError, ChainGuard, Judging, span_guard};
use crate::link::events::{EventSender, Events, mailbox};
use crate::link::pool::Request;
use crate::link::{Busy, GuardFailure, LinkEvent, NotSent};
use crate::wire::fields::guard_batch;
use crate::wire::judge_stream::Head;
use crate::wire::write;
use guardmesh_proto::v1::{GuardRole, JudgeResponse, Verdict};
use prost::bytes::Bytes;
use std::time::Duration;
use tokio::time::Instant;

impl Judging<'_> {
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
            let bytes = results_phase::shared_part(
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

    fn send(
        &mut self,
        g: usize,
        tag: usize,
        events: &EventSender,
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
        let own_traceparent = guardmesh_client::trace::span_traceparent(&span);
        run.span = Some(span);
        if budget.is_zero() {
            return Err(GuardFailure::TimedOut(Duration::ZERO).into());
        }
        // Past the replicas' limits a request waits its turn among the
        // clients (R25): the caller's identity, or its connection, and the
        // session within it.
        let sender = *self.sender.get_or_insert_with(|| {
            crate::link::fair::Sender::of(
                self.trace.client,
                &self.trace.identity,
                self.context.as_ref().map_or("", |c| c.session_id.as_str()),
            )
        });
        // Written from the batch's own text: nothing of it is copied per
        // guard but these bytes.
        let head = Head::new(
            &self.request.batch_id,
            &guard.name,
            u32::try_from(budget.as_millis()).unwrap_or(u32::MAX),
            own_traceparent
                .as_deref()
                .unwrap_or(&self.trace.traceparent),
            &self.trace.tracestate,
        );
        let shared = self.shared_part(g);
        // A guard that takes nothing off its stream for its own timeout is
        // not reading (a failure); one that is slow but takes requests is
        // busy, and the batch is shed (R25).
        let id = link.send(Request {
            head,
            shared,
            tag,
            events: events.clone(),
            client: self.trace.client,
            sender,
            stall: guard.timeout,
            until: now + budget,
            at: now,
        })?;
        self.runs[g].request_id = Some(id);
        Ok(now + budget)
    }

    /// Guard `g`'s link had no room for this batch while the guard was
    /// making progress (R25): the batch is shed whole with
    /// `RESOURCE_EXHAUSTED` to its own client. No call is decided, so no
    /// load turns into a cancel; the requests already out to other guards
    /// are withdrawn, and no circuit hears of it.
    fn shed(&mut self, g: usize, busy: Busy) -> BatchError {
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
        self.withdraw_unfinished();
        error
    }

    /// Withdraws the requests still out to guards that have not finished:
    /// each is cancelled on its link and its guard marked superseded.
    pub(super) fn withdraw_unfinished(&mut self) {
        for (run, ChainGuard { link, .. }) in self.runs.iter_mut().zip(&self.chain.guards) {
            if run.finished.is_some() {
                continue;
            }
            if let (Some(id), Some(link)) = (run.request_id, link) {
                let _ = link.cancel(id);
                run.superseded = true;
            }
        }
    }

    /// Checks guard `g`'s `verdicts` against the calls it was sent (R8,
    /// R11), marking the calls they answer.
    fn check_verdicts(&mut self, g: usize, verdicts: Vec<Verdict>) -> Result<Checked, Rejection> {
        let guard = &self.chain.guards[g].guard;
        let run = &mut self.runs[g];
        check_verdicts_in(
            self.phase.is_results(),
            guard,
            self.limits,
            |i| self.calls[i].current(),
            &self.index_of,
            &run.sent,
            &mut run.answered,
            verdicts,
        )
    }

    /// Consults mutate guard `g` and applies what it says (R10, R11, R12).
    /// Its verdicts and its failure go through a one-guard [`Fold`], so the
    /// failure policy (R13) is applied exactly as for validate guards.
    pub(super) async fn mutate(&mut self, g: usize) -> Result<(), BatchError> {
        let mut sent = self.select(g);
        self.stand_in(g, &mut sent);
        if !sent.contains(&true) {
            return Ok(());
        }
        self.runs[g].send(sent);
        let mut fold = self.fold_of(&[g]);
        let (events_tx, mut events) = mailbox();
        let now = Instant::now();
        // Verdicts arrive in one final answer or in partial ones; a guard
        // that fails after partial answers keeps the skips it sent.
        let mut verdicts = Vec::new();
        // When the final answer was read; else when the guard failed.
        let mut finished = None;
        let failure = match self.send(g, 0, &events_tx, now) {
            Err(NotSent::Busy(busy)) => return Err(self.shed(g, busy.into())),
            Err(NotSent::NoRoom(busy)) => return Err(self.shed(g, busy.into())),
            Err(NotSent::Failed(failure)) => Some(failure),
            Ok(guard_deadline) => loop {
                tokio::select! {
                    event = events.recv() => match event {
                        LinkEvent::Answer { response, replica, .. } if !response.error.is_empty() => {
                            self.runs[g].replica = Some(replica);
                            break Some(GuardFailure::Refused(response.error));
                        }
                        LinkEvent::Answer { response, replica, answered, .. } => {
                            self.runs[g].replica = Some(replica);
                            verdicts.extend(response.verdicts);
                            if !response.partial {
                                finished = Some(answered);
                                break None;
                            }
                        }
                        LinkEvent::Failed { failure, replica, .. } => {
                            self.runs[g].replica = Some(replica);
                            break Some(failure);
                        }
                        // It waited for room and was shed (R25): the batch
                        // is refused, nothing decided.
                        LinkEvent::Shed { busy, .. } => {
                            self.runs[g].request_id = None;
                            return Err(self.shed(g, busy));
                        }
                    },
                    () = tokio::time::sleep_until(guard_deadline) => {
                        break Some(GuardFailure::TimedOut(guard_deadline - now));
                    }
                }
            },
        };
        self.runs[g].finished = Some(finished.unwrap_or_else(Instant::now));
        // A guard that answered in full is healthy, even when its answer is
        // then rejected (R11): that is a policy bug, not an outage. The
        // pool told its replica's circuit when the answer came.
        let answered = failure.is_none();
        let checked = self.check_verdicts(g, verdicts);
        let chain = self.chain;
        let guard = &chain.guards[g].guard;
        let run = &mut self.runs[g];
        let failure = match checked {
            Ok(checked) => {
                run.add_labels(checked.labels, checked.refused_labels);
                run.malformed = checked.malformed;
                run.skipped = checked.skips.iter().map(|(i, _)| *i).collect();
                run.skip_kinds = checked.skips.iter().map(|(_, s)| s.kind).collect();
                run.asked = checked.asks;
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

    /// Consults the validate guards concurrently and folds their verdicts
    /// as if in chain order (R3, R4, R5).
    pub(super) async fn validate(&mut self) -> Result<(), BatchError> {
        let order: Vec<usize> = (0..self.chain.guards.len())
            .filter(|&g| self.chain.guards[g].guard.role == GuardRole::Validate)
            .collect();
        if order.is_empty() {
            return Ok(());
        }
        for &g in &order {
            let mut sent = self.select(g);
            self.stand_in(g, &mut sent);
            self.runs[g].send(sent);
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
            let (events_tx, _) = channel.get_or_insert_with(mailbox);
            match self.send(g, k, events_tx, now) {
                Ok(at) => deadlines[k] = Some(at),
                Err(NotSent::Busy(busy)) => return Err(self.shed(g, busy.into())),
                Err(NotSent::NoRoom(busy)) => return Err(self.shed(g, busy.into())),
                Err(NotSent::Failed(failure)) => {
                    self.guard_failed(g, failure, false, &mut fold, k);
                }
            }
        }
        // Policy guards (R27) answer at once, in the mesh, through the same
        // fold as remote guards, once the remote ones are on their way.
        let policies = order
            .iter()
            .any(|&g| self.runs[g].sent_any && self.chain.guards[g].guard.is_policy());
        if policies {
            for (k, started, outcomes) in self.evaluate_policies(&order, now).await? {
                let order = order.as_slice();
                self.judge_policy(outcomes, started, order, k, &mut fold, &mut deadlines);
            }
        }
        if !fold.done() {
            let events = &mut channel.get_or_insert_with(mailbox).1;
            self.collect(&order, events, &mut fold, &mut deadlines, now)
                .await?;
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
        events: &mut Events,
        fold: &mut Fold,
        deadlines: &mut [Option<Instant>],
        now: Instant,
    ) -> Result<(), BatchError> {
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
                        event = events.recv() => Some(event),
                        () = &mut timer => None,
                    }
                }
                None => Some(events.recv().await),
            };
            match event {
                Some(LinkEvent::Answer {
                    tag: k,
                    response,
                    replica,
                    answered,
                }) => {
                    self.runs[order[k]].replica = Some(replica);
                    self.on_answer(order, k, response, answered, fold, deadlines);
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
                // It waited for room at that guard and was shed (R25): the
                // whole batch is refused with RESOURCE_EXHAUSTED.
                Some(LinkEvent::Shed { tag: k, busy, .. }) => {
                    self.runs[order[k]].request_id = None;
                    return Err(self.shed(order[k], busy));
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
        Ok(())
    }

    fn on_answer(
        &mut self,
        order: &[usize],
        k: usize,
        response: JudgeResponse,
        answered: Instant,
        fold: &mut Fold,
        deadlines: &mut [Option<Instant>],
    ) {
        let g = order[k];
        if !response.error.is_empty() {
            deadlines[k] = None;
            let failure = GuardFailure::Refused(response.error);
            self.guard_failed(g, failure, response.partial, fold, k);
            return;
        }
        let final_answer = !response.partial;
        let checked = self.check_verdicts(g, response.verdicts);
        let run = &mut self.runs[g];
        match checked {
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
                run.asked.extend(checked.asks);
                if final_answer {
                    deadlines[k] = None;
                    run.finished = Some(answered);
                    // The replica's circuit was told by the pool.
                    fold.complete(k);
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
}
