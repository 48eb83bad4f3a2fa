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
//! The link's parts, one concern a file: `guard_link` ([`GuardLink`] and the
//! state it shares with its stream's task), `stream` (that task: connect,
//! route answers, back off), `queue` (the requests waiting to be written,
//! bounded in bytes, R25) and `failure` (how a request fails or is not sent,
//! and what a guard's circuit hears of it). The bytes on the stream are
//! written and read in the mesh's `wire` module, re-exported here as
//! [`wire`]. Small state machines live in modules of their own, each
//! with its unit tests: `backoff` (the reconnect pauses), `breaker` (the
//! circuit breaker on consecutive failures, which takes the time as an
//! argument), `limit` (a replica's concurrency limit, adapted from its
//! latency, R25) and [`fair`] (the requests waiting for room at a guard's
//! replicas, taken in turns across clients, R25); [`pool`] puts a guard's
//! replicas together (R32).

/// A map keyed by the mesh's own request ids and client keys (never by
/// a peer's bytes): hashed by foldhash, seeded per process, a few
/// instructions a lookup where the standard SipHash takes over a hundred,
/// several lookups per guard request.
pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

mod backoff;
mod breaker;
pub mod dial;
pub mod discover;
pub mod events;
mod failure;
pub mod fair;
mod guard_link;
pub mod health;
mod limit;
#[cfg(test)]
mod paused_tests;
pub mod pool;
#[cfg(test)]
mod pool_tests;
mod queue;
#[cfg(any(test, feature = "test-util"))]
pub mod scripted;
mod stream;
pub mod transport;
/// Writing requests to guards, encoded once, and reading guards' answers off
/// the wire (R23).
pub use crate::wire::judge_stream as wire;

pub use failure::{Busy, CLIENT_SHARES, GuardFailure, LinkBusy, NoRoom, NotSent, client_share};
pub use guard_link::GuardLink;
use guardmesh_proto::v1::JudgeResponse;
use std::sync::Arc;
use std::time::Duration;
use transport::GuardTransport;

/// What a link reports to the batch that sent a request. `replica`: the
/// endpoint of the link (the replica, R32) that answered or failed.
#[derive(Debug)]
pub enum LinkEvent {
    /// An answer (possibly partial) from the guard at index `tag`.
    Answer {
        tag: usize,
        response: JudgeResponse,
        replica: Arc<str>,
        /// When the mesh read it off the guard's stream: the request's
        /// latency ends here, for the replica's limit and the guard's
        /// trace entry alike (one reading of the clock for both).
        answered: tokio::time::Instant,
    },
    /// The request to the guard at index `tag` failed.
    Failed {
        tag: usize,
        failure: GuardFailure,
        replica: Arc<str>,
    },
    /// The request to the guard at index `tag` waited for room at the
    /// guard's replicas and was shed (R25): the batch is refused with
    /// `RESOURCE_EXHAUSTED`; the guard did not fail. `replica` is empty:
    /// no replica had it.
    Shed {
        tag: usize,
        busy: Busy,
        replica: Arc<str>,
    },
}

impl LinkEvent {
    /// The tag the request was sent with.
    pub fn tag(&self) -> usize {
        match self {
            Self::Answer { tag, .. } | Self::Failed { tag, .. } | Self::Shed { tag, .. } => *tag,
        }
    }

    /// The replica that answered or failed.
    pub fn replica(&self) -> &Arc<str> {
        match self {
            Self::Answer { replica, .. }
            | Self::Failed { replica, .. }
            | Self::Shed { replica, .. } => replica,
        }
    }
}

/// Where a link reports how a request ended: a hook (the replica pool's,
/// which may send the request again to another replica before the batch
/// hears of a failure), called on the link's reader task with none of the
/// link's locks held.
#[derive(Clone)]
pub(crate) struct Report(pub(crate) Arc<dyn Fn(LinkEvent) + Send + Sync>);

impl Report {
    fn send(&self, event: LinkEvent) {
        (self.0)(event)
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
    /// The most requests one replica of a guard is sent at once (R25): the
    /// ceiling of the limit the mesh adapts from the replica's latency
    /// (`limit`). Requests past every replica's limit wait, fairly across
    /// clients (`fair`).
    pub max_in_flight: usize,
    /// The least the adapted limit falls to; equal to `max_in_flight`, a
    /// fixed limit.
    pub min_in_flight: usize,
    /// Requests that may wait for room at a guard's replicas, for all
    /// clients together; one client holds at most a quarter
    /// ([`CLIENT_SHARES`]). Past it, or after waiting half the guard's
    /// time, a batch is shed with `RESOURCE_EXHAUSTED` (R25).
    pub max_waiting: usize,
    /// How links reach their guards. `None` (the default): each guard's
    /// endpoint over gRPC ([`transport::GrpcTransport`]) with the mesh's connector.
    /// Tests put an in-memory guard here ([`scripted`]).
    pub transport: Option<Arc<dyn GuardTransport>>,
}

/// The least interval between keepalive PINGs that default gRPC servers
/// accept from a client while they send no data: grpcio's
/// `grpc.http2.min_ping_interval_without_data_ms` (300000, two strikes, then
/// GOAWAY "too_many_pings"). grpc-js servers enforce no lower bound.
pub const MIN_PEER_PING_INTERVAL: Duration = Duration::from_secs(300);

/// [`LinkConfig::max_in_flight`] by default.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;
/// [`LinkConfig::max_waiting`] by default.
pub const DEFAULT_MAX_WAITING: usize = 1024;

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
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            min_in_flight: 1,
            max_waiting: DEFAULT_MAX_WAITING,
            transport: None,
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
