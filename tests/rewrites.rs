//! Rewrites by mutate guards: order, grants, the original beside the final
//! call, and dry runs (R10, R11, R12, R18 of `docs/behaviour.md`).

use crate::harness::*;
use guardmesh_client::proto::{FailurePolicy, ToolCall, TraceStatus, Verdict};
use guardmesh_client::verdict::{cancel, rename, rewrite_arguments, steer};
use guardmesh_client::{Batch, BatchDecision, ClientError, Outcome, Registration};
use serde_json::{Value, json};
use std::time::Duration;

fn args(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap()
}

/// A mutate guard that adds `key: true` to the arguments of every call.
async fn add_key(key: &'static str, delay: Duration) -> TestGuard {
    call_guard(delay, move |c| {
        let mut a = args(c);
        a[key] = json!(true);
        Some(rewrite_arguments(&c.call_id, &a))
    })
    .await
}

fn entry<'a>(d: &'a BatchDecision, guard: &str) -> &'a guardmesh_client::proto::GuardTrace {
    d.trace.iter().find(|t| t.guard == guard).unwrap()
}

fn status(d: &BatchDecision, guard: &str) -> TraceStatus {
    TraceStatus::try_from(entry(d, guard).status).unwrap()
}

#[tokio::test]
async fn r10_each_mutate_guard_sees_the_previous_output_and_validate_sees_the_final_call() {
    let mesh = TestMesh::start().await;
    let first = add_key("first", Duration::from_millis(50)).await;
    let second = add_key("second", Duration::ZERO).await;
    let judge = proceed_guard().await;
    mesh.register(Registration::validate("judge", &judge.url).priority(-10))
        .await;
    mesh.register(Registration::mutate("first", &first.url, ["*"]))
        .await;
    mesh.register(Registration::mutate("second", &second.url, ["*"]))
        .await;
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "http.get", r#"{"url":"u"}"#))
        .await;
    // The second mutate guard received the first one's output...
    let seen_by_second = &second.guard.batches()[0].calls[0];
    assert_eq!(args(seen_by_second), json!({"url": "u", "first": true}));
    // ...and the validate guard (registered first, but validate runs after
    // mutate: R10) judged the exact call that will run.
    let seen_by_judge = &judge.guard.batches()[0].calls[0];
    let want = json!({"url": "u", "first": true, "second": true});
    assert_eq!(args(seen_by_judge), want);
    let call = &d.calls[0];
    assert!(call.proceeds());
    assert_eq!(args(&call.final_call), want);
    assert_eq!(
        call.original.arguments, r#"{"url":"u"}"#,
        "R12: original kept"
    );
    assert_eq!(call.rewritten_by, ["first", "second"]);
    assert_eq!(call.changed_argument_keys(), ["first", "second"]);
    assert_eq!(args(&d.execute[0]), want);
    assert_eq!(status(&d, "first"), TraceStatus::Rewrote);
    assert_eq!(entry(&d, "first").rewritten_call_ids, ["c1"]);
    assert_eq!(status(&d, "judge"), TraceStatus::Proceeded);
}

/// Registers `guard` as a mutate guard with `grant` and `policy` in front of
/// a recording validate guard, sends calls c1 (tool sql.query) and c2 (tool
/// fs.read), and returns the decision (or error) and the validate guard.
async fn rejected_case(
    verdicts: impl Fn(&ToolCall) -> Option<Verdict> + Send + Sync + 'static,
    grant: Registration,
) -> (
    Result<BatchDecision, ClientError>,
    TestGuard,
    TestMesh,
    TestGuard,
) {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, verdicts).await;
    let judge = proceed_guard().await;
    let registration = grant;
    // The registration's endpoint is filled in by the caller's closure.
    let mut spec = registration.build();
    spec.endpoint = guard.url.clone();
    mesh.registrar().await.register(spec).await.unwrap();
    mesh.register(Registration::validate("judge", &judge.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let result = session
        .evaluate(
            Batch::new(0)
                .call("c1", "sql.query", r#"{"sql":"SELECT 1"}"#)
                .call("c2", "fs.read", r#"{"path":"a"}"#),
        )
        .await;
    (result, judge, mesh, guard)
}

fn assert_rejected(d: &BatchDecision, reason: &str) {
    assert_eq!(status(d, "rw"), TraceStatus::RejectedRewrite);
    let error = &entry(d, "rw").error;
    assert!(
        error.contains(reason),
        "{error:?} should mention {reason:?}"
    );
    assert!(
        entry(d, "rw").rewritten_call_ids.is_empty(),
        "nothing applied"
    );
    for call in &d.calls {
        assert!(
            call.rewritten_by.is_empty(),
            "never applied in part: {call:?}"
        );
        assert_eq!(call.final_call, call.original);
    }
}

#[tokio::test]
async fn r11_rewrite_outside_the_tool_grant_is_rejected_whole_fail_closed() {
    // A valid rewrite of c1 (in the grant) and one of c2 (outside it) in one
    // answer: neither is applied.
    let (d, judge, _mesh, _g) = rejected_case(
        |c| Some(rewrite_arguments(&c.call_id, &json!({"changed": true}))),
        Registration::mutate("rw", "", ["sql.*"]).failure_policy(FailurePolicy::FailClosed),
    )
    .await;
    let d = d.unwrap();
    assert_rejected(&d, "grant does not cover tool \"fs.read\"");
    for call in &d.calls {
        assert!(matches!(call.outcome, Outcome::Cancel { .. }) && call.failure);
        assert_eq!(call.decided_by.as_deref(), Some("rw"));
    }
    assert_eq!(
        judge.guard.requests(),
        0,
        "fixed calls are not sent on (R9)"
    );
}

#[tokio::test]
async fn r11_rename_without_the_rename_grant_is_rejected_fail_open() {
    let (d, judge, _mesh, _g) = rejected_case(
        |c| (c.tool == "sql.query").then(|| rename(&c.call_id, "sql.exec", None)),
        Registration::mutate("rw", "", ["sql.*"]).failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let d = d.unwrap();
    assert_rejected(&d, "without the rename grant");
    assert!(d.calls.iter().all(|c| c.proceeds()));
    assert_eq!(d.calls[0].bypassed, ["rw"]);
    // The validate guard judged the calls as the coordinator sent them.
    assert_eq!(judge.guard.batches()[0].calls[0].tool, "sql.query");
}

#[tokio::test]
async fn r11_rewrite_for_an_unknown_call_id_is_rejected_abort() {
    let (result, judge, _mesh, _g) = rejected_case(
        |c| (c.call_id == "c1").then(|| rewrite_arguments("c99", &json!({"x": 1}))),
        Registration::mutate("rw", "", ["*"]).failure_policy(FailurePolicy::Abort),
    )
    .await;
    let ClientError::Status(status) = result.unwrap_err() else {
        panic!("expected a status")
    };
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains("rw") && status.message().contains("c99"),
        "{status:?}"
    );
    assert_eq!(
        judge.guard.requests(),
        0,
        "an aborted batch goes no further"
    );
}

#[tokio::test]
async fn r11_non_object_arguments_are_rejected_fail_closed() {
    for bad in ["[1,2]", "\"text\"", "{broken", ""] {
        let (d, _judge, _mesh, _g) = rejected_case(
            move |c| {
                Some(Verdict {
                    labels: Vec::new(),
                    call_id: c.call_id.clone(),
                    outcome: Some(guardmesh_client::proto::verdict::Outcome::Rewrite(
                        guardmesh_client::proto::Rewrite {
                            tool: None,
                            arguments: Some(bad.to_owned()),
                        },
                    )),
                })
            },
            Registration::mutate("rw", "", ["*"]),
        )
        .await;
        let d = d.unwrap();
        assert_rejected(&d, "not a JSON object");
        assert!(d.calls.iter().all(|c| !c.proceeds()), "{bad}: fail_closed");
    }
}

#[tokio::test]
async fn r11_a_validate_guard_that_rewrites_is_refused() {
    let mesh = TestMesh::start().await;
    let sneaky = call_guard(Duration::ZERO, |c| {
        Some(rewrite_arguments(&c.call_id, &json!({"sneaky": true})))
    })
    .await;
    mesh.register(
        Registration::validate("rw", &sneaky.url).failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "t", r#"{"a":1}"#))
        .await;
    assert_rejected(&d, "only mutate guards may rewrite");
    assert!(d.calls[0].proceeds());
    assert_eq!(d.calls[0].final_call.arguments, r#"{"a":1}"#);
    assert_eq!(d.calls[0].bypassed, ["rw"]);
}

#[tokio::test]
async fn r11_rename_within_the_grant_applies() {
    let mesh = TestMesh::start().await;
    let g = call_guard(Duration::ZERO, |c| {
        Some(rename(
            &c.call_id,
            "sql.readonly_query",
            Some(&json!({"sql": "SELECT 1"})),
        ))
    })
    .await;
    mesh.register(Registration::mutate("rw", &g.url, ["sql.*"]).may_rename())
        .await;
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "sql.query", r#"{"sql":"SELECT 1;"}"#))
        .await;
    assert_eq!(d.calls[0].final_call.tool, "sql.readonly_query");
    assert_eq!(d.calls[0].original.tool, "sql.query");
    assert_eq!(d.calls[0].changed_argument_keys(), ["sql"]);
    assert_eq!(d.execute[0].tool, "sql.readonly_query");
}

#[tokio::test]
async fn r12_a_mutate_skip_is_final_and_later_guards_never_see_the_call() {
    let mesh = TestMesh::start().await;
    let m = call_guard(Duration::ZERO, |c| {
        (c.call_id == "c1").then(|| cancel(&c.call_id, "blocked at rewrite time"))
    })
    .await;
    let later_mutate = add_key("later", Duration::ZERO).await;
    let judge = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, "judge says no"))).await;
    mesh.register(Registration::mutate("m", &m.url, ["*"]))
        .await;
    mesh.register(Registration::mutate("later", &later_mutate.url, ["*"]))
        .await;
    mesh.register(Registration::validate("judge", &judge.url))
        .await;
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "t", "{}").call("c2", "t", "{}"))
        .await;
    assert_eq!(d.calls[0].outcome, cancelled("blocked at rewrite time"));
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("m"));
    for g in [&later_mutate, &judge] {
        let ids: Vec<_> = g.guard.batches()[0]
            .calls
            .iter()
            .map(|c| c.call_id.clone())
            .collect();
        assert_eq!(ids, ["c2"], "c1 was fixed by the mutate guard's skip");
    }
    assert_eq!(d.calls[1].decided_by.as_deref(), Some("judge"));
}

#[tokio::test]
async fn r18_dry_run_guards_change_nothing_and_say_what_they_would_have_done() {
    let mesh = TestMesh::start().await;
    let would_rewrite = add_key("dry", Duration::ZERO).await;
    let would_skip = call_guard(Duration::ZERO, |c| Some(cancel(&c.call_id, "would block"))).await;
    let judge = proceed_guard().await;
    mesh.register(Registration::mutate("dry-mutate", &would_rewrite.url, ["*"]).dry_run())
        .await;
    mesh.register(Registration::validate("dry-validate", &would_skip.url).dry_run())
        .await;
    mesh.register(Registration::validate("judge", &judge.url))
        .await;
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "t", r#"{"a":1}"#))
        .await;
    let call = &d.calls[0];
    assert!(call.proceeds());
    assert_eq!(call.final_call.arguments, r#"{"a":1}"#);
    assert!(call.rewritten_by.is_empty());
    // The validate guard judged the call as it will run, not the dry rewrite.
    assert_eq!(judge.guard.batches()[0].calls[0].arguments, r#"{"a":1}"#);
    let dm = entry(&d, "dry-mutate");
    assert_eq!(dm.status, TraceStatus::DryRun as i32);
    assert_eq!(dm.dry_run_status, TraceStatus::Rewrote as i32);
    assert_eq!(dm.rewritten_call_ids, ["c1"]);
    let dv = entry(&d, "dry-validate");
    assert_eq!(dv.status, TraceStatus::DryRun as i32);
    assert_eq!(dv.dry_run_status, TraceStatus::Skipped as i32);
    assert_eq!(dv.skipped_call_ids, ["c1"]);
}

#[tokio::test]
async fn r10_r4_final_calls_do_not_depend_on_guard_latencies() {
    use rand::Rng;
    let mut expected: Option<Vec<(String, Outcome, ToolCall)>> = None;
    for round in 0..8 {
        let mut rng = rand::rng();
        let mut delay = || Duration::from_millis(rng.random_range(0..40));
        let mesh = TestMesh::start().await;
        let a = add_key("a", delay()).await;
        let b = call_guard(delay(), |c| {
            let mut v = args(c);
            // Depends on what guard a did: order matters.
            v["b_saw_a"] = json!(v.get("a").is_some());
            Some(rewrite_arguments(&c.call_id, &v))
        })
        .await;
        let v1 = call_guard(delay(), |c| {
            (c.call_id == "c2").then(|| steer(&c.call_id, "v1"))
        })
        .await;
        let v2 = call_guard(delay(), |c| Some(cancel(&c.call_id, "v2"))).await;
        mesh.register(Registration::mutate("a", &a.url, ["*"]))
            .await;
        mesh.register(Registration::validate("v1", &v1.url)).await;
        mesh.register(Registration::mutate("b", &b.url, ["*"]))
            .await;
        mesh.register(Registration::validate("v2", &v2.url).tools(["x.*"]))
            .await;
        let (_session, d) = mesh
            .session_decides(
                Batch::new(0)
                    .call("c1", "x.one", "{}")
                    .call("c2", "x.two", "{}")
                    .call("c3", "y.three", "{}"),
            )
            .await;
        let got: Vec<_> = d
            .calls
            .iter()
            .map(|c| (c.call_id.clone(), c.outcome.clone(), c.final_call.clone()))
            .collect();
        assert_eq!(
            args(&d.calls[2].final_call),
            json!({"a": true, "b_saw_a": true})
        );
        match &expected {
            None => expected = Some(got),
            Some(want) => assert_eq!(&got, want, "round {round}"),
        }
    }
}
