//! Guards the tests script, served in process on loopback: SDK guards
//! ([`ScriptGuard`], [`HeldGuard`]) and raw `GuardService` servers that
//! misbehave on purpose, down to hand-written protobuf bytes (R23, R25).

use super::*;

/// What a scripted guard does with a batch.
#[derive(Clone, Default)]
pub(crate) struct Script {
    pub delay: Duration,
    pub verdicts: Vec<Verdict>,
    pub error: Option<Status>,
}

type Behaviour = dyn Fn(&GuardBatch) -> Script + Send + Sync;

/// A guard served by the Rust SDK whose answers a test scripts, and which
/// records what it received and what was cancelled.
pub(crate) struct ScriptGuard {
    behaviour: Box<Behaviour>,
    pub received: Mutex<Vec<GuardBatch>>,
    pub cancelled: AtomicUsize,
    pub answered: AtomicUsize,
}

impl ScriptGuard {
    pub(crate) fn batches(&self) -> Vec<GuardBatch> {
        self.received.lock().unwrap().clone()
    }

    pub(crate) fn requests(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    pub(crate) fn cancelled(&self) -> usize {
        self.cancelled.load(Ordering::SeqCst)
    }
}

struct CountOnDrop<'a> {
    counter: &'a AtomicUsize,
    armed: bool,
}

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.counter.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Guard for ScriptGuard {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        self.received.lock().unwrap().push(batch.clone());
        let script = (self.behaviour)(batch);
        // Counts the batch as cancelled if the mesh aborts this future.
        let mut on_cancel = CountOnDrop {
            counter: &self.cancelled,
            armed: true,
        };
        if !script.delay.is_zero() {
            tokio::time::sleep(script.delay).await;
        }
        on_cancel.armed = false;
        self.answered.fetch_add(1, Ordering::SeqCst);
        match script.error {
            Some(status) => Err(status),
            None => Ok(script.verdicts),
        }
    }
}

/// A running guard process-in-a-task.
pub(crate) struct TestGuard {
    pub url: String,
    pub guard: Arc<ScriptGuard>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Drop for TestGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// Serves a scripted guard on a fresh loopback port.
pub(crate) async fn script_guard(
    behaviour: impl Fn(&GuardBatch) -> Script + Send + Sync + 'static,
) -> TestGuard {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    serve_script_guard(listener, behaviour).await
}

pub(crate) async fn serve_script_guard(
    listener: TcpListener,
    behaviour: impl Fn(&GuardBatch) -> Script + Send + Sync + 'static,
) -> TestGuard {
    let url = format!("http://{}", listener.local_addr().unwrap());
    let guard = Arc::new(ScriptGuard {
        behaviour: Box::new(behaviour),
        received: Mutex::default(),
        cancelled: AtomicUsize::new(0),
        answered: AtomicUsize::new(0),
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn({
        let guard = guard.clone();
        async move {
            let _ = guardmesh_client::GuardServer::from_arc(guard)
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await;
        }
    });
    TestGuard {
        url,
        guard,
        stop: Some(stop),
        task,
    }
}

/// A guard that proceeds on everything.
pub(crate) async fn proceed_guard() -> TestGuard {
    script_guard(|_| Script::default()).await
}

/// A guard that proceeds on everything after `delay`.
pub(crate) async fn slow_guard(delay: Duration) -> TestGuard {
    script_guard(move |_| Script {
        delay,
        ..Default::default()
    })
    .await
}

/// A guard that applies `f` to each call: `Some(verdict)` or proceed.
pub(crate) async fn call_guard(
    delay: Duration,
    f: impl Fn(&guardmesh_client::proto::ToolCall) -> Option<Verdict> + Send + Sync + 'static,
) -> TestGuard {
    script_guard(move |batch| Script {
        delay,
        verdicts: batch.calls.iter().filter_map(&f).collect(),
        error: None,
    })
    .await
}

/// How a raw (non-SDK) guard misbehaves on its Judge stream.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Misbehaviour {
    /// Ends the stream with OK without answering anything.
    CloseOk,
    /// Ends the stream with an INTERNAL error.
    CloseError,
    /// Answers with partial verdicts for the first call of each batch
    /// (partial = true), then ends the stream.
    PartialThenClose,
}

pub(crate) struct RawGuard {
    mode: Misbehaviour,
    pub streams: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl GuardService for RawGuard {
    type JudgeStream = tokio_stream::wrappers::ReceiverStream<Result<JudgeResponse, Status>>;

    async fn judge(
        &self,
        request: tonic::Request<tonic::Streaming<JudgeRequest>>,
    ) -> Result<tonic::Response<Self::JudgeStream>, Status> {
        self.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mode = self.mode;
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else {
                return;
            };
            match mode {
                Misbehaviour::CloseOk => {}
                Misbehaviour::CloseError => {
                    let _ = tx.send(Err(Status::internal("guard exploded"))).await;
                }
                Misbehaviour::PartialThenClose => {
                    if let Some(guardmesh_client::proto::judge_request::Kind::Batch(batch)) =
                        first.kind
                    {
                        let verdicts = batch
                            .calls
                            .first()
                            .map(|c| guardmesh_client::verdict::steer(&c.call_id, "partial skip"))
                            .into_iter()
                            .collect();
                        let _ = tx
                            .send(Ok(JudgeResponse {
                                request_id: batch.request_id,
                                verdicts,
                                partial: true,
                                error: String::new(),
                            }))
                            .await;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// Serves a hand-written `GuardService` on a loopback port of its own: its
/// URL, and the task serving it.
pub(crate) async fn serve_guard_service<S: GuardService>(
    service: GuardServiceServer<S>,
) -> (String, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    (url, task)
}

/// Serves a misbehaving raw guard.
pub(crate) async fn raw_guard(mode: Misbehaviour) -> (String, Arc<AtomicUsize>, JoinHandle<()>) {
    let streams = Arc::new(AtomicUsize::new(0));
    let service = RawGuard {
        mode,
        streams: streams.clone(),
    };
    let (url, task) = serve_guard_service(GuardServiceServer::new(service)).await;
    (url, streams, task)
}

/// A loopback URL where nothing listens.
pub(crate) async fn closed_port() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// `{"sql": ...}` arguments.
pub(crate) fn sql(text: &str) -> String {
    serde_json::json!({ "sql": text }).to_string()
}

// ---------------------------------------------------------------------------
// Fault-injection helpers (issue 6): a raw guard whose every message is
// scripted, including answers for requests that do not exist and answers
// after a cancel, and an SDK guard that holds batches until released.
// ---------------------------------------------------------------------------

/// One message a [`RawScriptGuard`] sends for a batch: `response` exactly as
/// given (its `request_id` included, so a test can answer requests that do
/// not exist), `after` the previous message of the same batch was sent.
#[derive(Clone, Debug)]
pub(crate) struct RawSend {
    pub after: Duration,
    pub response: JudgeResponse,
}

impl RawSend {
    pub(crate) fn now(response: JudgeResponse) -> Self {
        Self {
            after: Duration::ZERO,
            response,
        }
    }
}

/// A final answer to `batch` with `verdicts`.
pub(crate) fn final_answer(batch: &GuardBatch, verdicts: Vec<Verdict>) -> JudgeResponse {
    JudgeResponse {
        request_id: batch.request_id,
        verdicts,
        partial: false,
        error: String::new(),
    }
}

type RawBehaviour = dyn Fn(&GuardBatch) -> Vec<RawSend> + Send + Sync;

/// A guard on the raw `GuardService` whose messages a test scripts per batch.
/// Unlike the SDK it ignores cancels (it records them) and keeps sending what
/// the script says: late answers, answers for unknown request ids, verdicts
/// with unknown enum values.
pub(crate) struct RawScriptGuard {
    behaviour: Arc<RawBehaviour>,
    pub received: Arc<Mutex<Vec<GuardBatch>>>,
    pub cancels: Arc<Mutex<Vec<u64>>>,
    /// Messages actually written to the stream.
    pub sent: Arc<AtomicUsize>,
    pub streams: Arc<AtomicUsize>,
}

impl RawScriptGuard {
    pub(crate) fn cancels(&self) -> Vec<u64> {
        self.cancels.lock().unwrap().clone()
    }
}

#[derive(Clone)]
struct RawScriptService(Arc<RawScriptGuard>);

#[tonic::async_trait]
impl GuardService for RawScriptService {
    type JudgeStream = tokio_stream::wrappers::ReceiverStream<Result<JudgeResponse, Status>>;

    async fn judge(
        &self,
        request: tonic::Request<tonic::Streaming<JudgeRequest>>,
    ) -> Result<tonic::Response<Self::JudgeStream>, Status> {
        use guardmesh_client::proto::judge_request::Kind;
        let guard = self.0.clone();
        guard.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                match message.kind {
                    Some(Kind::Batch(batch)) => {
                        guard.received.lock().unwrap().push(batch.clone());
                        let sends = (guard.behaviour)(&batch);
                        let tx = tx.clone();
                        let sent = guard.sent.clone();
                        tokio::spawn(async move {
                            for send in sends {
                                if !send.after.is_zero() {
                                    tokio::time::sleep(send.after).await;
                                }
                                if tx.send(Ok(send.response)).await.is_err() {
                                    return;
                                }
                                sent.fetch_add(1, Ordering::SeqCst);
                            }
                        });
                    }
                    Some(Kind::Cancel(cancel)) => {
                        guard.cancels.lock().unwrap().push(cancel.request_id);
                    }
                    None => {}
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// A running [`RawScriptGuard`].
pub(crate) struct RawScriptHandle {
    pub url: String,
    pub guard: Arc<RawScriptGuard>,
    task: JoinHandle<()>,
}

impl Drop for RawScriptHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves a raw scripted guard on a fresh loopback port.
pub(crate) async fn raw_script_guard(
    behaviour: impl Fn(&GuardBatch) -> Vec<RawSend> + Send + Sync + 'static,
) -> RawScriptHandle {
    let guard = Arc::new(RawScriptGuard {
        behaviour: Arc::new(behaviour),
        received: Arc::default(),
        cancels: Arc::default(),
        sent: Arc::default(),
        streams: Arc::default(),
    });
    let service = RawScriptService(guard.clone());
    let (url, task) = serve_guard_service(GuardServiceServer::new(service)).await;
    RawScriptHandle { url, guard, task }
}

/// An SDK guard that holds every batch until [`HeldGuard::release`], then
/// proceeds on it. Records each batch it receives.
pub(crate) struct HeldGuard {
    release: tokio::sync::watch::Sender<bool>,
    pub received: Mutex<Vec<GuardBatch>>,
    pub answered: AtomicUsize,
}

impl HeldGuard {
    pub(crate) fn release(&self) {
        self.release.send_replace(true);
    }

    pub(crate) fn requests(&self) -> usize {
        self.received.lock().unwrap().len()
    }
}

impl Guard for HeldGuard {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        self.received.lock().unwrap().push(batch.clone());
        let mut released = self.release.subscribe();
        let _ = released.wait_for(|r| *r).await;
        self.answered.fetch_add(1, Ordering::SeqCst);
        Ok(Vec::new())
    }
}

/// A running [`HeldGuard`].
pub(crate) struct HeldHandle {
    pub url: String,
    pub guard: Arc<HeldGuard>,
    task: JoinHandle<()>,
}

impl Drop for HeldHandle {
    fn drop(&mut self) {
        self.guard.release();
        self.task.abort();
    }
}

/// Serves a [`HeldGuard`] on a fresh loopback port.
pub(crate) async fn held_guard() -> HeldHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let guard = Arc::new(HeldGuard {
        release: tokio::sync::watch::channel(false).0,
        received: Mutex::default(),
        answered: AtomicUsize::new(0),
    });
    let task = tokio::spawn({
        let guard = guard.clone();
        async move {
            let _ = guardmesh_client::GuardServer::from_arc(guard)
                .serve(listener, std::future::pending())
                .await;
        }
    });
    HeldHandle { url, guard, task }
}

/// A script guard served over TLS with `cert_pem` and `key_pem` (asking
/// clients for a certificate of `client_ca_pem` when given), steering every
/// call with "checked over TLS": its `https://HOST:PORT` URL and state.
pub(crate) async fn tls_steering_guard(
    host: &str,
    cert_pem: String,
    key_pem: String,
    client_ca_pem: Option<String>,
) -> (String, Arc<ScriptGuard>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{host}:{}", listener.local_addr().unwrap().port());
    let guard = Arc::new(script_guard_state(|batch| Script {
        verdicts: batch
            .calls
            .iter()
            .map(|c| guardmesh_client::verdict::steer(&c.call_id, "checked over TLS"))
            .collect(),
        ..Default::default()
    }));
    tokio::spawn(
        guardmesh_client::GuardServer::from_arc(guard.clone()).serve_with(
            listener,
            Some(guardmesh_client::ServerTls {
                cert_pem,
                key_pem,
                client_ca_pem,
            }),
            std::future::pending(),
        ),
    );
    (url, guard)
}

/// A scripted guard's state without a server (to serve it yourself).
pub(crate) fn script_guard_state(
    behaviour: impl Fn(&GuardBatch) -> Script + Send + Sync + 'static,
) -> ScriptGuard {
    ScriptGuard {
        behaviour: Box::new(behaviour),
        received: Mutex::default(),
        cancelled: AtomicUsize::new(0),
        answered: AtomicUsize::new(0),
    }
}

// ---------------------------------------------------------------------------
// Raw-bytes guards (R23, R25): a `GuardService` whose answers are bytes a test
// writes by hand (fields a newer protocol might send), and one that accepts
// its Judge stream and never reads it.
// ---------------------------------------------------------------------------

/// What a [`raw_bytes_guard`] answers a batch with: each entry is the
/// protobuf encoding of one `JudgeResponse`, sent as it is.
type BytesBehaviour = dyn Fn(&GuardBatch) -> Vec<Vec<u8>> + Send + Sync;

/// The codec of the raw-bytes guard: requests decoded by prost, answers
/// written as the test gave them.
#[derive(Clone, Copy, Default)]
struct RawBytesCodec;

impl tonic::codec::Codec for RawBytesCodec {
    type Encode = Vec<u8>;
    type Decode = JudgeRequest;
    type Encoder = RawBytesCodec;
    type Decoder = RawBytesCodec;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl tonic::codec::Encoder for RawBytesCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawBytesCodec {
    type Item = JudgeRequest;
    type Error = Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<JudgeRequest>, Status> {
        use prost::Message;
        JudgeRequest::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

/// The `Judge` method of the raw-bytes guard.
struct RawBytesJudge {
    behaviour: Arc<BytesBehaviour>,
    streams: Arc<AtomicUsize>,
    /// Never read the stream: hold it open until the connection ends.
    never_read: bool,
}

type BoxStream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = T> + Send>>;

impl tonic::server::StreamingService<JudgeRequest> for RawBytesJudge {
    type Response = Vec<u8>;
    type ResponseStream = BoxStream<Result<Vec<u8>, Status>>;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<tonic::Response<Self::ResponseStream>, Status>>
                + Send,
        >,
    >;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<JudgeRequest>>) -> Self::Future {
        use guardmesh_client::proto::judge_request::Kind;
        self.streams.fetch_add(1, Ordering::SeqCst);
        let behaviour = self.behaviour.clone();
        let never_read = self.never_read;
        Box::pin(async move {
            let mut inbound = request.into_inner();
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, Status>>(256);
            tokio::spawn(async move {
                if never_read {
                    // Keep the stream (and so its flow-control window) open
                    // without ever polling it, until the mesh goes away.
                    tx.closed().await;
                    drop(inbound);
                    return;
                }
                while let Ok(Some(message)) = inbound.message().await {
                    if let Some(Kind::Batch(batch)) = message.kind {
                        for answer in behaviour(&batch) {
                            if tx.send(Ok(answer)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
            let stream: Self::ResponseStream =
                Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
            Ok(tonic::Response::new(stream))
        })
    }
}

/// A hand-written `GuardService` server around [`RawBytesJudge`].
#[derive(Clone)]
struct RawBytesServer {
    behaviour: Arc<BytesBehaviour>,
    streams: Arc<AtomicUsize>,
    never_read: bool,
}

impl tonic::server::NamedService for RawBytesServer {
    const NAME: &'static str = "guardmesh.v1.GuardService";
}

impl tower::Service<http::Request<tonic::body::Body>> for RawBytesServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let judge = RawBytesJudge {
            behaviour: self.behaviour.clone(),
            streams: self.streams.clone(),
            never_read: self.never_read,
        };
        Box::pin(async move {
            if request.uri().path() != "/guardmesh.v1.GuardService/Judge" {
                return Ok(Status::unimplemented("only Judge").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(RawBytesCodec);
            Ok(grpc.streaming(judge, request).await)
        })
    }
}

/// A running raw-bytes guard.
pub(crate) struct RawBytesHandle {
    pub url: String,
    /// Judge streams opened to it.
    pub streams: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for RawBytesHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_raw_bytes(server: RawBytesServer) -> RawBytesHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let streams = server.streams.clone();
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    RawBytesHandle { url, streams, task }
}

/// Serves a guard that answers each batch with the hand-encoded
/// `JudgeResponse`s `behaviour` returns, byte for byte.
pub(crate) async fn raw_bytes_guard(
    behaviour: impl Fn(&GuardBatch) -> Vec<Vec<u8>> + Send + Sync + 'static,
) -> RawBytesHandle {
    serve_raw_bytes(RawBytesServer {
        behaviour: Arc::new(behaviour),
        streams: Arc::default(),
        never_read: false,
    })
    .await
}

/// Serves a guard that accepts its Judge stream and never reads from it.
pub(crate) async fn never_reading_guard() -> RawBytesHandle {
    serve_raw_bytes(RawBytesServer {
        behaviour: Arc::new(|_| Vec::new()),
        streams: Arc::default(),
        never_read: true,
    })
    .await
}

/// Protobuf encoding helpers for hand-made answers.
pub(crate) mod raw_pb {
    use prost::encoding::{WireType, encode_key, encode_varint};

    /// Appends field `number` as a length-delimited value.
    pub(crate) fn bytes_field(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
        encode_key(number, WireType::LengthDelimited, out);
        encode_varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    /// Appends field `number` as a varint.
    pub(crate) fn varint_field(out: &mut Vec<u8>, number: u32, value: u64) {
        encode_key(number, WireType::Varint, out);
        encode_varint(value, out);
    }

    /// A `JudgeResponse` (final) for `request_id` whose `verdicts` are the
    /// given encoded `Verdict`s, followed by `extra` bytes of top-level
    /// fields.
    pub(crate) fn judge_response(request_id: u64, verdicts: &[Vec<u8>], extra: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        varint_field(&mut out, 1, request_id);
        for verdict in verdicts {
            bytes_field(&mut out, 2, verdict);
        }
        out.extend_from_slice(extra);
        out
    }

    /// A `Verdict` with `call_id` and then `extra` bytes (its outcome,
    /// known or not).
    pub(crate) fn verdict(call_id: &str, extra: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        bytes_field(&mut out, 1, call_id.as_bytes());
        out.extend_from_slice(extra);
        out
    }

    /// A `Skip` outcome (field 2 of `Verdict`) with `content`, kind steer,
    /// followed by `extra` bytes inside the skip.
    pub(crate) fn skip_outcome(content: &str, extra: &[u8]) -> Vec<u8> {
        let mut skip = Vec::new();
        bytes_field(&mut skip, 1, content.as_bytes());
        skip.extend_from_slice(extra);
        let mut out = Vec::new();
        bytes_field(&mut out, 2, &skip);
        out
    }
}
