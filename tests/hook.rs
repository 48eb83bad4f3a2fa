//! The pre-tool hook against hung meshes, rewrites and hosts (R31b), end
//! to end: a real `guardmesh serve` process (or a socket that accepts and
//! never answers), a scripted guard, and the `guardmesh hook pre-tool-use`
//! process run as a host runs it, with a bound on how long it may take.

use crate::harness::*;
use crate::mcp::{hook, mesh_with_policy, payload};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The host's own hook timeout (Claude Code's default, 60 s): the hook
/// must have answered well before it.
const HOST_TIMEOUT: Duration = Duration::from_secs(60);

/// What a hook run gave: exit code (-1 when it had to be killed), stdout,
/// stderr, and how long it took.
struct Run {
    code: i32,
    out: String,
    err: String,
    took: Duration,
}

/// Runs the hook with `input` on stdin (closed after it unless
/// `keep_open`), killing it after `bound`.
fn hook_within(mesh: &str, extra: &[&str], input: &str, keep_open: bool, bound: Duration) -> Run {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["hook", "pre-tool-use", "--mesh", mesh])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).unwrap();
    let held = keep_open.then_some(stdin);
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code().unwrap_or(-1);
        }
        if started.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            break -1;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(held);
    let took = started.elapsed();
    let mut out = String::new();
    let mut err = String::new();
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    Run {
        code,
        out,
        err,
        took,
    }
}

/// The `hookSpecificOutput` of a hook's stdout.
fn specific(out: &str) -> Value {
    let out: Value =
        serde_json::from_str(out).unwrap_or_else(|e| panic!("not hook JSON ({e}): {out:?}"));
    out["hookSpecificOutput"].clone()
}

/// A socket that accepts connections and never answers on them: TCP up,
/// no HTTP/2 ever.
async fn silent_server() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (url, task)
}

/// R31b: a mesh that accepts TCP and never answers gets a deny by the
/// hook's deadline, long before the host's timeout would let the call run;
/// `--fail-open` lets it through with a warning instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31b_hook_denies_by_its_deadline_when_the_mesh_never_answers() {
    let (url, server) = silent_server().await;
    tokio::task::spawn_blocking(move || {
        let input = payload("pay", json!({"amount": 5, "to": "b"}));
        let bound = HOST_TIMEOUT / 2;
        let run = hook_within(&url, &["--deadline-ms", "1500"], &input, false, bound);
        assert_eq!(run.code, 0, "took {:?}, stderr: {}", run.took, run.err);
        let out = specific(&run.out);
        assert_eq!(out["permissionDecision"], "deny", "{out}");
        let reason = out["permissionDecisionReason"].as_str().unwrap();
        assert!(reason.contains("did not answer within 1500 ms"), "{reason}");
        assert!(run.took < Duration::from_secs(15), "{:?}", run.took);
        // Fail open, as asked: nothing on stdout, the reason on stderr.
        let run = hook_within(
            &url,
            &["--deadline-ms", "500", "--fail-open"],
            &input,
            false,
            bound,
        );
        assert_eq!((run.code, run.out.as_str()), (0, ""), "{}", run.err);
        assert!(run.err.contains("--fail-open"), "{}", run.err);
    })
    .await
    .unwrap();
    server.abort();
}

/// R31b: a `guardmesh serve` that is stopped (SIGSTOP: the kernel still
/// accepts its connections) gets a deny within the hook's default deadline,
/// which is well under the host's own timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31b_hook_denies_within_its_default_deadline_when_the_mesh_is_stopped() {
    let (mesh, _guard) = mesh_with_policy("hook-stopped").await;
    let url = mesh.url.clone();
    // Answered while it runs...
    let input = payload("pay", json!({"amount": 5, "to": "b"}));
    let run = {
        let (url, input) = (url.clone(), input.clone());
        tokio::task::spawn_blocking(move || hook_within(&url, &[], &input, false, HOST_TIMEOUT))
            .await
            .unwrap()
    };
    assert_eq!((run.code, run.out.as_str()), (0, ""), "{}", run.err);
    // ... and denied in time once it is stopped.
    mesh.signal("STOP");
    let run =
        tokio::task::spawn_blocking(move || hook_within(&url, &[], &input, false, HOST_TIMEOUT))
            .await
            .unwrap();
    mesh.signal("CONT");
    assert_eq!(run.code, 0, "took {:?}, stderr: {}", run.took, run.err);
    let out = specific(&run.out);
    assert_eq!(out["permissionDecision"], "deny", "{out}");
    assert!(
        out["permissionDecisionReason"]
            .as_str()
            .unwrap()
            .contains("did not answer"),
        "{out}"
    );
    assert!(run.took < HOST_TIMEOUT / 2, "{:?}", run.took);
}

/// R31b: input that never ends (the host keeps stdin open) is not waited
/// for past the deadline: exit 2, which the host reads as a block.
#[test]
fn r31b_hook_stops_reading_stdin_at_its_deadline() {
    let run = hook_within(
        "http://127.0.0.1:9",
        &["--deadline-ms", "700"],
        r#"{"hook_event_name":"PreToolUse","tool_name":"pay","tool_in"#,
        true,
        HOST_TIMEOUT / 2,
    );
    assert_eq!((run.code, run.out.as_str()), (2, ""), "{}", run.err);
    assert!(run.err.contains("700 ms"), "{}", run.err);
    assert!(run.took < Duration::from_secs(15), "{:?}", run.took);
}

/// R31b: a rewrite is answered `ask` with the rewritten input, so the host
/// still asks its user where it would have; never an `allow` the host did
/// not ask for. Calls the guard leaves alone get no output (the host's own
/// flow), steers and cancels a deny.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31b_hook_answers_a_rewrite_with_ask_and_the_rewritten_input() {
    let (mesh, guard) = mesh_with_policy("hook-ask").await;
    let url = mesh.url.clone();
    tokio::task::spawn_blocking(move || {
        for format in [&[][..], &["--format", "claude"][..]] {
            let (code, out, err) = hook(
                &url,
                format,
                &payload("read_file", json!({"path": "/etc/shadow"})),
            );
            assert_eq!(code, 0, "{err}");
            let out = specific(&out);
            assert_eq!(out["hookEventName"], "PreToolUse");
            assert_eq!(out["permissionDecision"], "ask", "{out}");
            assert_eq!(out["updatedInput"], json!({"path": "/redacted"}));
            assert!(
                out["permissionDecisionReason"]
                    .as_str()
                    .unwrap()
                    .contains("policy"),
                "{out}"
            );
            let (code, out, _) = hook(&url, format, &payload("read_file", json!({"path": "/x"})));
            assert_eq!((code, out.as_str()), (0, ""));
            let (code, out, _) = hook(&url, format, &payload("delete_file", json!({"path": "/x"})));
            assert_eq!(code, 0);
            assert_eq!(specific(&out)["permissionDecision"], "deny");
        }
    })
    .await
    .unwrap();
    assert_eq!(guard.guard.batches().len(), 6);
}

/// R31b: in Codex's format, a PreToolUse answer is `deny` with a non-empty
/// reason, `allow` only together with `updatedInput` (a rewrite, which
/// grants nothing: the host's own approval still applies), or nothing;
/// Codex reads `ask` (and a bare `allow`) as a failed hook and runs the
/// original call, so neither is ever printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31b_hook_speaks_codex_format_as_codex_reads_it() {
    let (mesh, _guard) = mesh_with_policy("hook-codex").await;
    let url = mesh.url.clone();
    let closed = closed_port().await;
    tokio::task::spawn_blocking(move || {
        let codex = ["--format", "codex"];
        // A Codex PreToolUse input: its own fields besides the common ones.
        let input = |tool: &str, args: Value| {
            json!({
                "session_id": "019a6c2e-5b1d-7c55-9d0e-2f3a8b7c6d10",
                "turn_id": "turn-3",
                "transcript_path": null,
                "cwd": "/home/dev/shop",
                "hook_event_name": "PreToolUse",
                "model": "gpt-test",
                "permission_mode": "default",
                "tool_name": tool,
                "tool_input": args,
                "tool_use_id": "call_7",
            })
            .to_string()
        };
        let (code, out, _) = hook(&url, &codex, &input("read_file", json!({"path": "/etc/x"})));
        assert_eq!(code, 0);
        let out = specific(&out);
        assert_eq!(out["hookEventName"], "PreToolUse");
        assert_eq!(out["permissionDecision"], "allow", "{out}");
        assert_eq!(out["updatedInput"], json!({"path": "/redacted"}));
        for (tool, args, reason) in [
            (
                "delete_file",
                json!({"path": "/x"}),
                "deleting is not allowed; use trash",
            ),
            (
                "pay",
                json!({"amount": 500, "to": "m"}),
                "payments over 100 need approval",
            ),
        ] {
            let (code, out, _) = hook(&url, &codex, &input(tool, args));
            assert_eq!(code, 0);
            let out = specific(&out);
            assert_eq!(out["permissionDecision"], "deny", "{out}");
            assert_eq!(out["permissionDecisionReason"], reason);
            assert!(out.get("updatedInput").is_none(), "{out}");
        }
        let (code, out, _) = hook(&url, &codex, &input("pay", json!({"amount": 5})));
        assert_eq!((code, out.as_str()), (0, ""));
        let (code, out, _) = hook(&closed, &codex, &input("pay", json!({"amount": 5})));
        assert_eq!(code, 0);
        let out = specific(&out);
        assert_eq!(out["permissionDecision"], "deny");
        assert!(
            !out["permissionDecisionReason"]
                .as_str()
                .unwrap()
                .trim()
                .is_empty()
        );
        // An unknown format is a usage error, never a guess.
        let (code, out, _) = hook(&url, &["--format", "other"], &input("pay", json!({})));
        assert_eq!((code, out.as_str()), (2, ""));
    })
    .await
    .unwrap();
}

/// R31b: an event other than PreToolUse (or none) is refused with exit 2
/// and the reason on stderr, and never judged as if it were one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31b_hook_refuses_events_other_than_pre_tool_use() {
    let (mesh, guard) = mesh_with_policy("hook-events").await;
    let url = mesh.url.clone();
    tokio::task::spawn_blocking(move || {
        let with_event = |event: Value| {
            let mut input: Value = serde_json::from_str(&payload("pay", json!({"amount": 5})))
                .expect("payload is JSON");
            match event {
                Value::Null => {
                    input.as_object_mut().unwrap().remove("hook_event_name");
                }
                event => input["hook_event_name"] = event,
            }
            input.to_string()
        };
        for (event, named) in [
            (json!("PostToolUse"), "\"PostToolUse\""),
            (json!("PermissionRequest"), "\"PermissionRequest\""),
            (json!("pretooluse"), "\"pretooluse\""),
            (json!("PreToolUse "), "\"PreToolUse \""),
            (Value::Null, "no hook_event_name"),
        ] {
            for format in ["claude", "codex"] {
                let (code, out, err) =
                    hook(&url, &["--format", format], &with_event(event.clone()));
                assert_eq!((code, out.as_str()), (2, ""), "{event} {format}: {err}");
                assert!(err.contains(named), "{event}: {err}");
                assert!(err.contains("PreToolUse"), "{event}: {err}");
            }
        }
        let (code, out, err) = hook(&url, &[], &with_event(json!(7)));
        assert_eq!((code, out.as_str()), (2, ""), "{err}");
    })
    .await
    .unwrap();
    assert!(guard.guard.batches().is_empty());
}

/// R31b, R35: a guard's ask reaches the host as Claude Code's
/// `permissionDecision: "ask"`, whose reason names the guard, its reason
/// and the approval request, so the host's own prompt asks the person; in
/// Codex's format (which has no ask) it is a deny naming the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31b_r35_hook_answers_a_guards_ask_with_the_hosts_ask() {
    let (mesh, _policy) = mesh_with_policy("hook-approval").await;
    let asker = call_guard(Duration::ZERO, |call| {
        (call.tool == "refund")
            .then(|| guardmesh_client::verdict::ask(&call.call_id, "refunds need a person"))
    })
    .await;
    mesh.register(guardmesh_client::Registration::validate(
        "refunds", &asker.url,
    ))
    .await;
    let url = mesh.url.clone();
    tokio::task::spawn_blocking(move || {
        let input = payload("refund", json!({"amount": 1500}));
        let (code, out, err) = hook(&url, &["--format", "claude"], &input);
        assert_eq!(code, 0, "{err}");
        let out = specific(&out);
        assert_eq!(out["permissionDecision"], "ask", "{out}");
        assert!(out.get("updatedInput").is_none(), "{out}");
        let reason = out["permissionDecisionReason"].as_str().unwrap();
        for part in ["refunds", "refunds need a person", "approval request "] {
            assert!(reason.contains(part), "{part:?} in {reason}");
        }
        let (code, out, _) = hook(&url, &["--format", "codex"], &input);
        assert_eq!(code, 0);
        let out = specific(&out);
        assert_eq!(out["permissionDecision"], "deny", "{out}");
        let reason = out["permissionDecisionReason"].as_str().unwrap();
        assert!(reason.contains("approval request "), "{reason}");
        // Nothing else asks.
        let (code, out, _) = hook(&url, &[], &payload("pay", json!({"amount": 5})));
        assert_eq!((code, out.as_str()), (0, ""));
    })
    .await
    .unwrap();
}
