//! The MCP gateway and the PreToolUse hook (R31), end to end: a real
//! `guardmesh serve` process, a scripted guard, the `guardmesh mcp` /
//! `guardmesh hook` process, and the official Python MCP SDK (`mcp` on PyPI)
//! as the MCP client and as the upstream MCP server, whose log says what it
//! actually executed.
//!
//! Needs `scripts/setup-polyglot` (the SDK in build/venv).

use crate::harness::*;
use guardmesh_client::Registration;
use guardmesh_client::proto::FailurePolicy;
use guardmesh_client::proto::GuardBatch;
use guardmesh_client::verdict::{cancel, rewrite_arguments, steer};
use serde_json::{Value, json};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

pub(crate) fn sdk_dir() -> PathBuf {
    repo_root().join("tests/mcp-sdk")
}

/// The venv's python, with the MCP SDK installed.
pub(crate) fn mcp_python() -> PathBuf {
    let python = python();
    let ok = Command::new(&python)
        .args(["-c", "import mcp.server.mcpserver"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "the MCP SDK is not installed: run scripts/setup-polyglot"
    );
    python
}

/// A temporary folder with the upstream's log.
pub(crate) struct Scratch {
    pub(crate) dir: PathBuf,
}

impl Scratch {
    pub(crate) fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("guardmesh-mcp-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self { dir }
    }

    pub(crate) fn log(&self) -> PathBuf {
        self.dir.join("upstream.log")
    }

    /// What the upstream executed, in order.
    pub(crate) fn executed(&self) -> Vec<Value> {
        std::fs::read_to_string(self.log())
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// The upstream server's command line (stdio).
    pub(crate) fn upstream(&self, mode: &[&str]) -> Vec<String> {
        let mut command = vec![
            mcp_python().display().to_string(),
            sdk_dir().join("upstream.py").display().to_string(),
            self.log().display().to_string(),
        ];
        command.extend(mode.iter().map(|s| s.to_string()));
        command
    }
}

impl Scratch {
    /// The Python upstream on Streamable HTTP on a free port, its output to
    /// nowhere, once it listens: (its port, the process).
    pub(crate) async fn http_upstream(&self) -> (u16, KillOnDrop) {
        let port = free_port();
        let mut command = self.upstream(&["http", &port.to_string()]);
        let mut command_line = Command::new(command.remove(0));
        command_line.args(command).stderr(Stdio::null());
        let upstream = listening(&mut command_line, port, "the upstream MCP server").await;
        (port, upstream)
    }
}

/// `guardmesh mcp http ARGS... --listen LISTEN --upstream
/// http://127.0.0.1:UPSTREAM_PORT/mcp` (ARGS: `--mesh URL` or `--config
/// FILE`), its standard output to nowhere; not started yet.
pub(crate) fn gateway_command<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    listen: &str,
    upstream_port: u16,
) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args(["mcp", "http"])
        .args(args)
        .args(["--listen", listen, "--upstream"])
        .arg(format!("http://127.0.0.1:{upstream_port}/mcp"))
        .stdout(Stdio::null());
    command
}

/// Starts `command` (its standard output to nowhere) and waits until it
/// listens on `port`; `what` names it.
pub(crate) async fn listening(command: &mut Command, port: u16, what: &str) -> KillOnDrop {
    let child = KillOnDrop(
        command
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {what}: {e}")),
    );
    wait_for_port(port, what).await;
    child
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The judging the tests use: delete_file steered, pay over 100 cancelled,
/// read_file of /etc/* rewritten to /redacted, write_note (a tool with an
/// output schema) cancelled under /etc/ and steered when empty, everything
/// else proceeds.
pub(crate) fn policy(
    call: &guardmesh_client::proto::ToolCall,
) -> Option<guardmesh_client::proto::Verdict> {
    let args: Value = serde_json::from_str(&call.arguments).unwrap_or(json!({}));
    match call.tool.as_str() {
        "delete_file" => Some(steer(&call.call_id, "deleting is not allowed; use trash")),
        "pay" if args["amount"].as_f64().unwrap_or(0.0) > 100.0 => {
            Some(cancel(&call.call_id, "payments over 100 need approval"))
        }
        "read_file" if args["path"].as_str().unwrap_or("").starts_with("/etc/") => Some(
            rewrite_arguments(&call.call_id, &json!({ "path": "/redacted" })),
        ),
        // The reference filesystem server's tools (tests/mcp_answers.rs).
        "write_file" if args["path"].as_str().unwrap_or("").contains("/forbidden") => {
            Some(cancel(&call.call_id, "writing there is not allowed"))
        }
        "create_directory" => Some(steer(
            &call.call_id,
            "directories are made by the operator: write into an existing one",
        )),
        "write_note" if args["path"].as_str().unwrap_or("").starts_with("/etc/") => {
            Some(cancel(&call.call_id, "notes under /etc are not allowed"))
        }
        "write_note" if args["text"].as_str().unwrap_or("").is_empty() => Some(steer(
            &call.call_id,
            "an empty note: write what it should say",
        )),
        _ => None,
    }
}

/// A mesh process with the policy guard registered (mutate, grant
/// read_file, so it may also skip: R12).
pub(crate) async fn mesh_with_policy(name: &str) -> (MeshProcess, TestGuard) {
    let mesh = MeshProcess::start(name, "", None).await;
    let guard = call_guard(Duration::ZERO, policy).await;
    mesh.register(Registration::mutate("policy", &guard.url, ["read_file"]))
        .await;
    (mesh, guard)
}

/// Runs the Python SDK client with `scenario` against `target` (the
/// `stdio COMMAND...` or `http URL` arguments); returns its output lines.
/// [`run_client`] off the runtime's thread (the mesh it reaches runs on it).
pub(crate) async fn run_client_off_thread(scenario: Value, target: Vec<String>) -> Vec<Value> {
    tokio::task::spawn_blocking(move || run_client(scenario, &target))
        .await
        .unwrap()
}

pub(crate) fn run_client(scenario: Value, target: &[String]) -> Vec<Value> {
    run_sdk_client(
        &mcp_python(),
        &sdk_dir().join("client.py"),
        &scenario,
        target,
    )
}

/// Runs an SDK client script (`program script SCENARIO TARGET...`, as
/// tests/mcp-sdk/client.py and ts/client.mjs take them); returns its
/// output lines, one JSON value each.
pub(crate) fn run_sdk_client(
    program: &std::path::Path,
    script: &std::path::Path,
    scenario: &Value,
    target: &[String],
) -> Vec<Value> {
    let output = Command::new(program)
        .arg(script)
        .arg(scenario.to_string())
        .args(target)
        .stdin(Stdio::null())
        .output()
        .expect("run the MCP client");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "client failed: {}\nstdout: {stdout}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `stdio guardmesh mcp stdio --mesh URL [extra] -- UPSTREAM...`
pub(crate) fn via_gateway(mesh: &str, extra: &[&str], upstream: Vec<String>) -> Vec<String> {
    via_gateway_judging(["--mesh", mesh], extra, upstream)
}

/// `stdio guardmesh mcp stdio FLAG VALUE [extra] -- UPSTREAM...`, where
/// `FLAG VALUE` says how the gateway judges (`--mesh URL`, `--config FILE`).
pub(crate) fn via_gateway_judging(
    [flag, value]: [&str; 2],
    extra: &[&str],
    upstream: Vec<String>,
) -> Vec<String> {
    let mut target = vec![
        "stdio".to_owned(),
        env!("CARGO_BIN_EXE_guardmesh").to_owned(),
        "mcp".into(),
        "stdio".into(),
        flag.to_owned(),
        value.to_owned(),
    ];
    target.extend(extra.iter().map(|s| s.to_string()));
    target.push("--".into());
    target.extend(upstream);
    target
}

pub(crate) fn calls(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["op"] == "call").collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_stdio_decisions_through_the_official_sdk() {
    let (mesh, guard) = mesh_with_policy("mcp-stdio").await;
    let scratch = Scratch::new("stdio");
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "mallory"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]});
    let target = via_gateway(
        &mesh.url,
        &["--session", "s-42"],
        scratch.upstream(&["stdio"]),
    );
    let lines = run_client_off_thread(scenario, target).await;
    let results = calls(&lines);
    assert_eq!(results.len(), 4, "{lines:?}");
    // Proceed with the rewrite applied (R10, R31).
    assert_eq!(results[0]["isError"], false);
    assert_eq!(results[0]["text"][0], "contents of /redacted");
    // Steer: a tool result with isError true holding the content (R31).
    assert_eq!(results[1]["isError"], true, "{:?}", results[1]);
    assert_eq!(results[1]["text"][0], "deleting is not allowed; use trash");
    // Cancel: isError false holding the content (R31).
    assert_eq!(results[2]["isError"], false);
    assert_eq!(results[2]["text"][0], "payments over 100 need approval");
    assert_eq!(results[3]["text"][0], "paid 5.0 to bob");
    // The upstream never saw a skipped call and saw the rewritten arguments.
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}}),
        ]
    );
    // Each tools/call was one batch, in the MCP session (R31).
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 4);
    assert!(
        batches
            .iter()
            .all(|b| b.context.as_ref().unwrap().session_id == "s-42")
    );

    // tools/list is the upstream's with and without the gateway, but for
    // the output schemas the gateway takes out (R31, gateway/src/schemas.rs).
    let direct = {
        let mut target = vec!["stdio".to_owned()];
        target.extend(scratch.upstream(&["stdio"]));
        let scenario = json!({"mode": "legacy", "steps": [{"op": "list_tools"}]});
        run_client_off_thread(scenario, target).await
    };
    let listed = |lines: &[Value]| {
        lines
            .iter()
            .find(|l| l["op"] == "list_tools")
            .cloned()
            .unwrap()
    };
    let mut direct = listed(&direct);
    let schemas: Vec<String> = direct["tools"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .filter_map(|t| {
            let schema = t.as_object_mut()?.remove("outputSchema")?;
            Some(format!("{}: {schema}", t["name"]))
        })
        .collect();
    assert_eq!(schemas.len(), 1, "write_note declares one: {schemas:?}");
    assert_eq!(listed(&lines), direct);
    assert_eq!(listed(&lines)["tools"].as_array().unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_r31_a_session_without_calls_contacts_no_guard() {
    let (mesh, guard) = mesh_with_policy("mcp-zero").await;
    let scratch = Scratch::new("zero");
    // The default client mode too (it tries the stateless revision first).
    for mode in ["legacy", "auto"] {
        let scenario = json!({"mode": mode, "steps": [{"op": "list_tools"}, {"op": "list_tools"}]});
        let target = via_gateway(&mesh.url, &[], scratch.upstream(&["stdio"]));
        let lines = run_client_off_thread(scenario, target).await;
        assert_eq!(lines.iter().filter(|l| l["op"] == "list_tools").count(), 2);
    }
    assert_eq!(guard.guard.requests(), 0, "no guard contacted (R1, R31)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r13_aborted_and_unreachable_answer_json_rpc_errors_and_forward_nothing() {
    let mesh = MeshProcess::start("mcp-abort", "", None).await;
    let broken = script_guard(|_| Script {
        error: Some(tonic::Status::internal("guard down")),
        ..Script::default()
    })
    .await;
    mesh.register(
        Registration::validate("strict", &broken.url).failure_policy(FailurePolicy::Abort),
    )
    .await;
    let scratch = Scratch::new("abort");
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 1, "to": "bob"}},
    ]});
    let target = via_gateway(&mesh.url, &[], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    let result = calls(&lines)[0];
    assert_eq!(result["error"]["code"], -32070, "{result:?}");
    assert!(
        result["error"]["message"]
            .as_str()
            .unwrap()
            .contains("strict"),
        "{result:?}"
    );

    // A mesh that cannot be reached: fail closed.
    let closed = closed_port().await;
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 1, "to": "bob"}},
    ]});
    let target = via_gateway(&closed, &[], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    assert_eq!(calls(&lines)[0]["error"]["code"], -32071, "{lines:?}");
    assert_eq!(scratch.executed(), Vec::<Value>::new(), "nothing forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r22_r31_meta_traceparent_joins_the_trace() {
    let (mesh, guard) = mesh_with_policy("mcp-trace").await;
    let scratch = Scratch::new("trace");
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "call", "name": "read_file", "arguments": {"path": "/a"},
         "meta": {"traceparent": TRACEPARENT}},
    ]});
    let target = via_gateway(&mesh.url, &[], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    assert_eq!(calls(&lines)[0]["isError"], false, "{lines:?}");
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 1);
    let (trace_id, _, _) =
        guardmesh_client::trace::parse_traceparent(&batches[0].traceparent).expect("traceparent");
    assert_eq!(trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
}

// ---------------------------------------------------------------------------
// Raw JSON-RPC on the gateway's stdio: batches and hostile input.
// ---------------------------------------------------------------------------

/// `guardmesh mcp stdio` driven line by line.
pub(crate) struct RawGateway {
    pub(crate) child: std::process::Child,
    pub(crate) stdin: Option<std::process::ChildStdin>,
    pub(crate) stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl RawGateway {
    pub(crate) fn start(mesh: &str, extra: &[&str], upstream: Vec<String>) -> Self {
        Self::start_with_stderr(mesh, extra, upstream, Stdio::inherit())
    }

    /// [`RawGateway::start`] with the gateway's stderr going to `stderr`.
    pub(crate) fn start_with_stderr(
        mesh: &str,
        extra: &[&str],
        upstream: Vec<String>,
        stderr: Stdio,
    ) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
        command
            .args(["mcp", "stdio", "--mesh", mesh])
            .args(extra)
            .arg("--")
            .args(upstream)
            .stderr(stderr);
        Self::spawn(command)
    }

    /// Starts `command` (a `guardmesh mcp stdio ...` line, its stderr set)
    /// and initializes the session.
    pub(crate) fn spawn(command: Command) -> Self {
        Self::spawn_declaring(command, json!({}))
    }

    /// [`RawGateway::spawn`], the client declaring `capabilities`.
    pub(crate) fn spawn_declaring(mut command: Command, capabilities: Value) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut gateway = Self {
            child,
            stdin,
            stdout,
        };
        gateway.send(
            &json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": capabilities,
            "clientInfo": {"name": "raw", "version": "0"}}})
            .to_string(),
        );
        let init = gateway.recv();
        assert_eq!(init["id"], "init", "{init}");
        gateway.send(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
        gateway
    }

    pub(crate) fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// The client ends the session: stdin closed, the rest of stdout read,
    /// the gateway's exit awaited.
    pub(crate) fn end(&mut self) -> (String, std::process::ExitStatus) {
        drop(self.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        (rest, self.child.wait().unwrap())
    }

    pub(crate) fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "the gateway closed its stdout");
        serde_json::from_str(&line).unwrap()
    }

    pub(crate) fn call(id: Value, tool: &str, arguments: Value) -> Value {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
               "params": {"name": tool, "arguments": arguments}})
    }
}

impl Drop for RawGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The answers of a JSON-RPC batch's answer `answers` by their id (as
/// JSON text: `1`, `"3"`).
pub(crate) fn by_id(answers: &Value) -> std::collections::HashMap<String, Value> {
    answers
        .as_array()
        .unwrap_or_else(|| panic!("an array: {answers}"))
        .iter()
        .map(|a| (a["id"].to_string(), a.clone()))
        .collect()
}

/// Sends the JSON-RPC `batch` to a raw `guardmesh mcp stdio` of `mesh`
/// (with `extra` flags) before `upstream`, and reads its one answer: the
/// answers by id.
pub(crate) async fn stdio_batch(
    mesh: &str,
    extra: &[&'static str],
    upstream: Vec<String>,
    batch: Value,
) -> std::collections::HashMap<String, Value> {
    let (mesh, extra) = (mesh.to_owned(), extra.to_vec());
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&mesh, &extra, upstream);
        gateway.send(&batch.to_string());
        gateway.recv()
    })
    .await
    .unwrap();
    by_id(&answers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_json_rpc_batch_of_tool_calls_is_one_guard_batch() {
    let (mesh, guard) = mesh_with_policy("mcp-batch").await;
    let scratch = Scratch::new("batch");
    let batch = json!([
        RawGateway::call(json!(1), "delete_file", json!({"path": "/x"})),
        RawGateway::call(json!(2), "read_file", json!({"path": "/etc/passwd"})),
        RawGateway::call(json!("3"), "pay", json!({"amount": 1000, "to": "m"})),
        {"jsonrpc": "2.0", "id": 4, "method": "tools/list"},
        {"jsonrpc": "2.0", "method": "notifications/progress",
         "params": {"progressToken": 1, "progress": 1}},
    ]);
    // One array answering every request of the batch.
    let answers = stdio_batch(&mesh.url, &[], scratch.upstream(&["stdio"]), batch).await;
    assert_eq!(answers.len(), 4, "{answers:?}");
    assert_eq!(answers["1"]["result"]["isError"], true);
    assert_eq!(
        answers["2"]["result"]["content"][0]["text"],
        "contents of /redacted"
    );
    assert_eq!(answers["\"3\""]["result"]["isError"], false);
    assert_eq!(answers["4"]["result"]["tools"].as_array().unwrap().len(), 4);
    // The three tools/call were one guard batch (R31).
    let batches: Vec<GuardBatch> = guard.guard.batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0].calls.len(), 3);
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "read_file", "arguments": {"path": "/redacted"}})]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r20_hostile_input_is_never_forwarded_unjudged() {
    let (mesh, guard) = mesh_with_policy("mcp-hostile").await;
    let scratch = Scratch::new("hostile");
    let upstream = scratch.upstream(&["stdio"]);
    let url = mesh.url.clone();
    tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &["--max-message-bytes", "4096"], upstream);
        // Oversized: discarded, answered with -32072, id null.
        let big = RawGateway::call(json!(10), "pay", json!({"to": "x".repeat(8000), "amount": 1}));
        gateway.send(&big.to_string());
        let answer = gateway.recv();
        assert_eq!(answer["error"]["code"], -32072, "{answer}");
        assert_eq!(answer["id"], Value::Null);
        // Malformed JSON: parse error.
        gateway.send(r#"{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"pay",}"#);
        assert_eq!(gateway.recv()["error"]["code"], -32700);
        // Arguments that are not an object: invalid params, with the id.
        for (id, arguments) in [(12, json!([1, 2])), (13, json!("amount=1")), (14, Value::Null)] {
            gateway.send(&RawGateway::call(json!(id), "pay", arguments).to_string());
            let answer = gateway.recv();
            assert_eq!(answer["error"]["code"], -32602, "{answer}");
            assert_eq!(answer["id"], id);
        }
        // Duplicate member names: which "method" or "name" counts differs
        // between parsers, so the message is refused.
        gateway.send(r#"{"jsonrpc":"2.0","id":15,"method":"tools/list","method":"tools/call","params":{"name":"pay","arguments":{"amount":1,"to":"a"}}}"#);
        assert_eq!(gateway.recv()["error"]["code"], -32600);
        gateway.send(r#"{"jsonrpc":"2.0","id":16,"method":"tools/call","params":{"name":"read_file","name":"delete_file","arguments":{"path":"/"}}}"#);
        assert_eq!(gateway.recv()["error"]["code"], -32600);
        // Duplicate members inside the arguments: refused by the gateway
        // itself, at any depth (R31).
        gateway.send(r#"{"jsonrpc":"2.0","id":17,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1,"amount":1000,"to":"a"}}}"#);
        assert_eq!(gateway.recv()["error"]["code"], -32600);
        // A tools/call as a notification (no id) is dropped, not forwarded.
        gateway.send(r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"delete_file","arguments":{"path":"/n"}}}"#);
        // Colliding ids in one batch: the gateway refuses each request
        // using the id (R31: one id, one request in flight), none runs.
        let batch = json!([
            RawGateway::call(json!(20), "pay", json!({"amount": 1, "to": "a"})),
            RawGateway::call(json!(20), "delete_file", json!({"path": "/y"})),
        ]);
        gateway.send(&batch.to_string());
        let answers = gateway.recv();
        let answers = answers.as_array().unwrap();
        assert_eq!(answers.len(), 2);
        assert!(answers.iter().all(|a| a["error"]["code"] == -32600
            && a["error"]["message"].as_str().unwrap().contains("request id 20")), "{answers:?}");
        // The session still works, and the first call to run is this one.
        gateway.send(&RawGateway::call(json!(30), "read_file", json!({"path": "/ok"})).to_string());
        let answer = gateway.recv();
        assert_eq!(answer["id"], 30);
        assert_eq!(answer["result"]["content"][0]["text"], "contents of /ok");
    })
    .await
    .unwrap();
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "read_file", "arguments": {"path": "/ok"}})]
    );
    // Only the colliding batch and the last call reached the mesh, and only
    // the last reached the guard.
    assert_eq!(guard.guard.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_upstream_exit_ends_the_session_cleanly() {
    let (mesh, _guard) = mesh_with_policy("mcp-exit").await;
    let scratch = Scratch::new("exit");
    let upstream = scratch.upstream(&["exit-after", "1"]);
    let url = mesh.url.clone();
    let status = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &[], upstream);
        gateway.send(&RawGateway::call(json!(1), "read_file", json!({"path": "/a"})).to_string());
        assert_eq!(gateway.recv()["id"], 1);
        // The upstream exits after its first call: the gateway's stdout ends
        // and the process exits with the upstream's status.
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut gateway.stdout, &mut rest).unwrap();
        assert_eq!(rest, "");
        gateway.child.wait().unwrap()
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
}

/// R31: stdin and stdout that are files, not the pipes an MCP client gives
/// (the gateway reads pipes on its own reactor and anything else through
/// tokio's blocking-thread stdio): a line that is not JSON is still answered
/// with a parse error, written in full before the gateway exits at the end
/// of its input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_stdio_reads_and_writes_files_as_well_as_pipes() {
    let (mesh, _guard) = mesh_with_policy("mcp-files").await;
    let scratch = Scratch::new("files");
    let input = scratch.dir.join("in.jsonl");
    let output = scratch.dir.join("out.jsonl");
    std::fs::write(&input, "this is not json\n").unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args(["mcp", "stdio", "--mesh", &mesh.url, "--"])
        .args(scratch.upstream(&["stdio"]))
        .stdin(std::fs::File::open(&input).unwrap())
        .stdout(std::fs::File::create(&output).unwrap());
    let status = tokio::task::spawn_blocking(move || {
        let mut child = command.spawn().unwrap();
        for _ in 0..600 {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        panic!("the gateway did not exit within 60 s at the end of its input");
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
    let written = std::fs::read_to_string(&output).unwrap();
    let lines: Vec<Value> = written
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{written}");
    assert_eq!(lines[0]["error"]["code"], -32700, "{written}");
}

/// R31: stdin and stdout as socket pairs, which is what Node's
/// `child_process` (libuv) gives a child, so what most MCP clients give the
/// gateway: calls are judged and answered, a steered call is answered by
/// the gateway and not run, and the session ends when the client shuts its
/// side down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_stdio_over_socket_pairs_as_node_clients_give() {
    let (mesh, _guard) = mesh_with_policy("mcp-sockets").await;
    let scratch = Scratch::new("sockets");
    let upstream = scratch.upstream(&["stdio"]);
    let url = mesh.url.clone();
    let (answers, rest, status) = tokio::task::spawn_blocking(move || {
        use std::os::fd::OwnedFd;
        use std::os::unix::net::UnixStream;
        let (mut to_gateway, gateway_in) = UnixStream::pair().unwrap();
        let (from_gateway, gateway_out) = UnixStream::pair().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["mcp", "stdio", "--mesh", &url, "--"])
            .args(upstream)
            .stdin(Stdio::from(OwnedFd::from(gateway_in)))
            .stdout(Stdio::from(OwnedFd::from(gateway_out)))
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(from_gateway);
        let mut recv = || {
            let mut line = String::new();
            assert!(lines.read_line(&mut line).unwrap() > 0, "stdout ended");
            serde_json::from_str::<Value>(&line).unwrap()
        };
        let mut answers = Vec::new();
        for message in [
            json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "node-like", "version": "0"}}}),
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            RawGateway::call(json!(1), "read_file", json!({"path": "/a"})),
            RawGateway::call(json!(2), "delete_file", json!({"path": "/b"})),
        ] {
            writeln!(to_gateway, "{message}").unwrap();
            if message.get("id").is_some() {
                answers.push(recv());
            }
        }
        to_gateway.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut lines, &mut rest).unwrap();
        (answers, rest, child.wait().unwrap())
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(rest, "");
    assert_eq!(answers[0]["id"], "init", "{answers:?}");
    assert_eq!(answers[1]["id"], 1);
    assert_eq!(answers[1]["result"]["content"][0]["text"], "contents of /a");
    assert_eq!(answers[2]["id"], 2);
    assert_eq!(
        answers[2]["result"]["isError"], true,
        "steered: {answers:?}"
    );
    let executed = scratch.executed();
    assert_eq!(executed.len(), 1, "only the read ran: {executed:?}");
    assert_eq!(executed[0]["tool"], "read_file");
}

/// Whether the open file description behind `fd` is non-blocking.
fn nonblocking(fd: &impl std::os::fd::AsRawFd) -> bool {
    // SAFETY: F_GETFL on a descriptor the caller holds open.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    assert!(flags >= 0, "fcntl: {}", std::io::Error::last_os_error());
    flags & libc::O_NONBLOCK != 0
}

/// R31: the gateway reads and writes pipe and socket stdio without blocking
/// (the flag belongs to the open file description, shared with anyone
/// holding the same descriptor, such as a script that goes on writing to
/// the same stdout after the gateway), and puts the flags back as it found
/// them when it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_stdio_leaves_pipes_and_sockets_blocking_as_it_found_them() {
    use std::os::fd::OwnedFd;
    let (mesh, _guard) = mesh_with_policy("mcp-flags").await;
    let scratch = Scratch::new("flags");
    for sockets in [false, true] {
        let upstream = scratch.upstream(&["stdio"]);
        let url = mesh.url.clone();
        let (during, after, status) = tokio::task::spawn_blocking(move || {
            // (our end to write, the gateway's stdin, a copy of it) and
            // (our end to read, the gateway's stdout, a copy of it).
            let (to_gateway, stdin, from_gateway, stdout): (OwnedFd, OwnedFd, OwnedFd, OwnedFd) =
                if sockets {
                    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
                    let (c, d) = std::os::unix::net::UnixStream::pair().unwrap();
                    (a.into(), b.into(), c.into(), d.into())
                } else {
                    let (stdin_read, stdin_write) = std::io::pipe().unwrap();
                    let (stdout_read, stdout_write) = std::io::pipe().unwrap();
                    (
                        stdin_write.into(),
                        stdin_read.into(),
                        stdout_read.into(),
                        stdout_write.into(),
                    )
                };
            let (stdin_copy, stdout_copy) =
                (stdin.try_clone().unwrap(), stdout.try_clone().unwrap());
            assert!(!nonblocking(&stdin_copy) && !nonblocking(&stdout_copy));
            let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
                .args(["mcp", "stdio", "--mesh", &url, "--"])
                .args(upstream)
                .stdin(Stdio::from(stdin))
                .stdout(Stdio::from(stdout))
                .spawn()
                .unwrap();
            let mut to_gateway = std::fs::File::from(to_gateway);
            let mut lines = std::io::BufReader::new(std::fs::File::from(from_gateway));
            let init = json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "flags", "version": "0"}}});
            writeln!(to_gateway, "{init}").unwrap();
            let mut line = String::new();
            assert!(lines.read_line(&mut line).unwrap() > 0, "stdout ended");
            let answer: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(answer["id"], "init", "{answer}");
            // Answered: both are read and written on the reactor by now.
            let during = (nonblocking(&stdin_copy), nonblocking(&stdout_copy));
            // The end of its input ends the gateway. (Its stdout is not read
            // to its end: the copy kept here holds it open.)
            drop(to_gateway);
            let status = (0..600)
                .find_map(|_| {
                    let status = child.try_wait().unwrap();
                    if status.is_none() {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    status
                })
                .unwrap_or_else(|| {
                    let _ = child.kill();
                    panic!(
                        "sockets {sockets}: the gateway did not exit within 60 s of its input's end"
                    )
                });
            let after = (nonblocking(&stdin_copy), nonblocking(&stdout_copy));
            (during, after, status)
        })
        .await
        .unwrap();
        assert!(status.success(), "sockets {sockets}: {status}");
        assert_eq!(
            during,
            (true, true),
            "sockets {sockets}: on the reactor while it runs"
        );
        assert_eq!(
            after,
            (false, false),
            "sockets {sockets}: flags put back at exit"
        );
    }
}

/// R31: messages larger than a pipe holds (64 KiB on Linux), both ways,
/// through the gateway's non-blocking pipe stdio: a 300 KB call is read in
/// pieces, judged, forwarded whole, and the upstream's 300 KB answer is
/// written out in pieces, intact, followed by the next answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_stdio_relays_messages_larger_than_a_pipe_both_ways() {
    let (mesh, _guard) = mesh_with_policy("mcp-large").await;
    let scratch = Scratch::new("large");
    let upstream = scratch.upstream(&["stdio"]);
    let url = mesh.url.clone();
    let path = format!("/big/{}", "x".repeat(300_000));
    let sent = path.clone();
    let (big, small, status) = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &[], upstream);
        gateway.send(&RawGateway::call(json!(1), "read_file", json!({"path": sent})).to_string());
        gateway.send(&RawGateway::call(json!(2), "read_file", json!({"path": "/a"})).to_string());
        let mut answers = vec![gateway.recv(), gateway.recv()];
        answers.sort_by_key(|a| a["id"].as_i64());
        let small = answers.pop().unwrap();
        let big = answers.pop().unwrap();
        let (rest, status) = gateway.end();
        assert_eq!(rest, "");
        (big, small, status)
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
    assert_eq!(big["id"], 1);
    assert_eq!(
        big["result"]["content"][0]["text"],
        format!("contents of {path}"),
        "the large answer arrives whole"
    );
    assert_eq!(small["result"]["content"][0]["text"], "contents of /a");
    let executed = scratch.executed();
    assert_eq!(executed.len(), 2, "both calls ran");
    assert!(
        executed
            .iter()
            .any(|e| e["arguments"]["path"].as_str() == Some(path.as_str())),
        "the large call was forwarded whole"
    );
}

/// Single `tools/call` requests sent together (a client running a round's
/// calls as concurrent requests) are one guard batch, and each is answered
/// under its own id with its own decision (R2, R31); with a zero window each
/// is its own batch. A call that makes the group invalid (R20) is judged
/// again alone, so it does not fail the call it arrived with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_concurrent_single_calls_are_one_guard_batch() {
    let (mesh, guard) = mesh_with_policy("mcp-group").await;
    let scratch = Scratch::new("group");
    let url = mesh.url.clone();
    let upstream = scratch.upstream(&["stdio"]);
    let answers = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &["--batch-window-ms", "300"], upstream);
        // Two requests in one write: both arrive within the window.
        let two = format!(
            "{}\n{}",
            RawGateway::call(json!(1), "delete_file", json!({"path": "/x"})),
            RawGateway::call(json!(2), "read_file", json!({"path": "/etc/passwd"})),
        );
        gateway.send(&two);
        let mut answers = std::collections::HashMap::new();
        for _ in 0..2 {
            let answer = gateway.recv();
            answers.insert(answer["id"].to_string(), answer);
        }
        // A call with duplicate argument members (refused by the gateway
        // itself, R31: never judged nor forwarded) with a good one: the good
        // one still runs.
        let bad_and_good = format!(
            "{}\n{}",
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1,"amount":1000,"to":"a"}}}"#,
            RawGateway::call(json!(4), "pay", json!({"amount": 3, "to": "c"})),
        );
        gateway.send(&bad_and_good);
        for _ in 0..2 {
            let answer = gateway.recv();
            answers.insert(answer["id"].to_string(), answer);
        }
        answers
    })
    .await
    .unwrap();
    // Each answer under its own id, with its own decision.
    assert_eq!(answers["1"]["result"]["isError"], true, "{answers:?}");
    assert_eq!(
        answers["1"]["result"]["content"][0]["text"],
        "deleting is not allowed; use trash"
    );
    assert_eq!(
        answers["2"]["result"]["content"][0]["text"],
        "contents of /redacted"
    );
    assert_eq!(answers["3"]["error"]["code"], -32600, "{answers:?}");
    assert_eq!(
        answers["4"]["result"]["content"][0]["text"],
        "paid 3.0 to c"
    );
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 2, "{batches:?}");
    assert_eq!(batches[0].calls.len(), 2, "one guard batch for both calls");
    assert_eq!(batches[1].calls.len(), 1, "the good call, judged alone");
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
            json!({"tool": "pay", "arguments": {"amount": 3.0, "to": "c"}}),
        ]
    );

    // A zero window: one batch per call.
    let url = mesh.url.clone();
    let upstream = scratch.upstream(&["stdio"]);
    tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &["--batch-window-ms", "0"], upstream);
        let two = format!(
            "{}\n{}",
            RawGateway::call(json!(5), "read_file", json!({"path": "/a"})),
            RawGateway::call(json!(6), "read_file", json!({"path": "/b"})),
        );
        gateway.send(&two);
        gateway.recv();
        gateway.recv();
    })
    .await
    .unwrap();
    assert_eq!(guard.guard.batches().len(), 4);
}

/// With no `--batch-window-ms`, `guardmesh mcp stdio` makes the single
/// calls it read together (sent in one write) one guard batch, and judges a
/// call sent alone with nothing after it: no call waits for calls that were
/// not sent (R31). More calls in one write than the gateway judges at once
/// are all answered, in batches of at most 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_stdio_groups_the_calls_read_together_and_waits_for_none() {
    let (mesh, guard) = mesh_with_policy("mcp-read-group").await;
    let scratch = Scratch::new("read-group");
    let url = mesh.url.clone();
    let upstream = scratch.upstream(&["stdio"]);
    let read = |i: u32| RawGateway::call(json!(i), "read_file", json!({"path": format!("/f{i}")}));
    let answered = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::task::spawn_blocking(move || {
            let mut gateway = RawGateway::start(&url, &[], upstream);
            // One write each, so that the gateway reads each group whole.
            let mut write = |lines: Vec<Value>| {
                let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
                let stdin = gateway.stdin.as_mut().expect("stdin");
                stdin.write_all(text.as_bytes()).expect("write");
                stdin.flush().expect("flush");
            };
            write(vec![read(1), read(2)]);
            let mut ids = vec![gateway.recv()["id"].clone(), gateway.recv()["id"].clone()];
            // Alone, with nothing sent after it.
            let stdin = gateway.stdin.as_mut().expect("stdin");
            stdin
                .write_all(format!("{}\n", read(3)).as_bytes())
                .expect("write");
            ids.push(gateway.recv()["id"].clone());
            let many: String = (100..200).map(|i| format!("{}\n", read(i))).collect();
            let stdin = gateway.stdin.as_mut().expect("stdin");
            stdin.write_all(many.as_bytes()).expect("write");
            for _ in 0..100 {
                ids.push(gateway.recv()["id"].clone());
            }
            ids
        }),
    )
    .await
    .expect("every call answered within 120 s")
    .expect("the client");
    let mut ids: Vec<u64> = answered
        .iter()
        .map(|id| id.as_u64().expect("a number id"))
        .collect();
    ids.sort_unstable();
    let expected: Vec<u64> = [1, 2, 3].into_iter().chain(100..200).collect();
    assert_eq!(ids, expected, "each call answered once");
    let batches = guard.guard.batches();
    assert_eq!(
        batches[0].calls.len(),
        2,
        "the two calls sent together: {batches:?}"
    );
    assert_eq!(batches[1].calls.len(), 1, "the call sent alone");
    assert_eq!(
        batches[2..].iter().map(|b| b.calls.len()).sum::<usize>(),
        100
    );
    assert!(
        batches[2..].iter().all(|b| b.calls.len() <= 64),
        "{batches:?}"
    );
    // Read in large chunks, so most of the 100 share batches (reading 64
    // bytes at a time made them 51 batches).
    assert!(batches.len() - 2 <= 20, "{} batches", batches.len() - 2);

    // With a window, calls written apart within it still share a batch:
    // reading all that was sent does not close the group.
    let before = guard.guard.batches().len();
    let url = mesh.url.clone();
    let upstream = scratch.upstream(&["stdio"]);
    tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &["--batch-window-ms", "400"], upstream);
        gateway.send(&read(4).to_string());
        std::thread::sleep(Duration::from_millis(50));
        gateway.send(&read(5).to_string());
        gateway.recv();
        gateway.recv();
    })
    .await
    .unwrap();
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), before + 1, "{batches:?}");
    assert_eq!(batches[before].calls.len(), 2);
}

/// The upstream's stderr goes to the gateway's stderr line by line, never
/// onto stdout: an upstream that writes much to stderr (more than a pipe
/// holds, with lines that look like JSON-RPC responses) leaves the client's
/// MCP stream valid, every line on stdout a JSON-RPC message for the client
/// (R31).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_upstream_stderr_is_relayed_to_stderr_not_the_mcp_stream() {
    let (mesh, _guard) = mesh_with_policy("mcp-stderr").await;
    let scratch = Scratch::new("stderr");
    let upstream = scratch.upstream(&["noisy"]);
    let stderr_path = scratch.dir.join("gateway.stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let url = mesh.url.clone();
    let status = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start_with_stderr(&url, &[], upstream, stderr.into());
        gateway.send(&json!({"jsonrpc": "2.0", "id": "l", "method": "tools/list"}).to_string());
        let listed = gateway.recv();
        assert_eq!(listed["id"], "l", "{listed}");
        assert_eq!(listed["result"]["tools"].as_array().unwrap().len(), 4);
        gateway
            .send(&RawGateway::call(json!(1), "read_file", json!({"path": "/etc/x"})).to_string());
        let answer = gateway.recv();
        assert_eq!(answer["id"], 1, "{answer}");
        assert_eq!(
            answer["result"]["content"][0]["text"],
            "contents of /redacted"
        );
        gateway.send(&RawGateway::call(json!(2), "delete_file", json!({"path": "/"})).to_string());
        let answer = gateway.recv();
        assert_eq!(answer["id"], 2, "{answer}");
        assert_eq!(answer["result"]["isError"], true);
        gateway
            .send(&RawGateway::call(json!(3), "pay", json!({"amount": 2, "to": "b"})).to_string());
        let answer = gateway.recv();
        assert_eq!(answer["id"], 3, "{answer}");
        assert_eq!(answer["result"]["content"][0]["text"], "paid 2.0 to b");
        // The client ends the session: nothing else was ever on stdout.
        let (rest, status) = gateway.end();
        assert_eq!(rest, "", "only answers to the client's requests on stdout");
        status
    })
    .await
    .unwrap();
    assert!(status.success(), "{status}");
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(stderr.contains("upstream: starting, line 399 "), "{stderr}");
    for text in ["started", "ran read_file", "ran pay"] {
        assert!(
            stderr.contains(&format!("upstream: {text}\n")),
            "{text}: {stderr}"
        );
        let noise = format!(r#"{{"jsonrpc": "2.0", "id": 999, "result": {{"noise": "{text}"}}}}"#);
        assert!(stderr.lines().any(|l| l == noise), "{noise}: {stderr}");
    }
    assert_eq!(scratch.executed().len(), 2);
}

// ---------------------------------------------------------------------------
// guardmesh hook pre-tool-use
// ---------------------------------------------------------------------------

/// Runs the hook with `input` on stdin: (exit code, stdout, stderr).
pub(crate) fn hook(mesh: &str, extra: &[&str], input: &str) -> (i32, String, String) {
    let output = run_with_input(
        Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["hook", "pre-tool-use", "--mesh", mesh])
            .args(extra),
        input.as_bytes(),
    );
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A recorded-style PreToolUse payload, with fields the hook does not know.
pub(crate) fn payload(tool: &str, input: Value) -> String {
    json!({
        "session_id": "agent-session-1",
        "transcript_path": "/home/u/.agent/transcripts/t.jsonl",
        "cwd": "/home/u/p",
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": tool,
        "tool_input": input,
        "tool_use_id": "toolu_01ABC",
        "some_future_field": {"nested": [1, 2]},
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_hook_deny_allow_updated_input_and_exit_codes() {
    let (mesh, guard) = mesh_with_policy("mcp-hook").await;
    let url = mesh.url.clone();
    let closed = closed_port().await;
    tokio::task::spawn_blocking(move || {
        // Steer: deny with the content as the reason.
        let (code, out, _) = hook(&url, &[], &payload("delete_file", json!({"path": "/x"})));
        assert_eq!(code, 0);
        let out: Value = serde_json::from_str(&out).unwrap();
        let specific = &out["hookSpecificOutput"];
        assert_eq!(specific["hookEventName"], "PreToolUse");
        assert_eq!(specific["permissionDecision"], "deny");
        assert_eq!(
            specific["permissionDecisionReason"],
            "deleting is not allowed; use trash"
        );
        // Cancel: deny too.
        let (code, out, _) = hook(
            &url,
            &[],
            &payload("pay", json!({"amount": 500, "to": "m"})),
        );
        assert_eq!(code, 0);
        let out: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["hookSpecificOutput"]["permissionDecision"], "deny");
        assert_eq!(
            out["hookSpecificOutput"]["permissionDecisionReason"],
            "payments over 100 need approval"
        );
        // Rewrite: ask with updatedInput (R31b: the host still asks).
        let (code, out, _) = hook(
            &url,
            &[],
            &payload("read_file", json!({"path": "/etc/shadow"})),
        );
        assert_eq!(code, 0);
        let out: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["hookSpecificOutput"]["permissionDecision"], "ask");
        assert_eq!(
            out["hookSpecificOutput"]["updatedInput"],
            json!({"path": "/redacted"})
        );
        // Proceed unchanged: no output, the host's own flow applies.
        let (code, out, _) = hook(&url, &[], &payload("pay", json!({"amount": 5, "to": "b"})));
        assert_eq!((code, out.as_str()), (0, ""));
        // Mesh unreachable: fail closed (a deny saying so)...
        let (code, out, _) = hook(
            &closed,
            &[],
            &payload("pay", json!({"amount": 5, "to": "b"})),
        );
        assert_eq!(code, 0);
        let out: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["hookSpecificOutput"]["permissionDecision"], "deny");
        assert!(
            out["hookSpecificOutput"]["permissionDecisionReason"]
                .as_str()
                .unwrap()
                .contains("cannot be reached")
        );
        // ... or, with --fail-open, let it through with a warning.
        let (code, out, err) = hook(
            &closed,
            &["--fail-open"],
            &payload("pay", json!({"amount": 5, "to": "b"})),
        );
        assert_eq!((code, out.as_str()), (0, ""));
        assert!(err.contains("--fail-open"), "{err}");
        // Unreadable input: exit 2 (the host blocks the call), reason on stderr.
        for bad in [
            "not json",
            r#"{"tool_name":"pay"}"#,
            r#"{"tool_name":"pay","tool_input":[1]}"#,
        ] {
            let (code, out, err) = hook(&url, &[], bad);
            assert_eq!((code, out.as_str()), (2, ""), "{bad}");
            assert!(err.contains("cannot read"), "{err}");
        }
    })
    .await
    .unwrap();
    // The session and call ids of the payload are the batch's (R31).
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 4);
    assert_eq!(
        batches[0].context.as_ref().unwrap().session_id,
        "agent-session-1"
    );
    assert_eq!(batches[0].calls[0].call_id, "toolu_01ABC");
}

// ---------------------------------------------------------------------------
// guardmesh mcp http
// ---------------------------------------------------------------------------

/// The Python SDK upstream on Streamable HTTP and `guardmesh mcp http` in
/// front of it; returns the gateway's endpoint URL.
pub(crate) async fn http_gateway(
    mesh: &str,
    scratch: &Scratch,
) -> (String, KillOnDrop, KillOnDrop) {
    http_gateway_with(mesh, scratch, "127.0.0.1", &[]).await
}

/// [`http_gateway`] listening on `host` with `extra` arguments (`--tls-cert
/// ...`: the URL is then https://127.0.0.1).
pub(crate) async fn http_gateway_with(
    mesh: &str,
    scratch: &Scratch,
    host: &str,
    extra: &[&std::ffi::OsStr],
) -> (String, KillOnDrop, KillOnDrop) {
    let (upstream_port, upstream) = scratch.http_upstream().await;
    let (url, gateway) = gateway_before(mesh, host, upstream_port, extra).await;
    (url, upstream, gateway)
}

/// `guardmesh mcp http --mesh MESH` on a free port of `host`, in front of
/// the upstream on `upstream_port`, with `extra` arguments (`--tls-cert
/// ...`: the URL is then https://127.0.0.1), once it listens: (its endpoint
/// URL, the process).
pub(crate) async fn gateway_before(
    mesh: &str,
    host: &str,
    upstream_port: u16,
    extra: &[&std::ffi::OsStr],
) -> (String, KillOnDrop) {
    let port = free_port();
    let mut command = gateway_command(["--mesh", mesh], &format!("{host}:{port}"), upstream_port);
    let gateway = listening(command.args(extra), port, "guardmesh mcp http").await;
    let scheme = if extra.iter().any(|a| *a == "--tls-cert") {
        "https"
    } else {
        "http"
    };
    (format!("{scheme}://127.0.0.1:{port}/mcp"), gateway)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_http_decisions_and_session_through_the_official_sdk() {
    let (mesh, guard) = mesh_with_policy("mcp-http").await;
    let scratch = Scratch::new("http");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "mallory"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]});
    let target = vec!["http".to_owned(), url.clone()];
    let lines = run_client_off_thread(scenario, target).await;
    let results = calls(&lines);
    assert_eq!(results[0]["text"][0], "contents of /redacted", "{lines:?}");
    assert_eq!(results[1]["isError"], true);
    assert_eq!(results[1]["text"][0], "deleting is not allowed; use trash");
    assert_eq!(results[2]["isError"], false);
    assert_eq!(results[2]["text"][0], "payments over 100 need approval");
    assert_eq!(results[3]["text"][0], "paid 5.0 to bob");
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}}),
        ]
    );
    // The Mcp-Session-Id the upstream gave the client is every batch's
    // session (R31), not one the gateway made up.
    let sessions: Vec<String> = guard
        .guard
        .batches()
        .iter()
        .map(|b| b.context.as_ref().unwrap().session_id.clone())
        .collect();
    assert_eq!(sessions.len(), 4);
    assert!(sessions.iter().all(|s| *s == sessions[0]), "{sessions:?}");
    assert!(
        !sessions[0].is_empty() && !sessions[0].starts_with("mcp-http-"),
        "{sessions:?}"
    );

    // The client's default mode (the stateless revision first) works too.
    let scenario = json!({"mode": "auto", "steps": [
        {"op": "call", "name": "delete_file", "arguments": {"path": "/b"}},
    ]});
    let target = vec!["http".to_owned(), url];
    let lines = run_client_off_thread(scenario, target).await;
    assert_eq!(calls(&lines)[0]["isError"], true, "{lines:?}");
    assert_eq!(scratch.executed().len(), 2, "the steered call did not run");
}

/// One HTTP/1.1 exchange on a fresh connection: (status, headers, body).
pub(crate) async fn post(url: &str, session: Option<&str>, body: &str) -> (u16, String, String) {
    let session: Vec<_> = session.map(|s| ("Mcp-Session-Id", s)).into_iter().collect();
    mcp_post(url, "2025-11-25", &session, body).await
}

/// Initializes a Streamable HTTP session (2025-11-25); returns its
/// `Mcp-Session-Id`.
pub(crate) async fn http_session(url: &str) -> String {
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"}}});
    let (status, head, _) = post(url, None, &init.to_string()).await;
    assert_eq!(status, 200, "{head}");
    let session = header_value(&head, "mcp-session-id").expect("Mcp-Session-Id");
    let (status, _, _) = post(
        url,
        Some(&session),
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
    )
    .await;
    assert_eq!(status, 202);
    session
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_http_json_rpc_batch_is_one_guard_batch() {
    let (mesh, guard) = mesh_with_policy("mcp-http-batch").await;
    let scratch = Scratch::new("http-batch");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let session = http_session(&url).await;
    let batch = json!([
        RawGateway::call(json!(1), "delete_file", json!({"path": "/x"})),
        RawGateway::call(json!(2), "read_file", json!({"path": "/etc/passwd"})),
        RawGateway::call(json!(3), "pay", json!({"amount": 1000, "to": "m"})),
    ]);
    let (status, head, body) = post(&url, Some(&session), &batch.to_string()).await;
    assert_eq!(status, 200, "{head}\n{body}");
    let answers = by_id(&serde_json::from_str(&body).unwrap());
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert_eq!(answers["1"]["result"]["isError"], true);
    assert_eq!(
        answers["2"]["result"]["content"][0]["text"],
        "contents of /redacted"
    );
    assert_eq!(answers["3"]["result"]["isError"], false);
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 1, "one guard batch for the JSON-RPC batch");
    assert_eq!(batches[0].calls.len(), 3);
    assert_eq!(batches[0].context.as_ref().unwrap().session_id, session);
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "read_file", "arguments": {"path": "/redacted"}})]
    );
    // Malformed JSON: a JSON-RPC parse error, nothing forwarded.
    let (status, _, body) = post(&url, Some(&session), r#"{"jsonrpc":"2.0","id":9,"#).await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        -32700
    );
    assert_eq!(scratch.executed().len(), 1);
}

#[test]
fn r31_http_refuses_a_non_loopback_listen_address() {
    let output = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args([
            "mcp",
            "http",
            "--listen",
            "0.0.0.0:0",
            "--upstream",
            "http://127.0.0.1:1/mcp",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("not a loopback address"), "{stderr}");
}

/// `mcp http --tls-cert --tls-key`: HTTPS, and then a non-loopback listen
/// address is accepted. The official SDK's client (httpx, trusting only the
/// test CA) runs a session through it with the same decisions as over
/// plain HTTP (R31); a client speaking plain HTTP to the port gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_http_serves_tls_and_then_any_listen_address() {
    let (mesh, guard) = mesh_with_policy("mcp-https").await;
    let scratch = Scratch::new("https");
    let pki = TestPki::new();
    let ca = pki.ca_file();
    let (cert, key) = pki.issue_files("gateway");
    let (url, _upstream, _gateway) = http_gateway_with(
        &mesh.url,
        &scratch,
        "0.0.0.0",
        &[
            "--tls-cert".as_ref(),
            cert.as_os_str(),
            "--tls-key".as_ref(),
            key.as_os_str(),
        ],
    )
    .await;
    assert!(url.starts_with("https://"), "{url}");
    let scenario = json!({"mode": "legacy", "ca": ca, "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
    ]});
    let target = vec!["http".to_owned(), url.clone()];
    let lines = run_client_off_thread(scenario, target).await;
    let results = calls(&lines);
    assert_eq!(results.len(), 2, "{lines:?}");
    assert_eq!(results[0]["text"][0], "contents of /redacted");
    assert_eq!(results[1]["isError"], true);
    assert_eq!(results[1]["text"][0], "deleting is not allowed; use trash");
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "read_file", "arguments": {"path": "/redacted"}})]
    );
    assert_eq!(guard.guard.batches().len(), 2);

    // Plain HTTP on the TLS port: no HTTP answer, nothing judged.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = url
        .trim_start_matches("https://")
        .split('/')
        .next()
        .unwrap();
    let mut stream = tokio::net::TcpStream::connect(authority).await.unwrap();
    let body = RawGateway::call(json!(1), "pay", json!({"amount": 1, "to": "b"})).to_string();
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    assert!(
        !String::from_utf8_lossy(&answer).contains("HTTP/1.1"),
        "{answer:?}"
    );
    assert_eq!(guard.guard.batches().len(), 2);
    assert_eq!(scratch.executed().len(), 1);
}

#[test]
fn r31_http_tls_needs_readable_pem_files() {
    let pki = TestPki::new();
    let (cert, _) = pki.issue_files("gateway");
    let not_a_key = pki.file("empty.pem", "");
    let output = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["mcp", "http", "--listen", "0.0.0.0:0", "--upstream"])
        .arg("http://127.0.0.1:1/mcp")
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&not_a_key)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--tls-key"), "{stderr}");
}
