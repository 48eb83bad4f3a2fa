//! Metrics, health and reflection: what operators' tools see.

use crate::harness::*;
use guardmesh_client::proto::FailurePolicy;
use guardmesh_client::verdict::{cancel, steer};
use guardmesh_client::{Batch, Registration};
use std::time::Duration;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn metrics_count_exactly_what_happened() {
    let mesh = TestMesh::start().await;
    let veto = call_guard(Duration::ZERO, |c| match c.tool.as_str() {
        "danger" => Some(cancel(&c.call_id, "denied")),
        "typo" => Some(steer(&c.call_id, "fix it")),
        "blank" => Some(steer(&c.call_id, " ")),
        _ => None,
    })
    .await;
    let down = closed_port().await;
    mesh.register(Registration::validate("veto", &veto.url))
        .await;
    mesh.register(
        Registration::validate("down", &down)
            .tools(["net.*"])
            .failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    // 1: a vetoed call and a proceeding one.
    session
        .evaluate(
            Batch::new(0)
                .call("a", "danger", "{}")
                .call("b", "ok", "{}"),
        )
        .await
        .unwrap();
    // 2: a failed fail_open guard, bypassed.
    session
        .evaluate(Batch::new(1).call("c", "net.get", "{}"))
        .await
        .unwrap();
    // 3: a malformed verdict and a steer.
    session
        .evaluate(
            Batch::new(2)
                .call("d", "blank", "{}")
                .call("e", "typo", "{}"),
        )
        .await
        .unwrap();
    // 4: a refused batch.
    session
        .evaluate_raw(guardmesh_client::proto::EvaluateRequest {
            batch_id: "bad".into(),
            calls: vec![Default::default()],
            ..Default::default()
        })
        .await
        .unwrap_err();

    let addr = guardmesh_server::observe::metrics_http::spawn(
        "127.0.0.1:0".parse().unwrap(),
        mesh.mesh.metrics.clone(),
    )
    .await
    .unwrap();
    let text = http_get(addr, "/metrics").await;
    let expect = [
        (r#"guardmesh_batches_total{outcome="decided"}"#, 3.0),
        (r#"guardmesh_batches_total{outcome="refused"}"#, 1.0),
        (
            r#"guardmesh_batches_refused_total{reason="empty_call_id"}"#,
            1.0,
        ),
        (r#"guardmesh_calls_total{decision="proceed"}"#, 3.0),
        (r#"guardmesh_calls_total{decision="cancel"}"#, 1.0),
        (r#"guardmesh_calls_total{decision="steer"}"#, 1.0),
        (
            r#"guardmesh_guard_outcomes_total{guard="veto",status="skipped"}"#,
            1.0,
        ),
        (
            r#"guardmesh_guard_outcomes_total{guard="veto",status="malformed"}"#,
            1.0,
        ),
        (
            r#"guardmesh_guard_outcomes_total{guard="veto",status="proceeded"}"#,
            1.0,
        ),
        (
            r#"guardmesh_guard_outcomes_total{guard="down",status="failed"}"#,
            1.0,
        ),
        (
            r#"guardmesh_guard_outcomes_total{guard="down",status="not_applicable"}"#,
            2.0,
        ),
        (r#"guardmesh_guard_bypassed_calls_total{guard="down"}"#, 1.0),
        ("guardmesh_chain_guards", 2.0),
        ("guardmesh_batch_latency_seconds_count", 3.0),
    ];
    for (series, want) in expect {
        assert_eq!(value(&text, series), want, "{series} in\n{text}");
    }
    let missing = http_get(addr, "/nope").await;
    assert!(missing.contains("/metrics"));
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn health_reports_serving_on_mesh_and_sdk_guard() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    for (url, service) in [
        (&mesh.url, "guardmesh.v1.PreToolService"),
        (&mesh.url, "guardmesh.v1.GuardRegistry"),
        (&guard.url, "guardmesh.v1.GuardService"),
        (&mesh.url, ""),
    ] {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = HealthClient::new(channel);
        let status = client
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{url} {service:?}");
    }
}

#[tokio::test]
async fn reflection_lists_the_guardmesh_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    for (url, want) in [
        (
            &mesh.url,
            vec![
                "guardmesh.v1.PreToolService",
                "guardmesh.v1.GuardRegistry",
                "grpc.health.v1.Health",
            ],
        ),
        (
            &guard.url,
            vec!["guardmesh.v1.GuardService", "grpc.health.v1.Health"],
        ),
    ] {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .unwrap()
            .into_inner();
        let answer = answers.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("unexpected reflection answer")
        };
        let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
        for service in want {
            assert!(names.contains(&service), "{url}: {service} in {names:?}");
        }
    }
}

/// The standard Python `grpcio-reflection` client (and older grpcurl) speak
/// reflection `v1alpha`: the mesh answers it as well as `v1`, listing its
/// services and serving their descriptors.
#[tokio::test]
async fn reflection_v1alpha_lists_and_describes_the_guardmesh_services() {
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    let mesh = TestMesh::start().await;
    let channel = tonic::transport::Endpoint::from_shared(mesh.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("guardmesh.v1.PreToolService".into()),
    ]
    .map(|message| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(message),
    });
    let mut answers = client
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .expect("reflection v1alpha is served")
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("unexpected reflection answer: {answer:?}")
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    for service in [
        "guardmesh.v1.PreToolService",
        "guardmesh.v1.GuardRegistry",
        "grpc.health.v1.Health",
    ] {
        assert!(names.contains(&service), "{service} in {names:?}");
    }
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(files)) = answer.message_response else {
        panic!("unexpected reflection answer: {answer:?}")
    };
    assert!(!files.file_descriptor_proto.is_empty());
}
