//! The `Judge` stream on the mesh's side: requests to guards written once,
//! and guards' answers read off the wire (R23). Reached from outside the
//! mesh as `link::wire`.

use super::fields::{guard_batch, judge_request, judge_response, rewrite, verdict};
pub use super::read::Malformed;
use super::read::{self, LEN};
use super::write;
use guardmesh_proto::v1::{BatchContext, GuardBatch, JudgeRequest, JudgeResponse, ToolCall};
use prost::Message;
use prost::bytes::{Buf, BufMut, Bytes};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// An encoded `JudgeRequest`: `head`, then `shared`. A batch's `shared`
/// part is its context and calls (`GuardBatch.context` and `.calls`),
/// encoded once and shared, by reference count, by every guard of the
/// batch that is sent the same calls; `head` is the rest (the request's
/// key and length, the request id, the guard's name, deadline and trace
/// context). Protobuf readers accept fields in any order.
#[derive(Debug, Clone)]
pub struct Encoded {
    head: Bytes,
    shared: Bytes,
}

/// The bytes of a `GuardBatch`'s context and calls, to be encoded once per
/// batch and set of calls and shared by every guard sent that set (see
/// [`Encoded::batch`]).
pub fn shared_part<'a>(
    context: Option<&BatchContext>,
    calls: impl Iterator<Item = &'a ToolCall> + Clone,
) -> Bytes {
    let len = context.map_or(0, |c| write::message_len(guard_batch::CONTEXT, c))
        + calls
            .clone()
            .map(|call| write::message_len(guard_batch::CALLS, call))
            .sum::<usize>();
    let mut buf = Vec::with_capacity(len);
    if let Some(context) = context {
        write::message(guard_batch::CONTEXT, context, &mut buf);
    }
    for call in calls {
        write::message(guard_batch::CALLS, call, &mut buf);
    }
    Bytes::from(buf)
}

/// A guard request's own fields but its request id: the batch id, the
/// guard's name, the deadline and the trace context. Written once, from
/// borrowed text, when the request is made (no copy of that text is kept
/// but these bytes); the request id is written at each send
/// ([`Encoded::head_as`]), and a request moved to another replica with
/// less time left takes [`Head::with_deadline`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// `batch_id` and `guard`, then `traceparent` and `tracestate`,
    /// encoded; the deadline is written between the two.
    fields: Bytes,
    /// Where the trace context starts in `fields`.
    trace_at: usize,
    deadline_ms: u32,
}

impl Head {
    pub fn new(
        batch_id: &str,
        guard: &str,
        deadline_ms: u32,
        traceparent: &str,
        tracestate: &str,
    ) -> Self {
        use guard_batch::{BATCH_ID, GUARD, TRACEPARENT, TRACESTATE};
        let names =
            write::string_len(BATCH_ID, batch_id, true) + write::string_len(GUARD, guard, true);
        let trace = write::string_len(TRACEPARENT, traceparent, true)
            + write::string_len(TRACESTATE, tracestate, true);
        let mut fields = Vec::with_capacity(names + trace);
        write::string(BATCH_ID, batch_id, true, &mut fields);
        write::string(GUARD, guard, true, &mut fields);
        write::string(TRACEPARENT, traceparent, true, &mut fields);
        write::string(TRACESTATE, tracestate, true, &mut fields);
        Self {
            fields: fields.into(),
            trace_at: names,
            deadline_ms,
        }
    }

    /// The head of `batch` (its request id, context, calls, results and
    /// memory are not part of a head: they go in the shared part).
    pub fn of(batch: &GuardBatch) -> Self {
        debug_assert!(
            batch.context.is_none()
                && batch.calls.is_empty()
                && batch.results.is_empty()
                && batch.session.is_none()
        );
        Self::new(
            &batch.batch_id,
            &batch.guard,
            batch.deadline_ms,
            &batch.traceparent,
            &batch.tracestate,
        )
    }

    /// The same head with another deadline.
    pub fn with_deadline(&self, deadline_ms: u32) -> Self {
        Self {
            fields: self.fields.clone(),
            trace_at: self.trace_at,
            deadline_ms,
        }
    }
}

impl Encoded {
    /// Any request, encoded whole.
    pub fn request(request: &JudgeRequest) -> Self {
        Self {
            head: request.encode_to_vec().into(),
            shared: Bytes::new(),
        }
    }

    /// A batch: `head` is the batch without its context, calls, results
    /// and memory (see [`Head::of`]), `shared` its context and calls as
    /// [`shared_part`] encodes them.
    pub fn batch(head: &GuardBatch, shared: Bytes) -> Self {
        Self::head_as(&Head::of(head), head.request_id, shared)
    }

    /// A batch of `head`'s fields sent as request `request_id` (each
    /// replica a request goes to gives it its own), then `shared`. Its
    /// fields in the order prost writes them.
    pub fn head_as(head: &Head, request_id: u64, shared: Bytes) -> Self {
        let deadline = u64::from(head.deadline_ms);
        let own = write::varint_len(guard_batch::REQUEST_ID, request_id)
            + write::varint_len(guard_batch::DEADLINE_MS, deadline)
            + head.fields.len();
        let inner = own + shared.len();
        let mut bytes = Vec::with_capacity(write::header_len(judge_request::BATCH, inner) + own);
        write::header(judge_request::BATCH, inner, &mut bytes);
        write::varint(guard_batch::REQUEST_ID, request_id, &mut bytes);
        let (names, trace) = head.fields.split_at(head.trace_at);
        bytes.extend_from_slice(names);
        write::varint(guard_batch::DEADLINE_MS, deadline, &mut bytes);
        bytes.extend_from_slice(trace);
        Self {
            head: bytes.into(),
            shared,
        }
    }

    /// Encoded bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.shared.len()
    }

    /// Whether there are none (never, for a request).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, in one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.head);
        out.extend_from_slice(&self.shared);
        out
    }
}

/// A field of a guard's verdict that this mesh does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownField {
    /// The message it was found in: `Verdict` or `Rewrite`.
    pub message: &'static str,
    /// Its field number.
    pub number: u32,
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sent a verdict with {} field {}, which this mesh does not know (a newer protocol?); \
             a verdict the mesh cannot read never counts as proceed",
            self.message, self.number
        )
    }
}

/// A guard's answer, and the first unknown field of its verdicts.
#[derive(Debug)]
pub struct Answer {
    pub response: JudgeResponse,
    pub unknown: Option<UnknownField>,
}

/// The fields of a `Verdict` that this mesh knows, `rewrite` aside.
const VERDICT_FIELDS: [u32; 4] = [
    verdict::CALL_ID,
    verdict::SKIP,
    verdict::LABELS,
    verdict::ASK,
];

/// The fields of a `Rewrite`.
const REWRITE_FIELDS: [u32; 2] = [rewrite::TOOL, rewrite::ARGUMENTS];

/// Finds the first field of a verdict in a `JudgeResponse`'s bytes that
/// this mesh does not know: a `Verdict` field other than `call_id`,
/// `skip`, `rewrite`, `labels` and `ask` (such as a new outcome), or a `Rewrite` field
/// other than `tool` and `arguments` (a rewrite is applied whole or not
/// at all). Unknown fields elsewhere, inside a `Skip` included, do not
/// change what the verdict means for the call and are ignored: a skip
/// stands whatever else it carries (R23).
pub fn unknown_verdict_field(mut bytes: &[u8]) -> Result<Option<UnknownField>, Malformed> {
    while !bytes.is_empty() {
        let (number, wire_type) = read::key(&mut bytes)?;
        if number == judge_response::VERDICTS && wire_type == LEN {
            let verdict = read::length_delimited(&mut bytes)?;
            if let Some(field) = scan(verdict, "Verdict", &VERDICT_FIELDS, Some(verdict::REWRITE))?
            {
                return Ok(Some(field));
            }
        } else {
            read::skip(&mut bytes, number, wire_type, 0)?;
        }
    }
    Ok(None)
}

/// Walks a `Verdict` (`known` fields; `rewrite` scanned as a `Rewrite`)
/// or a `Rewrite` (`known` fields, no nested message to scan).
fn scan(
    mut bytes: &[u8],
    message: &'static str,
    known: &[u32],
    rewrite: Option<u32>,
) -> Result<Option<UnknownField>, Malformed> {
    while !bytes.is_empty() {
        let (number, wire_type) = read::key(&mut bytes)?;
        if Some(number) == rewrite {
            if wire_type == LEN {
                let inner = read::length_delimited(&mut bytes)?;
                if let Some(field) = scan(inner, "Rewrite", &REWRITE_FIELDS, None)? {
                    return Ok(Some(field));
                }
            } else {
                // A known field of the wrong type: prost refuses it.
                read::skip(&mut bytes, number, wire_type, 0)?;
            }
        } else if known.contains(&number) {
            read::skip(&mut bytes, number, wire_type, 0)?;
        } else {
            return Ok(Some(UnknownField { message, number }));
        }
    }
    Ok(None)
}

/// The `Judge` stream's codec on the mesh's side: requests encoded by
/// prost; answers walked for unknown verdict fields, then decoded.
#[derive(Debug, Clone, Copy, Default)]
pub struct JudgeCodec;

impl Codec for JudgeCodec {
    type Encode = Encoded;
    type Decode = Answer;
    type Encoder = JudgeCodec;
    type Decoder = JudgeCodec;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl Encoder for JudgeCodec {
    type Item = Encoded;
    type Error = Status;

    fn encode(&mut self, item: Encoded, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item.head);
        dst.put_slice(&item.shared);
        Ok(())
    }

    /// A guard link is one stream that carries every batch sent to its
    /// guard: a write buffer with room for many requests, so that the
    /// buffer rarely grows (and copies what it holds) while requests
    /// queue up under load.
    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::new(64 * 1024, 32 * 1024)
    }
}

impl Decoder for JudgeCodec {
    type Item = Answer;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Answer>, Status> {
        let len = src.remaining();
        // The frame is one contiguous buffer; copy only if it is not.
        if src.chunk().len() < len {
            let owned = src.copy_to_bytes(len);
            return read_answer(&owned).map(Some);
        }
        let answer = read_answer(src.chunk())?;
        src.advance(len);
        Ok(Some(answer))
    }
}

pub(crate) fn read_answer(bytes: &[u8]) -> Result<Answer, Status> {
    let malformed = |e: String| Status::internal(format!("guard sent an unreadable answer: {e}"));
    let unknown = unknown_verdict_field(bytes).map_err(|e| malformed(e.to_string()))?;
    let response = JudgeResponse::decode(bytes).map_err(|e| malformed(e.to_string()))?;
    Ok(Answer { response, unknown })
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{Rewrite, Skip, Verdict, verdict::Outcome};

    fn field(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
        prost::encoding::encode_key(number, prost::encoding::WireType::LengthDelimited, out);
        prost::encoding::encode_varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    fn response_with(verdict: Vec<u8>, extra: &[u8]) -> Vec<u8> {
        let mut out = JudgeResponse {
            request_id: 7,
            ..Default::default()
        }
        .encode_to_vec();
        field(&mut out, 2, &verdict);
        out.extend_from_slice(extra);
        out
    }

    #[test]
    fn r23_known_verdicts_have_no_unknown_field() {
        let response = JudgeResponse {
            request_id: 1,
            verdicts: vec![
                Verdict {
                    labels: Vec::new(),
                    call_id: "a".into(),
                    outcome: Some(Outcome::Skip(Skip {
                        content: "no".into(),
                        kind: 1,
                    })),
                },
                Verdict {
                    labels: Vec::new(),
                    call_id: "b".into(),
                    outcome: Some(Outcome::Rewrite(Rewrite {
                        tool: Some("t".into()),
                        arguments: Some("{}".into()),
                    })),
                },
                Verdict {
                    labels: Vec::new(),
                    call_id: "c".into(),
                    outcome: None,
                },
            ],
            partial: true,
            error: String::new(),
        };
        assert_eq!(unknown_verdict_field(&response.encode_to_vec()), Ok(None));
    }

    #[test]
    fn r23_unknown_fields_in_verdicts_and_rewrites_are_found_others_ignored() {
        let base = Verdict {
            labels: Vec::new(),
            call_id: "a".into(),
            outcome: None,
        }
        .encode_to_vec();
        // Field 9 of Verdict, as a message (a new outcome) and as a
        // varint; field 4 (`labels`) is known.
        let mut v = base.clone();
        field(&mut v, 4, b"secret:fs");
        assert_eq!(unknown_verdict_field(&response_with(v, &[])).unwrap(), None);
        let mut v = base.clone();
        field(&mut v, 9, b"\x0a\x01x");
        let found = unknown_verdict_field(&response_with(v, &[])).unwrap();
        assert_eq!(
            found,
            Some(UnknownField {
                message: "Verdict",
                number: 9
            })
        );
        let mut v = base.clone();
        v.extend_from_slice(&[0x48, 0x01]);
        assert_eq!(
            unknown_verdict_field(&response_with(v, &[])).unwrap(),
            Some(UnknownField {
                message: "Verdict",
                number: 9
            })
        );
        // A rewrite with a field 3.
        let mut rewrite = Vec::new();
        field(&mut rewrite, 3, b"drop");
        let mut v = base.clone();
        field(&mut v, 3, &rewrite);
        assert_eq!(
            unknown_verdict_field(&response_with(v, &[])).unwrap(),
            Some(UnknownField {
                message: "Rewrite",
                number: 3
            })
        );
        // Unknown fields in a skip, and after the verdicts (a group
        // included), are ignored.
        let mut skip = Skip {
            content: "no".into(),
            kind: 0,
        }
        .encode_to_vec();
        field(&mut skip, 9, b"why");
        let mut v = base.clone();
        field(&mut v, 2, &skip);
        let mut extra = Vec::new();
        field(&mut extra, 5, b"new top-level field");
        extra.extend_from_slice(&[0x30, 0x05]); // field 6, varint
        extra.extend_from_slice(&[0x3b, 0x08, 0x01, 0x3c]); // group 7 { 1: 1 }
        let bytes = response_with(v, &extra);
        assert_eq!(unknown_verdict_field(&bytes), Ok(None));
        assert!(JudgeResponse::decode(&bytes[..]).is_ok());
    }

    proptest::proptest! {
        /// The scan never panics, and never refuses what prost reads.
        #[test]
        fn r23_scan_accepts_whatever_prost_decodes(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96)
        ) {
            let scanned = unknown_verdict_field(&bytes);
            if JudgeResponse::decode(&bytes[..]).is_ok() {
                proptest::prop_assert!(scanned.is_ok(), "{:?}", scanned);
            }
        }
    }

    fn batch(guard: &str, request_id: u64, arguments: &str) -> GuardBatch {
        GuardBatch {
            request_id,
            batch_id: "b/1".into(),
            guard: guard.into(),
            context: Some(BatchContext {
                session_id: "s".into(),
                turn_index: 3,
                model_text: "text".into(),
                metadata: [("tenant".to_owned(), "acme".to_owned())].into(),
            }),
            calls: vec![
                ToolCall {
                    call_id: "c1".into(),
                    tool: "sql.query".into(),
                    arguments: arguments.into(),
                },
                ToolCall {
                    call_id: "c2".into(),
                    tool: "fs.read".into(),
                    arguments: "{}".into(),
                },
            ],
            deadline_ms: 250,
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            tracestate: String::new(),
            ..GuardBatch::default()
        }
    }

    fn decoded(encoded: &Encoded) -> JudgeRequest {
        JudgeRequest::decode(&encoded.to_vec()[..]).unwrap()
    }

    fn whole_batch(request: &JudgeRequest) -> GuardBatch {
        match &request.kind {
            Some(guardmesh_proto::v1::judge_request::Kind::Batch(batch)) => batch.clone(),
            other => panic!("not a batch: {other:?}"),
        }
    }

    fn as_request(batch: GuardBatch) -> JudgeRequest {
        JudgeRequest {
            kind: Some(guardmesh_proto::v1::judge_request::Kind::Batch(batch)),
        }
    }

    /// Encodes `batch` as the mesh does: its context and calls apart.
    fn encoded(batch: &GuardBatch) -> Encoded {
        let shared = shared_part(batch.context.as_ref(), batch.calls.iter());
        let head = GuardBatch {
            context: None,
            calls: Vec::new(),
            ..batch.clone()
        };
        Encoded::batch(&head, shared)
    }

    #[test]
    fn batches_encoded_in_two_parts_read_as_prost_encodes_them() {
        for batch in [
            batch("g1", 1, "{\"q\":1}"),
            batch("g3", u64::MAX, &"x".repeat(300)),
            GuardBatch {
                request_id: 9,
                ..GuardBatch::default()
            },
        ] {
            let encoded = encoded(&batch);
            let whole = as_request(batch);
            assert_eq!(decoded(&encoded), whole);
            assert_eq!(encoded.len(), whole.encoded_len());
        }
        // Guards sent the same calls share one buffer.
        let b = batch("g1", 1, "{}");
        let shared = shared_part(b.context.as_ref(), b.calls.iter());
        let head = GuardBatch {
            context: None,
            calls: Vec::new(),
            ..b.clone()
        };
        let (x, y) = (
            Encoded::batch(&head, shared.clone()),
            Encoded::batch(&head, shared),
        );
        assert_eq!(x.shared.as_ptr(), y.shared.as_ptr());
        let cancel = JudgeRequest {
            kind: Some(guardmesh_proto::v1::judge_request::Kind::Cancel(
                guardmesh_proto::v1::CancelBatch { request_id: 4 },
            )),
        };
        assert_eq!(decoded(&Encoded::request(&cancel)), cancel);
    }

    #[test]
    fn a_head_sent_with_another_request_id_reads_as_that_id_alone() {
        let b = batch("g1", 0, "{\"q\":1}");
        let shared = shared_part(b.context.as_ref(), b.calls.iter());
        for (own, sent) in [(0, 7), (0, u64::MAX), (5, 7), (5, 0), (u64::MAX, 1)] {
            let head = GuardBatch {
                request_id: own,
                context: None,
                calls: Vec::new(),
                ..b.clone()
            };
            let encoded = Encoded::head_as(&Head::of(&head), sent, shared.clone());
            let whole = as_request(GuardBatch {
                request_id: sent,
                ..b.clone()
            });
            assert_eq!(decoded(&encoded), whole, "own {own}, sent {sent}");
            assert_eq!(encoded.len(), whole.encoded_len(), "own {own}, sent {sent}");
            // The id appears once: no reader has two to choose between.
            let bytes = encoded.to_vec();
            let mut rest = &bytes[..];
            let (_, _) = super::super::read::key(&mut rest).unwrap();
            let _ = prost::encoding::decode_varint(&mut rest).unwrap();
            let ids = super::super::read::Fields(rest)
                .filter(|f| f.is_ok_and(|(number, _)| number == 1))
                .count();
            assert_eq!(ids, usize::from(sent != 0), "own {own}, sent {sent}");
        }
    }

    #[test]
    fn r14_r32_a_moved_request_reads_with_its_new_deadline_alone() {
        let mut b = batch("g1", 0, "{\"q\":1}");
        b.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into();
        b.tracestate = "k=v".into();
        let shared = shared_part(b.context.as_ref(), b.calls.iter());
        let head = Head::of(&GuardBatch {
            context: None,
            calls: Vec::new(),
            ..b.clone()
        });
        for deadline in [0, 1, 250, u32::MAX] {
            let moved = head.with_deadline(deadline);
            let encoded = Encoded::head_as(&moved, 3, shared.clone());
            let whole = as_request(GuardBatch {
                request_id: 3,
                deadline_ms: deadline,
                ..b.clone()
            });
            assert_eq!(decoded(&encoded), whole, "deadline {deadline}");
            assert_eq!(encoded.len(), whole.encoded_len(), "deadline {deadline}");
            // The head alone, byte for byte as prost writes it (its fields
            // in prost's order; the shared part follows them).
            let alone = as_request(GuardBatch {
                context: None,
                calls: Vec::new(),
                ..whole_batch(&whole)
            });
            assert_eq!(
                Encoded::head_as(&moved, 3, Bytes::new()).to_vec(),
                alone.encode_to_vec(),
                "deadline {deadline}"
            );
        }
    }

    #[test]
    fn r23_truncated_answers_are_malformed() {
        let mut v = Vec::new();
        field(&mut v, 1, b"abc");
        let bytes = response_with(v, &[]);
        for cut in 1..bytes.len() {
            let scanned = unknown_verdict_field(&bytes[..cut]);
            if JudgeResponse::decode(&bytes[..cut]).is_ok() {
                assert_eq!(scanned, Ok(None), "cut at {cut}");
            } else {
                assert!(scanned.is_err(), "cut at {cut}");
            }
        }
    }
}
