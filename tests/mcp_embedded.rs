//! `guardmesh mcp stdio --config MESH_TOML`: the gateway judging with the
//! mesh of a config file in its own process (R31), end to end with the
//! official Python MCP SDK as client and upstream, a remote guard on
//! loopback and a CEL policy guard, both from the config. What `guardmesh
//! serve` does with a config, the embedded mesh does: registration order
//! (R16), rewrites (R10), steer and cancel (R31), failure policies (R13),
//! session ids (R34) and the decision log (R29), closed cleanly when the
//! session ends.
//!
//! Needs `scripts/setup-polyglot` (the SDK in build/venv).

use crate::harness::*;
use crate::mcp::{Scratch, calls, policy, run_client_off_thread, via_gateway_judging};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

/// A CEL policy beside the remote guard: payments over 1000 are cancelled.
const CEL: &str = policy_rule!(name: "big-payments", tools: ["pay"], action: "cancel",
    when: r#""has(call.args.amount) && call.args.amount > 1000""#,
    message: r#"'"payments over 1000 need a human"'"#);

/// `stdio guardmesh mcp stdio --config CONFIG [extra] -- UPSTREAM...`
fn via_embedded(config: &Path, extra: &[&str], upstream: Vec<String>) -> Vec<String> {
    via_gateway_judging(["--config", &config.display().to_string()], extra, upstream)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r29_a_gateway_with_a_config_judges_in_its_own_process() {
    let guard = call_guard(Duration::ZERO, policy).await;
    let scratch = Scratch::new("embedded");
    let log = scratch.dir.join("log");
    std::fs::write(scratch.dir.join("cel.toml"), CEL).unwrap();
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[decision_log]\ndir = {:?}\n\n\
             [[guard]]\nname = \"policy\"\nendpoint = {:?}\nrole = \"mutate\"\n\
             grant = {{ tools = [\"read_file\"] }}\n\n\
             [[guard]]\nname = \"cel\"\npolicy = \"cel.toml\"\n",
            log.display().to_string(),
            guard.url
        ),
    )
    .unwrap();
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "mallory"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5000, "to": "bob"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]});
    let target = via_embedded(&config, &["--session", "s-7"], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    let results = calls(&lines);
    assert_eq!(results.len(), 5, "{lines:?}");
    // The remote guard's rewrite applied (R10), its steer and cancel (R31).
    assert_eq!(results[0]["text"][0], "contents of /redacted", "{lines:?}");
    assert_eq!(results[1]["isError"], true, "{:?}", results[1]);
    assert_eq!(results[1]["text"][0], "deleting is not allowed; use trash");
    assert_eq!(results[2]["isError"], false);
    assert_eq!(results[2]["text"][0], "payments over 100 need approval");
    // The first skip wins (R4): 5000 is cancelled by the remote guard, which
    // comes first in the file (R16), not by the CEL policy after it.
    assert_eq!(results[3]["text"][0], "payments over 100 need approval");
    assert_eq!(results[4]["text"][0], "paid 5.0 to bob");
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}}),
        ],
        "the upstream ran only what was allowed, as rewritten"
    );
    // Each tools/call was one batch of the MCP session, sent to the remote
    // guard by the mesh inside the gateway.
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 5);
    assert!(
        batches
            .iter()
            .all(|b| b.context.as_ref().unwrap().session_id == "s-7")
    );

    // R29: one record per batch, naming the in-process caller, and a log
    // closed cleanly when the session ended (it verifies).
    let all = records(&log);
    let changes = all.iter().filter(|r| r["kind"] == "chain_change").count();
    assert_eq!(changes, 2, "the config's two guards: {all:?}");
    let records: Vec<&Value> = all.iter().filter(|r| r["kind"] == "decision").collect();
    assert_eq!(records.len(), 5, "{all:?}");
    for record in &records {
        assert_eq!(record["caller"]["peer"], "in-process:mcp-stdio", "{record}");
        assert_eq!(record["batch"]["session_id"], "s-7", "{record}");
    }
    let actions: Vec<&Value> = records
        .iter()
        .map(|r| &r["decisions"][0]["action"])
        .collect();
    assert_eq!(
        actions,
        ["proceed", "steer", "cancel", "cancel", "proceed"],
        "{records:?}"
    );
    let verify = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["log", "verify"])
        .arg(&log)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}{}",
        text(&verify.stdout),
        text(&verify.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r13_r31_an_embedded_mesh_whose_guard_is_down_forwards_nothing() {
    let scratch = Scratch::new("embedded-down");
    let closed = closed_port().await;
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[[guard]]\nname = \"strict\"\nendpoint = {closed:?}\nfailure_policy = \"abort\"\ntimeout_ms = 500\n"
        ),
    )
    .unwrap();
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 1, "to": "bob"}},
    ]});
    let target = via_embedded(&config, &[], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    let result = calls(&lines)[0];
    // Aborted (R13): a JSON-RPC error naming the guard, as with --mesh.
    assert_eq!(result["error"]["code"], -32070, "{result:?}");
    assert!(
        result["error"]["message"]
            .as_str()
            .unwrap()
            .contains("strict"),
        "{result:?}"
    );
    assert_eq!(scratch.executed(), Vec::<Value>::new(), "nothing forwarded");
}

#[test]
fn r31_a_gateway_whose_config_cannot_start_a_mesh_starts_no_upstream() {
    let scratch = Scratch::new("embedded-broken");
    let marker = scratch.dir.join("upstream-ran");
    let upstream = format!("touch {}", marker.display());
    for (name, config, expect) in [
        ("missing", None, "cannot read config file"),
        (
            "unknown-key",
            Some(
                "[[guard]]\nname = \"a\"\nendpoint = \"http://127.0.0.1:1\"\nfailure = \"open\"\n",
            ),
            "failure",
        ),
        (
            "missing-policy",
            Some("[[guard]]\nname = \"p\"\npolicy = \"nowhere.toml\"\n"),
            "nowhere.toml",
        ),
    ] {
        let path = scratch.dir.join(format!("{name}.toml"));
        if let Some(config) = config {
            std::fs::write(&path, config).unwrap();
        }
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["mcp", "stdio", "--config"])
            .arg(&path)
            .args(["--", "sh", "-c", &upstream])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{name}: {stderr}");
        assert!(
            stderr.contains(&path.display().to_string()) && stderr.contains(expect),
            "{name}: the error names the file and what is wrong: {stderr}"
        );
        assert!(
            !marker.exists(),
            "{name}: the upstream was started without a mesh"
        );
    }
}

/// Writes `lines` to a `guardmesh mcp stdio --config` gateway in front of
/// the SDK's upstream, one at a time, each after the answer to the one
/// before; returns the answers with the time each took.
fn exchange(config: &Path, upstream: &[String], lines: &[Value]) -> Vec<(Value, Duration)> {
    exchange_with_env(config, upstream, &[], lines)
}

/// [`exchange`] with `env` set on the gateway's process.
fn exchange_with_env(
    config: &Path,
    upstream: &[String],
    env: &[(&str, &str)],
    lines: &[Value],
) -> Vec<(Value, Duration)> {
    use std::io::{BufRead, BufReader, Write};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .envs(env.iter().copied())
        .args(["mcp", "stdio", "--config"])
        .arg(config)
        .arg("--")
        .args(upstream)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut answers = Vec::new();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}});
    for line in std::iter::once(&init).chain(lines) {
        let started = std::time::Instant::now();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let mut answer = String::new();
        stdout.read_line(&mut answer).unwrap();
        answers.push((serde_json::from_str(&answer).unwrap(), started.elapsed()));
    }
    drop(stdin);
    let _ = child.wait();
    answers.remove(0);
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r14_r20_the_mesh_in_the_gateway_keeps_its_limits_and_deadlines() {
    // A guard that answers after 5 s, past its 300 ms timeout (R14).
    let slow = slow_guard(Duration::from_secs(5)).await;
    let scratch = Scratch::new("embedded-bounds");
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[limits]\nmax_argument_bytes = 64\nmax_calls_per_batch = 2\n\n\
             [[guard]]\nname = \"slow\"\nendpoint = {:?}\ntimeout_ms = 300\nfailure_policy = \"fail_closed\"\n",
            slow.url
        ),
    )
    .unwrap();
    let call = |id: u32, amount: u32, to: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
               "params": {"name": "pay", "arguments": {"amount": amount, "to": to}}})
    };
    let lines = vec![
        // Over max_argument_bytes (R20).
        call(1, 1, &"x".repeat(200)),
        // A JSON-RPC batch of three calls: one guard batch, over
        // max_calls_per_batch (R20, R31).
        json!([call(2, 1, "a"), call(3, 1, "b"), call(4, 1, "c")]),
        // Within the limits: the guard times out, fail_closed (R13, R14).
        call(5, 1, "bob"),
        // The interceptors extension needs a mesh reached with --mesh.
        json!({"jsonrpc": "2.0", "id": 6, "method": "interceptors/list", "params": {}}),
    ];
    let upstream = scratch.upstream(&["stdio"]);
    let answers = tokio::task::spawn_blocking(move || exchange(&config, &upstream, &lines))
        .await
        .unwrap();
    let (big, _) = &answers[0];
    assert_eq!(big["error"]["code"], -32070, "{big}");
    assert!(
        big["error"]["message"]
            .as_str()
            .unwrap()
            .contains("220 bytes of arguments; the limit is 64"),
        "the refusal names the limit: {big}"
    );
    let (batch, _) = &answers[1];
    let batch = batch
        .as_array()
        .expect("a JSON-RPC batch is answered with an array");
    assert_eq!(batch.len(), 3, "{batch:?}");
    for answer in batch {
        assert_eq!(answer["error"]["code"], -32070, "{answer}");
    }
    assert_eq!(slow.guard.requests(), 1, "refused batches contact no guard");
    let (late, took) = &answers[2];
    assert!(
        late.get("error").is_some() || late["result"]["isError"].is_boolean(),
        "answered, not forwarded: {late}"
    );
    assert!(
        *took < Duration::from_secs(4),
        "answered by the guard's deadline, not its 5 s: {took:?}"
    );
    let (listed, _) = &answers[3];
    assert_eq!(listed["error"]["code"], -32071, "{listed}");
    assert!(
        listed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--mesh"),
        "{listed}"
    );
    assert_eq!(scratch.executed(), Vec::<Value>::new(), "nothing forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_the_http_gateway_with_a_config_judges_in_its_own_process() {
    let guard = call_guard(Duration::ZERO, policy).await;
    let scratch = Scratch::new("embedded-http");
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!("[[guard]]\nname = \"policy\"\nendpoint = {:?}\n", guard.url),
    )
    .unwrap();
    let (upstream_port, _upstream) = scratch.http_upstream().await;
    let port = free_port();
    let mut command = crate::mcp::gateway_command(
        [std::ffi::OsStr::new("--config"), config.as_os_str()],
        &format!("127.0.0.1:{port}"),
        upstream_port,
    );
    let _gateway = crate::mcp::listening(&mut command, port, "guardmesh mcp http --config").await;
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]});
    let target = vec!["http".to_owned(), format!("http://127.0.0.1:{port}/mcp")];
    let lines = run_client_off_thread(scenario, target).await;
    let results = calls(&lines);
    assert_eq!(results[0]["isError"], true, "{lines:?}");
    assert_eq!(results[0]["text"][0], "deleting is not allowed; use trash");
    assert_eq!(results[1]["text"][0], "paid 5.0 to bob", "{lines:?}");
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}})]
    );
    assert_eq!(guard.guard.batches().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r31b_config_wins_over_an_exported_mesh_address_and_the_hook_refuses_it() {
    let scratch = Scratch::new("embedded-env");
    std::fs::write(scratch.dir.join("cel.toml"), CEL).unwrap();
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        "[[guard]]\nname = \"cel\"\npolicy = \"cel.toml\"\n",
    )
    .unwrap();
    let upstream = scratch.upstream(&["stdio"]);
    // A mesh address exported for other commands, reaching nothing: the
    // gateway judges with its config all the same (a warning says so).
    let closed = closed_port().await;
    let answers = tokio::task::spawn_blocking({
        let config = config.clone();
        move || {
            // The variable is set on the gateway's process only.
            exchange_with_env(
                &config,
                &upstream,
                &[("GUARDMESH_MESH", closed.as_str())],
                &[json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                    "params": {"name": "pay", "arguments": {"amount": 5000, "to": "bob"}}})],
            )
        }
    })
    .await
    .unwrap();
    let (cancelled, _) = &answers[0];
    assert_eq!(
        cancelled["result"]["content"][0]["text"], "payments over 1000 need a human",
        "{cancelled}"
    );
    assert_eq!(scratch.executed(), Vec::<Value>::new());

    // R31b: the hook runs once per call and reaches a mesh: `--config`
    // blocks the call (exit 2) with the reason, never lets it through.
    let hook = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["hook", "pre-tool-use", "--config"])
        .arg(&config)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(hook.status.code(), Some(2), "{}", text(&hook.stderr));
    assert!(text(&hook.stdout).is_empty());
    assert!(
        text(&hook.stderr).contains("--config"),
        "{}",
        text(&hook.stderr)
    );
}
