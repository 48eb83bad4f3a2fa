//! Every answer of the MCP gateway is one the official SDK clients accept,
//! for every tool, including tools that declare an output schema (R31).
//!
//! A cancel is a tool result with `isError: false` and the guard's text, and
//! has no structured content: a client that knows the tool's output schema
//! refuses it (TypeScript SDK: `-32600 ... has an output schema but did not
//! return structured content`; Python SDK: `RuntimeError`). The gateway
//! lists tools without their output schemas (gateway/src/schemas.rs), and
//! these tests run the official TypeScript and Python SDK clients, through
//! `guardmesh mcp stdio` and `guardmesh mcp http`, against the reference
//! filesystem server (`@modelcontextprotocol/server-filesystem`, whose every
//! tool declares one) and a Python SDK server's tool with an output schema.

use crate::harness::*;
use crate::mcp::{
    Scratch, calls, http_gateway, mcp_python, mesh_with_policy, run_client, run_sdk_client,
    sdk_dir, via_gateway,
};
use serde_json::{Value, json};

/// Runs the TypeScript SDK client (tests/mcp-sdk/ts/client.mjs) with
/// `scenario` against `target`; returns its output lines.
pub(crate) fn run_ts_client(scenario: &Value, target: &[String]) -> Vec<Value> {
    run_sdk_client(&node(), &sdk_dir().join("ts/client.mjs"), scenario, target)
}

/// The reference filesystem server over stdio, serving `dir`.
fn filesystem_server(dir: &std::path::Path) -> Vec<String> {
    vec![
        node().display().to_string(),
        sdk_dir()
            .join("ts/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js")
            .display()
            .to_string(),
        dir.display().to_string(),
    ]
}

/// Both SDK clients run `scenario` against `target`: (client name, lines).
fn both_clients(scenario: &Value, target: &[String]) -> Vec<(&'static str, Vec<Value>)> {
    vec![
        ("python", run_client(scenario.clone(), target)),
        ("typescript", run_ts_client(scenario, target)),
    ]
}

/// Asserts that a call was answered with a tool result (no error the
/// client raised), with `is_error` and text containing `text`.
fn assert_result(client: &str, result: &Value, is_error: bool, text: &str) {
    assert!(
        result.get("error").is_none(),
        "{client}: the SDK client refused the answer: {result}"
    );
    assert_eq!(result["isError"], is_error, "{client}: {result}");
    assert!(
        result["text"][0].as_str().unwrap_or("").contains(text),
        "{client}: {result}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_both_sdk_clients_accept_every_answer_for_the_reference_filesystem_server() {
    mcp_python();
    let (mesh, _guard) = mesh_with_policy("mcp-answers-fs").await;
    let scratch = Scratch::new("answers-fs");
    let served = scratch.dir.join("served");
    std::fs::create_dir_all(&served).unwrap();
    let served = served.canonicalize().unwrap();
    let file = |name: &str| served.join(name).display().to_string();
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "write_file", "arguments": {"path": file("forbidden.txt"), "content": "x"}},
        {"op": "call", "name": "create_directory", "arguments": {"path": file("sub")}},
        {"op": "call", "name": "write_file", "arguments": {"path": file("ok.txt"), "content": "hello"}},
        {"op": "call", "name": "read_text_file", "arguments": {"path": file("ok.txt")}},
    ]});
    let target = via_gateway(&mesh.url, &[], filesystem_server(&served));
    let runs = tokio::task::spawn_blocking(move || both_clients(&scenario, &target))
        .await
        .unwrap();
    for (client, lines) in &runs {
        let listed = lines.iter().find(|l| l["op"] == "list_tools").unwrap();
        let tools = listed["tools"].as_array().unwrap();
        assert!(tools.len() >= 10, "{client}: {listed}");
        assert!(
            tools.iter().all(|t| t.get("outputSchema").is_none()),
            "{client}: the gateway lists no output schema: {listed}"
        );
        let results = calls(lines);
        assert_eq!(results.len(), 4, "{client}: {lines:?}");
        // Cancel: not an error, "not allowed, move on" (R31).
        assert_result(client, results[0], false, "writing there is not allowed");
        // Steer: an error result, "fix it and retry".
        assert_result(
            client,
            results[1],
            true,
            "directories are made by the operator",
        );
        // Proceed: the server's own result, structured content included.
        assert_result(client, results[2], false, "Successfully wrote");
        assert!(
            results[2]["structured"].is_object(),
            "{client}: {}",
            results[2]
        );
        assert_result(client, results[3], false, "hello");
    }
    assert!(
        !served.join("forbidden.txt").exists(),
        "a cancelled call ran"
    );
    assert!(!served.join("sub").exists(), "a steered call ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_both_sdk_clients_accept_every_answer_for_an_output_schema_tool_over_stdio_and_http() {
    mcp_python();
    let (mesh, _guard) = mesh_with_policy("mcp-answers-schema").await;
    let scratch = Scratch::new("answers-schema");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "write_note", "arguments": {"path": "/etc/motd", "text": "x"}},
        {"op": "call", "name": "write_note", "arguments": {"path": "/tmp/a", "text": ""}},
        {"op": "call", "name": "write_note", "arguments": {"path": "/tmp/b", "text": "hello"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "mallory"}},
    ]});
    let targets = vec![
        (
            "stdio",
            via_gateway(&mesh.url, &[], scratch.upstream(&["stdio"])),
        ),
        ("http", vec!["http".to_owned(), url]),
    ];
    for (transport, target) in targets {
        let scenario = scenario.clone();
        let runs = tokio::task::spawn_blocking(move || both_clients(&scenario, &target))
            .await
            .unwrap();
        for (client, lines) in &runs {
            let client = &format!("{client} over {transport}");
            let results = calls(lines);
            assert_eq!(results.len(), 4, "{client}: {lines:?}");
            assert_result(
                client,
                results[0],
                false,
                "notes under /etc are not allowed",
            );
            assert_result(client, results[1], true, "an empty note");
            assert_result(client, results[2], false, "");
            assert_eq!(
                results[2]["structured"],
                json!({"path": "/tmp/b", "chars": 5}),
                "{client}: {}",
                results[2]
            );
            // A tool without an output schema: unchanged.
            assert_result(client, results[3], false, "payments over 100 need approval");
        }
    }
    // Only the proceeded notes ran, once per client and transport.
    let ran: Vec<Value> = scratch
        .executed()
        .into_iter()
        .filter(|e| e["tool"] == "write_note")
        .collect();
    assert_eq!(ran.len(), 4, "{ran:?}");
    assert!(
        ran.iter().all(|e| e["arguments"]["path"] == "/tmp/b"),
        "{ran:?}"
    );
}

/// The gateway judges on one `Evaluate` stream; when the mesh restarts, the
/// next call is judged on a new stream by the new mesh, not answered as
/// unreachable, and a call while it is down is never forwarded (R31, R13).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_the_gateway_judges_on_a_new_stream_after_the_mesh_restarts() {
    use crate::mcp::RawGateway;
    let port = free_port();
    let guard = call_guard(std::time::Duration::ZERO, crate::mcp::policy).await;
    let start = move |name: &'static str, endpoint: String| async move {
        let mesh = MeshProcess::start_at(name, "", None, port).await;
        mesh.register(guardmesh_client::Registration::validate(
            "policy", &endpoint,
        ))
        .await;
        mesh
    };
    let mut mesh = start("mcp-restart-1", guard.url.clone()).await;
    let scratch = Scratch::new("restart");
    let (url, upstream) = (mesh.url.clone(), scratch.upstream(&["stdio"]));
    let handle = tokio::runtime::Handle::current();
    let endpoint = guard.url.clone();
    let second = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &[], upstream);
        let mut ask = |id: u32, amount: u32| {
            let call = RawGateway::call(json!(id), "pay", json!({"amount": amount, "to": "bob"}));
            gateway.send(&call.to_string());
            gateway.recv()
        };
        let first = ask(1, 5);
        assert_eq!(first["result"]["isError"], false, "{first}");
        // The mesh goes away: a call is answered as unreachable, not run.
        let _ = mesh.child.kill();
        let _ = mesh.child.wait();
        // The stream's end reaches the gateway as a transport failure:
        // the mesh is unreachable (-32071), never a refusal (-32070) of a
        // batch it did not see; nothing forwarded.
        let down = ask(2, 6);
        assert_eq!(down["error"]["code"], -32071, "{down}");
        // A new mesh where the old one was.
        let second = handle.block_on(start("mcp-restart-2", endpoint));
        let cancelled = ask(3, 500);
        assert_eq!(
            cancelled["result"]["content"][0]["text"], "payments over 100 need approval",
            "{cancelled}"
        );
        let fine = ask(4, 7);
        assert_eq!(fine["result"]["isError"], false, "{fine}");
        second
    })
    .await
    .unwrap();
    let ran: Vec<Value> = scratch.executed();
    assert_eq!(
        ran,
        vec![
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}}),
            json!({"tool": "pay", "arguments": {"amount": 7.0, "to": "bob"}}),
        ]
    );
    drop(second);
}
