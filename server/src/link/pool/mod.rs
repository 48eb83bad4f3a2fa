//! A guard's replicas as one guard (R32): a [`GuardLink`] per replica, a
//! replica chosen per request by load, failover before failure policy.
//!
//! The pool follows a [`Replicas`] watch: a registered guard's pool
//! ([`GuardPool::registered`]) follows the union of its sources
//! ([`GuardSources`]: each registered target, a DNS name's addresses, the
//! heartbeat-announced replicas), which a new registration relists. A new
//! target gets a link of its own, a target that left gets no new requests
//! and its link closes once the requests in flight on it have ended (the
//! link is held by them). A replica of a name that fails to connect asks
//! the name to be resolved again.
//!
//! **Choice**: power of two choices, by cost. Two replicas are drawn at
//! random among those that are not ejected, not draining (their health
//! watch says `NOT_SERVING`, [`super::health`]) and whose link is not down, and
//! the cheaper gets the request. Two costs within a factor of [`COST_TIE`](replica::COST_TIE)
//! of each other are a tie, which the requests each holds decide, then the
//! draw: equal replicas' latency estimates differ by noise, and following
//! it sent nearly every request to whichever looked a little faster (at
//! light load, where each holds none, two thirds to the fastest of three
//! and none to the slowest). When its queue is full ([`NotSent::Busy`],
//! R25) or it fails at once, the other, then the rest by cost, then the
//! ejected ones, get their turn. A batch is shed with `RESOURCE_EXHAUSTED`
//! only when every replica was full: busy is never a failure.
//!
//! **Cost**: what one more request to the replica would wait for. Each
//! request it holds counts as its latency estimate, or as its age once it
//! is older than that (a replica that stopped answering costs more with
//! every moment its requests wait), and the new request as the estimate
//! ([`Load::price`]). The estimate is a peak-EWMA of its answers' round
//! trips: a slower answer sets it at once, a faster one moves it a tenth
//! of the way ([`EWMA_WEIGHT`](replica::EWMA_WEIGHT)); a request withdrawn unanswered (the
//! batch's time ran out, or the batch no longer needed it) raises it to
//! its age. A replica that has not answered yet is priced at its
//! *default*: the lowest estimate among the other replicas that have
//! answered (what a replica of this guard is known to take), or
//! [`DEFAULT_RTT`] (30 ms) before any has; never zero, the price that
//! made a replica hanging from the start look the cheapest and draw
//! most requests. An estimate above the default decays towards it with
//! the time constant [`DECAY`] (0.5 s), whether or not the replica is
//! chosen, so a replica that was slow for a moment, and got nothing
//! since, is tried again. (Like linkerd's and tower's peak-EWMA balancers,
//! with two differences: the default is the replica's peers' figure, not
//! a constant, and an estimate decays towards it, not towards zero; an
//! idle pool then prices every replica alike, where decay towards zero
//! would price them all at nothing.)
//!
//! Measured against real guards (the integration module
//! `guard_replicas`, 600 batches per run, 2 vCPU shared with other
//! builds), before the decay and the age: a replica 5x slower than two
//! others judged, of 600, 114 and 124 (19-21%) by outstanding requests
//! alone; 64 (11%) with a peak-EWMA without the tie band; 23 with the
//! rise damped to half; 39 and 46 (7%) with a plain EWMA. Three equal
//! Python replicas: 200/208/192 by outstanding requests; 243/174/183 with
//! peak-EWMA; 189/191/220 and then 266/160/174 (outside +-25%) with the
//! damped peak; 168/206/226 and 199/186/215 with the plain EWMA. With the
//! tie band ([`COST_TIE`](replica::COST_TIE)), the same test counting from the replicas' own
//! tally, 1,200 batches paced at 320 a second: 389/406/405, 395/404/401,
//! 396/405/399 (without the band 424/377/399, 438/380/382, 408/417/375);
//! closed loop of 16 sessions: 406/394/400, 406/397/397, 410/398/392
//! (without: 415/399/386, 423/389/388, 381/423/396); the 5x slower
//! replica judged 53 of 600 (9%). The paused-time test of three replicas
//! at 10, 12 and 14 ms, one request at a time, shows what the band is
//! for: without it the 14 ms replica got nothing. The plain EWMA had a
//! flaw the band did not show: it moved only on answers, and a replica
//! more than twice as costly is never asked, so one slow second (300 ms
//! more) left a replica out for good; the decay brings it back, and the
//! band keeps a peak of noise (a pause of a guard's runtime, a busy
//! core) from pushing a healthy replica aside unless it doubles the
//! cost, and then only for about a [`DECAY`].
//!
//! **Failover**: a request whose replica fails (connect error, stream
//! reset, GOAWAY, not reading its stream) is sent to another replica not
//! yet tried for it, while the guard's time for the batch lasts (the
//! batch's `deadline_ms` is what is left). The failing replica is ejected
//! for a backoff period (doubling per consecutive ejection, reset by a
//! success) and its circuit hears of the failure; the batch only hears of
//! a failure when no replica could take the request, and then the guard's
//! failure policy applies (R13). A request that already had a partial
//! answer is not sent again (its verdicts are in the batch's fold). A
//! guard may therefore see the same batch id on two replicas.
//!
//! **A timeout fails over too** (R32: R13 applies only when no replica
//! can judge in time). A request that another available replica could
//! take gives its replica half of the guard's time left, so that a second
//! attempt fits, but at least [`ATTEMPT_ESTIMATES`](moves::ATTEMPT_ESTIMATES) (3) times the
//! replica's estimate (a replica at its usual pace is not cut off, and a
//! guard whose answers take a large part of its timeout is not split at
//! all). When that runs out unanswered ([`attempt_timer`], one task per
//! pool, woken only for an earlier deadline), the request is sent to
//! another replica and withdrawn from the first, whose estimate rises to
//! what it waited and which is ejected as a failed one is. A request moves
//! so once at most, and the pool's moves on timeout are held to a budget
//! ([`Budget`]: 10 a second plus a fifth of the requests sent), so a
//! guard whose replicas all hang is sent each batch twice at most, most
//! batches once, and fails per R13 at its time as before. Ejection is
//! capped: at most half the replicas are ejected at once (never all, in
//! the manner of Envoy's `max_ejection_percent`); a failing replica past
//! the cap stays in the choice, where its unanswered requests' age prices
//! it out, and its circuit still hears of its outage once.
//!
//! **Busy is not failed** (R25). Each replica is sent at most its limit
//! of requests at once ([`super::limit`]: adapted from its latency, within
//! `LinkConfig::min_in_flight`..`max_in_flight`); an available replica at
//! its limit is passed over, and when every one is, the request waits for
//! room ([`super::fair`]: in turns across clients and their sessions, at
//! most half the guard's time, one client at most a quarter of
//! `LinkConfig::max_waiting`). A request past its client's share, or that
//! waited its time, or that has less than [`NEEDS_ESTIMATES`](waiting::NEEDS_ESTIMATES) of the
//! quickest replica's typical round trip left, is shed ([`LinkEvent::Shed`]: the
//! batch is refused with `RESOURCE_EXHAUSTED`), unless the guard's replicas
//! answered none of the requests they held meanwhile: then the guard makes
//! no progress, a failure ([`GuardFailure::NoProgress`], R13). A request
//! that times out on a replica that answered others meanwhile waited
//! behind load: the replica's circuit is not told, and a move on its
//! attempt's timeout does not eject it.
//!
//! **Why not tower's `balance::p2c`**: tower's balancer drives
//! `tower::Service`s, one call per request and readiness polled before
//! each call. A guard link is a multiplexed stream whose requests answer
//! through events on the batch's mailbox, whose "not ready" comes in two
//! kinds (busy: try another, shed if all are; failed: eject and try
//! another), and whose requests must move to another replica after they
//! were sent. tower's `Balance` cannot resend an accepted request nor tell
//! busy from broken, so the choice (a dozen lines) is written here; the
//! replica set is a `tokio::sync::watch`, which is what tower's `discover`
//! change stream would be fed from.

use super::discover::dns::ResolveHandle;
use super::discover::sources::GuardSources;
use super::discover::{ReplicaTarget, Replicas};
use super::events::EventSender;
use super::fair::{Fair, Sender};
use super::limit::Limit;
use super::wire::Head;
use super::{GuardFailure, GuardLink, LinkEvent, NotSent, Report};
use crate::observe::metrics::{FlowSeries, HeldSeries, Metrics};
use prost::bytes::Bytes;
use rand::SeedableRng;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

mod choice;
mod moves;
mod replica;
mod waiting;

use choice::Undispatched;
use moves::{Budget, attempt_timer};
pub use moves::{EJECT_INITIAL, EJECT_MAX};
pub use replica::{DECAY, DEFAULT_RTT};
use replica::{Ejection, Ended, Load, Prices, Replica};
use waiting::Waiting;

/// Opens the link to one replica.
pub type SpawnLink = Box<dyn Fn(&ReplicaTarget) -> GuardLink + Send + Sync>;

/// A request as [`GuardPool::send`] was asked to send it: the batch, its
/// sender, and when the guard's time for it is up.
pub struct Request {
    /// The batch's own fields for the guard, encoded (its context and
    /// calls are `shared`).
    pub head: Head,
    /// Its context and calls, as [`super::wire::shared_part`] encoded them.
    pub shared: Bytes,
    /// Names the request in the events it causes.
    pub tag: usize,
    /// Where the answer or the failure is reported.
    pub events: EventSender,
    /// The sending coordinator connection's key.
    pub client: u64,
    /// Its place in the fair queue.
    pub sender: Sender,
    /// How long the guard may take nothing off its stream before it is not
    /// reading (its timeout).
    pub stall: Duration,
    /// When the guard's time for this batch is up.
    pub until: Instant,
    /// When the batch sent it: the pool's time for it, read once by the
    /// batch for all its guards, not once more by the pool per guard.
    pub at: Instant,
}

/// A request the pool has sent and not settled.
struct Pending {
    asked: Request,
    replica: Arc<Replica>,
    link_id: u64,
    tried: Vec<Arc<str>>,
    partial: bool,
    /// When it was sent to `replica` (for its latency).
    sent_at: Instant,
    /// When the attempt on `replica` gives up for another replica (its
    /// entry in [`State::attempts`]); `None`: it waits for the guard's
    /// time.
    attempt_until: Option<Instant>,
    /// Whether it already moved because its replica did not answer in
    /// time: once is all, so a batch is sent to a hung guard twice at
    /// most.
    moved_on_timeout: bool,
}

struct State {
    live: Vec<Arc<Replica>>,
    requests: super::IdMap<u64, Pending>,
    /// Requests waiting for room, by id, and their turns ([`fair`](super::fair)).
    queued: super::IdMap<u64, Waiting>,
    waiting: Fair<u64>,
    /// Their wait deadlines, earliest first.
    waits: BTreeSet<(Instant, u64)>,
    /// The guard's gauges as last published: its replicas' limits
    /// together, and the requests waiting.
    published: Option<(usize, usize)>,
    rng: rand::rngs::SmallRng,
    /// The requests' attempt deadlines ([`Pending::attempt_until`]),
    /// earliest first, with each request's id.
    attempts: BTreeSet<(Instant, u64)>,
    /// The deadline the attempt timer sleeps until ([`Inner::expire`]).
    armed: Option<Instant>,
    budget: Budget,
}

struct Inner {
    name: String,
    spawn: SpawnLink,
    metrics: Arc<Metrics>,
    /// The guard's flow series ([`Inner::gauges`]), looked up once.
    flow: FlowSeries,
    /// The requests its replicas hold together, published as each moves.
    held: HeldSeries,
    state: Mutex<State>,
    next_id: AtomicU64,
    /// Which watch of the replica set the pool follows now: a set read
    /// from an older one (replaced by [`GuardPool::relist`]) is not applied.
    generation: AtomicU64,
    /// The handles that ask a registered name to be resolved again, by
    /// registered endpoint. A leaf lock: nothing else is taken under it.
    resolvers: Mutex<HashMap<String, ResolveHandle>>,
    /// Wakes the attempt timer ([`attempt_timer`]) for an earlier deadline.
    wake: Arc<Notify>,
    /// The attempt timer's task, ended with the pool.
    timer: Mutex<Option<tokio::task::AbortHandle>>,
    /// Where the replicas' links report: one hook for every request, each
    /// sent tagged with the pool's id of it (no hook made per request).
    report: Report,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let timer = self.timer.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(timer) = timer.take() {
            timer.abort();
        }
    }
}

/// What a failed request's replica failure means for the pool: whether
/// another replica may judge it instead. Failures of the replica's
/// connection or stream do; an answer (even one with an error), a timeout
/// of the batch, or a verdict the mesh cannot read (the same code runs on
/// every replica) do not.
pub fn fails_over(failure: &GuardFailure) -> bool {
    matches!(
        failure,
        GuardFailure::Unreachable(_)
            | GuardFailure::Status { .. }
            | GuardFailure::StreamClosed
            | GuardFailure::NotReading { .. }
            | GuardFailure::CircuitOpen { .. }
    )
}

/// A guard's replicas, one link each (R32).
pub struct GuardPool {
    inner: Arc<Inner>,
    follow: Mutex<Option<tokio::task::AbortHandle>>,
    /// The registration's sources, when the pool was given a list
    /// ([`Self::listed`], [`Self::registered`]).
    sources: Option<Mutex<GuardSources>>,
    /// The identity the registration pins (`server_identity`).
    identity: Option<String>,
}

impl std::fmt::Debug for GuardPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardPool")
            .field("name", &self.inner.name)
            .field("replicas", &self.endpoints())
            .finish()
    }
}

impl Drop for GuardPool {
    fn drop(&mut self) {
        let follow = self
            .follow
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(follow) = follow.take() {
            follow.abort();
        }
    }
}

impl GuardPool {
    /// A pool that follows `replicas`, opening each replica's link with
    /// `spawn`. Must be called within a tokio runtime.
    pub fn new(name: &str, replicas: Replicas, spawn: SpawnLink, metrics: Arc<Metrics>) -> Self {
        let pool = Self::start(name, spawn, metrics, None, None);
        pool.follow(replicas);
        pool
    }

    /// A pool over a list the owner changes with [`Self::relist`], each
    /// entry one replica dialed as written.
    pub fn listed(
        name: &str,
        endpoints: impl IntoIterator<Item = String>,
        spawn: SpawnLink,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self::registered(
            name,
            endpoints,
            GuardSources::new(name, None, None),
            None,
            spawn,
            metrics,
        )
    }

    /// A registered guard's pool (R32): it follows `sources` (each
    /// registered target, a name's addresses, the heartbeat-announced
    /// replicas) with the registered list `endpoints`, which the owner
    /// changes with [`Self::relist`]. `identity`: the registration's
    /// pinned identity ([`Self::identity`]). Must be called within a tokio
    /// runtime.
    pub fn registered(
        name: &str,
        endpoints: impl IntoIterator<Item = String>,
        sources: GuardSources,
        identity: Option<String>,
        spawn: SpawnLink,
        metrics: Arc<Metrics>,
    ) -> Self {
        let endpoints: Vec<String> = endpoints.into_iter().collect();
        let pool = Self::start(name, spawn, metrics, Some(sources), identity);
        pool.relist(&endpoints);
        pool
    }

    fn start(
        name: &str,
        spawn: SpawnLink,
        metrics: Arc<Metrics>,
        sources: Option<GuardSources>,
        identity: Option<String>,
    ) -> Self {
        let inner = Arc::new_cyclic(|weak: &Weak<Inner>| Inner {
            name: name.to_owned(),
            spawn,
            flow: metrics.flow_series(name),
            held: metrics.guard_held(name),
            metrics,
            state: Mutex::new(State {
                live: Vec::new(),
                requests: super::IdMap::default(),
                queued: super::IdMap::default(),
                waiting: Fair::new(),
                waits: BTreeSet::new(),
                published: None,
                rng: rand::rngs::SmallRng::from_os_rng(),
                attempts: BTreeSet::new(),
                armed: None,
                budget: Budget {
                    since: Instant::now(),
                    sent: 0,
                    moved: 0,
                },
            }),
            next_id: AtomicU64::new(1),
            generation: AtomicU64::new(0),
            resolvers: Mutex::new(HashMap::new()),
            wake: Arc::new(Notify::new()),
            timer: Mutex::new(None),
            report: {
                let weak = weak.clone();
                Report(Arc::new(move |event: LinkEvent| {
                    if let Some(inner) = weak.upgrade() {
                        inner.on_event(event.tag() as u64, event);
                    }
                }))
            },
        });
        let timer = tokio::spawn(attempt_timer(Arc::downgrade(&inner), inner.wake.clone()));
        *inner.timer.lock().unwrap_or_else(PoisonError::into_inner) = Some(timer.abort_handle());
        Self {
            inner,
            follow: Mutex::new(None),
            sources: sources.map(Mutex::new),
            identity,
        }
    }

    /// Follows `replicas` from now on, in place of what the pool followed:
    /// its set is applied at once (the chain snapshot built with this pool
    /// expects it), then each change.
    fn follow(&self, mut replicas: Replicas) {
        let generation = self.inner.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let first = replicas.borrow_and_update().clone();
        self.inner.apply(&first, generation);
        let weak = Arc::downgrade(&self.inner);
        let task = tokio::spawn(async move {
            while replicas.changed().await.is_ok() {
                let targets = replicas.borrow_and_update().clone();
                let Some(inner) = weak.upgrade() else { return };
                inner.apply(&targets, generation);
            }
        })
        .abort_handle();
        let old = self
            .follow
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(task);
        if let Some(old) = old {
            old.abort();
        }
    }

    /// Replaces the registered list of a [`Self::listed`] or
    /// [`Self::registered`] pool: new targets get their replicas, targets
    /// that left drain theirs; the replicas of targets still listed (a
    /// name's addresses) and the announced ones stay as they are. False
    /// for a pool that follows a source given to [`Self::new`].
    pub fn relist(&self, endpoints: &[String]) -> bool {
        let Some(sources) = &self.sources else {
            return false;
        };
        let (replicas, resolvers) = {
            let mut sources = sources.lock().unwrap_or_else(PoisonError::into_inner);
            let replicas = sources.relist(endpoints);
            let resolvers: HashMap<String, ResolveHandle> = sources
                .registered()
                .iter()
                .filter_map(|e| Some((e.clone(), sources.resolver(e)?)))
                .collect();
            (replicas, resolvers)
        };
        *self
            .inner
            .resolvers
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = resolvers;
        self.follow(replicas);
        true
    }

    /// The registered list (what [`Self::relist`] was last given, each
    /// target once); empty for a pool that follows a source.
    pub fn registered_targets(&self) -> Vec<String> {
        self.sources.as_ref().map_or_else(Vec::new, |sources| {
            sources
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .registered()
                .to_vec()
        })
    }

    /// The identity the registration pins, as given to
    /// [`Self::registered`] (a replica reached by a name's address may be
    /// pinned to the name instead, see [`Self::pin`]).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// The live replicas' endpoints, in the set's order.
    pub fn endpoints(&self) -> Vec<String> {
        self.inner
            .lock()
            .live
            .iter()
            .map(|r| r.endpoint.to_string())
            .collect()
    }

    /// The identity every replica must present, if pinned.
    pub fn pin(&self) -> Option<String> {
        self.inner
            .lock()
            .live
            .first()
            .and_then(|r| r.link.pin().map(str::to_owned))
    }

    /// The live replicas that cannot be reached now, with why (their
    /// link's last stream ended or could not be opened, and none opened
    /// since: refused, a certificate that is not the pinned identity, ...);
    /// they get no request while another replica can take it.
    pub fn unreachable(&self) -> Vec<(String, String)> {
        self.inner
            .lock()
            .live
            .iter()
            .filter_map(|r| Some((r.endpoint.to_string(), r.link.down_reason()?.to_string())))
            .collect()
    }

    /// Whether each live replica is draining (its health watch says
    /// `NOT_SERVING`), by endpoint.
    pub fn draining(&self) -> Vec<(String, bool)> {
        self.inner
            .lock()
            .live
            .iter()
            .map(|r| (r.endpoint.to_string(), r.link.draining()))
            .collect()
    }

    /// The health the link of replica `endpoint` reads (unit tests).
    #[cfg(test)]
    pub(crate) fn health_of(&self, endpoint: &str) -> Option<Arc<super::health::Health>> {
        self.inner
            .lock()
            .live
            .iter()
            .find(|r| &*r.endpoint == endpoint)
            .map(|r| r.link.health.clone())
    }

    /// Requests each live replica has unanswered, by endpoint.
    pub fn outstanding(&self) -> Vec<(String, usize)> {
        self.inner
            .lock()
            .live
            .iter()
            .map(|r| (r.endpoint.to_string(), r.outstanding()))
            .collect()
    }

    /// Sends the request's batch to one replica (see [`GuardLink::send`] for `shared`,
    /// `client` and `stall`); the answer or the failure arrives on
    /// `events` tagged `tag`, naming the replica. `until`: when the
    /// guard's time for this batch is up; a request whose replica fails
    /// before then is sent to another. When every replica holds as many
    /// requests as its limit allows, the request waits for room, in turn
    /// with the other clients' (`sender`, [`fair`](super::fair)), for at most half the
    /// guard's time; a request shed meanwhile is reported as
    /// [`LinkEvent::Shed`] (R25). Returns the pool's id of the request,
    /// for [`Self::cancel`].
    pub fn send(&self, asked: Request) -> Result<u64, NotSent> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut state = self.inner.lock();
        let now = asked.at;
        let request = Waiting::new(asked, now);
        // Others wait already: this one takes its turn after them.
        if !state.waiting.is_empty() {
            self.inner.enqueue(&mut state, id, request)?;
            self.inner.drain(&mut state, Some(now));
            self.inner.gauges(&mut state);
            return Ok(id);
        }
        let sent = self.inner.dispatch_new(&mut state, id, &request.asked, now);
        let result = match sent {
            Ok((replica, link_id, sent_at)) => {
                self.inner
                    .start(&mut state, id, request, replica, link_id, sent_at);
                Ok(id)
            }
            Err(Undispatched::Full) => self.inner.enqueue(&mut state, id, request).map(|()| id),
            Err(Undispatched::Not(not)) => Err(not),
        };
        self.inner.gauges(&mut state);
        result
    }

    /// Withdraws request `id` (R5, a timeout): the replica holding it is
    /// told, and named in the answer (when it was still out).
    pub fn cancel(&self, id: u64) -> Option<Arc<str>> {
        let (pending, prices) = {
            let mut state = self.inner.lock();
            if let Some(waiting) = state.queued.remove(&id) {
                state.waiting.remove(waiting.asked.sender, &id);
                state.waits.remove(&(waiting.wait_until, id));
                self.inner.gauges(&mut state);
                return None;
            }
            let pending = state.requests.remove(&id)?;
            if let Some(at) = pending.attempt_until {
                state.attempts.remove(&(at, id));
            }
            (pending, Prices::of(&state.live))
        };
        pending.replica.link.cancel(pending.link_id);
        // Unanswered for this long: its estimate is at least that.
        let now = Instant::now();
        let left = pending
            .replica
            .release(pending.sent_at, id, now, Ended::Withdrawn, &prices);
        pending.replica.series.outstanding(left);
        let mut state = self.inner.lock();
        self.inner.drain(&mut state, Some(now));
        self.inner.gauges(&mut state);
        drop(state);
        Some(pending.replica.endpoint.clone())
    }

    /// How a request to `replica` ended, for that replica's circuit and
    /// ejection: an answer clears its ejection backoff. A failure the pool
    /// already handled (failed over, or failed at sending) was recorded
    /// then; `replica` is `None` for those.
    pub fn record(&self, replica: Option<&str>, outcome: Result<(), &GuardFailure>) {
        let Some(replica) = replica else { return };
        if let Some(found) = self.inner.live_replica(replica) {
            if outcome.is_ok() {
                found.answered_in_full();
                return;
            }
            // R25, R13: a request that timed out on a replica that answered
            // others meanwhile waited behind load; the circuit opens only
            // on a replica that makes no progress.
            if let Err(GuardFailure::TimedOut(waited)) = outcome
                && found.answered_since(
                    Instant::now()
                        .checked_sub(*waited)
                        .unwrap_or_else(Instant::now),
                )
            {
                tracing::debug!(
                    guard = %self.inner.name,
                    replica = %found.endpoint,
                    waited = ?waited,
                    "request timed out behind load: the replica answers others; its circuit is not told"
                );
                return;
            }
            found.link.record(outcome);
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The live replica at `endpoint`, if it is still one.
    fn live_replica(&self, endpoint: &str) -> Option<Arc<Replica>> {
        self.lock()
            .live
            .iter()
            .find(|r| *r.endpoint == *endpoint)
            .cloned()
    }

    /// Makes the live set `targets`: keeps the replicas still listed, opens
    /// links to new ones, and lets the others drain (their links close
    /// when the last request on them ends).
    fn apply(&self, targets: &[ReplicaTarget], generation: u64) {
        let left;
        {
            let mut state = self.lock();
            if self.generation.load(Ordering::SeqCst) != generation {
                return;
            }
            let mut old: Vec<Arc<Replica>> = std::mem::take(&mut state.live);
            let mut live = Vec::with_capacity(targets.len());
            for target in targets {
                if live
                    .iter()
                    .any(|r: &Arc<Replica>| *r.endpoint == *target.endpoint)
                {
                    continue;
                }
                match old.iter().position(|r| *r.endpoint == *target.endpoint) {
                    Some(i) => live.push(old.swap_remove(i)),
                    None => {
                        let link = (self.spawn)(target);
                        let now = Instant::now();
                        let (min, max, _) = link.flow();
                        let limit = Limit::new(min, max, now);
                        live.push(Arc::new(Replica {
                            endpoint: Arc::from(target.endpoint.as_str()),
                            registered: target.registered.as_deref().map(Arc::from),
                            link,
                            ejections: AtomicU32::new(0),
                            ejection: Mutex::new(Ejection::default()),
                            load: Mutex::new(Load {
                                in_flight: BTreeSet::new(),
                                estimate: None,
                                updated: now,
                                limit,
                                typical: None,
                                answered: None,
                            }),
                            estimate: AtomicU64::new(0f64.to_bits()),
                            series: self.metrics.replica_series(&self.name, &target.endpoint),
                            guard_held: self.held.clone(),
                            // Published by the next `gauges`.
                            published_limit: AtomicUsize::new(0),
                        }));
                    }
                }
            }
            state.live = live;
            left = old;
        }
        for replica in &left {
            tracing::info!(guard = %self.name, replica = %replica.endpoint, "replica left: draining");
            self.metrics.replica_gone(&self.name, &replica.endpoint);
        }
        // Dropped outside the lock: a link closing reports to no one here
        // (requests on it hold it), but never under the pool's lock.
        drop(left);
    }

    /// Sets request `id`'s attempt deadline `at`, waking the timer when it
    /// is the earliest.
    fn arm(&self, state: &mut State, id: u64, at: Instant) {
        state.attempts.insert((at, id));
        self.wake_at(state, at);
    }

    /// Wakes the timer for `at` when it is earlier than what it sleeps to.
    fn wake_at(&self, state: &mut State, at: Instant) {
        if state.armed.is_none_or(|armed| at < armed) {
            state.armed = Some(at);
            self.wake.notify_one();
        }
    }

    /// Request `id`, sent to `replica` at `sent_at`, is out: held as
    /// pending, with its attempt deadline (a move to another replica if
    /// this one does not answer in time).
    fn start(
        &self,
        state: &mut State,
        id: u64,
        request: Waiting,
        replica: Arc<Replica>,
        link_id: u64,
        sent_at: Instant,
    ) {
        state.budget.sent(sent_at);
        let attempt_until =
            self.attempt_deadline(state, &replica, &[], sent_at, request.asked.until);
        if let Some(at) = attempt_until {
            self.arm(state, id, at);
        }
        state.requests.insert(
            id,
            Pending {
                asked: request.asked,
                replica,
                link_id,
                tried: Vec::new(),
                partial: false,
                sent_at,
                attempt_until,
                moved_on_timeout: false,
            },
        );
    }

    /// Every replica's requests in flight, their limits together, and the
    /// latest answer of any.
    fn load(&self, state: &State) -> (usize, usize, Option<Instant>) {
        let mut held = 0;
        let mut limit = 0;
        let mut answered: Option<Instant> = None;
        for replica in &state.live {
            let load = replica.load();
            held += load.in_flight.len();
            limit += load.limit.get();
            answered = answered.max(load.answered);
        }
        (held, limit, answered)
    }

    /// Publishes the guard's limit (its replicas' together) and the
    /// requests waiting, when they changed. Each replica's limit is
    /// published when it moves ([`Replica::release`]) and the requests in
    /// flight as each is sent or ends ([`HeldSeries`]): nothing here takes
    /// a replica's lock.
    fn gauges(&self, state: &mut State) {
        let mut limits = 0;
        for replica in &state.live {
            let published = replica.published_limit.load(Ordering::Relaxed);
            limits += if published == 0 {
                // Joined since the last call: its first limit, published
                // under its lock (an answer that moves it meanwhile then
                // publishes after this, never before).
                let load = replica.load();
                let limit = load.limit.get();
                replica.published_limit.store(limit, Ordering::Relaxed);
                replica.series.limit(limit);
                drop(load);
                limit
            } else {
                published
            };
        }
        let flow = (limits, state.waiting.len());
        if state.published != Some(flow) {
            state.published = Some(flow);
            self.flow.set(flow.0, flow.1);
        }
    }

    /// Whether the guard's replicas have answered nothing since `since`
    /// (while a request waited for room, or for the guard's timeout): the
    /// requests they hold and how long they have answered none, when so.
    fn stalled(&self, state: &State, since: Instant, now: Instant) -> Option<(usize, Duration)> {
        let (held, _, answered) = self.load(state);
        if answered.is_some_and(|at| at > since) {
            return None;
        }
        let from = answered.unwrap_or(since).min(since);
        Some((held, now.saturating_duration_since(from)))
    }

    /// A replica's link reports on request `id`: answers go to the batch;
    /// a failure moves the request to another replica while its time
    /// lasts, and reaches the batch only when none can take it.
    fn on_event(self: &Arc<Self>, id: u64, event: LinkEvent) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(pending) = state.requests.get_mut(&id) else {
            return;
        };
        let forward = match event {
            // A link never sheds: only the pool does.
            LinkEvent::Shed { .. } => return,
            LinkEvent::Answer {
                response,
                replica,
                answered,
                ..
            } => {
                if response.partial && response.error.is_empty() {
                    pending.partial = true;
                    // Not sent again (its verdicts are in the batch's
                    // fold): it waits for the guard's time.
                    if let Some(at) = pending.attempt_until.take() {
                        state.attempts.remove(&(at, id));
                    }
                    let event = LinkEvent::Answer {
                        tag: pending.asked.tag,
                        response,
                        replica,
                        answered,
                    };
                    pending.asked.events.send(event);
                    return;
                }
                let Some(pending) = state.requests.remove(&id) else {
                    return;
                };
                if let Some(at) = pending.attempt_until {
                    state.attempts.remove(&(at, id));
                }
                let prices = Prices::of(&state.live);
                drop(guard);
                let left = pending.replica.release(
                    pending.sent_at,
                    id,
                    answered,
                    Ended::Answered,
                    &prices,
                );
                pending.replica.series.outstanding(left);
                // A final answer that is not an error: the replica that
                // sent it is healthy (R13, R32), whatever the batch then
                // makes of the verdicts (a rejected rewrite is a policy
                // bug, R11, not an outage). Told here, where the replica
                // is at hand.
                let moved_from;
                let answering = if *pending.replica.endpoint == *replica {
                    Some(&pending.replica)
                } else {
                    // The replica the request had just moved away from
                    // answered as its attempt ran out: the copy sent to
                    // the other one is withdrawn, and the one that
                    // answered is the healthy one, not the other.
                    pending.replica.link.cancel(pending.link_id);
                    moved_from = self.live_replica(&replica);
                    moved_from.as_ref()
                };
                if let Some(answering) = answering
                    && response.error.is_empty()
                {
                    answering.answered_in_full();
                }
                (
                    pending,
                    LinkEvent::Answer {
                        tag: 0,
                        response,
                        replica,
                        answered,
                    },
                )
            }
            LinkEvent::Failed {
                failure, replica, ..
            } => {
                let now = Instant::now();
                if let Some(at) = pending.attempt_until.take() {
                    state.attempts.remove(&(at, id));
                }
                let failed = pending.replica.clone();
                let left =
                    failed.release(pending.sent_at, id, now, Ended::Failed, &Prices::of(&[]));
                failed.series.outstanding(left);
                if fails_over(&failure) && !pending.partial && now < pending.asked.until {
                    pending.tried.push(failed.endpoint.clone());
                    let head = pending.asked.head.with_deadline(
                        u32::try_from((pending.asked.until - now).as_millis().max(1))
                            .unwrap_or(u32::MAX),
                    );
                    let tried = pending.tried.clone();
                    let (shared, client, stall, until, moved) = (
                        pending.asked.shared.clone(),
                        pending.asked.client,
                        pending.asked.stall,
                        pending.asked.until,
                        pending.moved_on_timeout,
                    );
                    let outage = self.eject(state, &failed, &failure, now);
                    let sent = self.dispatch(state, id, &head, &shared, client, stall, &tried, now);
                    if let Err(Undispatched::Full) = sent {
                        // The other replicas are at their limits: it waits
                        // for room as a new request would (R25, R32).
                        if outage {
                            failed.link.record(Err(&failure));
                        }
                        if let Some(pending) = state.requests.remove(&id) {
                            let events = pending.asked.events.clone();
                            let tag = pending.asked.tag;
                            let asked = Request {
                                head,
                                ..pending.asked
                            };
                            let request = Waiting::new(asked, now);
                            let event = match self.enqueue(state, id, request) {
                                Ok(()) => None,
                                Err(NotSent::Busy(busy)) => Some(LinkEvent::Shed {
                                    tag,
                                    busy: busy.into(),
                                    replica,
                                }),
                                Err(NotSent::NoRoom(busy)) => Some(LinkEvent::Shed {
                                    tag,
                                    busy: busy.into(),
                                    replica,
                                }),
                                Err(NotSent::Failed(failure)) => Some(LinkEvent::Failed {
                                    tag,
                                    failure,
                                    replica,
                                }),
                            };
                            if let Some(event) = event {
                                events.send(event);
                            }
                            self.gauges(state);
                        }
                        drop(guard);
                        return;
                    }
                    if let Ok((next, link_id, sent_at)) = sent {
                        tracing::info!(
                            guard = %self.name,
                            from = %failed.endpoint,
                            to = %next.endpoint,
                            error = %failure,
                            "request sent to another replica"
                        );
                        self.metrics.replica_failover(&self.name, &failed.endpoint);
                        // The batch never hears of this failure: the
                        // replica's circuit does, here, once per outage
                        // (a reset stream fails every request on it at
                        // once; that is one failure of the replica).
                        if outage {
                            failed.link.record(Err(&failure));
                        }
                        // It may still move once more if this replica
                        // does not answer in time.
                        let attempt_until = if moved {
                            None
                        } else {
                            self.attempt_deadline(state, &next, &tried, sent_at, until)
                        };
                        if let Some(at) = attempt_until {
                            self.arm(state, id, at);
                        }
                        let old = state.requests.get_mut(&id).map(|pending| {
                            pending.link_id = link_id;
                            pending.sent_at = sent_at;
                            pending.attempt_until = attempt_until;
                            std::mem::replace(&mut pending.replica, next)
                        });
                        drop(guard);
                        drop(old);
                        return;
                    }
                }
                let Some(pending) = state.requests.remove(&id) else {
                    return;
                };
                drop(guard);
                (
                    pending,
                    LinkEvent::Failed {
                        tag: 0,
                        failure,
                        replica,
                    },
                )
            }
        };
        let (pending, mut event) = forward;
        match &mut event {
            LinkEvent::Answer { tag, .. }
            | LinkEvent::Failed { tag, .. }
            | LinkEvent::Shed { tag, .. } => *tag = pending.asked.tag,
        }
        // An answer was timed as it was read: the turn's time.
        let now = match &event {
            LinkEvent::Answer { answered, .. } => Some(*answered),
            LinkEvent::Failed { .. } | LinkEvent::Shed { .. } => None,
        };
        pending.asked.events.send(event);
        // A replica has room again: the next waiting request, in turn.
        {
            let mut state = self.lock();
            self.drain(&mut state, now);
            self.gauges(&mut state);
        }
        // `pending` (and the replica it may hold last) goes here, outside
        // the lock.
    }
}
