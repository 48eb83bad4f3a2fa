//! Tool calls a model asks for through sampling (R31): the client's answer
//! to an upstream's `sampling/createMessage` holds `tool_use` blocks, which
//! the upstream runs. Each is judged by the mesh as a call of the session
//! before the upstream receives the answer; a call the chain skips reaches
//! the upstream as a text block saying why, never as a `tool_use`. The
//! upstream (tests/mcp-sdk/sampling_upstream.py) and the client are the
//! official Python MCP SDK's; the mesh is remote (`--mesh`, over stdio and
//! Streamable HTTP) or in the gateway's process (`--config`).
//!
//! Needs `scripts/setup-polyglot` (the SDK in build/venv).

use crate::harness::*;
use crate::mcp::{
    RawGateway, Scratch, calls, gateway_before, listening, mcp_python, run_client_off_thread,
    sdk_dir, via_gateway_judging,
};
use crate::mcp_returns::{WITHHELD, block_secrets};
use guardmesh_client::Registration;
use guardmesh_client::proto::{GuardBatch, GuardPhases, ToolCall, Verdict};
use guardmesh_client::verdict::{cancel, rewrite_arguments};
use serde_json::{Value, json};
use std::process::{Command, Stdio};
use std::time::Duration;

/// What the guard says of `delete_db`.
const NOT_ALLOWED: &str = "deleting the database is not allowed";

/// The guard: `delete_db` cancelled, whatever its arguments; `read_db` of
/// the `secrets` table rewritten to the `public` one.
fn guard_policy(call: &ToolCall) -> Option<Verdict> {
    let args: Value = serde_json::from_str(&call.arguments).unwrap_or(json!({}));
    match call.tool.as_str() {
        "delete_db" => Some(cancel(&call.call_id, NOT_ALLOWED)),
        "read_db" if args["table"] == "secrets" => Some(rewrite_arguments(
            &call.call_id,
            &json!({"table": "public"}),
        )),
        _ => None,
    }
}

/// A mesh process with the guard registered (a mutate grant on `read_db`).
async fn mesh_with_guard(name: &str) -> (MeshProcess, TestGuard) {
    let mesh = MeshProcess::start(name, "", None).await;
    let guard = call_guard(Duration::ZERO, guard_policy).await;
    mesh.register(Registration::mutate("db", &guard.url, ["read_db"]))
        .await;
    (mesh, guard)
}

/// The upstream's command line (stdio), logging to the scratch folder.
fn upstream(scratch: &Scratch, mode: &[&str]) -> Vec<String> {
    let mut command = vec![
        mcp_python().display().to_string(),
        sdk_dir().join("sampling_upstream.py").display().to_string(),
        scratch.log().display().to_string(),
    ];
    command.extend(mode.iter().map(|s| s.to_string()));
    command
}

/// A config for `--config` (the embedded mesh): the guard as
/// [`mesh_with_guard`] registers it, then `more` (TOML).
fn embedded_config(scratch: &Scratch, guard: &TestGuard, more: &str) -> String {
    let config = scratch.dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[[guard]]\nname = \"db\"\nendpoint = {:?}\nrole = \"mutate\"\n\
             grant = {{ tools = [\"read_db\"] }}\n{more}",
            guard.url
        ),
    )
    .unwrap();
    config.display().to_string()
}

/// Which way the client reaches the upstream: through `mcp stdio` or
/// `mcp http` before a mesh process, or through `mcp stdio` with its
/// mesh embedded.
#[derive(Clone, Copy)]
enum Way {
    Stdio,
    Http,
    Embedded,
}

/// A gateway before the sampling upstream, the way `way` says, its chain
/// the call guard of [`mesh_with_guard`] and, with `results`, the results
/// guard of [`mesh_judging_results`]; what keeps it running.
struct Setup {
    target: Vec<String>,
    scratch: Scratch,
    guard: TestGuard,
    results: Option<TestGuard>,
    _mesh: Option<MeshProcess>,
    _processes: Vec<KillOnDrop>,
}

impl Setup {
    async fn new(way: Way, name: &str, results: bool) -> Self {
        Self::judging_results_of(way, name, results.then_some(&[][..])).await
    }

    /// [`Self::new`], its results guard judging the results of `tools`
    /// only (`Some(&[])`: of every tool; `None`: no results guard).
    async fn judging_results_of(way: Way, name: &str, results: Option<&[&str]>) -> Self {
        let scratch = Scratch::new(name);
        let tools = results.unwrap_or_default();
        let (mesh, guard, results) = match (way, results.is_some()) {
            (Way::Embedded, _) => {
                let guard = call_guard(Duration::ZERO, guard_policy).await;
                let results = if results.is_some() {
                    Some(script_guard(block_secrets).await)
                } else {
                    None
                };
                (None, guard, results)
            }
            (_, true) => {
                let (mesh, guard, results) = mesh_judging_results(name, tools).await;
                (Some(mesh), guard, Some(results))
            }
            (_, false) => {
                let (mesh, guard) = mesh_with_guard(name).await;
                (Some(mesh), guard, None)
            }
        };
        let mut processes = Vec::new();
        let target = match (way, &mesh) {
            (Way::Http, Some(mesh)) => {
                let (url, upstream, gateway) = http_gateway_to_upstream(&mesh.url, &scratch).await;
                processes.extend([upstream, gateway]);
                vec!["http".into(), url]
            }
            (Way::Stdio, Some(mesh)) => {
                via_gateway_judging(["--mesh", &mesh.url], &[], upstream(&scratch, &["stdio"]))
            }
            _ => {
                let more = results
                    .as_ref()
                    .map_or_else(String::new, |r| results_guard_toml(r, tools));
                let config = embedded_config(&scratch, &guard, &more);
                via_gateway_judging(["--config", &config], &[], upstream(&scratch, &["stdio"]))
            }
        };
        Self {
            target,
            scratch,
            guard,
            results,
            _mesh: mesh,
            _processes: processes,
        }
    }

    /// [`sampled_tool_use_is_judged_at`] through this gateway.
    async fn tool_use_is_judged(&self, revision: Revision) {
        sampled_tool_use_is_judged_at(revision, self.target.clone(), &self.scratch, &self.guard)
            .await;
    }

    /// [`sampled_tool_result_is_judged`] through this gateway.
    async fn tool_result_is_judged(&self, revision: Revision) {
        let results = self.results.as_ref().expect("a setup judging results");
        sampled_tool_result_is_judged(revision, self.target.clone(), &self.scratch, results).await;
    }
}

/// The upstream on Streamable HTTP and `guardmesh mcp http --mesh MESH`
/// before it: (the gateway's URL, the upstream, the gateway).
async fn http_gateway_to_upstream(
    mesh: &str,
    scratch: &Scratch,
) -> (String, KillOnDrop, KillOnDrop) {
    let port = free_port();
    let mut command = upstream(scratch, &["http", &port.to_string()]);
    let mut command_line = Command::new(command.remove(0));
    command_line.args(command).stderr(Stdio::null());
    let upstream = listening(&mut command_line, port, "the sampling upstream").await;
    let (url, gateway) = gateway_before(mesh, "127.0.0.1", port, &[]).await;
    (url, upstream, gateway)
}

/// The model's answer: some text, a `tool_use` of `delete_db` and one of
/// `read_db` on the secrets table.
fn answer() -> Value {
    json!([
        {"type": "text", "text": "cleaning up"},
        {"type": "tool_use", "id": "u1", "name": "delete_db", "input": {"name": "prod"}},
        {"type": "tool_use", "id": "u2", "name": "read_db", "input": {"table": "secrets"}},
    ])
}

/// How the sampling request and its answer travel.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Revision {
    /// A `sampling/createMessage` request of the server's, answered by the
    /// client (2025-11-25; the upstream's tool `plan`).
    Legacy,
    /// An `input_required` result holding the request; the answer comes
    /// back in the retried call's `inputResponses` (2026-07-28; the
    /// upstream's tool `plan_later`).
    InputRequired,
}

impl Revision {
    /// The client's mode and the upstream's tool.
    fn mode_and_tool(self) -> (&'static str, &'static str) {
        match self {
            Self::Legacy => ("legacy", "plan"),
            Self::InputRequired => ("auto", "plan_later"),
        }
    }
}

/// The client asks the upstream to `plan`; the upstream samples, the
/// client's model answers [`answer`] (the sampling travelling as
/// `revision` says). The upstream must run only `read_db`, as rewritten,
/// and read what the guard said of `delete_db`.
async fn sampled_tool_use_is_judged_at(
    revision: Revision,
    target: Vec<String>,
    scratch: &Scratch,
    guard: &TestGuard,
) {
    let (mode, tool) = revision.mode_and_tool();
    let scenario = json!({"mode": mode, "sample": [answer()], "steps": [
        {"op": "call", "name": tool, "arguments": {"task": "clean up"}},
    ]});
    let lines = run_client_off_thread(scenario, target).await;
    if revision == Revision::InputRequired {
        assert_eq!(lines[0]["protocol"], "2026-07-28", "{lines:?}");
    }
    let results = calls(&lines);
    assert_eq!(results.len(), 1, "{lines:?}");
    assert!(results[0].get("error").is_none(), "{lines:?}");
    assert!(
        lines.iter().any(|l| l["op"] == "sampled"),
        "the client was asked to sample: {lines:?}"
    );
    let executed = scratch.executed();
    let ran: Vec<&Value> = executed
        .iter()
        .filter(|e| e.get("tool").is_some())
        .collect();
    assert_eq!(
        ran,
        vec![&json!({"tool": "read_db", "arguments": {"table": "public"}})],
        "the upstream ran only what the mesh let proceed, as rewritten: {executed:?}"
    );
    let received = executed
        .iter()
        .find_map(|e| e.get("answer"))
        .unwrap_or_else(|| panic!("{executed:?}"));
    let texts: Vec<&str> = received
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(texts[0], "cleaning up", "{received}");
    assert!(
        texts[1].contains("the tool call delete_db was not run") && texts[1].contains(NOT_ALLOWED),
        "the guard's content in the tool_use's place: {received}"
    );
    assert!(
        !received
            .to_string()
            .contains("delete_db\",\"type\":\"tool_use")
            && received
                .as_array()
                .unwrap()
                .iter()
                .all(|b| b["type"] != "tool_use" || b["name"] == "read_db"),
        "{received}"
    );
    // The mesh judged both as calls of the session.
    let judged: Vec<String> = guard
        .guard
        .batches()
        .iter()
        .flat_map(|b: &GuardBatch| b.calls.iter().map(|c| c.tool.clone()))
        .collect();
    assert!(
        judged.iter().any(|t| t == "delete_db") && judged.iter().any(|t| t == "read_db"),
        "{judged:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_through_sampling_is_judged_as_a_call_stdio() {
    Setup::new(Way::Stdio, "sampling-stdio", false)
        .await
        .tool_use_is_judged(Revision::Legacy)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_through_sampling_is_judged_as_a_call_embedded() {
    Setup::new(Way::Embedded, "sampling-embedded", false)
        .await
        .tool_use_is_judged(Revision::Legacy)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_through_sampling_is_judged_as_a_call_http() {
    Setup::new(Way::Http, "sampling-http", false)
        .await
        .tool_use_is_judged(Revision::Legacy)
        .await;
}

/// R31 over stdio: a sampling answer sent inside a JSON-RPC batch is
/// judged as one sent alone; with every `tool_use` replaced, the upstream
/// reads a finished turn (`endTurn`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_through_sampling_in_a_batch_is_judged() {
    let (mesh, _guard) = mesh_with_guard("sampling-batch").await;
    let scratch = Scratch::new("sampling-batch");
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args(["mcp", "stdio", "--mesh", &mesh.url, "--"])
        .args(upstream(&scratch, &["stdio"]));
    let result = tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::spawn_declaring(command, json!({"sampling": {"tools": {}}}));
        gateway.send(&RawGateway::call(json!(1), "plan", json!({"task": "clean up"})).to_string());
        let asked = gateway.recv();
        assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
        let blocks = json!([
            {"type": "tool_use", "id": "u1", "name": "delete_db", "input": {}},
            {"type": "tool_use", "id": "u2", "name": "delete_db", "input": {"name": "prod"}},
        ]);
        let answer = json!({"jsonrpc": "2.0", "id": asked["id"], "result": {
            "role": "assistant", "content": blocks, "model": "m", "stopReason": "toolUse"}});
        gateway.send(&json!([answer]).to_string());
        let result = gateway.recv();
        gateway.end();
        result
    })
    .await
    .unwrap();
    assert_eq!(result["id"], 1, "{result}");
    let executed = scratch.executed();
    assert!(
        executed.iter().all(|e| e.get("tool").is_none()),
        "nothing ran: {executed:?}"
    );
    let received = executed
        .iter()
        .find(|e| e.get("answer").is_some())
        .unwrap_or_else(|| panic!("{executed:?}"));
    assert_eq!(received["stopReason"], "endTurn", "{received}");
    let blocks = received["answer"].as_array().unwrap();
    assert_eq!(blocks.len(), 2, "{received}");
    for block in blocks {
        assert_eq!(block["type"], "text", "{received}");
        assert!(
            block["text"].as_str().unwrap().contains(NOT_ALLOWED),
            "{received}"
        );
    }
}

// ---------------------------------------------------------------------------
// 2026-07-28: the sampling answer comes back in a retried call's
// `inputResponses` (R31): its `tool_use` blocks are judged alike.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_in_input_responses_is_judged_as_a_call_stdio() {
    Setup::new(Way::Stdio, "sampling-mrtr-stdio", false)
        .await
        .tool_use_is_judged(Revision::InputRequired)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_in_input_responses_is_judged_as_a_call_embedded() {
    Setup::new(Way::Embedded, "sampling-mrtr-embedded", false)
        .await
        .tool_use_is_judged(Revision::InputRequired)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_a_tool_use_in_input_responses_is_judged_as_a_call_http() {
    Setup::new(Way::Http, "sampling-mrtr-http", false)
        .await
        .tool_use_is_judged(Revision::InputRequired)
        .await;
}

// ---------------------------------------------------------------------------
// The tools' results go back to the client's model in the upstream's next
// sampling request (`tool_result` blocks, R33): judged as the results of
// the calls the mesh let proceed, before the client sees them.
// ---------------------------------------------------------------------------

/// A mesh process with the guard of [`mesh_with_guard`] and a results
/// guard blocking every result holding an AWS key id, of the tools `tools`
/// (empty: of every tool): (mesh, the call guard, the results guard).
async fn mesh_judging_results(name: &str, tools: &[&str]) -> (MeshProcess, TestGuard, TestGuard) {
    let (mesh, guard) = mesh_with_guard(name).await;
    let results = script_guard(block_secrets).await;
    mesh.register(
        Registration::validate("secrets", &results.url)
            .phases(GuardPhases::Results)
            .tools(tools.iter().copied()),
    )
    .await;
    (mesh, guard, results)
}

/// The results guard of [`mesh_judging_results`] in a config (TOML).
fn results_guard_toml(results: &TestGuard, tools: &[&str]) -> String {
    let tools = if tools.is_empty() {
        String::new()
    } else {
        format!("tools = {tools:?}\n")
    };
    format!(
        "[[guard]]\nname = \"secrets\"\nendpoint = {:?}\nrole = \"validate\"\n\
         phases = \"results\"\n{tools}",
        results.url
    )
}

/// The client's model asks for `read_db` of the secrets table (run on the
/// public one, as rewritten); the upstream sends its result, rows holding
/// an AWS key id, back to the model in its next sampling request. The
/// client must read the results guard's content in its place, never the
/// key; the results guard judged it as the result of the call the mesh
/// let proceed. Legacy: through the upstream's prompt `report` (no tool
/// call runs: sampling requests during a call whose result is judged are
/// withheld); 2026-07-28: through the tool `plan_later`'s `input_required`
/// rounds.
async fn sampled_tool_result_is_judged(
    revision: Revision,
    target: Vec<String>,
    scratch: &Scratch,
    results: &TestGuard,
) {
    let step = match revision {
        Revision::Legacy => {
            json!({"op": "prompt", "name": "report", "arguments": {"task": "report"}})
        }
        Revision::InputRequired => {
            json!({"op": "call", "name": "plan_later", "arguments": {"task": "report"}})
        }
    };
    let (mode, _) = revision.mode_and_tool();
    let read =
        json!([{"type": "tool_use", "id": "u2", "name": "read_db", "input": {"table": "secrets"}}]);
    let scenario = json!({"mode": mode, "sample": [read], "steps": [step]});
    let lines = run_client_off_thread(scenario, target).await;
    let done = lines.last().unwrap_or_else(|| panic!("{lines:?}"));
    assert!(done.get("error").is_none(), "{lines:?}");
    assert_eq!(done["op"], step["op"], "{lines:?}");
    assert_eq!(
        scratch.executed().last(),
        Some(&json!({"tool": "read_db", "arguments": {"table": "public"}})),
        "the tool ran"
    );
    let sampled: Vec<&Value> = lines.iter().filter(|l| l["op"] == "sampled").collect();
    assert_eq!(sampled.len(), 2, "{lines:?}");
    let messages = &sampled[1]["messages"];
    assert!(
        !messages.to_string().contains("AKIA"),
        "the key reached the client's model: {messages}"
    );
    let block = &messages[2]["content"][0];
    assert_eq!(block["type"], "tool_result", "{messages}");
    assert_eq!(block["toolUseId"], "u2", "{messages}");
    assert_eq!(block["isError"], true, "{messages}");
    assert_eq!(block["content"][0]["text"], WITHHELD, "{messages}");
    // Judged as the result of the call the mesh let proceed.
    let judged: Vec<(String, String)> = results
        .guard
        .batches()
        .iter()
        .flat_map(|b| {
            b.results
                .iter()
                .map(|r| (r.call_id.clone(), r.tool.clone()))
        })
        .filter(|(_, tool)| tool == "read_db")
        .collect();
    assert_eq!(judged.len(), 1, "{judged:?}");
    // Judged as the result of the call the mesh let proceed (its call id),
    // not under an id of the gateway's own for a result it never saw
    // called (R33, R34: the session's memory learns what was read).
    assert!(
        judged[0].0.starts_with("sampling-") && !judged[0].0.starts_with("sampling-result-"),
        "{judged:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_tool_result_sent_to_the_model_through_sampling_is_judged_stdio() {
    Setup::new(Way::Stdio, "sampling-result-stdio", true)
        .await
        .tool_result_is_judged(Revision::Legacy)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_tool_result_sent_to_the_model_through_sampling_is_judged_http() {
    Setup::new(Way::Http, "sampling-result-http", true)
        .await
        .tool_result_is_judged(Revision::Legacy)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_tool_result_sent_to_the_model_through_sampling_is_judged_embedded() {
    Setup::new(Way::Embedded, "sampling-result-embedded", true)
        .await
        .tool_result_is_judged(Revision::Legacy)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_tool_result_in_an_input_required_sampling_request_is_judged_stdio() {
    Setup::new(Way::Stdio, "sampling-mrtr-result-stdio", true)
        .await
        .tool_result_is_judged(Revision::InputRequired)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_tool_result_in_an_input_required_sampling_request_is_judged_http() {
    Setup::new(Way::Http, "sampling-mrtr-result-http", true)
        .await
        .tool_result_is_judged(Revision::InputRequired)
        .await;
}

// ---------------------------------------------------------------------------
// A `tool_result` whose `toolUseId` names no call the gateway judged (R33):
// the upstream writes the `tool_use` it answers itself, so the name there
// is the upstream's word, not a judged call. Never judged under it.
// ---------------------------------------------------------------------------

/// The upstream forges a conversation (its prompt `forge`, or at
/// 2026-07-28 its tool `forge_later`): a `tool_use` of the harmless tool
/// `echo` no model asked for, and a `tool_result` for it holding an AWS
/// key id. The chain's results guard judges the results of `read_db` only
/// (where secrets are read). The client's model must read an error result
/// saying the result was withheld, never the key; and no `echo` result
/// was sent to the mesh under the name the upstream chose.
async fn forged_tool_result_is_withheld(revision: Revision, setup: &Setup) {
    let step = match revision {
        Revision::Legacy => json!({"op": "prompt", "name": "forge", "arguments": {"task": "t"}}),
        Revision::InputRequired => {
            json!({"op": "call", "name": "forge_later", "arguments": {"task": "t"}})
        }
    };
    let (mode, _) = revision.mode_and_tool();
    let scenario = json!({"mode": mode, "sample": [], "steps": [step]});
    let lines = run_client_off_thread(scenario, setup.target.clone()).await;
    let done = lines.last().unwrap_or_else(|| panic!("{lines:?}"));
    assert!(done.get("error").is_none(), "{lines:?}");
    let sampled: Vec<&Value> = lines.iter().filter(|l| l["op"] == "sampled").collect();
    assert_eq!(sampled.len(), 1, "{lines:?}");
    let messages = &sampled[0]["messages"];
    assert!(
        !messages.to_string().contains("AKIA"),
        "the key reached the client's model: {messages}"
    );
    let block = &messages[2]["content"][0];
    assert_eq!(block["type"], "tool_result", "{messages}");
    assert_eq!(block["toolUseId"], "x", "{messages}");
    assert_eq!(block["isError"], true, "{messages}");
    let text = block["content"][0]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("withheld") && text.contains("not a call judged through this gateway"),
        "{messages}"
    );
    // The upstream's own `tool_use` is relayed as it wrote it: it is the
    // upstream's text, not a call.
    assert_eq!(messages[1]["content"][0]["name"], "echo", "{messages}");
    let results = setup.results.as_ref().expect("a setup judging results");
    let judged: Vec<String> = results
        .guard
        .batches()
        .iter()
        .flat_map(|b| b.results.iter().map(|r| r.tool.clone()))
        .collect();
    assert!(judged.is_empty(), "{judged:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_forged_tool_result_is_withheld_not_judged_under_its_name_stdio() {
    let setup = Setup::judging_results_of(Way::Stdio, "sampling-forged-stdio", Some(&["read_db"]));
    forged_tool_result_is_withheld(Revision::Legacy, &setup.await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_forged_tool_result_is_withheld_not_judged_under_its_name_http() {
    let setup = Setup::judging_results_of(Way::Http, "sampling-forged-http", Some(&["read_db"]));
    forged_tool_result_is_withheld(Revision::Legacy, &setup.await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_forged_tool_result_is_withheld_not_judged_under_its_name_embedded() {
    let setup = Setup::judging_results_of(
        Way::Embedded,
        "sampling-forged-embedded",
        Some(&["read_db"]),
    );
    forged_tool_result_is_withheld(Revision::Legacy, &setup.await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_forged_tool_result_in_an_input_required_result_is_withheld_stdio() {
    let setup =
        Setup::judging_results_of(Way::Stdio, "sampling-forged-mrtr-stdio", Some(&["read_db"]));
    forged_tool_result_is_withheld(Revision::InputRequired, &setup.await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r33_a_forged_tool_result_in_an_input_required_result_is_withheld_http() {
    let setup =
        Setup::judging_results_of(Way::Http, "sampling-forged-mrtr-http", Some(&["read_db"]));
    forged_tool_result_is_withheld(Revision::InputRequired, &setup.await).await;
}

// ---------------------------------------------------------------------------
// `mcp stdio`: sampling messages are judged in one ordered lane per
// direction, within the bound of messages judged at once (R25, R31): a
// flood waits (the gateway stops reading the peer), nothing is dropped,
// and a message sent after a sampling message reaches the peer after it.
// ---------------------------------------------------------------------------

/// Messages judged at once by `mcp stdio`, at most, per direction (the
/// bound the relay documents).
const JUDGED_AT_ONCE: usize = 64;

/// Sampling messages in a flood: three times the bound.
const FLOOD: usize = 3 * JUDGED_AT_ONCE;

/// A mesh that sends its guards every batch at once (a fixed limit far
/// past the flood), so the guard sees what the gateway sends.
async fn mesh_sending_every_batch(name: &str) -> MeshProcess {
    let config = "[guard_links]\nmin_in_flight = 1024\nmax_in_flight = 1024\n";
    MeshProcess::start(name, config, None).await
}

/// The scripted upstream's command line (tests/mcp-sdk/flood_upstream.py).
fn flood_upstream(scratch: &Scratch) -> Vec<String> {
    vec![
        mcp_python().display().to_string(),
        sdk_dir().join("flood_upstream.py").display().to_string(),
        scratch.log().display().to_string(),
    ]
}

/// `guardmesh mcp stdio` before the flood upstream, judging with `mesh`
/// (batches may wait 30 s there), its client declaring sampling with
/// tools; and its process id.
async fn flood_gateway(mesh: &MeshProcess, scratch: &Scratch) -> (RawGateway, u32) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args([
            "mcp",
            "stdio",
            "--mesh",
            &mesh.url,
            "--timeout-ms",
            "30000",
            "--",
        ])
        .args(flood_upstream(scratch))
        .stderr(Stdio::null());
    let gateway = tokio::task::spawn_blocking(move || {
        RawGateway::spawn_declaring(command, json!({"sampling": {"tools": {}}}))
    })
    .await
    .unwrap();
    let pid = gateway.child.id();
    (gateway, pid)
}

/// Runs `f` with the gateway off the runtime's threads, at most 60 s
/// (then the gateway, the process `pid`, is killed and the test fails).
async fn off_thread<T: Send + 'static>(
    pid: u32,
    gateway: RawGateway,
    f: impl FnOnce(&mut RawGateway) -> T + Send + 'static,
) -> (RawGateway, T) {
    let mut gateway = gateway;
    let work = tokio::task::spawn_blocking(move || {
        let out = f(&mut gateway);
        (gateway, out)
    });
    match tokio::time::timeout(Duration::from_secs(60), work).await {
        Ok(done) => done.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            panic!("the gateway did not answer within 60 s");
        }
    }
}

/// Waits (at most 30 s) until `held` has received `JUDGED_AT_ONCE`
/// batches, then half a second more (a gateway past its bound sends more
/// meanwhile; one within it cannot): how many it holds at once.
async fn held_at_once(held: &HeldHandle) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while held.guard.requests() < JUDGED_AT_ONCE && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    held.guard.requests()
}

/// What a message is, for the order checks: its method, or "response".
fn kind(message: &Value) -> String {
    message["method"]
        .as_str()
        .map_or_else(|| "response".to_owned(), str::to_owned)
}

/// R25, R31 (upstream to client): the upstream sends `FLOOD` sampling
/// requests holding a tool result the mesh judges, while the results
/// guard holds every batch: the mesh is sent at most `JUDGED_AT_ONCE` at
/// once, the rest wait; once it answers, the client receives every one,
/// in the order sent, and the log message and the prompt's answer the
/// upstream sent after them only after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_sampling_requests_are_judged_in_order_within_the_bound_stdio() {
    let mesh = mesh_sending_every_batch("sampling-flood-up").await;
    let held = held_guard().await;
    mesh.register(
        Registration::validate("held", &held.url)
            .phases(GuardPhases::Results)
            .timeout(Duration::from_secs(30)),
    )
    .await;
    let scratch = Scratch::new("sampling-flood-up");
    let (gateway, pid) = flood_gateway(&mesh, &scratch).await;
    let (gateway, ()) = off_thread(pid, gateway, |gateway| {
        let flood = FLOOD.to_string();
        gateway.send(
            &json!({"jsonrpc": "2.0", "id": 1, "method": "prompts/get",
                    "params": {"name": "flood", "arguments": {"n": flood}}})
            .to_string(),
        );
        let asked = gateway.recv();
        assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
        let read = json!([{"type": "tool_use", "id": "u1", "name": "read_db", "input": {}}]);
        gateway.send(
            &json!({"jsonrpc": "2.0", "id": asked["id"], "result": {
                "role": "assistant", "content": read, "model": "m", "stopReason": "toolUse"}})
            .to_string(),
        );
    })
    .await;
    let at_once = held_at_once(&held).await;
    held.guard.release();
    // Judged concurrently up to the bound, never past it.
    assert_eq!(at_once, JUDGED_AT_ONCE, "sampling requests judged at once");
    let (mut gateway, received) = off_thread(pid, gateway, |gateway| {
        let mut received = Vec::new();
        loop {
            let message = gateway.recv();
            let last = message["id"] == 1;
            received.push(message);
            if last {
                return received;
            }
        }
    })
    .await;
    let kinds: Vec<String> = received.iter().map(kind).collect();
    let mut expected = vec!["sampling/createMessage".to_owned(); FLOOD];
    expected.extend(["notifications/message".to_owned(), "response".to_owned()]);
    assert_eq!(kinds, expected, "{received:?}");
    for (i, request) in received[..FLOOD].iter().enumerate() {
        let messages = &request["params"]["messages"];
        assert_eq!(
            messages[0]["content"]["text"],
            format!("flood {}", i + 1),
            "{request}"
        );
        assert_eq!(
            messages[2]["content"][0]["content"][0]["text"],
            format!("rows {}", i + 1),
            "judged and passed: {request}"
        );
    }
    assert_eq!(held.guard.requests(), FLOOD, "each judged once");
    gateway.end();
}

/// R25, R31 (client to upstream): the client answers `FLOOD` sampling
/// requests with a `tool_use` each, then pings, while the call guard holds
/// every batch: the mesh is sent at most `JUDGED_AT_ONCE` at once; once it
/// answers, the upstream receives every answer, in the order sent, and
/// the ping only after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_sampling_answers_are_judged_in_order_within_the_bound_stdio() {
    let mesh = mesh_sending_every_batch("sampling-flood-down").await;
    let held = held_guard().await;
    mesh.register(Registration::validate("held", &held.url).timeout(Duration::from_secs(30)))
        .await;
    let scratch = Scratch::new("sampling-flood-down");
    let (gateway, pid) = flood_gateway(&mesh, &scratch).await;
    let (gateway, ()) = off_thread(pid, gateway, |gateway| {
        let flood = FLOOD.to_string();
        gateway.send(
            &json!({"jsonrpc": "2.0", "id": 1, "method": "prompts/get",
                    "params": {"name": "ask", "arguments": {"n": flood}}})
            .to_string(),
        );
        let asked: Vec<Value> = (0..FLOOD).map(|_| gateway.recv()).collect();
        for (i, asked) in asked.iter().enumerate() {
            assert_eq!(asked["method"], "sampling/createMessage", "{asked}");
            let read = json!([{"type": "tool_use", "id": format!("u{}", i + 1),
                               "name": "read_db", "input": {"row": i + 1}}]);
            gateway.send(
                &json!({"jsonrpc": "2.0", "id": asked["id"], "result": {
                    "role": "assistant", "content": read, "model": "m",
                    "stopReason": "toolUse"}})
                .to_string(),
            );
        }
        gateway.send(r#"{"jsonrpc":"2.0","id":"after","method":"ping"}"#);
    })
    .await;
    let at_once = held_at_once(&held).await;
    held.guard.release();
    // Judged concurrently up to the bound, never past it.
    assert_eq!(at_once, JUDGED_AT_ONCE, "sampling answers judged at once");
    let (mut gateway, answers) =
        off_thread(pid, gateway, |gateway| [gateway.recv(), gateway.recv()]).await;
    gateway.end();
    assert!(
        answers.iter().any(|a| a["id"] == 1) && answers.iter().any(|a| a["id"] == "after"),
        "{answers:?}"
    );
    let received: Vec<Value> = scratch
        .executed()
        .into_iter()
        .map(|e| e["received"].clone())
        .filter(|m| m.get("method").is_none() || m["method"] == "ping")
        .collect();
    assert_eq!(received.len(), FLOOD + 1, "{received:?}");
    for (i, answer) in received[..FLOOD].iter().enumerate() {
        assert_eq!(
            answer["result"]["content"][0]["input"]["row"],
            i + 1,
            "in the order sent: {answer}"
        );
    }
    assert_eq!(received[FLOOD]["method"], "ping", "{received:?}");
    assert_eq!(held.guard.requests(), FLOOD, "each judged once");
}
