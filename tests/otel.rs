//! One trace across coordinator, mesh and guard (R21, R22), exported for real
//! over OTLP/gRPC to an in-process collector on loopback.
//!
//! This file holds a single test: it installs the process-wide subscriber.

use crate::harness::*;
use guardmesh_client::Batch;
use guardmesh_client::Registration;
use guardmesh_client::verdict::steer;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

#[derive(Default, Clone)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            Value::BoolValue(b) => Some(b.to_string()),
            other => Some(format!("{other:?}")),
        }
    })
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
    let collector = Collector::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn({
        let collector = collector.clone();
        async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector))
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
                .unwrap();
        }
    });
    // The standard variables configure the real exporter.
    // SAFETY: this test runs alone in its own process (see the wrapper
    // above); nothing else reads the environment concurrently here.
    unsafe {
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
        std::env::set_var("OTEL_SERVICE_NAME", "guardmesh-under-test");
    }
    let telemetry = guardmesh_server::observe::telemetry::init(
        guardmesh_server::observe::telemetry::LogFormat::Human,
        "warn",
    )
    .unwrap();
    assert!(telemetry.exporting());

    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, "no"))).await;
    let quiet = proceed_guard().await;
    mesh.register(Registration::validate("vetoer", &guard.url))
        .await;
    mesh.register(Registration::validate("quiet", &quiet.url))
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
        .evaluate(Batch::new(0).call("c1", "t", "{}"))
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

    telemetry.shutdown().await;
    let spans = collector.spans.lock().unwrap().clone();
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };
    let batch = named("guardmesh.v1.PreToolService/Evaluate");
    assert_eq!(
        batch.len(),
        1,
        "one batch span: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    let batch = batch[0];
    assert_eq!(hex(&batch.trace_id), coordinator_trace);
    assert_eq!(
        hex(&batch.parent_span_id),
        coordinator_span,
        "child of the agent's span"
    );
    assert_eq!(attr(batch, "rpc.system").as_deref(), Some("grpc"));
    assert_eq!(attr(batch, "guardmesh.session_id").as_deref(), Some("s"));
    assert_eq!(attr(batch, "guardmesh.calls.steer").as_deref(), Some("1"));
    let guard_spans = named("guardmesh.v1.GuardService/Judge");
    assert_eq!(guard_spans.len(), 2, "one client span per guard consulted");
    for span in &guard_spans {
        assert_eq!(hex(&span.trace_id), coordinator_trace);
        assert_eq!(
            span.parent_span_id, batch.span_id,
            "child of the batch span"
        );
    }
    let vetoer = guard_spans
        .iter()
        .find(|s| attr(s, "guardmesh.guard").as_deref() == Some("vetoer"))
        .unwrap();
    assert_eq!(attr(vetoer, "guardmesh.status").as_deref(), Some("skipped"));
    // The Rust guard's own span (served by the SDK) joined the same trace,
    // under the mesh's client span for it.
    let judged = named("guard.judge");
    assert!(!judged.is_empty(), "the SDK guard exported its span");
    assert!(judged.iter().all(|s| hex(&s.trace_id) == coordinator_trace));
    assert!(judged.iter().any(|s| s.parent_span_id == vetoer.span_id));
    // No transport-internal spans leave the process.
    assert!(
        spans
            .iter()
            .all(|s| s.name.starts_with("guardmesh.") || s.name == "guard.judge"),
        "{:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
}
