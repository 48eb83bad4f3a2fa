//! The guard side: write a guard as a trait impl and serve it (feature
//! `guard`).
//!
//! A [`Guard`] only says what it objects to. [`GuardServer`] turns it into
//! the `GuardService` the mesh streams batches to. Serve it alone, with gRPC
//! health and reflection, through [`serve`] (or [`GuardServer::serve_with`]
//! for TLS):
//!
//! ```no_run
//! use guardmesh_client::guard::{Guard, serve};
//! use guardmesh_client::proto::{GuardBatch, ToolCall, Verdict};
//! use guardmesh_client::verdict::steer;
//!
//! struct NoDeleteWithoutWhere;
//!
//! impl Guard for NoDeleteWithoutWhere {
//!     fn check(&self, call: &ToolCall, _batch: &GuardBatch) -> Option<Verdict> {
//!         let sql = call.arguments.to_ascii_uppercase();
//!         (sql.contains("DELETE") && !sql.contains("WHERE"))
//!             .then(|| steer(&call.call_id, "DELETE needs a WHERE clause; add one and retry."))
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! serve(NoDeleteWithoutWhere, listener, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! Or add it to a tonic server of your own, next to your other services, as
//! with `tonic-health`'s `HealthServer`:
//!
//! ```no_run
//! # use guardmesh_client::guard::Guard;
//! # struct NoDeleteWithoutWhere;
//! # impl Guard for NoDeleteWithoutWhere {}
//! use guardmesh_client::guard::GuardServer;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! tonic::transport::Server::builder()
//!     .add_service(GuardServer::new(NoDeleteWithoutWhere).into_service())
//!     .serve("127.0.0.1:7001".parse()?)
//!     .await?;
//! # Ok(()) }
//! ```

use crate::MAX_MESSAGE_BYTES;
use crate::proto::guard_service_server::{GuardService, GuardServiceServer};
use crate::proto::{GuardBatch, JudgeRequest, JudgeResponse, ToolCall, Verdict, judge_request};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// A guard. Implement [`Guard::check`] to judge call by call, or
/// [`Guard::judge`] to see the whole batch at once (and await I/O). Both
/// default to proceeding: a guard only says what it objects to.
pub trait Guard: Send + Sync + 'static {
    /// Whether the guard reads the batch's session memory
    /// (`GuardBatch.session`, R34). Registered through
    /// `GuardServer::registration`, a guard that says `true` is sent the
    /// memory with each batch; one that keeps the default `false` is sent
    /// none and pays nothing for it.
    const READS_SESSION: bool = false;

    /// Judges one call. `None` proceeds.
    fn check(&self, call: &ToolCall, batch: &GuardBatch) -> Option<Verdict> {
        let _ = (call, batch);
        None
    }

    /// Judges a batch: the calls this guard applies to (R9). Calls without a
    /// verdict proceed. An `Err` fails the request (the mesh applies the
    /// guard's failure policy, R13).
    fn judge(
        &self,
        batch: &GuardBatch,
    ) -> impl Future<Output = Result<Vec<Verdict>, Status>> + Send {
        let verdicts = batch
            .calls
            .iter()
            .filter_map(|call| self.check(call, batch))
            .collect();
        std::future::ready(Ok(verdicts))
    }
}

/// `GuardService` for any [`Guard`]: judges the batches of a stream
/// concurrently, answers each exactly once, and stops work on a batch the
/// mesh cancels.
///
/// Add [`GuardServer::into_service`] to your own tonic server, or run it
/// alone with [`GuardServer::serve`].
#[derive(Debug)]
pub struct GuardServer<G> {
    guard: Arc<G>,
}

impl<G> Clone for GuardServer<G> {
    fn clone(&self) -> Self {
        Self {
            guard: self.guard.clone(),
        }
    }
}

impl<G: Guard> GuardServer<G> {
    /// Serves `guard`.
    pub fn new(guard: G) -> Self {
        Self {
            guard: Arc::new(guard),
        }
    }

    /// The registration of this guard as a validate guard named `name` at
    /// `endpoint`, asking for session memory when the guard reads it
    /// ([`Guard::READS_SESSION`], R34). Chain more options on it
    /// ([`crate::Registration`]) before sending it. (Feature `coordinator`.)
    #[cfg(feature = "coordinator")]
    pub fn registration(
        &self,
        name: impl Into<String>,
        endpoint: impl Into<String>,
    ) -> crate::Registration {
        let registration = crate::Registration::validate(name, endpoint);
        if G::READS_SESSION {
            registration.reads_session_memory()
        } else {
            registration.without_session_memory()
        }
    }

    /// Serves a guard the caller keeps a handle to (to inspect its state).
    pub fn from_arc(guard: Arc<G>) -> Self {
        Self { guard }
    }

    /// The tonic service, with the SDK's message limits
    /// ([`MAX_MESSAGE_BYTES`] both ways), for `Server::add_service`.
    pub fn into_service(self) -> GuardServiceServer<Self> {
        GuardServiceServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Serves the guard alone on `listener` until `shutdown` completes, with
    /// gRPC health (`grpc.health.v1`) and server reflection.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        self.serve_with(listener, None, shutdown).await
    }

    /// [`GuardServer::serve`] with optional TLS (for `https://`
    /// registrations).
    pub async fn serve_with(
        self,
        listener: TcpListener,
        tls: Option<ServerTls>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<GuardServiceServer<Self>>().await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(guardmesh_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        #[allow(unused_mut)]
        let mut builder = tonic::transport::Server::builder().tcp_nodelay(true);
        if let Some(tls) = tls {
            #[cfg(feature = "tls")]
            {
                use tonic::transport::{Certificate, Identity, ServerTlsConfig};
                let mut config =
                    ServerTlsConfig::new().identity(Identity::from_pem(tls.cert_pem, tls.key_pem));
                if let Some(ca) = tls.client_ca_pem {
                    config = config.client_ca_root(Certificate::from_pem(ca));
                }
                builder = builder.tls_config(config)?;
            }
            #[cfg(not(feature = "tls"))]
            {
                let _ = tls;
                return Err(ServeError::NoTls);
            }
        }
        builder
            .add_service(health_service)
            .add_service(reflection)
            .add_service(self.into_service())
            // `Server::tcp_nodelay` does not apply to an incoming stream: set
            // it here, or Nagle's algorithm stalls answers by the delayed-ACK
            // time.
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                shutdown,
            )
            .await?;
        Ok(())
    }
}

/// Why a guard could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The transport failed: bad TLS settings, or the listener failed.
    #[error("cannot serve the guard: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The reflection service could not be built.
    #[error("cannot build gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// TLS was asked for, but the SDK was built without the `tls` feature.
    #[error("TLS requested but the SDK was built without the `tls` feature")]
    NoTls,
}

#[tonic::async_trait]
impl<G: Guard> GuardService for GuardServer<G> {
    type JudgeStream = ReceiverStream<Result<JudgeResponse, Status>>;

    async fn judge(
        &self,
        request: Request<Streaming<JudgeRequest>>,
    ) -> Result<Response<Self::JudgeStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(256);
        let guard = self.guard.clone();
        tokio::spawn(async move {
            let running: Arc<Mutex<HashMap<u64, tokio::task::AbortHandle>>> = Arc::default();
            loop {
                let message = tokio::select! {
                    message = inbound.message() => message,
                    () = tx.closed() => break,
                };
                match message {
                    Ok(Some(JudgeRequest {
                        kind: Some(judge_request::Kind::Batch(batch)),
                    })) => {
                        let id = batch.request_id;
                        let guard = guard.clone();
                        let tx = tx.clone();
                        let done = running.clone();
                        let span = tracing::debug_span!(
                            "guard.judge",
                            guard = %batch.guard,
                            batch_id = %batch.batch_id,
                            // An int attribute, not a string.
                            calls = i64::try_from(batch.calls.len()).unwrap_or(i64::MAX),
                            otel.kind = "server",
                        );
                        #[cfg(feature = "otel")]
                        {
                            // R22: the guard's span joins the batch's trace.
                            use tracing_opentelemetry::OpenTelemetrySpanExt;
                            let _ = span.set_parent(crate::trace::parent_context(
                                &batch.traceparent,
                                &batch.tracestate,
                            ));
                        }
                        let task = tokio::spawn(tracing::Instrument::instrument(
                            async move {
                                let answer = match guard.judge(&batch).await {
                                    Ok(verdicts) => JudgeResponse {
                                        request_id: id,
                                        verdicts,
                                        partial: false,
                                        error: String::new(),
                                    },
                                    Err(status) => {
                                        // Fails this request only; the
                                        // stream and its other batches live.
                                        tracing::warn!(%status, "guard failed a batch");
                                        JudgeResponse {
                                            request_id: id,
                                            verdicts: Vec::new(),
                                            partial: false,
                                            error: format!(
                                                "{}: {}",
                                                status.code(),
                                                status.message()
                                            ),
                                        }
                                    }
                                };
                                done.lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .remove(&id);
                                let _ = tx.send(Ok(answer)).await;
                            },
                            span,
                        ));
                        running
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(id, task.abort_handle());
                    }
                    Ok(Some(JudgeRequest {
                        kind: Some(judge_request::Kind::Cancel(cancel)),
                    })) => {
                        let task = running
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .remove(&cancel.request_id);
                        if let Some(task) = task {
                            task.abort();
                        }
                    }
                    Ok(Some(JudgeRequest { kind: None })) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            for (_, task) in running
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .drain()
            {
                task.abort();
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Serves `guard` alone on `listener` until `shutdown` completes, with gRPC
/// health (`grpc.health.v1`) and server reflection: shorthand for
/// `GuardServer::new(guard).serve(listener, shutdown)`.
pub async fn serve<G: Guard>(
    guard: G,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    GuardServer::new(guard).serve(listener, shutdown).await
}

/// TLS for a guard's server (feature `tls`).
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The guard's certificate chain, PEM.
    pub cert_pem: String,
    /// The key of that certificate, PEM.
    pub key_pem: String,
    /// With it, the mesh must present a client certificate from this CA.
    pub client_ca_pem: Option<String>,
}

#[cfg(all(test, feature = "coordinator"))]
mod tests {
    use super::{Guard, GuardServer};
    use crate::proto::SessionMemoryUse;

    struct Plain;
    impl Guard for Plain {}

    struct Rate;
    impl Guard for Rate {
        const READS_SESSION: bool = true;
    }

    /// R34: a guard's registration asks for session memory exactly when
    /// its handler reads it; one that says nothing is sent none.
    #[test]
    fn r34_the_registration_asks_for_memory_when_the_guard_reads_it() {
        let plain = GuardServer::new(Plain)
            .registration("plain", "http://127.0.0.1:7001")
            .build();
        assert_eq!(plain.session_memory, SessionMemoryUse::None as i32);
        let rate = GuardServer::new(Rate)
            .registration("rate", "http://127.0.0.1:7002")
            .build();
        assert_eq!(rate.session_memory, SessionMemoryUse::Read as i32);
        assert_eq!(
            (rate.name.as_str(), rate.endpoint.as_str()),
            ("rate", "http://127.0.0.1:7002")
        );
    }
}
