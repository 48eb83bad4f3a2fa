//! The MCP 2026-07-28 revision through `guardmesh mcp http` (R31): its
//! stateless requests carry routing headers (`Mcp-Method`, `Mcp-Name`) that
//! a router or the upstream may act on without reading the body. The
//! gateway refuses a request whose headers disagree with the body it
//! judged, and forwards a rewritten call with headers of the final call.

use crate::harness::mcp_post;
use crate::mcp::{Scratch, calls, http_gateway, mesh_with_policy, run_client_off_thread};
use serde_json::{Value, json};

/// A stateless (2026-07-28) `tools/call` body for `tool`.
fn stateless_call(id: u32, tool: &str, arguments: Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
    "name": tool, "arguments": arguments,
    "_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"}
    }}})
    .to_string()
}

/// Extra request headers: (name, value).
type Headers<'a> = Vec<(&'a str, &'a str)>;

/// One POST with `headers`: (status, body).
async fn post(url: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let (status, _, body) = mcp_post(url, "2026-07-28", headers, body).await;
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_routing_headers_that_disagree_with_the_judged_body_are_refused() {
    let (mesh, guard) = mesh_with_policy("mcp-revision").await;
    let scratch = Scratch::new("revision");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let pay = stateless_call(1, "pay", json!({"amount": 5, "to": "bob"}));
    let cases: [(&str, Headers, String); 5] = [
        (
            "Mcp-Name names another tool",
            vec![("Mcp-Method", "tools/call"), ("Mcp-Name", "read_file")],
            stateless_call(1, "delete_file", json!({"path": "/home/a"})),
        ),
        (
            "Mcp-Method names another method",
            vec![("Mcp-Method", "tools/list")],
            pay.clone(),
        ),
        (
            "Mcp-Name twice",
            vec![
                ("Mcp-Method", "tools/call"),
                ("Mcp-Name", "pay"),
                ("Mcp-Name", "read_file"),
            ],
            pay.clone(),
        ),
        (
            "Mcp-Name in base64 of another tool",
            // "read_file"
            vec![
                ("Mcp-Method", "tools/call"),
                ("Mcp-Name", "=?base64?cmVhZF9maWxl?="),
            ],
            pay.clone(),
        ),
        (
            "routing headers on a batch",
            vec![("Mcp-Method", "tools/call"), ("Mcp-Name", "pay")],
            format!("[{pay}]"),
        ),
    ];
    for (what, headers, body) in &cases {
        let (status, answer) = post(&url, headers, body).await;
        assert_eq!(status, 400, "{what}: {answer}");
        let answer: Value =
            serde_json::from_str(&answer).unwrap_or_else(|_| panic!("{what}: {answer}"));
        assert_eq!(answer["error"]["code"], -32020, "{what}: {answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("guardmesh: "),
            "{what}: the gateway refuses, not the upstream: {answer}"
        );
    }
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
    assert!(
        guard.guard.batches().is_empty(),
        "a refused request is not judged"
    );

    // Headers that agree: judged and run.
    let (status, answer) = post(
        &url,
        &[("Mcp-Method", "tools/call"), ("Mcp-Name", "pay")],
        &pay,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("paid 5"), "{answer}");
    assert_eq!(scratch.executed().len(), 1);
}

/// The official Python SDK client speaks the 2026-07-28 revision first
/// (`mode: auto`): its calls, a rewritten one included, pass the upstream
/// SDK server's own header checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_the_stateless_revision_through_the_official_sdks_with_a_rewrite() {
    let (mesh, _guard) = mesh_with_policy("mcp-revision-sdk").await;
    let scratch = Scratch::new("revision-sdk");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let scenario = json!({"mode": "auto", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "mallory"}},
        {"op": "call", "name": "write_note", "arguments": {"path": "/tmp/n", "text": "hi"}},
    ]});
    let target = vec!["http".to_owned(), url];
    let lines = run_client_off_thread(scenario, target).await;
    assert_eq!(lines[0]["protocol"], "2026-07-28", "{lines:?}");
    let results = calls(&lines);
    assert_eq!(results[0]["text"][0], "contents of /redacted", "{lines:?}");
    assert_eq!(results[1]["isError"], false);
    assert_eq!(results[1]["text"][0], "payments over 100 need approval");
    assert_eq!(
        results[2]["structured"],
        json!({"path": "/tmp/n", "chars": 2})
    );
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
            json!({"tool": "write_note", "arguments": {"path": "/tmp/n", "text": "hi"}}),
        ]
    );
}
