//! The MCP gateway's relay, end to end through the `guardmesh` binary
//! (R31): single `tools/call` requests of `guardmesh mcp http` grouped into
//! one guard batch, and what the relay of the upstream's stderr in
//! `guardmesh mcp stdio` does that an inherited stderr would not.

use crate::mcp::{RawGateway, Scratch, http_gateway_with, http_session, mesh_with_policy, post};
use serde_json::{Value, json};
use std::ffi::OsStr;
use std::process::{Command, Stdio};

/// The JSON-RPC message of an HTTP answer: a JSON body, or the first
/// `data:` line of an SSE body (chunked transfer coding undone).
fn message(head: &str, body: &str) -> Value {
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).unwrap();
            if size == 0 {
                break;
            }
            out.push_str(&tail[..size]);
            rest = &tail[size + 2..];
        }
        out
    } else {
        body.to_owned()
    };
    let text = if body.trim_start().starts_with('{') {
        body.trim().to_owned()
    } else {
        body.lines()
            .find_map(|l| l.strip_prefix("data:"))
            .unwrap_or_else(|| panic!("no JSON-RPC message in {body:?}"))
            .trim()
            .to_owned()
    };
    serde_json::from_str(&text).unwrap()
}

/// Posts each of `requests` on its own connection, all at once; returns
/// the answers in the same order.
async fn post_together(url: &str, session: &str, requests: Vec<Value>) -> Vec<Value> {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let (url, session) = (url.to_owned(), session.to_owned());
            tokio::spawn(async move {
                let (status, head, body) = post(&url, Some(&session), &request.to_string()).await;
                assert_eq!(status, 200, "{head}\n{body}");
                message(&head, &body)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

/// Single `tools/call` POSTs of one MCP session arriving within
/// `--batch-window-ms` are one guard batch, each still answered on its own
/// request with its own decision (R2, R31); with `--batch-window-ms 0` each
/// call is a batch of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_http_single_calls_within_the_window_are_one_guard_batch() {
    let (mesh, guard) = mesh_with_policy("mcp-http-group").await;
    let scratch = Scratch::new("http-group");
    let requests = |base: i64| {
        vec![
            RawGateway::call(json!(base), "delete_file", json!({"path": "/x"})),
            RawGateway::call(json!(base + 1), "read_file", json!({"path": "/etc/passwd"})),
            RawGateway::call(json!(base + 2), "pay", json!({"amount": 500, "to": "m"})),
            RawGateway::call(json!(base + 3), "pay", json!({"amount": 5, "to": "b"})),
        ]
    };
    // A window far longer than four requests sent at once take to arrive.
    let window: [&OsStr; 2] = ["--batch-window-ms".as_ref(), "400".as_ref()];
    let (url, upstream, gateway) =
        http_gateway_with(&mesh.url, &scratch, "127.0.0.1", &window).await;
    let session = http_session(&url).await;
    let answers = post_together(&url, &session, requests(1)).await;
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer["id"], 1 + i as i64, "{answers:?}");
    }
    assert_eq!(answers[0]["result"]["isError"], true, "{answers:?}");
    assert_eq!(
        answers[0]["result"]["content"][0]["text"],
        "deleting is not allowed; use trash"
    );
    assert_eq!(
        answers[1]["result"]["content"][0]["text"],
        "contents of /redacted"
    );
    assert_eq!(answers[2]["result"]["isError"], false);
    assert_eq!(
        answers[2]["result"]["content"][0]["text"],
        "payments over 100 need approval"
    );
    assert_eq!(answers[3]["result"]["content"][0]["text"], "paid 5.0 to b");
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 1, "one guard batch: {batches:?}");
    assert_eq!(batches[0].calls.len(), 4);
    assert_eq!(batches[0].context.as_ref().unwrap().session_id, session);
    let mut executed = scratch.executed();
    executed.sort_by_key(|e| e.to_string());
    assert_eq!(
        executed,
        vec![
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "b"}}),
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
        ]
    );
    drop((upstream, gateway));

    // A zero window: the same four requests are four batches of one.
    let window: [&OsStr; 2] = ["--batch-window-ms".as_ref(), "0".as_ref()];
    let (url, _upstream, _gateway) =
        http_gateway_with(&mesh.url, &scratch, "127.0.0.1", &window).await;
    let session = http_session(&url).await;
    let answers = post_together(&url, &session, requests(11)).await;
    assert_eq!(answers[0]["result"]["isError"], true, "{answers:?}");
    assert_eq!(answers[3]["result"]["content"][0]["text"], "paid 5.0 to b");
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 5, "{batches:?}");
    assert!(
        batches[1..].iter().all(|b| b.calls.len() == 1),
        "{batches:?}"
    );
}

/// `guardmesh mcp stdio` with `RUST_LOG=warn` and its stderr in `stderr`.
fn stdio_gateway(mesh: &str, upstream: Vec<String>, stderr: Stdio) -> RawGateway {
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args(["mcp", "stdio", "--mesh", mesh, "--"])
        .args(upstream)
        .env("RUST_LOG", "warn")
        .stderr(stderr);
    RawGateway::spawn(command)
}

/// The upstream's stderr reaches the gateway's stderr in whole lines: a
/// line the upstream writes in two parts, with the gateway logging a
/// warning of its own in between (about a line on the upstream's stdout
/// that is not JSON), is still one line, and the warning is a line of its
/// own. An upstream sharing the gateway's stderr would have the warning cut
/// into its line. The line that is not JSON never reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_upstream_stderr_lines_are_never_cut_by_the_gateway_log() {
    let (mesh, _guard) = mesh_with_policy("mcp-stderr-split").await;
    let scratch = Scratch::new("stderr-split");
    let upstream = scratch.upstream(&["split-stderr"]);
    let stderr_path = scratch.dir.join("gateway.stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let url = mesh.url.clone();
    let status = tokio::task::spawn_blocking(move || {
        let mut gateway = stdio_gateway(&url, upstream, stderr.into());
        gateway.send(&RawGateway::call(json!(1), "read_file", json!({"path": "/a"})).to_string());
        let answer = gateway.recv();
        assert_eq!(answer["id"], 1, "{answer}");
        assert_eq!(answer["result"]["content"][0]["text"], "contents of /a");
        let (rest, status) = gateway.end();
        assert_eq!(rest, "", "nothing but answers on stdout");
        status
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    let warning = stderr
        .lines()
        .find(|l| l.contains("not JSON"))
        .unwrap_or_else(|| panic!("the gateway logged no warning: {stderr}"));
    assert!(!warning.contains("upstream:"), "{stderr}");
    // A log file, not a terminal: no colour escapes in the gateway's lines.
    assert!(!warning.contains('\u{1b}'), "{warning:?}");
    assert!(
        stderr
            .lines()
            .any(|l| l == "upstream: first half, second half"),
        "the upstream's line was cut: {stderr}"
    );
}

/// The upstream does not depend on the host reading the gateway's stderr:
/// with that stderr closed (a host that discards it by closing the pipe),
/// an upstream that logs much to stderr still starts and serves the
/// session, where one sharing the closed stderr would fail on its first
/// log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_upstream_serves_when_the_gateway_stderr_is_closed() {
    let (mesh, _guard) = mesh_with_policy("mcp-stderr-closed").await;
    let scratch = Scratch::new("stderr-closed");
    let upstream = scratch.upstream(&["noisy"]);
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let url = mesh.url.clone();
    let status = tokio::task::spawn_blocking(move || {
        let mut gateway = stdio_gateway(&url, upstream, writer.into());
        gateway.send(&json!({"jsonrpc": "2.0", "id": "l", "method": "tools/list"}).to_string());
        let listed = gateway.recv();
        assert_eq!(listed["result"]["tools"].as_array().unwrap().len(), 4);
        gateway
            .send(&RawGateway::call(json!(1), "pay", json!({"amount": 2, "to": "b"})).to_string());
        let answer = gateway.recv();
        assert_eq!(answer["result"]["content"][0]["text"], "paid 2.0 to b");
        gateway.send(&RawGateway::call(json!(2), "delete_file", json!({"path": "/"})).to_string());
        assert_eq!(gateway.recv()["result"]["isError"], true);
        drop(gateway.stdin.take());
        gateway.child.wait().unwrap()
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "pay", "arguments": {"amount": 2.0, "to": "b"}})]
    );
}
