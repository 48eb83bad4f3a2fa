//! The decision log exported as OpenTelemetry log records (R29,
//! `[decision_log] otlp = true`): `guardmesh serve` sends every record it
//! writes over OTLP/gRPC to a logs collector this test serves on loopback,
//! configured by the standard `OTEL_EXPORTER_OTLP_*` variables; the record
//! received is the line in the file, masked, linked to the batch's trace.

use crate::harness::*;
use guardmesh_client::Batch;
use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::logs::v1::LogRecord;
use prost::Message;
use serde_json::Value;
use std::time::Duration;

const SECRET: &str = "hunter2-otlp-secret";

fn attribute(record: &LogRecord, key: &str) -> Option<Any> {
    record
        .attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.clone()?.value)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn r29_records_are_exported_over_otlp_grpc_as_log_records_masked_and_linked_to_the_trace() {
    exported(Via::Grpc).await;
}

/// The same over OTLP/HTTP with protobuf bodies
/// (`OTEL_EXPORTER_OTLP_LOGS_PROTOCOL=http/protobuf`), to `/v1/logs`.
#[tokio::test]
async fn r29_records_are_exported_over_otlp_http_protobuf_as_log_records_masked_and_linked_to_the_trace()
 {
    exported(Via::HttpProtobuf).await;
}

#[derive(Debug, Clone, Copy)]
enum Via {
    Grpc,
    HttpProtobuf,
}

/// The first log record the collector received, if any.
type FirstRecord = Box<dyn Fn() -> Option<LogRecord> + Send>;

/// A logs collector on loopback for `via`: the environment that points the
/// mesh at it, and its first record.
async fn collector(via: Via) -> (Vec<(&'static str, String)>, FirstRecord) {
    match via {
        Via::Grpc => {
            let (collector, endpoint) = Collector::serve().await;
            let first: FirstRecord =
                Box::new(move || collector.logs.lock().unwrap().first().cloned());
            (vec![("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)], first)
        }
        Via::HttpProtobuf => {
            let (endpoint, received) = crate::otel_http::receiver(false).await;
            let first: FirstRecord = Box::new(move || {
                let received = received.lock().unwrap();
                received
                    .bodies
                    .iter()
                    .filter(|(path, _)| path == "/v1/logs")
                    .filter_map(|(_, body)| ExportLogsServiceRequest::decode(&body[..]).ok())
                    .flat_map(|request| request.resource_logs)
                    .flat_map(|resource| resource.scope_logs)
                    .flat_map(|scope| scope.log_records)
                    .next()
            });
            (
                vec![
                    (
                        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
                        format!("{endpoint}/v1/logs"),
                    ),
                    ("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/protobuf".into()),
                ],
                first,
            )
        }
    }
}

async fn exported(via: Via) {
    let (environment, first_record) = collector(via).await;

    let dir = fresh_dir(&format!("declog-otlp-{via:?}"));
    let log = dir.join("log");
    let config = log_config_file(&dir, &log, "mask = [\"password\"]\notlp = true\n");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let _serve = KillOnDrop(
        serve_command(&config, port)
            .envs(environment)
            // The batch processor exports every 100 ms instead of 1 s.
            .env("OTEL_BLRP_SCHEDULE_DELAY", "100")
            .env_remove("OTEL_TRACES_EXPORTER")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let coordinator = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(c) = guardmesh_client::Coordinator::connect(url.clone()).await {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the mesh starts");

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let decision = coordinator
        .evaluate_once(
            "s",
            Batch::new(0)
                .call(
                    "c1",
                    "login",
                    format!(r#"{{"user": "ann", "password": "{SECRET}"}}"#),
                )
                .traceparent(format!("00-{trace}-00f067aa0ba902b7-01")),
        )
        .await
        .unwrap();
    assert_eq!(decision.trace_id, trace);

    // The line in the file.
    let lines = log_lines(&log);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    let written: Value = serde_json::from_str(line).unwrap();

    // The log record received: bounded wait for the batch processor.
    let received = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            if let Some(record) = first_record() {
                break record;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a log record reaches the collector");
    let body = match received.body.clone().and_then(|b| b.value) {
        Some(Any::StringValue(body)) => body,
        other => panic!("body is not a string: {other:?}"),
    };
    assert_eq!(&body, line, "the body is the record as written");
    assert!(!body.contains(SECRET), "masked in the export too");
    assert!(body.contains(r#""password":"[masked]""#), "{body}");
    assert_eq!(
        attribute(&received, "guardmesh.record.id"),
        Some(Any::StringValue(written["id"].as_str().unwrap().to_owned()))
    );
    assert_eq!(
        attribute(&received, "guardmesh.record.kind"),
        Some(Any::StringValue("decision".into()))
    );
    assert_eq!(
        attribute(&received, "guardmesh.batch.id"),
        Some(Any::StringValue("s/0".into()))
    );
    assert_eq!(
        attribute(&received, "guardmesh.record.seq"),
        Some(Any::IntValue(0))
    );
    assert_eq!(
        hex(&received.trace_id),
        trace,
        "linked to the batch's trace"
    );
    assert_eq!(received.event_name, "guardmesh.decision_log.record");
    // Its time is the record's (RFC 3339 in the line, nanoseconds here).
    let time = time::OffsetDateTime::parse(
        written["time"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert_eq!(
        i128::from(received.time_unix_nano),
        time.unix_timestamp_nanos()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A log protocol the mesh cannot export with stops `serve` at start, naming
/// the variable: the records are never sent over another protocol than the
/// one asked for.
#[test]
fn r29_an_unsupported_logs_protocol_refuses_to_start_naming_the_variable() {
    let dir = fresh_dir("declog-otlp-protocol");
    let config = log_config_file(&dir, &dir.join("log"), "otlp = true\n");
    let mut child = serve_command(&config, 0)
        .env(
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
            "http://127.0.0.1:9/v1/logs",
        )
        .env("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "http/json")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start guardmesh serve");
    // Bounded: a mesh that starts anyway is killed and the test fails.
    let (exited, stderr) = exit_within_20s(&mut child);
    let status =
        exited.unwrap_or_else(|| panic!("serve started with an unsupported protocol\n{stderr}"));
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL=\"http/json\" is not supported"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
