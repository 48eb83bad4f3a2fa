//! What cannot be remembered is not passed (R34, R13): a decided batch
//! whose calls (or results) could not be written to their session's
//! memory fails per the failure policy of the guards that read sessions.
//! Applied after judging, before the batch's record is written, so that
//! the record, the metrics and the answer all hold the outcome.

use super::fold::{FoldGuard, OnFailure};
use super::guard_run::trace_entry;
use super::{BatchError, Chain, Judged};
use crate::link::GuardFailure;
use crate::registry::spec::Guard;
use guardmesh_proto::v1::Action;
use std::sync::Arc;

/// Whether `guard` reads session memory (R34): a policy guard one of
/// whose rules names `session`, or a remote guard that did not opt out of
/// being sent it.
fn reads_session(guard: &Guard) -> bool {
    guard
        .policy
        .as_ref()
        .is_some_and(|p| p.compiled.reads_session())
        || guard.wants_session_memory()
}

/// What the model reads instead of a call (or result) that cannot be
/// remembered, under guard `name`'s `fail_closed`.
fn content(name: &str, results: bool) -> String {
    if results {
        format!(
            "Tool result withheld: the session memory that guard {name} reads cannot record \
             this result now, so it cannot be checked later. Do not retry it now."
        )
    } else {
        format!(
            "Tool call blocked: the session memory that guard {name} reads cannot record this \
             call now, so it cannot be checked later. Do not retry it now."
        )
    }
}

/// The calls of `judged`'s decision marked in `affected` (results, when
/// `results`) could not be remembered in their session, because of
/// `why`. Each of them that proceeds fails per the failure policy of the
/// enforced guards of `chain` that read sessions, the strictest first
/// (R13): `abort` aborts the batch naming the guard; `fail_closed`
/// skips it as *cancel* with content naming the guard, marked as a
/// failure (a result is then blocked, an error result); `fail_open`
/// lets it through and records those guards as bypassed. The failure is
/// traced on the guards whose policy applied (status `failed`, the error
/// naming the session memory), logged and counted. A chain whose readers
/// all run in dry run is not changed.
pub(crate) fn unremembered(
    judged: &mut Judged,
    chain: &Chain,
    affected: &[bool],
    why: &str,
    results: bool,
) {
    let Ok(decision) = &mut judged.result else {
        return;
    };
    let hit: Vec<usize> = decision
        .decisions
        .iter()
        .enumerate()
        .filter(|(i, d)| affected.get(*i) == Some(&true) && d.action == Action::Proceed as i32)
        .map(|(i, _)| i)
        .collect();
    let readers: Vec<(usize, OnFailure)> = chain
        .guards
        .iter()
        .enumerate()
        .filter(|(_, g)| reads_session(&g.guard))
        .map(|(i, g)| {
            let policy = FoldGuard {
                enforced: g.guard.enforced(),
                policy: g.guard.failure_policy,
            };
            (i, policy.on_failure())
        })
        .filter(|(_, on)| *on != OnFailure::Ignore)
        .collect();
    if hit.is_empty() || readers.is_empty() {
        return;
    }
    let strictest = [OnFailure::Abort, OnFailure::Cancel]
        .into_iter()
        .find_map(|on| readers.iter().find(|(_, r)| *r == on).copied());
    let failure = GuardFailure::SessionMemory(Arc::from(why));
    let name = |g: usize| chain.guards[g].guard.name.clone();
    let failed: Vec<usize> = match strictest {
        Some((g, OnFailure::Abort)) => {
            tracing::warn!(
                guard = %chain.guards[g].guard.name,
                error = why,
                "session memory cannot remember what the batch let through: the batch is aborted (failure policy abort)"
            );
            judged.runs[g].failure.get_or_insert(failure.clone());
            judged.result = Err(BatchError::Aborted {
                guard: name(g),
                failure,
            });
            return;
        }
        Some((g, _)) => {
            let by = name(g);
            let text = content(&by, results);
            let mut cancelled = Vec::with_capacity(hit.len());
            for &i in &hit {
                let d = &mut decision.decisions[i];
                d.action = Action::Cancel as i32;
                d.content.clone_from(&text);
                d.decided_by.clone_from(&by);
                d.failure = true;
                cancelled.push(d.call_id.clone());
            }
            decision
                .execute
                .retain(|call| !cancelled.contains(&call.call_id));
            vec![g]
        }
        None => {
            for &i in &hit {
                let d = &mut decision.decisions[i];
                for (g, _) in &readers {
                    let name = &chain.guards[*g].guard.name;
                    if !d.bypassed.contains(name) {
                        d.bypassed.push(name.clone());
                    }
                }
            }
            readers.iter().map(|(g, _)| *g).collect()
        }
    };
    tracing::warn!(
        guards = ?failed.iter().map(|&g| chain.guards[g].guard.name.as_str()).collect::<Vec<_>>(),
        affected = hit.len(),
        failed_closed = strictest.is_some(),
        error = why,
        "session memory cannot remember what the batch let through: it is not passed \
         unless the guards that read it fail open"
    );
    let ids: Vec<&str> = decision
        .decisions
        .iter()
        .map(|d| d.call_id.as_str())
        .collect();
    for g in failed {
        let run = &mut judged.runs[g];
        run.failure.get_or_insert_with(|| failure.clone());
        decision.trace[g] = trace_entry(&chain.guards[g].guard, run, &ids);
    }
}
