//! The OTLP trace exporter: the protocol the standard variables ask for,
//! OTLP/HTTP on the mesh's own runtime, and export failures logged
//! (rate-limited) and counted.
//!
//! * `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`:
//!   `grpc` (the default, port 4317) or `http/protobuf` (port 4318, the
//!   endpoint's `/v1/traces`). Any other value refuses to start with a
//!   message naming the variable and the accepted values: a protocol is
//!   never silently replaced by another.
//! * OTLP/HTTP runs on the tokio runtime that called [`super::telemetry::init`]
//!   (plain `http://` endpoints; `https://` is refused at start).
//! * Every failed export is counted in
//!   `guardmesh_otlp_export_failures_total{signal}` and logged at most once
//!   a minute, with the number of failures since the last line.

use http_body_util::{BodyExt, Full, Limited};
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// The trace protocol variables, most specific first.
pub const PROTOCOL_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];

/// The OTLP transports the mesh exports spans over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/gRPC (`grpc`).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (`http/protobuf`).
    HttpProtobuf,
}

/// A protocol variable set to a value the mesh does not export with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not supported: accepted values are \"grpc\" and \"http/protobuf\"")]
pub struct UnsupportedProtocol {
    pub var: &'static str,
    pub value: String,
}

/// The log protocol variables (the decision log's export), most specific
/// first.
pub const LOGS_PROTOCOL_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];

/// The protocol `lookup` (an environment) asks for: the signal's variable
/// first, then the general one; `grpc` when neither is set.
pub fn protocol_from(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Protocol, UnsupportedProtocol> {
    signal_protocol_from(PROTOCOL_VARS, lookup)
}

/// [`protocol_from`] for the signal whose variables are `vars`.
pub fn signal_protocol_from(
    vars: [&'static str; 2],
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Protocol, UnsupportedProtocol> {
    for var in vars {
        let Some(value) = lookup(var) else { continue };
        return match value.trim() {
            "" => continue,
            "grpc" => Ok(Protocol::Grpc),
            "http/protobuf" => Ok(Protocol::HttpProtobuf),
            _ => Err(UnsupportedProtocol { var, value }),
        };
    }
    Ok(Protocol::Grpc)
}

/// The protocol the process environment asks for.
pub fn protocol() -> Result<Protocol, UnsupportedProtocol> {
    protocol_from(|var| std::env::var(var).ok())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SignalLabel {
    pub(crate) signal: &'static str,
}

/// Failed exports by signal, for the whole process (one exporter serves
/// every mesh in it).
pub(crate) static EXPORT_FAILURES: LazyLock<Family<SignalLabel, Counter>> = LazyLock::new(|| {
    let family = Family::<SignalLabel, Counter>::default();
    let _ = family.get_or_create(&SignalLabel { signal: "traces" });
    let _ = family.get_or_create(&SignalLabel { signal: "logs" });
    family
});

/// How often a failing exporter is logged.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// When the last failure was logged, and the failures since then.
static LOGGED: Mutex<(Option<Instant>, u64)> = Mutex::new((None, 0));

/// An export of `signal` failed: counted always, logged at most once a
/// [`LOG_EVERY`].
pub fn export_failed(signal: &'static str, error: &dyn std::fmt::Display) {
    EXPORT_FAILURES.get_or_create(&SignalLabel { signal }).inc();
    let mut logged = match LOGGED.lock() {
        Ok(logged) => logged,
        Err(poisoned) => poisoned.into_inner(),
    };
    logged.1 += 1;
    let now = Instant::now();
    if logged
        .0
        .is_none_or(|at| now.duration_since(at) >= LOG_EVERY)
    {
        let failures = std::mem::take(&mut logged.1);
        logged.0 = Some(now);
        drop(logged);
        tracing::warn!(
            signal,
            failures,
            "OTLP export failed ({failures} failure(s) since the last report; next report in at most {}s): {error}",
            LOG_EVERY.as_secs()
        );
    }
}

/// `result` of an export of `signal`, a failure counted and logged.
fn counted(signal: &'static str, result: OTelSdkResult) -> OTelSdkResult {
    if let Err(error) = &result {
        export_failed(signal, error);
    }
    result
}

/// A span exporter whose failures are counted and logged.
#[derive(Debug)]
pub(crate) struct Counted<E>(pub(crate) E);

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        counted("traces", self.0.export(batch).await)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.0.set_resource(resource);
    }
}

/// A log exporter whose failures are counted and logged (signal `logs`).
#[derive(Debug)]
pub(crate) struct CountedLogs<E>(pub(crate) E);

impl<E: opentelemetry_sdk::logs::LogExporter> opentelemetry_sdk::logs::LogExporter
    for CountedLogs<E>
{
    async fn export(&self, batch: opentelemetry_sdk::logs::LogBatch<'_>) -> OTelSdkResult {
        counted("logs", self.0.export(batch).await)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.0.set_resource(resource);
    }
}

/// The per-export timeout the standard variables set for the signal whose
/// timeout variable is `signal_var`, else the specification's 10 s.
pub(crate) fn export_timeout(signal_var: &str) -> Duration {
    [signal_var, "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .iter()
        .find_map(|var| std::env::var(var).ok()?.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(10), Duration::from_millis)
}

/// Whether `name` is set to something other than white space.
pub(crate) fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// The resource every exporter of the mesh sends: `service.name` is
/// `guardmesh` unless `OTEL_SERVICE_NAME` names another.
pub(crate) fn resource() -> opentelemetry_sdk::Resource {
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !env_set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("guardmesh");
    }
    resource.build()
}

/// The variable, and its value (`lookup` reads variables), that points the
/// OTLP/HTTP exporter of the signal whose endpoint variable is `signal_var`
/// at an `https://` endpoint, which that exporter refuses (it speaks plain
/// HTTP only).
pub(crate) fn https_endpoint(
    signal_var: &'static str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Option<(&'static str, String)> {
    [signal_var, "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .find_map(|var| {
            let endpoint = lookup(var)?;
            endpoint
                .trim()
                .starts_with("https://")
                .then_some((var, endpoint))
        })
}

/// Why the OTLP/HTTP client of a signal cannot be made.
#[derive(Debug)]
pub(crate) enum HttpClientError {
    /// `var` points the exporter at an `https://` endpoint.
    Https { var: &'static str, endpoint: String },
    /// Not called on a tokio runtime.
    NoRuntime(tokio::runtime::TryCurrentError),
}

/// The variables that name one signal's endpoint and its export timeout.
pub(crate) struct Signal {
    pub(crate) endpoint_var: &'static str,
    pub(crate) timeout_var: &'static str,
}

/// Spans.
pub(crate) const TRACES: Signal = Signal {
    endpoint_var: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    timeout_var: "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
};

/// Log records (the decision log's export).
pub(crate) const LOGS: Signal = Signal {
    endpoint_var: "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
    timeout_var: "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT",
};

/// An OTLP/HTTP exporter's `builder` of `signal`, set to http/protobuf
/// through a client on the calling tokio runtime with the signal's export
/// timeout. An `https://` endpoint is refused (see [`https_endpoint`]).
pub(crate) fn over_http<B>(builder: B, signal: &Signal) -> Result<B, HttpClientError>
where
    B: opentelemetry_otlp::WithExportConfig + opentelemetry_otlp::WithHttpConfig,
{
    if let Some((var, endpoint)) =
        https_endpoint(signal.endpoint_var, |var| std::env::var(var).ok())
    {
        return Err(HttpClientError::Https { var, endpoint });
    }
    let client = RuntimeHttpClient {
        runtime: tokio::runtime::Handle::try_current().map_err(HttpClientError::NoRuntime)?,
        timeout: export_timeout(signal.timeout_var),
    };
    Ok(builder
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_http_client(client))
}

/// Largest collector answer read.
const MAX_RESPONSE: usize = 1 << 20;

/// An HTTP/1.1 client for OTLP/HTTP whose requests run on a tokio runtime,
/// whichever thread (the SDK's export thread) sends them: one connection
/// per export, bounded by `timeout`.
#[derive(Debug)]
pub(crate) struct RuntimeHttpClient {
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
enum PostError {
    #[error("the OTLP/HTTP endpoint {0:?} has no host")]
    NoHost(String),
    #[error("OTLP/HTTP to {0:?}: only http:// endpoints are supported")]
    Scheme(String),
    #[error("OTLP/HTTP export timed out after {0:?}")]
    TimedOut(Duration),
    #[error("OTLP/HTTP export task ended: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl RuntimeHttpClient {
    async fn post(request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let uri = request.uri().clone();
        if uri.scheme_str() != Some("http") {
            return Err(PostError::Scheme(uri.to_string()).into());
        }
        let host = uri
            .host()
            .ok_or_else(|| PostError::NoHost(uri.to_string()))?;
        let port = uri.port_u16().unwrap_or(80);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let stream = tokio::net::TcpStream::connect((host, port)).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let (mut parts, body) = request.into_parts();
        if !parts.headers.contains_key(hyper::header::HOST)
            && let Some(authority) = uri.authority()
            && let Ok(value) = authority.as_str().parse()
        {
            parts.headers.insert(hyper::header::HOST, value);
        }
        // The request line names the path (origin form), not the whole URL.
        parts.uri = uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .unwrap_or_default();
        let response = sender
            .send_request(hyper::Request::from_parts(parts, Full::new(body)))
            .await?;
        let (parts, body) = response.into_parts();
        let body = Limited::new(body, MAX_RESPONSE).collect().await?.to_bytes();
        Ok(Response::from_parts(parts, body))
    }
}

#[tonic::async_trait]
impl HttpClient for RuntimeHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let timeout = self.timeout;
        let task = self.runtime.spawn(async move {
            tokio::time::timeout(timeout, Self::post(request))
                .await
                .unwrap_or_else(|_| Err(PostError::TimedOut(timeout).into()))
        });
        task.await.map_err(PostError::from)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |var| pairs.iter().find(|(k, _)| k == var).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_log_export_reads_its_own_protocol_variable_first() {
        let logs = |pairs: &[(&str, &str)]| signal_protocol_from(LOGS_PROTOCOL_VARS, env(pairs));
        assert_eq!(logs(&[]), Ok(Protocol::Grpc));
        assert_eq!(
            logs(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]),
            Ok(Protocol::HttpProtobuf)
        );
        assert_eq!(
            logs(&[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift"),
            ]),
            Ok(Protocol::Grpc)
        );
        let error = logs(&[("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/json")]).unwrap_err();
        assert_eq!(error.var, "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL");
    }

    #[test]
    fn protocol_is_grpc_unless_asked_and_the_signal_variable_wins() {
        assert_eq!(protocol_from(env(&[])), Ok(Protocol::Grpc));
        assert_eq!(
            protocol_from(env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")])),
            Ok(Protocol::HttpProtobuf)
        );
        assert_eq!(
            protocol_from(env(&[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
            ])),
            Ok(Protocol::Grpc)
        );
        assert_eq!(
            protocol_from(env(&[("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", " ")])),
            Ok(Protocol::Grpc)
        );
    }

    #[test]
    fn an_https_endpoint_is_found_in_the_signal_variable_or_the_general_one() {
        let found =
            |pairs: &[(&str, &str)]| https_endpoint("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", env(pairs));
        assert_eq!(found(&[]), None);
        assert_eq!(
            found(&[("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://c:4318")]),
            None
        );
        assert_eq!(
            found(&[("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", " https://c:4318")]),
            Some((
                "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
                " https://c:4318".to_owned()
            ))
        );
        assert_eq!(
            found(&[
                ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318"),
            ]),
            Some(("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318".to_owned())),
            "the general variable is checked too"
        );
        assert_eq!(
            found(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://c:4318")]),
            None,
            "another signal's variable"
        );
    }

    #[test]
    fn an_unsupported_protocol_is_refused_naming_the_variable_and_the_accepted_values() {
        let error =
            protocol_from(env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")])).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\""),
            "{text}"
        );
        assert!(text.contains("\"grpc\" and \"http/protobuf\""), "{text}");
        let error = protocol_from(env(&[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift"),
        ]))
        .unwrap_err();
        assert_eq!(error.var, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL");
    }

    #[test]
    fn export_failures_are_counted_every_time() {
        let before = EXPORT_FAILURES
            .get_or_create(&SignalLabel { signal: "traces" })
            .get();
        export_failed("traces", &"connection refused");
        export_failed("traces", &"connection refused");
        let after = EXPORT_FAILURES
            .get_or_create(&SignalLabel { signal: "traces" })
            .get();
        assert!(after >= before + 2, "{before} -> {after}");
    }
}
