//! Requests moved to another replica when theirs does not answer in time
//! (within a [`Budget`]), and the ejection of failed replicas with their
//! backoff, capped at half the replicas.

use super::super::GuardFailure;
use super::replica::{Ended, Prices, Replica};
use super::{Inner, State};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a failed replica is first ejected; doubled per consecutive
/// ejection up to [`EJECT_MAX`], reset by an answer.
pub const EJECT_INITIAL: Duration = Duration::from_millis(500);

/// The longest ejection.
pub const EJECT_MAX: Duration = Duration::from_secs(8);

/// A request that another replica could take if its own does not answer
/// in time gives that replica half the guard's time left, so that a
/// second attempt fits, but never less than this many of the replica's
/// latency estimate: a replica answering at its own pace is not cut off
/// (and a guard whose answers take most of its timeout is not split).
pub(super) const ATTEMPT_ESTIMATES: f64 = 3.0;

/// The budget of requests moved to another replica because theirs did not
/// answer in time ([`Budget`]): per window of this long, ...
pub(super) const BUDGET_WINDOW: Duration = Duration::from_secs(1);

/// ... this many, ...
pub(super) const BUDGET_MIN: u32 = 10;

/// ... and this share of the requests sent in the window.
pub(super) const BUDGET_RATIO: f64 = 0.2;

/// How many requests the pool moved to another replica because theirs did
/// not answer in time, against how many it sent, in the current window of
/// [`BUDGET_WINDOW`]: at most [`BUDGET_MIN`] plus [`BUDGET_RATIO`] of
/// them. Past it a request waits for its replica to the guard's time, so
/// a guard whose replicas all hang is not sent every batch twice. (Moves
/// after a replica *failed* are not counted: that replica has dropped the
/// request, nothing is sent twice to a live one.)
pub(super) struct Budget {
    pub(super) since: Instant,
    pub(super) sent: u32,
    pub(super) moved: u32,
}

impl Budget {
    pub(super) fn roll(&mut self, now: Instant) {
        if now.saturating_duration_since(self.since) >= BUDGET_WINDOW {
            *self = Budget {
                since: now,
                sent: 0,
                moved: 0,
            };
        }
    }

    pub(super) fn sent(&mut self, now: Instant) {
        self.roll(now);
        self.sent = self.sent.saturating_add(1);
    }

    pub(super) fn allows(&mut self, now: Instant) -> bool {
        self.roll(now);
        f64::from(self.moved) < f64::from(BUDGET_MIN) + f64::from(self.sent) * BUDGET_RATIO
    }

    pub(super) fn spend(&mut self, now: Instant) {
        self.roll(now);
        self.moved = self.moved.saturating_add(1);
    }
}

/// Moves the requests whose attempt ran out to another replica
/// ([`Inner::expire`]), then sleeps until the next attempt deadline or an
/// earlier one is set. Holds the pool weakly: it ends with it.
pub(super) async fn attempt_timer(inner: Weak<Inner>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(inner) = inner.upgrade() else {
                return;
            };
            inner.expire(Instant::now())
        };
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

impl Inner {
    /// When the attempt just sent to `replica` at `now`, of a request whose
    /// time ends `until` and which replicas `tried` already failed, gives
    /// up for another replica: `None` (it waits to `until`) when no other
    /// replica is available to take it, the budget of such moves is spent,
    /// or [`ATTEMPT_ESTIMATES`] of the replica's estimate leave no time for
    /// a second attempt.
    pub(super) fn attempt_deadline(
        &self,
        state: &mut State,
        replica: &Replica,
        tried: &[Arc<str>],
        now: Instant,
        until: Instant,
    ) -> Option<Instant> {
        let left = until.checked_duration_since(now)?;
        let another = state.live.iter().any(|r| {
            !std::ptr::eq(Arc::as_ptr(r), replica)
                && !tried.contains(&r.endpoint)
                && r.available(now)
        });
        if !another || !state.budget.allows(now) {
            return None;
        }
        let prices = Prices::of(&state.live);
        let estimate = replica.load().estimate(now, prices.default_for(replica));
        let attempt = (left / 2).max(Duration::from_nanos((estimate * ATTEMPT_ESTIMATES) as u64));
        (attempt < left).then(|| now + attempt)
    }

    /// Moves the requests whose attempt deadline is past at `now` to
    /// another replica ([`Self::attempt_timed_out`]); the next deadline.
    pub(super) fn expire(self: &Arc<Self>, now: Instant) -> Option<Instant> {
        let mut moved = Vec::new();
        let mut state = self.lock();
        while let Some(&(at, id)) = state.attempts.first() {
            if at > now {
                break;
            }
            state.attempts.pop_first();
            moved.extend(self.attempt_timed_out(&mut state, id, now));
        }
        self.expire_waits(&mut state, now);
        self.drain(&mut state, Some(now));
        self.gauges(&mut state);
        let attempt = state.attempts.first().map(|(at, _)| *at);
        let wait = state.waits.first().map(|(at, _)| *at);
        state.armed = match (attempt, wait) {
            (Some(a), Some(w)) => Some(a.min(w)),
            (a, w) => a.or(w),
        };
        let next = state.armed;
        drop(state);
        // The replicas they left, outside the lock.
        drop(moved);
        next
    }

    /// Request `id`'s replica has not answered by its attempt deadline
    /// (R32: "R13 applies only when no replica can judge in time"): it is
    /// sent to another replica not yet tried, within the budget, and only
    /// once; then withdrawn from the first, whose estimate rises to the
    /// time it waited, and which is ejected as a failed one is. A request
    /// with a partial answer stays (its verdicts are in the batch's fold),
    /// and so does one that no other replica takes: both wait for the
    /// guard's time. The replica it left, to be dropped outside the lock.
    pub(super) fn attempt_timed_out(
        self: &Arc<Self>,
        state: &mut State,
        id: u64,
        now: Instant,
    ) -> Option<Arc<Replica>> {
        let pending = state.requests.get_mut(&id)?;
        pending.attempt_until = None;
        if pending.partial || pending.moved_on_timeout || now >= pending.asked.until {
            return None;
        }
        let failed = pending.replica.clone();
        let mut tried = pending.tried.clone();
        tried.push(failed.endpoint.clone());
        let head = pending.asked.head.with_deadline(
            u32::try_from((pending.asked.until - now).as_millis().max(1)).unwrap_or(u32::MAX),
        );
        let (shared, client, stall) = (
            pending.asked.shared.clone(),
            pending.asked.client,
            pending.asked.stall,
        );
        if !state.budget.allows(now) {
            tracing::debug!(
                guard = %self.name,
                replica = %failed.endpoint,
                "no answer in time; the failover budget is spent: the request waits for the guard's time"
            );
            return None;
        }
        let (next, link_id, sent_at) = self
            .dispatch(state, id, &head, &shared, client, stall, &tried, now)
            .ok()?;
        state.budget.spend(now);
        let pending = state.requests.get_mut(&id)?;
        let old_link = std::mem::replace(&mut pending.link_id, link_id);
        let sent = std::mem::replace(&mut pending.sent_at, sent_at);
        let old = std::mem::replace(&mut pending.replica, next.clone());
        pending.tried = tried;
        pending.moved_on_timeout = true;
        failed.link.cancel(old_link);
        let left = failed.release(sent, id, now, Ended::Withdrawn, &Prices::of(&state.live));
        failed.series.outstanding(left);
        let waited = now.saturating_duration_since(sent);
        let failure = GuardFailure::TimedOut(waited);
        // The replica's circuit hears of it once per outage, as of a
        // replica that failed; the batch never does. A replica that
        // answered others meanwhile is busy, not hung (R25): neither
        // ejected nor told.
        if !failed.answered_since(sent) && self.eject(state, &failed, &failure, now) {
            failed.link.record(Err(&failure));
        }
        self.metrics.replica_failover(&self.name, &failed.endpoint);
        tracing::info!(
            guard = %self.name,
            from = %failed.endpoint,
            to = %next.endpoint,
            waited = ?waited,
            "request sent to another replica: no answer in time"
        );
        Some(old)
    }

    /// Ejects `replica` after `failure`: it gets no new requests for its
    /// backoff, unless no other replica can take them; but never more than
    /// half of the replicas at once (never all: Envoy's
    /// `max_ejection_percent` of 50), so one outage of several replicas
    /// leaves the others, and a replica past the cap stays in the choice,
    /// where the age of its unanswered requests prices it out.
    /// True when this is the first failure of an outage, which the
    /// replica's circuit hears of; the others within its backoff are not.
    pub(super) fn eject(
        &self,
        state: &State,
        replica: &Replica,
        failure: &GuardFailure,
        now: Instant,
    ) -> bool {
        if matches!(failure, GuardFailure::CircuitOpen { .. }) {
            return false;
        }
        let out = state
            .live
            .iter()
            .filter(|r| !std::ptr::eq(Arc::as_ptr(r), replica))
            .filter(|r| r.ejected_until().is_some_and(|until| until > now))
            .count();
        let cap = state.live.len() / 2;
        let mut ejection = replica
            .ejection
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // One outage is one ejection: the other requests it fails while
        // the replica is out extend nothing.
        if ejection.outage_until.is_some_and(|u| u > now) {
            return false;
        }
        let n = replica.ejections.fetch_add(1, Ordering::Relaxed);
        let period = EJECT_INITIAL
            .saturating_mul(1u32 << n.min(5))
            .min(EJECT_MAX);
        ejection.outage_until = Some(now + period);
        let ejected = out < cap;
        if ejected {
            ejection.until = Some(now + period);
        }
        drop(ejection);
        if ejected {
            tracing::warn!(
                guard = %self.name,
                replica = %replica.endpoint,
                error = %failure,
                ejected_for = ?period,
                "replica ejected"
            );
            self.metrics.replica_ejected(&self.name, &replica.endpoint);
        } else {
            tracing::warn!(
                guard = %self.name,
                replica = %replica.endpoint,
                error = %failure,
                ejected = out,
                replicas = state.live.len(),
                "replica failed; not ejected: at most half the replicas are at once"
            );
        }
        // A replica of a name that cannot be reached may have moved: the
        // name is resolved again (at most once a gap) rather than at the
        // next interval.
        let connection = matches!(
            failure,
            GuardFailure::Unreachable(_)
                | GuardFailure::StreamClosed
                | GuardFailure::Status {
                    code: tonic::Code::Unavailable,
                    ..
                }
        );
        if let (true, Some(name)) = (connection, &replica.registered) {
            let handle = self
                .resolvers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&**name)
                .cloned();
            if let Some(handle) = handle {
                handle.resolve_now();
            }
        }
        true
    }
}
