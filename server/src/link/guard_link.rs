//! The mesh's connection to one guard: [`GuardLink`], through which
//! batches send requests and withdraw them, and the state it shares with
//! the task that runs its stream (`stream.rs`): the queue, or why the
//! guard is down; the requests waiting for an answer; the circuit breaker.

use super::breaker::{self, ConsecutiveFailures};
use super::failure::{GuardFailure, LinkBusy, NotSent, client_share, record_outcome};
use super::queue::{self, Queue, QueueError};
use super::transport::{GrpcTransport, GuardTransport};
use super::wire::{Encoded, Head};
use super::{LinkConfig, LinkEvent, MIN_PEER_PING_INTERVAL, Report, health, stream};
use guardmesh_proto::v1::{CancelBatch, JudgeRequest, judge_request};
use prost::bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

pub(super) struct Waiter {
    pub(super) tag: usize,
    pub(super) events: Report,
}

pub(super) enum Conn {
    /// A stream is being opened or is open; requests go into the queue.
    Open(Queue),
    /// The last attempt failed; requests fail fast until the next attempt.
    Down(Arc<str>),
}

pub(super) struct State {
    pub(super) conn: Conn,
    pub(super) waiting: super::IdMap<u64, Waiter>,
    /// The guard's circuit breaker: after `circuit_failures` consecutive
    /// failures the guard's failure policy applies at once, without waiting
    /// for timeouts, until a probe request succeeds. An open circuit is a
    /// failure like any other (R13): under `fail_closed` it blocks, it never
    /// bypasses.
    circuit: ConsecutiveFailures,
    /// Why the last stream ended or could not be opened, until a stream
    /// opens again ([`GuardLink::down_reason`]).
    pub(super) last_failure: Option<Arc<str>>,
}

pub(super) struct Shared {
    pub(super) name: String,
    max_queued_bytes: usize,
    /// `LinkConfig::min_in_flight`, `max_in_flight` and `max_waiting`,
    /// read by the pool.
    flow: (usize, usize, usize),
    circuit_open_for: Duration,
    pub(super) metrics: Arc<crate::observe::metrics::Metrics>,
    pub(super) endpoint: Arc<str>,
    state: Mutex<State>,
    next_id: AtomicU64,
    /// Whether the current outage was already logged.
    pub(super) outage: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Marks an outage; true when it is a new one (to be logged).
    pub(super) fn outage_started(&self) -> bool {
        !self.outage.swap(true, Ordering::Relaxed)
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the guard that `request_id` no longer matters. Within the queue's
    /// bound only: a guard that does not read gets no more to not read.
    pub(super) fn send_cancel(&self, state: &State, request_id: u64) {
        if let Conn::Open(queue) = &state.conn {
            let _ = queue.push(
                Encoded::request(&JudgeRequest {
                    kind: Some(judge_request::Kind::Cancel(CancelBatch { request_id })),
                }),
                queue::CONTROL,
                queue::Bounds::control(self.max_queued_bytes),
                tokio::time::Instant::now(),
            );
        }
    }

    /// Fails every waiting request and moves to `conn`.
    pub(super) fn fail_all(&self, failure: GuardFailure, conn: Conn) {
        let waiting = {
            let mut state = self.lock();
            if let Conn::Down(reason) = &conn {
                state.last_failure = Some(reason.clone());
            }
            state.conn = conn;
            std::mem::take(&mut state.waiting)
        };
        for (_, waiter) in waiting {
            waiter.events.send(LinkEvent::Failed {
                tag: waiter.tag,
                failure: failure.clone(),
                replica: self.endpoint.clone(),
            });
        }
    }
}

/// The mesh's connection to one guard.
pub struct GuardLink {
    shared: Arc<Shared>,
    task: tokio::task::AbortHandle,
    pin: Option<String>,
    /// What the guard's health watch last said (R32: draining).
    pub(super) health: Arc<health::Health>,
}

impl std::fmt::Debug for GuardLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardLink")
            .field("name", &self.shared.name)
            .field("endpoint", &self.shared.endpoint)
            .finish()
    }
}

impl Drop for GuardLink {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.fail_all(
            GuardFailure::Unreachable("guard link closed".into()),
            Conn::Down("guard link closed".into()),
        );
    }
}

impl GuardLink {
    /// Starts connecting to `endpoint` in the background, over gRPC with
    /// `connector` (or over `config.transport` when set). Must be called
    /// within a tokio runtime.
    pub fn spawn(
        name: &str,
        endpoint: &str,
        config: LinkConfig,
        connector: crate::link::dial::GuardConnector,
        metrics: Arc<crate::observe::metrics::Metrics>,
    ) -> Self {
        let pin = connector.pin.clone();
        let health = Arc::new(health::Health::default());
        let transport = match &config.transport {
            Some(transport) => transport.clone(),
            None => Arc::new(
                GrpcTransport::new(connector, config.dead_peer_timeout).with_health(
                    name,
                    health.clone(),
                    metrics.clone(),
                ),
            ),
        };
        let mut link = Self::spawn_with(name, endpoint, config, transport, pin, metrics);
        link.health = health;
        link
    }

    /// Starts connecting to `endpoint` in the background over `transport`;
    /// `pin` is the identity the transport requires of the guard, if any
    /// ([`Self::pin`]). Must be called within a tokio runtime.
    pub fn spawn_with(
        name: &str,
        endpoint: &str,
        config: LinkConfig,
        transport: Arc<dyn GuardTransport>,
        pin: Option<String>,
        metrics: Arc<crate::observe::metrics::Metrics>,
    ) -> Self {
        if !config.keepalive_interval.is_zero()
            && config.keepalive_interval < MIN_PEER_PING_INTERVAL
        {
            tracing::warn!(
                guard = %name,
                interval = ?config.keepalive_interval,
                "keepalive pings more often than every 5 minutes: a guard on a default gRPC server \
                 (grpcio) answers them with GOAWAY too_many_pings and its link is dropped"
            );
        }
        let (queue, requests) = Queue::new();
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            max_queued_bytes: config.max_queued_bytes,
            flow: (
                config.min_in_flight,
                config.max_in_flight,
                config.max_waiting,
            ),
            circuit_open_for: config.circuit_open_for,
            metrics,
            endpoint: Arc::from(endpoint),
            state: Mutex::new(State {
                conn: Conn::Open(queue),
                waiting: super::IdMap::default(),
                circuit: ConsecutiveFailures::new(config.circuit_failures, config.circuit_open_for),
                last_failure: None,
            }),
            next_id: AtomicU64::new(1),
            outage: std::sync::atomic::AtomicBool::new(false),
        });
        let task = tokio::spawn(stream::run(
            shared.clone(),
            config,
            transport,
            Box::pin(requests),
        ))
        .abort_handle();
        Self {
            shared,
            task,
            pin,
            health: Arc::default(),
        }
    }

    /// Whether the guard said, on its health watch, that it does not serve
    /// (`NOT_SERVING`): it is draining, and should get no new requests.
    pub fn draining(&self) -> bool {
        self.health.draining()
    }

    /// The identity this link requires of the guard, if pinned.
    pub fn pin(&self) -> Option<&str> {
        self.pin.as_deref()
    }

    /// The bounds of the replica's limit of requests at once, and the
    /// most requests that may wait for room at the guard
    /// (`LinkConfig::min_in_flight`, `max_in_flight`, `max_waiting`).
    pub(crate) fn flow(&self) -> (usize, usize, usize) {
        self.shared.flow
    }

    /// The endpoint this link dials.
    pub fn endpoint(&self) -> &str {
        &self.shared.endpoint
    }

    /// Whether the link's last connection attempt failed and it waits to
    /// try again: a request sent now fails at once.
    pub fn is_down(&self) -> bool {
        matches!(self.shared.lock().conn, Conn::Down(_))
    }

    /// Why the link's last stream ended or could not be opened (a refused
    /// connection, a certificate that is not the pinned identity, ...),
    /// while no stream has opened since: `None` once one is open.
    pub fn down_reason(&self) -> Option<Arc<str>> {
        self.shared.lock().last_failure.clone()
    }

    /// Sends a batch of `head`'s fields (its `request_id` is assigned here)
    /// with `shared`, its context and calls as [`super::wire::shared_part`]
    /// encoded them. The answer or the failure is reported to `events`,
    /// tagged with `tag`. Fails at once when the guard is known to be down.
    ///
    /// `client` is the sending coordinator connection's key: it holds at
    /// most its [`client_share`] of the queue. When the queue has no room,
    /// the guard is busy ([`NotSent::Busy`]) unless its stream has taken
    /// nothing for `stall` (its timeout): then it is not reading, a failure.
    /// `now`: the time of the send, read once by the caller for the room,
    /// the circuit and the queue.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send(
        &self,
        head: &Head,
        shared: Bytes,
        tag: usize,
        events: Report,
        client: u64,
        stall: Duration,
        now: tokio::time::Instant,
    ) -> Result<u64, NotSent> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        // Encoded once, outside the lock; the calls' bytes are shared with
        // the other guards sent the same calls.
        let request = Encoded::head_as(head, id, shared);
        // A client's own key never collides with the mesh's.
        let client = if client == queue::CONTROL { 0 } else { client };
        let bounds = queue::Bounds {
            limit: self.shared.max_queued_bytes,
            share: client_share(self.shared.max_queued_bytes),
            stall,
        };
        let mut state = self.shared.lock();
        // Room first: a batch shed for load neither takes the circuit's
        // half-open probe nor tells the circuit anything. All pushes happen
        // under the state's lock, so the room is still there below.
        if let Conn::Open(queue) = &state.conn {
            queue
                .check(request.len(), client, bounds, now)
                .map_err(|refusal| self.refused(refusal))?;
        }
        state
            .circuit
            .admit(now)
            .map_err(|refused| GuardFailure::CircuitOpen {
                failures: refused.failures,
                last: refused.last,
                retry_in: refused.retry_in,
            })?;
        let queue = match &state.conn {
            Conn::Open(queue) => queue,
            Conn::Down(error) => return Err(GuardFailure::Unreachable(error.clone()).into()),
        };
        match queue.push(request, client, bounds, now) {
            Ok(()) => {}
            Err(QueueError::Closed) => {
                return Err(GuardFailure::Unreachable("stream is closing".into()).into());
            }
            Err(QueueError::Refused(refusal)) => return Err(self.refused(refusal)),
        }
        state.waiting.insert(id, Waiter { tag, events });
        Ok(id)
    }

    /// What a queue's refusal means for the batch, counted.
    fn refused(&self, refusal: queue::Refusal) -> NotSent {
        let limit = self.shared.max_queued_bytes;
        match refusal {
            queue::Refusal::Busy { queued, held } => NotSent::Busy(LinkBusy {
                queued,
                limit,
                held,
                share: client_share(limit),
            }),
            queue::Refusal::Stalled { queued, stalled } => {
                NotSent::Failed(GuardFailure::NotReading {
                    queued,
                    limit,
                    stalled,
                })
            }
        }
    }

    /// Records how a request to this guard ended, for its circuit breaker.
    pub fn record(&self, outcome: Result<(), &GuardFailure>) {
        let transition = {
            let mut state = self.shared.lock();
            record_outcome(&mut state.circuit, tokio::time::Instant::now, outcome)
        };
        match (transition, outcome) {
            (Some(breaker::Transition::Closed), _) => {
                tracing::info!(guard = %self.shared.name, "circuit closed: probe succeeded");
            }
            (
                Some(
                    breaker::Transition::Opened { failures }
                    | breaker::Transition::Reopened { failures },
                ),
                Err(failure),
            ) => {
                tracing::warn!(
                    guard = %self.shared.name,
                    failures,
                    error = %failure,
                    "circuit open: the guard's failure policy applies at once for {:?}",
                    self.shared.circuit_open_for
                );
                self.shared.metrics.circuit_opened(&self.shared.name);
            }
            _ => {}
        }
    }

    /// Withdraws a request: its answer no longer matters (R5, or a timeout).
    /// The guard is told so it can stop work; a late answer is ignored.
    pub fn cancel(&self, request_id: u64) {
        let mut state = self.shared.lock();
        if state.waiting.remove(&request_id).is_some() {
            self.shared.send_cancel(&state, request_id);
        }
    }
}
