//! The decision rules of `docs/behaviour.md` (R1..R9, R13..R17, R19..R21),
//! held against a real mesh and real guards on loopback. Each test is named
//! after the rule it holds.

use crate::harness::*;
use guardmesh_client::proto::{EvaluateRequest, FailurePolicy, ToolCall, TraceStatus};
use guardmesh_client::verdict::{cancel, proceed, steer};
use guardmesh_client::{Batch, ClientError, Outcome, Registration};
use std::time::Duration;

fn content(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Steer { content } | Outcome::Cancel { content } | Outcome::Ask { content, .. } => {
            content
        }
        Outcome::Proceed => "",
    }
}

async fn eventually(mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

/// No guard was contacted for the batches the mesh refused, and the stream
/// still serves: a fine call `ok` of `tool` with `args` proceeds, the first
/// request `guard` sees.
async fn assert_refused_unseen_and_still_serving(
    session: &guardmesh_client::Session,
    guard: &TestGuard,
    tool: &str,
    args: &str,
) {
    assert_eq!(
        guard.guard.requests(),
        0,
        "no guard contacted for a refused batch"
    );
    let d = session
        .evaluate(Batch::new(0).call("ok", tool, args))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds(), "the stream still serves");
    assert_eq!(guard.guard.requests(), 1);
}

#[tokio::test]
async fn r1_zero_calls_contact_no_guard() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();

    // Through the SDK: answered locally, no RPC.
    let d = session.evaluate(Batch::new(0)).await.unwrap();
    assert!(d.calls.is_empty() && d.execute.is_empty());
    // Sent on the wire anyway: the mesh answers at once and contacts no guard.
    let d = session
        .evaluate_raw(EvaluateRequest {
            batch_id: "empty".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(d.batch_id, "empty");
    assert!(d.calls.is_empty());
    assert_eq!(status_of(&d, "g"), TraceStatus::NotApplicable);
    let d = coordinator.evaluate_once("s", Batch::new(1)).await.unwrap();
    assert!(d.calls.is_empty());
    assert_eq!(
        guard.guard.requests(),
        0,
        "zero calls must contact no guard"
    );

    // The counter does count: one call, one request.
    session
        .evaluate(Batch::new(2).call("c1", "t", "{}"))
        .await
        .unwrap();
    assert_eq!(guard.guard.requests(), 1);
}

#[tokio::test]
async fn r3_r4_slow_early_skip_beats_fast_later_skip() {
    let mesh = TestMesh::start().await;
    let early = call_guard(Duration::from_millis(300), |c| {
        Some(steer(&c.call_id, "early guard says no"))
    })
    .await;
    let late = call_guard(Duration::ZERO, |c| {
        Some(cancel(&c.call_id, "late guard says no"))
    })
    .await;
    mesh.register(Registration::validate("early", &early.url))
        .await;
    mesh.register(Registration::validate("late", &late.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    for turn in 0..3 {
        let d = session
            .evaluate(Batch::new(turn).call("c1", "t", "{}"))
            .await
            .unwrap();
        let call = &d.calls[0];
        assert_eq!(
            call.outcome,
            steered("early guard says no"),
            "chain order decides, not answer order"
        );
        assert_eq!(call.decided_by.as_deref(), Some("early"));
        assert_eq!(status_of(&d, "early"), TraceStatus::Skipped);
        assert_eq!(status_of(&d, "late"), TraceStatus::Skipped);
    }
}

#[tokio::test]
async fn r5_early_veto_answers_and_cancels_the_slow_later_guard() {
    let mesh = TestMesh::start().await;
    let veto = call_guard(Duration::ZERO, |c| Some(cancel(&c.call_id, "denied"))).await;
    let slow = call_guard(Duration::from_secs(10), |_| None).await;
    mesh.register(Registration::validate("veto", &veto.url))
        .await;
    mesh.register(Registration::validate("slow", &slow.url).timeout(Duration::from_secs(20)))
        .await;
    let (_session, d) = mesh
        .session_decides(timed_batch(0, Duration::from_secs(30)))
        .await;
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("veto"));
    assert_eq!(status_of(&d, "slow"), TraceStatus::Superseded);
    assert_eq!(slow.guard.requests(), 1);
    assert!(
        eventually(|| slow.guard.cancelled() == 1).await,
        "the superseded request must be cancelled at the guard"
    );
    assert_eq!(
        slow.guard
            .answered
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

#[tokio::test]
async fn r6_a_skip_touches_only_its_call() {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |c| {
        (c.call_id == "c2").then(|| steer(&c.call_id, "not this one"))
    })
    .await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let (_session, d) = mesh
        .session_decides(
            Batch::new(0)
                .call("c1", "a", "{}")
                .call("c2", "b", "{}")
                .call("c3", "c", r#"{"x":1}"#),
        )
        .await;
    let ids: Vec<_> = d.calls.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(
        ids,
        ["c1", "c2", "c3"],
        "R2: one decision per call, in order"
    );
    assert!(d.calls[0].proceeds() && d.calls[2].proceeds());
    assert!(!d.calls[1].proceeds());
    let run: Vec<_> = d.execute.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(run, ["c1", "c3"]);
    assert_eq!(d.execute[1].arguments, r#"{"x":1}"#);
}

#[tokio::test]
async fn r7_skip_without_kind_is_steer() {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |c| match c.call_id.as_str() {
        "default" => Some(guardmesh_client::proto::Verdict {
            labels: Vec::new(),
            call_id: c.call_id.clone(),
            outcome: Some(guardmesh_client::proto::verdict::Outcome::Skip(
                guardmesh_client::proto::Skip {
                    content: "fix it".into(),
                    kind: 0,
                },
            )),
        }),
        "cancel" => Some(cancel(&c.call_id, "not allowed")),
        _ => None,
    })
    .await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let (_session, d) = mesh.session_decides(t_calls(&["default", "cancel"])).await;
    assert_eq!(d.calls[0].outcome, steered("fix it"));
    assert_eq!(d.calls[1].outcome, cancelled("not allowed"));
}

#[tokio::test]
async fn r8_malformed_verdicts_are_dropped_and_traced() {
    let mesh = TestMesh::start().await;
    let guard = script_guard(|batch| {
        let mut verdicts = Vec::new();
        for c in &batch.calls {
            match c.call_id.as_str() {
                "blank" => verdicts.push(steer(&c.call_id, "   ")),
                "twice" => {
                    verdicts.push(proceed(&c.call_id));
                    verdicts.push(cancel(&c.call_id, "second verdict"));
                }
                _ => {}
            }
        }
        verdicts.push(steer("never-sent", "unknown call id"));
        Script {
            verdicts,
            ..Default::default()
        }
    })
    .await;
    let later = proceed_guard().await;
    mesh.register(Registration::validate("buggy", &guard.url))
        .await;
    mesh.register(Registration::validate("later", &later.url))
        .await;
    let (_session, d) = mesh.session_decides(t_calls(&["blank", "twice"])).await;
    assert!(d.calls[0].proceeds(), "a blank skip counts as proceed");
    assert!(d.calls[1].proceeds(), "the second verdict is ignored");
    assert_eq!(status_of(&d, "buggy"), TraceStatus::Malformed);
    assert_eq!(status_of(&d, "later"), TraceStatus::Proceeded);
    let entry = d.trace.iter().find(|t| t.guard == "buggy").unwrap();
    for needle in ["blank", "second verdict", "never-sent"] {
        assert!(
            entry.error.contains(needle),
            "{needle} in {:?}",
            entry.error
        );
    }
}

#[tokio::test]
async fn r9_guard_receives_only_the_calls_it_applies_to() {
    let mesh = TestMesh::start().await;
    let sql = proceed_guard().await;
    let files = proceed_guard().await;
    let none = proceed_guard().await;
    mesh.register(Registration::validate("sql", &sql.url).tools(["sql.*"]))
        .await;
    mesh.register(Registration::validate("files", &files.url).tools(["fs.read", "fs.write"]))
        .await;
    mesh.register(Registration::validate("none", &none.url).tools(["payments.*"]))
        .await;
    let (_session, d) = mesh
        .session_decides(
            Batch::new(0)
                .call("q", "sql.query", sql_args())
                .call("r", "fs.read", "{}")
                .call("x", "shell", "{}"),
        )
        .await;
    let got = |g: &TestGuard| -> Vec<String> {
        g.guard.batches()[0]
            .calls
            .iter()
            .map(|c| c.call_id.clone())
            .collect()
    };
    assert_eq!(got(&sql), ["q"]);
    assert_eq!(got(&files), ["r"]);
    assert_eq!(none.guard.requests(), 0);
    assert_eq!(status_of(&d, "none"), TraceStatus::NotApplicable);
    assert!(d.calls.iter().all(|c| c.proceeds()));
}

fn sql_args() -> String {
    sql("SELECT 1")
}

/// The ways a guard can fail (R13).
#[derive(Debug, Clone, Copy)]
enum Cause {
    Unreachable,
    ErrorAnswer,
    StreamError,
    StreamClosed,
    Timeout,
}

async fn failing_guard(
    cause: Cause,
) -> (
    String,
    Option<TestGuard>,
    Option<tokio::task::JoinHandle<()>>,
) {
    match cause {
        Cause::Unreachable => (closed_port().await, None, None),
        Cause::ErrorAnswer => {
            let g = script_guard(|_| Script {
                error: Some(tonic::Status::internal("database down")),
                ..Default::default()
            })
            .await;
            (g.url.clone(), Some(g), None)
        }
        Cause::StreamError => {
            let (url, _, task) = raw_guard(Misbehaviour::CloseError).await;
            (url, None, Some(task))
        }
        Cause::StreamClosed => {
            let (url, _, task) = raw_guard(Misbehaviour::CloseOk).await;
            (url, None, Some(task))
        }
        Cause::Timeout => {
            let g = slow_guard(Duration::from_secs(5)).await;
            (g.url.clone(), Some(g), None)
        }
    }
}

#[tokio::test]
async fn r13_each_failure_cause_under_each_policy() {
    for cause in [
        Cause::Unreachable,
        Cause::ErrorAnswer,
        Cause::StreamError,
        Cause::StreamClosed,
        Cause::Timeout,
    ] {
        for policy in [
            FailurePolicy::FailClosed,
            FailurePolicy::FailOpen,
            FailurePolicy::Abort,
        ] {
            let mesh = TestMesh::start().await;
            let (url, _guard, _task) = failing_guard(cause).await;
            let ok = proceed_guard().await;
            mesh.register(
                Registration::validate("flaky", &url)
                    .failure_policy(policy)
                    .timeout(Duration::from_millis(200))
                    .tools(["db.*"]),
            )
            .await;
            mesh.register(Registration::validate("ok", &ok.url)).await;
            let session = mesh.coordinator().await.session("s").await.unwrap();
            let result = session
                .evaluate(
                    Batch::new(0)
                        .call("c1", "db.query", "{}")
                        .call("c2", "fs.read", "{}"),
                )
                .await;
            let what = format!("{cause:?} under {policy:?}");
            match policy {
                FailurePolicy::FailClosed => {
                    let d = result.unwrap_or_else(|e| panic!("{what}: {e}"));
                    let c1 = &d.calls[0];
                    assert!(
                        matches!(c1.outcome, Outcome::Cancel { .. }),
                        "{what}: {c1:?}"
                    );
                    assert!(c1.failure, "{what}");
                    assert_eq!(c1.decided_by.as_deref(), Some("flaky"), "{what}");
                    assert!(content(&c1.outcome).contains("flaky"), "{what}");
                    assert!(d.calls[1].proceeds(), "{what}: R6, other calls run");
                    let status = status_of(&d, "flaky");
                    let want = if matches!(cause, Cause::Timeout) {
                        TraceStatus::TimedOut
                    } else {
                        TraceStatus::Failed
                    };
                    assert_eq!(status, want, "{what}");
                    let entry = d.trace.iter().find(|t| t.guard == "flaky").unwrap();
                    assert!(!entry.error.is_empty(), "{what}: a failure is never silent");
                }
                FailurePolicy::FailOpen => {
                    let d = result.unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(d.calls[0].proceeds(), "{what}");
                    assert_eq!(d.calls[0].bypassed, ["flaky"], "{what}");
                    assert!(d.calls[1].bypassed.is_empty(), "{what}");
                    assert_ne!(status_of(&d, "flaky"), TraceStatus::Proceeded, "{what}");
                }
                FailurePolicy::Abort => {
                    let err = result.expect_err(&what);
                    let ClientError::Status(status) = &err else {
                        panic!("{what}: {err}");
                    };
                    assert_eq!(status.code(), tonic::Code::Unavailable, "{what}");
                    assert!(status.message().contains("flaky"), "{what}: {status:?}");
                    // The stream survives an aborted batch.
                    let d = session
                        .evaluate(Batch::new(1).call("c3", "fs.read", "{}"))
                        .await;
                    assert!(d.unwrap().calls[0].proceeds(), "{what}");
                }
            }
        }
    }
}

#[tokio::test]
async fn r14_guard_gets_the_smaller_of_its_timeout_and_the_batch_deadline() {
    let mesh = TestMesh::start().await;
    let slow = slow_guard(Duration::from_secs(3)).await;
    mesh.register(Registration::validate("slow", &slow.url).timeout(Duration::from_secs(20)))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = session
        .evaluate(timed_batch(0, Duration::from_millis(300)))
        .await
        .unwrap();
    assert_eq!(status_of(&d, "slow"), TraceStatus::TimedOut);
    assert!(d.calls[0].failure);
    let sent = slow.guard.batches()[0].deadline_ms;
    assert!(sent > 0 && sent <= 300, "guard told its budget: {sent} ms");

    // And the guard's own timeout when it is the smaller one.
    mesh.register(Registration::validate("slow", &slow.url).timeout(Duration::from_millis(100)))
        .await;
    let d = session
        .evaluate(timed_batch(1, Duration::from_secs(20)))
        .await
        .unwrap();
    assert_eq!(status_of(&d, "slow"), TraceStatus::TimedOut);
    assert!(slow.guard.batches()[1].deadline_ms <= 100);
}

#[tokio::test]
async fn r15_a_killed_guard_keeps_failing_until_deregistered() {
    let mesh = TestMesh::start().await;
    let mut guard = GuardProcess::start("allow", 0, &[]);
    mesh.register(Registration::validate("g", &guard.url).timeout(Duration::from_millis(300)))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = session
        .evaluate(Batch::new(0).call("c", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
    assert_eq!(status_of(&d, "g"), TraceStatus::Proceeded);
    guard.kill();
    for turn in 1..5 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        assert!(
            matches!(d.calls[0].outcome, Outcome::Cancel { .. }) && d.calls[0].failure,
            "turn {turn}: a crashed guard is not a missing guard: {:?}",
            d.calls[0]
        );
        assert!(matches!(
            status_of(&d, "g"),
            TraceStatus::Failed | TraceStatus::TimedOut
        ));
    }
    let registrar = mesh.registrar().await;
    assert_eq!(
        registrar.list().await.unwrap().guards.len(),
        1,
        "still in the chain"
    );
    assert!(registrar.deregister("g").await.unwrap());
    let d = session
        .evaluate(Batch::new(9).call("c", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
    assert!(d.trace.is_empty());
}

#[tokio::test]
async fn r16_reregistration_updates_in_place_and_keeps_position() {
    let mesh = TestMesh::start().await;
    let a = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, "a"))).await;
    let b = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, "b"))).await;
    let registrar = mesh.registrar().await;
    registrar
        .register(Registration::validate("a", &a.url))
        .await
        .unwrap();
    registrar
        .register(Registration::validate("b", &b.url))
        .await
        .unwrap();
    // Re-register "a" with new settings: it stays first.
    let out = registrar
        .register(Registration::validate("a", &a.url).tools(["t"]))
        .await
        .unwrap();
    assert!(!out.created);
    assert_eq!(out.position, 0);
    let list = registrar.list().await.unwrap();
    let names: Vec<_> = list.guards.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(list.guards[0].tools, ["t"]);
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c", "t", "{}"))
        .await;
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("a"));
    assert_eq!(d.chain_revision, list.revision);
    // Bad registrations are refused with INVALID_ARGUMENT naming the field.
    let err = registrar
        .register(Registration::validate("bad", "not a uri"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument));
    assert!(err.to_string().contains("endpoint"), "{err}");
    assert_eq!(registrar.list().await.unwrap().guards.len(), 2);
}

#[tokio::test]
async fn r17_registration_during_a_batch_applies_from_the_next() {
    let mesh = TestMesh::start().await;
    let slow = slow_guard(Duration::from_millis(500)).await;
    let veto = call_guard(Duration::ZERO, |c| Some(cancel(&c.call_id, "new guard"))).await;
    mesh.register(Registration::validate("slow", &slow.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let in_flight = session.evaluate(Batch::new(0).call("c", "t", "{}"));
    let register = async {
        // Wait until the batch is at the slow guard, then register.
        while slow.guard.requests() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        mesh.register(Registration::validate("veto", &veto.url).priority(-1))
            .await;
    };
    let (d, ()) = tokio::join!(in_flight, register);
    let d = d.unwrap();
    assert!(
        d.calls[0].proceeds(),
        "judged with the chain it started with"
    );
    assert_eq!(d.trace.len(), 1);
    let next = session
        .evaluate(Batch::new(1).call("c", "t", "{}"))
        .await
        .unwrap();
    assert_eq!(next.calls[0].decided_by.as_deref(), Some("veto"));
    assert_eq!(next.trace.len(), 2);
    assert!(next.chain_revision > d.chain_revision);
    assert_eq!(veto.guard.requests(), 1);
}

#[tokio::test]
async fn r19_batches_in_flight_on_one_stream_and_across_streams() {
    let mesh = TestMesh::start().await;
    let guard = script_guard(|batch| Script {
        delay: if batch.calls.iter().any(|c| c.tool == "slow") {
            Duration::from_millis(400)
        } else {
            Duration::ZERO
        },
        verdicts: batch
            .calls
            .iter()
            .map(|c| steer(&c.call_id, format!("seen {}", c.call_id)))
            .collect(),
        error: None,
    })
    .await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let coordinator = mesh.coordinator().await;
    let one = coordinator.session("one").await.unwrap();
    let two = coordinator.session("two").await.unwrap();

    // On one stream: the slow batch does not hold back the fast one.
    let slow = one.evaluate(Batch::new(0).call("s1", "slow", "{}"));
    let fast = one.evaluate(Batch::new(1).call("f1", "fast", "{}"));
    tokio::pin!(slow);
    let first = tokio::select! {
        d = &mut slow => ("slow", d.unwrap()),
        d = fast => ("fast", d.unwrap()),
    };
    assert_eq!(first.0, "fast");
    assert_eq!(content(&first.1.calls[0].outcome), "seen f1");
    let d = slow.await.unwrap();
    assert_eq!(
        content(&d.calls[0].outcome),
        "seen s1",
        "each answer keyed to its batch"
    );

    // Across streams: a slow batch on one session does not stop another.
    let slow = one.evaluate(Batch::new(2).call("s2", "slow", "{}"));
    tokio::pin!(slow);
    let other = two.evaluate(Batch::new(0).call("o1", "fast", "{}"));
    let first = tokio::select! {
        d = &mut slow => ("slow", d.unwrap()),
        d = other => ("other", d.unwrap()),
    };
    assert_eq!(first.0, "other");
    assert_eq!(content(&first.1.calls[0].outcome), "seen o1");
    assert_eq!(content(&slow.await.unwrap().calls[0].outcome), "seen s2");

    // Many at once: every batch answered exactly once, with its own calls.
    let many = futures::future::join_all(
        (0..20).map(|i| one.evaluate(Batch::new(10 + i).call(format!("m{i}"), "fast", "{}"))),
    )
    .await;
    for (i, d) in many.into_iter().enumerate() {
        let d = d.unwrap();
        assert_eq!(d.calls.len(), 1);
        assert_eq!(content(&d.calls[0].outcome), format!("seen m{i}"));
    }
}

fn call(id: &str, tool: &str, args: &str) -> ToolCall {
    ToolCall {
        call_id: id.into(),
        tool: tool.into(),
        arguments: args.into(),
    }
}

#[tokio::test]
async fn r20_bad_batches_are_refused_and_the_stream_goes_on() {
    let mut config = fast_config();
    config.limits.max_calls_per_batch = 3;
    config.limits.max_argument_bytes = 1000;
    config.limits.max_batch_bytes = 2000;
    let mesh = TestMesh::with_config(config).await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let big = format!(r#"{{"x":"{}"}}"#, "a".repeat(1200));
    let cases: Vec<(Vec<ToolCall>, tonic::Code, &str)> = vec![
        (
            vec![call("", "t", "{}")],
            tonic::Code::InvalidArgument,
            "empty call_id",
        ),
        (
            vec![call("a", "t", "{}"), call("a", "t", "{}")],
            tonic::Code::InvalidArgument,
            "\"a\"",
        ),
        (
            vec![call("c9", "  ", "{}")],
            tonic::Code::InvalidArgument,
            "c9",
        ),
        (
            vec![call("c7", "t", "[1,2]")],
            tonic::Code::InvalidArgument,
            "c7",
        ),
        (
            vec![call("c8", "t", "{nope")],
            tonic::Code::InvalidArgument,
            "c8",
        ),
        (
            (0..4).map(|i| call(&format!("c{i}"), "t", "{}")).collect(),
            tonic::Code::ResourceExhausted,
            "limit is 3",
        ),
        (
            vec![call("huge", "t", &big)],
            tonic::Code::ResourceExhausted,
            "huge",
        ),
        (
            (0..3)
                .map(|i| call(&format!("h{i}"), "t", &big[..900]))
                .collect(),
            tonic::Code::ResourceExhausted,
            "bytes",
        ),
    ];
    for (i, (calls, code, needle)) in cases.into_iter().enumerate() {
        let err = session
            .evaluate_raw(EvaluateRequest {
                batch_id: format!("bad-{i}"),
                calls,
                ..Default::default()
            })
            .await
            .expect_err("refused");
        let ClientError::Status(status) = &err else {
            panic!("case {i}: {err}")
        };
        assert_eq!(status.code(), code, "case {i}: {status:?}");
        assert!(status.message().contains(needle), "case {i}: {status:?}");
    }
    assert_refused_unseen_and_still_serving(&session, &guard, "t", r#"{"fine":true}"#).await;
}

#[tokio::test]
async fn r21_one_trace_entry_per_guard_with_its_status() {
    let mesh = TestMesh::start().await;
    let proceeds = proceed_guard().await;
    let skips = call_guard(Duration::from_millis(100), |c| {
        Some(steer(&c.call_id, "no"))
    })
    .await;
    let not_applicable = proceed_guard().await;
    let superseded = slow_guard(Duration::from_secs(10)).await;
    let malformed = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, ""))).await;
    let failed = closed_port().await;
    mesh.register(Registration::validate("proceeds", &proceeds.url))
        .await;
    mesh.register(
        Registration::validate("failed", &failed).failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    mesh.register(Registration::validate("malformed", &malformed.url))
        .await;
    mesh.register(Registration::validate("skips", &skips.url))
        .await;
    mesh.register(Registration::validate("not_applicable", &not_applicable.url).tools(["x"]))
        .await;
    mesh.register(
        Registration::validate("superseded", &superseded.url).timeout(Duration::from_secs(20)),
    )
    .await;
    let (_session, d) = mesh
        .session_decides(timed_batch(0, Duration::from_secs(30)))
        .await;
    let got: Vec<_> = d
        .trace
        .iter()
        .map(|t| (t.guard.as_str(), TraceStatus::try_from(t.status).unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            ("proceeds", TraceStatus::Proceeded),
            ("failed", TraceStatus::Failed),
            ("malformed", TraceStatus::Malformed),
            ("skips", TraceStatus::Skipped),
            ("not_applicable", TraceStatus::NotApplicable),
            ("superseded", TraceStatus::Superseded),
        ]
    );
    let skips_entry = &d.trace[3];
    assert_eq!(skips_entry.skipped_call_ids, ["c1"]);
    assert_eq!(skips_entry.sent_call_ids, ["c1"]);
    assert!(skips_entry.latency_us >= 100_000, "latency is measured");
    assert!(d.trace[4].sent_call_ids.is_empty());
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("skips"));
    assert_eq!(d.calls[0].bypassed, ["failed"]);
}

/// R20: arguments that mainstream parsers read differently (or refuse) are
/// refused at the gate, so a guard never judges one call while the tool
/// runs another. Each is sent on the wire on one stream, which keeps
/// serving.
#[tokio::test]
async fn r20_arguments_must_be_i_json_or_the_batch_is_refused() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let nested = format!(r#"{{"a":{}1{}}}"#, "[".repeat(129), "]".repeat(129));
    let digits = format!(r#"{{"n":1{}}}"#, "0".repeat(400));
    // Within max_id_bytes (256), longer than what a message shows (64).
    let long_id = "L".repeat(200);
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "c1",
            r#"{"n":1e400}"#.into(),
            "number out of range of a double at $.n",
        ),
        (
            "c2",
            r#"{"s":"\ud800"}"#.into(),
            r"lone surrogate \ud800 at $.s",
        ),
        ("c3", nested, "nesting deeper than 64 at $"),
        ("c4", digits, "number longer than 100 characters at $.n"),
        (
            "c5",
            r#"{"sql":"SELECT 1","sql":"DELETE FROM t"}"#.into(),
            r#"duplicate member name "sql" at $"#,
        ),
        (
            &long_id,
            r#"{"sql":"SELECT 1","\u0073ql":"DELETE FROM t"}"#.into(),
            r#"duplicate member name "sql" at $"#,
        ),
    ];
    for (i, (id, arguments, reason)) in cases.iter().enumerate() {
        let err = session
            .evaluate_raw(EvaluateRequest {
                batch_id: format!("bad-{i}"),
                calls: vec![call("fine", "sql", "{}"), call(id, "sql", arguments)],
                ..Default::default()
            })
            .await
            .expect_err("refused");
        let ClientError::Status(status) = &err else {
            panic!("case {i}: {err}")
        };
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "case {i}: {status:?}"
        );
        let message = status.message();
        assert!(message.contains(reason), "case {i}: {message}");
        // The call is named by position and id; a long id is cut short.
        let shown = &id[..id.len().min(20)];
        assert!(
            message.contains(&format!("call #1 (\"{shown}")),
            "case {i}: {message}"
        );
        assert!(message.len() < 300, "case {i}: {} bytes", message.len());
    }
    assert_eq!(
        metric(
            &mesh,
            r#"guardmesh_batches_refused_total{reason="arguments_not_i_json"}"#
        ),
        6.0
    );
    let fine = r#"{"sql":"SELECT 1","n":1e300}"#;
    assert_refused_unseen_and_still_serving(&session, &guard, "sql", fine).await;
}

/// Log injection: ids and arguments come from the network. A batch id with
/// a newline and ANSI escapes, refused and logged by the real `guardmesh
/// serve` in the human format, stays on its own log line, escaped.
#[tokio::test]
async fn r25_network_values_cannot_forge_log_lines() {
    use guardmesh_client::Coordinator;
    use std::process::{Command, Stdio};

    let dir = std::env::temp_dir().join(format!("guardmesh-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log_path = dir.join("mesh.log");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log_path).unwrap()))
        .spawn()
        .expect("start guardmesh serve");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut coordinator = None;
    for _ in 0..500 {
        if let Ok(c) = Coordinator::connect(url.clone()).await {
            coordinator = Some(c);
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("guardmesh serve exited with {status}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let child = Kill(child);
    let session = coordinator
        .expect("the mesh came up")
        .session("s")
        .await
        .unwrap();
    let forged = "2026-12-01T00:00:00.000000Z ERROR guardmesh_server: FORGED";
    let batch_id = format!("b\n{forged} \x1b[31mred\x1b[0m\r");
    let refused = session
        .evaluate_raw(EvaluateRequest {
            batch_id: batch_id.clone(),
            calls: vec![call("", "t", "{}")],
            ..Default::default()
        })
        .await;
    assert!(refused.is_err(), "a batch with an empty call_id is refused");
    // The stream still serves, and the log has the refusal by then.
    let d = session
        .evaluate(Batch::new(1).call("ok", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
    let mut log = String::new();
    for _ in 0..250 {
        log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if log.contains("FORGED") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(log.contains("FORGED"), "the refusal was logged:\n{log}");
    assert!(
        !log.contains(['\x1b', '\r']),
        "raw escapes in the log:\n{log:?}"
    );
    for line in log.lines() {
        assert!(
            !line.starts_with(forged) && !line.trim_start().starts_with("2026-12-01T00:00:00"),
            "a forged log line:\n{log}"
        );
    }
}
