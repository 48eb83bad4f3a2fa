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
    for batch in [
        // 1: a vetoed call and a proceeding one.
        Batch::new(0)
            .call("a", "danger", "{}")
            .call("b", "ok", "{}"),
        // 2: a failed fail_open guard, bypassed.
        Batch::new(1).call("c", "net.get", "{}"),
        // 3: a malformed verdict and a steer.
        Batch::new(2)
            .call("d", "blank", "{}")
            .call("e", "typo", "{}"),
    ] {
        session.evaluate(batch).await.unwrap();
    }
    // 4: a refused batch.
    session
        .evaluate_raw(evaluate_request("bad", &[("", "", "")]))
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
        let channel = channel(url).await;
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
        let channel = channel(url).await;
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
    let channel = channel(&mesh.url).await;
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

/// `GET /metrics` with an `Accept` header: the content type and the body.
/// [`scrape`] without `Accept`, which must answer Prometheus text: the text.
async fn scrape_prometheus_text(addr: std::net::SocketAddr) -> String {
    let (content_type, text) = scrape(addr, None).await;
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    text
}

async fn scrape(addr: std::net::SocketAddr, accept: Option<&str>) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    let request = format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    let content_type = header_value(head, "content-type").unwrap_or_default();
    (content_type, body.to_owned())
}

/// Parses `text` with the Python `prometheus_client` parser of `format`
/// (`prometheus`: the Prometheus text format; `openmetrics`): each family's
/// type and samples, as JSON.
fn parsed(format: &str, text: &str) -> serde_json::Value {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families as prometheus
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
parse = prometheus if sys.argv[1] == "prometheus" else openmetrics
families = {}
for family in parse(sys.stdin.read()):
    families[family.name] = {
        "type": family.type,
        "samples": [[s.name, s.labels, s.value] for s in family.samples],
    }
print(json.dumps(families))
"#;
    let output = run_with_input(
        std::process::Command::new(python()).args(["-c", SCRIPT, format]),
        text.as_bytes(),
    );
    assert!(
        output.status.success(),
        "the {format} parser refused the metrics:\n{}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The value of the sample `name` with `labels` in parsed `families`.
fn sample(families: &serde_json::Value, family: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let samples = families[family]["samples"]
        .as_array()
        .unwrap_or_else(|| panic!("no family {family}"));
    samples
        .iter()
        .find(|s| s[0] == name && labels.iter().all(|(k, v)| s[1][*k].as_str() == Some(*v)))
        .and_then(|s| s[2].as_f64())
        .unwrap_or_else(|| panic!("no sample {name}{labels:?} in {family}: {samples:?}"))
}

/// Both formats parse with real parsers, by the `Accept` header; every
/// registered guard's series exist at 0 before its first batch; a dry-run
/// guard's calls are split by what it would have done; `process_*` and
/// `guardmesh_build_info` are there; the latency buckets reach the longest
/// batch the mesh allows.
#[tokio::test]
async fn metrics_parse_as_prometheus_text_and_openmetrics() {
    let config = fast_config();
    let max_batch = config.max_batch_timeout.as_secs_f64();
    let mesh = TestMesh::with_config(config).await;
    let veto = call_guard(Duration::ZERO, |c| match c.tool.as_str() {
        "danger" => Some(cancel(&c.call_id, "denied")),
        _ => None,
    })
    .await;
    let candidate = call_guard(Duration::ZERO, |c| match c.tool.as_str() {
        "typo" => Some(steer(&c.call_id, "fix it")),
        "danger" | "net.get" => Some(cancel(&c.call_id, "no")),
        _ => None,
    })
    .await;
    mesh.register(Registration::validate("veto", &veto.url))
        .await;
    mesh.register(Registration::validate("candidate", &candidate.url).dry_run())
        .await;
    let addr = guardmesh_server::observe::metrics_http::spawn(
        "127.0.0.1:0".parse().unwrap(),
        mesh.mesh.metrics.clone(),
    )
    .await
    .unwrap();

    // Registered, not yet used: the guards' series are there, at 0.
    let text = scrape_prometheus_text(addr).await;
    let before = parsed("prometheus", &text);
    for guard in ["veto", "candidate"] {
        for status in ["proceeded", "skipped", "failed", "timed_out", "dry_run"] {
            assert_eq!(
                sample(
                    &before,
                    "guardmesh_guard_outcomes",
                    "guardmesh_guard_outcomes_total",
                    &[("guard", guard), ("status", status)]
                ),
                0.0
            );
        }
        assert_eq!(
            sample(
                &before,
                "guardmesh_guard_latency_seconds",
                "guardmesh_guard_latency_seconds_count",
                &[("guard", guard)]
            ),
            0.0
        );
    }
    assert_eq!(
        sample(
            &before,
            "guardmesh_dry_run_calls",
            "guardmesh_dry_run_calls_total",
            &[("guard", "candidate"), ("would", "cancel")]
        ),
        0.0
    );

    let session = mesh.coordinator().await.session("s").await.unwrap();
    session
        .evaluate(
            Batch::new(0)
                .call("a", "danger", "{}")
                .call("b", "typo", "{}")
                .call("c", "net.get", "{}")
                .call("d", "ok", "{}"),
        )
        .await
        .unwrap();

    let text = scrape_prometheus_text(addr).await;
    let (om_type, om_text) = scrape(
        addr,
        Some("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3"),
    )
    .await;
    assert!(
        om_type.starts_with("application/openmetrics-text"),
        "{om_type}"
    );
    assert!(om_text.ends_with("# EOF\n"));
    for (format, text) in [("prometheus", &text), ("openmetrics", &om_text)] {
        let families = parsed(format, text);
        let kind = |family: &str| {
            families[family]["type"]
                .as_str()
                .unwrap_or("missing")
                .to_owned()
        };
        for (family, want) in [
            ("guardmesh_batches", "counter"),
            ("guardmesh_calls", "counter"),
            ("guardmesh_guard_outcomes", "counter"),
            ("guardmesh_dry_run_calls", "counter"),
            ("guardmesh_otlp_export_failures", "counter"),
            ("guardmesh_batch_latency_seconds", "histogram"),
            ("guardmesh_guard_latency_seconds", "histogram"),
            ("guardmesh_build_info", "gauge"),
            ("guardmesh_chain_guards", "gauge"),
            ("process_cpu_seconds", "counter"),
            ("process_resident_memory_bytes", "gauge"),
            ("process_open_fds", "gauge"),
            ("process_start_time_seconds", "gauge"),
        ] {
            assert_eq!(kind(family), want, "{format}: {family}");
        }
        assert_eq!(
            sample(
                &families,
                "guardmesh_batches",
                "guardmesh_batches_total",
                &[("outcome", "decided")]
            ),
            1.0,
            "{format}"
        );
        assert_eq!(
            sample(
                &families,
                "guardmesh_build_info",
                "guardmesh_build_info",
                &[("version", env!("CARGO_PKG_VERSION"))]
            ),
            1.0,
            "{format}"
        );
        assert!(
            sample(
                &families,
                "process_resident_memory_bytes",
                "process_resident_memory_bytes",
                &[]
            ) > 0.0
        );
        // The dry-run guard: what it would have done, call by call.
        for (would, want) in [
            ("cancel", 2.0),
            ("steer", 1.0),
            ("proceed", 1.0),
            ("failed", 0.0),
        ] {
            assert_eq!(
                sample(
                    &families,
                    "guardmesh_dry_run_calls",
                    "guardmesh_dry_run_calls_total",
                    &[("guard", "candidate"), ("would", would)]
                ),
                want,
                "{format}: would {would}"
            );
        }
        // The largest finite bucket reaches the longest batch allowed.
        let largest = families["guardmesh_batch_latency_seconds"]["samples"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s[0] == "guardmesh_batch_latency_seconds_bucket")
            .filter_map(|s| s[1]["le"].as_str()?.parse::<f64>().ok())
            .filter(|le| le.is_finite())
            .fold(0.0, f64::max);
        assert!(largest >= max_batch, "{format}: {largest} < {max_batch}");
    }
}
