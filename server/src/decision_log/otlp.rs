//! Optional export of the records as OpenTelemetry log records over OTLP
//! (`[decision_log] otlp = true`), so that they reach any backend a
//! collector feeds. The file stays the source of truth: a record is
//! exported only once it is written there, and an export that fails loses
//! nothing from the file.
//!
//! Where to: the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_LOGS_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_EXPORTER_OTLP_TIMEOUT`, ...); nothing here overrides them. The
//! protocol is `OTEL_EXPORTER_OTLP_LOGS_PROTOCOL`, else
//! `OTEL_EXPORTER_OTLP_PROTOCOL`: `grpc` (the default) or `http/protobuf`
//! (plain `http://` endpoints, on the mesh's runtime); any other value
//! refuses to start, naming the variable. Failed exports are counted in
//! `guardmesh_otlp_export_failures_total{signal="logs"}` and logged, at
//! most once a minute.
//!
//! One log record per line of the file: its body is the line itself (the
//! record's JSON exactly as written, so already masked, with its hashes);
//! its attributes name the record (`guardmesh.record.id`, `.seq`, `.kind`,
//! `.hash`) and, for a decision, the batch and its outcome
//! (`guardmesh.batch.id`, `guardmesh.outcome.status`); a decision's trace
//! id is the log record's trace context, so a backend links it to the
//! batch's trace. Event name `guardmesh.decision_log.record`; for the
//! writer's signed checkpoints and gap records (see [`super::checkpoint`])
//! `guardmesh.decision_log.checkpoint`, with `guardmesh.checkpoint.reason`
//! (`gap` for a gap): the body is the signed line, so a collector keeps an
//! outside copy of the latest checkpoint, which `guardmesh log verify
//! --key PUB --checkpoint FILE` checks the log against.

use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity};
use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_sdk::logs::{SdkLogger, SdkLoggerProvider};
use serde::Deserialize;

/// The exporter of one decision log.
pub struct Export {
    provider: SdkLoggerProvider,
    logger: SdkLogger,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Export")
    }
}

/// The fields of a line the export reads (the rest is in the body).
#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    id: String,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    hash: String,
    #[serde(default)]
    time: String,
    #[serde(default)]
    trace_id: Option<String>,
    #[serde(default)]
    batch: Option<BatchFields>,
    #[serde(default)]
    outcome: Option<OutcomeFields>,
    #[serde(default)]
    reason: Option<String>,
}

#[derive(Deserialize)]
struct BatchFields {
    #[serde(default)]
    batch_id: String,
}

#[derive(Deserialize)]
struct OutcomeFields {
    #[serde(default)]
    status: String,
}

/// Why the OTLP log exporter cannot be built from the environment.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("the OTLP log exporter: {0}")]
    Protocol(#[from] crate::observe::otlp::UnsupportedProtocol),
    #[error("the OTLP log exporter: {0}")]
    Build(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error(
        "the OTLP log exporter: {var}={endpoint:?}: only http:// endpoints are supported with http/protobuf"
    )]
    Https { var: &'static str, endpoint: String },
    #[error("the OTLP log exporter: {0}")]
    NoRuntime(#[from] tokio::runtime::TryCurrentError),
}

impl From<crate::observe::otlp::HttpClientError> for ExportError {
    fn from(error: crate::observe::otlp::HttpClientError) -> Self {
        use crate::observe::otlp::HttpClientError;
        match error {
            HttpClientError::Https { var, endpoint } => Self::Https { var, endpoint },
            HttpClientError::NoRuntime(e) => Self::NoRuntime(e),
        }
    }
}

impl Export {
    /// The exporter the `OTEL_EXPORTER_OTLP_*` variables describe. Must be
    /// called on a tokio runtime.
    pub fn from_env() -> Result<Export, ExportError> {
        use crate::observe::otlp::{self, CountedLogs, Protocol};
        use opentelemetry_otlp::WithExportConfig;
        let protocol =
            otlp::signal_protocol_from(otlp::LOGS_PROTOCOL_VARS, |var| std::env::var(var).ok())?;
        // No `.with_endpoint()`: the OTEL_EXPORTER_OTLP_* variables decide.
        let exporter = match protocol {
            Protocol::Grpc => opentelemetry_otlp::LogExporter::builder()
                .with_tonic()
                .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                .build()?,
            Protocol::HttpProtobuf => otlp::over_http(
                opentelemetry_otlp::LogExporter::builder().with_http(),
                &otlp::LOGS,
            )?
            .build()?,
        };
        let exporter = CountedLogs(exporter);
        let provider = SdkLoggerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(otlp::resource())
            .build();
        let logger = provider.logger("guardmesh.decision_log");
        Ok(Export { provider, logger })
    }

    /// Exports one line written to the file (without its newline).
    pub fn emit(&self, line: &[u8]) {
        let Ok(text) = std::str::from_utf8(line) else {
            return;
        };
        let Ok(fields) = serde_json::from_str::<Fields>(text) else {
            return;
        };
        let mut record = self.logger.create_log_record();
        let sealed = fields.kind == "checkpoint" || fields.kind == "gap";
        record.set_event_name(if sealed {
            "guardmesh.decision_log.checkpoint"
        } else {
            "guardmesh.decision_log.record"
        });
        if sealed {
            let reason = fields.reason.clone().unwrap_or_else(|| fields.kind.clone());
            record.add_attribute("guardmesh.checkpoint.reason", reason);
        }
        record.set_severity_number(Severity::Info);
        record.set_severity_text("INFO");
        // The record's own time; when it was exported is the observed time.
        let now = std::time::SystemTime::now();
        record.set_observed_timestamp(now);
        record.set_timestamp(
            time::OffsetDateTime::parse(
                &fields.time,
                &time::format_description::well_known::Rfc3339,
            )
            .map_or(now, std::time::SystemTime::from),
        );
        record.set_body(AnyValue::String(text.to_owned().into()));
        record.add_attribute("guardmesh.record.id", fields.id);
        record.add_attribute(
            "guardmesh.record.seq",
            i64::try_from(fields.seq).unwrap_or(i64::MAX),
        );
        record.add_attribute("guardmesh.record.kind", fields.kind);
        record.add_attribute("guardmesh.record.hash", fields.hash);
        if let Some(batch) = fields.batch {
            record.add_attribute("guardmesh.batch.id", batch.batch_id);
        }
        if let Some(outcome) = fields.outcome {
            record.add_attribute("guardmesh.outcome.status", outcome.status);
        }
        if let Some(trace_id) = fields
            .trace_id
            .and_then(|hex| TraceId::from_hex(&hex).ok())
            .filter(|id| *id != TraceId::INVALID)
        {
            record.set_trace_context(trace_id, SpanId::INVALID, None);
        }
        self.logger.emit(record);
    }

    /// Flushes what is queued and stops. Blocks: call it off the runtime's
    /// threads.
    pub fn shutdown(self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "decision log OTLP export: shutdown");
        }
    }
}
