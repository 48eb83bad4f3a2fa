//! The policy guards (R27), judged in the mesh: each guard's rules
//! evaluated on the batch as it stands after the mutate guards, within its
//! timeout and the batch's deadline (R14), inline when the batch is small
//! or else in its client's turn on the policy pool's lanes
//! (`policy::pool`), a batch that gets no lane in time shed (R25); and the
//! outcomes folded as a remote guard's answer is (R3, R4, R13).

use super::fold::Fold;
use super::{BatchError, Call, Judging, span_guard};
use crate::link::GuardFailure;
use crate::policy::{Args, BatchValues, CallRef, ContextRef, Outcome as PolicyOutcome, Recorded};
use guardmesh_proto::v1::{BatchContext, Skip, SkipKind};
use std::sync::Arc;
use tokio::time::Instant;

impl Judging<'_> {
    /// Judges the calls policy guard `order[k]` was sent with its rules
    /// (R27), folding its verdicts as a remote guard's answer is folded
    /// (R3, R4) but without the round trip through verdict messages: the
    /// outcomes are per call index, so no call id is looked up. A call whose
    /// evaluation failed is left unanswered and the guard fails through
    /// [`Self::guard_failed`], so its failure policy (R13) applies to
    /// exactly those calls: never a proceed.
    pub(super) fn judge_policy(
        &mut self,
        outcomes: Vec<PolicyOutcome>,
        started: Instant,
        order: &[usize],
        k: usize,
        fold: &mut Fold,
        deadlines: &mut [Option<Instant>],
    ) {
        let g = order[k];
        let guard_name = &self.chain.guards[g].guard.name;
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
                    let mut content = if matched.message.trim().is_empty() {
                        format!("Tool call blocked by policy rule {:?}.", matched.rule)
                    } else {
                        matched.message
                    };
                    let kind = match matched.action {
                        crate::policy::Action::Steer => SkipKind::Steer,
                        crate::policy::Action::Cancel => SkipKind::Cancel,
                        // R35: the message is the approver's reason; the
                        // model reads that the call waits.
                        crate::policy::Action::Ask => {
                            let reason = std::mem::replace(
                                &mut content,
                                crate::approval::waiting_content(guard_name),
                            );
                            run.asked.push((i, crate::approval::record::clip(&reason)));
                            SkipKind::Cancel
                        }
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
    pub(super) async fn evaluate_policies(
        &mut self,
        order: &[usize],
        now: Instant,
    ) -> Result<Vec<(usize, Instant, Vec<PolicyOutcome>)>, BatchError> {
        // Borrowed from the guards' runs while judged here; owned only to
        // go to the pool.
        let jobs: Vec<Job<'_>> = order
            .iter()
            .enumerate()
            .filter_map(|(k, &g)| {
                let guard = &self.chain.guards[g].guard;
                let rules = guard.policy.as_ref()?;
                let run = &self.runs[g];
                run.sent_any.then(|| Job {
                    k,
                    policy: &rules.compiled,
                    sent: &run.sent,
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
                self.identity.as_ref(),
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
        let jobs: Vec<PolicyJob> = jobs.into_iter().map(Job::for_pool).collect();
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
            identity: self.identity.clone(),
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
                    None => {
                        let jobs: Vec<Job<'_>> = work.jobs.iter().map(PolicyJob::as_job).collect();
                        Ok(panicked(&jobs, now))
                    }
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
        self.withdraw_unfinished();
        BatchError::PolicyBusy { guard, wait }
    }
}

/// One policy guard's evaluation of a batch, in the policy lane.
#[derive(Clone, Copy)]
struct Job<'a> {
    /// Its position in the validate fold.
    k: usize,
    policy: &'a Arc<crate::policy::Policy>,
    /// The calls it was sent.
    sent: &'a [bool],
    /// Its timeout within the batch's deadline (R14).
    until: Instant,
}

impl Job<'_> {
    /// The job as it goes to an evaluation thread.
    fn for_pool(self) -> PolicyJob {
        PolicyJob {
            k: self.k,
            policy: Arc::clone(self.policy),
            sent: self.sent.to_vec(),
            until: self.until,
        }
    }
}

/// A [`Job`] of its own, moved to an evaluation thread and back.
struct PolicyJob {
    k: usize,
    policy: Arc<crate::policy::Policy>,
    sent: Vec<bool>,
    until: Instant,
}

impl PolicyJob {
    fn as_job(&self) -> Job<'_> {
        Job {
            k: self.k,
            policy: &self.policy,
            sent: &self.sent,
            until: self.until,
        }
    }
}

/// What a batch's policy guards read, moved to an evaluation thread and
/// back.
struct PolicyWork {
    calls: Vec<Call>,
    members: Recorded,
    context: Option<BatchContext>,
    jobs: Vec<PolicyJob>,
    session: Option<crate::policy::SessionVal>,
    identity: Option<crate::policy::SessionVal>,
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
        let jobs: Vec<Job<'_>> = self.jobs.iter().map(PolicyJob::as_job).collect();
        let values = batch_values(
            &self.calls,
            &self.members,
            self.context.as_ref(),
            &jobs,
            self.session.as_ref(),
            self.identity.as_ref(),
        );
        evaluate_jobs(&values, &jobs, None)
            .unwrap_or_else(|crate::policy::OverInline| panicked(&jobs, Instant::now()))
    }
}

/// The values of a batch for its policy guards `jobs`, built once and
/// shared by them all.
fn batch_values<'a>(
    calls: &'a [Call],
    members: &'a Recorded,
    context: Option<&'a BatchContext>,
    jobs: &[Job<'_>],
    session: Option<&crate::policy::SessionVal>,
    identity: Option<&crate::policy::SessionVal>,
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
    if let Some(identity) = identity {
        values.set_identity(identity.clone());
    }
    values
}

/// Judges every job on `values`; under `inline`, stops at its bound.
fn evaluate_jobs(
    values: &BatchValues<'_>,
    jobs: &[Job<'_>],
    mut inline: Option<&mut crate::policy::Inline>,
) -> Result<PolicyOutcomes, crate::policy::OverInline> {
    jobs.iter()
        .map(|job| {
            let started = Instant::now();
            let deadline = Some(job.until.into_std());
            let outcomes = match inline.as_deref_mut() {
                Some(inline) => {
                    job.policy
                        .evaluate_inline(values, Some(job.sent), deadline, inline)?
                }
                None => job.policy.evaluate_within(values, Some(job.sent), deadline),
            };
            Ok((job.k, started, outcomes))
        })
        .collect()
}

/// Every policy guard of `jobs` failed on every call it was sent: its
/// evaluation panicked (R13).
fn panicked(jobs: &[Job<'_>], at: Instant) -> PolicyOutcomes {
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
