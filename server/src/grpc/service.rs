//! The gRPC services of the mesh: `PreToolService` for coordinators and
//! `GuardRegistry` for registrars.
//!
//! A batch's way, from the `Evaluate` handler to its answer: the batch is
//! read and its size and counts checked on the wire (`inbound.rs`); a
//! [`BatchLog`] (`mesh/record.rs`) is made for it; the admission stage
//! (`admit/`) admits it to its stream and the mesh's in-flight bytes;
//! [`Mesh::pass`] runs the admission stage's mesh checks and judging
//! (`mesh/evaluate.rs`, `judge/`); the outcome goes to the record, which
//! emits metrics, logs, spans and the decision record; the answer is
//! queued. Nothing below calls back up here.

use crate::admit::{self, StreamGate};
use crate::decision_log::from_mesh::{self, RegistryChange};
use crate::decision_log::{ChangeKind, MeshLog};
use crate::grpc::answer_body::{AnswerBody, Counted};
use crate::grpc::inbound::InboundCodec;
use crate::judge::TraceContext;
use crate::mesh::Mesh;
use crate::mesh::pipeline::{Admitted, Arrival, Door, Inbound, Refusing};
use crate::mesh::record::LogCaller;
use crate::registry::{Admission, AdmitError, Owner, RegistryError};
use crate::security::auth::{Caller, Role};
use futures::{Stream, StreamExt};
use guardmesh_proto::v1::guard_registry_server::GuardRegistry;
use guardmesh_proto::v1::pre_tool_service_server::PreToolService;
use guardmesh_proto::v1::{
    AlwaysSkippedRequest, AlwaysSkippedResponse, BatchDecision, DeregisterRequest,
    DeregisterResponse, EvaluateRequest, EvaluateResponse, ListRequest, ListResponse,
    RegisterRequest, RegisterResponse, evaluate_response,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc::OwnedPermit;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

/// Reads W3C trace context from request metadata (R22).
pub(crate) fn trace_context(metadata: &MetadataMap) -> TraceContext {
    let get = |key: &str| {
        metadata
            .get(key)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    };
    TraceContext::from_w3c(get("traceparent"), get("tracestate"))
}

/// R20: whether `request`'s caller may send batch ids in the prefix the
/// mesh reserves for its replays: a caller with the admin role (an
/// operator running `guardmesh replay --mesh`), or any caller of a mesh
/// without principals, where every caller may do everything.
pub(crate) fn may_replay<T>(request: &Request<T>) -> bool {
    request
        .extensions()
        .get::<Caller>()
        .is_none_or(|caller| caller.has(Role::Admin))
}

/// The key of the connection `request` came on, by which guard links share
/// their queues between clients (R25): its peer address (ip and port) when
/// known, else 0.
fn client_key<T>(request: &Request<T>) -> u64 {
    use std::hash::{Hash, Hasher};
    let peer = request
        .extensions()
        .get::<crate::security::tls::PeerInfo>()
        .and_then(|p| p.remote)
        .or_else(|| request.remote_addr());
    peer.map_or(0, |peer| {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        peer.hash(&mut hasher);
        hasher.finish()
    })
}

/// The authenticated caller's identity, if any (R33: handed on with each
/// result decision).
fn caller_id<T>(request: &Request<T>) -> Option<Arc<str>> {
    request
        .extensions()
        .get::<Caller>()
        .map(|caller| Arc::from(caller.id.as_str()))
}

/// The caller's identity as the auth layer established it (empty without
/// principals): session memory is keyed by it (R34).
fn caller_identity<T>(request: &Request<T>) -> Arc<str> {
    request
        .extensions()
        .get::<Caller>()
        .map_or_else(|| Arc::from(""), |caller| Arc::from(caller.id.as_str()))
}

/// The caller of a request for the decision log; `None` (and nothing
/// read) when no log is attached.
pub(crate) fn log_caller<T>(mesh: &Mesh, request: &Request<T>) -> Option<LogCaller> {
    mesh.decision_log()?;
    let peer = request
        .extensions()
        .get::<crate::security::tls::PeerInfo>()
        .and_then(|p| p.remote)
        .or_else(|| request.remote_addr());
    Some(Arc::new(crate::mesh::record::caller(
        request.extensions().get::<Caller>(),
        peer,
    )))
}

/// The trace context a request's door hands its batches (R22): the W3C
/// context of its metadata, the key of its connection (R25), and the
/// authenticated caller (R33, R34).
pub(crate) fn door_trace<T>(request: &Request<T>) -> TraceContext {
    let mut trace = trace_context(request.metadata());
    trace.client = client_key(request);
    trace.caller = caller_id(request);
    trace.identity = caller_identity(request);
    trace
}

/// What every door reads of a request before its batches, the same at
/// each: the trace context with the connection's key and the caller (R22,
/// R25, R33, R34), the caller for the decision log (R29), whether it may
/// send batch ids in the replay prefix (R20), and the transport's deadline
/// (R14).
#[derive(Debug)]
pub(crate) struct RequestDoor {
    trace: TraceContext,
    caller: Option<LogCaller>,
    may_replay: bool,
    /// `grpc-timeout`, when the request has one; a stream's batches carry
    /// their own deadlines.
    transport: Option<Duration>,
}

impl RequestDoor {
    pub(crate) fn read<T>(mesh: &Mesh, request: &Request<T>) -> Self {
        Self {
            trace: door_trace(request),
            caller: log_caller(mesh, request),
            may_replay: may_replay(request),
            transport: grpc_timeout(request.metadata()),
        }
    }

    /// The door of a unary call's one batch.
    pub(crate) fn unary(&self) -> Door<'_> {
        let mut door = Door::unary(&self.trace, self.caller.as_ref());
        door.transport = self.transport;
        door.may_replay = self.may_replay;
        door
    }
}

/// Parses a `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
pub(crate) fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// `PreToolService`.
#[derive(Debug, Clone)]
pub(crate) struct PreTool {
    mesh: Arc<Mesh>,
    draining: watch::Receiver<bool>,
    /// One permit per open coordinator stream (`limits.max_coordinator_streams`).
    streams: Arc<Semaphore>,
}

impl PreTool {
    /// `draining` turns true when the server shuts down: open streams stop
    /// judging new batches (each one read is answered UNAVAILABLE), finish
    /// the ones in flight, and end cleanly (R25).
    pub(crate) fn new(mesh: Arc<Mesh>, draining: watch::Receiver<bool>) -> Self {
        let streams = Arc::new(Semaphore::new(
            mesh.config
                .limits
                .max_coordinator_streams
                .clamp(1, Semaphore::MAX_PERMITS),
        ));
        Self {
            mesh,
            draining,
            streams,
        }
    }

    /// Opens a coordinator stream reading `inbound` (R19, R25).
    pub(crate) fn open_stream<S>(
        &self,
        door: RequestDoor,
        inbound: S,
    ) -> Result<AnswerStream, Status>
    where
        S: Stream<Item = Result<Inbound, Status>> + Send + Unpin + 'static,
    {
        let permit = admit::stream(&self.streams, &self.mesh.config.limits)
            .map_err(|refusal| crate::mesh::record::stream_refused(&self.mesh.metrics, &refusal))?;
        let limits = &self.mesh.config.limits;
        // Every batch read reserves the slot of its answer, so that a
        // finished batch never waits to be answered; refusals need a few.
        let (tx, rx) = mpsc::channel(limits.max_batches_per_stream.saturating_add(16));
        let budget = Arc::new(StreamBudget {
            held: AtomicUsize::new(0),
            limit: limits.max_stream_bytes,
            released: Notify::new(),
        });
        let stream = StreamLoop {
            tool: self.clone(),
            trace: door.trace,
            caller: door.caller,
            may_replay: door.may_replay,
            tx,
            budget: budget.clone(),
            tasks: JoinSet::new(),
            gate: StreamGate::new(limits.max_batches_per_stream),
        };
        tokio::spawn(stream.run(inbound, permit));
        Ok(AnswerStream { rx, budget })
    }

    /// Judges one batch sent from this process (a gateway embedding the
    /// mesh): the unary call's door without the transport. The batch is
    /// checked against the same limits a decoded message is (R20),
    /// recorded (R29) and answered as a unary `EvaluateBatch` from an
    /// unauthenticated caller would be; `caller` names it in the decision
    /// log.
    pub(crate) async fn local(
        &self,
        request: EvaluateRequest,
        caller: &LogCaller,
    ) -> Result<BatchDecision, Status> {
        let inbound = Inbound::from_request(request, &self.mesh.config.limits);
        let door = RequestDoor {
            trace: trace_context(&MetadataMap::new()),
            caller: self.mesh.decision_log().map(|_| caller.clone()),
            may_replay: true,
            transport: None,
        };
        self.unary(door.unary(), inbound).await
    }

    /// Judges the one batch of a unary call through the pipeline.
    async fn unary(&self, door: Door<'_>, inbound: Inbound) -> Result<BatchDecision, Status> {
        match self.mesh.arrive(inbound, door) {
            Arrival::Admitted(admitted) => admitted.run(&self.mesh).await,
            Arrival::Refused(refused) => Err(refused.status().await),
        }
    }
}

/// What one coordinator stream holds, in bytes: its batches being judged
/// and its answers not yet taken by the transport (`limits.max_stream_bytes`).
#[derive(Debug)]
struct StreamBudget {
    held: AtomicUsize,
    limit: usize,
    /// Signalled when answers are taken.
    released: Notify,
}

impl StreamBudget {
    fn has_room(&self) -> bool {
        self.held.load(Ordering::Acquire) < self.limit
    }

    fn add(&self, bytes: usize) {
        self.held.fetch_add(bytes, Ordering::AcqRel);
    }

    fn release(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.released.notify_one();
    }
}

/// An answer queued on a stream, with the bytes it holds.
#[derive(Debug)]
struct Answer {
    /// Boxed: the stream's channel allocates 32 slots when the stream
    /// opens, and an unboxed answer (with room for a `Status`) made each
    /// idle stream hold about 7 KiB of them.
    response: Box<Result<EvaluateResponse, Status>>,
    /// Its encoded length: the bytes it holds of the stream's budget.
    counted: Counted,
}

impl Answer {
    fn new(response: EvaluateResponse) -> Self {
        Self {
            counted: Counted::of(&response),
            response: Box::new(Ok(response)),
        }
    }
}

/// The answers of a coordinator stream, as the transport takes them; each
/// one taken frees its bytes of the stream's budget.
#[derive(Debug)]
pub(crate) struct AnswerStream {
    rx: mpsc::Receiver<Answer>,
    budget: Arc<StreamBudget>,
}

impl AnswerStream {
    /// The next answer with its encoded length (counted once, when it was
    /// queued; 0 for an error), its bytes freed of the stream's budget.
    pub(crate) fn poll_answer(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(Result<EvaluateResponse, Status>, Counted)>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(answer)) => {
                self.budget.release(answer.counted.len);
                Poll::Ready(Some((*answer.response, answer.counted)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Stream for AnswerStream {
    type Item = Result<EvaluateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_answer(cx)
            .map(|answer| answer.map(|(response, _)| response))
    }
}

/// The reading side of one coordinator stream.
struct StreamLoop {
    tool: PreTool,
    trace: TraceContext,
    /// The stream's caller for the decision log; `None` without a log.
    caller: Option<LogCaller>,
    /// Whether its caller may send batch ids in the replay prefix (R20).
    may_replay: bool,
    tx: mpsc::Sender<Answer>,
    budget: Arc<StreamBudget>,
    tasks: JoinSet<()>,
    /// Batch ids in flight on this stream (R19: unique), and batches with
    /// calls being judged (`limits.max_batches_per_stream`).
    gate: Arc<StreamGate>,
}

/// What the stream loop does next. Short-lived, on the stack: not boxed.
#[allow(clippy::large_enum_variant)]
enum Step {
    Read(Option<Result<Inbound, Status>>, OwnedPermit<Answer>),
    Again,
    Gone,
}

impl StreamLoop {
    async fn run<S>(mut self, mut inbound: S, _stream: OwnedSemaphorePermit)
    where
        S: Stream<Item = Result<Inbound, Status>> + Send + Unpin + 'static,
    {
        let mut draining = self.tool.draining.clone();
        let mut is_draining = *draining.borrow();
        let mut stream_error = None;
        loop {
            // Finished batches are reaped here, not by waking the loop for
            // each one (that cost a pass through `next` per batch); while
            // draining, `next` wakes for them to see the stream emptied.
            while self.tasks.try_join_next().is_some() {}
            if is_draining && self.tasks.is_empty() {
                // R25: every batch read has been answered; stop reading.
                break;
            }
            match self
                .next(&mut inbound, &mut draining, &mut is_draining)
                .await
            {
                Step::Gone => {
                    // The coordinator went away: nobody reads the answers.
                    self.tasks.abort_all();
                    return;
                }
                Step::Again => {}
                Step::Read(None, _) => break,
                Step::Read(Some(Err(status)), _) => {
                    // The stream cannot be read further (e.g. a message
                    // above the transport limit). Answer what is in flight,
                    // then tell the coordinator why.
                    tracing::info!(%status, "coordinator stream ended with an error");
                    stream_error = Some(transport_status(status));
                    break;
                }
                Step::Read(Some(Ok(inbound)), slot) => {
                    let mut door =
                        Door::stream(&self.trace, self.caller.as_ref(), &self.gate, is_draining);
                    door.may_replay = self.may_replay;
                    match self.tool.mesh.arrive(inbound, door) {
                        Arrival::Admitted(admitted) => self.judge(admitted, slot),
                        Arrival::Refused(refused) => self.refuse(slot, refused),
                    }
                }
            }
        }
        let tx = self.tx.clone();
        let finish = async {
            while self.tasks.join_next().await.is_some() {}
            if let Some(status) = stream_error {
                let _ = tx
                    .send(Answer {
                        response: Box::new(Err(status)),
                        counted: Counted::default(),
                    })
                    .await;
            }
        };
        tokio::select! {
            () = finish => {}
            () = tx.closed() => {}
        }
    }

    /// Waits until the stream may read (room in its budget and a slot for
    /// the answer), then reads one message. Not reading a stream whose
    /// answers are not taken is what bounds it (R25): HTTP/2 flow control
    /// then stops the coordinator.
    async fn next<S>(
        &mut self,
        inbound: &mut S,
        draining: &mut watch::Receiver<bool>,
        is_draining: &mut bool,
    ) -> Step
    where
        S: Stream<Item = Result<Inbound, Status>> + Unpin,
    {
        let watch_draining = !*is_draining;
        // Woken by a finished batch only while draining (to end once every
        // batch read is answered); otherwise the loop reaps them in passing.
        let reap = *is_draining;
        // No shutdown begun since the stream last looked (see below).
        let quiet = !watch_draining || matches!(draining.has_changed(), Ok(false));
        let drain = async {
            let _ = draining.wait_for(|d| *d).await;
            tracing::debug!("draining: batches read from now on are answered UNAVAILABLE");
        };
        tokio::pin!(drain);
        if !self.budget.has_room() {
            return tokio::select! {
                biased;
                () = self.tx.closed() => Step::Gone,
                () = &mut drain, if watch_draining => {
                    *is_draining = true;
                    Step::Again
                }
                () = self.budget.released.notified() => Step::Again,
                Some(_) = self.tasks.join_next(), if reap && !self.tasks.is_empty() => Step::Again,
            };
        }
        // The usual case, with nothing to wait for: room for the answer and
        // no shutdown begun. The stream's waits (its coordinator gone, the
        // shutdown, a finished batch) are registered only when the next
        // message is not there yet.
        let slot = match self.tx.clone().try_reserve_owned() {
            Ok(slot) if quiet && !reap => {
                if let Some(message) = futures::FutureExt::now_or_never(inbound.next()) {
                    // A yield point, as the waits it skips were: a
                    // coordinator whose batches are all answered at once
                    // (refused) never holds the thread past the runtime's
                    // budget.
                    tokio::task::coop::consume_budget().await;
                    return Step::Read(message, slot);
                }
                Some(slot)
            }
            Ok(slot) => Some(slot),
            Err(mpsc::error::TrySendError::Closed(_)) => return Step::Gone,
            Err(mpsc::error::TrySendError::Full(_)) => None,
        };
        let slot = if let Some(slot) = slot {
            slot
        } else {
            tokio::select! {
                biased;
                () = self.tx.closed() => return Step::Gone,
                () = &mut drain, if watch_draining => {
                    *is_draining = true;
                    return Step::Again;
                }
                slot = self.tx.clone().reserve_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return Step::Gone,
                },
                Some(_) = self.tasks.join_next(), if reap && !self.tasks.is_empty() => return Step::Again,
            }
        };
        tokio::select! {
            biased;
            () = self.tx.closed() => Step::Gone,
            () = &mut drain, if watch_draining => {
                *is_draining = true;
                Step::Again
            }
            Some(_) = self.tasks.join_next(), if reap && !self.tasks.is_empty() => Step::Again,
            message = inbound.next() => Step::Read(message, slot),
        }
    }

    /// Queues an answer in its reserved slot.
    fn answer(&self, slot: OwnedPermit<Answer>, response: EvaluateResponse) {
        let answer = Answer::new(response);
        self.budget.add(answer.counted.len);
        slot.send(answer);
    }

    /// Answers a batch the pipeline refused, recorded first when a
    /// decision log is attached (R29).
    fn refuse(&mut self, slot: OwnedPermit<Answer>, refused: Refusing) {
        let batch_id = refused.batch_id.clone();
        let writes = refused.writes();
        let status = refused.status();
        if !writes {
            // Nothing to write: answered at once.
            let status = futures::FutureExt::now_or_never(status)
                .unwrap_or_else(|| Status::internal("a refusal's record did not finish"));
            self.answer(slot, error_response(batch_id, &status));
            return;
        }
        let budget = self.budget.clone();
        self.tasks.spawn(async move {
            let status = status.await;
            let answer = Answer::new(error_response(batch_id, &status));
            budget.add(answer.counted.len);
            slot.send(answer);
        });
    }

    /// Judges a batch the pipeline admitted, on a task of its own; its
    /// answer goes to its reserved slot.
    fn judge(&mut self, admitted: Admitted, slot: OwnedPermit<Answer>) {
        // The batch holds its bytes of the stream's budget while judged.
        let size = admitted.size();
        self.budget.add(size);
        let budget = self.budget.clone();
        let mesh = self.tool.mesh.clone();
        // The id as sent: answers carry it (R19).
        let batch_id = admitted.batch_id().to_owned();
        // Boxed: the judging future is several KiB, and a task's future is
        // moved whole into its cell, its output slot and out again; boxed,
        // only a pointer moves (this was over half the mesh's instructions
        // per batch).
        self.tasks.spawn(Box::pin(async move {
            let response = match admitted.run(&mesh).await {
                Ok(decision) => EvaluateResponse {
                    batch_id,
                    result: Some(evaluate_response::Result::Decision(decision)),
                },
                Err(status) => error_response(batch_id, &status),
            };
            let answer = Answer::new(response);
            budget.add(answer.counted.len);
            budget.release(size);
            slot.send(answer);
        }));
    }
}

#[tonic::async_trait]
impl PreToolService for PreTool {
    type EvaluateStream = AnswerStream;

    /// With the stock codec (a server built from the generated
    /// `PreToolServiceServer`): the same limits, checked after decoding.
    /// The mesh's own server uses [`PreToolServer`], which checks them
    /// before.
    async fn evaluate(
        &self,
        request: Request<Streaming<EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStream>, Status> {
        let door = RequestDoor::read(&self.mesh, &request);
        let limits = self.mesh.config.limits;
        let inbound = request
            .into_inner()
            .map(move |message| message.map(|m| Inbound::from_request(m, &limits)));
        Ok(Response::new(self.open_stream(door, inbound)?))
    }

    /// Tool visibility: see [`Mesh::always_skipped`]. Nothing is judged
    /// or recorded.
    async fn always_skipped(
        &self,
        request: Request<AlwaysSkippedRequest>,
    ) -> Result<Response<AlwaysSkippedResponse>, Status> {
        let tools = request.into_inner().tools;
        Ok(Response::new(self.mesh.always_skipped(&tools)?))
    }

    async fn evaluate_batch(
        &self,
        request: Request<EvaluateRequest>,
    ) -> Result<Response<BatchDecision>, Status> {
        let door = RequestDoor::read(&self.mesh, &request);
        let inbound = Inbound::from_request(request.into_inner(), &self.mesh.config.limits);
        Ok(Response::new(self.unary(door.unary(), inbound).await?))
    }
}

/// `PreToolService` served with [`InboundCodec`]: every batch's size and
/// counts are checked before it is decoded (R20), and a message above the
/// transport limit is refused with RESOURCE_EXHAUSTED.
#[derive(Debug, Clone)]
pub(crate) struct PreToolServer {
    tool: PreTool,
    /// Largest message read (a little above `limits.max_batch_bytes`).
    max_decoding: usize,
    /// Largest answer sent.
    max_encoding: usize,
}

impl PreToolServer {
    pub(crate) fn new(tool: PreTool, max_decoding: usize, max_encoding: usize) -> Self {
        Self {
            tool,
            max_decoding,
            max_encoding,
        }
    }

    fn grpc<E: prost::Message + Send + 'static>(&self) -> tonic::server::Grpc<InboundCodec<E>> {
        tonic::server::Grpc::new(InboundCodec::new(self.tool.mesh.config.limits))
            .max_decoding_message_size(self.max_decoding)
            .max_encoding_message_size(self.max_encoding)
    }
}

impl tonic::server::NamedService for PreToolServer {
    const NAME: &'static str = guardmesh_proto::v1::pre_tool_service_server::SERVICE_NAME;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// `Evaluate` with [`InboundCodec`]. tonic reads the request and writes
/// the response's head; the stream's answers go to `answers`, whose body
/// ([`AnswerBody`]) replaces the one tonic would encode them with.
struct EvaluateMethod {
    tool: PreTool,
    answers: Option<oneshot::Sender<AnswerStream>>,
}

impl tonic::server::StreamingService<Inbound> for EvaluateMethod {
    type Response = EvaluateResponse;
    type ResponseStream = futures::stream::Empty<Result<EvaluateResponse, Status>>;
    type Future = BoxFuture<Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Streaming<Inbound>>) -> Self::Future {
        let door = RequestDoor::read(&self.tool.mesh, &request);
        let opened =
            self.tool
                .open_stream(door, request.into_inner())
                .and_then(
                    |stream| match self.answers.take().map(|to| to.send(stream)) {
                        Some(Ok(())) => Ok(Response::new(futures::stream::empty())),
                        _ => Err(Status::internal("the answer stream has no body to go to")),
                    },
                );
        Box::pin(std::future::ready(opened))
    }
}

/// `EvaluateBatch` with [`InboundCodec`], read as a client stream of one
/// message so that a message over the transport limit is answered
/// RESOURCE_EXHAUSTED like every other size limit (R20).
struct EvaluateBatchMethod(PreTool);

impl tonic::server::ClientStreamingService<Inbound> for EvaluateBatchMethod {
    type Response = BatchDecision;
    type Future = BoxFuture<Result<Response<BatchDecision>, Status>>;

    fn call(&mut self, request: Request<Streaming<Inbound>>) -> Self::Future {
        let tool = self.0.clone();
        Box::pin(async move {
            let door = RequestDoor::read(&tool.mesh, &request);
            let mut inbound = request.into_inner();
            let message = inbound
                .message()
                .await
                .map_err(transport_status)?
                .ok_or_else(|| Status::invalid_argument("EvaluateBatch sent no request message"))?;
            Ok(Response::new(tool.unary(door.unary(), message).await?))
        })
    }
}

impl<B> tower::Service<http::Request<B>> for PreToolServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        if path == "/guardmesh.v1.PreToolService/Evaluate" {
            let mut grpc = self.grpc::<EvaluateResponse>();
            let (answers, opened) = oneshot::channel();
            let method = EvaluateMethod {
                tool: self.tool.clone(),
                answers: Some(answers),
            };
            let max_message = self.max_encoding;
            Box::pin(async move {
                let response = grpc.streaming(method, request).await;
                // Opened: the answers go in a body of the mesh's framing
                // (tonic's head kept); refused: tonic's answer as it is.
                Ok(match opened.await {
                    Ok(answers) => {
                        let (head, _) = response.into_parts();
                        http::Response::from_parts(
                            head,
                            tonic::body::Body::new(AnswerBody::new(answers, max_message)),
                        )
                    }
                    Err(_) => response,
                })
            })
        } else if path == "/guardmesh.v1.PreToolService/EvaluateBatch" {
            let mut grpc = self.grpc::<BatchDecision>();
            let method = EvaluateBatchMethod(self.tool.clone());
            Box::pin(async move { Ok(grpc.client_streaming(method, request).await) })
        } else if path == "/guardmesh.v1.PreToolService/AlwaysSkipped" {
            // Tool visibility: a unary request of names, read within the
            // most its bounds allow (R20, R25); counts and lengths are
            // then checked with INVALID_ARGUMENT naming the limit.
            let mut server =
                guardmesh_proto::v1::pre_tool_service_server::PreToolServiceServer::new(
                    self.tool.clone(),
                )
                .max_decoding_message_size(ALWAYS_SKIPPED_MAX_REQUEST_BYTES)
                .max_encoding_message_size(self.max_encoding);
            Box::pin(async move {
                Ok(server
                    .call(request)
                    .await
                    .unwrap_or_else(|never| match never {}))
            })
        } else {
            Box::pin(async move {
                Ok(
                    Status::unimplemented("no such method of guardmesh.v1.PreToolService")
                        .into_http(),
                )
            })
        }
    }
}

/// The largest `AlwaysSkippedRequest` read: its most names, each at its
/// longest with the bytes of its field's key and length, and some room.
const ALWAYS_SKIPPED_MAX_REQUEST_BYTES: usize = guardmesh_proto::ALWAYS_SKIPPED_MAX_TOOLS
    * (guardmesh_proto::ALWAYS_SKIPPED_MAX_NAME_BYTES + 4)
    + 1024;

/// The status to end a stream with after a read error. The transport
/// reports an over-limit message as OUT_OF_RANGE; to the coordinator it is
/// RESOURCE_EXHAUSTED like every other size limit (R20).
fn transport_status(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange {
        Status::resource_exhausted(format!(
            "a message on this stream exceeds the mesh's transport limit and cannot be read: {}",
            status.message()
        ))
    } else {
        status
    }
}

fn error_response(batch_id: String, status: &Status) -> EvaluateResponse {
    EvaluateResponse {
        batch_id,
        result: Some(evaluate_response::Result::Error(
            guardmesh_proto::v1::BatchError {
                code: status.code() as i32,
                message: status.message().to_owned(),
            },
        )),
    }
}

/// `GuardRegistry`.
#[derive(Debug, Clone)]
pub(crate) struct Registrar {
    mesh: Arc<Mesh>,
}

impl Registrar {
    pub(crate) fn new(mesh: Arc<Mesh>) -> Self {
        Self { mesh }
    }

    /// Checks what an authenticated caller may do with guard `name`; open
    /// when authentication is off.
    fn authorize<T>(&self, request: &Request<T>, name: &str) -> Result<Option<Caller>, Status> {
        let Some(caller) = request.extensions().get::<Caller>().cloned() else {
            return Ok(None);
        };
        if !caller.may_manage(name) {
            self.mesh
                .metrics
                .auth_refused(tonic::Code::PermissionDenied);
            tracing::warn!(identity = %caller.id, guard = %name, "registration refused: name outside the caller's prefixes");
            return Err(Status::permission_denied(format!(
                "{} may only manage guards named {}",
                caller.id,
                caller.name_prefixes.join(" or ")
            )));
        }
        Ok(Some(caller))
    }
}

fn registry_status(error: RegistryError) -> Status {
    match error {
        RegistryError::Invalid(e) => Status::invalid_argument(e.to_string()),
        RegistryError::Quota(e) => {
            tracing::warn!("registration refused: {e}");
            Status::resource_exhausted(e.to_string())
        }
        RegistryError::Unavailable(e) => Status::unavailable(e),
    }
}

/// The status of a registration that [`admit`](crate::registry::admit)
/// refused.
fn admit_status(name: &str, error: AdmitError) -> Status {
    match error {
        AdmitError::Invalid(e) => Status::invalid_argument(e.to_string()),
        AdmitError::Endpoint { endpoint, why, .. } => {
            tracing::warn!(guard = %name, endpoint = %endpoint, "registration refused: {why}");
            Status::permission_denied(format!(
                "guard {name:?}: endpoint {endpoint} refused by the endpoint policy: {why}"
            ))
        }
        AdmitError::Interrupted => Status::unavailable(error.to_string()),
    }
}

#[tonic::async_trait]
impl GuardRegistry for Registrar {
    /// R29: every registration and deregistration, applied or refused, is
    /// recorded with its caller.
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let named = |r: &RegisterRequest| {
            let spec = r.guard.as_ref();
            let name = spec.map(|g| g.name.clone()).unwrap_or_default();
            (name, spec.map(from_mesh::spec))
        };
        let apply = |request, ahead| self.register_in(request, ahead);
        self.logged(request, ChangeKind::Register, named, apply, |r| r.revision)
            .await
    }

    async fn deregister(
        &self,
        request: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        let named = |r: &DeregisterRequest| (r.name.clone(), None);
        let apply = |request, ahead| self.deregister_in(request, ahead);
        self.logged(request, ChangeKind::Deregister, named, apply, |r| {
            r.revision
        })
        .await
    }

    async fn list(&self, _request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let chain = self.mesh.registry().chain();
        Ok(Response::new(ListResponse {
            revision: chain.revision,
            guards: chain.guards.iter().map(|g| g.to_spec()).collect(),
        }))
    }
}

/// The record written before a chain change is applied (R29, under
/// `on_log_failure = "refuse"`), and the log it goes to.
struct Ahead {
    log: MeshLog,
    record: crate::decision_log::ChainChangeRecord,
}

impl Ahead {
    /// Writes the record; `Err`: the change must not be applied.
    async fn write(self) -> Result<(), Status> {
        self.log.change_before(self.record).await
    }
}

impl Registrar {
    /// Applies the registry change `request` asks for through `apply`
    /// (R29): without a decision log as it is; with one, as a change of
    /// `kind` to the guard (and registration) `named` finds in the request,
    /// its record written ahead of it when the log refuses unrecorded
    /// changes, and recorded with its caller once applied (`revision`: the
    /// new revision) or refused.
    async fn logged<T, R, Fut>(
        &self,
        request: Request<T>,
        kind: ChangeKind,
        named: impl FnOnce(&T) -> (String, Option<serde_json::Value>),
        apply: impl FnOnce(Request<T>, Option<Ahead>) -> Fut,
        revision: fn(&R) -> u64,
    ) -> Result<Response<R>, Status>
    where
        Fut: Future<Output = Result<R, Status>>,
    {
        let Some(caller) = log_caller(&self.mesh, &request) else {
            return apply(request, None).await.map(Response::new);
        };
        let (guard, spec) = named(request.get_ref());
        let change = RegistryChange {
            kind,
            guard,
            spec,
            old_revision: self.mesh.registry().chain().revision,
        };
        let ahead = self.ahead(&caller, &change);
        let result = apply(request, ahead).await;
        self.record(caller, change, result.as_ref().map(revision))
            .await;
        result.map(Response::new)
    }

    /// Records `change` once applied (`Ok`: the new revision) or refused
    /// (R29).
    async fn record(
        &self,
        caller: LogCaller,
        change: RegistryChange,
        result: Result<u64, &Status>,
    ) {
        if let Some(log) = self.mesh.decision_log() {
            let record = change.ended(Arc::unwrap_or_clone(caller), result);
            log.change(record).await;
        }
    }

    /// The record to write before applying a change, when the log refuses
    /// what it cannot record.
    fn ahead(&self, caller: &LogCaller, change: &RegistryChange) -> Option<Ahead> {
        let log = self.mesh.decision_log()?;
        log.refuses().then(|| Ahead {
            log: log.clone(),
            record: change.requested(caller.as_ref().clone()),
        })
    }

    /// Registers the guard once the checks pass and `ahead`, if any, is
    /// written.
    async fn register_in(
        &self,
        request: Request<RegisterRequest>,
        ahead: Option<Ahead>,
    ) -> Result<RegisterResponse, Status> {
        let Some(spec) = request.get_ref().guard.clone() else {
            return Err(Status::invalid_argument("RegisterRequest.guard is missing"));
        };
        let name = spec.name.clone();
        let caller = self.authorize(&request, &name)?;
        // R16: checked once, here (R25: its policy compiled off the
        // runtime's threads, within the policy's size and time bounds); the
        // registry takes the checked guard as it is.
        let checked = crate::registry::admit(spec, &Admission::of(&self.mesh.config))
            .await
            .map_err(|error| admit_status(&name, error))?;
        for warning in checked.guard().warnings() {
            tracing::warn!(guard = %name, "{warning}");
        }
        // R25: what the caller may hold is checked and counted by the
        // registry in the same step as the registration, so replicas
        // sharing a store enforce one quota.
        let owner = caller.as_ref().map(|caller| Owner {
            identity: caller.id.clone(),
            max_guards: (!caller.roles.contains(&Role::Admin)).then_some(caller.max_registrations),
            max_policy_bytes: self.mesh.config.max_policy_bytes_per_identity,
        });
        if let Some(ahead) = ahead {
            ahead.write().await?;
        }
        let out = self
            .mesh
            .registry()
            .register(checked, owner)
            .await
            .map_err(registry_status)?;
        // Start dialing the guard now rather than on its first batch.
        let _ = self.mesh.chain();
        tracing::info!(guard = %name, revision = out.revision, position = out.position, created = out.created, "guard registered");
        Ok(RegisterResponse {
            revision: out.revision,
            position: u32::try_from(out.position).unwrap_or(u32::MAX),
            created: out.created,
        })
    }

    async fn deregister_in(
        &self,
        request: Request<DeregisterRequest>,
        ahead: Option<Ahead>,
    ) -> Result<DeregisterResponse, Status> {
        let name = request.get_ref().name.clone();
        self.authorize(&request, &name)?;
        if let Some(ahead) = ahead {
            ahead.write().await?;
        }
        let out = self
            .mesh
            .registry()
            .deregister(name.clone())
            .await
            .map_err(registry_status)?;
        let _ = self.mesh.chain();
        tracing::info!(guard = %name, revision = out.revision, removed = out.removed, "guard deregistered");
        Ok(DeregisterResponse {
            revision: out.revision,
            removed: out.removed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r14_grpc_timeout_header() {
        let mut m = MetadataMap::new();
        m.insert("grpc-timeout", "250m".parse().unwrap());
        assert_eq!(grpc_timeout(&m), Some(Duration::from_millis(250)));
        m.insert("grpc-timeout", "3S".parse().unwrap());
        assert_eq!(grpc_timeout(&m), Some(Duration::from_secs(3)));
        m.insert("grpc-timeout", "x".parse().unwrap());
        assert_eq!(grpc_timeout(&m), None);
    }

    /// R19, idle streams' memory: an open stream's answer channel holds a
    /// block of 32 answer slots, so a queued answer stays a pointer and
    /// its counted lengths (32 bytes; 48 when the lengths were a `Vec`
    /// and a length beside it).
    #[test]
    fn a_queued_answer_is_small_whatever_it_holds() {
        assert!(
            std::mem::size_of::<Answer>() <= 32,
            "{} bytes",
            std::mem::size_of::<Answer>()
        );
    }
}
