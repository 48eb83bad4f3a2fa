//! The choice of a replica for a request: power of two choices among the
//! available replicas by price, then the others, and the send.

use super::super::wire::Head;
use super::super::{GuardFailure, NotSent};
use super::replica::{Prices, Replica};
use super::{Inner, Request, State, fails_over};
use prost::bytes::Bytes;
use rand::Rng;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Why [`Inner::dispatch`] sent nothing.
pub(super) enum Undispatched {
    /// Every available replica holds as many requests as its limit
    /// allows: the request waits for room.
    Full,
    /// Busy or failed at every replica tried.
    Not(NotSent),
}

impl From<NotSent> for Undispatched {
    fn from(not: NotSent) -> Self {
        Self::Not(not)
    }
}

impl Inner {
    /// The replicas to try for a request, of a guard of two or more, best
    /// first: two drawn at random
    /// among the available ones, the less loaded first (power of two
    /// choices), then the other available ones by load, then the ejected
    /// or down ones, the soonest back first, then the draining ones (health
    /// `NOT_SERVING`). `exclude`: already tried.
    pub(super) fn candidates(
        &self,
        state: &mut State,
        exclude: &[Arc<str>],
        now: Instant,
    ) -> Vec<Arc<Replica>> {
        let (mut available, mut out): (Vec<Arc<Replica>>, Vec<Arc<Replica>>) = state
            .live
            .iter()
            .filter(|r| !exclude.iter().any(|e| *e == r.endpoint))
            .cloned()
            .partition(|r| r.available(now));
        let mut order = Vec::with_capacity(available.len() + out.len());
        let prices = Prices::of(&state.live);
        if available.len() >= 2 {
            let i = state.rng.random_range(0..available.len());
            let mut j = state.rng.random_range(0..available.len() - 1);
            if j >= i {
                j += 1;
            }
            let (pi, pj) = (
                available[i].price(now, &prices),
                available[j].price(now, &prices),
            );
            let (first, second) = if pj.cheaper_than(pi) { (j, i) } else { (i, j) };
            order.push(available[first].clone());
            order.push(available[second].clone());
            let (hi, lo) = (first.max(second), first.min(second));
            available.swap_remove(hi);
            available.swap_remove(lo);
        }
        let mut rest: Vec<(f64, Arc<Replica>)> = available
            .into_iter()
            .map(|r| (r.price(now, &prices).cost, r))
            .collect();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0));
        order.extend(rest.into_iter().map(|(_, r)| r));
        // A draining replica (health NOT_SERVING) only when nothing else
        // can take the request.
        out.sort_by_key(|r| (r.link.draining(), r.ejected_until()));
        order.extend(out);
        order
    }

    /// [`Self::dispatch`] of a request as it was asked, to any replica, at
    /// `now`.
    pub(super) fn dispatch_new(
        &self,
        state: &mut State,
        id: u64,
        asked: &Request,
        now: Instant,
    ) -> Result<(Arc<Replica>, u64, Instant), Undispatched> {
        let Request {
            head,
            shared,
            client,
            stall,
            ..
        } = asked;
        self.dispatch(state, id, head, shared, *client, *stall, &[], now)
    }

    /// Sends to the first replica of [`Self::candidates`] that takes the
    /// request. An available replica at its limit is passed over; when
    /// every available one is, the request waits for room (`Full`, R25)
    /// rather than go to an ejected or down one. Busy everywhere: `Busy`
    /// (R25, shed); else the first failure, each failing replica ejected
    /// and its circuit told.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch(
        &self,
        state: &mut State,
        id: u64,
        head: &Head,
        shared: &Bytes,
        client: u64,
        stall: Duration,
        exclude: &[Arc<str>],
        now: Instant,
    ) -> Result<(Arc<Replica>, u64, Instant), Undispatched> {
        let mut busy = None;
        let mut failed = None;
        let mut full = false;
        // One replica (most guards): it is the only candidate, whatever
        // its state; no draw, no prices, no sort, no list.
        let (one, many);
        let candidates: &[Arc<Replica>] = match state.live.as_slice() {
            [only] if exclude.iter().any(|e| *e == only.endpoint) => &[],
            [only] => {
                one = [only.clone()];
                &one
            }
            _ => {
                many = self.candidates(state, exclude, now);
                &many
            }
        };
        for replica in candidates {
            // Whether it is available is asked only when it matters (its
            // ejection and its link each take a lock): when it has no room,
            // or when an available one before it had none.
            if !replica.has_room() && replica.available(now) {
                full = true;
                continue;
            }
            if full && !replica.available(now) {
                break;
            }
            match replica.link.send(
                head,
                shared.clone(),
                id as usize,
                self.report.clone(),
                client,
                stall,
                now,
            ) {
                Ok(link_id) => {
                    let held = replica.hold(now, id);
                    replica.series.sent(held);
                    return Ok((replica.clone(), link_id, now));
                }
                Err(NotSent::Busy(b)) => {
                    busy.get_or_insert(b);
                }
                // A link never answers so: only the pool has no room.
                Err(NotSent::NoRoom(_)) => {}
                Err(NotSent::Failed(f)) => {
                    if fails_over(&f) {
                        self.eject(state, replica, &f, now);
                    }
                    replica.link.record(Err(&f));
                    failed.get_or_insert(f);
                }
            }
        }
        if full && busy.is_none() {
            return Err(Undispatched::Full);
        }
        Err(Undispatched::Not(match (busy, failed) {
            (Some(b), _) => NotSent::Busy(b),
            (None, Some(f)) => NotSent::Failed(f),
            // R15: a guard whose replicas all left stays in the chain and
            // fails per R13.
            (None, None) => NotSent::Failed(GuardFailure::Unreachable(
                "the guard has no replicas".into(),
            )),
        }))
    }
}
