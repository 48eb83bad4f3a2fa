//! The MCP interceptors (SEP-2624) conformance fixtures, replayed through a
//! real `guardmesh serve` and, for `list` and `invoke` steps, the real MCP
//! gateway (`guardmesh mcp stdio`). See docs/flows.md, "Interceptor
//! conformance", for the mapping of the fixtures' vocabulary to the mesh.
//!
//! The fixtures are read where they are kept, never copied: the folder
//! `../shared/interceptors-conformance` beside the checkout, or
//! `GUARDMESH_INTERCEPTORS_FIXTURES` (`skip` skips the test). A missing
//! folder fails the test, naming the path.
//!
//! Each fixture gets a fresh mesh process (fixtures are independent), its
//! interceptors registered as guards: the generic behaviours as remote
//! guards served by this test, `cross-boundary-guard` as the mesh's own
//! flow rule (a CEL policy over session memory, R34), and
//! `secretless-redactor` as a redacting mutate guard of this test.

use super::harness::*;
use guardmesh_client::proto::{FailurePolicy, GuardBatch, GuardPhases, Verdict};
use guardmesh_client::verdict::{rewrite_arguments, rewrite_result, steer};
use guardmesh_client::{Batch, Coordinator, Outcome, Registrar, Registration};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The flow rule standing for the fixtures' `cross-boundary-guard`: a call
/// that sends a value a result of another server held is cancelled. The
/// batch's metadata `server` is the call's server (the gateway's
/// upstream); results are remembered with their server (R33, R34).
const CROSS_BOUNDARY_POLICY: &str = policy_rule!(name: "values-stay-on-their-server", action: "cancel",
    when: r#"'"server" in context.metadata && session.seen_from_other(call.args, context.metadata.server)'"#,
    message: r#"'"Tool call blocked: it sends a value read from another server. Do not retry it."'"#);

/// The tools of the reference adapter's servers (the fixtures' PROVENANCE):
/// a tool not listed is a server of its own name.
const SERVERS: &[(&str, &[&str])] = &[
    (
        "filesystem",
        &[
            "read_file",
            "write_file",
            "move_file",
            "list_directory",
            "search_files",
        ],
    ),
    (
        "sqlite",
        &["read_query", "write_query", "list_tables", "describe_table"],
    ),
    ("git", &["git_log", "git_show", "git_diff_unstaged"]),
    (
        "memory",
        &["read_graph", "create_entities", "add_observations"],
    ),
    ("fetch", &["fetch"]),
    (
        "browser",
        &["browser_type", "browser_fill_form", "browser_snapshot"],
    ),
    ("shell", &["execute_command"]),
];

fn server_of(tool: &str) -> String {
    SERVERS
        .iter()
        .find(|(_, tools)| tools.contains(&tool))
        .map_or_else(|| tool.to_owned(), |(server, _)| (*server).to_owned())
}

/// Where the fixtures are: `None` when told to skip.
fn fixtures_dir() -> Option<PathBuf> {
    match std::env::var("GUARDMESH_INTERCEPTORS_FIXTURES") {
        Ok(v) if v == "skip" => None,
        Ok(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => Some(repo_root().join("../shared/interceptors-conformance")),
    }
}

// --- the fixtures' behaviours, as guards -----------------------------------

/// The payload a guard's behaviour sees: a call as `{name, arguments}`; a
/// result as its `structuredContent` when it was a payload wrapped as one
/// (no content), else as the result itself.
fn call_payload(tool: &str, arguments: &str) -> Value {
    let arguments: Value = serde_json::from_str(arguments).unwrap_or(json!({}));
    json!({ "name": tool, "arguments": arguments })
}

fn result_payload(result: &str) -> (Value, bool) {
    let value: Value = serde_json::from_str(result).unwrap_or(Value::Null);
    let empty = value
        .get("content")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty);
    match value.get("structuredContent") {
        Some(inner) if empty => (inner.clone(), true),
        _ => (value, false),
    }
}

/// A response payload as a `CallToolResult`: itself when it has a
/// `content` array, else the `structuredContent` of a result with no
/// content (as the gateway maps `interceptor/invoke`).
fn wrap_result(payload: &Value) -> (String, bool) {
    if payload.get("content").is_some_and(Value::is_array) {
        (payload.to_string(), false)
    } else {
        (
            json!({ "content": [], "structuredContent": payload }).to_string(),
            true,
        )
    }
}

fn note(payload: &Value) -> Option<&str> {
    payload.pointer("/arguments/note").and_then(Value::as_str)
}

/// A validator's answer for one payload: `Some(message)` fails it.
fn validate(behavior: &str, payload: &Value) -> Option<&'static str> {
    match behavior {
        "deny-all" => Some("denied by policy"),
        "require-note" => match note(payload) {
            Some(n) if !n.is_empty() => None,
            _ => Some("note is required"),
        },
        "require-uppercase-note" => match note(payload) {
            Some(n) if n == n.to_uppercase() => None,
            _ => Some("note must be uppercase"),
        },
        _ => None,
    }
}

/// A mutator's answer for one payload: `Some(new payload)` rewrites it.
fn mutate(behavior: &str, payload: &Value) -> Option<Value> {
    match behavior {
        "uppercase-note" => {
            let upper = note(payload)?.to_uppercase();
            let mut out = payload.clone();
            out["arguments"]["note"] = Value::String(upper);
            Some(out)
        }
        "secretless-redactor" => {
            let mut out = payload.clone();
            redact(&mut out).then_some(out)
        }
        _ => None,
    }
}

/// A secret format: prefix, name, the characters after the prefix, the
/// least and most of them.
type SecretFormat = (&'static str, &'static str, fn(u8) -> bool, usize, usize);

/// The secret formats of the fixtures' reference adapter.
const SECRETS: &[SecretFormat] = &[
    (
        "sk_live_",
        "stripe_secret_live",
        |b| b.is_ascii_alphanumeric(),
        16,
        usize::MAX,
    ),
    (
        "pk_live_",
        "stripe_publishable_live",
        |b| b.is_ascii_alphanumeric(),
        16,
        usize::MAX,
    ),
    (
        "ghp_",
        "github_pat",
        |b| b.is_ascii_alphanumeric(),
        20,
        usize::MAX,
    ),
    (
        "gho_",
        "github_oauth",
        |b| b.is_ascii_alphanumeric(),
        20,
        usize::MAX,
    ),
    (
        "AKIA",
        "aws_access_key",
        |b| b.is_ascii_uppercase() || b.is_ascii_digit(),
        16,
        16,
    ),
    (
        "xoxb-",
        "slack_bot",
        |b| b.is_ascii_alphanumeric() || b == b'-',
        10,
        usize::MAX,
    ),
    (
        "xoxr-",
        "slack_refresh",
        |b| b.is_ascii_alphanumeric() || b == b'-',
        10,
        usize::MAX,
    ),
];

/// Replaces every secret in every string of `value` with
/// `[redacted:FORMAT]`; whether anything was replaced.
fn redact(value: &mut Value) -> bool {
    match value {
        Value::String(s) => {
            let redacted = redact_text(s);
            let changed = redacted != *s;
            *s = redacted;
            changed
        }
        Value::Array(items) => items.iter_mut().fold(false, |c, v| redact(v) | c),
        Value::Object(members) => members.values_mut().fold(false, |c, v| redact(v) | c),
        _ => false,
    }
}

fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    'scan: while i < bytes.len() {
        for (prefix, format, allowed, least, most) in SECRETS {
            if bytes[i..].starts_with(prefix.as_bytes()) {
                let start = i + prefix.len();
                let run = bytes[start..].iter().take_while(|b| allowed(**b)).count();
                if run >= *least && run <= *most {
                    out.push_str(&format!("[redacted:{format}]"));
                    i = start + run;
                    continue 'scan;
                }
            }
        }
        // Copy one character (UTF-8 boundaries kept).
        let next = text[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&text[i..i + next]);
        i += next;
    }
    out
}

/// A remote guard with the fixture behaviour `behavior`: on calls and on
/// results, each judged as its payload.
async fn behaviour_guard(behavior: String) -> TestGuard {
    script_guard(move |batch: &GuardBatch| {
        if behavior == "crash" {
            return Script {
                error: Some(tonic::Status::internal("interceptor crashed")),
                ..Script::default()
            };
        }
        let mut verdicts: Vec<Verdict> = Vec::new();
        for call in &batch.calls {
            let payload = call_payload(&call.tool, &call.arguments);
            if let Some(message) = validate(&behavior, &payload) {
                verdicts.push(steer(&call.call_id, message));
            } else if let Some(new) = mutate(&behavior, &payload) {
                verdicts.push(rewrite_arguments(&call.call_id, &new["arguments"]));
            }
        }
        for result in &batch.results {
            let (payload, wrapped) = result_payload(&result.result);
            if let Some(message) = validate(&behavior, &payload) {
                verdicts.push(steer(&result.call_id, message));
            } else if let Some(new) = mutate(&behavior, &payload) {
                let new = if wrapped {
                    json!({ "content": [], "structuredContent": new })
                } else {
                    new
                };
                verdicts.push(rewrite_result(&result.call_id, &new));
            }
        }
        Script {
            verdicts,
            ..Script::default()
        }
    })
    .await
}

/// Registers the fixture's interceptors, in order; the guards served here
/// are kept alive in the returned list.
async fn register(registrar: &Registrar, interceptors: &[Value]) -> Result<Vec<TestGuard>, String> {
    let mut guards = Vec::new();
    for i in interceptors {
        let text = |k: &str| i.get(k).and_then(Value::as_str).unwrap_or_default();
        let (name, behavior) = (text("name"), text("behavior"));
        let mutation = text("type") == "mutation";
        let phases = match text("phases") {
            "request" => GuardPhases::Calls,
            "response" => GuardPhases::Results,
            _ => GuardPhases::Both,
        };
        let mut registration = if behavior == "cross-boundary-guard" {
            // The mesh's own flow rule; a policy guard judges calls, and
            // every result reaches session memory whatever judges it.
            Registration::policy(name, CROSS_BOUNDARY_POLICY)
        } else {
            let guard = behaviour_guard(behavior.to_owned()).await;
            let registration = if mutation {
                Registration::mutate(name, &guard.url, ["*"])
                    .phases(phases)
                    .result_grant(if phases == GuardPhases::Calls {
                        Vec::new()
                    } else {
                        vec!["*"]
                    })
            } else {
                Registration::validate(name, &guard.url).phases(phases)
            };
            guards.push(guard);
            registration.timeout(Duration::from_secs(5))
        };
        if i.get("mode").and_then(Value::as_str) == Some("audit") {
            registration = registration.dry_run();
        }
        if i.get("failOpen").and_then(Value::as_bool) == Some(true) {
            registration = registration.failure_policy(FailurePolicy::FailOpen);
        }
        let events = i.get("events").and_then(Value::as_array);
        let registration =
            registration.interceptor_events(events.into_iter().flatten().filter_map(Value::as_str));
        registrar
            .register(registration)
            .await
            .map_err(|e| format!("registering {name}: {e}"))?;
    }
    Ok(guards)
}

// --- comparing -------------------------------------------------------------

/// RFC 8785 (JCS) canonical text of `value` with the volatile keys removed
/// at any depth: members sorted by name (UTF-16 code units; the fixtures'
/// names are ASCII), no white space.
fn canonical(value: &Value, volatile: &[String]) -> String {
    fn write(value: &Value, volatile: &[String], out: &mut String) {
        match value {
            Value::Object(members) => {
                let sorted: BTreeMap<Vec<u16>, (&String, &Value)> = members
                    .iter()
                    .filter(|(k, _)| !volatile.contains(k))
                    .map(|(k, v)| (k.encode_utf16().collect(), (k, v)))
                    .collect();
                out.push('{');
                for (i, (key, value)) in sorted.values().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String((*key).clone()).to_string());
                    out.push(':');
                    write(value, volatile, out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, volatile, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(value, volatile, &mut out);
    out
}

// --- the gateway -----------------------------------------------------------

/// `guardmesh mcp stdio` in front of `cat` (the extension's requests are
/// answered by the gateway, never forwarded), spoken to line by line.
struct Gateway {
    child: tokio::process::Child,
    input: tokio::process::ChildStdin,
    output: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    next: u64,
}

impl Gateway {
    fn start(mesh: &str, session: &str) -> Self {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args([
                "mcp",
                "stdio",
                "--mesh",
                mesh,
                "--session",
                session,
                "--",
                "cat",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start guardmesh mcp stdio");
        let input = child.stdin.take().expect("stdin");
        let output = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Self {
            child,
            input,
            output,
            next: 1,
        }
    }

    /// Sends one request; its response (bounded in time).
    async fn request(&mut self, method: &str, params: Value) -> Result<Value, String> {
        let id = self.next;
        self.next += 1;
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        self.input
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| format!("write to the gateway: {e}"))?;
        let read = tokio::time::timeout(Duration::from_secs(15), self.output.next_line())
            .await
            .map_err(|_| format!("no answer to {method} within 15 s"))?
            .map_err(|e| format!("read from the gateway: {e}"))?
            .ok_or_else(|| "the gateway closed its output".to_owned())?;
        let answer: Value =
            serde_json::from_str(&read).map_err(|e| format!("answer is not JSON ({e}): {read}"))?;
        if answer.get("id") != Some(&json!(id)) {
            return Err(format!("answer for another id: {read}"));
        }
        Ok(answer)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

// --- replaying -------------------------------------------------------------

/// What a session of a fixture remembers: the last call it let through
/// (call id, tool, server), to which a following response belongs.
#[derive(Default)]
struct Replay {
    turn: u32,
    last_allowed: HashMap<String, (String, String, String)>,
}

/// Replays one fixture; `Err` names the first step that failed.
async fn replay(fixture: &Value, name: &str) -> Result<(), String> {
    let volatile: Vec<String> = fixture["volatile"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let mesh = MeshProcess::start(name, "", None).await;
    let registrar = Registrar::connect(mesh.url.clone())
        .await
        .map_err(|e| e.to_string())?;
    let interceptors = fixture["interceptors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let _guards = register(&registrar, &interceptors).await?;
    let coordinator = Coordinator::connect(mesh.url.clone())
        .await
        .map_err(|e| e.to_string())?;
    let default_session = format!("conformance-{name}");
    let mut gateway: Option<Gateway> = None;
    let mut state = Replay::default();
    let steps = fixture["steps"].as_array().cloned().unwrap_or_default();
    for (index, step) in steps.iter().enumerate() {
        let at = |why: String| format!("step {index} ({}): {why}", step["op"]);
        let expect = &step["expect"];
        match step["op"].as_str() {
            Some("list") | Some("invoke") => {
                let gw = gateway.get_or_insert_with(|| Gateway::start(&mesh.url, &default_session));
                let answer = if step["op"] == "list" {
                    let params = match step["event"].as_str() {
                        Some(event) => json!({ "event": event }),
                        None => json!({}),
                    };
                    gw.request("interceptors/list", params).await
                } else {
                    gw.request("interceptor/invoke", step["params"].clone())
                        .await
                }
                .map_err(at)?;
                if let Some(code) = expect.get("errorCode") {
                    let got = answer.pointer("/error/code");
                    if got != Some(code) {
                        return Err(at(format!("expected error {code}, got {answer}")));
                    }
                } else {
                    let result = answer
                        .get("result")
                        .ok_or_else(|| at(format!("expected a result, got {answer}")))?;
                    let got = canonical(result, &volatile);
                    if Some(got.as_str()) != expect["canonical"].as_str() {
                        return Err(at(format!("expected {}, got {got}", expect["canonical"])));
                    }
                }
            }
            Some("apply") => {
                let session = step
                    .pointer("/context/sessionId")
                    .and_then(Value::as_str)
                    .map_or_else(|| default_session.clone(), str::to_owned);
                let (decision, payload) = apply(&coordinator, &mut state, &session, step)
                    .await
                    .map_err(at)?;
                if Some(decision) != expect["decision"].as_str() {
                    return Err(at(format!(
                        "expected {}, got {decision} (payload {payload})",
                        expect["decision"]
                    )));
                }
                let got = canonical(&payload, &volatile);
                if let Some(want) = expect["finalPayloadCanonical"].as_str()
                    && got != want
                {
                    return Err(at(format!("final payload: expected {want}, got {got}")));
                }
                for forbidden in expect["forbids"].as_array().into_iter().flatten() {
                    let forbidden = forbidden.as_str().unwrap_or_default();
                    if got.contains(forbidden) {
                        return Err(at(format!("final payload holds {forbidden:?}: {got}")));
                    }
                }
                for required in expect["requires"].as_array().into_iter().flatten() {
                    let required = required.as_str().unwrap_or_default();
                    if !got.contains(required) {
                        return Err(at(format!("final payload lacks {required:?}: {got}")));
                    }
                }
            }
            other => return Err(at(format!("unknown op {other:?}"))),
        }
    }
    Ok(())
}

/// One run of the chain: a request as a batch of one call, a response as
/// a batch of one result. The decision (`allow`/`deny`) and the payload
/// as the chain left it (`null` when denied).
async fn apply(
    coordinator: &Coordinator,
    state: &mut Replay,
    session: &str,
    step: &Value,
) -> Result<(&'static str, Value), String> {
    let payload = &step["payload"];
    state.turn += 1;
    let turn = state.turn;
    if step["phase"] == "request" {
        let tool = payload["name"]
            .as_str()
            .ok_or("a request payload without a tool name")?;
        let arguments = payload.get("arguments").cloned().unwrap_or(json!({}));
        let call_id = format!("call-{turn}");
        let server = server_of(tool);
        let batch = Batch::new(turn)
            .call(&call_id, tool, arguments.to_string())
            .meta("server", &server);
        let decision = coordinator
            .evaluate_once(session, batch)
            .await
            .map_err(|e| format!("the mesh refused the batch: {e}"))?;
        let call = decision.calls.first().ok_or("no decision")?;
        if call.outcome != Outcome::Proceed {
            return Ok(("deny", Value::Null));
        }
        let mut out = payload.clone();
        out["name"] = Value::String(call.final_call.tool.clone());
        out["arguments"] =
            serde_json::from_str(&call.final_call.arguments).map_err(|e| e.to_string())?;
        state.last_allowed.insert(
            session.to_owned(),
            (call_id, call.final_call.tool.clone(), server),
        );
        Ok(("allow", out))
    } else {
        let (call_id, tool, server) =
            state.last_allowed.get(session).cloned().unwrap_or_else(|| {
                let tool = payload["name"].as_str().unwrap_or("unknown").to_owned();
                (format!("call-{turn}"), tool, String::new())
            });
        let (result, wrapped) = wrap_result(payload);
        let batch = Batch::new(turn).result(&call_id, &tool, &server, result);
        let decision = coordinator
            .evaluate_once(session, batch)
            .await
            .map_err(|e| format!("the mesh refused the result: {e}"))?;
        let result = decision.results.first().ok_or("no result decision")?;
        if result.blocked() {
            return Ok(("deny", Value::Null));
        }
        let read: Value = serde_json::from_str(&result.result).map_err(|e| e.to_string())?;
        let out = if wrapped {
            read.get("structuredContent")
                .cloned()
                .unwrap_or(Value::Null)
        } else {
            read
        };
        Ok(("allow", out))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sep2624_every_interceptor_conformance_fixture_passes_through_the_mesh() {
    let Some(dir) = fixtures_dir() else {
        eprintln!("GUARDMESH_INTERCEPTORS_FIXTURES=skip: interceptor conformance skipped");
        return;
    };
    let manifest_path = dir.join("manifest.json");
    let manifest = std::fs::read_to_string(&manifest_path).unwrap_or_else(|e| {
        panic!(
            "the interceptor conformance fixtures are not at {} ({e}); set \
             GUARDMESH_INTERCEPTORS_FIXTURES to their folder, or to `skip`",
            dir.display()
        )
    });
    let manifest: Value = serde_json::from_str(&manifest).expect("manifest.json is JSON");
    let entries = manifest["fixtures"]
        .as_array()
        .expect("manifest lists fixtures");
    let started = Instant::now();
    let mut by_tag: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut failures = Vec::new();
    for (n, entry) in entries.iter().enumerate() {
        let id = entry["id"].as_str().unwrap_or_default();
        let tag = entry["requirement"].as_str().unwrap_or_default().to_owned();
        let file = dir.join(entry["file"].as_str().unwrap_or_default());
        let outcome = match std::fs::read_to_string(&file)
            .map_err(|e| format!("{}: {e}", file.display()))
            .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()))
        {
            Ok(fixture) => replay(&fixture, &format!("icf{n}")).await,
            Err(e) => Err(e),
        };
        let counts = by_tag.entry(tag).or_default();
        counts.1 += 1;
        match outcome {
            Ok(()) => counts.0 += 1,
            Err(why) => {
                eprintln!("FAIL {id}: {why}");
                failures.push(id.to_owned());
            }
        }
    }
    for (tag, (passed, total)) in &by_tag {
        println!("{tag}: {passed}/{total}");
    }
    let failed = failures.len();
    let passed = entries.len() - failed;
    println!(
        "{passed} passed, {failed} failed ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        (passed, failed),
        (24, 0),
        "interceptor conformance: failed {failures:?}"
    );
}

#[test]
fn sep2624_the_test_redactor_leaves_no_secret_of_the_fixture_formats() {
    let text =
        "a=AKIA5MZXN8QRF3WBY6OE b=ghp_Xa2bC3dEf4gH5iJk6Lm7nN8oP c=sk_live_4eC7aRm9Kx2bNw5pQj8sYd é";
    let out = redact_text(text);
    for secret in [
        "AKIA5MZXN8QRF3WBY6OE",
        "ghp_Xa2bC3dEf4gH5iJk6Lm7nN8oP",
        "sk_live_4eC7aRm9Kx2bNw5pQj8sYd",
    ] {
        assert!(!out.contains(secret), "{out}");
    }
    assert!(out.ends_with(" é"));
    // Too short, or an AKIA run of another length: not a secret.
    assert_eq!(
        redact_text("sk_live_short AKIA123"),
        "sk_live_short AKIA123"
    );
}

// --- the extension's surfaces, attacked ------------------------------------

async fn interceptor_client(
    url: &str,
) -> guardmesh_client::proto::interceptor_service_client::InterceptorServiceClient<
    tonic::transport::Channel,
> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .expect("mesh url")
        .connect()
        .await
        .expect("connect to the mesh");
    guardmesh_client::proto::interceptor_service_client::InterceptorServiceClient::new(channel)
}

fn invocation(
    name: &str,
    batch: Option<guardmesh_client::proto::EvaluateRequest>,
) -> guardmesh_client::proto::InterceptorInvokeRequest {
    guardmesh_client::proto::InterceptorInvokeRequest {
        name: name.to_owned(),
        batch,
    }
}

fn one_call(calls: usize, arguments: &str) -> guardmesh_client::proto::EvaluateRequest {
    guardmesh_client::proto::EvaluateRequest {
        batch_id: "invoke".into(),
        calls: (0..calls)
            .map(|i| guardmesh_client::proto::ToolCall {
                call_id: format!("c{i}"),
                tool: "echo".into(),
                arguments: arguments.into(),
            })
            .collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn sep2624_invoke_judges_one_call_or_result_of_a_named_guard_and_refuses_the_rest() {
    let mesh = MeshProcess::start("icf-invoke-attacks", "", None).await;
    let registrar = Registrar::connect(mesh.url.clone()).await.unwrap();
    registrar
        .register(Registration::policy("flows", CROSS_BOUNDARY_POLICY))
        .await
        .unwrap();
    let mut client = interceptor_client(&mesh.url).await;
    let code = |r: Result<_, tonic::Status>| r.map(|_: tonic::Response<_>| ()).unwrap_err();

    // No batch, two calls, no call: refused, naming what is wrong.
    let e = code(client.invoke(invocation("flows", None)).await);
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("batch"), "{e:?}");
    let e = code(
        client
            .invoke(invocation("flows", Some(one_call(2, "{}"))))
            .await,
    );
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("exactly one call or one result"),
        "{e:?}"
    );
    let e = code(
        client
            .invoke(invocation("flows", Some(one_call(0, "{}"))))
            .await,
    );
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // Unknown names, a huge one too: NOT_FOUND, the name not echoed whole.
    let e = code(
        client
            .invoke(invocation("nobody", Some(one_call(1, "{}"))))
            .await,
    );
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("nobody"), "{e:?}");
    let huge = "x".repeat(100_000);
    let e = code(
        client
            .invoke(invocation(&huge, Some(one_call(1, "{}"))))
            .await,
    );
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().len() < 512, "{} bytes", e.message().len());

    // Arguments a batch may not carry are refused as in a batch (R20).
    let e = code(
        client
            .invoke(invocation("flows", Some(one_call(1, r#"{"a":1,"a":2}"#))))
            .await,
    );
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // A policy guard judges calls: invoking it on a result is refused.
    let result = guardmesh_client::proto::EvaluateRequest {
        batch_id: "invoke".into(),
        results: vec![guardmesh_client::proto::ToolResult {
            call_id: "c".into(),
            tool: "echo".into(),
            server: String::new(),
            result: r#"{"content":[]}"#.into(),
        }],
        ..Default::default()
    };
    let e = code(client.invoke(invocation("flows", Some(result))).await);
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");

    // A list's event filter is bounded.
    let e = client
        .list(guardmesh_client::proto::InterceptorListRequest {
            event: "e".repeat(1000),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // The mesh still serves: a good invocation is judged.
    let ok = client
        .invoke(invocation("flows", Some(one_call(1, r#"{"note":"hi"}"#))))
        .await
        .unwrap()
        .into_inner();
    let decision = ok.decision.unwrap();
    assert_eq!(decision.decisions.len(), 1);
    assert_eq!(decision.trace.len(), 1, "the named guard alone");
}

#[tokio::test]
async fn sep2624_interceptor_events_outside_the_grammar_are_refused_at_registration() {
    let mesh = MeshProcess::start("icf-events", "", None).await;
    let registrar = Registrar::connect(mesh.url.clone()).await.unwrap();
    let with_events = |events: Vec<String>| {
        let mut spec = Registration::policy("g", CROSS_BOUNDARY_POLICY).build();
        spec.interceptor_events = events;
        spec
    };
    for (events, says) in [
        (vec!["tools/call\n".to_owned()], "outside ASCII letters"),
        (vec![String::new()], "1 to 128 bytes"),
        (vec!["e".repeat(129)], "1 to 128 bytes"),
        ((0..17).map(|i| format!("e{i}")).collect(), "more than 16"),
        (vec!["*".into(), "*".into()], "twice"),
        (vec!["t\u{2028}".into()], "outside ASCII letters"),
    ] {
        let error = registrar
            .register(with_events(events.clone()))
            .await
            .unwrap_err();
        let text = error.to_string();
        assert!(text.contains(says), "{events:?}: {text}");
    }
    assert!(registrar.list().await.unwrap().guards.is_empty());
    registrar
        .register(with_events(vec!["tools/call".into(), "*".into()]))
        .await
        .unwrap();
}

#[test]
fn sep2624_the_interceptor_service_needs_the_evaluate_role() {
    use guardmesh_server::security::auth::{Role, required_role};
    for method in ["List", "Invoke"] {
        assert_eq!(
            required_role(&format!("/guardmesh.v1.InterceptorService/{method}")),
            Some(Role::Evaluate)
        );
    }
}

#[tokio::test]
async fn sep2624_hostile_extension_requests_get_invalid_params_through_the_gateway() {
    let mesh = MeshProcess::start("icf-gateway-attacks", "", None).await;
    let registrar = Registrar::connect(mesh.url.clone()).await.unwrap();
    registrar
        .register(Registration::policy("flows", CROSS_BOUNDARY_POLICY))
        .await
        .unwrap();
    let mut gateway = Gateway::start(&mesh.url, "hostile");
    for (method, params, says) in [
        ("interceptor/invoke", json!([1]), "params must be an object"),
        (
            "interceptor/invoke",
            json!({"name": "flows", "phase": "request", "payload": {"name": "t", "arguments": []}}),
            "arguments must be an object",
        ),
        (
            "interceptor/invoke",
            json!({"name": "nobody", "phase": "request", "payload": {"name": "t"}}),
            "unknown interceptor",
        ),
        (
            "interceptor/invoke",
            json!({"name": "n".repeat(5000), "phase": "request", "payload": {"name": "t"}}),
            "1 to 128 bytes",
        ),
        (
            "interceptor/invoke",
            json!({"name": "flows", "phase": "response", "payload": {"content": []}}),
            "does not judge results",
        ),
        (
            "interceptor/invoke",
            json!({"name": "flows", "phase": "request", "payload": {"name": "bad name\n"}}),
            "tool",
        ),
        (
            "interceptors/list",
            json!({"event": "e".repeat(500)}),
            "params.event",
        ),
        ("interceptors/list", json!("x"), "must be an object"),
    ] {
        let answer = gateway.request(method, params.clone()).await.unwrap();
        assert_eq!(
            answer.pointer("/error/code"),
            Some(&json!(-32602)),
            "{params}: {answer}"
        );
        let message = answer
            .pointer("/error/message")
            .and_then(Value::as_str)
            .unwrap_or_default();
        assert!(message.contains(says), "{params}: {answer}");
        assert!(message.len() < 1024, "{params}: {} bytes", message.len());
    }
    // Still serving.
    let listed = gateway
        .request("interceptors/list", json!({}))
        .await
        .unwrap();
    assert_eq!(
        listed.pointer("/result/interceptors/0/name"),
        Some(&json!("flows")),
        "{listed}"
    );
}

#[tokio::test]
async fn sep2624_the_runner_fails_a_fixture_the_mesh_does_not_meet() {
    let Some(dir) = fixtures_dir() else {
        return;
    };
    let read = |file: &str| -> Value {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("fixtures not at {} ({e})", path.display()));
        serde_json::from_str(&text).unwrap()
    };
    // The relaybleed flow expected to pass: the mesh denies it, so the
    // runner must report the step.
    let mut flow = read("fixtures/behavior/relaybleed-aws_access_key.json");
    flow["steps"][2]["expect"]["decision"] = json!("allow");
    let why = replay(&flow, "icf-neg-flow").await.unwrap_err();
    assert!(why.contains("step 2"), "{why}");
    // An audit validator made active: it blocks.
    let mut audit = read("fixtures/protocol/chain-audit-never-blocks.json");
    audit["interceptors"][0]
        .as_object_mut()
        .unwrap()
        .remove("mode");
    assert!(replay(&audit, "icf-neg-audit").await.is_err());
    // A listing expected in another order.
    let mut list = read("fixtures/protocol/list-all.json");
    list["interceptors"].as_array_mut().unwrap().reverse();
    assert!(replay(&list, "icf-neg-list").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sep2624_the_http_gateway_answers_the_extension_itself() {
    use super::mcp::{Scratch, http_gateway, post};
    let mesh = MeshProcess::start("icf-http", "", None).await;
    let registrar = Registrar::connect(mesh.url.clone()).await.unwrap();
    let guard = behaviour_guard("uppercase-note".into()).await;
    let spec = Registration::mutate("upper", &guard.url, ["*"])
        .phases(GuardPhases::Both)
        .result_grant(["*"])
        .interceptor_events(["*"]);
    registrar.register(spec).await.unwrap();
    let scratch = Scratch::new("icf-http");
    let (url, _upstream, _gateway) = http_gateway(&mesh.url, &scratch).await;
    let ask = |id: u32, method: &str, params: Value| {
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string()
    };
    let (status, _, body) = post(
        &url,
        None,
        &ask(1, "interceptors/list", json!({"event": "prompts/get"})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let listed: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        listed["result"]["interceptors"][0]["hooks"][1],
        json!({"events": ["*"], "phase": "response"}),
        "{body}"
    );
    let payload = json!({"name": "echo", "arguments": {"note": "quiet"}});
    let (_, _, body) = post(
        &url,
        None,
        &ask(
            2,
            "interceptor/invoke",
            json!({"name": "upper", "phase": "response", "payload": payload}),
        ),
    )
    .await;
    let invoked: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(invoked["result"]["modified"], json!(true), "{body}");
    assert_eq!(
        invoked["result"]["payload"]["arguments"]["note"],
        json!("QUIET"),
        "{body}"
    );
    let (_, _, body) = post(
        &url,
        None,
        &ask(
            3,
            "interceptor/invoke",
            json!({"name": 1, "phase": "request", "payload": {}}),
        ),
    )
    .await;
    let refused: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(refused["error"]["code"], json!(-32602), "{body}");
    assert!(
        scratch.executed().is_empty(),
        "nothing reached the upstream's tools"
    );
}
