//! `guardmesh approvals list|approve|deny` (R35), the real binary against
//! an in-process mesh: a guard asks, the command lists the request and
//! answers it, and the coordinator's call then runs on the approval.

use crate::harness::*;
use guardmesh_client::verdict::ask;
use guardmesh_client::{Batch, Registration};
use std::process::Output;
use std::time::Duration;

const REFUND: &str = r#"{"amount":1500,"to":"acct-1"}"#;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `guardmesh approvals --mesh URL ARGS...`, off the test's runtime.
async fn approvals(mesh: &TestMesh, args: &[&str]) -> Output {
    let mut all = vec!["approvals", "--mesh", mesh.url.as_str()];
    all.extend_from_slice(args);
    guardmesh_off_thread(all).await
}

/// The requests `approvals list --json ARGS...` prints.
async fn listed(mesh: &TestMesh, args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["list", "--json"];
    all.extend_from_slice(args);
    let out = approvals(mesh, &all).await;
    assert!(out.status.success(), "{out:?}");
    let value: serde_json::Value =
        serde_json::from_str(&text(&out.stdout)).expect("list --json prints one JSON object");
    value["requests"].as_array().expect("requests").clone()
}

/// R35: the ask's request is listed as pending (JSON and text), `approve`
/// answers it and prints it approved, a second answer fails naming that
/// it is already answered, an unknown id fails as not found, and the
/// same call sent again with the approval runs.
#[tokio::test]
async fn r35_cli_lists_approves_and_refuses_a_second_answer() {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |call| {
        (call.tool == "refund").then(|| ask(&call.call_id, "refund over 1,000"))
    })
    .await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let d = mesh
        .decides(Batch::turn(0).call("c1", "refund", REFUND))
        .await;
    let id = d.calls[0]
        .ask()
        .unwrap_or_else(|| panic!("an ask, not {:?}", d.calls[0].outcome))
        .id
        .clone();
    assert_eq!(id.len(), 64, "{id}");

    let pending = listed(&mesh, &[]).await;
    let request = pending
        .iter()
        .find(|r| r["id"] == id.as_str())
        .unwrap_or_else(|| panic!("{id} listed: {pending:?}"));
    assert_eq!(request["state"], "pending");
    assert_eq!(request["guard"], "refunds");
    assert_eq!(request["reason"], "refund over 1,000");
    assert_eq!(request["session_id"], "s");
    assert_eq!(request["call"]["tool"], "refund");
    assert_eq!(request["call"]["arguments"]["amount"], 1500);
    assert_eq!(
        listed(&mesh, &["--state", "pending", "--session", "s"])
            .await
            .len(),
        1
    );
    assert!(listed(&mesh, &["--session", "another"]).await.is_empty());

    let out = approvals(&mesh, &["list"]).await;
    assert!(out.status.success(), "{out:?}");
    let table = text(&out.stdout);
    let line = table
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("a line for {id}: {table}"));
    for field in ["pending", "refunds", "refund", "\"refund over 1,000\""] {
        assert!(line.contains(field), "{field} in {line:?}");
    }

    let out = approvals(&mesh, &["approve", &id, "--note", "ok"]).await;
    assert!(out.status.success(), "{out:?}");
    let shown = text(&out.stdout);
    assert!(
        shown.contains(&format!("approval request {id}: approved")) && shown.contains("\"ok\""),
        "{shown}"
    );
    let approved = listed(&mesh, &["--state", "approved"]).await;
    assert_eq!(approved.len(), 1, "{approved:?}");
    assert_eq!(approved[0]["id"], id.as_str());
    assert_eq!(approved[0]["note"], "ok");

    let out = approvals(&mesh, &["deny", &id, "--note", "too late"]).await;
    assert!(!out.status.success(), "a second answer fails: {out:?}");
    let error = text(&out.stderr);
    assert!(
        error.contains("already answered") && error.contains("FAILED_PRECONDITION"),
        "{error}"
    );
    assert!(out.stdout.is_empty(), "{out:?}");

    let unknown = "0".repeat(64);
    let out = approvals(&mesh, &["approve", &unknown]).await;
    assert!(!out.status.success(), "{out:?}");
    assert!(text(&out.stderr).contains("NOT_FOUND"), "{out:?}");

    // The same call, sent again with the approval, runs.
    let d = mesh
        .decides(
            Batch::turn(1)
                .call("c1", "refund", REFUND)
                .approval("c1", &id),
        )
        .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
    assert_eq!(listed(&mesh, &["--state", "used"]).await.len(), 1);
}
