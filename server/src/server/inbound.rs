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

/// `EvaluateRequest` field numbers.
const BATCH_ID: u64 = 1;
const CONTEXT: u64 = 2;
const CALLS: u64 = 3;
/// `EvaluateRequest.results` (R33): counted as calls.
const RESULTS: u64 = 7;
/// `BatchContext.metadata`.
const METADATA: u64 = 4;

fn scan(bytes: &[u8]) -> Result<Scan<'_>, &'static str> {
    let mut scan = Scan::default();
    for field in Fields(bytes) {
        let (number, value) = field?;
        match (number, value) {
            (BATCH_ID, Some(value)) => scan.batch_id = value,
            (CONTEXT, Some(value)) => {
                for inner in Fields(value) {
                    if let (METADATA, Some(_)) = inner? {
                        scan.metadata_entries += 1;
                    }
                }
            }
            (CALLS | RESULTS, Some(_)) => scan.calls += 1,
            _ => {}
        }
    }
    Ok(scan)
}

/// The fields of a protobuf message: (number, contents of a
/// length-delimited field), without decoding them.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Option<&'a [u8]>), &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let item = self.field();
        if item.is_err() {
            self.0 = &[];
        }
        Some(item)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u64, Option<&'a [u8]>), &'static str> {
        let key = self.varint()?;
        let number = key >> 3;
        if number == 0 {
            return Err("field number 0");
        }
        let value = match key & 7 {
            0 => {
                self.varint()?;
                None
            }
            1 => {
                self.skip(8)?;
                None
            }
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|_| "length overflow")?;
                Some(self.skip(len)?)
            }
            5 => {
                self.skip(4)?;
                None
            }
            _ => return Err("unsupported wire type"),
        };
        Ok((number, value))
    }

    fn varint(&mut self) -> Result<u64, &'static str> {
        let mut value = 0u64;
        for (i, byte) in self.0.iter().enumerate().take(10) {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return Ok(value);
            }
        }
        Err("invalid varint")
    }

    fn skip(&mut self, len: usize) -> Result<&'a [u8], &'static str> {
        if len > self.0.len() {
            return Err("field runs past the end of the message");
        }
        let (value, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(value)
    }
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
