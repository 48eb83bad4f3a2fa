//! The Prometheus scrape endpoint: `GET /metrics` over plain HTTP/1.1.

use crate::observe::metrics::Metrics;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Most scrapes served at once; past it a new connection is closed at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Time a connection has to send its request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds `addr` and serves `/metrics` in the background. Returns the bound
/// address (useful with port 0).
///
/// Against silent and hostile clients (R25): one request per connection
/// (no keep-alive), a request head that does not arrive within
/// [`REQUEST_TIMEOUT`] closes the connection, at most [`MAX_CONNECTIONS`]
/// at once, and failed accepts (such as at the open-file limit) back off
/// instead of spinning.
pub async fn spawn(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "metrics endpoint serving /metrics");
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        let mut backoff = crate::security::tls::AcceptBackoff::new("metrics");
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => {
                    backoff.succeeded();
                    stream
                }
                Err(error) => {
                    backoff.failed(&error).await;
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                drop(stream);
                continue;
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let service = hyper::service::service_fn(
                    move |request: Request<hyper::body::Incoming>| {
                        let metrics = metrics.clone();
                        async move { Ok::<_, std::convert::Infallible>(respond(&request, &metrics)) }
                    },
                );
                let serve = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(REQUEST_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(stream), service);
                // A whole exchange is bounded too (a client that never reads
                // its answer).
                let _ = tokio::time::timeout(REQUEST_TIMEOUT * 3, serve).await;
            });
        }
    });
    Ok(bound)
}

fn respond(request: &Request<hyper::body::Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if request.uri().path() == "/metrics" {
        (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        )
    } else {
        (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".to_owned(),
        )
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}
