//! One replica of a guard's pool: its link, its ejection, its load and
//! latency estimate (peak-EWMA, decaying towards a default), and the price
//! the choice compares ([`Price`]).

use super::super::GuardLink;
use super::super::limit::Limit;
use crate::observe::metrics::{HeldSeries, ReplicaSeries};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// What a replica is priced at before any replica of its guard has
/// answered ([`Prices`]): a figure of the order of a guard's round trip,
/// never zero (a replica that never answered used to look the cheapest).
pub const DEFAULT_RTT: Duration = Duration::from_millis(30);

/// The time constant with which a latency estimate above its default
/// decays towards it ([`Load::estimate`]): a replica once slow is tried
/// again after a few of these, though nothing was sent to it meanwhile.
pub const DECAY: Duration = Duration::from_millis(500);

/// How far a replica's typical round trip moves towards each answer's.
pub(super) const TYPICAL_WEIGHT: f64 = 0.2;

/// How far the latency estimate moves towards an answer faster than it.
/// (A slower answer sets it at once: peak.)
pub(super) const EWMA_WEIGHT: f64 = 0.1;

/// Two replicas whose costs are within this factor of each other are a
/// tie for the choice ([`Price::cheaper_than`]).
pub(super) const COST_TIE: f64 = 2.0;

/// The least latency estimate, in nanoseconds: a cost is never zero.
pub(super) const MIN_ESTIMATE: f64 = 1_000.0;

pub(super) use crate::link::limit::nanos;

/// One replica: its link and its load.
pub(super) struct Replica {
    pub(super) endpoint: Arc<str>,
    /// The registered name it was found from ([`ReplicaTarget::registered`](super::super::discover::ReplicaTarget::registered)).
    pub(super) registered: Option<Arc<str>>,
    pub(super) link: GuardLink,
    /// Consecutive outages (for the backoff), reset by an answer.
    pub(super) ejections: AtomicU32,
    /// Its ejection and its outage. A leaf lock.
    pub(super) ejection: Mutex<Ejection>,
    /// Its requests in flight and its latency estimate. A leaf lock.
    pub(super) load: Mutex<Load>,
    /// Its metric series, looked up once when it joined.
    pub(super) series: ReplicaSeries,
    /// The requests its guard's replicas hold together (a count of the
    /// pool's, shared by its replicas).
    pub(super) guard_held: HeldSeries,
    /// Its limit as last published, read without the lock to sum the
    /// guard's ([`Inner::gauges`](super::Inner::gauges)).
    pub(super) published_limit: AtomicUsize,
    /// [`Load::estimate`] as last set, in nanoseconds (f64 bits; 0 before
    /// its first answer): read without the lock to price the other
    /// replicas ([`Prices`]).
    pub(super) estimate: AtomicU64,
}

/// A replica's ejection ([`Inner::eject`](super::Inner::eject)).
#[derive(Debug, Default)]
pub(super) struct Ejection {
    /// Until when it gets no new requests, unless no other replica can.
    pub(super) until: Option<Instant>,
    /// Until when its failures are one outage, of which its circuit hears
    /// once: its backoff period, whether it was ejected or not (at most
    /// half the replicas are).
    pub(super) outage_until: Option<Instant>,
}

/// A replica's requests in flight and its latency estimate.
pub(super) struct Load {
    /// Requests sent to it and not yet answered, failed or withdrawn: when
    /// each was sent, and the pool's id of it. Oldest first.
    pub(super) in_flight: BTreeSet<(Instant, u64)>,
    /// Peak-EWMA of its answers' round trips, in nanoseconds: a slower
    /// answer sets it, a faster one moves it by [`EWMA_WEIGHT`]. `None`
    /// until its first answer.
    pub(super) estimate: Option<f64>,
    /// When `estimate` was last set: its decay runs from then.
    pub(super) updated: Instant,
    /// How many requests it may hold at once ([`Limit`], R25).
    pub(super) limit: Limit,
    /// A plain moving average of its answers' round trips, in nanoseconds
    /// (withdrawn requests do not count): what a request sent to it now
    /// typically waits, for the shedding of waiting requests that could
    /// not be judged in time ([`NEEDS_ESTIMATES`](super::waiting::NEEDS_ESTIMATES)). The peak-sensitive
    /// estimate would let one hung request shed every waiting one.
    pub(super) typical: Option<f64>,
    /// When it last answered a request: a replica that answers is making
    /// progress, and its requests that time out meanwhile waited behind
    /// load, which never opens its circuit (R25, R13).
    pub(super) answered: Option<Instant>,
}

impl Load {
    /// The latency estimate at `now`, in nanoseconds. A replica that has
    /// not answered yet is priced at `default` (what its peers take,
    /// [`Prices`]); an estimate above `default` decays towards it with
    /// the time constant [`DECAY`], so a replica that was slow, and so
    /// got nothing since, is tried again.
    pub(super) fn estimate(&self, now: Instant, default: f64) -> f64 {
        let estimate = match self.estimate {
            None => default,
            Some(estimate) if estimate > default => {
                let elapsed = nanos(now.saturating_duration_since(self.updated));
                default + (estimate - default) * (-elapsed / nanos(DECAY)).exp()
            }
            Some(estimate) => estimate,
        };
        estimate.max(MIN_ESTIMATE)
    }

    /// What sending it one more request costs: each request in flight
    /// counts as the estimate, or as its age once it is older than that
    /// (a replica that stopped answering costs more with every moment),
    /// and the new request as the estimate.
    pub(super) fn price(&self, now: Instant, default: f64) -> Price {
        let estimate = self.estimate(now, default);
        let mut cost = estimate * (self.in_flight.len() as f64 + 1.0);
        for (sent, _) in &self.in_flight {
            let age = nanos(now.saturating_duration_since(*sent));
            if age <= estimate {
                break;
            }
            cost += age - estimate;
        }
        Price {
            cost,
            outstanding: self.in_flight.len(),
        }
    }

    /// Folds `rtt` in at `now`: a round trip slower than the estimate sets
    /// it (peak), a faster one moves it by [`EWMA_WEIGHT`]. With
    /// `bound_only`, `rtt` is only a lower bound (a request withdrawn
    /// unanswered after that long): it can raise the estimate, never
    /// lower it.
    pub(super) fn observe(
        &mut self,
        rtt: f64,
        now: Instant,
        default: f64,
        bound_only: bool,
    ) -> Option<f64> {
        let current = self.estimate.map(|_| self.estimate(now, default));
        let next = match current {
            Some(current) if rtt >= current => rtt,
            Some(current) if !bound_only => current + (rtt - current) * EWMA_WEIGHT,
            None if !bound_only || rtt > default => rtt,
            _ => return None,
        };
        self.estimate = Some(next);
        self.updated = now;
        Some(next)
    }
}

/// What one more request to a replica costs, and the requests it holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Price {
    pub(super) cost: f64,
    pub(super) outstanding: usize,
}

impl Price {
    /// Whether the choice prefers this replica to `other`. Costs within
    /// [`COST_TIE`] of each other are a tie, told apart by the requests
    /// each holds: what separates equal replicas' latency estimates is
    /// noise (a descheduled process, a busy core), and a choice that
    /// followed it would send nearly every request to whichever replica
    /// last looked a little faster. A real difference (a replica several
    /// times slower, or holding many more requests, or holding one it has
    /// not answered for long) is past the band.
    pub(super) fn cheaper_than(self, other: Price) -> bool {
        let (mine, theirs) = (self.cost, other.cost);
        if mine.max(theirs) <= mine.min(theirs) * COST_TIE {
            self.outstanding < other.outstanding
        } else {
            mine < theirs
        }
    }
}

/// What each replica of a guard is priced at while it has not answered,
/// and what its estimate decays towards: the lowest latency estimate among
/// the *other* replicas that have answered (what a replica of this guard
/// is known to take), or [`DEFAULT_RTT`] when none has.
pub(super) struct Prices {
    pub(super) lowest: Option<(f64, *const Replica)>,
    pub(super) second: Option<f64>,
}

impl Prices {
    pub(super) fn of(live: &[Arc<Replica>]) -> Self {
        let mut prices = Prices {
            lowest: None,
            second: None,
        };
        for replica in live {
            let estimate = f64::from_bits(replica.estimate.load(Ordering::Relaxed));
            if estimate <= 0.0 {
                continue;
            }
            match prices.lowest {
                Some((lowest, _)) if estimate >= lowest => {
                    if prices.second.is_none_or(|second| estimate < second) {
                        prices.second = Some(estimate);
                    }
                }
                _ => {
                    prices.second = prices.lowest.map(|(lowest, _)| lowest);
                    prices.lowest = Some((estimate, Arc::as_ptr(replica)));
                }
            }
        }
        prices
    }

    /// The default of `replica`: the lowest estimate but its own.
    pub(super) fn default_for(&self, replica: &Replica) -> f64 {
        let others = match self.lowest {
            Some((_, which)) if std::ptr::eq(which, replica) => self.second,
            lowest => lowest.map(|(lowest, _)| lowest),
        };
        others.unwrap_or_else(|| nanos(DEFAULT_RTT))
    }
}

impl Replica {
    pub(super) fn ejected_until(&self) -> Option<Instant> {
        self.ejection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .until
    }

    pub(super) fn available(&self, now: Instant) -> bool {
        self.ejected_until().is_none_or(|until| until <= now)
            && !self.link.is_down()
            && !self.link.draining()
    }

    pub(super) fn load(&self) -> std::sync::MutexGuard<'_, Load> {
        self.load.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn price(&self, now: Instant, prices: &Prices) -> Price {
        self.load().price(now, prices.default_for(self))
    }

    /// Request `id`, sent at `sent`, is now held by this replica: how many
    /// it holds.
    pub(super) fn hold(&self, sent: Instant, id: u64) -> usize {
        let mut load = self.load();
        if load.in_flight.insert((sent, id)) {
            self.guard_held.add();
        }
        load.in_flight.len()
    }

    /// Request `id`, sent at `sent`, left this replica at `now`: answered
    /// (its round trip folded into the estimate), withdrawn unanswered
    /// (its age a lower bound of the estimate), or failed (no round
    /// trip). How many it still holds.
    pub(super) fn release(
        &self,
        sent: Instant,
        id: u64,
        now: Instant,
        ended: Ended,
        prices: &Prices,
    ) -> usize {
        let default = prices.default_for(self);
        let mut load = self.load();
        let held = load.in_flight.len();
        if load.in_flight.remove(&(sent, id)) {
            self.guard_held.sub();
        }
        let round_trip = now.saturating_duration_since(sent);
        let rtt = nanos(round_trip);
        if let Ended::Answered = ended {
            load.limit.answered(round_trip, held, now);
            let limit = load.limit.get();
            if self.published_limit.swap(limit, Ordering::Relaxed) != limit {
                self.series.limit(limit);
            }
            load.answered = Some(now);
            load.typical = Some(
                load.typical
                    .map_or(rtt, |typical| typical + (rtt - typical) * TYPICAL_WEIGHT),
            );
        }
        let estimate = match ended {
            Ended::Answered => load.observe(rtt, now, default, false),
            Ended::Withdrawn => load.observe(rtt, now, default, true),
            Ended::Failed => None,
        };
        if let Some(estimate) = estimate {
            self.estimate.store(estimate.to_bits(), Ordering::Relaxed);
        }
        load.in_flight.len()
    }

    pub(super) fn outstanding(&self) -> usize {
        self.load().in_flight.len()
    }

    /// Whether it holds fewer requests than its limit allows.
    pub(super) fn has_room(&self) -> bool {
        let load = self.load();
        load.in_flight.len() < load.limit.get()
    }

    /// Whether it answered a request after `since`: it is making
    /// progress.
    pub(super) fn answered_since(&self, since: Instant) -> bool {
        self.load().answered.is_some_and(|at| at > since)
    }
    /// It answered a request in full (not with an error): it is healthy.
    /// Its ejection backoff starts over and its circuit hears of a
    /// success (R13, R32).
    pub(super) fn answered_in_full(&self) {
        self.ejections.store(0, Ordering::Relaxed);
        self.link.record(Ok(()));
    }
}

/// How a request left a replica ([`Replica::release`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Ended {
    Answered,
    Withdrawn,
    Failed,
}
