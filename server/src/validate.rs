//! Checks a coordinator's batch before any guard sees it (R20).
//!
//! A refused batch contacts no guard. Shape errors are INVALID_ARGUMENT and
//! name the offending call; size limits are RESOURCE_EXHAUSTED.

use guardmesh_proto::v1::EvaluateRequest;
use prost::Message;
use std::collections::HashSet;
use tonic::Status;

/// Size limits on what coordinators send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most calls in one batch.
    pub max_calls_per_batch: usize,
    /// Largest encoded batch accepted (checked per batch, so an oversized
    /// batch is refused alone and the stream stays open).
    pub max_batch_bytes: usize,
    /// Largest `arguments` text of one call.
    pub max_argument_bytes: usize,
    /// Batches judged at once by the whole mesh; beyond it a batch is
    /// refused at once with RESOURCE_EXHAUSTED instead of queueing without
    /// bound (load shedding). Zero-call batches need no slot (R1).
    pub max_inflight_batches: usize,
    /// Batches in flight on one coordinator stream.
    pub max_batches_per_stream: usize,
    /// Longest `batch_id` or `call_id`, in bytes (R20).
    pub max_id_bytes: usize,
    /// Most `context.metadata` entries in one batch.
    pub max_metadata_entries: usize,
    /// Bytes of batches judged at once by the whole mesh, each batch
    /// weighed at [`INFLIGHT_COPIES`] times its encoded size (the copies the
    /// mesh holds while judging it); beyond it a batch is shed with
    /// RESOURCE_EXHAUSTED. Zero-call batches weigh nothing (R1).
    pub max_inflight_bytes: usize,
    /// Bytes one coordinator stream may hold: its batches being judged and
    /// its answers the coordinator has not read yet. Past it the mesh stops
    /// reading that stream until answers are read, and HTTP/2 flow control
    /// pushes back on the coordinator (R25). One batch is always admitted.
    pub max_stream_bytes: usize,
    /// Coordinator streams open at once on the whole mesh; a new one past it
    /// is refused with RESOURCE_EXHAUSTED.
    pub max_coordinator_streams: usize,
}

/// How many times its encoded size a batch in flight counts against
/// `max_inflight_bytes`: the batch as received, its calls as judged, and a
/// copy on its way to a guard.
pub const INFLIGHT_COPIES: usize = 3;

/// How an id is shown in answers and logs: as sent when it is within the
/// limit, otherwise its first bytes and a marker with its length, so that
/// no unbounded input is ever echoed (R20).
pub fn shown_id(id: &str, max: usize) -> String {
    if id.len() <= max {
        return id.to_owned();
    }
    format!("{}...[{} bytes]", truncate(id, SHOWN_PREFIX), id.len())
}

/// Bytes of an over-long id kept by [`shown_id`].
pub const SHOWN_PREFIX: usize = 64;

/// `text` cut to at most `max` bytes, at a character boundary.
pub fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A value from the network shown in a message: at most 64 bytes, marked
/// when cut.
fn shown(text: &str) -> String {
    shown_id(text, SHOWN_PREFIX)
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_calls_per_batch: 256,
            max_batch_bytes: 4 * 1024 * 1024,
            max_argument_bytes: 1024 * 1024,
            max_inflight_batches: 4096,
            max_batches_per_stream: 256,
            max_id_bytes: 256,
            max_metadata_entries: 1024,
            max_inflight_bytes: 256 << 20,
            max_stream_bytes: 16 << 20,
            max_coordinator_streams: 4096,
        }
    }
}

/// Why a batch was refused; `reason` is the metrics label.
#[derive(Debug)]
pub struct Refusal {
    pub reason: &'static str,
    pub status: Status,
}

fn invalid(reason: &'static str, message: String) -> Refusal {
    Refusal {
        reason,
        status: Status::invalid_argument(message),
    }
}

fn exhausted(reason: &'static str, message: String) -> Refusal {
    Refusal {
        reason,
        status: Status::resource_exhausted(message),
    }
}

/// Whether `text` is a JSON object. An empty string counts as `{}`.
pub fn is_json_object(text: &str) -> bool {
    let trimmed = text.trim_start();
    if trimmed.is_empty() {
        return true;
    }
    trimmed.starts_with('{') && serde_json::from_str::<serde::de::IgnoredAny>(trimmed).is_ok()
}

/// Checks `request` against R20 and `limits`.
pub fn check(request: &EvaluateRequest, limits: &Limits) -> Result<(), Refusal> {
    check_counts(
        &request.batch_id,
        request.encoded_len(),
        request.calls.len(),
        request.context.as_ref().map_or(0, |c| c.metadata.len()),
        limits,
    )?;
    let mut seen = HashSet::with_capacity(request.calls.len());
    for (index, call) in request.calls.iter().enumerate() {
        if call.call_id.is_empty() {
            return Err(invalid(
                "empty_call_id",
                format!(
                    "call #{index} (tool {:?}) has an empty call_id",
                    shown(&call.tool)
                ),
            ));
        }
        if call.call_id.len() > limits.max_id_bytes {
            return Err(invalid(
                "call_id_too_long",
                format!(
                    "call #{index} has a call_id of {} bytes ({:?}); the limit is {} bytes",
                    call.call_id.len(),
                    shown(&call.call_id),
                    limits.max_id_bytes
                ),
            ));
        }
        if !seen.insert(call.call_id.as_str()) {
            return Err(invalid(
                "duplicate_call_id",
                format!("call #{index} repeats call_id {:?}", call.call_id),
            ));
        }
        if call.tool.trim().is_empty() {
            return Err(invalid(
                "empty_tool",
                format!("call {:?} has an empty tool name", call.call_id),
            ));
        }
        if call.arguments.len() > limits.max_argument_bytes {
            return Err(exhausted(
                "arguments_too_large",
                format!(
                    "call {:?} has {} bytes of arguments; the limit is {}",
                    call.call_id,
                    call.arguments.len(),
                    limits.max_argument_bytes
                ),
            ));
        }
        if !is_json_object(&call.arguments) {
            return Err(invalid(
                "arguments_not_object",
                format!("call {:?}: arguments are not a JSON object", call.call_id),
            ));
        }
    }
    Ok(())
}

/// The checks that need only a batch's id, size and counts, so that they
/// can run before the batch is decoded (R20: before the costly work).
pub fn check_counts(
    batch_id: &str,
    size: usize,
    calls: usize,
    metadata_entries: usize,
    limits: &Limits,
) -> Result<(), Refusal> {
    if batch_id.len() > limits.max_id_bytes {
        return Err(invalid(
            "batch_id_too_long",
            format!(
                "batch_id is {} bytes; the limit is {} bytes",
                batch_id.len(),
                limits.max_id_bytes
            ),
        ));
    }
    if size > limits.max_batch_bytes {
        return Err(exhausted(
            "batch_too_large",
            format!(
                "batch {batch_id:?} is {size} bytes; the limit is {} bytes (limits.max_batch_bytes)",
                limits.max_batch_bytes
            ),
        ));
    }
    if calls > limits.max_calls_per_batch {
        return Err(exhausted(
            "too_many_calls",
            format!(
                "batch {batch_id:?} has {calls} calls; the limit is {} (limits.max_calls_per_batch)",
                limits.max_calls_per_batch
            ),
        ));
    }
    if metadata_entries > limits.max_metadata_entries {
        return Err(exhausted(
            "too_many_metadata_entries",
            format!(
                "batch {batch_id:?} has {metadata_entries} context.metadata entries; the limit is {} (limits.max_metadata_entries)",
                limits.max_metadata_entries
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r20_ids_are_shown_truncated() {
        assert_eq!(shown_id("b1", 256), "b1");
        let long = "é".repeat(1000);
        let shown = shown_id(&long, 256);
        assert!(shown.len() < 100, "{shown}");
        assert!(shown.ends_with("...[2000 bytes]"), "{shown}");
        let request = EvaluateRequest {
            batch_id: "x".repeat(300),
            ..Default::default()
        };
        let refusal = check(&request, &Limits::default()).unwrap_err();
        assert_eq!(refusal.status.code(), tonic::Code::InvalidArgument);
        assert!(refusal.status.message().len() < 100);
    }

    #[test]
    fn r20_json_object_check() {
        assert!(is_json_object(""));
        assert!(is_json_object(" {\"a\": [1, {\"b\": null}]} "));
        for bad in ["[]", "1", "\"s\"", "{", "{\"a\":1} x", "null", "{\"a\":}"] {
            assert!(!is_json_object(bad), "{bad}");
        }
    }
}
