//! The MCP 2026-07-28 revision through `guardmesh mcp http` with the
//! official TypeScript SDK v2 (`@modelcontextprotocol/client` and
//! `@modelcontextprotocol/server`, pinned in tests/mcp-sdk/ts2; the 1.x SDK
//! in tests/mcp-sdk/ts speaks the 2025-11-25 revision in tests/mcp_answers.rs)
//! (R31). The client is pinned to the stateless revision: no `initialize`,
//! no `Mcp-Session-Id`, routing headers on every request. The upstream is
//! the SDK's own server, which checks `Mcp-Name` and the `Mcp-Param-*`
//! headers its tools declare (`x-mcp-header`) against the body, and logs
//! each call it ran with the routing headers it came with.

use crate::harness::*;
use crate::mcp::{
    Scratch, calls, gateway_before, listening, mesh_with_policy, run_sdk_client, sdk_dir,
};
use serde_json::{Value, json};
use std::process::Command;

/// The SDK v2 upstream (tests/mcp-sdk/ts2/server.mjs) and `guardmesh mcp
/// http` in front of it: (gateway URL, upstream, gateway).
pub(crate) async fn gateway_before_ts2_upstream(
    mesh: &str,
    scratch: &Scratch,
) -> (String, KillOnDrop, KillOnDrop) {
    gateway_before_ts2_upstream_with(mesh, scratch, &[]).await
}

/// [`gateway_before_ts2_upstream`], the gateway given `extra` arguments.
pub(crate) async fn gateway_before_ts2_upstream_with(
    mesh: &str,
    scratch: &Scratch,
    extra: &[&std::ffi::OsStr],
) -> (String, KillOnDrop, KillOnDrop) {
    let upstream_port = free_port();
    let upstream = listening(
        Command::new(node())
            .arg(sdk_dir().join("ts2/server.mjs"))
            .arg(scratch.log())
            .arg(upstream_port.to_string()),
        upstream_port,
        "the SDK v2 upstream",
    )
    .await;
    let (url, gateway) = gateway_before(mesh, "127.0.0.1", upstream_port, extra).await;
    (url, upstream, gateway)
}

/// Runs the SDK v2 client (tests/mcp-sdk/ts2/client.mjs) with `scenario`.
pub(crate) fn run_ts2_client(scenario: Value, url: String) -> Vec<Value> {
    run_sdk_client(
        &node(),
        &sdk_dir().join("ts2/client.mjs"),
        &scenario,
        &[url],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_the_official_typescript_sdk_v2_stateless_through_the_gateway() {
    let (mesh, guard) = mesh_with_policy("mcp-revision-ts2").await;
    let scratch = Scratch::new("revision-ts2");
    let (url, _upstream, _gateway) = gateway_before_ts2_upstream(&mesh.url, &scratch).await;
    let scenario = json!({"steps": [
        {"op": "list_tools"},
        // proceed
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
        // cancel
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "mallory"}},
        // rewrite: the guard sends /redacted; the client mirrored /etc/shadow
        // into Mcp-Param-Path
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        // proceed with a mirrored parameter
        {"op": "call", "name": "read_file", "arguments": {"path": "/home/a"}},
        // the client's headers disagree with its body
        {"op": "call", "name": "pay", "arguments": {"amount": 7, "to": "eve"},
         "tamper": {"Mcp-Name": "read_file"}},
    ]});
    let lines = tokio::task::spawn_blocking(move || run_ts2_client(scenario, url))
        .await
        .unwrap();
    assert_eq!(lines[0]["protocol"], "2026-07-28", "{lines:?}");

    // Stateless: no initialize and no session id on any request.
    let sent = &lines.last().unwrap()["requests"];
    let sent = sent.as_array().unwrap_or_else(|| panic!("{lines:?}"));
    assert!(!sent.is_empty());
    for request in sent {
        assert_eq!(request["sessionId"], Value::Null, "{request}");
        assert_ne!(request["body"], "initialize", "{request}");
    }

    let results = calls(&lines);
    assert_eq!(results.len(), 5, "{lines:?}");
    assert_eq!(results[0]["isError"], false, "{lines:?}");
    assert_eq!(results[0]["text"][0], "paid 5 to bob", "{lines:?}");
    assert_eq!(results[1]["isError"], false, "{lines:?}");
    assert_eq!(
        results[1]["text"][0], "payments over 100 need approval",
        "{lines:?}"
    );
    assert_eq!(
        results[2]["text"][0], "contents of /redacted",
        "the SDK upstream ran the rewritten call: {lines:?}"
    );
    assert_eq!(results[3]["text"][0], "contents of /home/a", "{lines:?}");
    assert_eq!(results[4]["error"]["code"], -32020, "{lines:?}");
    assert!(
        results[4]["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("guardmesh: "),
        "the gateway refuses, not the upstream: {lines:?}"
    );

    // The upstream saw the final calls, each with routing headers of the
    // call it ran; the cancelled and the refused call never reached it.
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "pay", "arguments": {"amount": 5, "to": "bob"},
                   "headers": {"mcp-method": "tools/call", "mcp-name": "pay"}}),
            json!({"tool": "read_file", "arguments": {"path": "/redacted"},
                   "headers": {"mcp-method": "tools/call", "mcp-name": "read_file",
                               "mcp-param-path": "/redacted"}}),
            json!({"tool": "read_file", "arguments": {"path": "/home/a"},
                   "headers": {"mcp-method": "tools/call", "mcp-name": "read_file",
                               "mcp-param-path": "/home/a"}}),
        ]
    );
    // Four calls judged; the refused one was not.
    assert_eq!(guard.guard.batches().len(), 4);
}
