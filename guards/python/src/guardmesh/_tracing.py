"""OpenTelemetry, when it is installed (the ``otel`` extra): W3C trace
context in and out (R22). Without it the kit and the client do not trace."""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

try:
    from opentelemetry import context as _context
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR: Optional[TraceContextTextMapPropagator] = TraceContextTextMapPropagator()
except ImportError:  # pragma: no cover - depends on the environment
    _PROPAGATOR = None

__all__ = ["current_traceparent", "extract_context", "install_file_tracing", "tracer"]


def available() -> bool:
    return _PROPAGATOR is not None


def current_traceparent() -> tuple[str, str]:
    """(traceparent, tracestate) of the current span, or ("", "") when
    OpenTelemetry is missing or no span is recording."""
    if _PROPAGATOR is None:
        return "", ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def extract_context(traceparent: str, tracestate: str) -> Any:
    """An OpenTelemetry context whose parent is the given W3C context."""
    assert _PROPAGATOR is not None
    carrier = {}
    if traceparent:
        carrier["traceparent"] = traceparent
        if tracestate:
            carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier, context=_context.Context())


def tracer(name: str) -> Any:
    """A tracer, or None without OpenTelemetry."""
    if _PROPAGATOR is None:
        return None
    return _trace.get_tracer(name)


def server_kind() -> Any:
    return _trace.SpanKind.SERVER


def install_file_tracing(path: str, service_name: str = "guardmesh-guard") -> Any:
    """Installs a global SDK TracerProvider that appends each finished span
    to ``path`` as one JSON line::

        {"name": ..., "trace_id": "<32 hex>", "span_id": "<16 hex>",
         "parent_span_id": "<16 hex>" | null, "attributes": {...},
         "kind": "SERVER", "service": ..., "status": "UNSET" | "OK" | "ERROR",
         "start_time_unix_nano": "<decimal>", "end_time_unix_nano": "<decimal>"}

    For tests that check trace ids without an OTLP receiver. Needs
    ``opentelemetry-sdk`` (the ``otel`` extra). Returns the provider.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class JsonLinesSpanExporter(SpanExporter):
        def __init__(self, file_path: str):
            self._path = file_path
            self._lock = threading.Lock()

        def export(self, spans: Any) -> SpanExportResult:
            lines = []
            span: ReadableSpan
            for span in spans:
                parent = span.parent
                context = span.context
                assert context is not None
                lines.append(json.dumps({
                    "name": span.name,
                    "trace_id": format(context.trace_id, "032x"),
                    "span_id": format(context.span_id, "016x"),
                    "parent_span_id": format(parent.span_id, "016x") if parent else None,
                    "kind": span.kind.name,
                    "service": span.resource.attributes.get("service.name"),
                    "start_time_unix_nano": str(span.start_time),
                    "end_time_unix_nano": str(span.end_time),
                    "status": span.status.status_code.name,
                    "attributes": {k: list(v) if isinstance(v, tuple) else v
                                   for k, v in (span.attributes or {}).items()},
                }, default=str))
            with self._lock, open(self._path, "a", encoding="utf-8") as out:
                out.write("".join(line + "\n" for line in lines))
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    _trace.set_tracer_provider(provider)
    return provider
