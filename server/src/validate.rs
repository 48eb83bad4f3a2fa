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
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_calls_per_batch: 256,
            max_batch_bytes: 4 * 1024 * 1024,
            max_argument_bytes: 1024 * 1024,
            max_inflight_batches: 4096,
            max_batches_per_stream: 256,
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
    let size = request.encoded_len();
    if size > limits.max_batch_bytes {
        return Err(exhausted(
            "batch_too_large",
            format!(
                "batch {:?} is {size} bytes; the limit is {} bytes",
                request.batch_id, limits.max_batch_bytes
            ),
        ));
    }
    if request.calls.len() > limits.max_calls_per_batch {
        return Err(exhausted(
            "too_many_calls",
            format!(
                "batch {:?} has {} calls; the limit is {}",
                request.batch_id,
                request.calls.len(),
                limits.max_calls_per_batch
            ),
        ));
    }
    let mut seen = HashSet::with_capacity(request.calls.len());
    for (index, call) in request.calls.iter().enumerate() {
        if call.call_id.is_empty() {
            return Err(invalid(
                "empty_call_id",
                format!("call #{index} (tool {:?}) has an empty call_id", call.tool),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r20_json_object_check() {
        assert!(is_json_object(""));
        assert!(is_json_object(" {\"a\": [1, {\"b\": null}]} "));
        for bad in ["[]", "1", "\"s\"", "{", "{\"a\":1} x", "null", "{\"a\":}"] {
            assert!(!is_json_object(bad), "{bad}");
        }
    }
}
