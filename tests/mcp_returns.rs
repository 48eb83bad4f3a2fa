//! What comes back through the MCP gateway (R31, R33): every upstream
//! message read once as I-JSON and matched to its request by the gateway's
//! own ids, every path by which a call's result reaches the client judged.
//! The upstream is scripted (tests/mcp-sdk/odd_upstream.py, over stdio and
//! HTTP) to answer as a hostile or buggy server would; the client is the
//! official Python MCP SDK, or raw JSON-RPC where an SDK would never send
//! what is tried (a reused id); the mesh is remote (`--mesh`) or embedded
//! (`--config`). A results guard blocks every result holding the secret.
//!
//! Needs `scripts/setup-polyglot` (the SDK in build/venv).

use crate::harness::*;
use crate::mcp::{
    RawGateway, Scratch, calls, gateway_before, gateway_command, http_session, listening,
    mcp_python, post, run_client_off_thread, sdk_dir, via_gateway_judging,
};
use guardmesh_client::Registration;
use guardmesh_client::proto::{GuardBatch, GuardPhases};
use guardmesh_client::verdict::block_result;
use serde_json::{Value, json};
use std::process::Command;

/// What the results guard says instead of a result holding the secret.
pub(crate) const WITHHELD: &str = "the result held a secret and is withheld";

/// The results guard: blocks every result holding an AWS key id.
pub(crate) fn block_secrets(batch: &GuardBatch) -> Script {
    Script {
        verdicts: batch
            .results
            .iter()
            .filter(|r| r.result.contains("AKIA"))
            .map(|r| block_result(&r.call_id, WITHHELD))
            .collect(),
        ..Script::default()
    }
}

/// A mesh process with the results guard registered.
async fn mesh_judging_results(name: &str) -> (MeshProcess, TestGuard) {
    let mesh = MeshProcess::start(name, "", None).await;
    let guard = script_guard(block_secrets).await;
    mesh.register(Registration::validate("secrets", &guard.url).phases(GuardPhases::Results))
        .await;
    (mesh, guard)
}

/// A config for `--config` (the embedded mesh) with the results guard.
fn embedded_config(scratch: &Scratch, guard: &TestGuard) -> String {
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[[guard]]\nname = \"secrets\"\nendpoint = {:?}\nrole = \"validate\"\n\
             phases = \"results\"\n",
            guard.url
        ),
    )
    .unwrap();
    config.display().to_string()
}

/// The scripted upstream over stdio.
fn odd_stdio() -> Vec<String> {
    vec![
        mcp_python().display().to_string(),
        sdk_dir().join("odd_upstream.py").display().to_string(),
        "stdio".into(),
    ]
}

/// The scripted upstream over HTTP, once it listens: (port, process).
async fn odd_http() -> (u16, KillOnDrop) {
    let port = free_port();
    let upstream = listening(
        Command::new(mcp_python())
            .arg(sdk_dir().join("odd_upstream.py"))
            .args(["http", &port.to_string()]),
        port,
        "the scripted upstream",
    )
    .await;
    (port, upstream)
}

fn no_secret(lines: &[Value]) {
    for line in lines {
        assert!(
            !line.to_string().contains("AKIA"),
            "a secret reached the client: {line}"
        );
    }
}

/// R31, R20, R33: an upstream answer with `result` twice is refused with a
/// JSON-RPC error (the SDK would take the last, unjudged one); one with
/// `id` twice, or with the request's id retyped (`"114"` for `114`),
/// matches no request and is dropped: the client reads the clean answer
/// that follows, judged. A plain result holding the secret is blocked.
async fn odd_answers_reach_the_sdk_only_as_judged(target: Vec<String>) {
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "clean", "arguments": {}},
        {"op": "call", "name": "dup_result", "arguments": {}},
        {"op": "call", "name": "dup_id", "arguments": {}},
        {"op": "call", "name": "retyped", "arguments": {}},
    ]});
    let lines = run_client_off_thread(scenario, target).await;
    no_secret(&lines);
    let results = calls(&lines);
    assert_eq!(results.len(), 4, "{lines:?}");
    assert_eq!(results[0]["isError"], true, "{lines:?}");
    assert_eq!(results[0]["text"][0], WITHHELD, "{lines:?}");
    assert_eq!(results[1]["error"]["code"], -32075, "{lines:?}");
    assert_eq!(results[2]["text"][0], "clean", "{lines:?}");
    assert_eq!(results[3]["text"][0], "clean", "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r20_odd_upstream_answers_reach_the_sdk_only_as_judged_stdio() {
    let (mesh, _guard) = mesh_judging_results("returns-odd-stdio").await;
    let target = via_gateway_judging(["--mesh", &mesh.url], &[], odd_stdio());
    odd_answers_reach_the_sdk_only_as_judged(target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r20_odd_upstream_answers_reach_the_sdk_only_as_judged_embedded() {
    let guard = script_guard(block_secrets).await;
    let scratch = Scratch::new("returns-odd-embedded");
    let config = embedded_config(&scratch, &guard);
    let target = via_gateway_judging(["--config", &config], &[], odd_stdio());
    odd_answers_reach_the_sdk_only_as_judged(target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r20_odd_upstream_answers_reach_the_sdk_only_as_judged_http() {
    let (mesh, _guard) = mesh_judging_results("returns-odd-http").await;
    let (port, _upstream) = odd_http().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", port, &[]).await;
    odd_answers_reach_the_sdk_only_as_judged(vec!["http".into(), url]).await;
}

/// `guardmesh mcp stdio --mesh MESH -- odd_upstream.py stdio`, initialized.
fn raw_gateway(mesh: &str) -> RawGateway {
    RawGateway::start(mesh, &[], odd_stdio())
}

/// R31: a request reusing the id of a request in flight in its session is
/// refused with a JSON-RPC error naming the id, and never takes the other
/// request's answer: the slow call's result is still judged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_request_reusing_an_id_in_flight_is_refused_stdio() {
    let (mesh, guard) = mesh_judging_results("returns-reuse-stdio").await;
    let url = mesh.url.clone();
    let (first, second, rest) = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        gateway.send(&RawGateway::call(json!(122), "slow", json!({})).to_string());
        gateway.send(r#"{"jsonrpc":"2.0","id":122,"method":"ping"}"#);
        let first = gateway.recv();
        let second = gateway.recv();
        let (rest, _) = gateway.end();
        (first, second, rest)
    })
    .await
    .unwrap();
    no_secret(&[first.clone(), second.clone(), json!(rest)]);
    assert_eq!(first["id"], 122, "{first}");
    assert_eq!(first["error"]["code"], -32600, "{first}");
    assert!(
        first["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in flight"),
        "{first}"
    );
    assert_eq!(second["id"], 122, "{second}");
    assert_eq!(second["result"]["isError"], true, "{second}");
    assert_eq!(second["result"]["content"][0]["text"], WITHHELD, "{second}");
    assert_eq!(guard.guard.requests(), 1, "one result judged");
}

/// R31 over HTTP: concurrent requests of one session under one id: one is
/// judged and answered, the others are refused; no answer is unjudged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_request_reusing_an_id_in_flight_is_refused_http() {
    let (mesh, _guard) = mesh_judging_results("returns-reuse-http").await;
    let (port, _upstream) = odd_http().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", port, &[]).await;
    let session = http_session(&url).await;
    let call = RawGateway::call(json!(122), "slow", json!({})).to_string();
    let answers = futures::future::join_all(
        (0..8).map(|_| async { post(&url, Some(&session), &call).await }),
    )
    .await;
    let mut judged = 0;
    for (status, _head, body) in &answers {
        assert!(!body.contains("AKIA"), "an unjudged answer: {body}");
        let message: Value =
            serde_json::from_str(body).unwrap_or_else(|_| panic!("{status}: {body}"));
        assert_eq!(message["id"], 122, "{message}");
        if message["result"]["content"][0]["text"] == WITHHELD {
            judged += 1;
        } else {
            assert_eq!(message["error"]["code"], -32600, "{message}");
        }
    }
    assert!(judged >= 1, "{answers:?}");
}

/// R31, R33: a task-wrapped call's task-created answer is relayed intact;
/// the task's result (`tasks/result`) goes through the results phase like
/// a plain call's; `tasks/get` is relayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_task_wrapped_call_is_judged_on_its_result() {
    let (mesh, guard) = mesh_judging_results("returns-task").await;
    let url = mesh.url.clone();
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        let mut call = RawGateway::call(json!(5), "clean", json!({}));
        call["params"]["task"] = json!({"ttl": 60000});
        gateway.send(&call.to_string());
        let created = gateway.recv();
        gateway
            .send(r#"{"jsonrpc":"2.0","id":6,"method":"tasks/get","params":{"taskId":"task-1"}}"#);
        let got = gateway.recv();
        gateway.send(
            r#"{"jsonrpc":"2.0","id":7,"method":"tasks/result","params":{"taskId":"task-1"}}"#,
        );
        let result = gateway.recv();
        gateway.end();
        [created, got, result]
    })
    .await
    .unwrap();
    no_secret(&answers);
    let [created, got, result] = answers;
    assert_eq!(created["id"], 5, "{created}");
    assert_eq!(created["result"]["task"]["taskId"], "task-1", "{created}");
    assert_eq!(created["result"]["task"]["status"], "working", "{created}");
    assert_eq!(got["result"]["status"], "completed", "{got}");
    assert_eq!(result["id"], 7, "{result}");
    assert_eq!(result["result"]["isError"], true, "{result}");
    assert_eq!(result["result"]["content"][0]["text"], WITHHELD, "{result}");
    let judged = guard.guard.batches();
    assert_eq!(judged.len(), 1, "the task's result judged once");
    assert_eq!(judged[0].results[0].tool, "clean");
}

/// R31 at 2026-07-28: a judged result keeps `resultType`; an
/// `input_required` answer is relayed (it is no tool result yet), and the
/// call sent again with its `requestState` is judged and its result too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_judged_results_keep_result_type_and_input_required_passes() {
    let (mesh, _guard) = mesh_judging_results("returns-mrtr").await;
    let url = mesh.url.clone();
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        gateway.send(&RawGateway::call(json!(1), "clean", json!({})).to_string());
        let clean = gateway.recv();
        gateway.send(&RawGateway::call(json!(2), "ask", json!({})).to_string());
        let asked = gateway.recv();
        let mut again = RawGateway::call(json!(3), "ask", json!({}));
        again["params"]["requestState"] = json!("state-1");
        gateway.send(&again.to_string());
        let answered = gateway.recv();
        gateway.end();
        [clean, asked, answered]
    })
    .await
    .unwrap();
    let [clean, asked, answered] = answers;
    assert_eq!(clean["result"]["resultType"], "complete", "{clean}");
    assert_eq!(clean["result"]["content"][0]["text"], WITHHELD, "{clean}");
    assert_eq!(asked["id"], 2, "{asked}");
    assert_eq!(asked["result"]["resultType"], "input_required", "{asked}");
    assert_eq!(asked["result"]["requestState"], "state-1", "{asked}");
    assert_eq!(answered["result"]["resultType"], "complete", "{answered}");
    assert_eq!(
        answered["result"]["content"][0]["text"], "answered",
        "{answered}"
    );
}

/// R31: the official Python SDK client at 2026-07-28 (`mode: auto`)
/// accepts results judged by a results guard (it refuses a result without
/// `resultType`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_the_2026_07_28_sdk_client_accepts_judged_results() {
    let (mesh, _guard) = mesh_judging_results("returns-modern").await;
    let scratch = Scratch::new("returns-modern");
    let (upstream_port, _upstream) = scratch.http_upstream().await;
    let port = free_port();
    let _gateway = listening(
        &mut gateway_command(
            ["--mesh", &mesh.url],
            &format!("127.0.0.1:{port}"),
            upstream_port,
        ),
        port,
        "guardmesh mcp http",
    )
    .await;
    let scenario = json!({"mode": "auto", "steps": [
        {"op": "call", "name": "read_file", "arguments": {"path": "/home/notes"}},
    ]});
    let target = vec!["http".to_owned(), format!("http://127.0.0.1:{port}/mcp")];
    let lines = run_client_off_thread(scenario, target).await;
    assert_eq!(lines[0]["protocol"], "2026-07-28", "{lines:?}");
    let results = calls(&lines);
    assert_eq!(
        results[0]["text"][0], "contents of /home/notes",
        "{lines:?}"
    );
}

/// R31: the official TypeScript SDK v2 client at 2026-07-28 accepts the
/// results a results guard judged, against the SDK v2 server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_the_2026_07_28_typescript_client_accepts_judged_results() {
    let (mesh, guard) = mesh_judging_results("returns-modern-ts2").await;
    let scratch = Scratch::new("returns-modern-ts2");
    let (url, _upstream, _gateway) =
        crate::mcp_revision_ts::gateway_before_ts2_upstream(&mesh.url, &scratch).await;
    let scenario = json!({"steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
        {"op": "call", "name": "read_file", "arguments": {"path": "/home/a"}},
    ]});
    let lines =
        tokio::task::spawn_blocking(move || crate::mcp_revision_ts::run_ts2_client(scenario, url))
            .await
            .unwrap();
    assert_eq!(lines[0]["protocol"], "2026-07-28", "{lines:?}");
    let results = calls(&lines);
    assert_eq!(results[0]["text"][0], "paid 5 to bob", "{lines:?}");
    assert_eq!(results[1]["text"][0], "contents of /home/a", "{lines:?}");
    let judged: Vec<String> = guard
        .guard
        .batches()
        .iter()
        .flat_map(|b| b.results.iter().map(|r| format!("{} {}", r.tool, r.result)))
        .collect();
    // Both results judged (and the upstream's error answering the client's
    // first read_file, sent before it had listed the tools' headers: the
    // SDK lists them and sends the call again).
    for text in ["paid 5 to bob", "contents of /home/a"] {
        assert!(
            judged.iter().any(|j| j.contains(text)),
            "{text}: {judged:?}"
        );
    }
}

/// A JSON-RPC batch holding an `interceptors/list` request (SEP-2624) and
/// a ping.
fn batch_with_an_interceptor_request() -> String {
    json!([
        {"jsonrpc": "2.0", "id": "list", "method": "interceptors/list"},
        {"jsonrpc": "2.0", "id": "p", "method": "ping"},
    ])
    .to_string()
}

/// The answer to the `interceptors/list` request in a batch's answers:
/// the gateway's (a list of interceptors), never the upstream's.
fn assert_answered_by_the_gateway(answers: &Value) {
    let list = answers
        .as_array()
        .and_then(|a| a.iter().find(|m| m["id"] == "list"))
        .unwrap_or_else(|| panic!("{answers}"));
    assert!(list["result"]["interceptors"].is_array(), "{list}");
}

/// R31, SEP-2624: interceptor requests inside a JSON-RPC batch are
/// answered by the gateway, as they are alone, never forwarded upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sep2624_interceptor_requests_inside_a_batch_are_answered_by_the_gateway() {
    let (mesh, _guard) = mesh_judging_results("returns-batch-interceptors").await;
    let url = mesh.url.clone();
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        gateway.send(&batch_with_an_interceptor_request());
        let answers = gateway.recv();
        gateway.end();
        answers
    })
    .await
    .unwrap();
    assert_answered_by_the_gateway(&answers);
    let (port, _upstream) = odd_http().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", port, &[]).await;
    let session = http_session(&url).await;
    let (status, _head, body) =
        post(&url, Some(&session), &batch_with_an_interceptor_request()).await;
    assert_eq!(status, 200, "{body}");
    assert_answered_by_the_gateway(&serde_json::from_str(&body).unwrap_or(json!(body)));
}

/// R31, R33: a JSON-RPC error answering a call whose result the chain
/// judges goes through the results phase as an error result: one holding
/// the secret is blocked; a clean one reaches the client as the error it
/// was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_json_rpc_error_answering_a_call_is_judged() {
    let (mesh, guard) = mesh_judging_results("returns-errors").await;
    let url = mesh.url.clone();
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        gateway.send(&RawGateway::call(json!(1), "error_secret", json!({})).to_string());
        let secret = gateway.recv();
        gateway.send(&RawGateway::call(json!(2), "nope", json!({})).to_string());
        let clean = gateway.recv();
        gateway.end();
        [secret, clean]
    })
    .await
    .unwrap();
    no_secret(&answers);
    let [secret, clean] = answers;
    assert_eq!(secret["id"], 1, "{secret}");
    assert_eq!(secret["result"]["isError"], true, "{secret}");
    assert_eq!(secret["result"]["content"][0]["text"], WITHHELD, "{secret}");
    assert_eq!(clean["id"], 2, "{clean}");
    assert_eq!(clean["error"]["code"], -32602, "{clean}");
    assert_eq!(clean["error"]["message"], "unknown tool", "{clean}");
    assert_eq!(guard.guard.requests(), 2, "both errors judged");
}

/// R31, R33 over stdio: while a call whose result is judged runs, the
/// upstream's log messages are dropped, its progress notifications lose
/// their `message`, and its sampling request is answered by the gateway
/// with an error instead of reaching the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_messages_sent_while_a_judged_call_runs_leak_nothing() {
    let (mesh, _guard) = mesh_judging_results("returns-chatty").await;
    let url = mesh.url.clone();
    let lines = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        let mut call = RawGateway::call(json!(1), "chatty", json!({}));
        call["params"]["_meta"] = json!({"progressToken": "p1"});
        gateway.send(&call.to_string());
        let mut lines = Vec::new();
        loop {
            let line = gateway.recv();
            let done = line["id"] == 1;
            lines.push(line);
            if done {
                break;
            }
        }
        gateway.end();
        lines
    })
    .await
    .unwrap();
    no_secret(&lines);
    let progress: Vec<&Value> = lines
        .iter()
        .filter(|l| l["method"] == "notifications/progress")
        .collect();
    assert_eq!(progress.len(), 1, "{lines:?}");
    assert_eq!(progress[0]["params"]["progressToken"], "p1");
    assert!(
        !lines
            .iter()
            .any(|l| l["method"] == "sampling/createMessage"),
        "{lines:?}"
    );
    assert_eq!(
        lines.last().unwrap()["result"]["content"][0]["text"],
        "chatty done"
    );
}

/// R31: a gateway session belongs to the client that opened it. The
/// gateway issues its own unguessable session id; the upstream's id, or
/// any id the gateway did not issue, is answered 404 with nothing judged
/// or forwarded (a tool call, an `interceptor/invoke` reading the session's
/// memory); the id the gateway issued works, until the session is ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_session_id_is_honoured_only_as_the_gateway_issued_it() {
    let (mesh, guard) = mesh_judging_results("returns-sessions").await;
    let (port, _upstream) = odd_http().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", port, &[]).await;
    let session = http_session(&url).await;
    assert_ne!(session, "odd-session", "the upstream's id is not shown");
    let call = RawGateway::call(json!(1), "clean", json!({})).to_string();
    let invoke = json!({"jsonrpc": "2.0", "id": 2, "method": "interceptor/invoke",
        "params": {"name": "secrets", "phase": "response",
                   "payload": {"content": [{"type": "text", "text": "x"}]}}})
    .to_string();
    for foreign in [
        "odd-session",
        "gm-00000000000000000000000000000001",
        "guessed",
    ] {
        for body in [&call, &invoke] {
            let (status, _, answer) = post(&url, Some(foreign), body).await;
            assert_eq!(status, 404, "{foreign}: {answer}");
            assert!(answer.contains("unknown session"), "{answer}");
        }
    }
    assert_eq!(
        guard.guard.requests(),
        0,
        "nothing of a foreign session judged"
    );
    let (status, _, answer) = post(&url, Some(&session), &call).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains(WITHHELD), "{answer}");
}

/// R31, R33 over HTTP: a sampling request the upstream sends in its answer
/// to a call whose result the mesh judges (an answer the gateway reads
/// whole, alone or in a JSON-RPC batch) cannot be sent to the client
/// there: the gateway answers it with `-32076`, so the upstream does not
/// wait for it, and the call's result is judged and relayed. The scripted
/// upstream says in the call's result what answer its request got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_request_inside_a_judged_answer_is_answered_http() {
    let (mesh, guard) = mesh_judging_results("returns-sampler-http").await;
    let (port, _upstream) = odd_http().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", port, &[]).await;
    let session = http_session(&url).await;
    let call = RawGateway::call(json!(1), "sampler", json!({}));
    for body in [call.to_string(), json!([call]).to_string()] {
        let (status, _, answer) = post(&url, Some(&session), &body).await;
        assert_eq!(status, 200, "{answer}");
        assert!(
            answer.contains("sampling answered with -32076"),
            "the upstream got the gateway's answer: {answer}"
        );
        assert!(!answer.contains("sampling/createMessage"), "{answer}");
    }
    assert_eq!(guard.guard.requests(), 2, "both results judged");
}

/// The requests of a client fetching tasks the gateway did not see
/// created (by the upstream behind its back, or before it started): a
/// result (`taskId`, and `TASKID` as Go's `encoding/json` reads it) and a
/// status that carries a result.
fn unseen_task_requests() -> [String; 3] {
    [
        r#"{"jsonrpc":"2.0","id":"r","method":"tasks/result","params":{"taskId":"task-9"}}"#,
        r#"{"jsonrpc":"2.0","id":"R","method":"tasks/result","params":{"TASKID":"task-9"}}"#,
        r#"{"jsonrpc":"2.0","id":"g","method":"tasks/get","params":{"taskId":"full-9"}}"#,
    ]
    .map(str::to_owned)
}

/// The answers to [`unseen_task_requests`]: both results refused with
/// `-32077` (not judged, so not fetched), the status relayed without the
/// result it carried.
fn assert_unseen_tasks_refused(answers: &[Value]) {
    no_secret(answers);
    for answer in &answers[..2] {
        assert_eq!(answer["error"]["code"], -32077, "{answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains("was not created through this gateway"),
            "{answer}"
        );
    }
    assert_eq!(answers[2]["id"], "g", "{}", answers[2]);
    assert_eq!(
        answers[2]["result"]["status"], "completed",
        "{}",
        answers[2]
    );
    assert!(
        answers[2]["result"].get("content").is_none(),
        "{}",
        answers[2]
    );
}

/// R31, R33: the result of a task the gateway did not see created cannot
/// be judged: `tasks/result` of it is refused, never fetched and relayed
/// unjudged; `tasks/get` of it relays the task's status only. A task
/// created through the gateway under a chain that does not judge results
/// is fetched as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r33_a_task_not_seen_created_is_never_relayed_unjudged() {
    let (mesh, guard) = mesh_judging_results("returns-unseen-task").await;
    let url = mesh.url.clone();
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = raw_gateway(&url);
        let answers: Vec<Value> = unseen_task_requests()
            .iter()
            .map(|request| {
                gateway.send(request);
                gateway.recv()
            })
            .collect();
        gateway.end();
        answers
    })
    .await
    .unwrap();
    assert_unseen_tasks_refused(&answers);
    let (port, _upstream) = odd_http().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", port, &[]).await;
    let session = http_session(&url).await;
    let mut answers = Vec::new();
    for request in unseen_task_requests() {
        let (status, _, answer) = post(&url, Some(&session), &request).await;
        assert_eq!(status, 200, "{answer}");
        answers.push(serde_json::from_str(&answer).unwrap_or(json!(answer)));
    }
    assert_unseen_tasks_refused(&answers);
    assert_eq!(guard.guard.requests(), 0, "nothing to judge");

    // Without a results guard, a task created through the gateway is
    // fetched as before (its result is the plain call's, unjudged).
    let plain = MeshProcess::start("returns-seen-task", "", None).await;
    let (url, _plain_gateway) = gateway_before(&plain.url, "127.0.0.1", port, &[]).await;
    let session = http_session(&url).await;
    let mut call = RawGateway::call(json!(5), "clean", json!({}));
    call["params"]["task"] = json!({"ttl": 60000});
    let (_, _, created) = post(&url, Some(&session), &call.to_string()).await;
    let created: Value = serde_json::from_str(&created).unwrap_or(json!(created));
    let task = created["result"]["task"]["taskId"]
        .as_str()
        .unwrap_or_else(|| panic!("{created}"));
    let fetch = json!({"jsonrpc": "2.0", "id": 6, "method": "tasks/result",
        "params": {"taskId": task}});
    let (_, _, result) = post(&url, Some(&session), &fetch.to_string()).await;
    assert!(result.contains("task result"), "{result}");
}
