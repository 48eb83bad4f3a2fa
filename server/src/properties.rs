//! Fuzzing with proptest (issue 6, item 11), bounded to run in a few
//! seconds: decoding every message of the proto from arbitrary bytes (and
//! from mutated valid encodings), the mesh's checks on what it decodes
//! (`validate::check` for batches, `spec::Guard::from_spec` for
//! registrations), the fold over arbitrary verdict sequences and arrival
//! orders, and config-file parsing. No input may panic.
//!
//! The `cargo fuzz` targets in `fuzz/` cover the same ground for long,
//! coverage-guided runs (see `fuzz/README.md`). More cases here:
//!
//! ```text
//! PROPTEST_CASES=100000 cargo test -p guardmesh-server --release --lib properties
//! ```

use crate::config::Config;
use crate::judge::fold::{Cell, Fold, FoldGuard, Resolution};
use crate::registry::spec::Guard;
use crate::validate::{Limits, check};
use guardmesh_proto::v1::{
    BatchContext, BatchDecision, BatchError, CallDecision, CancelBatch, DeregisterRequest,
    DeregisterResponse, EvaluateRequest, EvaluateResponse, FailurePolicy, GuardBatch, GuardSpec,
    GuardTrace, JudgeRequest, JudgeResponse, ListRequest, ListResponse, RegisterRequest,
    RegisterResponse, Rewrite, RewriteGrant, Skip, ToolCall, Verdict, judge_request, verdict,
};
use proptest::prelude::*;
use prost::Message;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// Cases per property unless `PROPTEST_CASES` says otherwise.
fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Decoding every message
// ---------------------------------------------------------------------------

/// Decodes `bytes` as `M`; when that succeeds, re-encoding and decoding
/// again gives the same message (unknown fields aside, which are dropped).
fn decodes<M: Message + Default + PartialEq + std::fmt::Debug>(bytes: &[u8]) -> Option<M> {
    let message = M::decode(bytes).ok()?;
    let again = M::decode(message.encode_to_vec().as_slice()).expect("re-encoding decodes");
    assert_eq!(again, message, "decode(encode(m)) == m");
    Some(message)
}

/// Every message type of `guardmesh.v1`.
fn decode_all(bytes: &[u8]) {
    // What the mesh decodes from coordinators, registrars and guards, each
    // also run through the mesh's own checks.
    if let Some(request) = decodes::<EvaluateRequest>(bytes) {
        check_batch(&request);
    }
    if let Some(request) = decodes::<RegisterRequest>(bytes)
        && let Some(spec) = &request.guard
    {
        check_registration(spec);
    }
    if let Some(spec) = decodes::<GuardSpec>(bytes) {
        check_registration(&spec);
    }
    decodes::<DeregisterRequest>(bytes);
    decodes::<ListRequest>(bytes);
    decodes::<JudgeResponse>(bytes);
    decodes::<Verdict>(bytes);
    decodes::<Skip>(bytes);
    decodes::<Rewrite>(bytes);
    // What coordinators, registrars and guards decode from the mesh.
    decodes::<EvaluateResponse>(bytes);
    decodes::<BatchDecision>(bytes);
    decodes::<CallDecision>(bytes);
    decodes::<GuardTrace>(bytes);
    decodes::<BatchError>(bytes);
    decodes::<JudgeRequest>(bytes);
    decodes::<GuardBatch>(bytes);
    decodes::<CancelBatch>(bytes);
    decodes::<RegisterResponse>(bytes);
    decodes::<DeregisterResponse>(bytes);
    decodes::<ListResponse>(bytes);
    decodes::<RewriteGrant>(bytes);
    decodes::<ToolCall>(bytes);
    decodes::<BatchContext>(bytes);
}

fn small_limits() -> Limits {
    Limits {
        max_calls_per_batch: 3,
        max_batch_bytes: 256,
        max_argument_bytes: 48,
        ..Limits::default()
    }
}

/// Reference for R20, written from the spec: the first violated rule, in
/// the order the mesh checks them, and its gRPC code.
fn expected_refusal(request: &EvaluateRequest, limits: &Limits) -> Option<tonic::Code> {
    use tonic::Code::{InvalidArgument, ResourceExhausted};
    if request.encoded_len() > limits.max_batch_bytes
        || request.calls.len() > limits.max_calls_per_batch
    {
        return Some(ResourceExhausted);
    }
    let mut seen = HashSet::new();
    for call in &request.calls {
        if call.call_id.is_empty() || !seen.insert(call.call_id.as_str()) {
            return Some(InvalidArgument);
        }
        // R20's tool-name grammar: 1 to 128 of ASCII letters, digits,
        // '_', '-' and '.'.
        if call.tool.is_empty()
            || call.tool.len() > 128
            || !call
                .tool
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
        {
            return Some(InvalidArgument);
        }
        if call.arguments.len() > limits.max_argument_bytes {
            return Some(ResourceExhausted);
        }
        // I-JSON (RFC 7493), by an independent reader: serde_json's own
        // grammar, escapes and number range, plus what it lets through.
        let object = i_json_reference(&call.arguments, limits.max_json_depth);
        if !object {
            return Some(InvalidArgument);
        }
    }
    None
}

/// Reference for R20's I-JSON rule: an object read by serde_json (which
/// refuses bad grammar, lone surrogates and numbers out of a double's range)
/// through a visitor that also refuses duplicate member names (compared
/// decoded), noncharacters and nesting deeper than `max_depth`. The empty
/// text, or only JSON whitespace, is `{}`. It does not look at a number's
/// length: compare only on texts without a long run of number characters
/// (see `long_number`).
fn i_json_reference(text: &str, max_depth: usize) -> bool {
    if text.trim_matches([' ', '\t', '\n', '\r']).is_empty() {
        return true;
    }
    let mut reader = serde_json::Deserializer::from_str(text);
    let top = Reference {
        depth: 0,
        max_depth,
    };
    matches!(
        serde::de::DeserializeSeed::deserialize(top, &mut reader),
        Ok(Shape::Object)
    ) && reader.end().is_ok()
}

/// Whether `text` has a run of number characters longer than the mesh takes
/// (an over-approximation: such runs may be inside strings, so callers only
/// compare on texts without one).
fn long_number(text: &str) -> bool {
    let mut run = 0;
    for b in text.bytes() {
        run = if b.is_ascii_digit() || b"+-.eE".contains(&b) {
            run + 1
        } else {
            0
        };
        if run > crate::validate::ijson::MAX_NUMBER_CHARS {
            return true;
        }
    }
    false
}

#[derive(Debug, PartialEq)]
enum Shape {
    Object,
    Other,
}

#[derive(Clone, Copy)]
struct Reference {
    depth: usize,
    max_depth: usize,
}

fn noncharacter(text: &str) -> bool {
    text.chars()
        .map(u32::from)
        .any(|c| (0xFDD0..=0xFDEF).contains(&c) || c & 0xFFFE == 0xFFFE)
}

impl<'de> serde::de::DeserializeSeed<'de> for Reference {
    type Value = Shape;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Reference {
    type Value = Shape;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("I-JSON")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Shape, E> {
        Ok(Shape::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Shape, E> {
        Ok(Shape::Other)
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Shape, E> {
        if v.is_finite() {
            Ok(Shape::Other)
        } else {
            Err(E::custom("not finite"))
        }
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Shape, E> {
        if noncharacter(v) {
            Err(E::custom("noncharacter"))
        } else {
            Ok(Shape::Other)
        }
    }
    fn visit_unit<E>(self) -> Result<Shape, E> {
        Ok(Shape::Other)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        let inner = self.nested::<A::Error>()?;
        while seq.next_element_seed(inner)?.is_some() {}
        Ok(Shape::Other)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
        let inner = self.nested::<A::Error>()?;
        let mut names = HashSet::new();
        let mut folded = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            // R20: names one under Go's case folding are refused too.
            if noncharacter(&name)
                || !folded.insert(guardmesh_client::casefold::fold(&name))
                || !names.insert(name)
            {
                return Err(serde::de::Error::custom(
                    "duplicate, case-folded duplicate or noncharacter name",
                ));
            }
            map.next_value_seed(inner)?;
        }
        Ok(Shape::Object)
    }
}

impl Reference {
    fn nested<E: serde::de::Error>(self) -> Result<Self, E> {
        if self.depth + 1 > self.max_depth {
            return Err(E::custom("too deep"));
        }
        Ok(Self {
            depth: self.depth + 1,
            max_depth: self.max_depth,
        })
    }
}

/// `validate::check` never panics and agrees with the reference.
fn check_batch(request: &EvaluateRequest) {
    for limits in [Limits::default(), small_limits()] {
        let got = check(request, &limits).err().map(|r| r.status.code());
        assert_eq!(
            got,
            expected_refusal(request, &limits),
            "R20 for {request:?} under {limits:?}"
        );
    }
}

/// `Guard::from_spec` never panics; what it accepts is well formed and
/// survives a round trip through `to_spec`.
fn check_registration(spec: &GuardSpec) {
    let Ok(guard) = Guard::from_spec(spec, Duration::from_secs(1)) else {
        return;
    };
    assert!(!guard.name.is_empty());
    assert!(
        guard.endpoint.starts_with("http://") || guard.endpoint.starts_with("https://"),
        "{}",
        guard.endpoint
    );
    assert!(!guard.timeout.is_zero());
    let again = Guard::from_spec(&guard.to_spec(), Duration::from_secs(1))
        .expect("a registration the mesh lists can be registered again");
    assert_eq!(again.to_spec(), guard.to_spec());
}

fn tool_call() -> impl Strategy<Value = ToolCall> {
    (
        prop_oneof![Just(String::new()), "[a-c]{1,2}"],
        prop_oneof![
            Just(String::new()),
            Just("  ".to_owned()),
            "[a-z.*]{1,8}",
            "[A-Za-z0-9_.-]{1,8}",
            Just("sh\u{200b}ell".to_owned()),
            Just("\u{ff53}hell".to_owned()),
        ],
        prop_oneof![
            Just(String::new()),
            Just("{}".to_owned()),
            Just(r#"{"a":[1,{"b":null}]}"#.to_owned()),
            Just("[1]".to_owned()),
            Just("{".to_owned()),
            Just(" {\"k\": \"v\"} ".to_owned()),
            Just("null".to_owned()),
            Just(r#"{"a":1,"a":2}"#.to_owned()),
            Just(r#"{"a":1,"\u0061":2}"#.to_owned()),
            Just(r#"{"n":1e400}"#.to_owned()),
            Just(r#"{"s":"\ud800"}"#.to_owned()),
            Just(r#"{"s":"\ud83d\ude00"}"#.to_owned()),
            Just(r#"{"path":1,"PATH":2}"#.to_owned()),
            Just(r#"{"a":[{"s":1,"\u017f":2}]}"#.to_owned()),
            "\\PC{0,64}",
        ],
    )
        .prop_map(|(call_id, tool, arguments)| ToolCall {
            call_id,
            tool,
            arguments,
        })
}

fn evaluate_request() -> impl Strategy<Value = EvaluateRequest> {
    (
        "\\PC{0,12}",
        prop::collection::vec(tool_call(), 0..6),
        any::<u32>(),
        prop::option::of(("\\PC{0,8}", any::<u32>(), "\\PC{0,40}")),
    )
        .prop_map(|(batch_id, calls, timeout_ms, context)| EvaluateRequest {
            batch_id,
            context: context.map(|(session_id, turn_index, model_text)| BatchContext {
                session_id,
                turn_index,
                model_text,
                metadata: HashMap::from([("tenant".to_owned(), "t".to_owned())]),
            }),
            calls,
            timeout_ms,
            ..Default::default()
        })
}

fn guard_spec() -> impl Strategy<Value = GuardSpec> {
    (
        prop_oneof![Just("g".to_owned()), "\\PC{0,10}", "[a-z./_-]{1,12}"],
        prop_oneof![
            Just("127.0.0.1:7001".to_owned()),
            Just("http://[::1]:9".to_owned()),
            Just("https://guard.example:443".to_owned()),
            "(http|https|ftp)?(://)?[a-z0-9.:\\[\\]/@%-]{0,24}",
            "\\PC{0,24}",
        ],
        -2i32..4,
        prop::collection::vec(prop_oneof!["[a-z.*?\\[\\]{},!-]{0,6}", "\\PC{0,6}"], 0..3),
        any::<u32>(),
        -2i32..4,
        any::<i32>(),
        -2i32..3,
        prop::option::of((
            prop::collection::vec("[a-z.*\\[]{0,5}", 0..3),
            any::<bool>(),
        )),
    )
        .prop_map(
            |(name, endpoint, role, tools, timeout_ms, failure_policy, priority, mode, grant)| {
                GuardSpec {
                    name,
                    endpoint,
                    role,
                    tools,
                    timeout_ms,
                    failure_policy,
                    priority,
                    mode,
                    grant: grant.map(|(tools, may_rename)| RewriteGrant { tools, may_rename }),
                    ..Default::default()
                }
            },
        )
}

fn judge_response() -> impl Strategy<Value = JudgeResponse> {
    let outcome = prop_oneof![
        Just(None),
        ("\\PC{0,8}", any::<i32>())
            .prop_map(|(content, kind)| Some(verdict::Outcome::Skip(Skip { content, kind }))),
        (
            prop::option::of("[a-z.]{0,6}"),
            prop::option::of("\\PC{0,12}")
        )
            .prop_map(|(tool, arguments)| Some(verdict::Outcome::Rewrite(Rewrite {
                tool,
                arguments
            }))),
    ];
    (
        any::<u64>(),
        prop::collection::vec(("[a-c]{0,2}", outcome), 0..5),
        any::<bool>(),
        "\\PC{0,8}",
    )
        .prop_map(|(request_id, verdicts, partial, error)| JudgeResponse {
            request_id,
            verdicts: verdicts
                .into_iter()
                .map(|(call_id, outcome)| Verdict {
                    call_id,
                    outcome,
                    labels: Vec::new(),
                })
                .collect(),
            partial,
            error,
        })
}

/// A valid encoding of some message, then damaged: bytes flipped, cut,
/// spliced or repeated, so that decoding goes deep before it fails.
fn mutated(valid: Vec<u8>, edits: Vec<(usize, u8, u8)>) -> Vec<u8> {
    let mut bytes = valid;
    for (at, op, value) in edits {
        if bytes.is_empty() {
            bytes.push(value);
            continue;
        }
        let at = at % bytes.len();
        match op % 5 {
            0 => bytes[at] = value,
            1 => bytes[at] ^= 1 << (value % 8),
            2 => bytes.truncate(at),
            3 => bytes.insert(at, value),
            _ => {
                let tail = bytes[at..].to_vec();
                bytes.extend_from_slice(&tail);
            }
        }
    }
    bytes
}

fn valid_encoding() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        evaluate_request().prop_map(|m| m.encode_to_vec()),
        guard_spec().prop_map(|m| RegisterRequest { guard: Some(m) }.encode_to_vec()),
        judge_response().prop_map(|m| m.encode_to_vec()),
        evaluate_request().prop_map(|m| {
            JudgeRequest {
                kind: Some(judge_request::Kind::Batch(GuardBatch {
                    request_id: 7,
                    batch_id: m.batch_id,
                    guard: "g".into(),
                    context: m.context,
                    calls: m.calls,
                    deadline_ms: m.timeout_ms,
                    ..Default::default()
                })),
            }
            .encode_to_vec()
        }),
    ]
}

proptest! {
    #![proptest_config(cases(1024))]

    #[test]
    fn fuzz_decode_every_message_from_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        decode_all(&bytes);
    }

    #[test]
    fn fuzz_decode_every_message_from_mutated_valid_encodings(
        valid in valid_encoding(),
        edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..4),
    ) {
        decode_all(&mutated(valid, edits));
    }

    #[test]
    fn fuzz_validate_check_agrees_with_r20(request in evaluate_request()) {
        check_batch(&request);
    }

    #[test]
    fn fuzz_registration_checks_never_panic(spec in guard_spec()) {
        check_registration(&spec);
    }
}

// ---------------------------------------------------------------------------
// R20: I-JSON arguments
// ---------------------------------------------------------------------------

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        // Non-finite floats become null.
        any::<f64>().prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map("\\PC{0,8}", inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn json_object() -> impl Strategy<Value = serde_json::Value> {
    prop::collection::btree_map("\\PC{0,8}", json_value(), 0..8)
        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
}

/// `text` with every non-ASCII character written as `\uXXXX` escapes (in
/// JSON text written by serde_json they occur only inside strings).
fn escape_non_ascii(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        if ch.is_ascii() {
            out.push(ch);
        } else {
            let mut units = [0u16; 2];
            for unit in ch.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// Fragments that matter to an I-JSON reader, spliced into valid texts.
const FRAGMENTS: &[&str] = &[
    "\"",
    "\\",
    "\\u",
    "\\ud800",
    "\\udc00",
    "\\uffff",
    "\\u0061",
    "1e400",
    "-1e308",
    "0e999999",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    ",\"a\":1",
    "\"a\":",
    " ",
    "\u{feff}",
    "\u{ffff}",
    "\u{fdd0}",
    "\u{1fffe}",
    "\t",
    "\u{1}",
    "null",
    "tru",
    "1.",
    ".5",
    "-0",
];

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn fuzz_r20_every_serde_json_object_is_i_json(
        value in json_object(),
        pretty in any::<bool>(),
        ascii in any::<bool>(),
    ) {
        let mut text = if pretty {
            serde_json::to_string_pretty(&value).unwrap()
        } else {
            serde_json::to_string(&value).unwrap()
        };
        if ascii {
            text = escape_non_ascii(&text);
        }
        // Names that Go's encoding/json reads as one are refused (R20).
        prop_assume!(guardmesh_client::casefold::find_collision_deep(&value).is_none());
        let got = crate::validate::ijson::check(&text, 64);
        prop_assert!(got.is_ok(), "{:?}: {:?}", text, got);
        prop_assert!(i_json_reference(&text, 64));
    }

    #[test]
    fn fuzz_r20_i_json_check_on_damaged_json_agrees_with_the_reference(
        value in json_object(),
        ascii in any::<bool>(),
        edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..4),
        splices in prop::collection::vec((any::<usize>(), 0..FRAGMENTS.len()), 0..4),
        depth in 1usize..8,
    ) {
        let mut text = serde_json::to_string(&value).unwrap();
        if ascii {
            text = escape_non_ascii(&text);
        }
        for (at, fragment) in splices {
            let mut at = at % (text.len() + 1);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            text.insert_str(at, FRAGMENTS[fragment]);
        }
        let bytes = mutated(text.into_bytes(), edits);
        let text = String::from_utf8_lossy(&bytes);
        // Never panics, whatever the text and the limit.
        let got = crate::validate::ijson::check(&text, depth);
        if let Err(error) = &got {
            prop_assert!(!error.to_string().is_empty());
        }
        if !long_number(&text) {
            prop_assert_eq!(got.is_ok(), i_json_reference(&text, depth), "{:?}: {:?}", text, got);
        }
    }
}

// ---------------------------------------------------------------------------
// The fold over arbitrary verdict sequences and arrival orders
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Event {
    Proceed(usize, usize),
    Skip(usize, usize),
    Complete(usize),
    Fail(usize),
}

#[derive(Debug, Clone)]
struct FoldCase {
    guards: Vec<FoldGuard>,
    calls: usize,
    sent: Vec<Vec<bool>>,
    /// Arbitrary events, junk included: verdicts for calls never sent,
    /// second verdicts, verdicts after a guard ended, events after the fold
    /// is done.
    events: Vec<Event>,
    /// How each guard ends once the events are spent: fail (true) or
    /// complete.
    ends_failed: Vec<bool>,
}

fn fold_case() -> impl Strategy<Value = FoldCase> {
    (1usize..6, 1usize..7).prop_flat_map(|(guards, calls)| {
        let policy = prop_oneof![
            Just(FailurePolicy::FailClosed),
            Just(FailurePolicy::FailOpen),
            Just(FailurePolicy::Abort),
        ];
        let event = prop_oneof![
            4 => (0..guards, 0..calls).prop_map(|(g, c)| Event::Proceed(g, c)),
            4 => (0..guards, 0..calls).prop_map(|(g, c)| Event::Skip(g, c)),
            1 => (0..guards).prop_map(Event::Complete),
            1 => (0..guards).prop_map(Event::Fail),
        ];
        (
            prop::collection::vec((any::<bool>(), policy), guards),
            prop::collection::vec(prop::collection::vec(any::<bool>(), calls), guards),
            prop::collection::vec(event, 0..40),
            prop::collection::vec(any::<bool>(), guards),
        )
            .prop_map(move |(gs, sent, events, ends_failed)| FoldCase {
                guards: gs
                    .into_iter()
                    .map(|(enforced, policy)| FoldGuard { enforced, policy })
                    .collect(),
                calls,
                sent,
                events,
                ends_failed,
            })
    })
}

#[derive(Debug, Clone, PartialEq)]
enum RefCell {
    NotSent,
    Pending,
    Proceed,
    Skip(String),
    Failed,
}

/// The sequential reference: each call judged by the guards one by one in
/// chain order, over what each guard finally said (R3, R13, R18).
fn sequential(case: &FoldCase, cells: &[Vec<RefCell>], c: usize) -> Resolution {
    for (g, guard) in case.guards.iter().enumerate() {
        match &cells[g][c] {
            RefCell::NotSent | RefCell::Proceed => {}
            RefCell::Pending => return Resolution::Open,
            RefCell::Skip(_) if guard.enforced => return Resolution::Skip(g),
            RefCell::Skip(_) => {}
            RefCell::Failed if !guard.enforced => {}
            RefCell::Failed => match guard.policy {
                FailurePolicy::FailClosed => return Resolution::FailClosed(g),
                FailurePolicy::Abort => return Resolution::Abort(g),
                FailurePolicy::FailOpen => {}
            },
        }
    }
    Resolution::Proceed
}

fn skip(text: &str) -> Skip {
    Skip {
        content: text.into(),
        kind: 0,
    }
}

proptest! {
    #![proptest_config(cases(2048))]

    /// Whatever arrives in whatever order, junk included: each cell keeps
    /// the first thing its guard said (R8), every call ends with exactly one
    /// resolution (R2), and it is the sequential one (R3, R4), with the
    /// bypassed fail_open guards recorded (R13).
    #[test]
    fn fuzz_fold_over_arbitrary_verdict_sequences(case in fold_case()) {
        let sent = case.sent.clone();
        let mut fold = Fold::new(case.guards.clone(), case.calls, |g, c| sent[g][c]);
        let mut cells: Vec<Vec<RefCell>> = sent
            .iter()
            .map(|row| row.iter().map(|&s| if s { RefCell::Pending } else { RefCell::NotSent }).collect())
            .collect();
        let settle = |cells: &mut Vec<Vec<RefCell>>, g: usize, to: RefCell| {
            for cell in cells[g].iter_mut() {
                if *cell == RefCell::Pending {
                    *cell = to.clone();
                }
            }
        };
        let ends = case
            .ends_failed
            .iter()
            .enumerate()
            .map(|(g, &f)| if f { Event::Fail(g) } else { Event::Complete(g) });
        for event in case.events.iter().copied().chain(ends) {
            match event {
                Event::Proceed(g, c) | Event::Skip(g, c) => {
                    let (verdict, cell) = match event {
                        Event::Skip(..) => (Some(skip(&format!("skip {g} {c}"))), RefCell::Skip(format!("skip {g} {c}"))),
                        _ => (None, RefCell::Proceed),
                    };
                    let pending = cells[g][c] == RefCell::Pending;
                    prop_assert_eq!(fold.answer(g, c, verdict), pending, "R8: only a pending cell takes a verdict");
                    if pending {
                        cells[g][c] = cell;
                    }
                }
                Event::Complete(g) => {
                    fold.complete(g);
                    settle(&mut cells, g, RefCell::Proceed);
                }
                Event::Fail(g) => {
                    fold.fail(g);
                    settle(&mut cells, g, RefCell::Failed);
                }
            }
            for (g, row) in cells.iter().enumerate() {
                prop_assert_eq!(fold.pending(g), row.contains(&RefCell::Pending));
            }
        }
        prop_assert!(fold.done(), "every guard ended: the fold is done");
        let mut aborts = Vec::new();
        for c in 0..case.calls {
            let want = sequential(&case, &cells, c);
            prop_assert_ne!(want, Resolution::Open);
            prop_assert_eq!(fold.resolution(c), want, "call {}", c);
            if let Resolution::Abort(g) = want {
                aborts.push(g);
            }
            let until = match want {
                Resolution::Skip(g) | Resolution::FailClosed(g) | Resolution::Abort(g) => g,
                _ => case.guards.len(),
            };
            let bypassed: Vec<usize> = (0..until)
                .filter(|&g| {
                    let guard = case.guards[g];
                    guard.enforced && guard.policy == FailurePolicy::FailOpen && cells[g][c] == RefCell::Failed
                })
                .collect();
            prop_assert_eq!(fold.bypassed(c).collect::<Vec<_>>(), bypassed);
            if let Resolution::Skip(g) = want {
                let RefCell::Skip(text) = &cells[g][c] else { unreachable!() };
                prop_assert_eq!(fold.take_skip(g, c).map(|s| s.content), Some(text.clone()));
                prop_assert!(matches!(fold.cell(g, c), Cell::Skip(_)));
            }
        }
        // The batch aborts exactly when some call reaches an `abort` failure.
        match fold.aborted_by() {
            None => prop_assert!(aborts.is_empty()),
            Some(g) => prop_assert!(aborts.contains(&g), "aborted by {} but {:?}", g, aborts),
        }
    }
}

// ---------------------------------------------------------------------------
// Config-file parsing
// ---------------------------------------------------------------------------

const VALID_CONFIG: &str = r#"
listen = "127.0.0.1:50051"
metrics_listen = "127.0.0.1:9090"
default_guard_timeout_ms = 1000
default_batch_timeout_ms = 5000
max_batch_timeout_ms = 30000

[limits]
max_calls_per_batch = 256
max_batch_bytes = 4194304
max_argument_bytes = 1048576

[guard_links]
connect_timeout_ms = 2000
backoff_initial_ms = 50
backoff_max_ms = 2000
max_answer_bytes = 4194304

[[guard]]
name = "sql-where"
endpoint = "http://127.0.0.1:7001"
tools = ["sql.*", "db.[ab]?"]
timeout_ms = 200
failure_policy = "fail_closed"
priority = -1

[[guard]]
name = "redact"
endpoint = "127.0.0.1:7002"
role = "mutate"
mode = "dry_run"
failure_policy = "fail_open"
grant = { tools = ["http.*"], may_rename = true }
"#;

/// Parsing never panics; a config that parses yields mesh settings and
/// registrations without panicking either.
fn parse_config(text: &str) {
    let Ok(config) = Config::parse(text, "fuzz.toml") else {
        return;
    };
    let mesh = config.mesh_config();
    assert!(mesh.link.backoff_initial > Duration::ZERO);
    for guard in &config.guards {
        if let Ok(g) = Guard::from_spec(&guard.to_spec(), mesh.default_guard_timeout) {
            assert_eq!(g.name, guard.name.trim());
        }
    }
}

/// Line-level damage to a valid file: lines dropped, duplicated, swapped,
/// cut, or given a character from TOML's syntax.
fn mutate_config(edits: &[(usize, u8, char)]) -> String {
    let mut lines: Vec<String> = VALID_CONFIG.lines().map(str::to_owned).collect();
    for &(at, op, ch) in edits {
        if lines.is_empty() {
            lines.push(ch.to_string());
            continue;
        }
        let i = at % lines.len();
        match op % 6 {
            0 => {
                lines.remove(i);
            }
            1 => {
                let line = lines[i].clone();
                lines.insert(i, line);
            }
            2 => {
                let j = (at / 7) % lines.len();
                lines.swap(i, j);
            }
            3 => {
                let line = &mut lines[i];
                let cut = (at / 3) % (line.chars().count() + 1);
                *line = line.chars().take(cut).collect();
            }
            4 => {
                let line = &mut lines[i];
                let pos = (at / 3) % (line.chars().count() + 1);
                let mut chars: Vec<char> = line.chars().collect();
                chars.insert(pos, ch);
                *line = chars.into_iter().collect();
            }
            _ => {
                // Replace a value: big, negative, wrong type, or empty.
                if let Some((key, _)) = lines[i].split_once('=') {
                    let value = [
                        "18446744073709551615",
                        "-1",
                        "0",
                        "\"x\"",
                        "[]",
                        "{}",
                        "1e400",
                        "\"\"",
                    ][usize::from(op) % 8];
                    lines[i] = format!("{key}= {value}");
                }
            }
        }
    }
    lines.join("\n")
}

#[test]
fn fuzz_config_seed_is_valid() {
    let config = Config::parse(VALID_CONFIG, "seed.toml").expect("the seed config parses");
    assert_eq!(config.guards.len(), 2);
    parse_config(VALID_CONFIG);
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn fuzz_config_parse_arbitrary_text(text in prop_oneof![
        "\\PC{0,200}",
        "[\\[\\]{}=\"'a-z_0-9.,# \n-]{0,200}",
    ]) {
        parse_config(&text);
    }

    #[test]
    fn fuzz_config_parse_mutated_valid_file(edits in prop::collection::vec(
        (any::<usize>(), any::<u8>(), prop::sample::select(vec!['[', ']', '{', '}', '=', '"', '\'', '#', ',', '.', '\n', '\\', '0', '-', 'x', 'é'])),
        1..6,
    )) {
        parse_config(&mutate_config(&edits));
    }
}
