//! The mesh's plain-HTTP side port (`metrics_listen`): the Prometheus
//! scrape endpoint and the probes of process supervisors.
//!
//! * `GET /metrics`: in the OpenMetrics text format when the `Accept`
//!   header prefers it (as Prometheus' own scrapes do), else the Prometheus
//!   text format 0.0.4.
//! * `GET /healthz`: `200 ok` while the process answers (a liveness probe).
//! * `GET /readyz`: `200 ready` when the mesh can judge batches, else `503`
//!   with one line per reason (a readiness probe): see [`Probes::not_ready`].
//!
//! The port is plain HTTP on purpose: kubelets and load balancers probe it
//! without the client certificate the gRPC listener may require.

use crate::observe::metrics::Metrics;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::net::TcpListener;

/// Most scrapes served at once; past it a new connection is closed at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Time a connection has to send its request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the decision log's directory check may take before `/readyz`
/// reports it as not answering (a hung network file system).
pub const LOG_CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest reason line `/readyz` writes (longer ones are cut).
const MAX_REASON_CHARS: usize = 300;

/// What `/healthz` and `/readyz` report. `guardmesh serve` creates it
/// before anything else, serves it at once (so probes answer while the
/// registry is still loading), and fills it in as it starts and stops:
/// [`Probes::set_mesh`] once the mesh is built (registry loaded, decision
/// log open), [`Probes::set_listening`] once the gRPC listener accepts,
/// [`Probes::set_draining`] when a shutdown signal arrives.
/// What `/readyz` asks of a built mesh (the mesh implements it; telemetry
/// imports nothing above it).
pub trait Readiness: Send + Sync {
    /// The mesh's metrics, served at `/metrics`.
    fn metrics(&self) -> Arc<Metrics>;
    /// Why the registry refuses to judge now, if it does.
    fn registry_refusal(&self) -> Option<String>;
    /// How long the registry has gone unconfirmed by its store, if it has.
    fn registry_staleness(&self) -> Option<Duration>;
    /// The decision log's directory, when a decision log is configured.
    fn decision_log_dir(&self) -> Option<std::path::PathBuf>;
}

#[derive(Default)]
pub struct Probes {
    metrics: OnceLock<Arc<Metrics>>,
    mesh: OnceLock<Arc<dyn Readiness>>,
    /// Made by [`spawn`]: metrics alone, nothing to judge readiness by.
    metrics_only: bool,
    listening: AtomicBool,
    draining: AtomicBool,
    /// A decision-log directory check is running (on a blocking thread):
    /// at most one at a time, however many probes arrive while a file
    /// system hangs.
    checking_log: Arc<AtomicBool>,
}

impl std::fmt::Debug for Probes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probes")
            .field("mesh", &self.mesh.get().is_some())
            .field("listening", &self.listening.load(Ordering::Relaxed))
            .field("draining", &self.draining.load(Ordering::Relaxed))
            .finish()
    }
}

impl Probes {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The mesh is built: its registry loaded (with etcd, the chain listed
    /// from the quorum) and its decision log open. Serves its metrics from
    /// now on. A second call is ignored.
    pub fn set_mesh(&self, mesh: Arc<dyn Readiness>) {
        let _ = self.metrics.set(mesh.metrics());
        let _ = self.mesh.set(mesh);
    }

    /// Whether the gRPC listener accepts connections.
    pub fn listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// The gRPC listener accepts connections.
    pub fn set_listening(&self) {
        self.listening.store(true, Ordering::SeqCst);
    }

    /// A shutdown began: `/readyz` answers 503 from now on, so load
    /// balancers stop sending new coordinators while in-flight batches are
    /// answered.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether a shutdown began.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Why the mesh cannot take batches now; empty when it can. In order:
    /// draining; the registry not loaded yet (start-up, e.g. etcd not
    /// reached yet); the gRPC listener not up; the registry refusing to
    /// judge (with etcd: the chain not confirmed by etcd's quorum within
    /// `staleness_window_ms`, unless `after_window = "serve_stale"`, or a
    /// stored registration unreadable); the decision log's directory not
    /// writable (when `[decision_log]` is configured).
    pub async fn not_ready(&self) -> Vec<String> {
        let mut reasons = Vec::new();
        if self.metrics_only {
            reasons.push("unknown: this endpoint serves metrics only".to_owned());
            return reasons;
        }
        if self.draining() {
            reasons.push("draining: the mesh is shutting down".to_owned());
        }
        let Some(mesh) = self.mesh.get() else {
            reasons.push("starting: the registry is not loaded yet".to_owned());
            return reasons;
        };
        if !self.listening.load(Ordering::SeqCst) {
            reasons.push("starting: the gRPC listener is not up yet".to_owned());
        }
        if let Some(error) = mesh.registry_refusal() {
            reasons.push(format!("registry: {error}"));
        }
        if let Some(dir) = mesh.decision_log_dir() {
            if self.checking_log.swap(true, Ordering::SeqCst) {
                reasons
                    .push("decision log: the previous directory check has not finished".to_owned());
                return clean(reasons);
            }
            let checking = self.checking_log.clone();
            let check = tokio::task::spawn_blocking(move || {
                let result = writable(&dir).map_err(|e| (dir, e));
                checking.store(false, Ordering::SeqCst);
                result
            });
            match tokio::time::timeout(LOG_CHECK_TIMEOUT, check).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err((dir, error)))) => reasons.push(format!(
                    "decision log: directory {} is not writable: {error}",
                    dir.display()
                )),
                Ok(Err(_)) => reasons.push("decision log: the directory check failed".to_owned()),
                Err(_) => reasons.push(format!(
                    "decision log: the directory check did not finish within {}ms",
                    LOG_CHECK_TIMEOUT.as_millis()
                )),
            }
        }
        clean(reasons)
    }

    /// A note for a ready mesh whose registry has gone unconfirmed for a
    /// while but may still judge (within the staleness window, or
    /// `serve_stale`).
    fn note(&self) -> Option<String> {
        let stale = self.mesh.get()?.registry_staleness()?;
        Some(format!(
            "registry: unconfirmed by its store for {}ms",
            stale.as_millis()
        ))
    }
}

/// Each reason on one line, whatever an error message holds, and cut at
/// [`MAX_REASON_CHARS`].
fn clean(mut reasons: Vec<String>) -> Vec<String> {
    for reason in &mut reasons {
        if reason.chars().count() > MAX_REASON_CHARS {
            *reason = reason.chars().take(MAX_REASON_CHARS).collect::<String>() + "...";
        }
        *reason = reason.replace(['\r', '\n'], " ");
    }
    reasons
}

/// Whether the process may create files in `dir` (write and search
/// permission, a file system mounted read-write).
fn writable(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("the path holds a NUL byte"))?;
    // SAFETY: `path` is a valid NUL-terminated string that outlives the call.
    let result = unsafe { libc::access(path.as_ptr(), libc::W_OK | libc::X_OK) };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Binds `addr` and serves `metrics` at `/metrics` in the background;
/// `/healthz` answers, `/readyz` answers 503 (nothing to judge readiness
/// by: see [`spawn_with_probes`]). Returns the bound address (useful with
/// port 0).
pub async fn spawn(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    let probes = Probes {
        metrics: OnceLock::from(metrics),
        metrics_only: true,
        ..Probes::default()
    };
    spawn_with_probes(addr, Arc::new(probes)).await
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` in the
/// background. Returns the bound address (useful with port 0).
///
/// Against silent and hostile clients (R25): one request per connection
/// (no keep-alive), a request head that does not arrive within
/// [`REQUEST_TIMEOUT`] closes the connection, at most [`MAX_CONNECTIONS`]
/// at once, and failed accepts (such as at the open-file limit) back off
/// instead of spinning.
pub async fn spawn_with_probes(
    addr: SocketAddr,
    probes: Arc<Probes>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "metrics endpoint serving /metrics, /healthz and /readyz");
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
            let probes = probes.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let service =
                    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let probes = probes.clone();
                        async move {
                            Ok::<_, std::convert::Infallible>(respond(&request, &probes).await)
                        }
                    });
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

/// Plain text for the probes and errors.
const TEXT: &str = "text/plain; charset=utf-8";

async fn respond(
    request: &Request<hyper::body::Incoming>,
    probes: &Probes,
) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match request.uri().path() {
        "/metrics" => match probes.metrics.get() {
            Some(m) => metrics(request, m),
            None => (
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                "starting: no metrics before the registry is loaded\n".to_owned(),
            ),
        },
        "/healthz" => (StatusCode::OK, TEXT, "ok\n".to_owned()),
        "/readyz" => {
            let reasons = probes.not_ready().await;
            if reasons.is_empty() {
                let mut body = "ready\n".to_owned();
                if let Some(note) = probes.note() {
                    body.push_str(&note);
                    body.push('\n');
                }
                (StatusCode::OK, TEXT, body)
            } else {
                let mut body = "not ready\n".to_owned();
                for reason in reasons {
                    body.push_str(&reason);
                    body.push('\n');
                }
                (StatusCode::SERVICE_UNAVAILABLE, TEXT, body)
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            TEXT,
            "not found: this port serves /metrics, /healthz and /readyz\n".to_owned(),
        ),
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

fn metrics(
    request: &Request<hyper::body::Incoming>,
    metrics: &Metrics,
) -> (StatusCode, &'static str, String) {
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
}

#[cfg(test)]
mod tests {
    use super::{MAX_REASON_CHARS, clean, prefers_openmetrics, writable};

    #[test]
    fn the_log_directory_check_names_a_missing_directory() {
        let dir = std::env::temp_dir().join(format!("guardmesh-writable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(writable(&dir).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
        let error = writable(&dir).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::NotFound, "{error}");
    }

    #[test]
    fn readyz_reasons_are_single_bounded_lines() {
        let long = "x".repeat(10_000);
        let reasons = clean(vec!["registry: a\r\nb".to_owned(), long]);
        assert_eq!(reasons[0], "registry: a  b");
        assert_eq!(reasons[1].chars().count(), MAX_REASON_CHARS + 3);
    }

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
