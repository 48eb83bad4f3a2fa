//! How a request to a guard fails ([`GuardFailure`]) or is not sent
//! ([`NotSent`]: a failure, or a guard too busy to take it, [`LinkBusy`]),
//! the share of a guard's queue one client may hold (R25), and which
//! failures a guard's circuit breaker hears of.

use super::breaker::{self, ConsecutiveFailures};
use super::wire;
use std::sync::Arc;
use std::time::Duration;

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
    /// R25, R13: requests waited for room at the guard while its replicas
    /// held `in_flight` requests and answered none of them for `stalled`:
    /// the guard makes no progress, a failure (not load).
    #[error(
        "makes no progress: its replicas hold {in_flight} requests and have answered none for {stalled:?}"
    )]
    NoProgress { in_flight: usize, stalled: Duration },
    /// R27: a policy guard's rule could not be evaluated for a call (a
    /// missing field, a wrong type, a cost bound): a failure, never a
    /// proceed. The text names the rule and the error.
    #[error("policy evaluation failed: {0}")]
    Policy(String),
    /// R34: the session memory the guard reads could not record a call or
    /// a result that was to pass: what cannot be remembered is not passed
    /// (R13 applies). Says nothing of the guard's own availability.
    #[error("session memory cannot remember what the batch let through: {0}")]
    SessionMemory(Arc<str>),
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
                | Self::SessionMemory(_)
        )
    }
}

impl GuardFailure {
    pub(super) fn from_status(status: &tonic::Status) -> Self {
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

/// R25: every replica of a guard holds as many requests as its limit
/// allows, and a request found no room to wait, or waited for as long as
/// the guard's time allows: load, not a failure, shed as [`LinkBusy`] is.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NoRoom {
    /// The requests waiting for room reach their bound, or this client's
    /// share of it (`guard_links.max_waiting`, [`super::fair`]).
    #[error(
        "is busy: its replicas hold {in_flight} requests (limit {limit}) and {waiting} wait for room (one client may hold {share} of them, this one holds {held}); retry with backoff"
    )]
    Full {
        in_flight: usize,
        limit: usize,
        waiting: usize,
        held: usize,
        share: usize,
    },
    /// The batch waited for room for as long as the guard's time allows
    /// waiting (half of it), while the guard kept answering others.
    #[error(
        "is busy: the batch waited {waited:?} for room while its replicas held {in_flight} requests (limit {limit}) and answered others; retry with backoff"
    )]
    Waited {
        waited: Duration,
        in_flight: usize,
        limit: usize,
    },
}

/// Why a guard is busy (R25): its link's queue is full ([`LinkBusy`]), or
/// its replicas have no room ([`NoRoom`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Busy {
    #[error(transparent)]
    Queue(#[from] LinkBusy),
    #[error(transparent)]
    NoRoom(#[from] NoRoom),
}

/// Why a request was not sent to a guard.
#[derive(Debug, Clone)]
pub enum NotSent {
    /// The guard failed (R13): its failure policy applies.
    Failed(GuardFailure),
    /// The guard is busy (R25): the batch is shed, nothing is decided.
    Busy(LinkBusy),
    /// The guard's replicas have no room (R25): shed as `Busy` is.
    NoRoom(NoRoom),
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

/// Feeds how a request ended at `now` to a guard's circuit breaker. Only
/// failures that say something about the guard's availability count
/// ([`GuardFailure::counts_for_circuit`]); the others leave it as it is.
pub(super) fn record_outcome(
    circuit: &mut ConsecutiveFailures,
    now: impl FnOnce() -> tokio::time::Instant,
    outcome: Result<(), &GuardFailure>,
) -> Option<breaker::Transition> {
    match outcome {
        // A success reads no clock: most requests end so.
        Ok(()) => circuit.record_success(),
        Err(failure) if failure.counts_for_circuit() => circuit.record_failure(now(), failure),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
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
            GuardFailure::NoProgress {
                in_flight: 2,
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
            GuardFailure::SessionMemory("the session store did not answer".into()),
        ]
    }

    #[test]
    fn circuit_counts_availability_failures_only() {
        let open_for = Duration::from_millis(300);
        let t0 = tokio::time::Instant::now();
        for failure in counting() {
            assert!(failure.counts_for_circuit(), "{failure}");
            let mut circuit = ConsecutiveFailures::new(2, open_for);
            assert_eq!(record_outcome(&mut circuit, || t0, Err(&failure)), None);
            assert_eq!(
                record_outcome(&mut circuit, || t0, Err(&failure)),
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
                assert_eq!(record_outcome(&mut circuit, || t0, Err(&failure)), None);
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
            record_outcome(&mut circuit, || t0, Err(&down));
            // Open: an uncounted failure neither extends it nor renames it.
            let t1 = t0 + open_for / 2;
            assert_eq!(record_outcome(&mut circuit, || t1, Err(&failure)), None);
            let refused = circuit.admit(t1).unwrap_err();
            assert_eq!(refused.failures, 1, "{failure}");
            assert_eq!(*refused.last, down.to_string());
            assert_eq!(refused.retry_in, open_for / 2);
            // Half-open: the probe stays out; the circuit neither closes
            // nor re-opens.
            let t2 = t0 + open_for;
            assert_eq!(circuit.admit(t2), Ok(breaker::Admitted::Probe));
            assert_eq!(record_outcome(&mut circuit, || t2, Err(&failure)), None);
            assert_eq!(circuit.admit(t2).unwrap_err().retry_in, Duration::ZERO);
            assert_eq!(
                record_outcome(&mut circuit, || t2, Ok(())),
                Some(breaker::Transition::Closed)
            );
        }
    }
}
