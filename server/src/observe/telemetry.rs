//! Logs and traces.
//!
//! * Logs: `tracing-subscriber` with `RUST_LOG`-style filtering, human format
//!   by default, JSON on request, to stderr.
//! * Traces: when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, or `OTEL_TRACES_EXPORTER`
//!   is `otlp`, spans are exported over OTLP by `opentelemetry-otlp`,
//!   configured by the standard `OTEL_*` variables (endpoint, protocol,
//!   headers, timeout, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//!   `OTEL_TRACES_SAMPLER`/`_ARG`); see [`super::otlp`] for the protocols
//!   and the counting of failed exports. Otherwise no exporter runs. Only
//!   the mesh's and the SDK's own spans are exported: HTTP/2 and transport
//!   library spans are filtered out, and health checks create no spans.
//!   Spans carry only their own attributes and events: none of the
//!   subscriber's bookkeeping (`busy_ns`, `idle_ns`, `code.*`, `thread.*`,
//!   `target`, `level`), and log events stay in the logs.
//!
//! The W3C trace context propagator is installed globally, so coordinators
//! and guards in any language join the same trace (R22).
//!
//! Logged values often come from the network (batch and call ids, tool
//! names, error messages that quote them). The human format writes every
//! field value and the message through [`EscapeControls`], so a value with
//! a newline cannot forge a log line and ANSI escapes never reach a
//! terminal raw; the JSON format escapes them as JSON strings.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::fmt::{self, Write as _};
use tracing::Level;
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::filter::{FilterExt, Targets};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Log output format: `human` or `json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One readable line per event.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// The name used on the command line and in config files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Human => "human",
            Self::Json => "json",
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "human" => Ok(Self::Human),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format {other:?} (human, json)")),
        }
    }
}

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("OTLP exporter: {0}")]
    Protocol(#[from] super::otlp::UnsupportedProtocol),
    #[error(
        "OTLP exporter: {var}={endpoint:?}: http/protobuf exports to http:// endpoints only \
         (use a local collector, or OTEL_EXPORTER_OTLP_PROTOCOL=grpc)"
    )]
    HttpsEndpoint { var: &'static str, endpoint: String },
    #[error("OTLP exporter: http/protobuf needs a tokio runtime: {0}")]
    Runtime(#[from] tokio::runtime::TryCurrentError),
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

    /// Exports the spans ended so far; whether that went through. The SDK's
    /// flush blocks, so it runs on the blocking pool.
    pub async fn flush(&self) -> bool {
        let Some(provider) = self.provider.clone() else {
            return true;
        };
        matches!(
            tokio::task::spawn_blocking(move || provider.force_flush()).await,
            Ok(Ok(()))
        )
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

/// Whether the environment asks for OTLP trace export.
pub fn otlp_configured() -> bool {
    match std::env::var("OTEL_TRACES_EXPORTER") {
        Ok(v) if v.trim() == "none" => false,
        Ok(v) if v.trim() == "otlp" => true,
        _ => {
            use super::otlp::env_set;
            env_set("OTEL_EXPORTER_OTLP_ENDPOINT") || env_set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        }
    }
}

impl From<super::otlp::HttpClientError> for TelemetryError {
    fn from(error: super::otlp::HttpClientError) -> Self {
        use super::otlp::HttpClientError;
        match error {
            HttpClientError::Https { var, endpoint } => Self::HttpsEndpoint { var, endpoint },
            HttpClientError::NoRuntime(e) => Self::Runtime(e),
        }
    }
}

fn provider() -> Result<SdkTracerProvider, TelemetryError> {
    use super::otlp::{Counted, Protocol};
    use opentelemetry_otlp::WithExportConfig;
    // No `.with_endpoint()`: the OTEL_EXPORTER_OTLP_* variables decide.
    let exporter = match super::otlp::protocol()? {
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_protocol(opentelemetry_otlp::Protocol::Grpc)
            .build()?,
        Protocol::HttpProtobuf => super::otlp::over_http(
            opentelemetry_otlp::SpanExporter::builder().with_http(),
            &super::otlp::TRACES,
        )?
        .build()?,
    };
    let exporter = Counted(exporter);
    Ok(SdkTracerProvider::builder()
        // Masked values are scrubbed from a span as it ends (R29).
        .with_span_processor(super::scrub::ScrubSpans(
            opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter).build(),
        ))
        .with_resource(super::otlp::resource())
        .build())
}

/// Whether `ch` is written escaped in the human log: control characters
/// (C0, DEL, C1: newlines, carriage returns, ESC), the Unicode line and
/// paragraph separators, and the bidirectional overrides that reorder what a
/// reader sees.
fn needs_escape(ch: char) -> bool {
    ch.is_control()
        || matches!(ch, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// A writer that passes text through to `inner` with the characters of
/// [`needs_escape`] written as `\n`, `\r`, `\t` or `\u{..}`.
pub struct EscapeControls<'a, W: fmt::Write + ?Sized>(pub &'a mut W);

impl<W: fmt::Write + ?Sized> fmt::Write for EscapeControls<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut start = 0;
        for (i, ch) in s.char_indices() {
            if !needs_escape(ch) {
                continue;
            }
            self.0.write_str(&s[start..i])?;
            match ch {
                '\n' => self.0.write_str("\\n")?,
                '\r' => self.0.write_str("\\r")?,
                '\t' => self.0.write_str("\\t")?,
                _ => write!(self.0, "\\u{{{:x}}}", u32::from(ch))?,
            }
            start = i + ch.len_utf8();
        }
        self.0.write_str(&s[start..])
    }
}

/// The human format's field formatter: `message key=value ...` like
/// tracing-subscriber's default, with every value (`%` Display, `?` Debug,
/// strings, errors) and the message passed through [`EscapeControls`].
/// Used for events and for span fields alike.
pub fn escaping_fields() -> impl for<'writer> FormatFields<'writer> + Send + Sync + 'static {
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        if field.name() != "message" {
            write!(writer, "{}=", field.name())?;
        }
        write!(EscapeControls(writer), "{value:?}")
    })
    .delimited(" ")
}

/// The log layer in `format`, writing to `writer`, with colours when `ansi`.
fn log_layer<S, W>(format: LogFormat, writer: W, ansi: bool) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    W: for<'writer> MakeWriter<'writer> + Send + Sync + 'static,
{
    match format {
        LogFormat::Human => tracing_subscriber::fmt::layer()
            .fmt_fields(escaping_fields())
            .with_ansi(ansi)
            .with_writer(writer)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(writer)
            .boxed(),
    }
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
        // Spans only: log events stay in the logs rather than riding on
        // spans as events with the subscriber's `level` and `target`.
        let ours = Targets::new()
            .with_target("guardmesh_server", Level::DEBUG)
            .with_target("guardmesh_client", Level::DEBUG)
            .and(tracing_subscriber::filter::filter_fn(|meta| meta.is_span()));
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("guardmesh"))
            .with_tracked_inactivity(false)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_filter(ours)
    });
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only on a terminal: a log file gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // Masked values are scrubbed from every line (R29).
    let logs =
        log_layer(format, super::scrub::ScrubWriter(std::io::stderr), ansi).with_filter(filter);
    if let Err(error) = tracing_subscriber::registry()
        .with(otel)
        .with(logs)
        .try_init()
    {
        eprintln!("logging already initialised: {error}");
    }
    Ok(Telemetry { provider })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Self;
        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }

    /// What one event (inside a span) is logged as in `format`.
    fn logged(format: LogFormat, ansi: bool) -> String {
        let out = Captured::default();
        let subscriber = tracing_subscriber::registry().with(log_layer(format, out.clone(), ansi));
        let hostile = "b1\n2026-12-01T00:00:00Z ERROR guardmesh: forged \x1b[31mred\r\u{2028}";
        let error = std::io::Error::other("bad\nline \x1b[0m");
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("batch", batch_id = %hostile);
            let _entered = span.enter();
            tracing::info!(
                batch_id = %hostile,
                tool = ?hostile,
                name = hostile,
                error = &error as &(dyn std::error::Error + 'static),
                "batch refused: {hostile}"
            );
        });
        let bytes = out.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn r25_logged_network_values_cannot_forge_lines_or_colour_the_terminal() {
        for format in [LogFormat::Human, LogFormat::Json] {
            let text = logged(format, false);
            assert_eq!(text.lines().count(), 1, "{format:?}: {text}");
            assert!(text.ends_with('\n'), "{format:?}: {text}");
            let line = text.trim_end_matches('\n');
            // (JSON may keep U+2028 raw: it is valid in a JSON string
            // and ends no line for a JSON-lines reader.)
            assert!(!line.contains(['\n', '\r', '\x1b']), "{format:?}: {line:?}");
            assert!(line.contains("forged"), "{format:?}: {line}");
        }
        // With colours on, the only escapes are the formatter's own.
        let human = logged(LogFormat::Human, true);
        assert_eq!(human.lines().count(), 1, "{human}");
        assert!(
            human.contains(r"batch refused: b1\n2026-12-01T00:00:00Z ERROR guardmesh: forged \u{1b}[31mred\r\u{2028}"),
            "{human}"
        );
        assert!(human.contains(r"batch_id=b1\n2026"), "{human}");
        assert!(!human.contains('\u{2028}'), "{human}");
    }
}
