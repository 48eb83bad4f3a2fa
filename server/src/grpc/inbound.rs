//! Reading a coordinator's batches: sizes and counts are checked on the
//! message's wire form, before it is decoded (R20: limits are checked before
//! the costly work).
//!
//! The gRPC transport hands [`InboundDecoder`] one whole message, at most the
//! transport limit (a little above `limits.max_batch_bytes`). A cheap scan of
//! its top-level fields counts the calls and the metadata entries and finds
//! the `batch_id`; a batch over a limit is answered with a refusal carrying
//! only its (shown) id, and is never built. So a refused batch costs its
//! bytes once, and the stream stays open for the next batch (R20).

pub(crate) use crate::mesh::pipeline::{Inbound, Refused};
use crate::validate::{self, Limits, Refusal};
use crate::wire::fields::{batch_context, evaluate_request as request};
use crate::wire::read::Fields;
use guardmesh_proto::v1::EvaluateRequest;
use prost::Message;
use std::marker::PhantomData;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The initial size of a stream's read and write buffers. tonic's default
/// (8 KiB each) is allocated when a stream opens, so 1,000 idle coordinator
/// streams held 16 MiB they never used; buffers grow as messages need, and
/// keep what they grew to.
const STREAM_BUFFER_BYTES: usize = 1024;

/// Buffer settings of the mesh's streams (see [`STREAM_BUFFER_BYTES`]);
/// yielding to the transport after 32 KiB, tonic's default.
pub(crate) fn buffer_settings() -> BufferSettings {
    BufferSettings::new(STREAM_BUFFER_BYTES, 32 * 1024)
}

impl Inbound {
    /// Reads one encoded `EvaluateRequest`: scans it, then decodes it if it
    /// is within the limits.
    pub(crate) fn decode(bytes: &[u8], limits: &Limits) -> Self {
        let scan = match scan(bytes) {
            Ok(scan) => scan,
            Err(why) => {
                return Self::Refused(Refused {
                    batch_id: String::new(),
                    refusal: malformed(why),
                });
            }
        };
        let id = String::from_utf8_lossy(scan.batch_id);
        let shown = validate::shown_id(&id, limits.max_id_bytes);
        if let Err(refusal) =
            validate::check_counts(&id, bytes.len(), scan.calls, scan.metadata_entries, limits)
        {
            return Self::Refused(Refused {
                batch_id: shown,
                refusal,
            });
        }
        match EvaluateRequest::decode(bytes) {
            Ok(request) => Self::Batch {
                request,
                size: bytes.len(),
            },
            Err(error) => Self::Refused(Refused {
                batch_id: shown,
                refusal: malformed(&error.to_string()),
            }),
        }
    }
}

fn malformed(why: &str) -> Refusal {
    Refusal {
        reason: "malformed",
        status: Status::invalid_argument(format!(
            "the batch is not a valid EvaluateRequest: {}",
            validate::truncate(why, 200)
        )),
    }
}

/// What the scan of a message's top-level fields found.
#[derive(Debug, Default, PartialEq, Eq)]
struct Scan<'a> {
    /// The last `batch_id` field (proto3: the last one wins).
    batch_id: &'a [u8],
    calls: usize,
    /// `context.metadata` entries, over every `context` field.
    metadata_entries: usize,
}

fn scan(bytes: &[u8]) -> Result<Scan<'_>, &'static str> {
    let mut scan = Scan::default();
    for field in Fields(bytes) {
        let (number, value) = field?;
        // A number past `u32` is no field of these messages.
        match (u32::try_from(number), value) {
            (Ok(request::BATCH_ID), Some(value)) => scan.batch_id = value,
            (Ok(request::CONTEXT), Some(value)) => {
                for inner in Fields(value) {
                    let (number, value) = inner?;
                    if let (Ok(batch_context::METADATA), Some(_)) = (u32::try_from(number), value) {
                        scan.metadata_entries += 1;
                    }
                }
            }
            // R33: results count as calls.
            (Ok(request::CALLS | request::RESULTS), Some(_)) => scan.calls += 1,
            _ => {}
        }
    }
    Ok(scan)
}

/// The codec of `PreToolService`: encodes answers of type `E` with prost,
/// reads requests as [`Inbound`].
#[derive(Debug, Clone)]
pub(super) struct InboundCodec<E> {
    limits: Limits,
    answer: PhantomData<fn() -> E>,
}

impl<E> InboundCodec<E> {
    pub(super) fn new(limits: Limits) -> Self {
        Self {
            limits,
            answer: PhantomData,
        }
    }
}

impl<E: Message + Send + 'static> Codec for InboundCodec<E> {
    type Encode = E;
    type Decode = Inbound;
    type Encoder = AnswerEncoder<E>;
    type Decoder = InboundDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        AnswerEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        InboundDecoder {
            limits: self.limits,
        }
    }
}

/// Encodes one answer.
#[derive(Debug)]
pub(super) struct AnswerEncoder<E>(PhantomData<fn() -> E>);

impl<E: Message> Encoder for AnswerEncoder<E> {
    type Item = E;
    type Error = Status;

    fn encode(&mut self, item: E, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("encoding an answer: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}

/// Reads one message as [`Inbound`].
#[derive(Debug)]
pub(super) struct InboundDecoder {
    limits: Limits,
}

impl Decoder for InboundDecoder {
    type Item = Inbound;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Inbound>, Status> {
        use prost::bytes::Buf;
        let bytes = src.copy_to_bytes(src.remaining());
        Ok(Some(Inbound::decode(&bytes, &self.limits)))
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{BatchContext, ToolCall};

    fn encoded(request: &EvaluateRequest) -> Vec<u8> {
        request.encode_to_vec()
    }

    #[test]
    fn r20_scan_counts_what_decode_would_build() {
        let request = EvaluateRequest {
            batch_id: "b1".into(),
            context: Some(BatchContext {
                session_id: "s".into(),
                metadata: [("a".to_owned(), "1".to_owned()), ("b".into(), "2".into())]
                    .into_iter()
                    .collect(),
                ..Default::default()
            }),
            calls: (0..3)
                .map(|i| ToolCall {
                    call_id: format!("c{i}"),
                    tool: "t".into(),
                    arguments: "{}".into(),
                })
                .collect(),
            timeout_ms: 7,
            traceparent: "x".into(),
            ..Default::default()
        };
        let bytes = encoded(&request);
        let scan = scan(&bytes).unwrap();
        assert_eq!(scan.batch_id, b"b1");
        assert_eq!(scan.calls, 3);
        assert_eq!(scan.metadata_entries, 2);
        match Inbound::decode(&bytes, &Limits::default()) {
            Inbound::Batch { request: got, size } => {
                assert_eq!(got, request);
                assert_eq!(size, bytes.len());
            }
            Inbound::Refused(r) => panic!("{r:?}"),
        }
    }

    #[test]
    fn r20_over_limit_batches_are_refused_without_being_built() {
        let limits = Limits::default();
        // 2 MiB of empty calls: `1a 00` repeated.
        let mut bytes = vec![0x0a, 0x02, b'b', b'1'];
        bytes.extend(std::iter::repeat_n([0x1a, 0x00], 1 << 20).flatten());
        let Inbound::Refused(r) = Inbound::decode(&bytes, &limits) else {
            panic!("refused")
        };
        assert_eq!(r.batch_id, "b1");
        assert_eq!(r.refusal.reason, "too_many_calls");
        assert_eq!(r.refusal.status.code(), tonic::Code::ResourceExhausted);
        // Metadata entries inside a context.
        let mut context = Vec::new();
        for _ in 0..2000 {
            context.extend([0x22, 0x00]);
        }
        let mut bytes = vec![0x12];
        prost::encoding::encode_varint(context.len() as u64, &mut bytes);
        bytes.extend(context);
        let Inbound::Refused(r) = Inbound::decode(&bytes, &limits) else {
            panic!("refused")
        };
        assert_eq!(r.refusal.reason, "too_many_metadata_entries");
        // An over-long id is cut and marked.
        let request = EvaluateRequest {
            batch_id: "x".repeat(100_000),
            ..Default::default()
        };
        let Inbound::Refused(r) = Inbound::decode(&encoded(&request), &limits) else {
            panic!("refused")
        };
        assert_eq!(r.refusal.status.code(), tonic::Code::InvalidArgument);
        assert!(r.batch_id.len() < 100 && r.batch_id.ends_with("[100000 bytes]"));
        // Bad wire data is refused in-band, not a transport error.
        for bad in [&[0x0a, 0x05, b'a'][..], &[0x0b], &[0x80]] {
            let Inbound::Refused(r) = Inbound::decode(bad, &limits) else {
                panic!("refused")
            };
            assert_eq!(r.refusal.reason, "malformed");
        }
    }
}
