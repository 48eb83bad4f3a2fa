//! The HTTP/2 body of an `Evaluate` answer stream, framed by the mesh.
//!
//! tonic's server encoder writes every message of a stream into one buffer
//! that lives as long as the stream and keeps the largest size it grew to:
//! a coordinator stream that was answered once (a four-call answer is some
//! 6 KiB, each call in it three times, R12) held that buffer while idle,
//! about 8 KiB of each idle stream's memory. Here each answer is framed into
//! a buffer of its own size (its gRPC message prefix, then the encoded
//! `EvaluateResponse`), handed to the transport and freed once written: an
//! idle stream holds none. Answers ready together are gathered into one
//! frame, as tonic's encoder gathers them (up to [`GATHER_BYTES`]): each
//! HTTP/2 data frame costs the transport some 900 instructions of its own
//! (its stream's send queue, flow control, the frame's head), about a
//! tenth of a batch's encoding at 16 batches in flight on one stream, where
//! one frame per answer had doubled the frames sent. They are taken first
//! and framed into one buffer of their summed size, so no frame is copied
//! as it grows. The stream's end, or
//! an error that ends it, is sent as trailers as tonic's server body sends
//! them (`grpc-status`, `grpc-message`), after every answer taken before
//! it. Request decoding, the response's headers and compression negotiation
//! stay tonic's.

use super::service::AnswerStream;
use guardmesh_proto::v1::{BatchDecision, EvaluateResponse, evaluate_response};
use http_body::Frame;
use prost::Message;
use prost::bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{
    WireType, bool, encode_key, encode_varint, encoded_len_varint, key_len, string, uint64,
};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tonic::Status;

/// The gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

/// `EvaluateResponse.batch_id`'s and `.decision`'s field numbers.
const BATCH_ID_FIELD: u32 = 1;
const DECISION_FIELD: u32 = 2;

/// `BatchDecision`'s field numbers.
mod batch_decision {
    pub(super) const DECISIONS: u32 = 1;
    pub(super) const EXECUTE: u32 = 2;
    pub(super) const TRACE: u32 = 3;
    pub(super) const CHAIN_REVISION: u32 = 4;
    pub(super) const TRACE_ID: u32 = 5;
    pub(super) const RESULTS: u32 = 6;
    pub(super) const JUDGES_RESULTS: u32 = 7;
}

/// An answer's encoded length, counted once when it is queued: the whole
/// message's, and its decision's when it has one (the prefix of that
/// field, which encoding the message would count again, nested messages
/// and all).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Counted {
    /// The encoded `EvaluateResponse`, in bytes.
    pub(crate) len: usize,
    /// Its `decision` field's message, when it has one.
    decision: Option<DecisionLengths>,
}

/// A `BatchDecision`'s encoded length, then those of the messages of its
/// repeated fields in field order (`decisions`, `execute`, `trace`,
/// `results`): written as counted, not counted again for each level of
/// nesting as prost's encoding of the whole message counts them. One
/// boxed slice of `u32` (an answer is at most `u32::MAX` bytes, its gRPC
/// prefix says so), so that a queued answer is no larger than it was
/// before these lengths were kept: each stream's channel holds a block of
/// answer slots while it is open.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DecisionLengths(Box<[u32]>);

impl DecisionLengths {
    /// The decision's own length.
    fn len(&self) -> usize {
        self.0.first().map_or(0, |&len| len as usize)
    }

    /// Its nested messages' lengths, in the order written.
    fn parts(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().skip(1).map(|&len| len as usize)
    }
}

/// A length as kept: one over `u32::MAX` is kept as `u32::MAX`, which no
/// message encodes to, so the frame is refused (over the message limit,
/// or as written at another length than counted), never sent.
fn kept(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// A nested message's field: its key, length and message, in bytes.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

impl DecisionLengths {
    fn of(decision: &BatchDecision) -> Self {
        use batch_decision as f;
        // Every field named: a field added to the message is a field this
        // count and `write_decision` must write.
        let BatchDecision {
            decisions,
            execute,
            trace,
            chain_revision,
            trace_id,
            results,
            judges_results,
        } = decision;
        let mut parts =
            Vec::with_capacity(1 + decisions.len() + execute.len() + trace.len() + results.len());
        parts.push(0);
        let mut len = 0;
        let mut count = |tag: u32, message_len: usize| {
            parts.push(kept(message_len));
            len += field_len(tag, message_len);
        };
        decisions
            .iter()
            .for_each(|m| count(f::DECISIONS, m.encoded_len()));
        execute
            .iter()
            .for_each(|m| count(f::EXECUTE, m.encoded_len()));
        trace.iter().for_each(|m| count(f::TRACE, m.encoded_len()));
        results
            .iter()
            .for_each(|m| count(f::RESULTS, m.encoded_len()));
        if *chain_revision != 0 {
            len += uint64::encoded_len(f::CHAIN_REVISION, chain_revision);
        }
        if !trace_id.is_empty() {
            len += string::encoded_len(f::TRACE_ID, trace_id);
        }
        if *judges_results {
            len += bool::encoded_len(f::JUDGES_RESULTS, judges_results);
        }
        parts[0] = kept(len);
        Self(parts.into_boxed_slice())
    }
}

/// Writes `decision`'s fields, in field order as prost writes them, each
/// nested message with its length as counted in `lengths`; `Err` with
/// what went wrong if a nested message is not of its counted length (what
/// was written of it is then garbage, to be truncated).
fn write_decision(
    decision: &BatchDecision,
    lengths: &DecisionLengths,
    buf: &mut BytesMut,
) -> Result<(), String> {
    use batch_decision as f;
    let BatchDecision {
        decisions,
        execute,
        trace,
        chain_revision,
        trace_id,
        results,
        judges_results,
    } = decision;
    let mut parts = lengths.parts();
    nested(f::DECISIONS, decisions, &mut parts, buf)?;
    nested(f::EXECUTE, execute, &mut parts, buf)?;
    nested(f::TRACE, trace, &mut parts, buf)?;
    if *chain_revision != 0 {
        uint64::encode(f::CHAIN_REVISION, chain_revision, buf);
    }
    if !trace_id.is_empty() {
        string::encode(f::TRACE_ID, trace_id, buf);
    }
    nested(f::RESULTS, results, &mut parts, buf)?;
    if *judges_results {
        bool::encode(f::JUDGES_RESULTS, judges_results, buf);
    }
    Ok(())
}

/// Writes `messages` as the repeated field `tag`, each with the next of
/// the lengths counted; `Err` if one is not of that length.
fn nested<M: Message>(
    tag: u32,
    messages: &[M],
    lengths: &mut impl Iterator<Item = usize>,
    buf: &mut BytesMut,
) -> Result<(), String> {
    for message in messages {
        let Some(counted) = lengths.next() else {
            return Err(format!("field {tag} has more messages than were counted"));
        };
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(counted as u64, buf);
        let at = buf.len();
        message.encode_raw(buf);
        let wrote = buf.len() - at;
        if wrote != counted {
            return Err(format!(
                "a message of field {tag} encoded to {wrote} bytes, not the {counted} it was counted at"
            ));
        }
    }
    Ok(())
}

impl Counted {
    pub(crate) fn of(response: &EvaluateResponse) -> Self {
        // Every field named: a field added to the message is a field this
        // count and `frame_into` must write.
        let EvaluateResponse { batch_id, result } = response;
        match result {
            Some(evaluate_response::Result::Decision(decision)) => {
                let lengths = DecisionLengths::of(decision);
                Self {
                    len: batch_id_len(batch_id) + field_len(DECISION_FIELD, lengths.len()),
                    decision: Some(lengths),
                }
            }
            Some(evaluate_response::Result::Error(_)) | None => Self {
                len: response.encoded_len(),
                decision: None,
            },
        }
    }
}

/// `batch_id`'s field, as proto3 writes it: nothing when empty.
fn batch_id_len(batch_id: &String) -> usize {
    if batch_id.is_empty() {
        0
    } else {
        string::encoded_len(BATCH_ID_FIELD, batch_id)
    }
}

/// Answers ready together are gathered into one frame until it holds this
/// many bytes (tonic's encoder yields at the same size), so a frame is at
/// most this plus one answer.
pub(crate) const GATHER_BYTES: usize = 32 * 1024;

/// Where an [`AnswerBody`] takes its answers from: a stream's queue of
/// answers ([`AnswerStream`]), or a test's script.
pub(crate) trait Answers: Unpin {
    /// The next answer with its length as counted when it was queued;
    /// `None` once the stream has no more.
    fn poll_answer(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(Result<EvaluateResponse, Status>, Counted)>>;
}

impl Answers for AnswerStream {
    fn poll_answer(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(Result<EvaluateResponse, Status>, Counted)>> {
        AnswerStream::poll_answer(self, cx)
    }
}

/// An `Evaluate` stream's answers as HTTP/2 frames, then its trailers.
#[derive(Debug)]
pub(crate) struct AnswerBody<A = AnswerStream> {
    answers: A,
    /// The largest answer sent, in bytes (the server's encoding limit).
    max_message: usize,
    /// How the stream ends, once known while the answers taken before it
    /// are still to be sent: its trailers follow their frame. Boxed: every
    /// open stream holds one of these bodies.
    end: Option<Box<Status>>,
    ended: bool,
}

impl<A: Answers> AnswerBody<A> {
    pub(crate) fn new(answers: A, max_message: usize) -> Self {
        Self {
            answers,
            max_message,
            end: None,
            ended: false,
        }
    }

    /// The stream's trailers, for `status`; nothing after them.
    fn trailers(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.ended = true;
        let mut trailers = http::HeaderMap::with_capacity(3);
        Poll::Ready(Some(
            status
                .add_header(&mut trailers)
                .map(|()| Frame::trailers(trailers)),
        ))
    }
}

/// Appends `response`, of the length `counted` when it was queued, to
/// `buf` as one uncompressed gRPC message; refused `OUT_OF_RANGE` over
/// `max_message` bytes, as tonic refuses it, and `INTERNAL` (nothing
/// appended) if it does not encode to that length.
fn frame_into(
    buf: &mut BytesMut,
    response: &EvaluateResponse,
    counted: &Counted,
    max_message: usize,
) -> Result<(), Status> {
    let len = counted.len;
    if len > max_message {
        return Err(Status::out_of_range(format!(
            "an answer of {len} bytes is over the mesh's limit of {max_message} bytes per message"
        )));
    }
    let prefix = u32::try_from(len)
        .map_err(|_| Status::out_of_range(format!("an answer of {len} bytes")))?;
    buf.reserve(PREFIX_BYTES + len);
    let start = buf.len();
    buf.put_u8(0);
    buf.put_u32(prefix);
    // Written without `encode`, whose check of the room left counts the
    // whole answer's length again, and with the decision's lengths as
    // counted (prost's would count them, every nested message's, once or
    // twice more): the lengths are known, and the room reserved.
    match (&response.result, &counted.decision) {
        (Some(evaluate_response::Result::Decision(decision)), Some(lengths)) => {
            if !response.batch_id.is_empty() {
                string::encode(BATCH_ID_FIELD, &response.batch_id, buf);
            }
            let inner = lengths.len();
            encode_key(DECISION_FIELD, WireType::LengthDelimited, buf);
            encode_varint(inner as u64, buf);
            let at = buf.len();
            let wrote = write_decision(decision, lengths, buf).and_then(|()| {
                let wrote = buf.len() - at;
                if wrote == inner {
                    Ok(())
                } else {
                    Err(format!(
                        "its decision encoded to {wrote} bytes, not the {inner} it was counted at"
                    ))
                }
            });
            if let Err(what) = wrote {
                buf.truncate(start);
                return Err(Status::internal(format!(
                    "an answer was not written: {what}"
                )));
            }
        }
        _ => response.encode_raw(buf),
    }
    let written = buf.len() - start - PREFIX_BYTES;
    if written != len {
        // Never sent: a frame whose prefix disagrees with its message
        // would garble every later message of the stream.
        buf.truncate(start);
        return Err(Status::internal(format!(
            "an answer encoded to {written} bytes, not the {len} it was counted at"
        )));
    }
    Ok(())
}

impl<A: Answers> http_body::Body for AnswerBody<A> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Some(status) = self.end.take() {
            return self.trailers(*status);
        }
        let first = match ready!(self.answers.poll_answer(cx)) {
            Some((Ok(response), counted)) => (response, counted),
            Some((Err(status), _)) => return self.trailers(status),
            None => return self.trailers(Status::ok("")),
        };
        // The answers ready with it, while the frame is under its bound;
        // each counted at most at the limit (one over it is refused below,
        // before any room is made for it).
        let max_message = self.max_message;
        let room = |counted: &Counted| PREFIX_BYTES.saturating_add(counted.len.min(max_message));
        let mut bytes = room(&first.1);
        let mut more = Vec::new();
        while bytes < GATHER_BYTES {
            match self.answers.poll_answer(cx) {
                Poll::Ready(Some((Ok(response), counted))) => {
                    bytes = bytes.saturating_add(room(&counted));
                    more.push((response, counted));
                }
                Poll::Ready(Some((Err(status), _))) => {
                    self.end = Some(Box::new(status));
                    break;
                }
                Poll::Ready(None) => {
                    self.end = Some(Box::new(Status::ok("")));
                    break;
                }
                Poll::Pending => break,
            }
        }
        let mut buf = BytesMut::with_capacity(bytes);
        for (response, counted) in std::iter::once(first).chain(more) {
            if let Err(status) = frame_into(&mut buf, &response, &counted, max_message) {
                // The answers framed before it are sent; it and those
                // after it are not, and the stream ends with why.
                self.end = Some(Box::new(status));
                break;
            }
        }
        if buf.is_empty() {
            let status = self
                .end
                .take()
                .map_or_else(|| Status::ok(""), |status| *status);
            return self.trailers(status);
        }
        Poll::Ready(Some(Ok(Frame::data(buf.freeze()))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{
        Action, ApprovalRequest, BatchError, CallDecision, GuardTrace, ResultDecision, ToolCall,
        ToolResult, evaluate_response,
    };

    fn answer(batch_id: &str) -> EvaluateResponse {
        EvaluateResponse {
            batch_id: batch_id.into(),
            result: Some(evaluate_response::Result::Error(BatchError {
                code: 8,
                message: "busy".into(),
            })),
        }
    }

    /// A decision of `calls` calls, each in it three times (R12), with a
    /// trace entry per guard (R21): long enough that its lengths take
    /// varints of two and three bytes.
    fn decided(batch_id: &str, calls: usize, arguments: usize) -> EvaluateResponse {
        let call = |i: usize| ToolCall {
            call_id: format!("c{i}"),
            tool: "sql.query".into(),
            arguments: format!("{{\"q\":\"{}\"}}", "x".repeat(arguments)),
        };
        EvaluateResponse {
            batch_id: batch_id.into(),
            result: Some(evaluate_response::Result::Decision(BatchDecision {
                decisions: (0..calls)
                    .map(|i| CallDecision {
                        call_id: format!("c{i}"),
                        action: Action::Proceed as i32,
                        call: Some(call(i)),
                        original: Some(call(i)),
                        ..Default::default()
                    })
                    .collect(),
                execute: (0..calls).map(call).collect(),
                trace: (0..4)
                    .map(|g| GuardTrace {
                        guard: format!("g{g}"),
                        latency_us: 1234,
                        sent_call_ids: (0..calls).map(|i| format!("c{i}")).collect(),
                        ..Default::default()
                    })
                    .collect(),
                chain_revision: 7,
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                ..Default::default()
            })),
        }
    }

    /// A decision with every field of `BatchDecision` set, and nested
    /// messages with maps, repeated fields and an approval request: of
    /// calls (R12, R21, R35) and of results (R33).
    fn decided_in_full() -> EvaluateResponse {
        let mut response = decided("b9", 3, 300);
        let Some(evaluate_response::Result::Decision(decision)) = &mut response.result else {
            unreachable!("decided answers with a decision")
        };
        decision.decisions[1].action = Action::Ask as i32;
        decision.decisions[1].approval = Some(ApprovalRequest {
            id: "ar-1".into(),
            guard: "g1".into(),
            reason: "a person must look".into(),
            digest: "d".repeat(64),
            chain_revision: 7,
            ..Default::default()
        });
        decision.decisions[2].rewritten_by = vec!["g0".into(), "g2".into()];
        decision.decisions[2].bypassed = vec!["g3".into()];
        decision.decisions[0].content = "Tool call blocked: é ✓".into();
        decision.trace[0].rules = [("c0".to_owned(), "no-delete".to_owned())].into();
        decision.trace[0].labels = vec!["pii".into()];
        decision.trace[2].error = "did not answer within 100 ms".into();
        decision.results = vec![
            ResultDecision {
                call_id: "c0".into(),
                result: "{\"rows\":3}".into(),
                original: Some(ToolResult {
                    call_id: "c0".into(),
                    result: "{\"rows\":3}".into(),
                    ..Default::default()
                }),
                rewritten_by: vec!["redact".into()],
                ..Default::default()
            },
            ResultDecision::default(),
        ];
        decision.judges_results = true;
        response
    }

    /// The messages of the frames in `buf`.
    fn messages(buf: &[u8]) -> Vec<&[u8]> {
        let mut rest = buf;
        let mut out = Vec::new();
        while !rest.is_empty() {
            assert_eq!(rest[0], 0, "not compressed");
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            out.push(&rest[PREFIX_BYTES..PREFIX_BYTES + len]);
            rest = &rest[PREFIX_BYTES + len..];
        }
        out
    }

    #[test]
    fn r19_answers_are_framed_as_uncompressed_grpc_messages_that_decode_back() {
        let (first, second) = (answer("b1"), answer("b2"));
        let mut buf = BytesMut::new();
        frame_into(&mut buf, &first, &Counted::of(&first), 1 << 20).unwrap();
        frame_into(&mut buf, &second, &Counted::of(&second), 1 << 20).unwrap();
        let framed = messages(&buf);
        assert_eq!(framed.len(), 2);
        for (message, want) in framed.into_iter().zip([first, second]) {
            assert_eq!(EvaluateResponse::decode(message).unwrap(), want);
        }
    }

    /// R12, R19: a decision is written with its lengths as counted when it
    /// was queued, and its bytes are prost's own, byte for byte: with and
    /// without a batch id, small and large (lengths of one to three varint
    /// bytes), every field set, an empty decision, an error, and an answer
    /// with no result.
    #[test]
    fn r19_decisions_are_written_as_prost_writes_them() {
        let answers = [
            decided("b1", 4, 500),
            decided("", 4, 500),
            decided("b2", 1, 0),
            decided("b3", 0, 0),
            decided(&"b".repeat(200), 64, 2_000),
            decided_in_full(),
            EvaluateResponse {
                batch_id: "b6".into(),
                result: Some(evaluate_response::Result::Decision(BatchDecision::default())),
            },
            answer("b4"),
            EvaluateResponse {
                batch_id: "b5".into(),
                result: None,
            },
        ];
        for response in answers {
            let counted = Counted::of(&response);
            assert_eq!(counted.len, response.encoded_len());
            let mut buf = BytesMut::new();
            frame_into(&mut buf, &response, &counted, 1 << 24).unwrap();
            let framed = messages(&buf);
            assert_eq!(framed, [response.encode_to_vec().as_slice()]);
        }
    }

    /// R19: a frame's length prefix is the length of the message it
    /// carries, or the frame is not written: a miscounted answer would
    /// garble the stream for every batch after it.
    #[test]
    fn r19_an_answer_counted_at_another_length_is_refused_and_nothing_is_appended() {
        let mut buf = BytesMut::new();
        let first = answer("b1");
        frame_into(&mut buf, &first, &Counted::of(&first), 1 << 20).unwrap();
        let framed = buf.len();
        let error = answer("b2");
        let decision = decided("b3", 4, 500);
        let right = Counted::of(&decision);
        let lengths = right.decision.clone().unwrap();
        let shorter = |by: u32| {
            let mut lengths = lengths.clone();
            lengths.0[0] -= by;
            lengths
        };
        // One nested message counted a byte short, the total kept.
        let mut part_short = lengths.clone();
        part_short.0[3] -= 1;
        let wrong = [
            (
                &error,
                Counted {
                    len: Counted::of(&error).len - 1,
                    decision: None,
                },
            ),
            (
                &error,
                Counted {
                    len: Counted::of(&error).len + 1,
                    decision: None,
                },
            ),
            (
                &decision,
                Counted {
                    len: right.len + 1,
                    ..right.clone()
                },
            ),
            (
                &decision,
                Counted {
                    decision: Some(shorter(1)),
                    ..right.clone()
                },
            ),
            (
                &decision,
                Counted {
                    len: right.len - 1,
                    decision: Some(shorter(1)),
                },
            ),
            (
                &decision,
                Counted {
                    decision: Some(part_short),
                    ..right.clone()
                },
            ),
        ];
        for (response, counted) in wrong {
            let status = frame_into(&mut buf, response, &counted, 1 << 20).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
            assert_eq!(buf.len(), framed, "nothing of it is appended");
        }
    }

    #[test]
    fn an_answer_over_the_limit_is_refused_out_of_range() {
        let mut buf = BytesMut::new();
        let long = answer(&"b".repeat(100));
        let status = frame_into(&mut buf, &long, &Counted::of(&long), 50).unwrap_err();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert!(status.message().contains("limit of 50 bytes"), "{status:?}");
        assert!(buf.is_empty(), "nothing of it is sent");
    }

    /// A stream's answers as a test scripts them.
    enum Step {
        Answer(Result<EvaluateResponse, Status>, Counted),
        Pending,
        End,
    }

    struct Script(std::collections::VecDeque<Step>);

    impl Answers for Script {
        fn poll_answer(
            &mut self,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<(Result<EvaluateResponse, Status>, Counted)>> {
            match self.0.pop_front() {
                Some(Step::Answer(answer, counted)) => Poll::Ready(Some((answer, counted))),
                Some(Step::Pending) => Poll::Pending,
                Some(Step::End) | None => Poll::Ready(None),
            }
        }
    }

    fn ok(response: &EvaluateResponse) -> Step {
        Step::Answer(Ok(response.clone()), Counted::of(response))
    }

    /// What a body gave when polled once.
    #[derive(Debug)]
    enum Polled {
        Data(Vec<EvaluateResponse>),
        Trailers(tonic::Code, String),
        Done,
        Pending,
    }

    fn poll(body: &mut AnswerBody<Script>) -> Polled {
        use http_body::Body;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match Pin::new(body).poll_frame(&mut cx) {
            Poll::Pending => Polled::Pending,
            Poll::Ready(None) => Polled::Done,
            Poll::Ready(Some(Err(status))) => panic!("a body error: {status:?}"),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => Polled::Data(
                    messages(&data)
                        .into_iter()
                        .map(|m| EvaluateResponse::decode(m).expect("decodes"))
                        .collect(),
                ),
                Err(frame) => {
                    let trailers = frame.into_trailers().expect("data or trailers");
                    let status = Status::from_header_map(&trailers).expect("grpc-status");
                    Polled::Trailers(status.code(), status.message().to_owned())
                }
            },
        }
    }

    fn body(steps: Vec<Step>) -> AnswerBody<Script> {
        AnswerBody::new(Script(steps.into()), 1 << 20)
    }

    /// R19: answers ready together go out in one frame, in the order they
    /// were queued, each its own gRPC message; one queued later goes in the
    /// next; the stream then ends with `OK`.
    #[test]
    fn r19_answers_ready_together_go_in_one_frame_in_their_order() {
        let a: Vec<EvaluateResponse> = (0..4).map(|i| decided(&format!("b{i}"), 4, 500)).collect();
        let mut body = body(vec![
            ok(&a[0]),
            ok(&a[1]),
            ok(&a[2]),
            Step::Pending,
            ok(&a[3]),
            // One ends the gathering after it, the next is the wait.
            Step::Pending,
            Step::Pending,
        ]);
        assert!(matches!(poll(&mut body), Polled::Data(m) if m == a[..3]));
        assert!(matches!(poll(&mut body), Polled::Data(m) if m == a[3..]));
        assert!(matches!(poll(&mut body), Polled::Pending));
        body.answers.0.push_back(Step::End);
        assert!(matches!(
            poll(&mut body),
            Polled::Trailers(tonic::Code::Ok, _)
        ));
        assert!(matches!(poll(&mut body), Polled::Done));
    }

    /// R19: the stream's end, or an error that ends it, found while
    /// gathering, follows the answers taken before it: none is lost.
    #[test]
    fn r19_an_end_found_while_gathering_follows_the_answers_before_it() {
        let a = [decided("b1", 4, 500), answer("b2")];
        let mut ended = body(vec![ok(&a[0]), ok(&a[1]), Step::End]);
        assert!(matches!(poll(&mut ended), Polled::Data(m) if m == a));
        assert!(matches!(
            poll(&mut ended),
            Polled::Trailers(tonic::Code::Ok, _)
        ));
        assert!(matches!(poll(&mut ended), Polled::Done));
        let mut failed = body(vec![
            ok(&a[0]),
            ok(&a[1]),
            Step::Answer(Err(Status::unavailable("draining")), Counted::default()),
            ok(&a[0]),
        ]);
        assert!(matches!(poll(&mut failed), Polled::Data(m) if m == a));
        assert!(matches!(
            poll(&mut failed),
            Polled::Trailers(tonic::Code::Unavailable, message) if message == "draining"
        ));
        assert!(matches!(poll(&mut failed), Polled::Done));
        // An error with nothing before it: the trailers at once.
        let mut at_once = body(vec![Step::Answer(
            Err(Status::resource_exhausted("busy")),
            Counted::default(),
        )]);
        assert!(matches!(
            poll(&mut at_once),
            Polled::Trailers(tonic::Code::ResourceExhausted, _)
        ));
    }

    /// R19: an answer among those gathered that does not encode to its
    /// counted length ends the stream `INTERNAL` after the answers before
    /// it; it and those after it are not sent.
    #[test]
    fn r19_a_miscounted_answer_gathered_ends_the_stream_after_those_before_it() {
        let a = [
            decided("b1", 4, 500),
            decided("b2", 4, 500),
            decided("b3", 4, 500),
        ];
        let wrong = Counted {
            len: Counted::of(&a[1]).len + 1,
            ..Counted::of(&a[1])
        };
        let mut stream = body(vec![
            ok(&a[0]),
            Step::Answer(Ok(a[1].clone()), wrong),
            ok(&a[2]),
        ]);
        assert!(matches!(poll(&mut stream), Polled::Data(m) if m == a[..1]));
        assert!(matches!(
            poll(&mut stream),
            Polled::Trailers(tonic::Code::Internal, _)
        ));
        assert!(matches!(poll(&mut stream), Polled::Done));
        // The first one miscounted: nothing is sent but the trailers.
        let short = Counted {
            len: Counted::of(&a[0]).len - 1,
            ..Counted::of(&a[0])
        };
        let mut first = body(vec![Step::Answer(Ok(a[0].clone()), short), ok(&a[1])]);
        assert!(matches!(
            poll(&mut first),
            Polled::Trailers(tonic::Code::Internal, _)
        ));
    }

    /// R19, R25: a frame holds answers up to its bound and one more at
    /// most, so many answers ready at once go in several frames, every one
    /// of them in order.
    #[test]
    fn r19_a_frame_holds_at_most_its_bound_and_one_answer() {
        let a: Vec<EvaluateResponse> = (0..40).map(|i| decided(&format!("b{i}"), 4, 500)).collect();
        let one = PREFIX_BYTES + Counted::of(&a[0]).len;
        let mut steps: Vec<Step> = a.iter().map(ok).collect();
        steps.push(Step::End);
        let mut body = body(steps);
        let mut sent = Vec::new();
        let mut frames = 0;
        loop {
            match poll(&mut body) {
                Polled::Data(m) => {
                    frames += 1;
                    let bytes: usize = m.iter().map(|r| PREFIX_BYTES + r.encoded_len()).sum();
                    assert!(bytes < GATHER_BYTES + one + 64, "{bytes} bytes in a frame");
                    sent.extend(m);
                }
                Polled::Trailers(code, _) => {
                    assert_eq!(code, tonic::Code::Ok);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(frames > 1, "{frames} frame(s) for {} bytes", one * a.len());
        assert_eq!(sent, a);
    }
}
