//! An in-memory guard behind [`GuardTransport`], for unit tests of the link
//! and of the judging above it in paused time (`tokio::test(start_paused =
//! true)`): no socket, no thread, every wait a tokio timer, so a test's
//! virtual durations are exact.
//!
//! A [`ScriptedNet`] is a transport that maps endpoints to
//! [`ScriptedGuard`]s (an endpoint with none refuses connections). Per
//! batch, a guard's script gives the [`Step`]s it takes, each `after` a
//! delay from the moment it read the batch: answer (in full, in part, with
//! an error), send raw bytes (malformed, or with fields this mesh does not
//! know), end its stream, or fail it. An empty script never answers. Apart
//! from the script, a guard can refuse connections N times, refuse the
//! `Judge` stream, be killed and restarted, stop reading its stream, and
//! ignore cancels. Its answers go through the link's own reader
//! ([`wire::read_answer`]), as they would off the wire (R23).
//!
//! [`serve_on_loopback`] serves the same guard, script and all, as a gRPC
//! `GuardService` on a loopback socket: a scenario written once runs on
//! both transports, in paused time here and over the mesh's own
//! [`GrpcTransport`](super::transport::GrpcTransport) there.

use super::LinkConfig;
use super::transport::{Answers, GuardTransport, OpenError, Opening, Requests};
use super::wire;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use guardmesh_proto::v1::{
    GuardBatch, JudgeRequest, JudgeResponse, Rewrite, Skip, SkipKind, Verdict, judge_request,
    verdict,
};
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// A link's settings with the integration harness's quick redials: the
/// first pause 20 ms, the longest 200 ms.
pub fn quick_redials() -> LinkConfig {
    LinkConfig {
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..LinkConfig::default()
    }
}

/// Which transport a scenario's scripted guards are reached over: a
/// scenario written once runs on both (see [`on_both_transports`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// In memory ([`ScriptedNet`]), in paused time: every duration exact.
    Scripted,
    /// On loopback sockets ([`serve_on_loopback`]), reached by the mesh's
    /// own gRPC transport, in real time.
    Socket,
}

impl Transport {
    /// Asserts that something took `want`: exactly in paused time; no less
    /// on sockets, whose clock is real (there, a scenario asserts outcomes
    /// and order, not durations).
    pub fn assert_took(self, took: Duration, want: Duration, what: &str) {
        match self {
            Self::Scripted => assert_eq!(took, want, "{what}"),
            Self::Socket => assert!(took >= want, "{what}: {took:?} < {want:?}"),
        }
    }

    /// Lets the spawned tasks (links, guards' streams) run: 1 ms of virtual
    /// time, or 100 ms on sockets.
    pub async fn settle(self) {
        tokio::time::sleep(match self {
            Self::Scripted => Duration::from_millis(1),
            Self::Socket => Duration::from_millis(100),
        })
        .await;
    }
}

/// Runs each named scenario of the module `scenarios` (an `async fn` taking
/// a [`Transport`]) twice: as a paused-time test of its name over scripted
/// guards in memory, and as `on_a_socket::` that name over the same guards
/// on loopback sockets.
#[cfg(test)]
macro_rules! on_both_transports {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test(start_paused = true)]
            async fn $name() {
                scenarios::$name($crate::link::scripted::Transport::Scripted).await;
            }
        )*

        mod on_a_socket {
            use super::scenarios;
            $(
                #[tokio::test]
                async fn $name() {
                    scenarios::$name($crate::link::scripted::Transport::Socket).await;
                }
            )*
        }
    };
}
#[cfg(test)]
pub(crate) use on_both_transports;

/// What a scripted guard does about a batch, `after` it read it.
#[derive(Debug, Clone)]
pub enum Step {
    /// Sends this answer.
    Answer {
        after: Duration,
        response: JudgeResponse,
    },
    /// Sends these bytes as an answer: read by the link as off the wire.
    Raw { after: Duration, bytes: Vec<u8> },
    /// Ends its stream cleanly (as a guard returning from `Judge`).
    End { after: Duration },
    /// Ends its stream with this error.
    Fail {
        after: Duration,
        status: tonic::Status,
    },
}

impl Step {
    /// The final answer to `batch`: `verdicts`, at once.
    pub fn answer(batch: &GuardBatch, verdicts: Vec<Verdict>) -> Self {
        Self::Answer {
            after: Duration::ZERO,
            response: JudgeResponse {
                request_id: batch.request_id,
                verdicts,
                partial: false,
                error: String::new(),
            },
        }
    }

    /// A partial answer to `batch` (more to come).
    pub fn partial(batch: &GuardBatch, verdicts: Vec<Verdict>) -> Self {
        let mut step = Self::answer(batch, verdicts);
        if let Self::Answer { response, .. } = &mut step {
            response.partial = true;
        }
        step
    }

    /// An answer to request `request_id`, whatever batch it is.
    pub fn answer_to(request_id: u64, verdicts: Vec<Verdict>, partial: bool) -> Self {
        Self::Answer {
            after: Duration::ZERO,
            response: JudgeResponse {
                request_id,
                verdicts,
                partial,
                error: String::new(),
            },
        }
    }

    /// An answer to `batch` that carries an error (`JudgeResponse.error`).
    pub fn error(batch: &GuardBatch, message: &str) -> Self {
        Self::Answer {
            after: Duration::ZERO,
            response: JudgeResponse {
                request_id: batch.request_id,
                verdicts: Vec::new(),
                partial: false,
                error: message.to_owned(),
            },
        }
    }

    /// These bytes as an answer.
    pub fn raw(bytes: Vec<u8>) -> Self {
        Self::Raw {
            after: Duration::ZERO,
            bytes,
        }
    }

    /// Ends the stream cleanly.
    pub fn end() -> Self {
        Self::End {
            after: Duration::ZERO,
        }
    }

    /// Ends the stream with `status`.
    pub fn fail(status: tonic::Status) -> Self {
        Self::Fail {
            after: Duration::ZERO,
            status,
        }
    }

    /// The same step, `delay` after the batch was read.
    pub fn after(mut self, delay: Duration) -> Self {
        match &mut self {
            Self::Answer { after, .. }
            | Self::Raw { after, .. }
            | Self::End { after }
            | Self::Fail { after, .. } => *after = delay,
        }
        self
    }

    fn delay(&self) -> Duration {
        match self {
            Self::Answer { after, .. }
            | Self::Raw { after, .. }
            | Self::End { after }
            | Self::Fail { after, .. } => *after,
        }
    }
}

/// A proceed verdict for `call_id`.
pub fn proceed(call_id: &str) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: None,
    }
}

/// A skip of `call_id` with `content`, of `kind` (`SkipKind` as sent).
pub fn skip(call_id: &str, content: &str, kind: i32) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(verdict::Outcome::Skip(Skip {
            content: content.into(),
            kind,
        })),
    }
}

/// A steer of `call_id`.
pub fn steer(call_id: &str, content: &str) -> Verdict {
    skip(call_id, content, SkipKind::Steer as i32)
}

/// A cancel of `call_id`.
pub fn cancel(call_id: &str, content: &str) -> Verdict {
    skip(call_id, content, SkipKind::Cancel as i32)
}

/// A rewrite of `call_id` (new tool name, new arguments).
pub fn rewrite(call_id: &str, tool: Option<&str>, arguments: Option<&str>) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(verdict::Outcome::Rewrite(Rewrite {
            tool: tool.map(Into::into),
            arguments: arguments.map(Into::into),
        })),
    }
}

type Script = dyn Fn(&GuardBatch) -> Vec<Step> + Send + Sync;

/// Control of a guard's open stream.
enum Ctl {
    /// Look at the guard's state again (reading resumed).
    Wake,
    /// End the stream cleanly.
    End,
    /// End the stream with an error.
    Fail(tonic::Status),
}

#[derive(Default)]
struct State {
    connects: Vec<Instant>,
    streams: u32,
    refuse_connects: u32,
    refuse_streams: Vec<tonic::Status>,
    down: bool,
    not_reading: bool,
    serial: bool,
    ignore_cancels: bool,
    received: Vec<(Instant, GuardBatch)>,
    cancels: Vec<u64>,
    answered: usize,
    /// The controls of its open streams (one per link that dialed it).
    open: Vec<mpsc::UnboundedSender<Ctl>>,
}

impl State {
    /// Sends `ctl` to every open stream.
    fn signal_streams(&mut self, ctl: impl Fn() -> Ctl) {
        self.open.retain(|stream| stream.send(ctl()).is_ok());
    }
}

/// A guard that answers as its script says, and records what it was sent.
pub struct ScriptedGuard {
    script: Mutex<Arc<Script>>,
    state: Mutex<State>,
}

impl std::fmt::Debug for ScriptedGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedGuard").finish_non_exhaustive()
    }
}

impl ScriptedGuard {
    /// A guard that runs `script` on each batch it reads.
    pub fn new(script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(Arc::new(script)),
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `script` on the batches it reads from now on.
    pub fn set_script(&self, script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static) {
        *self.script.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(script);
    }

    /// Refuses the next `n` connections (as a closed port).
    pub fn refuse_connects(&self, n: u32) {
        self.lock().refuse_connects = n;
    }

    /// Connects, then refuses the next `Judge` stream with `status` (once
    /// per call).
    pub fn refuse_stream(&self, status: tonic::Status) {
        self.lock().refuse_streams.push(status);
    }

    /// The process dies: its stream fails (a reset connection) and every
    /// connection is refused until [`Self::restart`].
    pub fn kill(&self) {
        let mut state = self.lock();
        state.down = true;
        state.signal_streams(|| {
            Ctl::Fail(tonic::Status::unavailable(
                "error reading a body from connection: connection reset",
            ))
        });
        state.open.clear();
    }

    /// The process is back: connections are accepted again.
    pub fn restart(&self) {
        self.lock().down = false;
    }

    /// Ends its open streams cleanly.
    pub fn end_streams(&self) {
        let mut state = self.lock();
        state.signal_streams(|| Ctl::End);
        state.open.clear();
    }

    /// Stops (`false`) or resumes (`true`) taking requests off its stream.
    pub fn reading(&self, reading: bool) {
        let mut state = self.lock();
        state.not_reading = !reading;
        state.signal_streams(|| Ctl::Wake);
    }

    /// Reads one batch at a time: the next only once every step of the
    /// last is taken (a single-worker guard).
    pub fn serial(&self) {
        self.lock().serial = true;
    }

    /// Keeps working on (and answering) batches the mesh cancelled.
    pub fn ignore_cancels(&self) {
        self.lock().ignore_cancels = true;
    }

    /// The batches it read, in order.
    pub fn batches(&self) -> Vec<GuardBatch> {
        self.lock()
            .received
            .iter()
            .map(|(_, b)| b.clone())
            .collect()
    }

    /// When it read each batch.
    pub fn read_at(&self) -> Vec<Instant> {
        self.lock().received.iter().map(|(at, _)| *at).collect()
    }

    /// How many batches it read.
    pub fn requests(&self) -> usize {
        self.lock().received.len()
    }

    /// The request ids the mesh cancelled, in order.
    pub fn cancels(&self) -> Vec<u64> {
        self.lock().cancels.clone()
    }

    /// Answers it sent (well formed or not).
    pub fn answered(&self) -> usize {
        self.lock().answered
    }

    /// Connection attempts.
    pub fn connects(&self) -> usize {
        self.lock().connects.len()
    }

    /// When each connection attempt was made.
    pub fn connects_at(&self) -> Vec<Instant> {
        self.lock().connects.clone()
    }

    /// Streams opened.
    pub fn streams(&self) -> u32 {
        self.lock().streams
    }

    fn open(
        self: &Arc<Self>,
        endpoint: &str,
        max_answer: usize,
        requests: Requests,
    ) -> Result<Answers, OpenError> {
        self.connect().map_err(|reason| OpenError::Unreachable {
            endpoint: endpoint.to_owned(),
            reason: reason.to_owned(),
        })?;
        let ctl = self.open_stream().map_err(OpenError::Refused)?;
        let (answers_tx, answers) = mpsc::unbounded_channel();
        let requests = requests
            .map(|request| JudgeRequest::decode(&request.to_vec()[..]).ok())
            .boxed();
        let out = Out::Link {
            max_answer,
            answers: answers_tx,
        };
        tokio::spawn(serve(self.clone(), requests, ctl, out));
        Ok(Box::pin(UnboundedReceiverStream::new(answers)))
    }

    /// A connection attempt, recorded: refused while the guard is down, or
    /// while it has refusals left.
    fn connect(&self) -> Result<(), &'static str> {
        let mut state = self.lock();
        state.connects.push(Instant::now());
        if state.down {
            return Err("connection refused (the guard is down)");
        }
        if state.refuse_connects > 0 {
            state.refuse_connects -= 1;
            return Err("connection refused");
        }
        Ok(())
    }

    /// A `Judge` stream on an accepted connection: refused as
    /// [`Self::refuse_stream`] says, or opened, with its control.
    fn open_stream(&self) -> Result<mpsc::UnboundedReceiver<Ctl>, tonic::Status> {
        let mut state = self.lock();
        if !state.refuse_streams.is_empty() {
            return Err(state.refuse_streams.remove(0));
        }
        state.streams += 1;
        let (ctl_tx, ctl) = mpsc::unbounded_channel();
        state.open.push(ctl_tx);
        Ok(ctl)
    }

    /// Reads one request off the stream.
    fn read(&self, request: Option<JudgeRequest>) -> Read {
        let Some(request) = request else {
            return Read::Other;
        };
        match request.kind {
            Some(judge_request::Kind::Batch(batch)) => {
                self.lock().received.push((Instant::now(), batch.clone()));
                let script = self
                    .script
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                let steps = script(&batch);
                Read::Batch(batch.request_id, steps)
            }
            Some(judge_request::Kind::Cancel(cancel)) => {
                let mut state = self.lock();
                state.cancels.push(cancel.request_id);
                if state.ignore_cancels {
                    Read::Other
                } else {
                    Read::Cancel(cancel.request_id)
                }
            }
            None => Read::Other,
        }
    }
}

/// A request read off a stream.
enum Read {
    /// A batch (its request id) and the steps the script takes for it.
    Batch(u64, Vec<Step>),
    /// A cancel to obey: that request's steps are dropped.
    Cancel(u64),
    /// Nothing to do.
    Other,
}

/// What a scripted guard sends as an answer.
enum Frame {
    /// A well-formed answer.
    Message(JudgeResponse),
    /// Bytes as they are ([`Step::Raw`]).
    Raw(Vec<u8>),
}

/// Where one stream's answers go.
enum Out {
    /// To a link in this process, read as the link's codec reads them off
    /// the wire.
    Link {
        max_answer: usize,
        answers: mpsc::UnboundedSender<Result<wire::Answer, tonic::Status>>,
    },
    /// To a gRPC stream on a real socket ([`serve_on_loopback`]), written
    /// byte for byte.
    Socket(mpsc::UnboundedSender<Result<Vec<u8>, tonic::Status>>),
}

impl Out {
    /// Sends an answer; `false` once the stream is over.
    fn answer(&self, frame: Frame) -> bool {
        match self {
            Self::Link {
                max_answer,
                answers,
            } => {
                let bytes = match frame {
                    Frame::Message(response) => response.encode_to_vec(),
                    Frame::Raw(bytes) => bytes,
                };
                // As the link's codec reads it off the wire: a frame over
                // the link's bound, or one it cannot read, ends the stream
                // with that error.
                if bytes.len() > *max_answer {
                    self.fail(tonic::Status::out_of_range(format!(
                        "Error, decoded message length too large: found {} bytes, the limit is: {max_answer} bytes",
                        bytes.len()
                    )));
                    return false;
                }
                match wire::read_answer(&bytes) {
                    Ok(answer) => answers.send(Ok(answer)).is_ok(),
                    Err(status) => {
                        self.fail(status);
                        false
                    }
                }
            }
            Self::Socket(answers) => {
                let bytes = match frame {
                    Frame::Message(response) => response.encode_to_vec(),
                    Frame::Raw(bytes) => bytes,
                };
                answers.send(Ok(bytes)).is_ok()
            }
        }
    }

    /// Ends the stream with `status`.
    fn fail(&self, status: tonic::Status) {
        let _ = match self {
            Self::Link { answers, .. } => answers.send(Err(status)).is_ok(),
            Self::Socket(answers) => answers.send(Err(status)).is_ok(),
        };
    }

    /// Resolves once the other end stopped reading the answers.
    async fn closed(&self) {
        match self {
            Self::Link { answers, .. } => answers.closed().await,
            Self::Socket(answers) => answers.closed().await,
        }
    }
}

/// One open stream of `guard`: reads requests (while it reads), takes the
/// steps of its script when due, and obeys its controls.
async fn serve(
    guard: Arc<ScriptedGuard>,
    mut requests: BoxStream<'static, Option<JudgeRequest>>,
    mut ctl: mpsc::UnboundedReceiver<Ctl>,
    out: Out,
) {
    // Due steps by (when, order), with their request id.
    let mut pending: BTreeMap<(Instant, u64), (u64, Step)> = BTreeMap::new();
    let mut seq = 0u64;
    let mut requests_open = true;
    loop {
        let due = pending.keys().next().map(|(at, _)| *at);
        let reading = {
            let state = guard.lock();
            requests_open && !state.not_reading && (!state.serial || pending.is_empty())
        };
        tokio::select! {
            biased;
            control = ctl.recv() => match control {
                Some(Ctl::Wake) => {}
                Some(Ctl::End) | None => return,
                Some(Ctl::Fail(status)) => {
                    out.fail(status);
                    return;
                }
            },
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                let Some((_, (_, step))) = pending.pop_first() else {
                    continue;
                };
                let frame = match step {
                    Step::Answer { response, .. } => Frame::Message(response),
                    Step::Raw { bytes, .. } => Frame::Raw(bytes),
                    Step::End { .. } => return,
                    Step::Fail { status, .. } => {
                        out.fail(status);
                        return;
                    }
                };
                guard.lock().answered += 1;
                if !out.answer(frame) {
                    return;
                }
            }
            request = requests.next(), if reading => match request {
                None => requests_open = false,
                Some(request) => match guard.read(request) {
                    Read::Batch(request_id, steps) => {
                        let now = Instant::now();
                        for step in steps {
                            pending.insert((now + step.delay(), seq), (request_id, step));
                            seq += 1;
                        }
                    }
                    Read::Cancel(id) => pending.retain(|_, (request_id, _)| *request_id != id),
                    Read::Other => {}
                },
            },
            () = out.closed() => return,
        }
    }
}

/// Serves `guard` as a gRPC `GuardService` on a loopback port of its own,
/// and gives its endpoint: the same scripts over the mesh's own transport
/// and a real socket. A connection is accepted, then closed at once while
/// the guard is down or has refusals left; a `Judge` stream is refused as
/// [`ScriptedGuard::refuse_stream`] says. Answers, raw ones too, go out
/// byte for byte. A guard that stops reading ([`ScriptedGuard::reading`])
/// is for the scripted transport only: a socket buffers what the guard does
/// not take.
pub fn serve_on_loopback(guard: Arc<ScriptedGuard>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    listener
        .set_nonblocking(true)
        .expect("a non-blocking listener");
    let endpoint = format!("http://{}", listener.local_addr().expect("a bound port"));
    let listener = tokio::net::TcpListener::from_std(listener).expect("in a tokio runtime");
    let (accepted_tx, accepted) = mpsc::unbounded_channel();
    let gate = guard.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            // A refused connection is dropped, closed at once.
            if gate.connect().is_ok() && accepted_tx.send(Ok::<_, std::io::Error>(socket)).is_err()
            {
                return;
            }
        }
    });
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(OnSocket(guard))
            .serve_with_incoming(UnboundedReceiverStream::new(accepted))
            .await;
    });
    endpoint
}

/// A scripted guard as a gRPC `GuardService` (its `Judge` method), written
/// by hand so that its answers go out byte for byte, raw ones too.
#[derive(Clone)]
struct OnSocket(Arc<ScriptedGuard>);

impl tonic::server::NamedService for OnSocket {
    const NAME: &'static str = "guardmesh.v1.GuardService";
}

impl tower::Service<http::Request<tonic::body::Body>> for OnSocket {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let judge = Judge(self.0.clone());
        Box::pin(async move {
            if request.uri().path() != "/guardmesh.v1.GuardService/Judge" {
                return Ok(
                    tonic::Status::unimplemented("a scripted guard serves Judge only").into_http(),
                );
            }
            Ok(tonic::server::Grpc::new(AnswerBytes)
                .streaming(judge, request)
                .await)
        })
    }
}

/// The `Judge` method of a scripted guard on a socket: each stream opened
/// as [`ScriptedGuard::open`] opens one in memory, and served by the same
/// loop.
struct Judge(Arc<ScriptedGuard>);

impl tonic::server::StreamingService<JudgeRequest> for Judge {
    type Response = Vec<u8>;
    type ResponseStream = UnboundedReceiverStream<Result<Vec<u8>, tonic::Status>>;
    type Future = BoxFuture<'static, Result<tonic::Response<Self::ResponseStream>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<JudgeRequest>>) -> Self::Future {
        let guard = self.0.clone();
        Box::pin(async move {
            let ctl = guard.open_stream()?;
            let (answers_tx, answers) = mpsc::unbounded_channel();
            let requests = request
                .into_inner()
                .take_while(|request| std::future::ready(request.is_ok()))
                .map(Result::ok)
                .boxed();
            tokio::spawn(serve(guard, requests, ctl, Out::Socket(answers_tx)));
            Ok(tonic::Response::new(UnboundedReceiverStream::new(answers)))
        })
    }
}

/// The codec of a scripted guard on a socket: requests read by prost,
/// answers written as the bytes they are.
#[derive(Clone, Copy, Default)]
struct AnswerBytes;

impl tonic::codec::Codec for AnswerBytes {
    type Encode = Vec<u8>;
    type Decode = JudgeRequest;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl tonic::codec::Encoder for AnswerBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for AnswerBytes {
    type Item = JudgeRequest;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<JudgeRequest>, tonic::Status> {
        JudgeRequest::decode(src)
            .map(Some)
            .map_err(|error| tonic::Status::internal(error.to_string()))
    }
}

/// A transport to scripted guards, by endpoint. An endpoint with no guard
/// refuses connections.
#[derive(Debug, Default)]
pub struct ScriptedNet {
    guards: Mutex<HashMap<String, Arc<ScriptedGuard>>>,
}

impl ScriptedNet {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Serves `guard` at `endpoint` (in place of any other).
    pub fn serve(&self, endpoint: &str, guard: Arc<ScriptedGuard>) {
        self.guards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(endpoint.to_owned(), guard);
    }

    /// A new guard running `script`, served at `endpoint`.
    pub fn guard(
        &self,
        endpoint: &str,
        script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
    ) -> Arc<ScriptedGuard> {
        let guard = ScriptedGuard::new(script);
        self.serve(endpoint, guard.clone());
        guard
    }
}

impl GuardTransport for ScriptedNet {
    fn open<'a>(&'a self, url: &'a str, config: &'a LinkConfig, requests: Requests) -> Opening<'a> {
        let guard = self
            .guards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(url)
            .cloned();
        Box::pin(async move {
            match guard {
                Some(guard) => guard.open(url, config.max_decoding_message_size, requests),
                None => Err(OpenError::Unreachable {
                    endpoint: url.to_owned(),
                    reason: "connection refused".into(),
                }),
            }
        })
    }
}
