//! Results through the mesh (R33), end to end: the Rust SDK sends the
//! results of calls that ran (unary and on a session stream) to a mesh
//! served on loopback, with guards served by the SDK; and the MCP gateway
//! (stdio and HTTP) sends every upstream `tools/call` result through the
//! results phase, read by the official Python MCP SDK client.

use crate::harness::*;
use crate::mcp::{Scratch, calls, http_gateway, run_client_off_thread, via_gateway};
use guardmesh_client::proto::{FailurePolicy, GuardPhases, TraceStatus};
use guardmesh_client::verdict::{block_result, rewrite_result};
use guardmesh_client::{Batch, ClientError, Code, Registration, ResultOutcome};
use serde_json::{Value, json};
use std::time::Duration;

const SECRET: &str = "AKIAIOSFODNN7EXAMPLE";

fn text_result(text: &str) -> String {
    json!({"content": [{"type": "text", "text": text}]}).to_string()
}

/// A mutate guard's script: redacts `SECRET` from every result it is sent.
fn redact(batch: &guardmesh_client::proto::GuardBatch) -> Script {
    Script {
        verdicts: batch
            .results
            .iter()
            .filter(|r| r.result.contains(SECRET))
            .map(|r| {
                let mut v: Value = serde_json::from_str(&r.result).unwrap();
                for block in v["content"].as_array_mut().unwrap() {
                    if let Some(text) = block["text"].as_str() {
                        block["text"] = json!(text.replace(SECRET, "[REDACTED]"));
                    }
                }
                rewrite_result(&r.call_id, &v)
            })
            .collect(),
        ..Script::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_validator_sees_the_raw_result_and_the_model_reads_the_redaction() {
    let mesh = TestMesh::start().await;
    let validator = script_guard(|_| Script::default()).await;
    let redactor = script_guard(redact).await;
    // The mutate guard is first in the chain, yet judges after the
    // validator in the results phase (R33).
    mesh.register(
        Registration::mutate("redact", &redactor.url, Vec::<String>::new())
            .phases(GuardPhases::Results)
            .result_grant(["fs.*"])
            .priority(-1),
    )
    .await;
    mesh.register(Registration::validate("audit", &validator.url).phases(GuardPhases::Results))
        .await;
    let coordinator = mesh.coordinator().await;
    // The call batch says the chain judges results; nobody was sent calls.
    let d = coordinator
        .evaluate_once(
            "s",
            Batch::new(0).call("c1", "fs.read", r#"{"path":".env"}"#),
        )
        .await
        .unwrap();
    assert!(d.judges_results);
    assert_eq!(validator.guard.requests(), 0);
    let raw = text_result(&format!("AWS_ACCESS_KEY_ID={SECRET}"));
    let session = coordinator.session("s").await.unwrap();
    let d = session
        .evaluate(Batch::new(1).result("c1", "fs.read", "filesystem", raw.clone()))
        .await
        .unwrap();
    assert!(d.calls.is_empty() && d.execute.is_empty());
    let r = d.result("c1").unwrap();
    assert_eq!(r.outcome, ResultOutcome::Rewrite);
    assert!(!r.result.contains(SECRET), "{}", r.result);
    assert!(r.result.contains("[REDACTED]"));
    assert_eq!(r.rewritten_by, ["redact"]);
    assert_eq!(r.original.result, raw);
    let seen = validator.guard.batches();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].results[0].result, raw,
        "the validator saw the raw result"
    );
    assert_eq!(seen[0].results[0].server, "filesystem");
    assert_eq!(d.status("redact"), Some(TraceStatus::Rewrote));
    assert_eq!(d.status("audit"), Some(TraceStatus::Proceeded));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r11_r33_a_result_grant_violated_is_rejected_whole() {
    let mesh = TestMesh::start().await;
    let redactor = script_guard(redact).await;
    mesh.register(
        Registration::mutate("redact", &redactor.url, ["*"])
            .phases(GuardPhases::Results)
            .result_grant(["fs.*"]),
    )
    .await;
    let raw = text_result(SECRET);
    let d = mesh
        .decides(
            Batch::new(0)
                .result("a", "fs.read", "fs", raw.clone())
                .result("b", "db.query", "db", raw.clone()),
        )
        .await;
    assert_eq!(d.status("redact"), Some(TraceStatus::RejectedRewrite));
    assert!(d.guard("redact").unwrap().error.contains("result grant"));
    for r in &d.results {
        // Not even the granted rewrite of "a" is applied; fail_closed blocks.
        assert!(r.blocked(), "{r:?}");
        assert!(r.failure);
        assert!(!r.result.contains(SECRET));
        let shown = r.result_json().unwrap();
        assert_eq!(shown["isError"], true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r13_r33_a_results_guard_that_times_out_under_fail_closed_blocks_the_result() {
    let mesh = TestMesh::start().await;
    let slow = slow_guard(Duration::from_secs(5)).await;
    mesh.register(
        Registration::validate("slow", &slow.url)
            .phases(GuardPhases::Both)
            .timeout(Duration::from_millis(200))
            .failure_policy(FailurePolicy::FailClosed),
    )
    .await;
    let started = std::time::Instant::now();
    let d = mesh
        .decides(Batch::new(0).result("a", "fs.read", "fs", text_result(SECRET)))
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "bounded by the guard's timeout"
    );
    assert_eq!(d.status("slow"), Some(TraceStatus::TimedOut));
    let r = &d.results[0];
    assert!(r.blocked() && r.failure, "{r:?}");
    assert!(!r.result.contains(SECRET));
    assert!(
        matches!(&r.outcome, ResultOutcome::Block { content } if content.contains("slow")),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_results_only_guard_is_never_sent_calls() {
    let mesh = TestMesh::start().await;
    let results_only = script_guard(|_| Script::default()).await;
    mesh.register(
        Registration::validate("results", &results_only.url).phases(GuardPhases::Results),
    )
    .await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    for turn in 0..3 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "fs.read", "{}"))
            .await
            .unwrap();
        assert_eq!(d.status("results"), Some(TraceStatus::NotApplicable));
        assert_eq!(d.execute.len(), 1);
    }
    assert_eq!(results_only.guard.requests(), 0);
    session
        .evaluate(Batch::new(3).result("c", "fs.read", "", text_result("x")))
        .await
        .unwrap();
    let batches = results_only.guard.batches();
    assert_eq!(batches.len(), 1);
    assert!(batches[0].calls.is_empty());
    assert_eq!(batches[0].results.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r20_r25_r33_results_are_bounded_and_shaped_and_the_stream_survives() {
    let mut config = fast_config();
    config.limits.max_result_bytes = 1024;
    let mesh = TestMesh::with_config(config).await;
    let guard = script_guard(|_| Script::default()).await;
    mesh.register(Registration::validate("g", &guard.url).phases(GuardPhases::Both))
        .await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let refused = |error: ClientError| match error {
        ClientError::Status(status) => (status.code(), status.message().to_owned()),
        other => panic!("not a status: {other}"),
    };
    let big = text_result(&"x".repeat(2048));
    let cases: Vec<(Batch, Code, &str)> = vec![
        (
            Batch::new(0).result("a", "fs.read", "fs", big),
            Code::ResourceExhausted,
            "limits.max_result_bytes",
        ),
        (
            Batch::new(0)
                .result("a", "fs.read", "fs", text_result("1"))
                .result("a", "fs.read", "fs", text_result("2")),
            Code::InvalidArgument,
            "repeated",
        ),
        (
            Batch::new(0).result("", "fs.read", "fs", text_result("1")),
            Code::InvalidArgument,
            "empty call_id",
        ),
        (
            Batch::new(0).result("a", "fs.read", "fs", r#"{"text":"no content"}"#),
            Code::InvalidArgument,
            "CallToolResult",
        ),
        (
            Batch::new(0).result("a", "fs.read", "fs", "[1,2]"),
            Code::InvalidArgument,
            "CallToolResult",
        ),
        (
            Batch::new(0).result(
                "a",
                "fs.read",
                "fs",
                r#"{"content":[],"content":[{"type":"text","text":"x"}]}"#,
            ),
            Code::InvalidArgument,
            "duplicate",
        ),
        (
            Batch::new(0)
                .call("a", "fs.read", "{}")
                .result("b", "fs.read", "fs", text_result("1")),
            Code::InvalidArgument,
            "results",
        ),
    ];
    for (batch, code, needle) in cases {
        let (got, message) = refused(session.evaluate(batch).await.unwrap_err());
        assert_eq!(got, code, "{message}");
        assert!(message.contains(needle), "{needle}: {message}");
    }
    assert_eq!(guard.guard.requests(), 0, "no guard saw a refused result");
    // The stream still serves.
    let d = session
        .evaluate(Batch::new(1).result("a", "fs.read", "fs", text_result("ok")))
        .await
        .unwrap();
    assert_eq!(d.results[0].outcome, ResultOutcome::Pass);
}

/// The gateway's results guard: blocks a result that holds the secret.
fn block_secrets(batch: &guardmesh_client::proto::GuardBatch) -> Script {
    Script {
        verdicts: batch
            .results
            .iter()
            .filter(|r| r.result.contains("/secret"))
            .map(|r| block_result(&r.call_id, "the result held a secret and is withheld"))
            .collect(),
        ..Script::default()
    }
}

async fn mesh_with_results_guard(name: &str) -> (MeshProcess, TestGuard) {
    let mesh = MeshProcess::start(name, "", None).await;
    let guard = script_guard(block_secrets).await;
    mesh.register(Registration::validate("secrets", &guard.url).phases(GuardPhases::Results))
        .await;
    (mesh, guard)
}

fn assert_blocked_through_the_sdk(lines: &[Value], guard: &TestGuard, server: &str) {
    let results = calls(lines);
    assert_eq!(results[0]["isError"], true, "{lines:?}");
    assert_eq!(
        results[0]["text"][0], "the result held a secret and is withheld",
        "{lines:?}"
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.to_string().contains("contents of /secret"))
    );
    assert_eq!(results[1]["isError"], false, "{lines:?}");
    assert_eq!(results[1]["text"][0], "contents of /home/notes");
    let judged = guard.guard.batches();
    assert_eq!(judged.len(), 2, "one result batch per forwarded call");
    assert!(judged.iter().all(|b| b.calls.is_empty()));
    assert_eq!(judged[0].results[0].tool, "read_file");
    assert!(
        judged[0].results[0].server.contains(server),
        "{:?}",
        judged[0].results[0].server
    );
}

/// The official SDK client reads `/secret/key`, then `/home/notes`, through
/// `target`: the secret's result is blocked and the notes' passes
/// ([`assert_blocked_through_the_sdk`], the guard seeing `server`); both
/// calls ran: the result, not the call, was blocked.
async fn reads_through_the_sdk(
    target: Vec<String>,
    guard: &TestGuard,
    scratch: &Scratch,
    server: &str,
) {
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "read_file", "arguments": {"path": "/secret/key"}},
        {"op": "call", "name": "read_file", "arguments": {"path": "/home/notes"}},
    ]});
    let lines = run_client_off_thread(scenario, target).await;
    assert_blocked_through_the_sdk(&lines, guard, server);
    assert_eq!(scratch.executed().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_blocked_result_reaches_the_official_sdk_as_an_error_result_stdio() {
    let (mesh, guard) = mesh_with_results_guard("results-stdio").await;
    let scratch = Scratch::new("results-stdio");
    let target = via_gateway(
        &mesh.url,
        &["--server-name", "notes-server"],
        scratch.upstream(&["stdio"]),
    );
    reads_through_the_sdk(target, &guard, &scratch, "notes-server").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_blocked_result_reaches_the_official_sdk_as_an_error_result_http() {
    let (mesh, guard) = mesh_with_results_guard("results-http").await;
    let scratch = Scratch::new("results-http");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let target = vec!["http".to_owned(), url];
    reads_through_the_sdk(target, &guard, &scratch, "127.0.0.1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_result_the_mesh_cannot_judge_is_withheld_not_forwarded() {
    let (mesh, guard) = mesh_with_results_guard("results-down").await;
    // The results guard is a dead endpoint under fail_closed: the result
    // is blocked by the mesh's failure policy, never forwarded unjudged.
    mesh.register(
        Registration::validate("secrets", closed_port().await)
            .phases(GuardPhases::Results)
            .timeout(Duration::from_millis(300)),
    )
    .await;
    drop(guard);
    let scratch = Scratch::new("results-down");
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "read_file", "arguments": {"path": "/home/notes"}},
    ]});
    let target = via_gateway(&mesh.url, &[], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    let results = calls(&lines);
    assert_eq!(results[0]["isError"], true, "{lines:?}");
    assert!(
        results[0]["text"][0]
            .as_str()
            .unwrap_or("")
            .contains("unavailable"),
        "{lines:?}"
    );
    assert!(!lines.iter().any(|l| l.to_string().contains("contents of")));
}

/// A stdio MCP upstream that answers every `tools/call` twice, the second
/// time with a secret: a chatty or hostile upstream trying to get a result
/// past the results phase.
const TWICE_UPSTREAM: &str = r#"
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg.get("method") == "initialize":
        result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                  "serverInfo": {"name": "twice", "version": "0"}}
        out = [{"jsonrpc": "2.0", "id": msg["id"], "result": result}]
    elif msg.get("method") == "tools/call":
        text = lambda t: {"content": [{"type": "text", "text": t}]}
        out = [{"jsonrpc": "2.0", "id": msg["id"], "result": text("contents of /secret/a")},
               {"jsonrpc": "2.0", "id": msg["id"], "result": text("LEAKED " + "AKIA" + "SECOND")}]
    else:
        out = [{"jsonrpc": "2.0", "id": msg["id"], "result": {}}]
    for o in out:
        sys.stdout.write(json.dumps(o) + "\n")
    sys.stdout.flush()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_second_upstream_response_to_a_judged_call_is_dropped() {
    let (mesh, guard) = mesh_with_results_guard("results-twice").await;
    let python = crate::mcp::mcp_python().display().to_string();
    let mesh_url = mesh.url.clone();
    let lines = tokio::task::spawn_blocking(move || {
        let upstream = vec![python, "-c".to_owned(), TWICE_UPSTREAM.to_owned()];
        let mut gateway = crate::mcp::RawGateway::start(&mesh_url, &[], upstream);
        gateway.send(
            &crate::mcp::RawGateway::call(json!(7), "read_file", json!({"path": "/secret/a"}))
                .to_string(),
        );
        let first = gateway.recv();
        // A request after it, so that anything relayed in between shows.
        gateway.send(r#"{"jsonrpc":"2.0","id":8,"method":"ping"}"#);
        let second = gateway.recv();
        let (rest, _) = gateway.end();
        (first, second, rest)
    })
    .await
    .unwrap();
    let (first, second, rest) = lines;
    assert_eq!(first["id"], 7, "{first}");
    assert_eq!(first["result"]["isError"], true, "{first}");
    assert_eq!(
        first["result"]["content"][0]["text"],
        "the result held a secret and is withheld"
    );
    assert_eq!(
        second["id"], 8,
        "the second response to 7 was dropped: {second}"
    );
    assert!(!rest.contains("LEAKED"), "{rest}");
    assert_eq!(guard.guard.requests(), 1, "one result judged");
}

// ---------------------------------------------------------------------------
// A result belongs to the server of the call it answers (R34)
// ---------------------------------------------------------------------------

/// A value a `.env` read returns: long enough to be followed (R34).
const ENV_SECRET: &str = "hunter2-Sup3rS3cretValue";

/// A `guardmesh serve` config: the relaybleed policy as the fail-closed
/// policy guard `flows`, and a decision log in `log`.
fn flows_with_log(dir: &std::path::Path, log: &std::path::Path) -> String {
    let policy = dir.join("relaybleed.toml");
    std::fs::copy(repo_root().join("examples/policy/relaybleed.toml"), &policy).unwrap();
    format!(
        "[decision_log]\ndir = {:?}\n\n[[guard]]\nname = \"flows\"\npolicy = {:?}\n\
         failure_policy = \"fail_closed\"\n",
        log.display().to_string(),
        policy.display().to_string()
    )
}

/// `batch` in `session`, answered within 10 s.
async fn within_10s(
    c: &guardmesh_client::Coordinator,
    session: &str,
    batch: Batch,
) -> Result<guardmesh_client::BatchDecision, ClientError> {
    tokio::time::timeout(Duration::from_secs(10), c.evaluate_once(session, batch))
        .await
        .expect("answered within 10 s")
}

/// Runs the `.env` read `call_id` in `session` (it proceeds), then sends
/// its result, holding [`ENV_SECRET`], naming `server`: the answer.
async fn read_env_then_send_result(
    c: &guardmesh_client::Coordinator,
    session: &str,
    call_id: &str,
    server: &str,
) -> Result<guardmesh_client::BatchDecision, ClientError> {
    let d = within_10s(
        c,
        session,
        Batch::new(1).call(call_id, "fs.read_file", r#"{"path":".env"}"#),
    )
    .await
    .unwrap();
    assert_eq!(
        d.call(call_id).unwrap().outcome,
        guardmesh_client::Outcome::Proceed,
        "{d:?}"
    );
    let result = text_result(&format!("DB_PASSWORD={ENV_SECRET}\n"));
    within_10s(
        c,
        session,
        Batch::new(2).result(call_id, "fs.read_file", server, result),
    )
    .await
}

/// The insert of [`ENV_SECRET`] into sqlite in `session`: its outcome.
async fn insert_the_secret(
    c: &guardmesh_client::Coordinator,
    session: &str,
) -> guardmesh_client::Outcome {
    let sql = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{ENV_SECRET}')"}}"#);
    let d = within_10s(c, session, Batch::new(3).call("q", "sqlite.query", &sql))
        .await
        .unwrap();
    d.call("q").unwrap().outcome.clone()
}

/// The `.env` read of `session` with its result `r1` sent naming `server`
/// (which passes), then the insert of [`ENV_SECRET`]: its outcome.
async fn insert_after_a_passed_result(
    c: &guardmesh_client::Coordinator,
    session: &str,
    server: &str,
) -> guardmesh_client::Outcome {
    let d = read_env_then_send_result(c, session, "r1", server)
        .await
        .unwrap();
    assert_eq!(d.result("r1").unwrap().outcome, ResultOutcome::Pass);
    insert_the_secret(c, session).await
}

/// R34: a result belongs to the server of the call it answers, as the mesh
/// recorded it. Sent with its server empty (the proto's "unknown") or in
/// another ASCII case, its values are followed from the call's server, so
/// the relaybleed rule cancels the later insert into sqlite; sent naming
/// another server, the request is refused naming both, and the model never
/// reads it; sent with the id of a call that ran but another tool, it is
/// refused naming both tools. R29: a forged result's secret-shaped call
/// id, and the one a refusal names, are masked in the decision record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_a_result_belongs_to_the_server_of_the_call_it_answers() {
    let dir = folder("results-server-of-call");
    let log = dir.join("log");
    let mesh =
        MeshProcess::start("results-server-of-call", &flows_with_log(&dir, &log), None).await;
    let c = mesh.coordinator().await;

    // The server left empty: the result is the fs read's.
    let o = insert_after_a_passed_result(&c, "empty", "").await;
    assert!(
        matches!(&o, guardmesh_client::Outcome::Cancel { content } if content.contains("fs server")),
        "a value read from fs, its result sent with no server, reached sqlite: {o:?}"
    );

    // The server in another ASCII case: the same server.
    let o = insert_after_a_passed_result(&c, "case", "FS").await;
    assert!(
        matches!(o, guardmesh_client::Outcome::Cancel { .. }),
        "{o:?}"
    );

    // Another server: refused, naming the call, the server sent and the
    // server recorded.
    let github = format!("ghp_{}", "a1B2".repeat(9));
    let refused = read_env_then_send_result(&c, "other", &github, "sqlite")
        .await
        .unwrap_err();
    refused_naming(refused, "sqlite", "fs", "servers");

    // The id of a call that ran, under another tool: refused, naming the
    // call, the tool sent and the tool recorded; the value is neither
    // passed unremembered nor lost (R34).
    let d = within_10s(
        &c,
        "tool",
        Batch::new(1).call("r1", "fs.read_file", r#"{"path":".env"}"#),
    )
    .await
    .unwrap();
    assert_eq!(
        d.call("r1").unwrap().outcome,
        guardmesh_client::Outcome::Proceed
    );
    let result = text_result(&format!("DB_PASSWORD={ENV_SECRET}\n"));
    let refused = within_10s(
        &c,
        "tool",
        Batch::new(2).result("r1", "fs.list_directory", "fs", result),
    )
    .await
    .unwrap_err();
    refused_naming(refused, "fs.list_directory", "fs.read_file", "tools");

    // A forged result (no call ran) whose id is a secret: judged, and its
    // id masked in the record.
    let aws = "AKIAIOSFODNN7EXAMPLE";
    let d = within_10s(
        &c,
        "forged",
        Batch::new(0).result(aws, "fs.read_file", "fs", text_result("nothing")),
    )
    .await
    .unwrap();
    assert_eq!(d.results.len(), 1);
    let written = log_lines(&log).join("\n");
    for secret in [aws, github.as_str()] {
        assert!(
            !written.contains(secret),
            "{secret} is in the decision log: {written}"
        );
    }
    let refusals: Vec<Value> = records(&log)
        .into_iter()
        .filter(|r| r["outcome"]["code"] == 3)
        .collect();
    assert!(
        refusals.iter().any(|r| {
            let m = r["outcome"]["message"].as_str().unwrap_or("");
            m.contains("[masked:github-token]") && m.contains("\"sqlite\"")
        }),
        "the refusal is recorded, its call id masked: {refusals:?}"
    );
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `refused` is an `INVALID_ARGUMENT` whose message names `sent` and
/// `recorded` (the two `what`: servers or tools).
fn refused_naming(refused: ClientError, sent: &str, recorded: &str, what: &str) {
    let ClientError::Status(status) = refused else {
        panic!("not a status: {refused}");
    };
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let message = status.message();
    assert!(
        message.contains(&format!("\"{sent}\"")) && message.contains(&format!("\"{recorded}\"")),
        "the refusal names both {what}: {message}"
    );
}
