//! Logs and traces.
//!
//! * Logs: `tracing-subscriber` with `RUST_LOG`-style filtering, human format
//!   by default, JSON on request, to stderr.
//! * Traces: when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, or `OTEL_TRACES_EXPORTER`
//!   is `otlp`, spans are exported over OTLP/gRPC by `opentelemetry-otlp`,
//!   configured by the standard `OTEL_*` variables (endpoint, headers,
//!   timeout, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//!   `OTEL_TRACES_SAMPLER`/`_ARG`). Otherwise no exporter runs. Only the
//!   mesh's and the SDK's own spans are exported: HTTP/2 and transport
//!   library spans are filtered out, and health checks create no spans.
//!
//! The W3C trace context propagator is installed globally, so coordinators
//! and guards in any language join the same trace (R22).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Log output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] flushes it.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes and stops the exporter. The SDK's shutdown blocks, so it runs
    /// on the blocking pool.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let result = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            if let Ok(Err(error)) = result {
                eprintln!("trace exporter shutdown: {error}");
            }
        }
    }
}

fn env_set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// Whether the environment asks for OTLP trace export.
pub fn otlp_configured() -> bool {
    match std::env::var("OTEL_TRACES_EXPORTER") {
        Ok(v) if v.trim() == "none" => false,
        Ok(v) if v.trim() == "otlp" => true,
        _ => {
            env_set("OTEL_EXPORTER_OTLP_ENDPOINT") || env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        }
    }
}

fn provider() -> Result<SdkTracerProvider, TelemetryError> {
    // No `.with_endpoint()`: the OTEL_EXPORTER_OTLP_* variables decide.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !env_set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("guardmesh");
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Installs the global subscriber: logs filtered by `RUST_LOG` (or
/// `default_filter`), plus span export when configured.
pub fn init(format: LogFormat, default_filter: &str) -> Result<Telemetry, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let provider = if otlp_configured() {
        Some(provider()?)
    } else {
        None
    };
    let otel = provider.as_ref().map(|provider| {
        opentelemetry::global::set_tracer_provider(provider.clone());
        // Only our own spans: h2, hyper and tonic internals never leave.
        // The batch and guard spans are at DEBUG so that, without export,
        // they are never created (the log layer filters at INFO): span
        // bookkeeping was a third of the mesh's CPU per batch.
        let ours = Targets::new()
            .with_target("guardmesh_server", Level::DEBUG)
            .with_target("guardmesh_client", Level::DEBUG);
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("guardmesh"))
            .with_filter(ours)
    });
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let logs = match format {
        LogFormat::Human => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    if let Err(error) = tracing_subscriber::registry()
        .with(otel)
        .with(logs)
        .try_init()
    {
        eprintln!("logging already initialised: {error}");
    }
    Ok(Telemetry { provider })
}
