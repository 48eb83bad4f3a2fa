//! The admission stage: everything a batch must pass before any guard sees
//! it, each check once, each refusal typed ([`Refusal`]) and turned into
//! its gRPC status in one place ([`Refusal::status`]).
//!
//! * the batch's content: sizes, counts, ids and I-JSON arguments (R20),
//!   checked on the wire by `grpc/inbound.rs` and here by [`content`];
//! * its stream: ids unique in flight (R19), batches judged at once
//!   ([`StreamGate`]);
//! * the mesh's budgets: batches and bytes in flight ([`inflight`],
//!   [`inflight_bytes`]) (R25);
//! * the registry's freshness ([`registry`]);
//! * R1: a batch without calls contacts no guard ([`contacts_guards`]):
//!   it takes no slot and no bytes, and is answered at once.
//!
//! Admission decides nothing about calls and writes nothing: a refusal is
//! handed to the batch's record (`mesh/record.rs`), which counts, logs and
//! records it.

pub(crate) mod result_batch;

use crate::registry::Registry;
use crate::validate::ijson::Recorded;
use crate::validate::{self, Limits};
use guardmesh_proto::v1::EvaluateRequest;
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// Why a batch was refused before any guard saw it. Its text is the
/// message of its status.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The batch breaks a rule of its content: a size, a count, an id,
    /// its arguments' I-JSON, the reserved id prefix (R20).
    #[error("{}", .0.status.message())]
    Invalid(validate::Refusal),
    /// The mesh is draining (R25).
    #[error("the mesh is shutting down; send this batch to another replica")]
    ShuttingDown,
    /// Its id is already in flight on its stream (R19); the id as shown.
    #[error("batch_id {0:?} is already in flight on this stream")]
    DuplicateId(String),
    /// Its stream has `limits.max_batches_per_stream` batches being judged.
    #[error(
        "{0} batches already in flight on this stream (limits.max_batches_per_stream); wait for answers"
    )]
    StreamOverloaded(usize),
    /// The mesh holds `limits.max_inflight_bytes` of batches (R25).
    #[error(
        "mesh overloaded: {0} bytes of batches already in flight (limits.max_inflight_bytes); retry with backoff"
    )]
    OverloadedBytes(usize),
    /// The mesh judges `limits.max_inflight_batches` batches (R25).
    #[error("mesh overloaded: {0} batches already in flight; retry with backoff")]
    Overloaded(usize),
    /// A coordinator stream, not a batch: `limits.max_coordinator_streams`
    /// streams are open (R25).
    #[error(
        "{0} coordinator streams are already open on this mesh (limits.max_coordinator_streams); retry with backoff"
    )]
    TooManyStreams(usize),
    /// The registry cannot be trusted to be current (stale past its
    /// window); the registry's error.
    #[error("{0}")]
    RegistryUnavailable(String),
}

impl Refusal {
    /// The metrics label (`reason`) of the refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Invalid(refusal) => refusal.reason,
            Self::ShuttingDown => "shutting_down",
            Self::DuplicateId(_) => "duplicate_batch_id",
            Self::StreamOverloaded(_) => "stream_overloaded",
            Self::OverloadedBytes(_) => "overloaded_bytes",
            Self::Overloaded(_) => "overloaded",
            Self::TooManyStreams(_) => "too_many_streams",
            Self::RegistryUnavailable(_) => "registry_unavailable",
        }
    }

    /// The gRPC status the coordinator gets: the one mapping of refusals
    /// to codes.
    pub fn status(&self) -> Status {
        match self {
            Self::Invalid(refusal) => refusal.status.clone(),
            Self::DuplicateId(_) => Status::invalid_argument(self.to_string()),
            Self::ShuttingDown | Self::RegistryUnavailable(_) => {
                Status::unavailable(self.to_string())
            }
            Self::StreamOverloaded(_)
            | Self::OverloadedBytes(_)
            | Self::Overloaded(_)
            | Self::TooManyStreams(_) => Status::resource_exhausted(self.to_string()),
        }
    }
}

impl From<validate::Refusal> for Refusal {
    fn from(refusal: validate::Refusal) -> Self {
        Self::Invalid(refusal)
    }
}

/// R1: whether `batch` contacts any guard. A batch without calls does not:
/// it needs no slot of its stream, no in-flight bytes or permit, and is
/// answered at once.
pub(crate) fn contacts_guards(batch: &EvaluateRequest) -> bool {
    !batch.calls.is_empty()
}

/// The batch's content (R20). `policy_args`: `None` without a policy guard
/// in the chain; else whether one of them reads arguments, in which case
/// the check records where each call's argument members are, so that the
/// rules read them without scanning the text again (R27); for policies
/// that read no arguments, only each call's largest collection (the cost
/// bounds' `n`).
pub(crate) fn content(
    request: &EvaluateRequest,
    limits: &Limits,
    policy_args: Option<bool>,
) -> Result<Recorded, Refusal> {
    let Some(args) = policy_args else {
        validate::check(request, limits)?;
        return Ok(Recorded::default());
    };
    let calls = request.calls.len().min(limits.max_calls_per_batch);
    let mut members = if args {
        Recorded::with_calls(calls)
    } else {
        Recorded::largest_only(calls)
    };
    validate::check_recording(request, limits, &mut members)?;
    Ok(members)
}

/// Whether the registry is current enough to judge against.
pub(crate) fn registry(registry: &dyn Registry) -> Result<(), Refusal> {
    registry
        .check()
        .map_err(|error| Refusal::RegistryUnavailable(error.to_string()))
}

/// A permit of the mesh's batches in flight (load shedding: refused at
/// once rather than queued without bound).
pub(crate) fn inflight(
    slots: &Arc<Semaphore>,
    limits: &Limits,
) -> Result<OwnedSemaphorePermit, Refusal> {
    slot(slots, || Refusal::Overloaded(limits.max_inflight_batches))
}

/// One permit of `slots`, or at once the refusal `full` when none is
/// free.
fn slot(
    slots: &Arc<Semaphore>,
    full: impl FnOnce() -> Refusal,
) -> Result<OwnedSemaphorePermit, Refusal> {
    slots.clone().try_acquire_owned().map_err(|_| full())
}

/// The in-flight bytes a batch of `size` encoded bytes weighs (R25), from
/// `bytes` (KiB permits); `None` for a batch that contacts no guard (R1).
/// A batch heavier than the whole budget is still admitted alone.
pub(crate) fn inflight_bytes(
    bytes: &Arc<Semaphore>,
    limits: &Limits,
    batch: &EvaluateRequest,
    size: usize,
) -> Result<Option<OwnedSemaphorePermit>, Refusal> {
    if !contacts_guards(batch) {
        return Ok(None);
    }
    let limit = limits.max_inflight_bytes;
    let total = (limit / 1024).clamp(1, Semaphore::MAX_PERMITS);
    let kib = size
        .saturating_mul(validate::INFLIGHT_COPIES)
        .div_ceil(1024)
        .clamp(1, total.min(u32::MAX as usize));
    let kib = u32::try_from(kib).unwrap_or(u32::MAX);
    match bytes.clone().try_acquire_many_owned(kib) {
        Ok(permit) => Ok(Some(permit)),
        Err(_) => Err(Refusal::OverloadedBytes(limit)),
    }
}

/// A slot of the mesh's coordinator streams (R25), held while the stream
/// is open.
pub(crate) fn stream(
    streams: &Arc<Semaphore>,
    limits: &Limits,
) -> Result<OwnedSemaphorePermit, Refusal> {
    slot(streams, || {
        Refusal::TooManyStreams(limits.max_coordinator_streams)
    })
}

/// What one coordinator stream admits: batch ids unique among those in
/// flight (R19), and at most `max_batches` batches with calls being
/// judged at once.
#[derive(Debug)]
pub(crate) struct StreamGate {
    /// The ids in flight: a peer's strings, hashed by foldhash seeded per
    /// process (as the mesh's other maps of a peer's keys), at most the
    /// stream's batches in flight.
    in_flight: Mutex<HashSet<String, foldhash::fast::RandomState>>,
    judged: AtomicUsize,
    max_batches: usize,
}

/// A batch's place on its stream, given back when dropped.
#[derive(Debug)]
pub(crate) struct StreamTicket {
    gate: Arc<StreamGate>,
    batch_id: String,
    counted: bool,
}

impl StreamGate {
    pub(crate) fn new(max_batches: usize) -> Arc<Self> {
        Arc::new(Self {
            in_flight: Mutex::default(),
            judged: AtomicUsize::new(0),
            max_batches,
        })
    }

    /// Admits `batch` to its stream; `shown`: its id as messages show it.
    pub(crate) fn enter(
        gate: &Arc<Self>,
        batch: &EvaluateRequest,
        shown: &str,
    ) -> Result<StreamTicket, Refusal> {
        let mut in_flight = gate
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if in_flight.contains(&batch.batch_id) {
            return Err(Refusal::DuplicateId(shown.to_owned()));
        }
        // R1: a zero-call batch needs no slot and is answered at once.
        let counted = contacts_guards(batch);
        if counted && gate.judged.load(Ordering::Acquire) >= gate.max_batches {
            return Err(Refusal::StreamOverloaded(gate.max_batches));
        }
        in_flight.insert(batch.batch_id.clone());
        if counted {
            gate.judged.fetch_add(1, Ordering::AcqRel);
        }
        Ok(StreamTicket {
            gate: gate.clone(),
            batch_id: batch.batch_id.clone(),
            counted,
        })
    }
}

impl Drop for StreamTicket {
    fn drop(&mut self) {
        if self.counted {
            self.gate.judged.fetch_sub(1, Ordering::AcqRel);
        }
        self.gate
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.batch_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::ToolCall;
    use tonic::Code;

    fn batch(id: &str, calls: usize) -> EvaluateRequest {
        EvaluateRequest {
            batch_id: id.into(),
            calls: (0..calls)
                .map(|i| ToolCall {
                    call_id: format!("c{i}"),
                    tool: "t".into(),
                    arguments: "{}".into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// The refusal of the one-call batch `id` at `gate`, asserted to give
    /// `reason` and `code`.
    fn refused(gate: &Arc<StreamGate>, id: &str, reason: &str, code: Code) -> Refusal {
        let refusal = StreamGate::enter(gate, &batch(id, 1), id).unwrap_err();
        assert_eq!(refusal.reason(), reason);
        assert_eq!(refusal.status().code(), code);
        refusal
    }

    #[test]
    fn r19_an_id_in_flight_is_refused_until_its_ticket_is_dropped() {
        let gate = StreamGate::new(4);
        let ticket = StreamGate::enter(&gate, &batch("b", 1), "b").unwrap();
        let refusal = refused(&gate, "b", "duplicate_batch_id", Code::InvalidArgument);
        assert!(refusal.status().message().contains("\"b\""));
        drop(ticket);
        StreamGate::enter(&gate, &batch("b", 1), "b").unwrap();
    }

    #[test]
    fn r25_a_stream_judges_at_most_its_batches_and_r1_zero_call_batches_take_no_slot() {
        let gate = StreamGate::new(1);
        let first = StreamGate::enter(&gate, &batch("a", 1), "a").unwrap();
        refused(&gate, "b", "stream_overloaded", Code::ResourceExhausted);
        // R1: a batch without calls is admitted on a full stream.
        let empty = StreamGate::enter(&gate, &batch("e", 0), "e").unwrap();
        drop(empty);
        drop(first);
        StreamGate::enter(&gate, &batch("b", 1), "b").unwrap();
    }

    #[test]
    fn r1_zero_call_batches_take_no_inflight_bytes() {
        let limits = Limits {
            max_inflight_bytes: 1024,
            ..Limits::default()
        };
        let bytes = Arc::new(Semaphore::new(1));
        let held = inflight_bytes(&bytes, &limits, &batch("a", 1), 10).unwrap();
        assert!(held.is_some());
        let refusal = inflight_bytes(&bytes, &limits, &batch("b", 1), 10).unwrap_err();
        assert_eq!(refusal.reason(), "overloaded_bytes");
        assert!(
            refusal
                .status()
                .message()
                .contains("limits.max_inflight_bytes")
        );
        assert!(
            inflight_bytes(&bytes, &limits, &batch("e", 0), 10)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn every_refusal_has_one_status_whose_message_is_its_text() {
        let refusals = [
            (Refusal::ShuttingDown, Code::Unavailable),
            (Refusal::DuplicateId("x".into()), Code::InvalidArgument),
            (Refusal::StreamOverloaded(2), Code::ResourceExhausted),
            (Refusal::OverloadedBytes(2), Code::ResourceExhausted),
            (Refusal::Overloaded(2), Code::ResourceExhausted),
            (Refusal::TooManyStreams(2), Code::ResourceExhausted),
            (
                Refusal::RegistryUnavailable("stale".into()),
                Code::Unavailable,
            ),
        ];
        for (refusal, code) in refusals {
            let status = refusal.status();
            assert_eq!(status.code(), code, "{refusal:?}");
            assert_eq!(status.message(), refusal.to_string());
        }
        let mut bad = batch("b", 1);
        bad.calls[0].arguments = "{\"a\": 1, \"a\": 2}".into();
        let invalid = validate::check(&bad, &Limits::default()).unwrap_err();
        let (reason, code) = (invalid.reason, invalid.status.code());
        let refusal = Refusal::from(invalid);
        assert_eq!(refusal.reason(), reason);
        assert_eq!(refusal.status().code(), code);
    }
}
