//! OTLP over HTTP with protobuf bodies, to an in-process receiver on
//! loopback: the protocol variables are honoured, the current RPC attribute
//! names are emitted on request (`OTEL_SEMCONV_STABILITY_OPT_IN`), a failed
//! export is counted in the metrics, and a protocol the mesh cannot speak
//! stops it at start with a message naming the variable.

use crate::harness::*;
use crate::otel::{assert_no_internal_fields, exporting_telemetry, int, string};
use guardmesh_client::Batch;
use guardmesh_client::Registration;
use guardmesh_client::verdict::steer;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the receiver saw: the spans it accepted, each request's path and
/// content type, and the bodies it accepted by path.
#[derive(Default)]
pub(crate) struct Received {
    spans: Vec<Span>,
    pub(crate) requests: Vec<(String, String)>,
    pub(crate) bodies: Vec<(String, Vec<u8>)>,
}

/// An OTLP/HTTP receiver on loopback. With `fail_first` it answers
/// `400 Bad Request` to its first export (a failure the exporter does not
/// retry); it accepts the rest.
pub(crate) async fn receiver(fail_first: bool) -> (String, Arc<Mutex<Received>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received = Arc::new(Mutex::new(Received::default()));
    tokio::spawn({
        let received = received.clone();
        async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let received = received.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 8192];
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                    let header = |name: &str| header_value(&head, name).unwrap_or_default();
                    let length: usize = header("content-length").parse().unwrap_or(0);
                    while buf.len() < head_end + length {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let path = head
                        .split_whitespace()
                        .nth(1)
                        .unwrap_or_default()
                        .to_owned();
                    let body = &buf[head_end..head_end + length];
                    let first = {
                        let mut received = received.lock().unwrap();
                        received
                            .requests
                            .push((path.clone(), header("content-type")));
                        let first = fail_first && received.requests.len() == 1;
                        let traces = path == "/v1/traces";
                        if !first {
                            received.bodies.push((path, body.to_vec()));
                        }
                        if !first
                            && traces
                            && let Ok(request) = ExportTraceServiceRequest::decode(body)
                        {
                            for rs in request.resource_spans {
                                for ss in rs.scope_spans {
                                    received.spans.extend(ss.spans);
                                }
                            }
                        }
                        first
                    };
                    let status = if first { "400 Bad Request" } else { "200 OK" };
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/x-protobuf\r\n\
                         content-length: 0\r\nconnection: close\r\n\r\n"
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        }
    });
    (url, received)
}

fn failures(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("guardmesh_otlp_export_failures_total{signal=\"traces\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no export failure series in\n{metrics}"))
}

#[test]
fn otlp_http_protobuf_exports_current_rpc_names_and_counts_failures() {
    isolated(
        "otel_http::otlp_http_protobuf_exports_current_rpc_names_and_counts_failures_in_own_process",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs in its own process through otlp_http_protobuf_exports_current_rpc_names_and_counts_failures"]
async fn otlp_http_protobuf_exports_current_rpc_names_and_counts_failures_in_own_process() {
    let (endpoint, received) = receiver(true).await;
    // SAFETY: this test runs alone in its own process (see the wrapper
    // above); nothing else reads the environment concurrently here.
    unsafe {
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
        std::env::set_var("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf");
        std::env::set_var("OTEL_SEMCONV_STABILITY_OPT_IN", "rpc/dup");
        std::env::set_var("OTEL_SERVICE_NAME", "guardmesh-under-test");
    }
    let telemetry = exporting_telemetry("error");
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, "no"))).await;
    mesh.register(Registration::validate("vetoer", &guard.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let metrics = &mesh.mesh.metrics;
    assert_eq!(failures(&metrics.encode_prometheus()), 0.0, "present at 0");

    // The receiver refuses the first export: counted, and the mesh goes on.
    session
        .evaluate(Batch::new(0).call("c0", "t", "{}"))
        .await
        .unwrap();
    let mut counted = 0.0;
    for _ in 0..100 {
        telemetry.flush().await;
        counted = failures(&metrics.encode_prometheus());
        if counted > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(counted, 1.0, "the refused export is counted once");

    session
        .evaluate(Batch::new(1).call("c1", "t", "{}"))
        .await
        .unwrap();
    telemetry.shutdown().await;

    let received = received.lock().unwrap();
    assert!(received.requests.len() >= 2, "{:?}", received.requests);
    for (path, content_type) in &received.requests {
        assert_eq!(path, "/v1/traces");
        assert_eq!(content_type, "application/x-protobuf");
    }
    let spans = &received.spans;
    assert_no_internal_fields(spans);
    let batches: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "guardmesh.v1.PreToolService/Evaluate")
        .collect();
    assert!(
        !batches.is_empty(),
        "{:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    for batch in batches {
        // rpc/dup: the current names and the v1.37 ones, the method fully
        // qualified.
        assert_eq!(string(batch, "rpc.system.name"), "grpc");
        assert_eq!(string(batch, "rpc.system"), "grpc");
        assert_eq!(
            string(batch, "rpc.method"),
            "guardmesh.v1.PreToolService/Evaluate"
        );
        assert_eq!(string(batch, "rpc.status_code"), "OK");
        assert_eq!(int(batch, "rpc.grpc.status_code"), 0);
        assert!(int(batch, "server.port") > 0);
        assert_eq!(string(batch, "gen_ai.conversation.id"), "s");
    }
    let guardrail = spans
        .iter()
        .find(|s| s.name == "apply_guardrail vetoer")
        .expect("the guardrail span");
    assert_eq!(string(guardrail, "gen_ai.security.decision.type"), "deny");
    let judge = spans
        .iter()
        .find(|s| s.parent_span_id == guardrail.span_id)
        .expect("the guard's client span");
    assert_eq!(judge.name, "guardmesh.v1.GuardService/Judge");
    assert_eq!(
        string(judge, "rpc.method"),
        "guardmesh.v1.GuardService/Judge"
    );
    assert_eq!(string(judge, "rpc.status_code"), "OK");
}

/// A protocol the mesh cannot export with stops `serve` at start, with a
/// message naming the variable and the accepted values: it is never
/// silently replaced by another.
#[test]
fn an_unsupported_otlp_protocol_refuses_to_start_naming_the_variable() {
    for (var, value) in [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift"),
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
            .env(var, value)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start guardmesh serve");
        let (status, stderr) = exit_within_20s(&mut child);
        let Some(status) = status else {
            panic!("serve started with {var}={value}");
        };
        assert!(!status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!("{var}={value:?} is not supported")),
            "{stderr}"
        );
        assert!(
            stderr.contains("\"grpc\" and \"http/protobuf\""),
            "{stderr}"
        );
    }
}
