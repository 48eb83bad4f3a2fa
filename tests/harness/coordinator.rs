//! A coordinator that speaks raw protobuf bytes to `PreToolService`, for the
//! attack tests: messages sent exactly as given, answers read as bytes.

use super::*;

// ---------------------------------------------------------------------------
// Raw protobuf bytes on `PreToolService` (attack tests): messages sent
// exactly as given, answers read (or not) as bytes.
// ---------------------------------------------------------------------------

/// A codec that sends and receives messages as raw bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawCodec;

#[derive(Debug)]
pub(crate) struct RawClientBytes;

impl tonic::codec::Encoder for RawClientBytes {
    type Item = prost::bytes::Bytes;
    type Error = Status;
    fn encode(
        &mut self,
        item: Self::Item,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawClientBytes {
    type Item = prost::bytes::Bytes;
    type Error = Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Self::Item>, Status> {
        use prost::bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = prost::bytes::Bytes;
    type Decode = prost::bytes::Bytes;
    type Encoder = RawClientBytes;
    type Decoder = RawClientBytes;
    fn encoder(&mut self) -> Self::Encoder {
        RawClientBytes
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawClientBytes
    }
}

/// A gRPC channel of its own to `url`.
pub(crate) async fn channel(url: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A gRPC client on its own connection that speaks raw bytes.
pub(crate) async fn raw_client(url: &str) -> tonic::client::Grpc<tonic::transport::Channel> {
    tonic::client::Grpc::new(channel(url).await).max_decoding_message_size(64 << 20)
}

/// Opens `Evaluate` sending `requests` as raw messages; the answers are
/// returned unread.
pub(crate) async fn raw_evaluate(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    requests: impl futures::Stream<Item = prost::bytes::Bytes> + Send + 'static,
) -> Result<tonic::Streaming<prost::bytes::Bytes>, Status> {
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static("/guardmesh.v1.PreToolService/Evaluate");
    client
        .streaming(tonic::Request::new(requests), path, RawCodec)
        .await
        .map(|r| r.into_inner())
}

/// `EvaluateBatch` with a raw message.
pub(crate) async fn raw_evaluate_batch(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    request: prost::bytes::Bytes,
) -> Result<guardmesh_client::proto::BatchDecision, Status> {
    use prost::Message;
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static("/guardmesh.v1.PreToolService/EvaluateBatch");
    let answer = client
        .unary(tonic::Request::new(request), path, RawCodec)
        .await?
        .into_inner();
    guardmesh_client::proto::BatchDecision::decode(answer)
        .map_err(|e| Status::internal(e.to_string()))
}

/// Reads one raw answer of an `Evaluate` stream.
pub(crate) async fn next_answer(
    answers: &mut tonic::Streaming<prost::bytes::Bytes>,
) -> Result<Option<guardmesh_client::proto::EvaluateResponse>, Status> {
    use prost::Message;
    match answers.message().await? {
        Some(bytes) => guardmesh_client::proto::EvaluateResponse::decode(bytes)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string())),
        None => Ok(None),
    }
}

/// An `EvaluateRequest` with id `batch_id` and `calls` given as
/// `(call_id, tool, arguments)`.
pub(crate) fn evaluate_request(
    batch_id: &str,
    calls: &[(&str, &str, &str)],
) -> guardmesh_client::proto::EvaluateRequest {
    guardmesh_client::proto::EvaluateRequest {
        batch_id: batch_id.into(),
        calls: calls
            .iter()
            .map(
                |(call_id, tool, arguments)| guardmesh_client::proto::ToolCall {
                    call_id: (*call_id).into(),
                    tool: (*tool).into(),
                    arguments: (*arguments).into(),
                },
            )
            .collect(),
        ..Default::default()
    }
}

/// A steer with `content`.
pub(crate) fn steered(content: &str) -> guardmesh_client::Outcome {
    guardmesh_client::Outcome::Steer {
        content: content.into(),
    }
}

/// A cancel with `content`.
pub(crate) fn cancelled(content: &str) -> guardmesh_client::Outcome {
    guardmesh_client::Outcome::Cancel {
        content: content.into(),
    }
}

/// A well-formed batch's bytes.
pub(crate) fn batch_bytes(
    request: &guardmesh_client::proto::EvaluateRequest,
) -> prost::bytes::Bytes {
    use prost::Message;
    request.encode_to_vec().into()
}

/// A fresh connection to the MCP gateway at `url` on which the request of
/// [`mcp_post`] has been written, for the caller to read the answer.
pub(crate) async fn mcp_post_sent(
    url: &str,
    version: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let authority = url.trim_start_matches("http://").split('/').next().unwrap();
    let mut stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: {version}\r\n\
         {extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// The value of header `name` (any case) in an HTTP/1 head.
pub(crate) fn header_value(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim()
            .eq_ignore_ascii_case(name)
            .then(|| value.trim().to_owned())
    })
}

/// One HTTP/1.1 `POST /mcp` on a fresh connection to the MCP gateway at
/// `url`, with the MCP headers of protocol `version` and `headers` (name,
/// value) besides: (status, head, body).
pub(crate) async fn mcp_post(
    url: &str,
    version: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    use tokio::io::AsyncReadExt;
    let mut stream = mcp_post_sent(url, version, headers, body).await;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_owned(), body.to_owned())
}
