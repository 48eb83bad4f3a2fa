//! W3C trace context (R22) between coordinators, the mesh and guards.
//!
//! With the `otel` feature (default), a coordinator sends the `traceparent`
//! of its current span with each batch, and a guard served by this SDK makes
//! the batch's `traceparent` the parent of its own `guard.judge` span, so the
//! agent, the mesh and every guard share one trace.

/// Splits a valid `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`) into its
/// trace id, span id and flags.
pub fn parse_traceparent(value: &str) -> Option<(&str, &str, u8)> {
    let mut parts = value.trim().split('-');
    let version = parts.next()?;
    let trace_id = parts.next()?;
    let span_id = parts.next()?;
    let flags = parts.next()?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace_id, 32)
        && trace_id.bytes().any(|b| b != b'0')
        && hex(span_id, 16)
        && span_id.bytes().any(|b| b != b'0')
        && hex(flags, 2)
        && (version != "00" || parts.next().is_none());
    let flags = u8::from_str_radix(flags, 16).ok()?;
    valid.then_some((trace_id, span_id, flags))
}

/// The `traceparent` of the current `tracing` span, when it is an
/// OpenTelemetry span with a valid context.
#[cfg(feature = "otel")]
pub fn current_traceparent() -> Option<String> {
    span_traceparent(&tracing::Span::current())
}

/// The `traceparent` of `span`, when it is an OpenTelemetry span with a
/// valid context (an OpenTelemetry layer is installed and sampled it in).
#[cfg(feature = "otel")]
pub fn span_traceparent(span: &tracing::Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let context = span.context();
    let span = context.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Without the `otel` feature there is no span context to send.
#[cfg(not(feature = "otel"))]
pub fn current_traceparent() -> Option<String> {
    None
}

/// An OpenTelemetry context whose remote parent is `traceparent`; the empty
/// context when it is missing or invalid.
#[cfg(feature = "otel")]
pub fn parent_context(traceparent: &str, tracestate: &str) -> opentelemetry::Context {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    let Some((trace_id, span_id, flags)) = parse_traceparent(traceparent) else {
        return opentelemetry::Context::new();
    };
    let (Ok(trace_id), Ok(span_id)) = (TraceId::from_hex(trace_id), SpanId::from_hex(span_id))
    else {
        return opentelemetry::Context::new();
    };
    let state = tracestate.parse::<TraceState>().unwrap_or_default();
    let sc = SpanContext::new(trace_id, span_id, TraceFlags::new(flags & 1), true, state);
    opentelemetry::Context::new().with_remote_span_context(sc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r22_traceparent_forms() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            parse_traceparent(ok),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1))
        );
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-xyz-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad}");
        }
    }
}
