//! The benchmark's relay floor (`guardmesh bench-relay`, hidden): the mesh's
//! hops with none of the mesh's work, to measure what the hops themselves
//! cost on this machine.
//!
//! It speaks the mesh's protocols on both sides, with the same crates and
//! runtime as `guardmesh serve`: coordinators open `PreToolService.Evaluate`
//! streams to it, and it keeps one long-lived `GuardService.Judge` stream per
//! guard, multiplexed by request id, as the mesh does. For each batch it
//! sends every guard a `GuardBatch` with all the calls (their bytes encoded
//! once and shared, as the mesh writes them), waits for every
//! answer, and answers with the decision the mesh gives when every guard
//! proceeds: a `CallDecision` per call (the call and the original), the calls
//! to execute, and a trace entry per guard. It validates nothing, judges
//! nothing (it does not read the verdicts), keeps no metrics, traces nothing
//! and applies no deadline: no mesh can be cheaper on the same hops, so
//! `mesh_4` against `relay_floor_4` is what the mesh's own work costs, and
//! `relay_floor_4` against the direct baselines is the floor any target on
//! those ratios has to clear. It is a measuring instrument only: never a
//! guard mesh.
//!
//! It prints `RELAY <port>` and `READY` once its guard streams are open, and
//! exits when its stdin closes (the benchmark holds the other end), on
//! SIGINT or SIGTERM.

use super::Error;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use guardmesh_proto::v1::pre_tool_service_server::{PreToolService, PreToolServiceServer};
use guardmesh_proto::v1::{
    Action, BatchDecision, CallDecision, EvaluateRequest, EvaluateResponse, GuardBatch, GuardRole,
    GuardTrace, JudgeResponse, TraceStatus, evaluate_response,
};
use guardmesh_server::link::wire::{Encoded, JudgeCodec, shared_part};
use prost::Message;
use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::transport::Endpoint;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// Arguments of `guardmesh bench-relay`.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayArgs {
    /// A guard to relay to: `NAME=URL` of its `GuardService`. Repeatable.
    #[arg(long = "guard", required = true)]
    pub guards: Vec<String>,
    /// Runtime threads: 1 (a current-thread runtime) or more workers, as
    /// `guardmesh serve --worker-threads`, and by default as many as
    /// `guardmesh serve` takes on this machine.
    #[arg(long)]
    pub worker_threads: Option<usize>,
}

/// Answers waiting for their batch, by request id.
type Waiting = Arc<Mutex<HashMap<u64, oneshot::Sender<JudgeResponse>>>>;

/// The `Judge` stream's codec: requests written as the mesh writes them
/// (each batch's context and calls encoded once and shared by every guard),
/// answers read with plain prost (none of the mesh's checks).
#[derive(Debug, Clone, Copy, Default)]
struct RelayCodec;

impl Codec for RelayCodec {
    type Encode = Encoded;
    type Decode = JudgeResponse;
    type Encoder = JudgeCodec;
    type Decoder = RelayCodec;

    fn encoder(&mut self) -> JudgeCodec {
        JudgeCodec
    }

    fn decoder(&mut self) -> RelayCodec {
        *self
    }
}

impl Decoder for RelayCodec {
    type Item = JudgeResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<JudgeResponse>, Status> {
        JudgeResponse::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("unreadable answer: {e}")))
    }
}

/// One guard's `Judge` stream.
struct Link {
    name: String,
    requests: mpsc::UnboundedSender<Encoded>,
    waiting: Waiting,
}

impl Link {
    async fn open(name: String, url: String) -> Result<Self, Error> {
        let channel = Endpoint::from_shared(url.clone())?
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| format!("cannot connect to guard {name} at {url}: {e}"))?;
        let (requests, rx) = mpsc::unbounded_channel();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await?;
        let mut answers = grpc
            .streaming(
                Request::new(UnboundedReceiverStream::new(rx)),
                tonic::codegen::http::uri::PathAndQuery::from_static(
                    "/guardmesh.v1.GuardService/Judge",
                ),
                RelayCodec,
            )
            .await?
            .into_inner();
        let waiting: Waiting = Arc::default();
        tokio::spawn({
            let waiting = waiting.clone();
            let name = name.clone();
            async move {
                loop {
                    match answers.message().await {
                        Ok(Some(answer)) => {
                            let sender = waiting
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .remove(&answer.request_id);
                            if let Some(sender) = sender {
                                let _ = sender.send(answer);
                            }
                        }
                        Ok(None) => break,
                        Err(status) => {
                            tracing::error!(guard = %name, %status, "guard stream failed");
                            break;
                        }
                    }
                }
                // Every batch still waiting fails (its sender is dropped).
                waiting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clear();
            }
        });
        Ok(Self {
            name,
            requests,
            waiting,
        })
    }

    /// Sends request `request_id` and returns where its answer will arrive.
    fn send(
        &self,
        request_id: u64,
        batch: Encoded,
    ) -> Result<oneshot::Receiver<JudgeResponse>, Status> {
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(request_id, tx);
        self.requests
            .send(batch)
            .map_err(|_| Status::unavailable(format!("guard {} is gone", self.name)))?;
        Ok(rx)
    }
}

/// The relay: its guards' streams.
struct Relay {
    links: Vec<Link>,
    next_request: AtomicU64,
}

impl Relay {
    /// Relays one batch to every guard and answers as the mesh does when
    /// every guard proceeds.
    async fn relay(self: Arc<Self>, request: EvaluateRequest) -> EvaluateResponse {
        let batch_id = request.batch_id.clone();
        match self.judge(request).await {
            Ok(decision) => EvaluateResponse {
                batch_id,
                result: Some(evaluate_response::Result::Decision(decision)),
            },
            Err(status) => EvaluateResponse {
                batch_id,
                result: Some(evaluate_response::Result::Error(
                    guardmesh_proto::v1::BatchError {
                        code: status.code() as i32,
                        message: status.message().to_owned(),
                    },
                )),
            },
        }
    }

    async fn judge(&self, request: EvaluateRequest) -> Result<BatchDecision, Status> {
        let started = Instant::now();
        let shared = shared_part(request.context.as_ref(), request.calls.iter());
        let mut answers = Vec::with_capacity(self.links.len());
        for link in &self.links {
            let request_id = self.next_request.fetch_add(1, Ordering::Relaxed);
            let head = GuardBatch {
                request_id,
                batch_id: request.batch_id.clone(),
                guard: link.name.clone(),
                deadline_ms: request.timeout_ms,
                traceparent: request.traceparent.clone(),
                tracestate: request.tracestate.clone(),
                ..GuardBatch::default()
            };
            answers.push(link.send(request_id, Encoded::batch(&head, shared.clone()))?);
        }
        let mut latencies = Vec::with_capacity(answers.len());
        for (link, answer) in self.links.iter().zip(answers) {
            answer
                .await
                .map_err(|_| Status::unavailable(format!("guard {} did not answer", link.name)))?;
            latencies.push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        }
        let ids: Vec<String> = request.calls.iter().map(|c| c.call_id.clone()).collect();
        Ok(BatchDecision {
            decisions: request
                .calls
                .iter()
                .map(|call| CallDecision {
                    call_id: call.call_id.clone(),
                    action: Action::Proceed as i32,
                    call: Some(call.clone()),
                    original: Some(call.clone()),
                    ..CallDecision::default()
                })
                .collect(),
            trace: self
                .links
                .iter()
                .zip(latencies)
                .map(|(link, latency_us)| GuardTrace {
                    guard: link.name.clone(),
                    role: GuardRole::Validate as i32,
                    status: TraceStatus::Proceeded as i32,
                    latency_us,
                    sent_call_ids: ids.clone(),
                    ..GuardTrace::default()
                })
                .collect(),
            execute: request.calls,
            chain_revision: 1,
            trace_id: String::new(),
            ..BatchDecision::default()
        })
    }
}

/// The relay behind `PreToolService`.
struct RelayService(Arc<Relay>);

#[tonic::async_trait]
impl PreToolService for RelayService {
    type EvaluateStream = ReceiverStream<Result<EvaluateResponse, Status>>;

    /// The relay judges nothing but batches.
    async fn always_skipped(
        &self,
        _request: Request<guardmesh_proto::v1::AlwaysSkippedRequest>,
    ) -> Result<Response<guardmesh_proto::v1::AlwaysSkippedResponse>, Status> {
        Err(Status::unimplemented(
            "the benchmark's relay answers batches only",
        ))
    }

    async fn evaluate(
        &self,
        request: Request<Streaming<EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStream>, Status> {
        let mut requests = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let relay = self.0.clone();
        // One task per stream; its batches are judged concurrently in it.
        tokio::spawn(async move {
            let mut judging = FuturesUnordered::new();
            loop {
                tokio::select! {
                    next = requests.message() => match next {
                        Ok(Some(batch)) => judging.push(relay.clone().relay(batch)),
                        Ok(None) | Err(_) => break,
                    },
                    Some(answer) = judging.next(), if !judging.is_empty() => {
                        if tx.send(Ok(answer)).await.is_err() {
                            return;
                        }
                    }
                }
            }
            while let Some(answer) = judging.next().await {
                if tx.send(Ok(answer)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn evaluate_batch(
        &self,
        _request: Request<EvaluateRequest>,
    ) -> Result<Response<BatchDecision>, Status> {
        Err(Status::unimplemented(
            "the relay floor answers only on Evaluate streams",
        ))
    }
}

/// Entry point of `guardmesh bench-relay`.
pub(super) fn main(args: RelayArgs, mesh_default_worker_threads: usize) -> ExitCode {
    let runtime = match args.worker_threads.unwrap_or(mesh_default_worker_threads) {
        0 | 1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    };
    super::run_child(runtime, serve(args))
}

async fn serve(args: RelayArgs) -> Result<(), Error> {
    let mut links = Vec::with_capacity(args.guards.len());
    for guard in &args.guards {
        let (name, url) = guard
            .split_once('=')
            .filter(|(name, url)| !name.is_empty() && !url.is_empty())
            .ok_or_else(|| format!("bad --guard {guard:?}: expected NAME=URL"))?;
        links.push(Link::open(name.to_owned(), url.to_owned()).await?);
    }
    let relay = Arc::new(Relay {
        links,
        next_request: AtomicU64::new(1),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(PreToolServiceServer::new(RelayService(relay)))
            .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)))
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "relay server stopped");
        }
    });
    {
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(format!("RELAY {port}\nREADY\n").as_bytes())?;
        stdout.flush()?;
    }
    super::until_released().await
}
