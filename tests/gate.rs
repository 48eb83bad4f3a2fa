//! The gate (R20) and applicability without regard to case (R9), through
//! a mesh served over gRPC: names and arguments that one reader takes for
//! something else than another are refused with INVALID_ARGUMENT naming the
//! call before any guard is contacted, on the coordinator stream (which
//! stays open for the next batch) and on the unary call alike.

use crate::harness::*;
use guardmesh_client::proto::EvaluateRequest;
use guardmesh_client::verdict::cancel;
use guardmesh_client::{ClientError, Registration};
use std::time::Duration;

/// The status a refused batch was answered with.
fn refused(result: Result<guardmesh_client::BatchDecision, ClientError>) -> tonic::Status {
    match result {
        Err(ClientError::Status(status)) => status,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// `request` sent on the unary `EvaluateBatch`.
async fn unary(url: &str, request: &EvaluateRequest) -> Result<(), tonic::Status> {
    use prost::Message;
    let mut client = raw_client(url).await;
    raw_evaluate_batch(&mut client, request.encode_to_vec().into())
        .await
        .map(|_| ())
}

/// A mesh with one validate guard on every tool that lets everything
/// proceed, recording what it is sent.
async fn mesh_with_guard() -> (TestMesh, TestGuard) {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |_| None).await;
    mesh.register(Registration::validate("watch", &guard.url))
        .await;
    (mesh, guard)
}

/// R20: two member names that Go's `encoding/json` reads as one (`path`
/// and `PATH`, `s` and `ſ`, `k` and the Kelvin sign), at any depth, are
/// refused naming the call and both names; no guard sees the batch.
/// Whether call `c` of `request`, sent on `session`, proceeds.
async fn call_c_proceeds(session: &guardmesh_client::Session, request: EvaluateRequest) -> bool {
    let decision = session.evaluate_raw(request).await.unwrap();
    decision.call("c").unwrap().proceeds()
}

#[tokio::test]
async fn r20_gate_refuses_member_names_equal_under_case_folding() {
    let (mesh, guard) = mesh_with_guard().await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let cases = [
        (
            r#"{"path":"/tmp/ok","PATH":"/etc/shadow"}"#,
            r#""path" and "PATH""#,
        ),
        (r#"{"cmd":{"s":"ls","ſ":"rm -rf /"}}"#, r#""s" and "ſ""#),
        (r#"{"q":[{"k":1,"\u212a":2}]}"#, "\"k\" and \"\u{212a}\""),
        (
            r#"{"a":{"b":{"c":{"Role":"user","rOLE":"admin"}}}}"#,
            r#""Role" and "rOLE""#,
        ),
    ];
    for (i, (arguments, names)) in cases.iter().enumerate() {
        let batch = evaluate_request(
            &format!("b{i}"),
            &[("ok", "read_file", "{}"), ("fold", "read_file", arguments)],
        );
        for status in [
            refused(session.evaluate_raw(batch.clone()).await),
            unary(&mesh.url, &batch).await.unwrap_err(),
        ] {
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{arguments}");
            let message = status.message();
            assert!(message.contains("call #1 (\"fold\")"), "{message}");
            assert!(message.contains(names), "{message}");
            assert!(message.contains("case folding"), "{message}");
        }
    }
    // The stream is still served; only this batch reached the guard.
    let fine = evaluate_request(
        "fine",
        &[("c", "read_file", r#"{"path":"/tmp/ok","Path2":1}"#)],
    );
    assert!(call_c_proceeds(&session, fine).await);
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0].calls[0].call_id, "c");
}

/// R20: tool names outside the grammar (blank, invisible, look-alike,
/// control characters, over 128 characters) are refused naming the call;
/// a name in another case is within it and reaches the guard.
#[tokio::test]
async fn r20_gate_refuses_tool_names_outside_the_grammar() {
    let (mesh, guard) = mesh_with_guard().await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let long = "x".repeat(129);
    let bad = [
        " shell.exec",
        "shell.exec ",
        "shell\u{200b}.exec",
        "\u{ff53}\u{ff48}\u{ff45}\u{ff4c}\u{ff4c}.exec",
        "sh\u{435}ll.exec",
        "shell\u{0}.exec",
        "shell\u{1b}[2K.exec",
        "shell\r\n.exec",
        "shell\u{85}.exec",
        long.as_str(),
    ];
    for (i, tool) in bad.iter().enumerate() {
        let batch = evaluate_request(&format!("b{i}"), &[("c1", "ok", "{}"), ("bad", tool, "{}")]);
        for status in [
            refused(session.evaluate_raw(batch.clone()).await),
            unary(&mesh.url, &batch).await.unwrap_err(),
        ] {
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{tool:?}");
            let message = status.message();
            assert!(
                message.starts_with("call #1 (\"bad\") has tool name"),
                "{message}"
            );
            assert!(message.contains("tool-name grammar"), "{message}");
            assert!(message.len() < 500, "{message}");
        }
    }
    let fine = evaluate_request(
        "fine",
        &[
            ("c1", "Shell.exec", "{}"),
            ("c2", "mcp__fs__read-file.v2", "{}"),
        ],
    );
    let decision = session.evaluate_raw(fine).await.unwrap();
    assert!(decision.call("c1").unwrap().proceeds());
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0].calls[0].tool, "Shell.exec");
}

/// R20: the grammar is configured in `[limits]`, within printable ASCII.
#[tokio::test]
async fn r20_gate_tool_name_grammar_follows_the_config() {
    let config = guardmesh_server::config::Config::parse(
        "[limits]\nmax_tool_name_chars = 12\ntool_name_extra_chars = \"/\"\n",
        "test",
    )
    .unwrap();
    assert_eq!(config.check(), Ok(()));
    let mut mesh_config = fast_config();
    mesh_config.limits = config.mesh_config().limits;
    let mesh = TestMesh::with_config(mesh_config).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let ok = evaluate_request("a", &[("c", "fs/read", "{}")]);
    assert!(call_c_proceeds(&session, ok).await);
    for tool in ["fs/read/longer", "fs:read"] {
        let status = refused(
            session
                .evaluate_raw(evaluate_request("b", &[("c", tool, "{}")]))
                .await,
        );
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{tool}");
        assert!(
            status.message().contains("and \"/\""),
            "{}",
            status.message()
        );
    }
}

/// R20 with R30: batch ids in the prefix the mesh reserves for its replays
/// are refused from a coordinator without the admin role, on the stream
/// and the unary call; an operator (admin) replaying may use it. A mesh
/// without principals lets every caller do everything, this included.
#[tokio::test]
async fn r20_gate_refuses_the_replay_prefix_from_callers_that_may_not_replay() {
    let prefix = guardmesh_server::RESERVED_BATCH_PREFIX;
    let pki = TestPki::new();
    let (_mesh, url) = TestMesh::with_tokens(&pki, &[OPS, AGENT], "").await;
    let guard = call_guard(Duration::ZERO, |_| None).await;
    pki.registrar(&url, "ops-token")
        .await
        .register(Registration::validate("watch", &guard.url))
        .await
        .unwrap();
    let agent = pki.coordinator(&url, "agent-token").await;
    let session = agent.session("s").await.unwrap();
    let hidden = evaluate_request(&format!("{prefix}42"), &[("c", "read_file", "{}")]);
    let status = refused(session.evaluate_raw(hidden.clone()).await);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains(prefix), "{}", status.message());
    assert!(
        status.message().contains("reserves"),
        "{}",
        status.message()
    );
    // The same stream goes on; another id of the agent is judged.
    let fine = evaluate_request("replayed-by-hand", &[("c", "read_file", "{}")]);
    assert!(call_c_proceeds(&session, fine).await);
    assert_eq!(guard.guard.batches().len(), 1);
    // The operator's replay is judged.
    let ops = pki.coordinator(&url, "ops-token").await;
    let replay = ops.session("replay").await.unwrap();
    assert!(
        replay
            .evaluate_raw(hidden)
            .await
            .unwrap()
            .call("c")
            .unwrap()
            .proceeds()
    );
    assert_eq!(guard.guard.batches().len(), 2);

    // Without principals every caller may replay.
    let (open, _guard) = mesh_with_guard().await;
    let session = open.coordinator().await.session("s").await.unwrap();
    let replayed = evaluate_request(&format!("{prefix}7"), &[("c", "read_file", "{}")]);
    assert!(session.evaluate_raw(replayed.clone()).await.is_ok());
    assert!(unary(&open.url, &replayed).await.is_ok());
}

/// R9: a guard's tools match without regard to ASCII case: a guard on
/// `shell.*` judges `Shell.exec` and `SHELL.EXEC`, so capitalising a name
/// does not slip a call past it.
#[tokio::test]
async fn r9_gate_guard_patterns_match_tool_names_in_any_case() {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |call| {
        Some(cancel(&call.call_id, "shell is not allowed"))
    })
    .await;
    mesh.register(Registration::validate("no-shell", &guard.url).tools(["shell.*", "rm"]))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let decision = session
        .evaluate_raw(evaluate_request(
            "b",
            &[
                ("c1", "shell.exec", "{}"),
                ("c2", "Shell.exec", "{}"),
                ("c3", "SHELL.EXEC", "{}"),
                ("c4", "RM", "{}"),
                ("c5", "read_file", "{}"),
            ],
        ))
        .await
        .unwrap();
    for id in ["c1", "c2", "c3", "c4"] {
        assert!(!decision.call(id).unwrap().proceeds(), "{id}");
    }
    assert!(decision.call("c5").unwrap().proceeds());
    let sent: Vec<String> = guard.guard.batches()[0]
        .calls
        .iter()
        .map(|c| c.call_id.clone())
        .collect();
    assert_eq!(sent, ["c1", "c2", "c3", "c4"]);
}
