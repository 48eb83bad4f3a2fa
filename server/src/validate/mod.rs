//! Checks a coordinator's batch before any guard sees it (R20).
//!
//! A refused batch contacts no guard. Shape errors are INVALID_ARGUMENT and
//! name the offending call; size limits are RESOURCE_EXHAUSTED. What is
//! checked: ids (empty, over-long, repeated, or a batch id in the prefix
//! the mesh reserves for its replays, [`check_reserved`]); tool names
//! within the mesh's grammar ([`names`]); and arguments that are I-JSON
//! objects ([`ijson`]) with no two member names of one object equal under
//! case folding as Go's `encoding/json` reads them (`path` and `PATH`, `s`
//! and `ſ`, `k` and the Kelvin sign): such a reader takes the two for one
//! member, and which of them it keeps is not the one a guard checked.

// Its items are `pub` for the `cargo fuzz` targets, which reach them through
// the crate's `fuzzing` module (feature `fuzzing`); the crate itself keeps them
// private by not exporting this module.
#![allow(unreachable_pub)]

use guardmesh_proto::v1::EvaluateRequest;
use prost::Message;
use std::collections::HashSet;
use tonic::Status;

pub mod ijson;
pub mod names;

pub use names::{RESERVED_BATCH_PREFIX, ToolNameGrammar};

/// Batches of up to this many calls are checked for repeated call ids by
/// comparing each id with the ones before it; larger ones through a set.
const SCANNED_IDS: usize = 16;

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
    /// Deepest nesting of arrays and objects in one call's arguments (the
    /// top-level object counts as one), at most
    /// [`ijson::MAX_DEPTH_LIMIT`].
    pub max_json_depth: usize,
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
    /// The tool names a batch may carry (R20).
    pub tool_names: ToolNameGrammar,
    /// Largest `result` text of one result sent to be judged (R33).
    pub max_result_bytes: usize,
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
            max_json_depth: 64,
            max_id_bytes: 256,
            max_metadata_entries: 1024,
            max_inflight_bytes: 256 << 20,
            max_stream_bytes: 16 << 20,
            max_coordinator_streams: 4096,
            tool_names: ToolNameGrammar::default(),
            max_result_bytes: 1024 * 1024,
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

/// Whether `text` is an I-JSON object (see [`ijson`]) within the default
/// depth limit. An empty string counts as `{}`.
#[cfg(test)]
pub fn is_json_object(text: &str) -> bool {
    ijson::check(text, Limits::default().max_json_depth).is_ok()
}

/// Longest call id shown in a refusal, in characters.
const SHOWN_ID_CHARS: usize = 64;

/// Checks `request` against R20 and `limits`.
pub fn check(request: &EvaluateRequest, limits: &Limits) -> Result<(), Refusal> {
    check_calls(request, limits, None)
}

/// [`check`], recording each call's top-level argument members (call `i`'s
/// are `recorded.call(i)`) for the policy guards (R27).
pub fn check_recording(
    request: &EvaluateRequest,
    limits: &Limits,
    recorded: &mut ijson::Recorded,
) -> Result<(), Refusal> {
    check_calls(request, limits, Some(recorded))
}

fn check_calls(
    request: &EvaluateRequest,
    limits: &Limits,
    mut recorded: Option<&mut ijson::Recorded>,
) -> Result<(), Refusal> {
    check_counts(
        &request.batch_id,
        request.encoded_len(),
        request.calls.len(),
        request.context.as_ref().map_or(0, |c| c.metadata.len()),
        limits,
    )?;
    // A small batch's repeated id is found by comparing with the calls
    // before it (no hashing); a large one's with a set.
    let mut seen =
        (request.calls.len() > SCANNED_IDS).then(|| HashSet::with_capacity(request.calls.len()));
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
        let repeated = match &mut seen {
            Some(seen) => !seen.insert(call.call_id.as_str()),
            None => request.calls[..index]
                .iter()
                .any(|earlier| earlier.call_id == call.call_id),
        };
        if repeated {
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
        if let Err(bad) = limits.tool_names.check(&call.tool) {
            return Err(invalid(
                "tool_name_outside_grammar",
                format!(
                    "call #{index} ({:?}) has tool name {:?} outside the mesh's tool-name grammar ({}): {bad}",
                    ijson::clip(&call.call_id, SHOWN_ID_CHARS),
                    shown(&call.tool),
                    limits.tool_names.describe()
                ),
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
        let checked = match recorded.as_deref_mut() {
            Some(recorded) => {
                ijson::check_recording(&call.arguments, limits.max_json_depth, recorded)
            }
            None => ijson::check(&call.arguments, limits.max_json_depth),
        };
        if let Err(error) = checked {
            let what = match error.problem {
                ijson::Problem::CaseCollision(..) => "arguments are refused",
                _ => "arguments are not an I-JSON object",
            };
            return Err(invalid(
                error.reason(),
                format!(
                    "call #{index} ({:?}): {what}: {error}",
                    ijson::clip(&call.call_id, SHOWN_ID_CHARS)
                ),
            ));
        }
    }
    Ok(())
}

/// Refuses a batch id in the prefix the mesh reserves for the batches it
/// replays (R20, R30), so that no client's batch is taken for a replay
/// (and left out of the next one). The mesh's servers call it for callers
/// that may not replay.
pub fn check_reserved(batch_id: &str) -> Result<(), Refusal> {
    if batch_id.starts_with(RESERVED_BATCH_PREFIX) {
        return Err(invalid(
            "reserved_batch_id",
            format!(
                "batch_id {:?} begins with {RESERVED_BATCH_PREFIX:?}, the prefix the mesh reserves for \
                 the batches it replays; choose another batch_id",
                shown(batch_id)
            ),
        ));
    }
    Ok(())
}

/// R34, R20: a session id is bounded like batch and call ids
/// (`limits.max_id_bytes`), so that no session of unbounded name is ever
/// kept in session memory, a record or a log line; and one the mesh
/// reserves for itself (it begins with a NUL: an identity's memory) is
/// refused.
pub fn check_session_id(request: &EvaluateRequest, limits: &Limits) -> Result<(), Refusal> {
    let Some(context) = &request.context else {
        return Ok(());
    };
    let bytes = context.session_id.len();
    if bytes > limits.max_id_bytes {
        return Err(invalid(
            "session_id_too_long",
            format!(
                "session_id is {bytes} bytes; the limit is {} bytes (limits.max_id_bytes)",
                limits.max_id_bytes
            ),
        ));
    }
    // R34: the session ids the mesh keeps for itself (an identity's memory
    // across its sessions) are not a coordinator's to name.
    if crate::session::is_reserved_session_id(&context.session_id) {
        return Err(invalid(
            "session_id_reserved",
            "session_id begins with a NUL character: session ids that do are reserved by the mesh"
                .to_owned(),
        ));
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

    /// R20: a repeated call id is refused and named, found by the scan of
    /// small batches and by the set of large ones alike.
    #[test]
    fn r20_repeated_call_ids_are_refused_in_small_and_large_batches() {
        use guardmesh_proto::v1::ToolCall;
        for n in [2, SCANNED_IDS, SCANNED_IDS + 1, 200] {
            for repeat_of in [0, (n - 1) / 2, n - 2] {
                let mut calls: Vec<ToolCall> = (0..n)
                    .map(|i| ToolCall {
                        call_id: format!("c{i}"),
                        tool: "t".into(),
                        arguments: String::new(),
                    })
                    .collect();
                let request = EvaluateRequest {
                    batch_id: "b".into(),
                    calls: calls.clone(),
                    ..Default::default()
                };
                assert!(check(&request, &Limits::default()).is_ok(), "{n}");
                calls[n - 1].call_id = format!("c{repeat_of}");
                let request = EvaluateRequest {
                    batch_id: "b".into(),
                    calls,
                    ..Default::default()
                };
                let refusal = check(&request, &Limits::default()).unwrap_err();
                assert_eq!(refusal.status.code(), tonic::Code::InvalidArgument);
                assert!(
                    refusal
                        .status
                        .message()
                        .contains(&format!("call #{} repeats call_id \"c{repeat_of}\"", n - 1)),
                    "{n}: {}",
                    refusal.status.message()
                );
            }
        }
    }

    /// The message of `request`'s refusal, asserted INVALID_ARGUMENT for
    /// `reason` (`case`: what the test tried, shown when it fails).
    fn invalid(request: &EvaluateRequest, reason: &str, case: &str) -> String {
        let refusal = check(request, &Limits::default()).unwrap_err();
        assert_eq!(
            refusal.status.code(),
            tonic::Code::InvalidArgument,
            "{case}"
        );
        assert_eq!(refusal.reason, reason, "{case}");
        refusal.status.message().to_owned()
    }

    fn one_call(batch_id: &str, tool: &str, args: &str) -> EvaluateRequest {
        EvaluateRequest {
            batch_id: batch_id.into(),
            calls: vec![guardmesh_proto::v1::ToolCall {
                call_id: "c1".into(),
                tool: tool.into(),
                arguments: args.into(),
            }],
            ..Default::default()
        }
    }

    /// R20: member names equal under Go's case folding, in any object at
    /// any depth, are refused naming the call and both names.
    #[test]
    fn r20_case_folded_member_names_are_refused_naming_call_and_names() {
        let cases = [
            (
                r#"{"path":"/tmp/ok","PATH":"/etc/shadow"}"#,
                "path",
                "PATH",
                "$",
            ),
            (r#"{"s":1,"ſ":2}"#, "s", "ſ", "$"),
            (r#"{"k":1,"\u212a":2}"#, "k", "\u{212a}", "$"),
            (r#"{"q":{"Key":1,"kEY":2}}"#, "Key", "kEY", "$.q"),
            (r#"{"a":[{"b":{"Id":1,"ID":2}}]}"#, "Id", "ID", "$.a[0].b"),
            (r#"{"µ":1,"μ":2}"#, "µ", "μ", "$"),
        ];
        for (args, first, second, at) in cases {
            let batch = one_call("b", "t", args);
            let message = invalid(&batch, "arguments_case_collision", args);
            assert!(message.starts_with("call #0 (\"c1\")"), "{message}");
            assert!(
                message.contains(&format!("member names {first:?} and {second:?}")),
                "{message}"
            );
            assert!(message.ends_with(&format!(" at {at}")), "{message}");
        }
        // Many members: found by sorting the folds, the same way.
        let mut many: Vec<String> = (0..100).map(|i| format!("\"k{i}\":{i}")).collect();
        many.push("\"K5\":0".into());
        let text = format!("{{{}}}", many.join(","));
        let refusal = check(&one_call("b", "t", &text), &Limits::default()).unwrap_err();
        let message = refusal.status.message();
        assert!(
            message.contains("\"k5\" and \"K5\"") || message.contains("\"K5\" and \"k5\""),
            "{message}"
        );
        // Names a case-insensitive reader tells apart pass.
        for ok in [
            r#"{"path":1,"path2":2,"PATH_":3}"#,
            r#"{"ı":1,"I":2,"j":[{"I":1}]}"#,
            r#"{"a":{"x":1},"b":{"X":1}}"#,
            r#"{"ss":1,"ß":2}"#,
        ] {
            assert!(
                check(&one_call("b", "t", ok), &Limits::default()).is_ok(),
                "{ok}"
            );
        }
    }

    /// R20: tool names outside the grammar are refused naming the call.
    #[test]
    fn r20_tool_names_outside_the_grammar_are_refused_naming_the_call() {
        assert!(check(&one_call("b", "Shell.exec", "{}"), &Limits::default()).is_ok());
        let long = "x".repeat(129);
        for tool in [
            " shell.exec",
            "shell\u{200b}.exec",
            "\u{ff53}\u{ff48}\u{ff45}\u{ff4c}\u{ff4c}",
            "shell\u{0}exec",
            "shell\nexec",
            "shell\u{7f}",
            long.as_str(),
        ] {
            let batch = one_call("b", tool, "{}");
            let message = invalid(&batch, "tool_name_outside_grammar", &format!("{tool:?}"));
            assert!(
                message.starts_with("call #0 (\"c1\") has tool name"),
                "{message}"
            );
            assert!(message.contains("grammar (1 to 128 of ASCII"), "{message}");
            assert!(message.len() < 400, "{message}");
        }
        let limits = Limits {
            tool_names: ToolNameGrammar::new(16, "/").unwrap(),
            ..Limits::default()
        };
        assert!(check(&one_call("b", "fs/read", "{}"), &limits).is_ok());
        assert!(check(&one_call("b", "fs/read", "{}"), &Limits::default()).is_err());
    }

    /// R20: a batch id in the reserved prefix is refused by
    /// `check_reserved`, never by the checks every batch goes through (the
    /// mesh's own replays are judged with them).
    #[test]
    fn r20_reserved_batch_prefix() {
        for id in ["replay:1", "replay:", "replay:x/y"] {
            let refusal = check_reserved(id).unwrap_err();
            assert_eq!(refusal.status.code(), tonic::Code::InvalidArgument);
            assert_eq!(refusal.reason, "reserved_batch_id");
            assert!(refusal.status.message().contains(id), "{id}");
            assert!(check(&one_call(id, "t", "{}"), &Limits::default()).is_ok());
        }
        for id in [
            "",
            "b1",
            "Replay:1",
            "replay",
            "xreplay:1",
            "session/replay:1",
        ] {
            assert!(check_reserved(id).is_ok(), "{id}");
        }
        let long = format!("replay:{}", "x".repeat(1000));
        assert!(check_reserved(&long).unwrap_err().status.message().len() < 300);
    }

    #[test]
    fn r20_json_object_check() {
        assert!(is_json_object(""));
        assert!(is_json_object(" \t\r\n"));
        assert!(is_json_object(" {\"a\": [1, {\"b\": null}]} "));
        for bad in [
            "[]",
            "1",
            "\"s\"",
            "{",
            "{\"a\":1} x",
            "null",
            "{\"a\":}",
            "\u{feff}{}",
            "\u{2028}{}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":NaN}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":.5}",
            "{\"a\":+1}",
            "{\"a\":tru}",
            "{\"a\":\"\t\"}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12\"}",
            "{'a':1}",
            "{a:1}",
            "{\"a\":1}/**/",
        ] {
            assert!(!is_json_object(bad), "{bad:?}");
        }
    }

    fn problem(text: &str, depth: usize) -> String {
        match ijson::check(text, depth) {
            Ok(()) => String::from("ok"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn r20_i_json_accepts_what_every_parser_reads_alike() {
        let ok = [
            r#"{"a":"\ud83d\ude00","b":"😀","c":"\u00e9\n\"\\\/","d":-0.5e-3}"#,
            r#"{"n":1.7976931348623157e308,"m":-1.7976931348623157e308,"z":1e-400}"#,
            r#"{"big":18446744073709551616,"exact":9007199254740993}"#,
            r#"{"a":{"a":{"a":1}},"b":[{"a":1},{"a":2}],"c":{"B":1},"a ":2}"#,
            r#"{"\u0061b":1,"ac":2}"#,
            "{\"k\":\"\u{fffd}\u{ffef}\u{f000}\u{10fffd}\"}",
        ];
        for text in ok {
            assert_eq!(problem(text, 64), "ok", "{text}");
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            assert!(value.is_object());
        }
        let deep = |n: usize| format!("{{\"a\":{}{}}}", "[".repeat(n - 1), "]".repeat(n - 1));
        assert_eq!(problem(&deep(64), 64), "ok");
        assert_eq!(problem(&deep(127), 127), "ok");
        assert!(serde_json::from_str::<serde_json::Value>(&deep(127)).is_ok());
        let number = format!("{{\"n\":{}}}", "9".repeat(ijson::MAX_NUMBER_CHARS));
        assert_eq!(problem(&number, 64), "ok");
    }

    #[test]
    fn r20_i_json_refusals_name_the_reason_and_place() {
        let deep = |n: usize| format!("{{\"a\":{}{}}}", "[".repeat(n - 1), "]".repeat(n - 1));
        let long = |digits: usize| format!("{{\"n\":1{}}}", "0".repeat(digits - 1));
        let cases = [
            (
                r#"{"sql":"SELECT 1","sql":"DELETE FROM t"}"#.to_owned(),
                r#"duplicate member name "sql" at $"#,
            ),
            (
                r#"{"q":{"b":1,"a":2,"\u0062":3}}"#.to_owned(),
                r#"duplicate member name "b" at $.q"#,
            ),
            (
                r#"{"x":[0,{"z":1,"y":2,"x":3,"w":4,"y":5}]}"#.to_owned(),
                r#"duplicate member name "y" at $.x[1]"#,
            ),
            (
                r#"{"n":1e400}"#.to_owned(),
                "number out of range of a double at $.n",
            ),
            (
                r#"{"n":-1E+309}"#.to_owned(),
                "number out of range of a double at $.n",
            ),
            (long(401), "number longer than 100 characters at $.n"),
            (
                r#"{"s":"\ud800"}"#.to_owned(),
                r"lone surrogate \ud800 at $.s",
            ),
            (
                r#"{"s":"\ud800\u0041"}"#.to_owned(),
                r"lone surrogate \ud800 at $.s",
            ),
            (
                r#"{"s":["\udc00x"]}"#.to_owned(),
                r"lone surrogate \udc00 at $.s[0]",
            ),
            (r#"{"\ud800":1}"#.to_owned(), r"lone surrogate \ud800 at $"),
            (
                r#"{"s":"\uffff"}"#.to_owned(),
                "noncharacter U+FFFF in a string at $.s",
            ),
            (
                "{\"s\":\"\u{fdd0}\"}".to_owned(),
                "noncharacter U+FDD0 in a string at $.s",
            ),
            (
                r#"{"s":"\udbff\udfff"}"#.to_owned(),
                "noncharacter U+10FFFF in a string at $.s",
            ),
            (
                "{\"s\":\"\u{1fffe}\"}".to_owned(),
                "noncharacter U+1FFFE in a string at $.s",
            ),
            (
                deep(65),
                "nesting deeper than 64 at $...[0][0][0][0][0][0][0][0]",
            ),
            (
                deep(129),
                "nesting deeper than 64 at $...[0][0][0][0][0][0][0][0]",
            ),
            ("[1]".to_owned(), "not a JSON object"),
            (
                r#"{"a" 1}"#.to_owned(),
                "not valid JSON at byte 5: expected ':'",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(problem(&text, 64), want, "{text}");
        }
        assert_eq!(problem(&deep(3), 2), "nesting deeper than 2 at $.a[0]");
        // A name is shown clipped, and odd names are quoted.
        let name = "k".repeat(500);
        let text = format!(r#"{{"{name}":1,"{name}":2}}"#);
        let got = problem(&text, 64);
        assert!(got.len() < 100, "{got}");
        assert_eq!(
            problem(r#"{"a b":{"n":1e999}}"#, 64),
            r#"number out of range of a double at $["a b"].n"#
        );
    }

    #[test]
    fn r20_string_scan_finds_what_it_must_at_every_offset() {
        // The scanner skips plain ASCII eight bytes at a time: put each
        // kind of byte that matters at every offset around a word.
        for before in 0..24 {
            for after in [0, 1, 7, 8, 9] {
                let a = "a".repeat(before);
                let z = "z".repeat(after);
                let text = |middle: &str| format!("{{\"k\":\"{a}{middle}{z}\"}}");
                assert_eq!(problem(&text(""), 64), "ok");
                assert_eq!(problem(&text("\\\"é\\u00e9"), 64), "ok");
                assert_eq!(problem(&text("€😀"), 64), "ok");
                assert!(problem(&text("\u{1}"), 64).starts_with("not valid JSON"));
                assert!(problem(&text("\u{1f}"), 64).starts_with("not valid JSON"));
                assert_eq!(
                    problem(&text("\u{fffe}"), 64),
                    "noncharacter U+FFFE in a string at $.k"
                );
                assert_eq!(
                    problem(&text("\\udfff"), 64),
                    r"lone surrogate \udfff at $.k"
                );
                assert!(problem(&text("\"x"), 64).starts_with("not valid JSON"));
            }
        }
    }

    #[test]
    fn r20_many_members_are_checked_in_n_log_n() {
        // 100,000 distinct names, then one repeated at the end.
        let mut text = String::from("{");
        for i in 0..100_000 {
            text.push_str(&format!("\"k{i}\":{i},"));
        }
        text.push_str("\"k5\":0}");
        let started = std::time::Instant::now();
        assert_eq!(problem(&text, 64), r#"duplicate member name "k5" at $"#);
        assert_eq!(problem(&text.replace("\"k5\":0}", "\"end\":0}"), 64), "ok");
        // Generous: a quadratic check would take minutes.
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn r20_check_refuses_non_i_json_naming_the_call() {
        use guardmesh_proto::v1::ToolCall;
        let call = |id: &str, args: &str| ToolCall {
            call_id: id.into(),
            tool: "sql".into(),
            arguments: args.into(),
        };
        let request = EvaluateRequest {
            batch_id: "b".into(),
            calls: vec![
                call("ok", "{}"),
                // Within max_id_bytes (256), longer than what a message shows.
                call(
                    &"x".repeat(200),
                    r#"{"sql":"SELECT 1","sql":"DELETE FROM t"}"#,
                ),
            ],
            ..Default::default()
        };
        let message = invalid(&request, "arguments_not_i_json", "");
        assert!(message.starts_with("call #1 (\"xxxx"), "{message}");
        assert!(
            message.ends_with(r#"duplicate member name "sql" at $"#),
            "{message}"
        );
        assert!(message.len() < 200, "{message}");
        let limits = Limits {
            max_json_depth: 1,
            ..Limits::default()
        };
        let request = EvaluateRequest {
            calls: vec![call("c", r#"{"a":{}}"#)],
            ..Default::default()
        };
        let message = check(&request, &limits).unwrap_err().status;
        assert!(
            message.message().ends_with("nesting deeper than 1 at $.a"),
            "{message:?}"
        );
    }
}
