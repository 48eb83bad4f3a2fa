//! Tool visibility (`guardmesh mcp ... --hide-skipped-tools`): the
//! upstream's `tools/list` answers without the tools the chain skips
//! whatever a call's arguments (a policy rule whose `when` is `true`, R27;
//! `unguarded = "cancel"` for a tool no guard applies to, R28), on stdio,
//! over HTTP, inside JSON-RPC batches and with the mesh in the gateway's
//! process; through the official Python MCP SDK client and the official
//! TypeScript SDK clients (1.x at 2025-11-25 over stdio, v2 at 2026-07-28
//! over HTTP), and a scripted upstream for the hostile listings. Hiding is advisory: a hidden tool
//! called anyway is judged (and skipped); anything the gateway cannot ask
//! the mesh about is shown.
//!
//! Needs `scripts/setup-polyglot` (the SDK in build/venv).

use crate::harness::*;
use crate::mcp::{
    RawGateway, Scratch, by_id, calls, gateway_before, http_session, mcp_python, post,
    run_client_off_thread, sdk_dir, stdio_batch, via_gateway, via_gateway_judging,
};
use guardmesh_client::Registration;
use serde_json::{Value, json};

const HIDE: &str = "--hide-skipped-tools";

/// Deleting files is never allowed: a constant cancel rule.
const NO_DELETE: &str = policy_rule!(name: "no-delete", tools: ["delete_file"], action: "cancel",
    when: r#""true""#, message: r#"'"deleting files is never allowed here"'"#);

/// A mesh whose chain is one policy guard holding [`NO_DELETE`].
async fn mesh_without_delete(name: &str) -> MeshProcess {
    let mesh = MeshProcess::start(name, "", None).await;
    mesh.register(Registration::policy("never-delete", NO_DELETE))
        .await;
    mesh
}

/// The names of the tools a client's `list_tools` step printed.
fn listed(lines: &[Value]) -> Vec<String> {
    let list = lines
        .iter()
        .find(|l| l["op"] == "list_tools")
        .unwrap_or_else(|| panic!("no listing: {lines:?}"));
    list["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The scenario: list the tools, then call the hidden one anyway.
fn list_then_delete() -> Value {
    json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]})
}

/// A constant cancel rule's tool is absent, the others present; calling it
/// anyway is still cancelled (and never runs), and the others run.
fn assert_hidden_and_still_judged(lines: &[Value], scratch: &Scratch, cancelled_with: &str) {
    let mut names = listed(lines);
    names.sort();
    assert_eq!(names, ["pay", "read_file", "write_note"], "{lines:?}");
    let results = calls(lines);
    assert_eq!(results.len(), 2, "{lines:?}");
    assert_eq!(results[0]["isError"], false, "{lines:?}");
    assert!(
        results[0]["text"][0]
            .as_str()
            .is_some_and(|t| t.contains(cancelled_with)),
        "{lines:?}"
    );
    assert_eq!(results[1]["text"][0], "paid 5.0 to bob", "{lines:?}");
    assert_eq!(
        scratch.executed(),
        vec![json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}})],
        "the hidden tool never ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r27_r31_stdio_hides_a_tool_a_constant_cancel_rule_names_and_still_judges_it() {
    let mesh = mesh_without_delete("visibility-stdio").await;
    let scratch = Scratch::new("visibility-stdio");
    let target = via_gateway(&mesh.url, &[HIDE], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(list_then_delete(), target).await;
    assert_hidden_and_still_judged(&lines, &scratch, "deleting files is never allowed here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_without_the_flag_every_tool_is_listed() {
    let mesh = mesh_without_delete("visibility-off").await;
    let scratch = Scratch::new("visibility-off");
    let scenario = json!({"mode": "legacy", "steps": [{"op": "list_tools"}]});
    let target = via_gateway(&mesh.url, &[], scratch.upstream(&["stdio"]));
    let mut names = listed(&run_client_off_thread(scenario.clone(), target).await);
    names.sort();
    assert_eq!(names, ["delete_file", "pay", "read_file", "write_note"]);
    // Over HTTP too.
    let (upstream_port, _upstream) = scratch.http_upstream().await;
    let (url, _gateway) = gateway_before(&mesh.url, "127.0.0.1", upstream_port, &[]).await;
    let mut names = listed(&run_client_off_thread(scenario, vec!["http".into(), url]).await);
    names.sort();
    assert_eq!(names, ["delete_file", "pay", "read_file", "write_note"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r27_r31_http_hides_a_tool_a_constant_cancel_rule_names_and_still_judges_it() {
    let mesh = mesh_without_delete("visibility-http").await;
    let scratch = Scratch::new("visibility-http");
    let (upstream_port, _upstream) = scratch.http_upstream().await;
    let (url, _gateway) =
        gateway_before(&mesh.url, "127.0.0.1", upstream_port, &[HIDE.as_ref()]).await;
    let lines = run_client_off_thread(list_then_delete(), vec!["http".into(), url.clone()]).await;
    assert_hidden_and_still_judged(&lines, &scratch, "deleting files is never allowed here");
    // The client's default mode (the stateless revision first) too.
    let scenario = json!({"mode": "auto", "steps": [{"op": "list_tools"}]});
    let mut names = listed(&run_client_off_thread(scenario, vec!["http".into(), url]).await);
    names.sort();
    assert_eq!(names, ["pay", "read_file", "write_note"]);
}

fn names_of(answer: &Value) -> Vec<&str> {
    answer["result"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("a listing: {answer}"))
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_tool_visibility_holds_inside_json_rpc_batches_on_stdio_and_http() {
    let mesh = mesh_without_delete("visibility-batch").await;
    let scratch = Scratch::new("visibility-batch");
    let batch = json!([
        {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
        RawGateway::call(json!(2), "delete_file", json!({"path": "/x"})),
        {"jsonrpc": "2.0", "id": 3, "method": "ping"},
    ]);
    // stdio.
    let upstream = scratch.upstream(&["stdio"]);
    let answers = stdio_batch(&mesh.url, &[HIDE], upstream, batch.clone()).await;
    assert_eq!(answers.len(), 3, "{answers:?}");
    let mut names = names_of(&answers["1"]);
    names.sort_unstable();
    assert_eq!(names, ["pay", "read_file", "write_note"]);
    assert_eq!(answers["2"]["result"]["isError"], false, "{answers:?}");
    // HTTP.
    let (upstream_port, _upstream) = scratch.http_upstream().await;
    let (url, _gateway) =
        gateway_before(&mesh.url, "127.0.0.1", upstream_port, &[HIDE.as_ref()]).await;
    let session = http_session(&url).await;
    let (status, head, body) = post(&url, Some(&session), &batch.to_string()).await;
    assert_eq!(status, 200, "{head}\n{body}");
    let answers = by_id(&serde_json::from_str(&body).unwrap());
    assert_eq!(answers.len(), 3, "{answers:?}");
    let mut names = names_of(&answers["1"]);
    names.sort_unstable();
    assert_eq!(names, ["pay", "read_file", "write_note"]);
    assert_eq!(answers["2"]["result"]["isError"], false, "{answers:?}");
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r28_r31_the_embedded_mesh_hides_unguarded_tools_it_cancels() {
    let scratch = Scratch::new("visibility-embedded");
    // A guard on every tool but delete_file, whose rule is not constant;
    // unguarded calls are cancelled: delete_file is never run.
    let rule = policy_rule!(name: "big-payments", tools: ["pay"], action: "cancel",
        when: r#""has(call.args.amount) && call.args.amount > 1000""#,
        message: r#"'"payments over 1000 need a human"'"#);
    std::fs::write(scratch.dir.join("cel.toml"), rule).unwrap();
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        "unguarded = \"cancel\"\n\n[[guard]]\nname = \"cel\"\npolicy = \"cel.toml\"\n\
         tools = [\"pay\", \"read_*\", \"write_note\"]\n",
    )
    .unwrap();
    let target = via_gateway_judging(
        ["--config", &config.display().to_string()],
        &[HIDE],
        scratch.upstream(&["stdio"]),
    );
    let lines = run_client_off_thread(list_then_delete(), target).await;
    assert_hidden_and_still_judged(&lines, &scratch, "no guard checks the tool");
}

// ---------------------------------------------------------------------------
// Attacks: hiding never turns into hiding everything, or into an unbounded
// request to the mesh.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_listing_while_the_mesh_is_down_shows_every_tool() {
    let scratch = Scratch::new("visibility-down");
    let down = format!("http://127.0.0.1:{}", free_port());
    let scenario = json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
    ]});
    let target = via_gateway(&down, &[HIDE], scratch.upstream(&["stdio"]));
    let lines = run_client_off_thread(scenario, target).await;
    let mut names = listed(&lines);
    names.sort();
    assert_eq!(
        names,
        ["delete_file", "pay", "read_file", "write_note"],
        "shown, not hidden, and the listing not failed: {lines:?}"
    );
    // Calls are judged either way: unjudged, nothing runs.
    assert!(calls(&lines)[0]["error"].is_object(), "{lines:?}");
    assert!(scratch.executed().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r9_r20_a_hostile_listing_is_asked_about_within_bounds_and_the_rest_shown() {
    let mesh = mesh_without_delete("visibility-hostile").await;
    let scratch = Scratch::new("visibility-hostile");
    let upstream = vec![
        mcp_python().display().to_string(),
        sdk_dir().join("listing_upstream.py").display().to_string(),
        scratch.log().display().to_string(),
        "100000".to_owned(),
    ];
    let url = mesh.url.clone();
    let (listing, called) = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start(&url, &[HIDE], upstream);
        gateway.send(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#);
        let listing = gateway.recv();
        gateway.send(&RawGateway::call(json!(2), "DELETE_FILE", json!({})).to_string());
        (listing, gateway.recv())
    })
    .await
    .unwrap();
    let names = names_of(&listing);
    // 100,003 listed: the first 4,096 names within the bound are asked
    // about; delete_file and the name differing from it only in case are
    // hidden (R9: both would be cancelled); the 300-byte name and the
    // names past the bound cannot be asked about, and are shown.
    assert_eq!(
        names.len(),
        100_001,
        "{:?}",
        names.iter().take(3).collect::<Vec<_>>()
    );
    assert_eq!(names[0], "h".repeat(300));
    assert!(!names.contains(&"delete_file") && !names.contains(&"DELETE_FILE"));
    assert_eq!((names[1], names[100_000]), ("t0", "t99999"));
    // Called anyway: cancelled, never run.
    assert_eq!(called["result"]["isError"], false, "{called}");
    assert!(
        std::fs::read_to_string(scratch.log())
            .unwrap_or_default()
            .is_empty()
    );
}

/// The official TypeScript SDK client (1.x, 2025-11-25) over `mcp stdio`:
/// its `listTools()` does not see the tool a constant cancel rule names,
/// sees the others; the hidden tool called anyway is cancelled, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r27_r31_the_typescript_sdk_client_does_not_see_a_tool_the_chain_always_cancels() {
    let mesh = mesh_without_delete("visibility-ts").await;
    let scratch = Scratch::new("visibility-ts");
    let target = via_gateway(&mesh.url, &[HIDE], scratch.upstream(&["stdio"]));
    let lines = tokio::task::spawn_blocking(move || {
        crate::mcp_answers::run_ts_client(&list_then_delete(), &target)
    })
    .await
    .unwrap();
    assert_hidden_and_still_judged(&lines, &scratch, "deleting files is never allowed here");
}

/// Paying is never allowed: a constant cancel rule.
const NO_PAY: &str = policy_rule!(name: "no-pay", tools: ["pay"], action: "cancel",
    when: r#""true""#, message: r#"'"paying is never allowed here"'"#);

/// The official TypeScript SDK v2 client, stateless at 2026-07-28, over
/// `mcp http` before the SDK v2 upstream: `listTools()` does not see the
/// tool a constant cancel rule names, sees the other; calling it anyway is
/// cancelled and never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r27_r31_the_typescript_sdk_v2_client_does_not_see_a_tool_the_chain_always_cancels() {
    let mesh = MeshProcess::start("visibility-ts2", "", None).await;
    mesh.register(Registration::policy("never-pay", NO_PAY))
        .await;
    let scratch = Scratch::new("visibility-ts2");
    let (url, _upstream, _gateway) = crate::mcp_revision_ts::gateway_before_ts2_upstream_with(
        &mesh.url,
        &scratch,
        &[HIDE.as_ref()],
    )
    .await;
    let scenario = json!({"steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]});
    let lines =
        tokio::task::spawn_blocking(move || crate::mcp_revision_ts::run_ts2_client(scenario, url))
            .await
            .unwrap();
    assert_eq!(lines[0]["protocol"], "2026-07-28", "{lines:?}");
    assert_eq!(listed(&lines), ["read_file"], "{lines:?}");
    let results = calls(&lines);
    assert_eq!(results.len(), 1, "{lines:?}");
    assert_eq!(results[0]["isError"], false, "{lines:?}");
    assert_eq!(
        results[0]["text"][0], "paying is never allowed here",
        "{lines:?}"
    );
    assert!(scratch.executed().is_empty(), "the hidden tool never ran");
}
