//! The mesh's spans, named and attributed by the OpenTelemetry conventions
//! that dashboards query.
//!
//! * A batch is a **server** span `guardmesh.v1.PreToolService/Evaluate`
//!   (or `/EvaluateBatch`) under the coordinator's span (R22).
//! * Each guard consulted is an **internal** span `apply_guardrail {guard}`
//!   (the GenAI security conventions: `gen_ai.operation.name`,
//!   `gen_ai.guardian.*`, `gen_ai.security.*`, `gen_ai.conversation.id`),
//!   with one event per call it was sent (`gen_ai.tool.name`,
//!   `gen_ai.tool.call.id`, what the guard said). A remote guard's exchange
//!   is a **client** span `guardmesh.v1.GuardService/Judge` under it, whose
//!   context the guard receives (R22).
//! * RPC attributes: by default the names of semantic conventions v1.37
//!   (`rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code` as
//!   an int); `OTEL_SEMCONV_STABILITY_OPT_IN=rpc` switches to the current
//!   names (`rpc.system.name`, a fully qualified `rpc.method`,
//!   `rpc.status_code` as the code's name), `rpc/dup` emits both (the
//!   fully qualified `rpc.method`). `server.address` is a host,
//!   `server.port` an int; `error.type` is set when, and only when, the
//!   operation failed. Numbers are recorded as numbers.
//!
//! The spans are at DEBUG: without an exporter they are never created, and
//! every attribute that needs formatting is formatted only for a live span.

use guardmesh_proto::v1::{Action, BatchContext, BatchDecision, FailurePolicy};
use std::net::SocketAddr;
use std::sync::LazyLock;
use tracing::Span;
use tracing::field::Empty;

const PRE_TOOL_SERVICE: &str = "guardmesh.v1.PreToolService";
const GUARD_SERVICE: &str = "guardmesh.v1.GuardService";
const JUDGE: &str = "guardmesh.v1.GuardService/Judge";

/// Which generation of RPC attribute names spans carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RpcConventions {
    /// Semantic conventions v1.37 and before: `rpc.system`, `rpc.service`,
    /// `rpc.method` (the method alone), `rpc.grpc.status_code` (int).
    pub legacy: bool,
    /// The current ones: `rpc.system.name`, `rpc.method` (fully
    /// qualified), `rpc.status_code` (the code's name).
    pub current: bool,
}

impl RpcConventions {
    /// From the value of `OTEL_SEMCONV_STABILITY_OPT_IN` (a comma-separated
    /// list): `rpc/dup` both, `rpc` the current names, else the v1.37 ones.
    pub fn from_opt_in(value: &str) -> Self {
        let has = |item: &str| value.split(',').any(|v| v.trim() == item);
        if has("rpc/dup") {
            Self {
                legacy: true,
                current: true,
            }
        } else if has("rpc") {
            Self {
                legacy: false,
                current: true,
            }
        } else {
            Self {
                legacy: true,
                current: false,
            }
        }
    }
}

static CONVENTIONS: LazyLock<RpcConventions> = LazyLock::new(|| {
    RpcConventions::from_opt_in(&std::env::var("OTEL_SEMCONV_STABILITY_OPT_IN").unwrap_or_default())
});

/// The name the conventions give a gRPC status code.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Whether a server answering `code` failed, by the gRPC conventions (a
/// client's bad request is not the server's error).
fn server_error(code: tonic::Code) -> bool {
    use tonic::Code;
    matches!(
        code,
        Code::Unknown
            | Code::DeadlineExceeded
            | Code::Unimplemented
            | Code::Internal
            | Code::Unavailable
            | Code::DataLoss
    )
}

/// Records the status code attributes, and the error ones when `failed`.
fn record_status(span: &Span, code: tonic::Code, failed: bool, description: &str) {
    let conventions = *CONVENTIONS;
    if conventions.legacy {
        span.record("rpc.grpc.status_code", i64::from(i32::from(code)));
    }
    if conventions.current {
        span.record("rpc.status_code", code_name(code));
    }
    if failed {
        span.record("error.type", code_name(code));
        // A description makes the span's status an error.
        span.record(
            "otel.status_description",
            if description.is_empty() {
                code_name(code)
            } else {
                description
            },
        );
    }
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A span of one gRPC exchange, `kind` "server" or "client", of a
/// `service` method (its full name, then its name), with the RPC
/// attributes `conventions` asks for (the legacy ones, the current ones or
/// both), the server's address and port, and then `$rest`. Both the batch
/// and a guard's exchange are spans of this one shape.
macro_rules! rpc_span {
    (
        $(parent: $parent:expr,)?
        $name:literal,
        $conventions:expr,
        kind: $kind:literal,
        service: $service:expr,
        method: ($full:expr, $method:expr),
        server: ($address:expr, $port:expr),
        $($rest:tt)*
    ) => {
        tracing::debug_span!(
            $(parent: $parent,)?
            $name,
            otel.name = $full,
            otel.kind = $kind,
            otel.status_description = Empty,
            rpc.system = $conventions.legacy.then_some("grpc"),
            rpc.system.name = $conventions.current.then_some("grpc"),
            rpc.service = $conventions.legacy.then_some($service),
            rpc.method = if $conventions.current { $full } else { $method },
            rpc.grpc.status_code = Empty,
            rpc.status_code = Empty,
            server.address = $address,
            server.port = $port,
            "error.type" = Empty,
            $($rest)*
        )
    };
}

/// The server span of one batch. `served_at` is the mesh's listening
/// address, when it is serving.
pub(crate) fn batch_span(
    unary: bool,
    batch_id: &str,
    context: Option<&BatchContext>,
    calls: usize,
    served_at: Option<SocketAddr>,
) -> Span {
    let conventions = *CONVENTIONS;
    let (full, method) = if unary {
        ("guardmesh.v1.PreToolService/EvaluateBatch", "EvaluateBatch")
    } else {
        ("guardmesh.v1.PreToolService/Evaluate", "Evaluate")
    };
    let session = context.map_or("", |c| c.session_id.as_str());
    let served_at = served_at.filter(|a| !a.ip().is_unspecified());
    rpc_span!(
        "guardmesh.batch",
        conventions,
        kind: "server",
        service: PRE_TOOL_SERVICE,
        method: (full, method),
        server: (
            served_at.map(|a| tracing::field::display(a.ip())),
            served_at.map(|a| i64::from(a.port()))
        ),
        gen_ai.conversation.id = (!session.is_empty()).then_some(session),
        guardmesh.batch_id = batch_id,
        guardmesh.session_id = session,
        guardmesh.turn_index = i64::from(context.map_or(0, |c| c.turn_index)),
        guardmesh.batch.calls = count(calls),
        guardmesh.chain.revision = Empty,
        guardmesh.calls.proceed = Empty,
        guardmesh.calls.steer = Empty,
        guardmesh.calls.cancel = Empty,
        guardmesh.calls.ask = Empty,
    )
}

/// A guard as its spans name it. Telemetry knows nothing of the registry:
/// the caller describes the guard.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpanGuard<'a> {
    pub(crate) name: &'a str,
    /// `mutate` or `validate`.
    pub(crate) role: &'static str,
    /// Not dry-run (R18).
    pub(crate) enforced: bool,
    /// A policy guard judged inside the mesh (R27).
    pub(crate) policy: bool,
    pub(crate) endpoint: &'a str,
    pub(crate) failure_policy: FailurePolicy,
}

/// How a guard's consultation failed, as its spans name it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpanFailure {
    /// A low-cardinality name (`error.type` of the guardrail span).
    pub(crate) kind: &'static str,
    /// The gRPC code of the exchange; `None` when the exchange itself went
    /// through (the answer was then refused).
    pub(crate) code: Option<tonic::Code>,
}

/// Records how a batch ended on its span: its decision, or the status it
/// was answered with.
pub(crate) fn batch_done(span: &Span, result: Result<&BatchDecision, &tonic::Status>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(decision) => {
            record_status(span, tonic::Code::Ok, false, "");
            span.record(
                "guardmesh.chain.revision",
                i64::try_from(decision.chain_revision).unwrap_or(i64::MAX),
            );
            let count_of = |a: Action| {
                count(
                    decision
                        .decisions
                        .iter()
                        .filter(|d| d.action == a as i32)
                        .count(),
                )
            };
            span.record("guardmesh.calls.proceed", count_of(Action::Proceed));
            span.record("guardmesh.calls.steer", count_of(Action::Steer));
            span.record("guardmesh.calls.cancel", count_of(Action::Cancel));
            span.record("guardmesh.calls.ask", count_of(Action::Ask));
        }
        Err(status) => {
            record_status(
                span,
                status.code(),
                server_error(status.code()),
                status.message(),
            );
        }
    }
}

/// The internal span of one guard applied to a batch (the GenAI
/// `apply_guardrail` operation); `conversation` is the batch's session.
pub(crate) fn guardrail_span(
    parent: &Span,
    guard: &SpanGuard<'_>,
    conversation: &str,
    sent: usize,
) -> Span {
    let span = tracing::debug_span!(
        parent: parent,
        "guardmesh.guardrail",
        otel.name = Empty,
        otel.kind = "internal",
        otel.status_description = Empty,
        gen_ai.operation.name = "apply_guardrail",
        gen_ai.guardian.name = guard.name,
        gen_ai.guardian.id = guard.name,
        "gen_ai.security.target.type" = "tool_call",
        "gen_ai.security.decision.type" = Empty,
        gen_ai.conversation.id = (!conversation.is_empty()).then_some(conversation),
        "error.type" = Empty,
        guardmesh.guard = guard.name,
        guardmesh.guard.role = guard.role,
        guardmesh.guard.dry_run = !guard.enforced,
        guardmesh.guard.policy = guard.policy,
        guardmesh.status = Empty,
        guardmesh.calls.sent = count(sent),
        guardmesh.calls.skipped = Empty,
        guardmesh.calls.rewritten = Empty,
        guardmesh.error = Empty,
    );
    if !span.is_disabled() {
        span.record("otel.name", format!("apply_guardrail {}", guard.name));
    }
    span
}

/// `endpoint`'s host and port, as `server.address` and `server.port` want
/// them (the port of the scheme when none is written).
fn host_port(endpoint: &str) -> Option<(String, Option<u16>)> {
    let uri: http::Uri = endpoint.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().or(match uri.scheme_str() {
        Some("http") => Some(80),
        Some("https") => Some(443),
        _ => None,
    });
    Some((host.to_owned(), port))
}

/// The client span of a remote guard's exchange for one batch, under its
/// guardrail span.
pub(crate) fn judge_span(parent: &Span, guard: &SpanGuard<'_>) -> Span {
    let conventions = *CONVENTIONS;
    let span = rpc_span!(
        parent: parent,
        "guardmesh.guard",
        conventions,
        kind: "client",
        service: GUARD_SERVICE,
        method: (JUDGE, "Judge"),
        server: (Empty, Empty),
        guardmesh.guard = guard.name,
    );
    if !span.is_disabled() {
        match host_port(guard.endpoint) {
            Some((host, port)) => {
                span.record("server.address", host.as_str());
                if let Some(port) = port {
                    span.record("server.port", i64::from(port));
                }
            }
            None => {
                span.record("server.address", guard.endpoint);
            }
        }
    }
    span
}

/// What one guard did in a batch, for its spans.
pub(crate) struct GuardOutcome<'a> {
    pub(crate) guard: SpanGuard<'a>,
    /// The trace status (R21) as reported.
    pub(crate) status: &'static str,
    pub(crate) failure: Option<SpanFailure>,
    pub(crate) error: &'a str,
    pub(crate) skipped: usize,
    pub(crate) rewritten: usize,
}

/// The guardrail's decision as the GenAI security conventions name it: a
/// dry-run guard only audits; a failed guard's calls go as its failure
/// policy says.
fn decision_type(outcome: &GuardOutcome<'_>) -> &'static str {
    if !outcome.guard.enforced {
        "audit"
    } else if outcome.failure.is_some() {
        match outcome.guard.failure_policy {
            FailurePolicy::FailOpen => "allow",
            FailurePolicy::FailClosed | FailurePolicy::Abort => "deny",
        }
    } else if outcome.skipped > 0 {
        "deny"
    } else if outcome.rewritten > 0 {
        "modify"
    } else {
        "allow"
    }
}

/// Records how a guard's consultation ended on its guardrail span and, for
/// a remote guard, its client span.
pub(crate) fn guard_done(guardrail: &Span, judge: Option<&Span>, outcome: &GuardOutcome<'_>) {
    if !guardrail.is_disabled() {
        guardrail.record("gen_ai.security.decision.type", decision_type(outcome));
        guardrail.record("guardmesh.status", outcome.status);
        guardrail.record("guardmesh.calls.skipped", count(outcome.skipped));
        guardrail.record("guardmesh.calls.rewritten", count(outcome.rewritten));
        if !outcome.error.is_empty() {
            guardrail.record("guardmesh.error", outcome.error);
        }
        if let Some(failure) = outcome.failure {
            guardrail.record("error.type", failure.kind);
            guardrail.record("otel.status_description", outcome.error);
        }
    }
    if let Some(judge) = judge
        && !judge.is_disabled()
    {
        match outcome.failure.and_then(|failure| failure.code) {
            Some(code) => record_status(judge, code, true, outcome.error),
            None => record_status(judge, tonic::Code::Ok, false, ""),
        }
    }
}

/// Adds the event of one call a guard was sent to its guardrail span:
/// the tool, the call id, and what the guard said (`action`: proceed,
/// steer, cancel, rewrite, failed).
pub(crate) fn call_event(guardrail: &Span, tool: &str, call_id: &str, action: &'static str) {
    use opentelemetry::KeyValue;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if guardrail.is_disabled() {
        return;
    }
    let decision = match action {
        "steer" | "cancel" => "deny",
        "rewrite" => "modify",
        "failed" => "error",
        _ => "allow",
    };
    guardrail.add_event(
        "guardmesh.verdict",
        vec![
            KeyValue::new("gen_ai.tool.name", tool.to_owned()),
            KeyValue::new("gen_ai.tool.call.id", call_id.to_owned()),
            KeyValue::new("gen_ai.security.target.id", call_id.to_owned()),
            KeyValue::new("gen_ai.security.decision.type", decision),
            KeyValue::new("guardmesh.action", action),
        ],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_conventions_follow_the_stability_opt_in() {
        let legacy = RpcConventions {
            legacy: true,
            current: false,
        };
        assert_eq!(RpcConventions::from_opt_in(""), legacy);
        assert_eq!(RpcConventions::from_opt_in("http"), legacy);
        assert_eq!(
            RpcConventions::from_opt_in("http, rpc"),
            RpcConventions {
                legacy: false,
                current: true
            }
        );
        assert_eq!(
            RpcConventions::from_opt_in("rpc,rpc/dup"),
            RpcConventions {
                legacy: true,
                current: true
            }
        );
    }

    #[test]
    fn server_address_is_the_endpoint_host_and_the_port_a_number() {
        assert_eq!(
            host_port("http://127.0.0.1:50051"),
            Some(("127.0.0.1".to_owned(), Some(50051)))
        );
        assert_eq!(
            host_port("https://guard.example"),
            Some(("guard.example".to_owned(), Some(443)))
        );
        assert_eq!(
            host_port("http://[::1]:7000"),
            Some(("::1".to_owned(), Some(7000)))
        );
        assert_eq!(host_port(""), None);
    }
}
