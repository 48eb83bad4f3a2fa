//! One trace across coordinator, mesh and guard (R21, R22), exported for real
//! over OTLP/gRPC to an in-process collector on loopback, with the span
//! names, attribute names and attribute types dashboards query.
//!
//! Each test installs the process-wide subscriber, so each runs in its own
//! process (see `harness::isolated`).

use crate::harness::*;
use guardmesh_client::Batch;
use guardmesh_client::Registration;
use guardmesh_client::verdict::steer;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use std::time::Duration;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The mesh's telemetry, started as `serve` starts it (human logs at
/// `level`), from the OTLP variables the test has set: asserted to export.
pub(crate) fn exporting_telemetry(level: &str) -> guardmesh_server::observe::telemetry::Telemetry {
    let telemetry = guardmesh_server::observe::telemetry::init(
        guardmesh_server::observe::telemetry::LogFormat::Human,
        level,
    )
    .unwrap();
    assert!(telemetry.exporting());
    telemetry
}

/// The string attribute `key` of `attributes`; panics naming it when it is
/// absent or not a string.
pub(crate) fn string_in(attributes: &[KeyValue], key: &str) -> String {
    match attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref()?.value.as_ref())
    {
        Some(Value::StringValue(s)) => s.clone(),
        other => panic!("{key} is not a string attribute: {other:?} in {attributes:?}"),
    }
}

/// The int attribute `key` of `attributes`; panics naming it when it is
/// absent or not an int (a number recorded as a string fails here).
pub(crate) fn int_in(attributes: &[KeyValue], key: &str) -> i64 {
    match attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref()?.value.as_ref())
    {
        Some(Value::IntValue(i)) => *i,
        other => panic!("{key} is not an int attribute: {other:?} in {attributes:?}"),
    }
}

pub(crate) fn string(span: &Span, key: &str) -> String {
    string_in(&span.attributes, key)
}

pub(crate) fn int(span: &Span, key: &str) -> i64 {
    int_in(&span.attributes, key)
}

pub(crate) fn has(span: &Span, key: &str) -> bool {
    span.attributes.iter().any(|a| a.key == key)
}

/// No span or event carries the subscriber's own bookkeeping.
pub(crate) fn assert_no_internal_fields(spans: &[Span]) {
    for span in spans {
        let keys = span
            .attributes
            .iter()
            .map(|a| (a.key.as_str(), "span"))
            .chain(
                span.events
                    .iter()
                    .flat_map(|e| e.attributes.iter().map(|a| (a.key.as_str(), "event"))),
            );
        for (key, on) in keys {
            assert!(
                !matches!(key, "busy_ns" | "idle_ns" | "target" | "level")
                    && !key.starts_with("code.")
                    && !key.starts_with("thread."),
                "{} carries the internal {on} attribute {key}",
                span.name
            );
        }
    }
}

/// Measures (or sets) what the whole process owns: runs alone in a child
/// process of the test binary (see `harness::isolated`).
#[test]
fn r22_otlp_export_joins_coordinator_mesh_and_guard_in_one_trace() {
    isolated("otel::r22_otlp_export_joins_coordinator_mesh_and_guard_in_one_trace_in_own_process");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs in its own process through r22_otlp_export_joins_coordinator_mesh_and_guard_in_one_trace"]
async fn r22_otlp_export_joins_coordinator_mesh_and_guard_in_one_trace_in_own_process() {
    let (collector, endpoint) = Collector::serve().await;
    // The standard variables configure the real exporter.
    // SAFETY: this test runs alone in its own process (see the wrapper
    // above); nothing else reads the environment concurrently here.
    unsafe {
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
        std::env::set_var("OTEL_SERVICE_NAME", "guardmesh-under-test");
    }
    let telemetry = exporting_telemetry("warn");

    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |c| {
        (c.tool == "t").then(|| steer(&c.call_id, "no"))
    })
    .await;
    let quiet = proceed_guard().await;
    let auditor = call_guard(Duration::ZERO, |c| {
        Some(guardmesh_client::verdict::cancel(&c.call_id, "would block"))
    })
    .await;
    let down = closed_port().await;
    mesh.register(Registration::validate("vetoer", &guard.url))
        .await;
    mesh.register(Registration::validate("quiet", &quiet.url))
        .await;
    mesh.register(Registration::validate("auditor", &auditor.url).dry_run())
        .await;
    mesh.register(
        Registration::validate("down", &down)
            .failure_policy(guardmesh_client::proto::FailurePolicy::FailOpen),
    )
    .await;

    // The coordinator's own span, as an agent framework would send it.
    let coordinator_trace = "0af7651916cd43dd8448eb211c80319c";
    let coordinator_span = "b7ad6b7169203331";
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert(
        "traceparent",
        format!("00-{coordinator_trace}-{coordinator_span}-01")
            .parse()
            .unwrap(),
    );
    let session = mesh
        .coordinator()
        .await
        .session_with("s", metadata)
        .await
        .unwrap();
    let d = session
        .evaluate(Batch::new(0).call("c1", "t", "{}").call("c2", "read", "{}"))
        .await
        .unwrap();
    assert_eq!(
        d.trace_id, coordinator_trace,
        "R21: the decision names the trace"
    );
    // The guard was told its parent in the batch message itself.
    let sent = &guard.guard.batches()[0];
    assert!(
        sent.traceparent.contains(coordinator_trace),
        "{:?}",
        sent.traceparent
    );

    // A batch refused for the client's mistake (R20).
    session
        .evaluate_raw(evaluate_request("bad", &[("", "", "")]))
        .await
        .unwrap_err();

    telemetry.shutdown().await;
    let spans = collector.spans.lock().unwrap().clone();
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };
    let batches = named("guardmesh.v1.PreToolService/Evaluate");
    assert_eq!(
        batches.len(),
        2,
        "one span per batch: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    let (batch, refused) = match batches
        .iter()
        .position(|s| int(s, "rpc.grpc.status_code") == 0)
    {
        Some(0) => (batches[0], batches[1]),
        Some(_) => (batches[1], batches[0]),
        None => panic!("no batch span with status OK: {batches:?}"),
    };
    assert_eq!(hex(&batch.trace_id), coordinator_trace);
    assert_eq!(
        hex(&batch.parent_span_id),
        coordinator_span,
        "child of the agent's span"
    );
    // The RPC conventions (v1.37 names by default), with numbers as
    // numbers.
    assert_eq!(batch.kind, SpanKind::Server as i32);
    assert_eq!(string(batch, "rpc.system"), "grpc");
    assert_eq!(string(batch, "rpc.service"), "guardmesh.v1.PreToolService");
    assert_eq!(string(batch, "rpc.method"), "Evaluate");
    assert_eq!(int(batch, "rpc.grpc.status_code"), 0);
    assert_eq!(string(batch, "server.address"), "127.0.0.1");
    let mesh_port: i64 = mesh.url.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(int(batch, "server.port"), mesh_port);
    assert!(!has(batch, "error.type"), "a decided batch is no error");
    assert_eq!(string(batch, "gen_ai.conversation.id"), "s");
    assert_eq!(string(batch, "guardmesh.session_id"), "s");
    assert_eq!(int(batch, "guardmesh.calls.steer"), 1);
    assert_eq!(int(batch, "guardmesh.calls.proceed"), 1);
    assert_eq!(int(batch, "guardmesh.batch.calls"), 2);
    assert_eq!(int(batch, "guardmesh.turn_index"), 0);
    assert!(int(batch, "guardmesh.chain.revision") > 0);
    // A client's bad batch: its status code, and no server error.
    assert_eq!(int(refused, "rpc.grpc.status_code"), 3, "INVALID_ARGUMENT");
    assert!(!has(refused, "error.type"), "{refused:?}");
    assert_no_internal_fields(&spans);

    // Per guard consulted: an `apply_guardrail {guard}` span under the
    // batch span (the GenAI security conventions), one event per call.
    let guardrails: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name.starts_with("apply_guardrail "))
        .collect();
    assert_eq!(
        guardrails.len(),
        4,
        "one guardrail span per guard consulted"
    );
    let guardrail = |name: &str| -> &Span {
        guardrails
            .iter()
            .find(|s| s.name == format!("apply_guardrail {name}"))
            .unwrap_or_else(|| panic!("no span for {name}: {guardrails:?}"))
    };
    for span in &guardrails {
        assert_eq!(span.kind, SpanKind::Internal as i32);
        assert_eq!(
            span.parent_span_id, batch.span_id,
            "child of the batch span"
        );
        assert_eq!(string(span, "gen_ai.operation.name"), "apply_guardrail");
        assert_eq!(string(span, "gen_ai.security.target.type"), "tool_call");
        assert_eq!(string(span, "gen_ai.conversation.id"), "s");
        assert_eq!(int(span, "guardmesh.calls.sent"), 2);
        let guardian = string(span, "gen_ai.guardian.name");
        assert_eq!(span.name, format!("apply_guardrail {guardian}"));
        // One event per call, carrying the tool, the call id and what the
        // guard said.
        let mut events: Vec<(String, String, String)> = span
            .events
            .iter()
            .map(|e| {
                (
                    string_in(&e.attributes, "gen_ai.tool.call.id"),
                    string_in(&e.attributes, "gen_ai.tool.name"),
                    string_in(&e.attributes, "guardmesh.action"),
                )
            })
            .collect();
        events.sort();
        let want: Vec<(String, String, String)> = match guardian.as_str() {
            "vetoer" => vec![("c1", "t", "steer"), ("c2", "read", "proceed")],
            "quiet" => vec![("c1", "t", "proceed"), ("c2", "read", "proceed")],
            "auditor" => vec![("c1", "t", "cancel"), ("c2", "read", "cancel")],
            "down" => vec![("c1", "t", "failed"), ("c2", "read", "failed")],
            other => panic!("unexpected guard {other}"),
        }
        .into_iter()
        .map(|(a, b, c)| (a.to_owned(), b.to_owned(), c.to_owned()))
        .collect();
        assert_eq!(events, want, "{guardian}");
    }
    let decision = |name: &str| string(guardrail(name), "gen_ai.security.decision.type");
    assert_eq!(decision("vetoer"), "deny");
    assert_eq!(decision("quiet"), "allow");
    assert_eq!(decision("auditor"), "audit", "a dry-run guard only audits");
    assert_eq!(
        decision("down"),
        "allow",
        "fail_open lets the calls through"
    );
    assert!(!has(guardrail("vetoer"), "error.type"));
    assert!(!string(guardrail("down"), "error.type").is_empty());
    assert_eq!(
        guardrail("down").status.as_ref().map(|s| s.code),
        Some(2),
        "a failed guard's span is an error"
    );

    // A remote guard's exchange: a client span under its guardrail span.
    let guard_spans = named("guardmesh.v1.GuardService/Judge");
    assert_eq!(guard_spans.len(), 4, "one client span per remote guard");
    for span in &guard_spans {
        assert_eq!(hex(&span.trace_id), coordinator_trace);
        assert_eq!(span.kind, SpanKind::Client as i32);
        assert_eq!(string(span, "rpc.system"), "grpc");
        assert_eq!(string(span, "rpc.service"), "guardmesh.v1.GuardService");
        assert_eq!(string(span, "rpc.method"), "Judge");
        assert_eq!(string(span, "server.address"), "127.0.0.1");
        assert!(int(span, "server.port") > 0);
        assert!(
            guardrails.iter().any(|g| g.span_id == span.parent_span_id),
            "child of a guardrail span"
        );
    }
    let judge = |name: &str| -> &Span {
        let parent = &guardrail(name).span_id;
        guard_spans
            .iter()
            .find(|s| &s.parent_span_id == parent)
            .unwrap()
    };
    let vetoer = judge("vetoer");
    assert_eq!(int(vetoer, "rpc.grpc.status_code"), 0);
    let guard_port: i64 = guard.url.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(int(vetoer, "server.port"), guard_port);
    assert!(!has(vetoer, "error.type"));
    assert_eq!(string(guardrail("vetoer"), "guardmesh.status"), "skipped");
    let failed = judge("down");
    assert_ne!(int(failed, "rpc.grpc.status_code"), 0);
    assert_eq!(string(failed, "error.type"), "UNAVAILABLE");
    // The Rust guard's own span (served by the SDK) joined the same trace,
    // under the mesh's client span for it.
    let judged = named("guard.judge");
    assert!(!judged.is_empty(), "the SDK guard exported its span");
    assert!(judged.iter().all(|s| hex(&s.trace_id) == coordinator_trace));
    assert!(judged.iter().any(|s| s.parent_span_id == vetoer.span_id));
    for span in &judged {
        assert_eq!(int(span, "calls"), 2, "the SDK's count is an int");
    }
    // No transport-internal spans leave the process.
    assert!(
        spans.iter().all(|s| s.name.starts_with("guardmesh.")
            || s.name.starts_with("apply_guardrail ")
            || s.name == "guard.judge"),
        "{:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
}
