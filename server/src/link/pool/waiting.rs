//! Requests waiting for room at a guard's replicas (R25): queued in turns
//! across clients ([`super::super::fair`]), sent as room comes, shed when
//! their wait is up or too little of their time is left, failed (R13) when
//! the guard answered nothing while they waited.

use super::super::fair::{self, Sender};
use super::super::{Busy, GuardFailure, LinkEvent, NoRoom, NotSent};
use super::{Inner, Request, State, Undispatched};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A request that waited for room is sent only with this many of the
/// quickest replica's typical round trip left of its guard's time; with
/// less it is shed (R25) rather than sent to time out (R13).
pub(super) const NEEDS_ESTIMATES: f64 = 1.5;

/// A request waiting for room at the guard's replicas ([`fair`]): every
/// replica that could take it holds as many requests as its limit allows.
pub(super) struct Waiting {
    pub(super) asked: Request,
    /// Since when it waits.
    pub(super) since: Instant,
    /// Until when it may wait: half the guard's time left when it began
    /// to (its entry in [`State::waits`]).
    pub(super) wait_until: Instant,
}

impl Waiting {
    /// `asked`, waiting from `now` for at most half the guard's time left.
    pub(super) fn new(asked: Request, now: Instant) -> Self {
        let wait_until = now + asked.until.saturating_duration_since(now) / 2;
        Waiting {
            asked,
            since: now,
            wait_until,
        }
    }
}

impl Inner {
    /// Request `id` waits for room ([`fair`]): within the bound of
    /// waiting requests and its client's share, or refused: busy (R25),
    /// unless the guard has answered nothing for its timeout (`stall`)
    /// while holding requests, a failure (R13). A request of another
    /// client that made room is shed.
    pub(super) fn enqueue(
        &self,
        state: &mut State,
        id: u64,
        request: Waiting,
    ) -> Result<(), NotSent> {
        let now = request.since;
        let max_waiting = state
            .live
            .first()
            .map_or(super::super::DEFAULT_MAX_WAITING, |r| r.link.flow().2);
        let bounds = fair::Bounds {
            total: max_waiting,
            share: (max_waiting / super::super::CLIENT_SHARES).max(1),
        };
        if request.wait_until <= now {
            return Err(self.refusal(state, request.asked.stall, now, 0, bounds.share));
        }
        match state.waiting.push(request.asked.sender, id, bounds) {
            Err(refused) => {
                Err(self.refusal(state, request.asked.stall, now, refused.held, bounds.share))
            }
            Ok(evicted) => {
                state.waits.insert((request.wait_until, id));
                let at = request.wait_until;
                state.queued.insert(id, request);
                self.wake_at(state, at);
                if let Some((_, evicted)) = evicted
                    && let Some(shed) = state.queued.remove(&evicted)
                {
                    state.waits.remove(&(shed.wait_until, evicted));
                    let busy = self.full(state, shed.asked.sender, bounds.share);
                    self.shed(shed, busy.into());
                }
                Ok(())
            }
        }
    }

    /// Busy for a request of a client holding `held` waiting, or failed
    /// when the guard has answered nothing for `stall`.
    pub(super) fn refusal(
        &self,
        state: &State,
        stall: Duration,
        now: Instant,
        held: usize,
        share: usize,
    ) -> NotSent {
        if let Some(since) = now.checked_sub(stall)
            && let Some((in_flight, stalled)) = self.stalled(state, since, now)
        {
            return NotSent::Failed(GuardFailure::NoProgress { in_flight, stalled });
        }
        let (in_flight, limit, _) = self.load(state);
        NotSent::NoRoom(NoRoom::Full {
            in_flight,
            limit,
            waiting: state.waiting.len(),
            held,
            share,
        })
    }

    pub(super) fn full(&self, state: &State, sender: Sender, share: usize) -> NoRoom {
        let (in_flight, limit, _) = self.load(state);
        NoRoom::Full {
            in_flight,
            limit,
            waiting: state.waiting.len(),
            held: state.waiting.held(sender.client),
            share,
        }
    }

    /// Tells a waiting request's batch that it is shed (R25), counted.
    pub(super) fn shed(&self, request: Waiting, busy: Busy) {
        tracing::debug!(guard = %self.name, error = %busy, "request shed: the guard is busy");
        request.asked.events.send(LinkEvent::Shed {
            tag: request.asked.tag,
            busy,
            replica: Arc::from(""),
        });
    }

    /// Sends waiting requests, in turn, while an available replica has
    /// room (or none is available: then they go where [`Self::dispatch`]
    /// sends them, and fail there per the guard's policy if they must).
    /// `now`: the time when the caller has just read it (a send, an
    /// answer), else read here, once for the turn (it takes microseconds).
    pub(super) fn drain(self: &Arc<Self>, state: &mut State, now: Option<Instant>) {
        if state.waiting.is_empty() {
            return;
        }
        let now = now.unwrap_or_else(Instant::now);
        while !state.waiting.is_empty() {
            let room = state.live.iter().any(|r| r.available(now) && r.has_room())
                || !state.live.iter().any(|r| r.available(now));
            if !room {
                return;
            }
            let Some(id) = state.waiting.pop() else {
                return;
            };
            let Some(request) = state.queued.remove(&id) else {
                continue;
            };
            state.waits.remove(&(request.wait_until, id));
            // Less time left than the replicas now take, with a margin
            // for their queues growing: sent, it would only time out (a
            // failure for its batch); shed instead.
            let left = request.asked.until.saturating_duration_since(now);
            if let Some(takes) = self.least_estimate(state, now)
                && left < takes.mul_f64(NEEDS_ESTIMATES)
            {
                self.give_up(state, request, now);
                continue;
            }
            let sent = self.dispatch_new(state, id, &request.asked, now);
            match sent {
                Ok((replica, link_id, sent_at)) => {
                    self.start(state, id, request, replica, link_id, sent_at);
                }
                Err(Undispatched::Full) => {
                    // Room went between the check and the send: it waits
                    // again, at the back of its flow.
                    let sender = request.asked.sender;
                    let at = request.wait_until;
                    if state
                        .waiting
                        .push(
                            sender,
                            id,
                            fair::Bounds {
                                total: usize::MAX,
                                share: usize::MAX,
                            },
                        )
                        .is_ok()
                    {
                        state.waits.insert((at, id));
                        state.queued.insert(id, request);
                    }
                    return;
                }
                Err(Undispatched::Not(NotSent::Busy(busy))) => self.shed(request, busy.into()),
                Err(Undispatched::Not(NotSent::NoRoom(busy))) => self.shed(request, busy.into()),
                Err(Undispatched::Not(NotSent::Failed(failure))) => {
                    request.asked.events.send(LinkEvent::Failed {
                        tag: request.asked.tag,
                        failure,
                        replica: Arc::from(""),
                    });
                }
            }
        }
    }

    /// What the quickest available replica with room typically takes to
    /// answer now, if any has answered.
    pub(super) fn least_estimate(&self, state: &State, now: Instant) -> Option<Duration> {
        state
            .live
            .iter()
            .filter(|r| r.available(now) && r.has_room())
            .filter_map(|r| r.load().typical)
            .min_by(f64::total_cmp)
            .map(|nanos| Duration::from_nanos(nanos as u64))
    }

    /// The waiting requests whose wait is up at `now`: shed (R25), or
    /// failed when the guard answered nothing while they waited (R13).
    pub(super) fn expire_waits(&self, state: &mut State, now: Instant) {
        while let Some(&(at, id)) = state.waits.first() {
            if at > now {
                break;
            }
            state.waits.pop_first();
            let Some(request) = state.queued.remove(&id) else {
                continue;
            };
            state.waiting.remove(request.asked.sender, &id);
            self.give_up(state, request, now);
        }
    }

    /// Ends a waiting request that will not be sent: shed (R25), or failed
    /// when nothing was answered while it waited: not load, a guard making
    /// no progress (R13).
    pub(super) fn give_up(&self, state: &State, request: Waiting, now: Instant) {
        if let Some((in_flight, stalled)) = self.stalled(state, request.since, now) {
            request.asked.events.send(LinkEvent::Failed {
                tag: request.asked.tag,
                failure: GuardFailure::NoProgress { in_flight, stalled },
                replica: Arc::from(""),
            });
            return;
        }
        let (in_flight, limit, _) = self.load(state);
        let busy = NoRoom::Waited {
            waited: now.saturating_duration_since(request.since),
            in_flight,
            limit,
        };
        self.shed(request, busy.into());
    }
}
