//! A guard's ask (R35) through the MCP gateway (R31): put to the MCP
//! client's user through elicitation when the client declares it and the
//! gateway has approver credentials (`--approver-token-file`), else
//! answered as "approval needed". A real mesh with token principals (the
//! gateway's `evaluate` token, its `approver` token), a scripted guard that
//! asks about payments over 100, `guardmesh mcp stdio`, the official Python
//! MCP SDK as client (tests/mcp-sdk/client.py) and as upstream, whose log
//! says what ran; and raw JSON-RPC clients that answer the elicitation
//! badly, late, twice, or never.

use crate::harness::*;
use crate::mcp::{
    Scratch, calls, http_gateway_with, mcp_python, run_client_off_thread, via_gateway,
};
use guardmesh_client::proto::ApprovalState;
use guardmesh_client::verdict::ask;
use guardmesh_client::{Approver, Registration};
use serde_json::{Value, json};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const REASON: &str = "payments over 100 need a person";

/// A TLS mesh with token principals: the gateway (`evaluate`), its
/// approver (`approver`), a person with the approver role, and an operator
/// who registers; approval requests live `ttl`. The guard `payments` asks
/// about `pay` over 100 and lets everything else through.
struct Setup {
    pki: TestPki,
    mesh: TestMesh,
    url: String,
    _guards: Vec<TestGuard>,
}

impl Setup {
    async fn start(ttl: Duration) -> Self {
        Self::start_with(ttl, false).await
    }

    /// [`Setup::start`]; with `treasury`, a second guard, `treasury`, asks
    /// about `pay` over 1,000 as well.
    async fn start_with(ttl: Duration, treasury: bool) -> Self {
        let pki = TestPki::new();
        let principals: [(&str, &str, &[&str]); 4] = [
            ("gateway", "gateway-token", &["evaluate"]),
            ("gateway-approver", "gateway-approver-token", &["approver"]),
            ("person", "person-token", &["approver"]),
            ("ops", "ops-token", &["register"]),
        ];
        let (mesh, url) = TestMesh::with_tokens_and(&pki, &principals, "", |config| {
            config.approvals.ttl = ttl;
            config.approvals.max_open_per_session = 64;
        })
        .await;
        let guard = call_guard(Duration::ZERO, |call| {
            let args: Value = serde_json::from_str(&call.arguments).ok()?;
            (call.tool == "pay" && args["amount"].as_f64().unwrap_or(0.0) > 100.0)
                .then(|| ask(&call.call_id, REASON))
        })
        .await;
        let registrar = pki.registrar(&url, "ops-token").await;
        registrar
            .register(Registration::validate("payments", &guard.url))
            .await
            .unwrap();
        let mut guards = vec![guard];
        if treasury {
            let second = call_guard(Duration::ZERO, |call| {
                let args: Value = serde_json::from_str(&call.arguments).ok()?;
                (call.tool == "pay" && args["amount"].as_f64().unwrap_or(0.0) > 1000.0)
                    .then(|| ask(&call.call_id, "the treasury signs off large payments"))
            })
            .await;
            registrar
                .register(Registration::validate("treasury", &second.url))
                .await
                .unwrap();
            guards.push(second);
        }
        Self {
            pki,
            mesh,
            url,
            _guards: guards,
        }
    }

    /// The gateway's flags: its mesh over TLS with its own token, and
    /// (`approver`) its approver token; then `extra`.
    fn gateway_args(&self, approver: bool, extra: &[&str]) -> Vec<String> {
        let mut args = vec![
            "--ca-file".to_owned(),
            self.pki.ca_file().display().to_string(),
            "--token-file".to_owned(),
            self.pki.dir.join("gateway.token").display().to_string(),
        ];
        if approver {
            args.push("--approver-token-file".into());
            args.push(
                self.pki
                    .dir
                    .join("gateway-approver.token")
                    .display()
                    .to_string(),
            );
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// `stdio guardmesh mcp stdio --mesh URL ... -- upstream.py LOG stdio`.
    fn target(&self, scratch: &Scratch, approver: bool, extra: &[&str]) -> Vec<String> {
        let args = self.gateway_args(approver, extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        via_gateway(&self.url, &args, scratch.upstream(&["stdio"]))
    }

    /// The approval requests of every session in `state`, as the person
    /// with the approver role lists them.
    async fn requests(
        &self,
        state: ApprovalState,
    ) -> Vec<guardmesh_client::proto::ApprovalRequest> {
        Approver::connect_with(&self.url, &self.pki.connection(None, Some("person-token")))
            .await
            .unwrap()
            .list(state, "", 0)
            .await
            .unwrap()
    }
}

fn elicited(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["op"] == "elicited").collect()
}

fn text_of(result: &Value) -> String {
    result["text"][0].as_str().unwrap_or_default().to_owned()
}

/// R35, R31: the client's user accepts: the gateway approves with its
/// approver token and the same call runs once, upstream; the elicitation
/// named the guard, its reason, the tool and the arguments, with an empty
/// form; the request is used, answered by the gateway's approver with the
/// elicitation note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_r31_accepted_through_elicitation_the_call_runs_once() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-accept");
    let scenario = json!({"mode": "legacy", "elicit": ["accept"], "steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "bob"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "carol"}},
    ]});
    let lines = run_client_off_thread(scenario, setup.target(&scratch, true, &[])).await;
    let asks = elicited(&lines);
    assert_eq!(asks.len(), 1, "{lines:?}");
    let message = asks[0]["message"].as_str().unwrap();
    for part in ["payments", REASON, "pay", "500", "bob"] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    assert_eq!(
        asks[0]["schema"],
        json!({"type": "object", "properties": {}})
    );
    let results = calls(&lines);
    assert_eq!(results.len(), 2, "{lines:?}");
    assert_eq!(results[0]["isError"], false, "{lines:?}");
    assert!(text_of(results[0]).contains("paid 500"), "{lines:?}");
    assert!(text_of(results[1]).contains("paid 5"), "{lines:?}");
    assert_eq!(
        scratch.executed(),
        [
            json!({"tool": "pay", "arguments": {"amount": 500.0, "to": "bob"}}),
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "carol"}}),
        ]
    );
    let used = setup.requests(ApprovalState::Used).await;
    assert_eq!(used.len(), 1, "{used:?}");
    assert_eq!(used[0].answered_by, "gateway-approver");
    assert_eq!(used[0].asked_by, "gateway");
    assert_eq!(
        used[0].note,
        "approved by the MCP client's user through elicitation"
    );
    setup.mesh.shutdown().await;
}

/// R35: two guards ask about one call: the user is asked once per guard,
/// and the call runs once with both approvals, each used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_r31_two_guards_ask_each_is_put_to_the_user_and_the_call_runs_once() {
    mcp_python();
    let setup = Setup::start_with(Duration::from_secs(600), true).await;
    let scratch = Scratch::new("approvals-two");
    let scenario = json!({"mode": "legacy", "elicit": ["accept", "accept"], "steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 5000, "to": "bob"}},
    ]});
    let lines = run_client_off_thread(scenario, setup.target(&scratch, true, &[])).await;
    let asks = elicited(&lines);
    assert_eq!(asks.len(), 2, "{lines:?}");
    let mut guards: Vec<&str> = asks
        .iter()
        .map(|a| {
            let m = a["message"].as_str().unwrap();
            if m.contains("Guard: treasury") {
                "treasury"
            } else {
                "payments"
            }
        })
        .collect();
    guards.sort();
    assert_eq!(guards, ["payments", "treasury"], "{lines:?}");
    let results = calls(&lines);
    assert!(text_of(results[0]).contains("paid 5000"), "{lines:?}");
    assert_eq!(scratch.executed().len(), 1);
    assert_eq!(setup.requests(ApprovalState::Used).await.len(), 2);
    setup.mesh.shutdown().await;
}

/// R35, R31: without elicitation, the request is approved out of band
/// (`guardmesh approvals approve ID`, here the SDK's Approver): the same
/// call made again in the session runs once, the gateway naming the
/// request it was asked under; made a third time, it is asked about anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_r31_approved_out_of_band_the_same_call_made_again_runs_once() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-oob");
    let approved = scratch.dir.join("approved");
    let call = json!({"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "bob"}});
    let scenario = json!({"mode": "legacy", "steps": [
        call.clone(),
        {"op": "wait", "path": approved.display().to_string()},
        call.clone(),
        call.clone(),
    ]});
    let client = tokio::spawn(run_client_off_thread(
        scenario,
        setup.target(&scratch, false, &[]),
    ));
    let mut pending = Vec::new();
    for _ in 0..200 {
        pending = setup.requests(ApprovalState::Pending).await;
        if !pending.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pending.len(), 1, "{pending:?}");
    let first = pending[0].id.clone();
    Approver::connect_with(
        &setup.url,
        &setup.pki.connection(None, Some("person-token")),
    )
    .await
    .unwrap()
    .approve(&first, "checked")
    .await
    .unwrap();
    std::fs::write(&approved, "").unwrap();
    let lines = client.await.unwrap();
    let results = calls(&lines);
    assert_eq!(results.len(), 3, "{lines:?}");
    assert!(text_of(results[0]).contains(&first), "{lines:?}");
    assert!(text_of(results[1]).contains("paid 500"), "{lines:?}");
    let third = text_of(results[2]);
    assert!(
        third.contains("approval needed") && !third.contains(&first),
        "{third}"
    );
    assert_eq!(scratch.executed().len(), 1, "{:?}", scratch.executed());
    let used = setup.requests(ApprovalState::Used).await;
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].id, first);
    setup.mesh.shutdown().await;
}

/// R35, R31: the user declines (or dismisses): the request is denied with a
/// note saying so, the call is answered as a cancel (not an error) saying
/// the person declined, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_r31_declined_or_dismissed_through_elicitation_nothing_runs() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-decline");
    let scenario = json!({"mode": "legacy", "elicit": ["decline", "cancel"], "steps": [
        {"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "bob"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 600, "to": "bob"}},
    ]});
    let lines = run_client_off_thread(scenario, setup.target(&scratch, true, &[])).await;
    assert_eq!(elicited(&lines).len(), 2, "{lines:?}");
    let results = calls(&lines);
    assert_eq!(results.len(), 2, "{lines:?}");
    for (result, how) in results.iter().zip(["declined", "dismissed"]) {
        assert_eq!(result["isError"], false, "{lines:?}");
        let text = text_of(result);
        assert!(text.contains(how) && text.contains("not run"), "{text}");
    }
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
    let denied = setup.requests(ApprovalState::Denied).await;
    assert_eq!(denied.len(), 2, "{denied:?}");
    let mut notes: Vec<&str> = denied.iter().map(|r| r.note.as_str()).collect();
    notes.sort();
    assert!(
        notes[0].starts_with("declined by the MCP client's user"),
        "{notes:?}"
    );
    assert!(notes[1].starts_with("dismissed (cancelled)"), "{notes:?}");
    setup.mesh.shutdown().await;
}

/// R35, R31: a client without the elicitation capability, or a gateway
/// without approver credentials: no elicitation; the call is answered with
/// a tool result saying an approval is needed, naming the request and
/// `guardmesh approvals approve ID`; nothing runs, the request waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_r31_without_elicitation_or_approver_the_answer_names_the_request() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-none");
    let call = json!({"op": "call", "name": "pay", "arguments": {"amount": 500, "to": "bob"}});
    for (scenario, approver) in [
        (json!({"mode": "legacy", "steps": [call.clone()]}), true),
        (
            json!({"mode": "legacy", "elicit": ["accept"], "steps": [call.clone()]}),
            false,
        ),
    ] {
        let lines = run_client_off_thread(scenario, setup.target(&scratch, approver, &[])).await;
        assert!(elicited(&lines).is_empty(), "{lines:?}");
        let results = calls(&lines);
        assert_eq!(results.len(), 1, "{lines:?}");
        assert_eq!(results[0]["isError"], false, "{lines:?}");
        let text = text_of(results[0]);
        assert!(text.contains("payments"), "{text}");
        assert!(
            !text.contains(REASON),
            "the reason is the approver's: {text}"
        );
        assert!(text.contains("approval needed"), "{text}");
        let pending = setup.requests(ApprovalState::Pending).await;
        assert!(
            pending
                .iter()
                .any(|r| text.contains(&format!("guardmesh approvals approve {}", r.id))),
            "{text} names a pending request: {pending:?}"
        );
    }
    assert!(scratch.executed().is_empty());
    setup.mesh.shutdown().await;
}

/// R35, R31 over Streamable HTTP: the elicitation goes out on the SSE
/// stream answering the call's POST, the client POSTs its answer, and the
/// same stream carries the call's answer: accepted, the call runs once;
/// declined, nothing runs; a client without elicitation gets the
/// approval-needed answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_r31_elicitation_over_streamable_http() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-http");
    let args = setup.gateway_args(true, &[]);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    let (url, _upstream, _gateway) =
        http_gateway_with(&setup.url, &scratch, "127.0.0.1", &args).await;
    let target = vec!["http".to_owned(), url];
    let pay = |amount: i64| json!({"op": "call", "name": "pay", "arguments": {"amount": amount, "to": "bob"}});
    let lines = run_client_off_thread(
        json!({"mode": "legacy", "elicit": ["accept", "decline"], "steps": [pay(500), pay(600), pay(5)]}),
        target.clone(),
    )
    .await;
    let asks = elicited(&lines);
    assert_eq!(asks.len(), 2, "{lines:?}");
    assert!(asks[0]["message"].as_str().unwrap().contains("500"));
    let results = calls(&lines);
    assert_eq!(results.len(), 3, "{lines:?}");
    assert!(text_of(results[0]).contains("paid 500"), "{lines:?}");
    assert!(text_of(results[1]).contains("declined"), "{lines:?}");
    assert!(text_of(results[2]).contains("paid 5"), "{lines:?}");
    let lines = run_client_off_thread(json!({"mode": "legacy", "steps": [pay(700)]}), target).await;
    assert!(elicited(&lines).is_empty(), "{lines:?}");
    assert!(
        text_of(calls(&lines)[0]).contains("approval needed"),
        "{lines:?}"
    );
    assert_eq!(
        scratch.executed(),
        [
            json!({"tool": "pay", "arguments": {"amount": 500.0, "to": "bob"}}),
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}}),
        ]
    );
    assert_eq!(setup.requests(ApprovalState::Used).await.len(), 1);
    assert_eq!(setup.requests(ApprovalState::Denied).await.len(), 1);
    setup.mesh.shutdown().await;
}

// ---------------------------------------------------------------------------
// Raw JSON-RPC clients: elicitation answers that must not run anything.
// ---------------------------------------------------------------------------

/// `guardmesh mcp stdio` driven line by line by a client that declares
/// elicitation; its output read on a thread, so that waits are bounded.
struct Raw {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: mpsc::Receiver<Value>,
}

impl Raw {
    fn start(setup: &Setup, scratch: &Scratch, extra: &[&str]) -> Self {
        let mut target = setup.target(scratch, true, extra);
        target.remove(0); // "stdio"
        let mut child = Command::new(target.remove(0))
            .args(target)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(serde_json::from_str(&line).unwrap()).is_err() {
                    break;
                }
            }
        });
        let mut raw = Self {
            child,
            stdin: Some(stdin),
            lines,
        };
        raw.send(
            &json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {"elicitation": {}},
            "clientInfo": {"name": "raw", "version": "0"}}}),
        );
        assert_eq!(raw.recv()["id"], "init");
        raw.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        raw
    }

    fn send(&mut self, message: &Value) {
        self.send_line(&message.to_string());
    }

    fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// The client leaves (stdin closed): the gateway's exit, if within
    /// `bound`, and what it wrote before.
    fn leave(&mut self, bound: Duration) -> (Option<std::process::ExitStatus>, Vec<Value>) {
        drop(self.stdin.take());
        let start = std::time::Instant::now();
        while start.elapsed() < bound {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (Some(status), self.lines.try_iter().collect());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        (None, self.lines.try_iter().collect())
    }

    /// The next message within 20 s.
    fn recv(&mut self) -> Value {
        self.lines
            .recv_timeout(Duration::from_secs(20))
            .expect("a message from the gateway within 20 s")
    }

    /// The next message within `wait`, if any.
    fn try_recv(&mut self, wait: Duration) -> Option<Value> {
        self.lines.recv_timeout(wait).ok()
    }

    fn call(&mut self, id: i64, amount: i64) {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "pay", "arguments": {"amount": amount, "to": "bob"}}}));
    }

    /// The next message, which must be an elicitation: its id and message.
    fn elicitation(&mut self) -> (String, String) {
        let m = self.recv();
        assert_eq!(m["method"], "elicitation/create", "{m}");
        (
            m["id"].as_str().unwrap().to_owned(),
            m["params"]["message"].as_str().unwrap().to_owned(),
        )
    }

    fn answer(&mut self, id: &str, result: Value) {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "result": result}));
    }

    /// The gateway still serves: a ping is answered.
    fn still_serves(&mut self, id: &str) {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
        let pong = self.recv();
        assert_eq!(pong["id"], id, "{pong}");
        assert!(pong.get("result").is_some(), "{pong}");
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The text of a tool result answering request `id`.
fn result_text(m: &Value, id: i64) -> String {
    assert_eq!(m["id"], id, "{m}");
    assert_eq!(m["result"]["isError"], false, "{m}");
    m["result"]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// R35 attacks: garbage lines, answers with made-up or foreign ids, an
/// answer the gateway cannot read, then a second (accepting) answer: the
/// call never runs, the gateway keeps serving, and nothing of the answers
/// reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_garbage_wrong_ids_and_second_answers_never_run_the_call() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-garbage");
    let mut raw = Raw::start(&setup, &scratch, &[]);
    raw.call(1, 500);
    let (id, _) = raw.elicitation();
    assert!(
        id.starts_with("guardmesh-approval-") && id.len() > 40,
        "{id}"
    );
    // Not JSON: a parse error, and the ask still waits.
    raw.send_line("{not json at all");
    let refused = raw.recv();
    assert!(refused.get("error").is_some(), "{refused}");
    // An id of the gateway's form that it never sent, a numeric id, the
    // id in another type: none answers the elicitation.
    raw.answer(
        &format!("guardmesh-approval-{:032x}", 7),
        json!({"action": "accept"}),
    );
    raw.send(&json!({"jsonrpc": "2.0", "id": 7, "result": {"action": "accept"}}));
    raw.send(&json!({"jsonrpc": "2.0", "id": [id.clone()], "result": {"action": "accept"}}));
    let _ = raw.try_recv(Duration::from_millis(200));
    raw.still_serves("p1");
    assert!(scratch.executed().is_empty());
    // The real id with an action that is none of accept/decline/cancel.
    raw.answer(&id, json!({"action": "Accept", "content": {}}));
    let text = result_text(&raw.recv(), 1);
    assert!(
        text.contains("not approved") && text.contains("not run"),
        "{text}"
    );
    // A second answer, accepting: dropped.
    raw.answer(&id, json!({"action": "accept"}));
    raw.still_serves("p2");
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
    assert!(
        setup.requests(ApprovalState::Approved).await.is_empty()
            && setup.requests(ApprovalState::Used).await.is_empty(),
        "nothing was approved"
    );
    setup.mesh.shutdown().await;
}

/// R35 attack: a client that never answers: past the bound the elicitation
/// is cancelled at the client and the call answered as not approved; other
/// requests are served meanwhile; an accept after that is dropped and the
/// call never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_an_elicitation_never_answered_is_not_approved_and_blocks_nothing() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-hang");
    let mut raw = Raw::start(&setup, &scratch, &["--elicitation-timeout-ms", "1500"]);
    raw.call(1, 500);
    let (id, _) = raw.elicitation();
    // Meanwhile: a ping and a call that needs no approval.
    raw.still_serves("p1");
    raw.call(2, 5);
    let paid = raw.recv();
    assert!(result_text(&paid, 2).contains("paid 5"), "{paid}");
    let mut got = vec![raw.recv(), raw.recv()];
    got.sort_by_key(|m| m.get("method").is_none());
    assert_eq!(got[0]["method"], "notifications/cancelled", "{got:?}");
    assert_eq!(got[0]["params"]["requestId"], id.as_str());
    let text = result_text(&got[1], 1);
    assert!(text.contains("nobody answered"), "{text}");
    raw.answer(&id, json!({"action": "accept"}));
    raw.still_serves("p2");
    assert_eq!(
        scratch.executed(),
        [json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}})]
    );
    setup.mesh.shutdown().await;
}

/// R35: a client that leaves while its user is asked: the ask ends
/// unanswered at once (not at the bound), the call is not run, and the
/// gateway exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_a_client_that_leaves_while_asked_runs_nothing_and_the_gateway_exits() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-leave");
    let mut raw = Raw::start(&setup, &scratch, &[]);
    raw.call(1, 500);
    let _ = raw.elicitation();
    let (status, _) = raw.leave(Duration::from_secs(15));
    assert!(
        status.is_some(),
        "the gateway exits within 15 s, not at the 300 s bound"
    );
    assert!(scratch.executed().is_empty());
    setup.mesh.shutdown().await;
}

/// R35: the client cancels a call while its user is asked about it: the
/// elicitation is cancelled at the client at once, the call is not run,
/// and a later accept of it is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_a_call_cancelled_while_asked_ends_its_elicitation() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-cancelled");
    let mut raw = Raw::start(&setup, &scratch, &[]);
    raw.call(1, 500);
    let (id, _) = raw.elicitation();
    raw.send(
        &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": 1, "reason": "the user gave up"}}),
    );
    let cancelled = raw.recv();
    assert_eq!(
        cancelled["method"], "notifications/cancelled",
        "{cancelled}"
    );
    assert_eq!(cancelled["params"]["requestId"], id.as_str());
    let text = result_text(&raw.recv(), 1);
    assert!(
        text.contains("cancelled") && text.contains("not run"),
        "{text}"
    );
    raw.answer(&id, json!({"action": "accept"}));
    raw.still_serves("p1");
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
    assert!(setup.requests(ApprovalState::Approved).await.is_empty());
    setup.mesh.shutdown().await;
}

/// R35 attack: an accept that arrives after the approval request expired
/// does not run the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_an_accept_after_the_request_expired_runs_nothing() {
    mcp_python();
    let setup = Setup::start(Duration::from_millis(1500)).await;
    let scratch = Scratch::new("approvals-expired");
    let mut raw = Raw::start(&setup, &scratch, &[]);
    raw.call(1, 500);
    let (id, _) = raw.elicitation();
    std::thread::sleep(Duration::from_millis(2500));
    raw.answer(&id, json!({"action": "accept"}));
    let mut answer = raw.recv();
    if answer.get("method").is_some() {
        answer = raw.recv();
    }
    let text = result_text(&answer, 1);
    assert!(text.contains("not run"), "{text}");
    raw.still_serves("p1");
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
    assert!(setup.requests(ApprovalState::Used).await.is_empty());
    setup.mesh.shutdown().await;
}

/// R35 attack: two calls asked about at once; the user accepts one (its
/// answer's content naming the other) and declines the other: only the
/// accepted call runs, once, even when the accept is sent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_an_accept_approves_only_the_call_it_was_asked_about() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-other");
    let mut raw = Raw::start(&setup, &scratch, &[]);
    raw.call(1, 500);
    raw.call(2, 700);
    let asks = [raw.elicitation(), raw.elicitation()];
    let (small, large) = if asks[0].1.contains("500") {
        (&asks[0].0, &asks[1].0)
    } else {
        (&asks[1].0, &asks[0].0)
    };
    assert_ne!(small, large);
    raw.answer(
        small,
        json!({"action": "accept", "content": {"approve": large}}),
    );
    raw.answer(small, json!({"action": "accept"}));
    let text = result_text(&raw.recv(), 1);
    assert!(text.contains("paid 500"), "{text}");
    raw.answer(large, json!({"action": "decline"}));
    let text = result_text(&raw.recv(), 2);
    assert!(text.contains("declined"), "{text}");
    raw.still_serves("p1");
    assert_eq!(
        scratch.executed(),
        [json!({"tool": "pay", "arguments": {"amount": 500.0, "to": "bob"}})]
    );
    setup.mesh.shutdown().await;
}

// ---------------------------------------------------------------------------
// Raw Streamable HTTP: answers from another session, none, or twice.
// ---------------------------------------------------------------------------

/// A POST of `body` to the gateway at `url` (`http://HOST:PORT/mcp`) with
/// `headers`, its answer read as it streams: (status, head, the rest).
async fn post_streaming(
    url: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, String, tokio::io::BufReader<tokio::net::TcpStream>) {
    use tokio::io::AsyncBufReadExt;
    let stream = mcp_post_sent(url, "2025-11-25", headers, &body.to_string()).await;
    let mut reader = tokio::io::BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).await.unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        head.push_str(&line);
    }
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head, reader)
}

/// The next SSE event's data of a chunked answer, within 20 s.
async fn next_event(reader: &mut tokio::io::BufReader<tokio::net::TcpStream>) -> Value {
    use tokio::io::AsyncBufReadExt;
    let read = async {
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.unwrap() == 0 {
                panic!("the stream ended");
            }
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return serde_json::from_str::<Value>(data).unwrap();
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("an event within 20 s")
}

/// Opens a session (`initialize`, with `capabilities`); its id.
async fn open_session(url: &str, capabilities: Value) -> String {
    let (status, head, _) = post_streaming(
        url,
        &[],
        &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": capabilities,
            "clientInfo": {"name": "raw", "version": "0"}}}),
    )
    .await;
    assert_eq!(status, 200, "{head}");
    let session = header_value(&head, "mcp-session-id").expect("a session id");
    let (status, head, _) = post_streaming(
        url,
        &[("Mcp-Session-Id", &session)],
        &json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await;
    assert_eq!(status, 202, "{head}");
    session
}

/// R35 attack over HTTP: an accept POSTed in another session (or in none)
/// for this session's elicitation approves nothing; an answer the gateway
/// cannot read ends the ask as not approved; a second answer is dropped;
/// the call never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_over_http_an_answer_from_another_session_approves_nothing() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-http-raw");
    let args = setup.gateway_args(true, &[]);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    let (url, _upstream, _gateway) =
        http_gateway_with(&setup.url, &scratch, "127.0.0.1", &args).await;
    let mine = open_session(&url, json!({"elicitation": {}})).await;
    let other = open_session(&url, json!({"elicitation": {}})).await;
    let (status, head, mut call) = post_streaming(
        &url,
        &[("Mcp-Session-Id", &mine)],
        &json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "pay", "arguments": {"amount": 500, "to": "bob"}}}),
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("text/event-stream"), "{head}");
    let elicitation = next_event(&mut call).await;
    assert_eq!(elicitation["method"], "elicitation/create", "{elicitation}");
    let id = elicitation["id"].as_str().unwrap().to_owned();
    let accept = json!({"jsonrpc": "2.0", "id": id, "result": {"action": "accept"}});
    for session in [Some(other.as_str()), None] {
        let headers: Vec<(&str, &str)> =
            session.map(|s| ("Mcp-Session-Id", s)).into_iter().collect();
        let (status, head, _) = post_streaming(&url, &headers, &accept).await;
        // Another session's: dropped by the gateway (202); no session: the
        // upstream's refusal.
        assert!(status == 202 || session.is_none(), "{head}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(setup.requests(ApprovalState::Approved).await.is_empty());
    assert!(setup.requests(ApprovalState::Used).await.is_empty());
    // The session's own answer, unreadable: not approved.
    let (status, head, _) = post_streaming(
        &url,
        &[("Mcp-Session-Id", &mine)],
        &json!({"jsonrpc": "2.0", "id": id, "result": {"action": "yes"}}),
    )
    .await;
    assert_eq!(status, 202, "{head}");
    let answer = next_event(&mut call).await;
    assert_eq!(answer["id"], 1, "{answer}");
    let text = answer["result"]["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("not approved"), "{text}");
    // A second answer, accepting: dropped.
    let (status, head, _) = post_streaming(&url, &[("Mcp-Session-Id", &mine)], &accept).await;
    assert_eq!(status, 202, "{head}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(scratch.executed().is_empty(), "{:?}", scratch.executed());
    assert!(setup.requests(ApprovalState::Used).await.is_empty());
    setup.mesh.shutdown().await;
}

/// R35 bound over HTTP: a client that drops the stream of each call it is
/// asked about, more times than a session may have asks waiting: each ask
/// ends with its stream, none runs, and the session's next call is still
/// put to its user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_over_http_asks_whose_streams_are_dropped_end_with_them() {
    mcp_python();
    let setup = Setup::start(Duration::from_secs(600)).await;
    let scratch = Scratch::new("approvals-http-drop");
    let args = setup.gateway_args(true, &[]);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    let (url, _upstream, _gateway) =
        http_gateway_with(&setup.url, &scratch, "127.0.0.1", &args).await;
    let session = open_session(&url, json!({"elicitation": {}})).await;
    let call = |id: i64| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
               "params": {"name": "pay", "arguments": {"amount": 200 + id, "to": "bob"}}})
    };
    for id in 0..20 {
        let (status, head, mut stream) =
            post_streaming(&url, &[("Mcp-Session-Id", &session)], &call(id)).await;
        assert_eq!(status, 200, "{head}");
        assert!(head.contains("text/event-stream"), "ask {id}: {head}");
        let event = next_event(&mut stream).await;
        assert_eq!(event["method"], "elicitation/create", "ask {id}: {event}");
        drop(stream);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(scratch.executed().is_empty());
    setup.mesh.shutdown().await;
}

/// R35: approver credentials the gateway cannot read stop it at start,
/// naming the flag, for both transports (never a gateway that would fail
/// at the first accept).
#[test]
fn r35_an_unreadable_approver_token_file_stops_the_gateway_at_start() {
    for transport in [
        &["stdio"][..],
        &[
            "http",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9/mcp",
        ][..],
    ] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
        command.arg("mcp").args(transport).args([
            "--mesh",
            "http://127.0.0.1:9",
            "--approver-token-file",
            "/nonexistent/approver.token",
        ]);
        if transport[0] == "stdio" {
            command.args(["--", "true"]);
        }
        let output = command.stdin(Stdio::null()).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{transport:?}: {stderr}");
        assert!(
            stderr.contains("--approver-token-file"),
            "{transport:?}: {stderr}"
        );
    }
}
