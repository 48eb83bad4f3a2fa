//! The HTTP/2 body of an `Evaluate` answer stream, framed by the mesh.
//!
//! tonic's server encoder writes every message of a stream into one buffer
//! that lives as long as the stream and keeps the largest size it grew to:
//! a coordinator stream that was answered once (a four-call answer is some
//! 6 KiB, each call in it three times, R12) held that buffer while idle,
//! about 8 KiB of each idle stream's memory. Here each answer is framed into
//! a buffer of its own size (its gRPC message prefix, then the encoded
//! `EvaluateResponse`), handed to the transport and freed once written: an
//! idle stream holds none. (Answers ready together are not gathered into
//! one frame: each further one would copy the frame it grows, and the
//! transport writes the frames it holds together anyway.) The stream's end, or
//! an error that ends it, is sent as trailers as tonic's server body sends
//! them (`grpc-status`, `grpc-message`). Request decoding, the response's
//! headers and compression negotiation stay tonic's.

use super::service::AnswerStream;
use guardmesh_proto::v1::EvaluateResponse;
use http_body::Frame;
use prost::Message;
use prost::bytes::{BufMut, Bytes, BytesMut};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tonic::Status;

/// The gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

/// An `Evaluate` stream's answers as HTTP/2 frames, then its trailers.
#[derive(Debug)]
pub(crate) struct AnswerBody {
    answers: AnswerStream,
    /// The largest answer sent, in bytes (the server's encoding limit).
    max_message: usize,
    ended: bool,
}

impl AnswerBody {
    pub(crate) fn new(answers: AnswerStream, max_message: usize) -> Self {
        Self {
            answers,
            max_message,
            ended: false,
        }
    }
}

/// Appends `response`, of `len` encoded bytes (its `encoded_len`, counted
/// once when it was queued), to `buf` as one uncompressed gRPC message;
/// refused `OUT_OF_RANGE` over `max_message` bytes, as tonic refuses it.
fn frame_into(
    buf: &mut BytesMut,
    response: &EvaluateResponse,
    len: usize,
    max_message: usize,
) -> Result<(), Status> {
    debug_assert_eq!(len, response.encoded_len());
    if len > max_message {
        return Err(Status::out_of_range(format!(
            "an answer of {len} bytes is over the mesh's limit of {max_message} bytes per message"
        )));
    }
    let prefix = u32::try_from(len)
        .map_err(|_| Status::out_of_range(format!("an answer of {len} bytes")))?;
    buf.reserve(PREFIX_BYTES + len);
    buf.put_u8(0);
    buf.put_u32(prefix);
    response
        .encode(buf)
        .map_err(|e| Status::internal(format!("encoding an answer: {e}")))
}

impl http_body::Body for AnswerBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let status = match ready!(self.answers.poll_answer(cx)) {
            Some((Ok(response), len)) => {
                let mut buf = BytesMut::new();
                match frame_into(&mut buf, &response, len, self.max_message) {
                    Ok(()) => return Poll::Ready(Some(Ok(Frame::data(buf.freeze())))),
                    Err(status) => status,
                }
            }
            Some((Err(status), _)) => status,
            None => Status::ok(""),
        };
        // The end of the stream, or an error that ends it: its trailers.
        self.ended = true;
        let mut trailers = http::HeaderMap::with_capacity(3);
        Poll::Ready(Some(
            status
                .add_header(&mut trailers)
                .map(|()| Frame::trailers(trailers)),
        ))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{BatchError, evaluate_response};

    fn answer(batch_id: &str) -> EvaluateResponse {
        EvaluateResponse {
            batch_id: batch_id.into(),
            result: Some(evaluate_response::Result::Error(BatchError {
                code: 8,
                message: "busy".into(),
            })),
        }
    }

    #[test]
    fn r19_answers_are_framed_as_uncompressed_grpc_messages_that_decode_back() {
        let (first, second) = (answer("b1"), answer("b2"));
        let mut buf = BytesMut::new();
        frame_into(&mut buf, &first, first.encoded_len(), 1 << 20).unwrap();
        frame_into(&mut buf, &second, second.encoded_len(), 1 << 20).unwrap();
        let mut rest = &buf[..];
        for want in [first, second] {
            assert_eq!(rest[0], 0, "not compressed");
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let message = &rest[PREFIX_BYTES..PREFIX_BYTES + len];
            assert_eq!(EvaluateResponse::decode(message).unwrap(), want);
            rest = &rest[PREFIX_BYTES + len..];
        }
        assert!(rest.is_empty());
    }

    #[test]
    fn an_answer_over_the_limit_is_refused_out_of_range() {
        let mut buf = BytesMut::new();
        let long = answer(&"b".repeat(100));
        let status = frame_into(&mut buf, &long, long.encoded_len(), 50).unwrap_err();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert!(status.message().contains("limit of 50 bytes"), "{status:?}");
        assert!(buf.is_empty(), "nothing of it is sent");
    }
}
