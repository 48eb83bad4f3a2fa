//! What a guard link needs from a connection to its guard, behind a trait.
//!
//! A [`GuardLink`](super::GuardLink) owns the life of one guard's stream
//! (queue, routing by request id, failures, backoff, circuit); a
//! [`GuardTransport`] only opens a stream: it takes the requests the link
//! queues, and gives back the guard's answers until the stream ends. The
//! mesh's transport is [`GrpcTransport`]: a `GuardService/Judge` call over
//! the mesh's own connector (endpoint policy, TLS, dead-peer detection).
//! Unit tests put an in-memory guard behind the same trait
//! ([`super::scripted`]) and run the link and the judging above it in
//! paused time.

use super::health::Health;
use super::wire::{self, Encoded};
use super::{LinkConfig, error_chain};
use crate::observe::metrics::Metrics;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;

/// The requests of one stream, as the stream takes them. A request taken
/// off this stream counts as read by the guard (R25).
pub type Requests = std::pin::Pin<Box<dyn futures::Stream<Item = Encoded> + Send>>;

/// The answers of one stream: each answer read (and walked for unknown
/// verdict fields, R23), or the error that ends the stream. The stream's
/// end (`None`) is the guard closing its stream.
pub type Answers =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<wire::Answer, tonic::Status>> + Send>>;

/// Why no stream was opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The endpoint cannot be dialed at all.
    #[error("bad endpoint {endpoint}: {reason}")]
    BadEndpoint { endpoint: String, reason: String },
    /// No connection: refused, unresolvable, outside the endpoint policy,
    /// a failed handshake, a connect timeout.
    #[error("{endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    /// Connected, but the guard refused the `Judge` stream.
    #[error("Judge stream refused: {0}")]
    Refused(tonic::Status),
}

/// A `Judge` stream being opened: the guard's answers, or why it could
/// not be opened.
pub type Opening<'a> = BoxFuture<'a, Result<Answers, OpenError>>;

/// How a guard link reaches its guard: opens one `Judge` stream.
pub trait GuardTransport: Send + Sync + std::fmt::Debug + 'static {
    /// Opens a stream to the guard at `url` that writes `requests`
    /// (the first may already be queued: some gRPC stacks send no response
    /// headers until they answer) and yields the guard's answers.
    fn open<'a>(&'a self, url: &'a str, config: &'a LinkConfig, requests: Requests) -> Opening<'a>;
}

/// The mesh's transport: a `GuardService/Judge` call on a tonic channel
/// dialed with the guard's connector, with the kernel's dead-peer
/// detection on its socket.
#[derive(Clone)]
pub struct GrpcTransport {
    connector: DeadPeerConnector,
    /// Where each stream's health watch writes the replica's status.
    health: Arc<Health>,
    /// Named in the health watch's logs and metrics.
    guard: Arc<str>,
    /// Where the health watch reports a replica draining, and the dial a
    /// refused certificate (R32); none in tests that only dial.
    metrics: Option<Arc<Metrics>>,
}

impl std::fmt::Debug for GrpcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcTransport")
            .field("pin", &self.connector.inner.pin)
            .field("https", &self.connector.inner.https)
            .finish()
    }
}

impl GrpcTransport {
    /// Dials with `connector`; a connection whose peer is gone is closed
    /// within about `dead_peer_timeout` (zero: never).
    pub fn new(connector: super::dial::GuardConnector, dead_peer_timeout: Duration) -> Self {
        Self {
            connector: DeadPeerConnector {
                inner: connector,
                timeout: dead_peer_timeout,
            },
            health: Arc::default(),
            guard: Arc::from(""),
            metrics: None,
        }
    }

    /// Watches the guard service's health on each stream's connection for
    /// `guard`, into `health` (see [`super::health`]), and reports the
    /// replica's draining and refused certificates to `metrics`.
    pub fn with_health(mut self, guard: &str, health: Arc<Health>, metrics: Arc<Metrics>) -> Self {
        self.guard = Arc::from(guard);
        self.health = health;
        self.metrics = Some(metrics);
        self
    }
}

impl GuardTransport for GrpcTransport {
    fn open<'a>(&'a self, url: &'a str, config: &'a LinkConfig, requests: Requests) -> Opening<'a> {
        Box::pin(async move {
            // The connector resolves, applies the endpoint policy, connects
            // and speaks TLS for https:// guards (see dial.rs).
            let dial = match url.strip_prefix("https://") {
                Some(rest) => format!("http://{rest}"),
                None => url.to_owned(),
            };
            let mut dial = tonic::transport::Endpoint::from_shared(dial)
                .map_err(|error| OpenError::BadEndpoint {
                    endpoint: url.to_owned(),
                    reason: error.to_string(),
                })?
                .connect_timeout(config.connect_timeout);
            // R26: HTTP/2 PINGs only as often as default gRPC servers accept
            // (hyper pings after `keepalive_interval` without a frame from
            // the guard, so a busy link never pings). A vanished peer is
            // found sooner by the kernel's TCP probes (DeadPeerConnector).
            if !config.keepalive_interval.is_zero() {
                dial = dial
                    .http2_keep_alive_interval(config.keepalive_interval)
                    .keep_alive_timeout(config.keepalive_timeout)
                    .keep_alive_while_idle(true);
            }
            let channel = dial
                .connect_with_connector(self.connector.clone())
                .await
                .map_err(|error| {
                    if let (true, Some(metrics)) = (
                        super::dial::CertificateRefused::in_chain(&error),
                        &self.metrics,
                    ) {
                        metrics.replica_certificate_refused(&self.guard, url);
                    }
                    OpenError::Unreachable {
                        endpoint: url.to_owned(),
                        reason: error_chain(&error),
                    }
                })?;
            // R32: the replica's health rides on the same connection, and
            // ends with the stream (its task is aborted when the answers
            // are dropped).
            let watch = tokio::spawn(super::health::watch(
                channel.clone(),
                self.health.clone(),
                self.guard.clone(),
                Arc::from(url),
                self.metrics.clone(),
            ))
            .abort_handle();
            let watch = AbortOnDrop(watch);
            let answers = judge(channel, config, requests)
                .await
                .map_err(OpenError::Refused)?
                .into_inner();
            Ok(Box::pin(WithWatch {
                answers: Box::pin(answers),
                _watch: watch,
            }) as Answers)
        })
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A stream's answers, holding its health watch for as long as they last.
struct WithWatch {
    answers: Answers,
    _watch: AbortOnDrop,
}

impl futures::Stream for WithWatch {
    type Item = Result<wire::Answer, tonic::Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.answers.as_mut().poll_next(cx)
    }
}

/// Opens the `Judge` stream. Like the generated client's `judge`, but its
/// answers are read with [`wire::JudgeCodec`], which finds the verdict fields
/// this mesh does not know (R23) before prost drops them.
async fn judge(
    channel: tonic::transport::Channel,
    config: &LinkConfig,
    requests: Requests,
) -> Result<tonic::Response<tonic::Streaming<wire::Answer>>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(config.max_decoding_message_size)
        .max_encoding_message_size(config.max_encoding_message_size);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("guard channel not ready: {e}")))?;
    let mut request = tonic::Request::new(requests);
    request
        .extensions_mut()
        .insert(tonic::GrpcMethod::new("guardmesh.v1.GuardService", "Judge"));
    grpc.streaming(
        request,
        http::uri::PathAndQuery::from_static("/guardmesh.v1.GuardService/Judge"),
        wire::JudgeCodec,
    )
    .await
}

/// The guard connector, with the kernel's dead-peer detection on each new
/// socket: TCP keepalive probes after half of `timeout` idle, and
/// `TCP_USER_TIMEOUT` for data the peer never acknowledges. Unlike HTTP/2
/// PINGs, these are invisible to the guard's gRPC ping policy (R26).
#[derive(Clone)]
pub(super) struct DeadPeerConnector {
    pub(super) inner: super::dial::GuardConnector,
    pub(super) timeout: Duration,
}

impl tower::Service<http::Uri> for DeadPeerConnector {
    type Response = hyper_util::rt::TokioIo<super::dial::GuardIo>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let timeout = self.timeout;
        Box::pin(async move {
            let io = connecting.await?;
            if !timeout.is_zero() {
                let tcp = match io.inner() {
                    super::dial::GuardIo::Plain(tcp) => tcp,
                    super::dial::GuardIo::Tls(tls) => tls.get_ref().0,
                };
                if let Err(error) = detect_dead_peer(tcp, timeout) {
                    tracing::debug!(%error, "cannot set TCP keepalive on a guard connection");
                }
            }
            Ok(io)
        })
    }
}

/// Sets TCP keepalive (idle `timeout / 2`, then 3 probes over the other
/// half) and, on Linux, `TCP_USER_TIMEOUT` = `timeout` on `tcp`.
fn detect_dead_peer(tcp: &tokio::net::TcpStream, timeout: Duration) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(tcp);
    let idle = (timeout / 2).max(Duration::from_secs(1));
    let interval = (timeout / 6).max(Duration::from_secs(1));
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval(interval)
            .with_retries(3),
    )?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    socket.set_tcp_user_timeout(Some(timeout))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn r26_guard_sockets_get_tcp_keepalive_and_a_user_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.map(|(s, _)| s) });
        let mut connector = DeadPeerConnector {
            inner: crate::link::dial::GuardConnector {
                policy: Arc::new(crate::link::dial::EndpointPolicy::default()),
                tls: None,
                pin: None,
                https: false,
                connect_timeout: Duration::from_secs(2),
            },
            timeout: Duration::from_secs(30),
        };
        let uri: http::Uri = format!("http://{addr}").parse().unwrap();
        let io = tower::Service::call(&mut connector, uri).await.unwrap();
        let _peer = accept.await.unwrap().unwrap();
        let crate::link::dial::GuardIo::Plain(tcp) = io.inner() else {
            panic!("plaintext guard");
        };
        let socket = socket2::SockRef::from(tcp);
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            Duration::from_secs(15)
        );
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
        #[cfg(target_os = "linux")]
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(30))
        );
    }
}
