//! One long-lived `Judge` stream per guard, multiplexed by request id.
//!
//! Opening a gRPC call per guard per batch costs several times the CPU of
//! sending one message on an open stream, so the mesh keeps one stream per
//! guard and tags each batch with a `request_id`. A [`GuardLink`] owns that
//! stream: a background task connects, reads answers and routes each to the
//! batch waiting for it, and reconnects with bounded exponential backoff and
//! jitter when the stream ends.
//!
//! A link never blocks a batch on a reconnect: while the guard is known to be
//! down (between attempts) a request fails at once as unreachable, and the
//! batch applies the guard's failure policy (R13). The first request on a new
//! stream is queued *before* the mesh waits for response headers, because some
//! gRPC stacks (Python's sync server) send none until their first answer.
//!
//! What a link holds and sends is bounded and polite: the requests queued for
//! a guard that does not read them are bounded in bytes (R25); answers are
//! read with [`wire::JudgeCodec`], so a verdict with a field this mesh does
//! not know fails the guard instead of reading as proceed (R23); and the link
//! pings no more often than default gRPC servers allow, leaving dead-peer
//! detection to the kernel's TCP keepalive (R26).
//!
//! Two small state machines live in modules of their own, each with its unit
//! tests: `backoff` (the reconnect pauses) and `breaker` (the circuit breaker
//! on consecutive failures, which takes the time as an argument).

mod backoff;
mod breaker;
pub mod dial;
pub mod discover;
pub mod health;
#[cfg(test)]
mod paused_tests;
pub mod pool;
#[cfg(test)]
mod pool_tests;
mod queue;
#[cfg(any(test, feature = "test-util"))]
pub mod scripted;
pub mod transport;
/// Writing requests to guards, encoded once, and reading guards' answers off
/// the wire (R23).
pub use crate::wire::judge_stream as wire;

use backoff::ExpBackoff;
use breaker::ConsecutiveFailures;
use guardmesh_proto::v1::{CancelBatch, GuardBatch, JudgeRequest, JudgeResponse, judge_request};
use prost::bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use transport::{GrpcTransport, GuardTransport, OpenError, Requests};
use wire::Encoded;

/// Why a guard could not answer a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GuardFailure {
    #[error("unreachable: {0}")]
    Unreachable(Arc<str>),
    #[error("answered with gRPC error {code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error("answered with an error: {0}")]
    Refused(String),
    #[error("closed its stream without answering")]
    StreamClosed,
    #[error("did not answer within {0:?}")]
    TimedOut(Duration),
    #[error("rewrite rejected: {0}")]
    RejectedRewrite(String),
    #[error(
        "circuit open after {failures} consecutive failures (last: {last}); next probe in {retry_in:?}"
    )]
    CircuitOpen {
        failures: u32,
        last: Arc<str>,
        retry_in: Duration,
    },
    /// R23: a verdict carried a field this mesh does not know, so what the
    /// guard meant cannot be read; it never counts as proceed.
    #[error("{0}")]
    UnknownVerdictField(wire::UnknownField),
    /// R25: the requests already queued for the guard, which it has not read
    /// off its stream, reach the link's byte bound, and it has taken none of
    /// them for `stalled`, at least its timeout. (A guard that is slow but
    /// takes requests is busy, not failed: see [`LinkBusy`].)
    #[error(
        "is not reading its stream: {queued} bytes of earlier requests are still queued for it (bound {limit} bytes) and it has taken none for {stalled:?}"
    )]
    NotReading {
        queued: usize,
        limit: usize,
        stalled: Duration,
    },
    /// R27: a policy guard's rule could not be evaluated for a call (a
    /// missing field, a wrong type, a cost bound): a failure, never a
    /// proceed. The text names the rule and the error.
    #[error("policy evaluation failed: {0}")]
    Policy(String),
}

impl GuardFailure {
    /// Whether this failure says something about the guard's availability
    /// (and so counts towards opening its circuit). A rejected rewrite is a
    /// policy bug, not an outage, and so is a verdict the mesh cannot read
    /// (a protocol mismatch); an open circuit is not a new failure.
    pub fn counts_for_circuit(&self) -> bool {
        !matches!(
            self,
            Self::RejectedRewrite(_)
                | Self::CircuitOpen { .. }
                | Self::UnknownVerdictField(_)
                | Self::Policy(_)
        )
    }
}

impl GuardFailure {
    fn from_status(status: &tonic::Status) -> Self {
        Self::Status {
            code: status.code(),
            message: status.message().to_owned(),
        }
    }
}

/// R25: a guard's queue has no room for a request while the guard is making
/// progress: load, not a failure. The batch is shed with
/// `RESOURCE_EXHAUSTED` to its own client; the guard's circuit hears
/// nothing of it and no call is cancelled.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "is busy: {queued} bytes of requests are already queued for it (bound {limit} bytes; one client may hold {share} bytes, this one holds {held}); retry with backoff"
)]
pub struct LinkBusy {
    /// Bytes queued for the guard in all.
    pub queued: usize,
    /// The link's bound (`guard_links.max_queued_bytes`).
    pub limit: usize,
    /// Bytes the sending client holds in the queue.
    pub held: usize,
    /// Bytes one client may hold ([`client_share`]).
    pub share: usize,
}

/// Why a request was not sent to a guard.
#[derive(Debug, Clone)]
pub enum NotSent {
    /// The guard failed (R13): its failure policy applies.
    Failed(GuardFailure),
    /// The guard is busy (R25): the batch is shed, nothing is decided.
    Busy(LinkBusy),
}

impl From<GuardFailure> for NotSent {
    fn from(failure: GuardFailure) -> Self {
        Self::Failed(failure)
    }
}

/// The bytes of a guard's queue one client (a coordinator connection) may
/// hold once it holds any: a quarter of the queue's bound, so that one
/// client cannot fill the queue that every client shares (R25). A client
/// holding nothing always gets one request in, within the queue's bound.
pub fn client_share(max_queued_bytes: usize) -> usize {
    (max_queued_bytes / CLIENT_SHARES).max(1)
}

/// How many clients' shares a guard's queue holds ([`client_share`]).
pub const CLIENT_SHARES: usize = 4;

/// What a link reports to the batch that sent a request. `replica`: the
/// endpoint of the link (the replica, R32) that answered or failed.
#[derive(Debug)]
pub enum LinkEvent {
    /// An answer (possibly partial) from the guard at index `tag`.
    Answer {
        tag: usize,
        response: JudgeResponse,
        replica: Arc<str>,
    },
    /// The request to the guard at index `tag` failed.
    Failed {
        tag: usize,
        failure: GuardFailure,
        replica: Arc<str>,
    },
}

impl LinkEvent {
    /// The replica that answered or failed.
    pub fn replica(&self) -> &Arc<str> {
        match self {
            Self::Answer { replica, .. } | Self::Failed { replica, .. } => replica,
        }
    }
}

/// Where a link reports how a request ended: the sending batch's channel,
/// or a hook (the replica pool's, which may send the request again to
/// another replica before the batch hears of a failure). A hook is called
/// on the link's reader task with none of the link's locks held.
#[derive(Clone)]
pub(crate) enum Report {
    Channel(mpsc::UnboundedSender<LinkEvent>),
    Hook(Arc<dyn Fn(LinkEvent) + Send + Sync>),
}

impl Report {
    fn send(&self, event: LinkEvent) {
        match self {
            Self::Channel(events) => {
                let _ = events.send(event);
            }
            Self::Hook(hook) => hook(event),
        }
    }
}

/// Settings for connecting to guards.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    pub connect_timeout: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Largest answer accepted from a guard.
    pub max_decoding_message_size: usize,
    /// Largest request sent to a guard.
    pub max_encoding_message_size: usize,
    /// Consecutive failures that open a guard's circuit; 0 disables it.
    pub circuit_failures: u32,
    /// How long an open circuit fails requests at once before it lets one
    /// probe request through (half-open).
    pub circuit_open_for: Duration,
    /// HTTP/2 PING after this long without a frame from the guard; zero
    /// turns pings off. Default gRPC servers (grpcio) allow a client one
    /// ping per 5 minutes while they send nothing, and answer more with
    /// GOAWAY "too_many_pings" (R26): see [`MIN_PEER_PING_INTERVAL`].
    pub keepalive_interval: Duration,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// A guard connection whose peer is gone (host down, no FIN) is closed
    /// within about this long, by TCP keepalive probes on an idle socket and
    /// `TCP_USER_TIMEOUT` on one with unacknowledged data: the kernel's
    /// probes, which no gRPC ping policy sees. Zero turns both off.
    pub dead_peer_timeout: Duration,
    /// Bytes of requests the mesh queues for a guard that has not read them
    /// off its stream yet (R25). Past it, a batch fails at that guard at
    /// once, per its failure policy. A request is always admitted to an
    /// empty queue, whatever its size.
    pub max_queued_bytes: usize,
    /// How often a guard endpoint that is a DNS name is resolved again for
    /// its replicas (R32); a failed connection to one of them asks sooner.
    pub resolve_interval: Duration,
    /// How links reach their guards. `None` (the default): each guard's
    /// endpoint over gRPC ([`GrpcTransport`]) with the mesh's connector.
    /// Tests put an in-memory guard here ([`scripted`]).
    pub transport: Option<Arc<dyn GuardTransport>>,
}

/// The least interval between keepalive PINGs that default gRPC servers
/// accept from a client while they send no data: grpcio's
/// `grpc.http2.min_ping_interval_without_data_ms` (300000, two strikes, then
/// GOAWAY "too_many_pings"). grpc-js servers enforce no lower bound.
pub const MIN_PEER_PING_INTERVAL: Duration = Duration::from_secs(300);

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_decoding_message_size: 4 * 1024 * 1024,
            max_encoding_message_size: 16 * 1024 * 1024,
            circuit_failures: 5,
            circuit_open_for: Duration::from_secs(5),
            keepalive_interval: MIN_PEER_PING_INTERVAL,
            keepalive_timeout: Duration::from_secs(20),
            dead_peer_timeout: Duration::from_secs(30),
            max_queued_bytes: 16 * 1024 * 1024,
            resolve_interval: crate::link::discover::dns::DEFAULT_RESOLVE_INTERVAL,
            transport: None,
        }
    }
}

struct Waiter {
    tag: usize,
    events: Report,
}

/// The requests waiting to be written to one stream, encoded, with the
/// client that queued each, and their bytes ([`queue::Load`]).
struct Queue {
    tx: mpsc::UnboundedSender<(Encoded, queue::Client)>,
    load: Arc<Mutex<queue::Load>>,
}

impl Queue {
    fn new() -> (
        Self,
        impl tokio_stream::Stream<Item = Encoded> + Send + 'static,
    ) {
        let (tx, rx) = mpsc::unbounded_channel::<(Encoded, queue::Client)>();
        let load = Arc::new(Mutex::new(queue::Load::new(tokio::time::Instant::now())));
        let taken = load.clone();
        let stream = UnboundedReceiverStream::new(rx).map(move |(request, client)| {
            taken.lock().unwrap_or_else(PoisonError::into_inner).remove(
                request.len(),
                client,
                tokio::time::Instant::now(),
                true,
            );
            request
        });
        (Self { tx, load }, stream)
    }

    fn load(&self) -> std::sync::MutexGuard<'_, queue::Load> {
        self.load.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `len` bytes from `client` would be queued now.
    fn check(
        &self,
        len: usize,
        client: queue::Client,
        bounds: queue::Bounds,
    ) -> Result<(), queue::Refusal> {
        self.load()
            .check(len, client, bounds, tokio::time::Instant::now())
    }

    /// Queues `request` from `client` within `bounds` (see [`queue::Load`]).
    fn push(
        &self,
        request: Encoded,
        client: queue::Client,
        bounds: queue::Bounds,
    ) -> Result<(), QueueError> {
        let len = request.len();
        let now = tokio::time::Instant::now();
        {
            let mut load = self.load();
            load.check(len, client, bounds, now)
                .map_err(QueueError::Refused)?;
            load.add(len, client, now);
        }
        self.tx.send((request, client)).map_err(|_| {
            self.load().remove(len, client, now, false);
            QueueError::Closed
        })
    }
}

enum QueueError {
    Refused(queue::Refusal),
    Closed,
}

enum Conn {
    /// A stream is being opened or is open; requests go into the queue.
    Open(Queue),
    /// The last attempt failed; requests fail fast until the next attempt.
    Down(Arc<str>),
}

struct State {
    conn: Conn,
    waiting: HashMap<u64, Waiter>,
    /// The guard's circuit breaker: after `circuit_failures` consecutive
    /// failures the guard's failure policy applies at once, without waiting
    /// for timeouts, until a probe request succeeds. An open circuit is a
    /// failure like any other (R13): under `fail_closed` it blocks, it never
    /// bypasses.
    circuit: ConsecutiveFailures,
    /// Why the last stream ended or could not be opened, until a stream
    /// opens again ([`GuardLink::down_reason`]).
    last_failure: Option<Arc<str>>,
}

struct Shared {
    name: String,
    max_queued_bytes: usize,
    circuit_open_for: Duration,
    metrics: Arc<crate::observe::metrics::Metrics>,
    endpoint: Arc<str>,
    state: Mutex<State>,
    next_id: AtomicU64,
    /// Whether the current outage was already logged.
    outage: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Marks an outage; true when it is a new one (to be logged).
    fn outage_started(&self) -> bool {
        !self.outage.swap(true, Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the guard that `request_id` no longer matters. Within the queue's
    /// bound only: a guard that does not read gets no more to not read.
    fn send_cancel(&self, state: &State, request_id: u64) {
        if let Conn::Open(queue) = &state.conn {
            let _ = queue.push(
                Encoded::request(&JudgeRequest {
                    kind: Some(judge_request::Kind::Cancel(CancelBatch { request_id })),
                }),
                queue::CONTROL,
                queue::Bounds::control(self.max_queued_bytes),
            );
        }
    }

    /// Fails every waiting request and moves to `conn`.
    fn fail_all(&self, failure: GuardFailure, conn: Conn) {
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
    health: Arc<health::Health>,
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
            circuit_open_for: config.circuit_open_for,
            metrics,
            endpoint: Arc::from(endpoint),
            state: Mutex::new(State {
                conn: Conn::Open(queue),
                waiting: HashMap::new(),
                circuit: ConsecutiveFailures::new(config.circuit_failures, config.circuit_open_for),
                last_failure: None,
            }),
            next_id: AtomicU64::new(1),
            outage: std::sync::atomic::AtomicBool::new(false),
        });
        let task =
            tokio::spawn(run(shared.clone(), config, transport, Box::pin(requests))).abort_handle();
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

    /// The endpoint this link dials.
    pub fn endpoint(&self) -> &str {
        &self.shared.endpoint
    }

    /// Sends `batch` (its `request_id` is assigned here) with `shared`, its
    /// context and calls as [`wire::shared_part`] encoded them: `batch`'s
    /// own `context` and `calls` are left empty. The answer or the failure
    /// arrives on `events`, tagged with `tag`. Fails at once when the guard
    /// is known to be down.
    ///
    /// `client` is the sending coordinator connection's key: it holds at
    /// most its [`client_share`] of the queue. When the queue has no room,
    /// the guard is busy ([`NotSent::Busy`]) unless its stream has taken
    /// nothing for `stall` (its timeout): then it is not reading, a failure.
    pub fn send(
        &self,
        batch: GuardBatch,
        shared: Bytes,
        tag: usize,
        events: &mpsc::UnboundedSender<LinkEvent>,
        client: u64,
        stall: Duration,
    ) -> Result<u64, NotSent> {
        self.send_to(
            batch,
            shared,
            tag,
            Report::Channel(events.clone()),
            client,
            stall,
        )
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

    /// [`Self::send`], reporting to `events`.
    pub(crate) fn send_to(
        &self,
        mut batch: GuardBatch,
        shared: Bytes,
        tag: usize,
        events: Report,
        client: u64,
        stall: Duration,
    ) -> Result<u64, NotSent> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        batch.request_id = id;
        // Encoded once, outside the lock; the calls' bytes are shared with
        // the other guards sent the same calls.
        let request = Encoded::batch(&batch, shared);
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
                .check(request.len(), client, bounds)
                .map_err(|refusal| self.refused(refusal))?;
        }
        state
            .circuit
            .admit(tokio::time::Instant::now())
            .map_err(|refused| GuardFailure::CircuitOpen {
                failures: refused.failures,
                last: refused.last,
                retry_in: refused.retry_in,
            })?;
        let queue = match &state.conn {
            Conn::Open(queue) => queue,
            Conn::Down(error) => return Err(GuardFailure::Unreachable(error.clone()).into()),
        };
        match queue.push(request, client, bounds) {
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
            record_outcome(&mut state.circuit, tokio::time::Instant::now(), outcome)
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

/// Feeds how a request ended at `now` to a guard's circuit breaker. Only
/// failures that say something about the guard's availability count
/// ([`GuardFailure::counts_for_circuit`]); the others leave it as it is.
fn record_outcome(
    circuit: &mut ConsecutiveFailures,
    now: tokio::time::Instant,
    outcome: Result<(), &GuardFailure>,
) -> Option<breaker::Transition> {
    match outcome {
        Ok(()) => circuit.record_success(),
        Err(failure) if failure.counts_for_circuit() => circuit.record_failure(now, failure),
        Err(_) => None,
    }
}

/// The link's life: connect, serve one stream, back off, repeat.
async fn run(
    shared: Arc<Shared>,
    config: LinkConfig,
    transport: Arc<dyn GuardTransport>,
    first: Requests,
) {
    let mut first = Some(first);
    let mut backoff = ExpBackoff::new(
        config.backoff_initial,
        config.backoff_max,
        ExpBackoff::LINK_JITTER,
    );
    loop {
        let requests = match first.take() {
            Some(requests) => requests,
            None => {
                let (queue, requests) = Queue::new();
                shared.lock().conn = Conn::Open(queue);
                Box::pin(requests) as Requests
            }
        };
        let answered = serve_stream(&shared, &config, transport.as_ref(), requests).await;
        if answered {
            backoff.reset();
        }
        // Jitter over the current step keeps a fleet of meshes from
        // reconnecting to a restarted guard in lockstep.
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Opens one stream and routes its answers until it ends. Returns whether the
/// guard answered anything (to reset the backoff).
async fn serve_stream(
    shared: &Shared,
    config: &LinkConfig,
    transport: &dyn GuardTransport,
    requests: Requests,
) -> bool {
    let mut answers = match transport.open(&shared.endpoint, config, requests).await {
        Ok(answers) => answers,
        Err(error @ OpenError::BadEndpoint { .. }) => {
            let reason: Arc<str> = error.to_string().into();
            shared.fail_all(
                GuardFailure::Unreachable(reason.clone()),
                Conn::Down(reason),
            );
            return false;
        }
        Err(error @ OpenError::Unreachable { .. }) => {
            let reason: Arc<str> = error.to_string().into();
            // Warn once per outage; the retries that follow log at debug.
            if shared.outage_started() {
                tracing::warn!(guard = %shared.name, error = %reason, "guard unreachable; retrying with backoff");
            } else {
                tracing::debug!(guard = %shared.name, error = %reason, "guard still unreachable");
            }
            shared.fail_all(
                GuardFailure::Unreachable(reason.clone()),
                Conn::Down(reason),
            );
            return false;
        }
        Err(OpenError::Refused(status)) => {
            tracing::warn!(guard = %shared.name, %status, "guard refused the Judge stream");
            let reason: Arc<str> = format!("Judge stream refused: {status}").into();
            shared.fail_all(GuardFailure::from_status(&status), Conn::Down(reason));
            return false;
        }
    };
    tracing::debug!(guard = %shared.name, endpoint = %shared.endpoint, "guard stream open");
    shared.metrics.guard_stream_opened(&shared.name);
    shared.outage.store(false, Ordering::Relaxed);
    shared.lock().last_failure = None;
    let mut answered = false;
    let (failure, reason): (GuardFailure, Arc<str>) = loop {
        match answers.next().await {
            Some(Ok(answer)) => {
                answered = true;
                route(shared, answer);
            }
            None => break (GuardFailure::StreamClosed, "guard closed its stream".into()),
            Some(Err(status)) => {
                break (
                    GuardFailure::from_status(&status),
                    format!("stream failed: {status}").into(),
                );
            }
        }
    };
    tracing::warn!(guard = %shared.name, error = %failure, "guard stream ended");
    shared.fail_all(failure, Conn::Down(reason));
    answered
}

/// Hands an answer to the batch waiting for it. Answers for requests that
/// are not waiting (cancelled, timed out, unknown) are dropped and counted.
/// An answer whose verdicts carry a field this mesh does not know fails its
/// request (R23), partial or not: the guard is told to stop work on it.
fn route(shared: &Shared, answer: wire::Answer) {
    let wire::Answer { response, unknown } = answer;
    let id = response.request_id;
    let mut state = shared.lock();
    let waiter = if response.partial && unknown.is_none() {
        state.waiting.get(&id).map(|w| (w.tag, w.events.clone()))
    } else {
        state.waiting.remove(&id).map(|w| (w.tag, w.events))
    };
    if waiter.is_some() && response.partial && unknown.is_some() {
        shared.send_cancel(&state, id);
    }
    drop(state);
    let replica = shared.endpoint.clone();
    match (waiter, unknown) {
        (Some((tag, events)), None) => {
            events.send(LinkEvent::Answer {
                tag,
                response,
                replica,
            });
        }
        (Some((tag, events)), Some(field)) => {
            events.send(LinkEvent::Failed {
                tag,
                failure: GuardFailure::UnknownVerdictField(field),
                replica,
            });
        }
        (None, _) => {
            shared.metrics.spurious_answer(&shared.name);
            tracing::debug!(guard = %shared.name, request_id = id, "answer for a request no one waits for");
        }
    }
}

/// Renders an error with its sources, walking the chain rather than relying
/// on one layer's `Display`.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::transport::DeadPeerConnector;
    use super::*;

    /// Failures that say something about a guard's availability.
    fn counting() -> Vec<GuardFailure> {
        vec![
            GuardFailure::Unreachable("connection refused".into()),
            GuardFailure::Status {
                code: tonic::Code::Unavailable,
                message: "down".into(),
            },
            GuardFailure::Refused("busy".into()),
            GuardFailure::StreamClosed,
            GuardFailure::TimedOut(Duration::from_secs(1)),
            GuardFailure::NotReading {
                queued: 2,
                limit: 1,
                stalled: Duration::from_secs(1),
            },
        ]
    }

    /// Failures that do not: a policy bug, a protocol mismatch, an open
    /// circuit.
    fn not_counting() -> Vec<GuardFailure> {
        vec![
            GuardFailure::RejectedRewrite("bad arguments".into()),
            GuardFailure::CircuitOpen {
                failures: 3,
                last: "down".into(),
                retry_in: Duration::from_secs(1),
            },
            GuardFailure::UnknownVerdictField(wire::UnknownField {
                message: "Verdict",
                number: 4,
            }),
        ]
    }

    #[test]
    fn circuit_counts_availability_failures_only() {
        let open_for = Duration::from_millis(300);
        let t0 = tokio::time::Instant::now();
        for failure in counting() {
            assert!(failure.counts_for_circuit(), "{failure}");
            let mut circuit = ConsecutiveFailures::new(2, open_for);
            assert_eq!(record_outcome(&mut circuit, t0, Err(&failure)), None);
            assert_eq!(
                record_outcome(&mut circuit, t0, Err(&failure)),
                Some(breaker::Transition::Opened { failures: 2 }),
                "{failure}"
            );
            let refused = circuit.admit(t0).unwrap_err();
            assert_eq!(*refused.last, failure.to_string());
        }
        for failure in not_counting() {
            assert!(!failure.counts_for_circuit(), "{failure}");
            let mut circuit = ConsecutiveFailures::new(2, open_for);
            for _ in 0..10 {
                assert_eq!(record_outcome(&mut circuit, t0, Err(&failure)), None);
            }
            assert_eq!(
                circuit.admit(t0),
                Ok(breaker::Admitted::Closed),
                "{failure}"
            );
        }
    }

    #[test]
    fn circuit_failures_that_do_not_count_leave_an_open_circuit_and_its_probe_alone() {
        let open_for = Duration::from_millis(300);
        let t0 = tokio::time::Instant::now();
        let down = GuardFailure::StreamClosed;
        for failure in not_counting() {
            let mut circuit = ConsecutiveFailures::new(1, open_for);
            record_outcome(&mut circuit, t0, Err(&down));
            // Open: an uncounted failure neither extends it nor renames it.
            let t1 = t0 + open_for / 2;
            assert_eq!(record_outcome(&mut circuit, t1, Err(&failure)), None);
            let refused = circuit.admit(t1).unwrap_err();
            assert_eq!(refused.failures, 1, "{failure}");
            assert_eq!(*refused.last, down.to_string());
            assert_eq!(refused.retry_in, open_for / 2);
            // Half-open: the probe stays out; the circuit neither closes
            // nor re-opens.
            let t2 = t0 + open_for;
            assert_eq!(circuit.admit(t2), Ok(breaker::Admitted::Probe));
            assert_eq!(record_outcome(&mut circuit, t2, Err(&failure)), None);
            assert_eq!(circuit.admit(t2).unwrap_err().retry_in, Duration::ZERO);
            assert_eq!(
                record_outcome(&mut circuit, t2, Ok(())),
                Some(breaker::Transition::Closed)
            );
        }
    }

    #[tokio::test]
    async fn r26_guard_sockets_get_tcp_keepalive_and_a_user_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.map(|(s, _)| s) });
        let mut connector = DeadPeerConnector {
            inner: crate::link::dial::GuardConnector {
                policy: Arc::new(crate::link::dial::EndpointPolicy::default()),
                tls: None,
                pin: None,
                https: false,
                connect_timeout: Duration::from_secs(2),
            },
            timeout: Duration::from_secs(30),
        };
        let uri: http::Uri = format!("http://{addr}").parse().unwrap();
        let io = tower::Service::call(&mut connector, uri).await.unwrap();
        let _peer = accept.await.unwrap().unwrap();
        let crate::link::dial::GuardIo::Plain(tcp) = io.inner() else {
            panic!("plaintext guard");
        };
        let socket = socket2::SockRef::from(tcp);
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            Duration::from_secs(15)
        );
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
        #[cfg(target_os = "linux")]
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(30))
        );
    }
}
