//! One pipeline behind every door: a batch judged through the coordinator
//! stream (`Evaluate`), a unary call (`EvaluateBatch`), the mesh in a
//! gateway's process (`InProcess`), the interceptor invoke and
//! `Mesh::evaluate_unrecorded` (replay) gets the same decision or the same
//! refusal (R1, R13, R19, R20, R25), the same decision record (R29) and the
//! same metrics, from one table. A check added at one door and forgotten at
//! another fails here.

use crate::harness::*;
use guardmesh_client::proto::interceptor_service_client::InterceptorServiceClient;
use guardmesh_client::proto::pre_tool_service_client::PreToolServiceClient;
use guardmesh_client::proto::{
    Action, BatchContext, BatchDecision, EvaluateRequest, InterceptorInvokeRequest, ToolCall,
    evaluate_response,
};
use guardmesh_server::Server;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tonic::Code;

/// The doors a batch enters by.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Door {
    Stream,
    Unary,
    InProcess,
    Invoke,
    Unrecorded,
}

/// What a row of the table expects at every door.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    /// Decided: per call, its action and the guard that decided (empty
    /// for a proceed).
    Decided(Vec<(&'static str, Action, &'static str)>),
    /// Refused: the status code, the refusal's metrics reason, and words
    /// its message names.
    Refused(Code, &'static str, &'static str),
}

struct Row {
    batch: EvaluateRequest,
    /// The guard an interceptor invoke of this row names; `None` where the
    /// invoke does not apply (it judges exactly one call).
    invoke: Option<&'static str>,
    expect: Expect,
}

fn call(call_id: &str, tool: &str, arguments: &str) -> ToolCall {
    ToolCall {
        call_id: call_id.into(),
        tool: tool.into(),
        arguments: arguments.into(),
    }
}

fn batch(batch_id: &str, calls: Vec<ToolCall>) -> EvaluateRequest {
    EvaluateRequest {
        batch_id: batch_id.into(),
        calls,
        timeout_ms: 3_000,
        ..Default::default()
    }
}

/// Limits of the doors' meshes: small, so that each limit is cheap to hit.
const MAX_CALLS: usize = 4;
const MAX_BATCH_BYTES: usize = 16 * 1024;

fn table() -> Vec<Row> {
    use Expect::{Decided, Refused};
    let invalid = Code::InvalidArgument;
    vec![
        // R1: no calls, no guard contacted, decided at once.
        Row {
            batch: batch("zero", vec![]),
            invoke: None,
            expect: Decided(vec![]),
        },
        // R3: the chain's guards, one decision per call.
        Row {
            batch: batch(
                "judged",
                vec![call("c1", "read", "{}"), call("c2", "danger", "{}")],
            ),
            invoke: None,
            expect: Decided(vec![
                ("c1", Action::Proceed, ""),
                ("c2", Action::Cancel, "policy"),
            ]),
        },
        Row {
            batch: batch("vetoed", vec![call("c1", "danger", r#"{"n": 1}"#)]),
            invoke: Some("policy"),
            expect: Decided(vec![("c1", Action::Cancel, "policy")]),
        },
        // R13: a guard that cannot be reached cancels its calls (fail_closed).
        Row {
            batch: batch("down", vec![call("c1", "pay.send", "{}")]),
            invoke: Some("down"),
            expect: Decided(vec![("c1", Action::Cancel, "down")]),
        },
        // R20: bad calls, refused before any guard.
        Row {
            batch: batch("empty-call-id", vec![call("", "read", "{}")]),
            invoke: Some("policy"),
            expect: Refused(invalid, "empty_call_id", "call_id"),
        },
        Row {
            batch: batch(
                "duplicate-call-id",
                vec![call("c1", "read", "{}"), call("c1", "read", "{}")],
            ),
            invoke: None,
            expect: Refused(invalid, "duplicate_call_id", "c1"),
        },
        Row {
            batch: batch("bad-tool", vec![call("c1", "rm -rf", "{}")]),
            invoke: Some("policy"),
            expect: Refused(invalid, "tool_name_outside_grammar", "c1"),
        },
        Row {
            batch: batch(
                "duplicate-member",
                vec![call("c1", "read", r#"{"a": 1, "a": 2}"#)],
            ),
            invoke: Some("policy"),
            expect: Refused(invalid, "arguments_not_i_json", "c1"),
        },
        Row {
            batch: batch(
                "case-fold",
                vec![call("c1", "read", r#"{"path": 1, "PATH": 2}"#)],
            ),
            invoke: Some("policy"),
            expect: Refused(invalid, "arguments_case_collision", "c1"),
        },
        Row {
            batch: batch(&"b".repeat(300), vec![call("c1", "read", "{}")]),
            invoke: Some("policy"),
            expect: Refused(invalid, "batch_id_too_long", "batch_id is 300 bytes"),
        },
        // R34, R20: a session id is bounded like batch and call ids.
        Row {
            batch: EvaluateRequest {
                context: Some(BatchContext {
                    session_id: "s".repeat(300),
                    ..Default::default()
                }),
                ..batch("long-session-id", vec![call("c1", "read", "{}")])
            },
            invoke: Some("policy"),
            expect: Refused(invalid, "session_id_too_long", "limits.max_id_bytes"),
        },
        // R20, R25: sizes and counts.
        Row {
            batch: batch(
                "too-many-calls",
                (0..=MAX_CALLS)
                    .map(|i| call(&format!("c{i}"), "read", "{}"))
                    .collect(),
            ),
            invoke: None,
            expect: Refused(
                Code::ResourceExhausted,
                "too_many_calls",
                "max_calls_per_batch",
            ),
        },
        Row {
            batch: batch(
                "too-big",
                vec![call(
                    "c1",
                    "read",
                    &json!({ "text": "x".repeat(MAX_BATCH_BYTES) }).to_string(),
                )],
            ),
            invoke: Some("policy"),
            expect: Refused(
                Code::ResourceExhausted,
                "batch_too_large",
                "max_batch_bytes",
            ),
        },
    ]
}

/// The policy guard: cancels every `danger` call.
const POLICY: &str = r#"
[[rule]]
name = "no-danger"
tools = ["danger"]
when = "true"
action = "cancel"
message = '"no danger"'
"#;

/// A mesh config with the policy guard, a remote guard that is down (for
/// `pay.*`), small limits, and its decision log in `dir/log`.
fn config(dir: &Path, down: &str) -> PathBuf {
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let text = format!(
        "[limits]\nmax_calls_per_batch = {MAX_CALLS}\nmax_batch_bytes = {MAX_BATCH_BYTES}\n\n\
         [decision_log]\ndir = {:?}\n\n\
         [[guard]]\nname = \"policy\"\npolicy = {:?}\n\n\
         [[guard]]\nname = \"down\"\nendpoint = {down:?}\ntools = [\"pay.*\"]\n\
         failure_policy = \"fail_closed\"\ntimeout_ms = 500\n",
        dir.join("log").display().to_string(),
        policy.display().to_string()
    );
    let path = dir.join("mesh.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// What one row came to at a door: the decision's calls, or the status.
#[derive(Debug, Clone, PartialEq)]
enum Got {
    Decided(Vec<(String, Action, String)>),
    Refused(Code, String),
}

fn got(answer: Result<BatchDecision, tonic::Status>) -> Got {
    match answer {
        Ok(decision) => Got::Decided(
            decision
                .decisions
                .iter()
                .map(|d| {
                    (
                        d.call_id.clone(),
                        Action::try_from(d.action).unwrap_or(Action::Unspecified),
                        d.decided_by.clone(),
                    )
                })
                .collect(),
        ),
        Err(status) => Got::Refused(status.code(), status.message().to_owned()),
    }
}

/// Checks one row's answer against its expectation.
fn check(door: Door, row: &Row, got: &Got) {
    let id = &row.batch.batch_id[..row.batch.batch_id.len().min(20)];
    match (&row.expect, got) {
        (Expect::Decided(want), Got::Decided(have)) => {
            let want: Vec<(String, Action, String)> = want
                .iter()
                .map(|(c, a, by)| ((*c).to_owned(), *a, (*by).to_owned()))
                .collect();
            assert_eq!(&want, have, "{door:?} {id}");
        }
        (Expect::Refused(code, _, names), Got::Refused(have, message)) => {
            assert_eq!(code, have, "{door:?} {id}: {message}");
            assert!(
                message.contains(names),
                "{door:?} {id}: {message:?} does not name {names:?}"
            );
        }
        (want, have) => panic!("{door:?} {id}: expected {want:?}, got {have:?}"),
    }
}

/// The batch counters of a mesh's metrics: `batches_total` by outcome and
/// `batches_refused_total` by reason.
fn counters(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| {
            l.starts_with("guardmesh_batches_total{")
                || l.starts_with("guardmesh_batches_refused_total{")
        })
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .filter(|(_, value)| value != "0")
        .collect()
}

/// The counters a door's rows must leave.
fn expected_counters(rows: &[&Row]) -> BTreeMap<String, String> {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for row in rows {
        match &row.expect {
            Expect::Decided(_) => {
                *counts
                    .entry(r#"guardmesh_batches_total{outcome="decided"}"#.to_owned())
                    .or_default() += 1;
            }
            Expect::Refused(_, reason, _) => {
                *counts
                    .entry(r#"guardmesh_batches_total{outcome="refused"}"#.to_owned())
                    .or_default() += 1;
                *counts
                    .entry(format!(
                        r#"guardmesh_batches_refused_total{{reason="{reason}"}}"#
                    ))
                    .or_default() += 1;
            }
        }
    }
    counts
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect()
}

/// A record as the table compares it: its batch, outcome and decisions.
fn record_shape(record: &Value) -> Value {
    let decisions: Vec<Value> = record["decisions"]
        .as_array()
        .map(|d| {
            d.iter()
                .map(|d| json!([d["call_id"], d["action"], d["decided_by"]]))
                .collect()
        })
        .unwrap_or_default();
    json!({
        "batch_id": record["batch"]["batch_id"],
        "status": record["outcome"]["status"],
        "code": record["outcome"]["code"],
        "message": record["outcome"]["message"],
        "decisions": decisions,
    })
}

fn decision_records(dir: &Path) -> Vec<Value> {
    records(dir)
        .iter()
        .filter(|r| r["kind"] == "decision")
        .map(record_shape)
        .collect()
}

async fn channel(url: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Runs `rows` through `door` on a mesh of its own; each row's answer,
/// the mesh's batch counters and its decision records.
async fn walk(
    door: Door,
    rows: &[&Row],
    dir: PathBuf,
) -> (Vec<Got>, BTreeMap<String, String>, Vec<Value>) {
    let down = closed_port().await;
    let server = Server::load(&config(&dir, &down)).await.unwrap();
    let mut answers = Vec::new();
    let metrics;
    match door {
        Door::InProcess => {
            let mesh = server.in_process("doors", "test").await.unwrap();
            for row in rows {
                answers.push(got(mesh.evaluate(row.batch.clone()).await));
            }
            metrics = mesh.mesh().metrics.encode_prometheus();
            mesh.close().await;
        }
        _ => {
            let served = TestMesh::serve(server).await;
            match door {
                Door::Stream => {
                    // One stream for the whole table: each batch's answer is
                    // read before the next batch is sent.
                    let mut client = PreToolServiceClient::new(channel(&served.url).await);
                    let (tx, rx) = tokio::sync::mpsc::channel(1);
                    let mut answers_in = client
                        .evaluate(tokio_stream::wrappers::ReceiverStream::new(rx))
                        .await
                        .unwrap()
                        .into_inner();
                    for row in rows {
                        tx.send(row.batch.clone()).await.unwrap();
                        let answer = answers_in.message().await.unwrap().expect("an answer");
                        answers.push(got(match answer.result {
                            Some(evaluate_response::Result::Decision(decision)) => Ok(decision),
                            Some(evaluate_response::Result::Error(error)) => {
                                Err(tonic::Status::new(Code::from(error.code), error.message))
                            }
                            None => panic!("an answer with neither decision nor error"),
                        }));
                    }
                }
                Door::Unary => {
                    let mut client = PreToolServiceClient::new(channel(&served.url).await);
                    for row in rows {
                        let answer = client.evaluate_batch(row.batch.clone()).await;
                        answers.push(got(answer.map(tonic::Response::into_inner)));
                    }
                }
                Door::Invoke => {
                    let mut client = InterceptorServiceClient::new(channel(&served.url).await);
                    for row in rows {
                        let name = row.invoke.expect("an invokable row").to_owned();
                        let answer = client
                            .invoke(InterceptorInvokeRequest {
                                name,
                                batch: Some(row.batch.clone()),
                            })
                            .await;
                        answers.push(got(
                            answer.map(|a| a.into_inner().decision.unwrap_or_default())
                        ));
                    }
                }
                Door::Unrecorded => {
                    for row in rows {
                        let deadline =
                            tokio::time::Instant::now() + std::time::Duration::from_secs(3);
                        let answer = served
                            .mesh
                            .evaluate_unrecorded(row.batch.clone(), deadline, Default::default())
                            .await;
                        answers.push(got(answer.map_err(|e| e.status())));
                    }
                }
                Door::InProcess => unreachable!(),
            }
            metrics = served.mesh.metrics.encode_prometheus();
            if let Some(log) = served.mesh.decision_log() {
                log.close().await.unwrap();
            }
            served.shutdown().await;
        }
    }
    let records = decision_records(&dir.join("log"));
    (answers, counters(&metrics), records)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r20_r25_r29_every_door_gives_the_same_decision_refusal_record_and_metrics() {
    let table = table();
    let mut reference: Option<Vec<Value>> = None;
    for door in [
        Door::Stream,
        Door::Unary,
        Door::InProcess,
        Door::Invoke,
        Door::Unrecorded,
    ] {
        let rows: Vec<&Row> = table
            .iter()
            .filter(|row| door != Door::Invoke || row.invoke.is_some())
            .collect();
        let dir = folder(&format!("doors-{door:?}"));
        let (answers, counters, records) = walk(door, &rows, dir).await;
        for (row, answer) in rows.iter().zip(&answers) {
            check(door, row, answer);
        }
        assert_eq!(
            counters,
            expected_counters(&rows),
            "{door:?}: batch counters"
        );
        match door {
            // Replay and tests write no decision record, by design.
            Door::Unrecorded => assert!(records.is_empty(), "{records:?}"),
            _ => {
                // R29: one record per batch answered, in order, alike at every door.
                assert_eq!(records.len(), rows.len(), "{door:?}: {records:#?}");
                for (row, record) in rows.iter().zip(&records) {
                    let shown = &record["batch_id"];
                    let id = row.batch.batch_id.as_str();
                    assert!(
                        shown == id || shown.as_str().is_some_and(|s| id.starts_with(&s[..8])),
                        "{door:?}: record {record} for {id:?}"
                    );
                }
                let same: Vec<Value> = match door {
                    Door::Invoke => {
                        // The invoke's rows are a part of the table: compare
                        // them with the stream's records of the same rows.
                        let stream = reference.clone().unwrap_or_default();
                        table
                            .iter()
                            .zip(stream)
                            .filter(|(row, _)| row.invoke.is_some())
                            .map(|(_, record)| record)
                            .collect()
                    }
                    _ => match &reference {
                        Some(reference) => reference.clone(),
                        None => {
                            reference = Some(records.clone());
                            records.clone()
                        }
                    },
                };
                assert_eq!(
                    records, same,
                    "{door:?}: decision records differ from the stream's"
                );
            }
        }
    }
}
