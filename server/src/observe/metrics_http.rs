//! The Prometheus scrape endpoint: `GET /metrics` over plain HTTP/1.1, in
//! the OpenMetrics text format when the `Accept` header prefers it (as
//! Prometheus' own scrapes do), else the Prometheus text format 0.0.4.

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
        let mut backoff = crate::accept::AcceptBackoff::new("metrics");
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

/// The OpenMetrics content type.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The Prometheus text format's content type.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header prefers OpenMetrics to plain text: it names
/// `application/openmetrics-text` with a quality above 0 and at least that
/// of any text type it names.
pub fn prefers_openmetrics(accept: &str) -> bool {
    let mut openmetrics: f32 = 0.0;
    let mut text: f32 = 0.0;
    for item in accept.split(',') {
        let mut parts = item.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default().to_ascii_lowercase();
        let quality = parts
            .find_map(|p| p.strip_prefix("q="))
            .and_then(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(quality),
            "text/plain" | "text/*" | "*/*" => text = text.max(quality),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

fn respond(request: &Request<hyper::body::Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if request.uri().path() == "/metrics" {
        let accept = request
            .headers()
            .get(hyper::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if prefers_openmetrics(accept) {
            (StatusCode::OK, OPENMETRICS, metrics.encode())
        } else {
            (StatusCode::OK, PROMETHEUS_TEXT, metrics.encode_prometheus())
        }
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

#[cfg(test)]
mod tests {
    use super::prefers_openmetrics;

    #[test]
    fn the_accept_header_chooses_the_format() {
        // What Prometheus sends.
        assert!(prefers_openmetrics(
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,\
             application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        ));
        assert!(prefers_openmetrics("application/openmetrics-text"));
        assert!(!prefers_openmetrics(""));
        assert!(!prefers_openmetrics("*/*"));
        assert!(!prefers_openmetrics("text/plain;version=0.0.4"));
        assert!(!prefers_openmetrics(
            "application/openmetrics-text;q=0.2, text/plain;q=0.9"
        ));
        assert!(!prefers_openmetrics("application/openmetrics-text;q=0"));
    }
}
