//! Faults (issue 6): a guard that should block is never silently bypassed.
//!
//! Each test is named after the fault it injects: `unreachable_guard_*`,
//! `guard_closes_stream_*`, `hang_*`, `spurious_*`, `oversized_*`,
//! `restart_*`. Everything runs on loopback, every wait is bounded, and the
//! tests assert outcomes and their order, never how long something took.
//! (Circuit breaking and overload have their own tests.)

use crate::harness::*;
use guardmesh_client::proto::{
    EvaluateRequest, FailurePolicy, GuardBatch, JudgeResponse, Skip, ToolCall, TraceStatus,
    Verdict, verdict,
};
use guardmesh_client::verdict::{proceed, steer};
use guardmesh_client::{
    Batch, BatchDecision, CallDecision, ClientError, Outcome, Registration, Session,
};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn trace_error(decision: &BatchDecision, guard: &str) -> String {
    decision
        .trace
        .iter()
        .find(|t| t.guard == guard)
        .map(|t| t.error.clone())
        .unwrap_or_default()
}

fn content(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Steer { content } | Outcome::Cancel { content } | Outcome::Ask { content, .. } => {
            content
        }
        Outcome::Proceed => "",
    }
}

/// R13 `fail_closed`: cancelled, marked as a failure, decided by `guard`,
/// and the content names the guard.
fn assert_failure_cancel(call: &CallDecision, guard: &str, what: &str) {
    assert!(
        matches!(call.outcome, Outcome::Cancel { .. }),
        "{what}: {} must be cancelled by the failed fail_closed guard {guard}, got {call:?}",
        call.call_id
    );
    assert!(call.failure, "{what}: {call:?} must be marked as a failure");
    assert_eq!(call.decided_by.as_deref(), Some(guard), "{what}: {call:?}");
    assert!(
        content(&call.outcome).contains(guard),
        "{what}: the content names the guard: {call:?}"
    );
}

/// R13 `fail_open`: proceeds, and the bypass is recorded.
fn assert_bypassed(call: &CallDecision, guard: &str, what: &str) {
    assert!(call.proceeds(), "{what}: {call:?}");
    assert_eq!(call.bypassed, [guard], "{what}: the bypass is recorded");
    assert!(!call.failure, "{what}: {call:?}");
}

fn assert_skip(call: &CallDecision, guard: &str, want: &Outcome, what: &str) {
    assert_eq!(&call.outcome, want, "{what}: {call:?}");
    assert_eq!(call.decided_by.as_deref(), Some(guard), "{what}: {call:?}");
    assert!(
        !call.failure,
        "{what}: a verdict the guard sent, not a failure: {call:?}"
    );
}

fn steer_outcome(text: &str) -> Outcome {
    Outcome::Steer {
        content: text.into(),
    }
}

/// The same failing endpoint registered three times, once per policy:
/// `fc` (fail_closed) judges `a.*`, `fo` (fail_open) judges `b.*`, `ab`
/// (abort) judges `c.*`.
async fn register_each_policy(mesh: &TestMesh, url: &str, timeout: Duration) {
    for (name, tools, policy) in [
        ("fc", "a.*", FailurePolicy::FailClosed),
        ("fo", "b.*", FailurePolicy::FailOpen),
        ("ab", "c.*", FailurePolicy::Abort),
    ] {
        mesh.register(
            Registration::validate(name, url)
                .tools([tools])
                .failure_policy(policy)
                .timeout(timeout),
        )
        .await;
    }
}

/// Holds R13 for the guards of [`register_each_policy`], which all fail:
/// `rounds` times, whatever state the links are in (first dial, known down,
/// redialling). `statuses` are the trace statuses the failure may show, and
/// `needle` must appear in the failed guards' trace errors.
async fn assert_each_policy_fails(
    session: &Session,
    what: &str,
    rounds: u32,
    statuses: &[TraceStatus],
    needle: &str,
) {
    for round in 0..rounds {
        let what = format!("{what}, round {round}");
        let d = session
            .evaluate(
                Batch::new(round)
                    .call("a1", "a.x", "{}")
                    .call("b1", "b.x", "{}")
                    .call("z1", "z.x", "{}")
                    .timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap_or_else(|e| panic!("{what}: every batch gets a decision: {e}"));
        let ids: Vec<_> = d.calls.iter().map(|c| c.call_id.as_str()).collect();
        assert_eq!(ids, ["a1", "b1", "z1"], "{what}: R2");
        assert_failure_cancel(&d.calls[0], "fc", &what);
        assert_bypassed(&d.calls[1], "fo", &what);
        assert!(
            d.calls[2].proceeds() && d.calls[2].bypassed.is_empty(),
            "{what}: R6"
        );
        let run: Vec<_> = d.execute.iter().map(|c| c.call_id.as_str()).collect();
        assert_eq!(run, ["b1", "z1"], "{what}");
        for guard in ["fc", "fo"] {
            let status = status_of(&d, guard);
            assert!(statuses.contains(&status), "{what}: {guard} is {status:?}");
            let error = trace_error(&d, guard);
            assert!(
                error.contains(needle),
                "{what}: {guard}'s failure is traced with its cause ({needle:?}): {error:?}"
            );
        }
        assert_eq!(status_of(&d, "ab"), TraceStatus::NotApplicable, "{what}");

        let err = session
            .evaluate(
                Batch::new(round)
                    .call("c1", "c.x", "{}")
                    .call("z2", "z.x", "{}")
                    .timeout(Duration::from_secs(10)),
            )
            .await
            .expect_err("abort: no call proceeds");
        assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{what}: {err}");
        assert!(err.to_string().contains("\"ab\""), "{what}: {err}");
    }
}

// ---------------------------------------------------------------------------
// 1. Guard unreachable
// ---------------------------------------------------------------------------

#[tokio::test]
async fn unreachable_guard_closed_port_blocks_under_fail_closed_and_is_bypassed_under_fail_open() {
    let mesh = TestMesh::start().await;
    let url = closed_port().await;
    register_each_policy(&mesh, &url, Duration::from_secs(2)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    assert_each_policy_fails(
        &session,
        "closed port",
        4,
        &[TraceStatus::Failed],
        "unreachable",
    )
    .await;
}

#[tokio::test]
async fn unreachable_guard_unresolvable_host_blocks_under_fail_closed() {
    let mesh = TestMesh::start().await;
    // `.invalid` never resolves (RFC 6761). The registration is well formed:
    // the guard fails at dial time, per its policy, every time.
    register_each_policy(
        &mesh,
        "http://guard.invalid:50051",
        Duration::from_millis(500),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    assert_each_policy_fails(
        &session,
        "unresolvable host",
        4,
        &[TraceStatus::Failed, TraceStatus::TimedOut],
        "",
    )
    .await;
}

/// A TCP listener that is not a gRPC server: it accepts, and either says
/// nothing at all (`garbage == false`) or writes garbage and hangs up.
async fn not_grpc_listener(garbage: bool) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            if garbage {
                let _ = socket.write_all(b"SSH-2.0-not-grpc\r\n\r\n").await;
                drop(socket);
            } else {
                held.push(socket);
            }
        }
    });
    (url, task)
}

#[tokio::test]
async fn unreachable_guard_endpoint_that_is_not_grpc_blocks_under_fail_closed() {
    for garbage in [true, false] {
        let mesh = TestMesh::start().await;
        let (url, _task) = not_grpc_listener(garbage).await;
        register_each_policy(&mesh, &url, Duration::from_millis(300)).await;
        let session = mesh.coordinator().await.session("s").await.unwrap();
        let what = if garbage {
            "listener that writes garbage"
        } else {
            "listener that never speaks"
        };
        assert_each_policy_fails(
            &session,
            what,
            3,
            &[TraceStatus::Failed, TraceStatus::TimedOut],
            "",
        )
        .await;
    }
}

#[tokio::test]
async fn unreachable_guard_unparsable_endpoint_is_refused_at_registration_and_the_chain_is_unchanged()
 {
    let mesh = TestMesh::start().await;
    let veto = call_guard(Duration::ZERO, |c| Some(steer(&c.call_id, "from g"))).await;
    let registrar = mesh.registrar().await;
    registrar
        .register(Registration::validate("g", &veto.url))
        .await
        .unwrap();
    let before = registrar.list().await.unwrap();
    for bad in [
        "",
        "   ",
        "not a uri",
        "127.0.0.1",
        "http://:50051",
        "ftp://127.0.0.1:1",
        "http://127.0.0.1:1/path",
        "http://127.0.0.1:99999",
        "http://[::1:1",
    ] {
        // A new guard with a bad endpoint...
        let err = registrar
            .register(Registration::validate("new", bad))
            .await
            .expect_err(bad);
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{bad:?}");
        assert!(err.to_string().contains("endpoint"), "{bad:?}: {err}");
        // ...and an update of a working guard to a bad endpoint: refused
        // too, never a working guard silently replaced by an unreachable one.
        let err = registrar
            .register(Registration::validate("g", bad).failure_policy(FailurePolicy::FailOpen))
            .await
            .expect_err(bad);
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{bad:?}");
        let after = registrar.list().await.unwrap();
        assert_eq!(after, before, "{bad:?}: the chain is unchanged");
    }
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "t", "{}"))
        .await;
    assert_skip(&d.calls[0], "g", &steer_outcome("from g"), "still judged");
    assert_eq!(d.chain_revision, before.revision);
}

#[tokio::test]
async fn unreachable_guard_bad_endpoint_in_the_config_file_stops_the_mesh_from_starting() {
    let dir = std::env::temp_dir().join(format!("guardmesh-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad-endpoint.toml");
    std::fs::write(&file, "[[guard]]\nname = \"g\"\nendpoint = \"not a uri\"\n").unwrap();
    let port = free_port();
    let output = serve_command(&file, port)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run guardmesh serve");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !output.status.success(),
        "a mesh whose config has an unparsable endpoint must not start"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("endpoint") && stderr.contains("\"g\""),
        "{stderr}"
    );
}

// ---------------------------------------------------------------------------
// 2. Guard closes its stream
// ---------------------------------------------------------------------------

#[tokio::test]
async fn guard_closes_stream_with_ok_without_answering_fails_per_policy() {
    let mesh = TestMesh::start().await;
    let (url, streams, _task) = raw_guard(Misbehaviour::CloseOk).await;
    register_each_policy(&mesh, &url, Duration::from_secs(5)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    assert_each_policy_fails(
        &session,
        "closed with OK",
        3,
        &[TraceStatus::Failed],
        "closed its stream",
    )
    .await;
    // R15: the mesh keeps redialling a guard that closes on it; it stays in
    // the chain and keeps failing per policy.
    assert!(
        eventually_within(200, || streams.load(Ordering::SeqCst) > 3).await,
        "the mesh reopens the guard's stream"
    );
}

#[tokio::test]
async fn guard_closes_stream_with_an_error_fails_per_policy() {
    let mesh = TestMesh::start().await;
    let (url, _streams, _task) = raw_guard(Misbehaviour::CloseError).await;
    register_each_policy(&mesh, &url, Duration::from_secs(5)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    assert_each_policy_fails(
        &session,
        "closed with an error",
        3,
        &[TraceStatus::Failed],
        "guard exploded",
    )
    .await;
}

/// `PartialThenClose`: a partial answer skips the first call of the batch,
/// then the guard ends its stream without a final answer.
async fn partial_then_close(
    role_mutate: bool,
    policy: FailurePolicy,
) -> Result<BatchDecision, ClientError> {
    let mesh = TestMesh::start().await;
    let (url, _streams, _task) = raw_guard(Misbehaviour::PartialThenClose).await;
    let registration = if role_mutate {
        Registration::mutate("g", &url, ["t"])
    } else {
        Registration::validate("g", &url)
    };
    mesh.register(
        registration
            .failure_policy(policy)
            .timeout(Duration::from_secs(5)),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    session
        .evaluate(
            Batch::new(0)
                .call("c1", "t", "{}")
                .call("c2", "t", "{}")
                .call("c3", "t", "{}")
                .timeout(Duration::from_secs(10)),
        )
        .await
}

fn assert_partial_then_close(d: &BatchDecision, policy: FailurePolicy, what: &str) {
    let ids: Vec<_> = d.calls.iter().map(|c| c.call_id.as_str()).collect();
    assert_eq!(ids, ["c1", "c2", "c3"], "{what}: R2");
    // The answered call keeps the verdict the guard sent...
    assert_skip(&d.calls[0], "g", &steer_outcome("partial skip"), what);
    // ...and the pending ones fail per the guard's policy.
    for call in &d.calls[1..] {
        match policy {
            FailurePolicy::FailClosed => assert_failure_cancel(call, "g", what),
            FailurePolicy::FailOpen => assert_bypassed(call, "g", what),
            FailurePolicy::Abort => unreachable!(),
        }
    }
    let run: Vec<_> = d.execute.iter().map(|c| c.call_id.as_str()).collect();
    match policy {
        FailurePolicy::FailClosed => assert!(run.is_empty(), "{what}: {run:?}"),
        _ => assert_eq!(run, ["c2", "c3"], "{what}"),
    }
    assert_eq!(status_of(d, "g"), TraceStatus::Failed, "{what}");
    assert!(
        trace_error(d, "g").contains("closed its stream"),
        "{what}: {:?}",
        d.trace
    );
}

#[tokio::test]
async fn guard_closes_stream_mid_batch_answered_call_keeps_its_verdict_pending_calls_fail() {
    for policy in [FailurePolicy::FailClosed, FailurePolicy::FailOpen] {
        let what = format!("validate guard, {policy:?}");
        let d = partial_then_close(false, policy)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_partial_then_close(&d, policy, &what);
    }
    let err = partial_then_close(false, FailurePolicy::Abort)
        .await
        .expect_err("abort: the whole batch is refused, no call proceeds");
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    assert!(err.to_string().contains("\"g\""), "{err}");
}

/// The same fault from a mutate guard. Its skip was sent and is final for
/// the call (R12); closing the stream afterwards must not turn that skip
/// into a bypass (fail_open) or a failure (fail_closed).
#[tokio::test]
async fn guard_closes_stream_mid_batch_mutate_guard_keeps_the_skip_it_sent() {
    for policy in [FailurePolicy::FailClosed, FailurePolicy::FailOpen] {
        let what = format!("mutate guard, {policy:?}");
        let d = partial_then_close(true, policy)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_partial_then_close(&d, policy, &what);
    }
}

// ---------------------------------------------------------------------------
// 3. Guard hangs
// ---------------------------------------------------------------------------

#[tokio::test]
async fn hang_guard_fails_at_its_own_timeout_and_is_told_to_stop() {
    let mesh = TestMesh::start().await;
    let hung = slow_guard(Duration::from_secs(30)).await;
    register_each_policy(&mesh, &hung.url, Duration::from_millis(200)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    assert_each_policy_fails(
        &session,
        "hung guard",
        2,
        &[TraceStatus::TimedOut],
        "did not answer",
    )
    .await;
    // Every request was withdrawn at the guard (CancelBatch), none answered.
    let sent = hung.guard.requests();
    assert_eq!(sent, 2 * 3, "fc and fo once per round, ab once per round");
    for batch in hung.guard.batches() {
        assert!(
            batch.deadline_ms > 0 && batch.deadline_ms <= 200,
            "R14: the guard is told its own timeout: {}",
            batch.deadline_ms
        );
    }
    assert!(
        eventually_within(250, || hung.guard.cancelled() == sent).await,
        "cancelled {} of {sent}",
        hung.guard.cancelled()
    );
    assert_eq!(hung.guard.answered.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn hang_batch_deadline_smaller_than_the_guard_timeout_bounds_the_guard() {
    let mesh = TestMesh::start().await;
    let hung = slow_guard(Duration::from_secs(30)).await;
    register_each_policy(&mesh, &hung.url, Duration::from_secs(20)).await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = session
        .evaluate(
            Batch::new(0)
                .call("a1", "a.x", "{}")
                .call("b1", "b.x", "{}")
                .timeout(Duration::from_millis(400)),
        )
        .await
        .expect("a decision, not DEADLINE_EXCEEDED");
    assert_failure_cancel(&d.calls[0], "fc", "batch deadline");
    assert_bypassed(&d.calls[1], "fo", "batch deadline");
    assert_eq!(status_of(&d, "fc"), TraceStatus::TimedOut);
    assert_eq!(status_of(&d, "fo"), TraceStatus::TimedOut);
    let batches = hung.guard.batches();
    assert_eq!(batches.len(), 2);
    for batch in &batches {
        assert!(
            batch.deadline_ms > 0 && batch.deadline_ms <= 400,
            "R14: the smaller of the guard's 20 s and the batch's 400 ms: {}",
            batch.deadline_ms
        );
    }
}

/// `EvaluateBatch` takes its deadline from the gRPC timeout. A hung
/// fail_closed guard must still yield the fail_closed decision, not a
/// DEADLINE_EXCEEDED from the transport.
#[tokio::test]
async fn hang_unary_batch_gets_a_decision_before_its_grpc_deadline() {
    let mesh = TestMesh::start().await;
    let hung = slow_guard(Duration::from_secs(30)).await;
    mesh.register(
        Registration::validate("fc", &hung.url)
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_secs(20)),
    )
    .await;
    let coordinator = mesh.coordinator().await;
    for turn in 0..3 {
        let d = coordinator
            .evaluate_once(
                "s",
                Batch::new(turn)
                    .call("a1", "a.x", "{}")
                    .timeout(Duration::from_millis(500)),
            )
            .await
            .unwrap_or_else(|e| panic!("turn {turn}: a decision, not {e}"));
        assert_failure_cancel(&d.calls[0], "fc", "unary");
        assert_eq!(status_of(&d, "fc"), TraceStatus::TimedOut);
    }
}

#[tokio::test]
async fn hang_remaining_batch_budget_shrinks_across_mutate_guards() {
    let mesh = TestMesh::start().await;
    let first = slow_guard(Duration::from_millis(300)).await;
    // When the second mutate guard is asked, the first has already answered
    // (R10: one after another).
    let first_answered_when_second_asked = Arc::new(Mutex::new(Vec::new()));
    let second = script_guard({
        let first = first.guard.clone();
        let seen = first_answered_when_second_asked.clone();
        move |_| {
            seen.lock()
                .unwrap()
                .push(first.answered.load(Ordering::SeqCst));
            Script::default()
        }
    })
    .await;
    let validate = proceed_guard().await;
    mesh.register(Registration::mutate("m1", &first.url, ["t"]).timeout(Duration::from_secs(20)))
        .await;
    mesh.register(Registration::mutate("m2", &second.url, ["t"]).timeout(Duration::from_secs(20)))
        .await;
    mesh.register(Registration::validate("v", &validate.url).timeout(Duration::from_secs(20)))
        .await;
    let (_session, d) = mesh
        .session_decides(timed_batch(0, Duration::from_secs(3)))
        .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
    assert_eq!(*first_answered_when_second_asked.lock().unwrap(), [1]);
    let m1 = first.guard.batches()[0].deadline_ms;
    let m2 = second.guard.batches()[0].deadline_ms;
    let v = validate.guard.batches()[0].deadline_ms;
    assert!(
        0 < m1 && m1 <= 3000,
        "the first guard gets the batch's budget: {m1}"
    );
    assert!(
        m2 < m1,
        "the slow first guard leaves the second less: m1 {m1}, m2 {m2}"
    );
    assert!(
        v <= m2,
        "and the validate guards what is left: m2 {m2}, v {v}"
    );
}

#[tokio::test]
async fn hang_exhausted_batch_budget_fails_later_guards_without_contacting_them() {
    let mesh = TestMesh::start().await;
    let hung = slow_guard(Duration::from_secs(30)).await;
    let later = proceed_guard().await;
    let validate = proceed_guard().await;
    mesh.register(
        Registration::mutate("m1", &hung.url, ["t"])
            .failure_policy(FailurePolicy::FailOpen)
            .timeout(Duration::from_secs(20)),
    )
    .await;
    mesh.register(
        Registration::mutate("m2", &later.url, ["t"])
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_secs(20)),
    )
    .await;
    mesh.register(Registration::validate("v", &validate.url).timeout(Duration::from_secs(20)))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = session
        .evaluate(timed_batch(0, Duration::from_millis(400)))
        .await
        .expect("a decision, not DEADLINE_EXCEEDED");
    // m1 used the whole budget and was bypassed (fail_open); nothing was left
    // for m2, which fails closed without being asked; v never sees the call.
    let call = &d.calls[0];
    assert_failure_cancel(call, "m2", "exhausted budget");
    assert_eq!(call.bypassed, ["m1"], "{call:?}");
    assert_eq!(status_of(&d, "m1"), TraceStatus::TimedOut);
    assert_eq!(status_of(&d, "m2"), TraceStatus::TimedOut);
    assert_eq!(status_of(&d, "v"), TraceStatus::NotApplicable);
    assert_eq!(hung.guard.requests(), 1);
    assert_eq!(later.guard.requests(), 0, "no budget left: not contacted");
    assert_eq!(validate.guard.requests(), 0);
}

#[tokio::test]
async fn hang_guard_for_some_tools_does_not_delay_batches_that_do_not_need_it() {
    let mesh = TestMesh::start().await;
    let held = held_guard().await;
    let other = proceed_guard().await;
    mesh.register(
        Registration::validate("held", &held.url)
            .tools(["slow.*"])
            .timeout(Duration::from_secs(60)),
    )
    .await;
    mesh.register(Registration::validate("other", &other.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let one = coordinator.session("one").await.unwrap();
    let two = coordinator.session("two").await.unwrap();
    let slow = one.evaluate(
        Batch::new(0)
            .call("s1", "slow.op", "{}")
            .timeout(Duration::from_secs(60)),
    );
    tokio::pin!(slow);
    // Let the slow batch reach the held guard (polling the batch meanwhile).
    let reached = tokio::select! {
        biased;
        _ = &mut slow => panic!("the held batch was answered before release"),
        reached = eventually_within(500, || held.guard.requests() == 1) => reached,
    };
    assert!(reached, "the slow batch reached the held guard");
    // Other batches, on the same stream and on another, complete while the
    // slow one is still held.
    for i in 0..10 {
        let session = if i % 2 == 0 { &one } else { &two };
        let fast = session.evaluate(Batch::new(1 + i).call(format!("f{i}"), "fast.op", "{}"));
        let d = tokio::select! {
            biased;
            _ = &mut slow => panic!("the held batch finished before fast batch {i}"),
            d = fast => d.unwrap(),
        };
        assert!(d.calls[0].proceeds());
        assert_eq!(status_of(&d, "held"), TraceStatus::NotApplicable);
    }
    // A batch that does need the held guard waits for it like the first.
    let mixed = two.evaluate(
        Batch::new(50)
            .call("m1", "fast.op", "{}")
            .call("m2", "slow.op", "{}")
            .timeout(Duration::from_secs(60)),
    );
    tokio::pin!(mixed);
    let reached = tokio::select! {
        biased;
        _ = &mut mixed => panic!("the mixed batch was answered before release"),
        reached = eventually_within(500, || held.guard.requests() == 2) => reached,
    };
    assert!(reached);
    held.guard.release();
    let d = slow.await.unwrap();
    assert!(d.calls[0].proceeds());
    assert_eq!(status_of(&d, "held"), TraceStatus::Proceeded);
    let d = mixed.await.unwrap();
    assert!(d.calls.iter().all(|c| c.proceeds()));
    assert_eq!(status_of(&d, "held"), TraceStatus::Proceeded);
}

// ---------------------------------------------------------------------------
// 4. Spurious replies
// ---------------------------------------------------------------------------

fn spurious(mesh: &TestMesh, guard: &str) -> f64 {
    metric(
        mesh,
        &format!("guardmesh_guard_spurious_answers_total{{guard=\"{guard}\"}}"),
    )
}

#[tokio::test]
async fn spurious_late_verdict_for_a_decided_batch_is_ignored_and_counted() {
    let mesh = TestMesh::start().await;
    // The guard ignores cancels. It never answers batch "b1" in time; when
    // batch "b2" arrives it first sends its (late) proceed for b1, then skips
    // b2's call. For "b3" it skips, then answers the same request a second
    // time with a proceed.
    let ids: Arc<Mutex<Vec<u64>>> = Arc::default();
    let guard = raw_script_guard({
        let ids = ids.clone();
        move |batch: &GuardBatch| {
            let mut ids = ids.lock().unwrap();
            ids.push(batch.request_id);
            let call = batch.calls[0].call_id.clone();
            match batch.batch_id.as_str() {
                "b1" => Vec::new(),
                "b2" => vec![
                    RawSend::now(JudgeResponse {
                        request_id: ids[0],
                        verdicts: vec![proceed("c1")],
                        partial: false,
                        error: String::new(),
                    }),
                    RawSend::now(final_answer(batch, vec![steer(&call, "b2 skipped")])),
                ],
                "b3" => vec![
                    RawSend::now(final_answer(batch, vec![steer(&call, "b3 skipped")])),
                    RawSend::now(final_answer(batch, vec![proceed(&call)])),
                ],
                _ => vec![RawSend::now(final_answer(batch, Vec::new()))],
            }
        }
    })
    .await;
    mesh.register(
        Registration::validate("late", &guard.url)
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_millis(200)),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let raw = |batch_id: &str| EvaluateRequest {
        batch_id: batch_id.into(),
        calls: vec![ToolCall {
            call_id: "c1".into(),
            tool: "t".into(),
            arguments: "{}".into(),
        }],
        timeout_ms: 10_000,
        ..Default::default()
    };
    let d1 = session.evaluate_raw(raw("b1")).await.unwrap();
    assert_failure_cancel(&d1.calls[0], "late", "b1");
    assert_eq!(status_of(&d1, "late"), TraceStatus::TimedOut);
    assert_eq!(spurious(&mesh, "late"), 0.0);

    // b1's late proceed arrives while b2 is waiting, on the same stream:
    // it is not taken for b2's answer.
    let d2 = session.evaluate_raw(raw("b2")).await.unwrap();
    assert_skip(&d2.calls[0], "late", &steer_outcome("b2 skipped"), "b2");
    assert_eq!(
        spurious(&mesh, "late"),
        1.0,
        "the late answer is counted, by the time b2 (answered after it) is decided"
    );

    // A second answer to a decided request never turns its skip into a
    // proceed.
    let d3 = session.evaluate_raw(raw("b3")).await.unwrap();
    assert_skip(&d3.calls[0], "late", &steer_outcome("b3 skipped"), "b3");
    assert!(
        eventually_within(250, || spurious(&mesh, "late") == 2.0).await,
        "the second answer is counted: {}",
        spurious(&mesh, "late")
    );
    let d4 = session.evaluate_raw(raw("b4")).await.unwrap();
    assert!(
        d4.calls[0].proceeds(),
        "the stream goes on: {:?}",
        d4.calls[0]
    );
    assert_eq!(status_of(&d4, "late"), TraceStatus::Proceeded);
    assert_eq!(
        guard.guard.cancels(),
        [ids.lock().unwrap()[0]],
        "b1 was withdrawn"
    );
}

#[tokio::test]
async fn spurious_answers_for_unknown_request_ids_are_ignored_and_counted() {
    let mesh = TestMesh::start().await;
    // Before each real answer, noise: final and partial answers, proceeds,
    // skips and errors, for request ids that were never sent.
    let guard = raw_script_guard(|batch: &GuardBatch| {
        use rand::Rng;
        let mut rng = rand::rng();
        let all_proceed: Vec<Verdict> = batch.calls.iter().map(|c| proceed(&c.call_id)).collect();
        let all_skip: Vec<Verdict> = batch
            .calls
            .iter()
            .map(|c| steer(&c.call_id, "noise"))
            .collect();
        let unknown = |rng: &mut rand::rngs::ThreadRng| {
            batch.request_id + 1_000_000 + rng.random_range(0..u64::from(u32::MAX))
        };
        let noise = [
            (0, all_proceed.clone(), false, ""),
            (unknown(&mut rng), all_proceed.clone(), false, ""),
            (unknown(&mut rng), all_skip, true, ""),
            (unknown(&mut rng), Vec::new(), false, "noise error"),
            (u64::MAX, all_proceed, false, ""),
        ];
        let mut sends: Vec<RawSend> = noise
            .into_iter()
            .map(|(request_id, verdicts, partial, error)| {
                RawSend::now(JudgeResponse {
                    request_id,
                    verdicts,
                    partial,
                    error: error.into(),
                })
            })
            .collect();
        let verdicts = batch
            .calls
            .iter()
            .filter(|c| c.tool == "deny")
            .map(|c| steer(&c.call_id, "real skip"))
            .collect();
        sends.push(RawSend::now(final_answer(batch, verdicts)));
        sends
    })
    .await;
    mesh.register(Registration::validate("g", &guard.url).timeout(Duration::from_secs(5)))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    for turn in 0..3 {
        let d = session
            .evaluate(
                Batch::new(turn)
                    .call("c1", "deny", "{}")
                    .call("c2", "ok", "{}")
                    .timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap();
        assert_skip(&d.calls[0], "g", &steer_outcome("real skip"), "unknown ids");
        assert!(d.calls[1].proceeds(), "{:?}", d.calls[1]);
        assert_eq!(status_of(&d, "g"), TraceStatus::Skipped);
        assert_eq!(
            spurious(&mesh, "g"),
            f64::from(5 * (turn + 1)),
            "every answer for an unknown request is counted"
        );
    }
}

fn skip_with_kind(call_id: &str, kind: i32) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(verdict::Outcome::Skip(Skip {
            content: format!("kind {kind}"),
            kind,
        })),
    }
}

#[tokio::test]
async fn spurious_unknown_skip_kind_is_still_a_skip_read_as_steer() {
    for mutate in [false, true] {
        let mesh = TestMesh::start().await;
        let guard = call_guard(Duration::ZERO, |c| match c.tool.as_str() {
            "seven" => Some(skip_with_kind(&c.call_id, 7)),
            "negative" => Some(skip_with_kind(&c.call_id, -3)),
            "max" => Some(skip_with_kind(&c.call_id, i32::MAX)),
            _ => None,
        })
        .await;
        let registration = if mutate {
            Registration::mutate("g", &guard.url, ["*"])
        } else {
            Registration::validate("g", &guard.url)
        };
        mesh.register(registration.failure_policy(FailurePolicy::FailOpen))
            .await;
        let (_session, d) = mesh
            .session_decides(
                Batch::new(0)
                    .call("c1", "seven", "{}")
                    .call("c2", "negative", "{}")
                    .call("c3", "max", "{}")
                    .call("c4", "fine", "{}"),
            )
            .await;
        let what = if mutate { "mutate" } else { "validate" };
        for (call, kind) in d.calls.iter().zip([7, -3, i32::MAX]) {
            assert_skip(call, "g", &steer_outcome(&format!("kind {kind}")), what);
            assert!(call.bypassed.is_empty(), "{what}: {call:?}");
        }
        assert!(d.calls[3].proceeds());
        assert_eq!(status_of(&d, "g"), TraceStatus::Skipped, "{what}");
        let run: Vec<_> = d.execute.iter().map(|c| c.call_id.as_str()).collect();
        assert_eq!(run, ["c4"], "{what}");
    }
}

#[tokio::test]
async fn spurious_unknown_enum_values_in_a_registration_are_refused() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    let registrar = mesh.registrar().await;
    let before = registrar.list().await.unwrap();
    for (field, value) in [("role", 5), ("failure_policy", 7), ("mode", -1)] {
        let mut spec = Registration::validate("g", &guard.url).build();
        match field {
            "role" => spec.role = value,
            "failure_policy" => spec.failure_policy = value,
            _ => spec.mode = value,
        }
        let err = registrar.register(spec).await.expect_err(field);
        assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{field}");
        assert!(err.to_string().contains(field), "{field}: {err}");
    }
    assert_eq!(registrar.list().await.unwrap(), before);
}

// ---------------------------------------------------------------------------
// 5. Oversized messages
// ---------------------------------------------------------------------------

#[tokio::test]
async fn oversized_coordinator_batch_is_refused_alone_and_the_stream_goes_on() {
    let _heavy = HEAVY.lock().await;
    let mut config = fast_config();
    config.limits.max_batch_bytes = 64 * 1024;
    config.limits.max_calls_per_batch = 8;
    let mesh = TestMesh::with_config(config).await;
    let guard = call_guard(Duration::ZERO, |c| {
        (c.tool == "deny").then(|| steer(&c.call_id, "no"))
    })
    .await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let other = coordinator.session("other").await.unwrap();
    let big = serde_json::json!({ "blob": "x".repeat(100 * 1024) }).to_string();
    for turn in 0..3 {
        // An oversized batch and a normal one in flight together.
        let oversized = session.evaluate(Batch::new(turn).call("huge", "t", big.clone()));
        let normal = session.evaluate(Batch::new(turn).call("c1", "deny", "{}"));
        let too_many = (0..9).fold(Batch::new(turn), |b, i| b.call(format!("m{i}"), "t", "{}"));
        let too_many = other.evaluate(too_many);
        let (oversized, normal, too_many) = tokio::join!(oversized, normal, too_many);
        let err = oversized.expect_err("oversized");
        assert_eq!(err.code(), Some(tonic::Code::ResourceExhausted), "{err}");
        assert!(err.to_string().contains("limit"), "{err}");
        let err = too_many.expect_err("too many calls");
        assert_eq!(err.code(), Some(tonic::Code::ResourceExhausted), "{err}");
        let d = normal.unwrap();
        assert_skip(&d.calls[0], "g", &steer_outcome("no"), "normal batch");
        // The next batch on the same streams is served.
        let d = session
            .evaluate(Batch::new(turn).call("c2", "ok", "{}"))
            .await
            .unwrap();
        assert!(d.calls[0].proceeds());
        let d = other
            .evaluate(Batch::new(turn).call("c3", "ok", "{}"))
            .await
            .unwrap();
        assert!(d.calls[0].proceeds());
    }
    assert!(
        guard.guard.batches().iter().all(|b| b
            .calls
            .iter()
            .all(|c| c.call_id != "huge" && !c.call_id.starts_with('m'))),
        "no guard sees a refused batch"
    );
    assert_eq!(
        metric(
            &mesh,
            "guardmesh_batches_refused_total{reason=\"batch_too_large\"}"
        ),
        3.0
    );
}

/// A message larger than even the transport limit (16 MiB here) cannot be
/// read, so its batch cannot be answered in-band. The coordinator must still
/// learn why (RESOURCE_EXHAUSTED), not see a clean end of stream, and the
/// mesh goes on serving other streams and new ones.
#[tokio::test]
async fn oversized_coordinator_message_over_the_transport_limit_is_reported_as_resource_exhausted()
{
    let _heavy = HEAVY.lock().await;
    let mut config = fast_config();
    config.limits.max_batch_bytes = 64 * 1024;
    let mesh = TestMesh::with_config(config).await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let other = coordinator.session("other").await.unwrap();
    let huge = serde_json::json!({ "blob": "x".repeat(17 << 20) }).to_string();
    let err = session
        .evaluate(Batch::new(0).call("huge", "t", huge))
        .await
        .expect_err("a 17 MiB batch cannot be judged");
    let d = other
        .evaluate(Batch::new(0).call("c1", "t", "{}"))
        .await
        .expect("another stream on the same connection is unaffected");
    assert!(d.calls[0].proceeds());
    let again = coordinator.session("again").await.unwrap();
    let d = again
        .evaluate(Batch::new(0).call("c1", "t", "{}"))
        .await
        .expect("a new stream is served");
    assert!(d.calls[0].proceeds());
    assert_eq!(
        err.code(),
        Some(tonic::Code::ResourceExhausted),
        "the coordinator learns why its batch got no decision: {err:?}"
    );
}

#[tokio::test]
async fn oversized_guard_answer_fails_that_guard_per_policy_then_it_reconnects() {
    let _heavy = HEAVY.lock().await;
    let mut config = restart_config();
    config.link.max_decoding_message_size = 64 * 1024;
    let mesh = TestMesh::with_config(config).await;
    let guard = call_guard(Duration::ZERO, |c| {
        if c.arguments.contains("big") {
            Some(steer(&c.call_id, "x".repeat(100 * 1024)))
        } else if c.arguments.contains("deny") {
            Some(steer(&c.call_id, "small"))
        } else {
            None
        }
    })
    .await;
    mesh.register(
        Registration::validate("fc", &guard.url)
            .tools(["a.*"])
            .failure_policy(FailurePolicy::FailClosed),
    )
    .await;
    mesh.register(
        Registration::validate("fo", &guard.url)
            .tools(["b.*"])
            .failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let judged = |d: &BatchDecision| {
        d.calls
            .iter()
            .all(|c| c.outcome == steer_outcome("small") && !c.failure)
    };
    // Warm up: both links judge.
    let normal = || {
        Batch::new(0)
            .call("a1", "a.x", r#"{"m":"deny"}"#)
            .call("b1", "b.x", r#"{"m":"deny"}"#)
            .timeout(Duration::from_secs(5))
    };
    let d = session.evaluate(normal()).await.unwrap();
    assert!(judged(&d), "{:?}", d.calls);

    for round in 0..2 {
        let what = format!("round {round}");
        let d = session
            .evaluate(
                Batch::new(1)
                    .call("a1", "a.x", r#"{"m":"big"}"#)
                    .call("b1", "b.x", r#"{"m":"big"}"#)
                    .call("z1", "z.x", "{}")
                    .timeout(Duration::from_secs(5)),
            )
            .await
            .unwrap_or_else(|e| panic!("{what}: a decision for the batch: {e}"));
        assert_failure_cancel(&d.calls[0], "fc", &what);
        assert_bypassed(&d.calls[1], "fo", &what);
        assert!(d.calls[2].proceeds());
        assert_eq!(status_of(&d, "fc"), TraceStatus::Failed, "{what}");
        assert!(!trace_error(&d, "fc").is_empty(), "{what}");
        // The guard is redialled; until it is, batches fail per policy, and
        // then the next batch is judged normally.
        let mut recovered = false;
        for _ in 0..200 {
            let d = session.evaluate(normal()).await.unwrap();
            if judged(&d) {
                recovered = true;
                break;
            }
            for (call, guard) in d.calls.iter().zip(["fc", "fo"]) {
                if call.outcome != steer_outcome("small") {
                    match guard {
                        "fc" => assert_failure_cancel(call, guard, &what),
                        _ => assert_bypassed(call, guard, &what),
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            recovered,
            "{what}: the guard judges again after reconnecting"
        );
    }
}

// ---------------------------------------------------------------------------
// 6. Guard process killed and restarted
// ---------------------------------------------------------------------------

/// One round against the `veto-marker` process registered as `closed`
/// (fail_closed, `a.*`) and `open` (fail_open, `b.*`). Every round gets a
/// decision within its deadline (never DEADLINE_EXCEEDED or another error).
async fn restart_round(session: &Session, turn: u32) -> BatchDecision {
    session
        .evaluate(
            Batch::new(turn)
                .call("a1", "a.x", r#"{"note":"veto"}"#)
                .call("a2", "a.x", "{}")
                .call("b1", "b.x", r#"{"note":"veto"}"#)
                .call("b2", "b.x", "{}")
                .timeout(Duration::from_millis(1500)),
        )
        .await
        .unwrap_or_else(|e| panic!("turn {turn}: every batch gets a decision: {e}"))
}

/// Whether the round was judged by the live process.
fn judged_by_process(d: &BatchDecision) -> bool {
    let vetoed = steer_outcome("vetoed by marker");
    d.calls[0].outcome == vetoed
        && d.calls[1].proceeds()
        && d.calls[2].outcome == vetoed
        && d.calls[3].proceeds()
        && d.calls.iter().all(|c| !c.failure && c.bypassed.is_empty())
}

/// Whether every call failed per policy (the process is down).
fn assert_down_round(d: &BatchDecision, what: &str) {
    assert_failure_cancel(&d.calls[0], "closed", what);
    assert_failure_cancel(&d.calls[1], "closed", what);
    assert_bypassed(&d.calls[2], "open", what);
    assert_bypassed(&d.calls[3], "open", what);
}

/// Each call either judged by the process or failed per policy; never a
/// proceed for a call the process would veto unless bypassed (fail_open).
fn assert_judged_or_failed(d: &BatchDecision, what: &str) {
    let vetoed = steer_outcome("vetoed by marker");
    for (call, guard) in d.calls.iter().zip(["closed", "closed", "open", "open"]) {
        let judged = if call.call_id.ends_with('1') {
            call.outcome == vetoed && !call.failure
        } else {
            call.proceeds() && call.bypassed.is_empty()
        };
        if !judged {
            match guard {
                "closed" => assert_failure_cancel(call, guard, what),
                _ => assert_bypassed(call, guard, what),
            }
        }
    }
}

/// The fast test config, with a circuit breaker that opens after 5
/// consecutive failures and lets a probe through after 300 ms: a guard that
/// comes back is found again quickly, through the half-open probe.
fn restart_config() -> guardmesh_server::MeshConfig {
    let mut config = fast_config();
    config.link.circuit_failures = 5;
    config.link.circuit_open_for = Duration::from_millis(300);
    config
}

#[tokio::test]
async fn restart_killed_guard_process_fails_per_policy_while_down_then_judges_again() {
    let mesh = TestMesh::with_config(restart_config()).await;
    let mut process = GuardProcess::start("veto-marker", 0, &[]);
    let port = process.port;
    for (name, tools, policy) in [
        ("closed", "a.*", FailurePolicy::FailClosed),
        ("open", "b.*", FailurePolicy::FailOpen),
    ] {
        // The guard's timeout exceeds the batch's deadline: the batch's
        // deadline is what bounds every wait.
        mesh.register(
            Registration::validate(name, &process.url)
                .tools([tools])
                .failure_policy(policy)
                .timeout(Duration::from_secs(10)),
        )
        .await;
    }
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let mut turn = 0;
    let d = restart_round(&session, turn).await;
    assert!(judged_by_process(&d), "{:?}", d.calls);
    for cycle in 0..2 {
        process.kill();
        // R15: down is not missing. Every round is answered, per policy.
        for _ in 0..5 {
            turn += 1;
            let d = restart_round(&session, turn).await;
            assert_down_round(&d, &format!("cycle {cycle}, down, turn {turn}"));
            for guard in ["closed", "open"] {
                assert!(
                    matches!(
                        status_of(&d, guard),
                        TraceStatus::Failed | TraceStatus::TimedOut
                    ),
                    "{:?}",
                    d.trace
                );
            }
        }
        // Restarted on the same port: the mesh redials (bounded backoff
        // with jitter) and judges with it again.
        process =
            tokio::task::spawn_blocking(move || GuardProcess::start("veto-marker", port, &[]))
                .await
                .unwrap();
        assert_eq!(process.port, port);
        let mut recovered = false;
        for _ in 0..200 {
            turn += 1;
            let d = restart_round(&session, turn).await;
            if judged_by_process(&d) {
                recovered = true;
                break;
            }
            assert_judged_or_failed(&d, &format!("cycle {cycle}, reconnecting, turn {turn}"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            recovered,
            "cycle {cycle}: the mesh reconnects to the restarted guard"
        );
        for _ in 0..3 {
            turn += 1;
            let d = restart_round(&session, turn).await;
            assert!(judged_by_process(&d), "cycle {cycle}: {:?}", d.calls);
        }
    }
}

#[tokio::test]
async fn restart_guard_process_killed_with_a_batch_in_flight_fails_that_batch_per_policy() {
    let mesh = TestMesh::start().await;
    let mut process = GuardProcess::start("allow", 0, &["--delay-ms", "20000"]);
    let probe = proceed_guard().await;
    mesh.register(
        Registration::validate("proc", &process.url)
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_secs(30)),
    )
    .await;
    mesh.register(Registration::validate("probe", &probe.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let batch = session.evaluate(timed_batch(0, Duration::from_secs(30)));
    tokio::pin!(batch);
    // Validate guards are asked together: once the probe has the batch, so
    // has the process.
    let reached = tokio::select! {
        biased;
        _ = &mut batch => panic!("answered before the process was killed"),
        reached = eventually_within(500, || probe.guard.requests() == 1) => reached,
    };
    assert!(reached);
    process.kill();
    let d = batch.await.expect("a decision, not an error");
    assert_failure_cancel(&d.calls[0], "proc", "killed mid-batch");
    assert_eq!(
        status_of(&d, "proc"),
        TraceStatus::Failed,
        "the broken stream fails the batch at once, not at its deadline"
    );
}

// ---------------------------------------------------------------------------
// 7. R23: a verdict the mesh cannot read is not a proceed
// ---------------------------------------------------------------------------

/// How a newer guard might answer a call: hand-encoded `Verdict`s with a
/// field this mesh does not know.
fn newer_verdicts(call_id: &str, variant: &str) -> (Vec<u8>, bool) {
    let mut outcome = Vec::new();
    let mut partial = false;
    match variant {
        // Field 9 (unknown: 4 is `labels`): a message, as a new outcome would be.
        "new outcome message" => {
            let mut defer = Vec::new();
            raw_pb::bytes_field(&mut defer, 1, b"ask the user first");
            raw_pb::bytes_field(&mut outcome, 9, &defer);
        }
        // Field 9 as a bare varint (a new enum-valued outcome).
        "new outcome varint" => raw_pb::varint_field(&mut outcome, 9, 1),
        // The same, in a partial answer: the request fails at once.
        "new outcome in a partial answer" => {
            raw_pb::bytes_field(&mut outcome, 9, b"");
            partial = true;
        }
        other => panic!("unknown variant {other}"),
    }
    (raw_pb::verdict(call_id, &outcome), partial)
}

#[tokio::test]
async fn r23_unknown_verdict_outcome_fails_the_guard_per_its_policy() {
    for variant in [
        "new outcome message",
        "new outcome varint",
        "new outcome in a partial answer",
    ] {
        let mesh = TestMesh::start().await;
        let guard = raw_bytes_guard(move |batch| {
            let mut partial = false;
            let verdicts: Vec<Vec<u8>> = batch
                .calls
                .iter()
                .map(|c| {
                    let (verdict, p) = newer_verdicts(&c.call_id, variant);
                    partial |= p;
                    verdict
                })
                .collect();
            let mut extra = Vec::new();
            if partial {
                raw_pb::varint_field(&mut extra, 3, 1);
            }
            vec![raw_pb::judge_response(batch.request_id, &verdicts, &extra)]
        })
        .await;
        register_each_policy(&mesh, &guard.url, Duration::from_secs(5)).await;
        let session = mesh.coordinator().await.session("s").await.unwrap();
        assert_each_policy_fails(&session, variant, 2, &[TraceStatus::Failed], "field 9").await;
        // The guard failed on its answers, not on its streams: one per
        // registered name, never reopened.
        assert_eq!(guard.streams.load(Ordering::SeqCst), 3, "{variant}");
    }
}

#[tokio::test]
async fn r23_unknown_fields_outside_a_verdict_are_ignored() {
    let mesh = TestMesh::start().await;
    let guard = raw_bytes_guard(|batch| {
        let verdicts: Vec<Vec<u8>> = batch
            .calls
            .iter()
            .filter(|c| c.tool == "fs.delete")
            .map(|c| {
                // A skip carrying a field of its own: the skip stands.
                let mut inside = Vec::new();
                raw_pb::bytes_field(&mut inside, 9, b"policy-17");
                raw_pb::verdict(&c.call_id, &raw_pb::skip_outcome("no deletes", &inside))
            })
            .collect();
        // New top-level fields of JudgeResponse, before and after.
        let mut extra = Vec::new();
        raw_pb::bytes_field(&mut extra, 5, b"guard-version 2");
        raw_pb::varint_field(&mut extra, 6, 42);
        raw_pb::bytes_field(&mut extra, 1000, &[1, 2, 3]);
        vec![raw_pb::judge_response(batch.request_id, &verdicts, &extra)]
    })
    .await;
    mesh.register(
        Registration::validate("g", &guard.url)
            .failure_policy(FailurePolicy::FailOpen)
            .timeout(Duration::from_secs(5)),
    )
    .await;
    let (_session, d) = mesh
        .session_decides(
            Batch::new(0)
                .call("c1", "fs.delete", "{}")
                .call("c2", "fs.read", "{}"),
        )
        .await;
    assert_skip(
        &d.calls[0],
        "g",
        &steer_outcome("no deletes"),
        "unknown fields outside",
    );
    assert!(d.calls[0].bypassed.is_empty(), "{:?}", d.calls[0]);
    assert!(d.calls[1].proceeds() && d.calls[1].bypassed.is_empty());
    assert_eq!(status_of(&d, "g"), TraceStatus::Skipped);
    assert_eq!(trace_error(&d, "g"), "");
}

// ---------------------------------------------------------------------------
// 8. R25: a guard that never reads its stream holds bounded memory
// ---------------------------------------------------------------------------

/// Measures (or sets) what the whole process owns: runs alone in a child
/// process of the test binary (see `harness::isolated`).
#[test]
fn r25_guard_that_never_reads_its_stream_holds_bounded_memory_and_fails_per_policy() {
    isolated(
        "faults::r25_guard_that_never_reads_its_stream_holds_bounded_memory_and_fails_per_policy_in_own_process",
    );
}

#[tokio::test]
#[ignore = "runs in its own process through r25_guard_that_never_reads_its_stream_holds_bounded_memory_and_fails_per_policy"]
async fn r25_guard_that_never_reads_its_stream_holds_bounded_memory_and_fails_per_policy_in_own_process()
 {
    let _heavy = HEAVY.lock().await;
    const BATCHES: usize = 3000;
    const IN_FLIGHT: usize = 64;
    let mut config = fast_config();
    config.link.circuit_failures = 0;
    let bound = config.link.max_queued_bytes;
    let mesh = TestMesh::with_config(config).await;
    let stuck = never_reading_guard().await;
    mesh.register(
        Registration::validate("stuck", &stuck.url)
            .tools(["upload"])
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_millis(200)),
    )
    .await;
    let canary_guard = call_guard(Duration::ZERO, |c| {
        c.arguments
            .contains("DELETE")
            .then(|| steer(&c.call_id, "no deletes"))
    })
    .await;
    mesh.register(Registration::validate("canary", &canary_guard.url).tools(["sql"]))
        .await;

    // The canary: another coordinator, judged by another guard, meanwhile.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let canary = tokio::spawn({
        let coordinator = mesh.coordinator().await;
        let stop = stop.clone();
        async move {
            let session = coordinator.session("canary").await.unwrap();
            let mut rounds = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let d = session
                    .evaluate(
                        Batch::new(rounds)
                            .call("del", "sql", sql("DELETE FROM t"))
                            .call("sel", "sql", sql("SELECT 1"))
                            .timeout(Duration::from_secs(10)),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("canary round {rounds}: {e}"));
                assert_skip(
                    &d.calls[0],
                    "canary",
                    &steer_outcome("no deletes"),
                    "canary",
                );
                assert!(
                    d.calls[1].proceeds(),
                    "canary round {rounds}: {:?}",
                    d.calls[1]
                );
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            rounds
        }
    });

    let payload = serde_json::json!({ "blob": "x".repeat(64 * 1024) }).to_string();
    let session = mesh.coordinator().await.session("s").await.unwrap();
    // Opens the link before measuring.
    let d = session
        .evaluate(Batch::new(0).call("u", "upload", &payload))
        .await
        .unwrap();
    assert_failure_cancel(&d.calls[0], "stuck", "first batch");
    let before = self_vmrss_bytes();

    use futures::StreamExt;
    let not_reading = std::sync::atomic::AtomicUsize::new(0);
    let shed = std::sync::atomic::AtomicUsize::new(0);
    futures::stream::iter(0..BATCHES)
        .for_each_concurrent(IN_FLIGHT, |i| {
            let session = &session;
            let payload = &payload;
            let not_reading = &not_reading;
            let shed = &shed;
            async move {
                let what = format!("batch {i}");
                let answer = session
                    .evaluate(
                        Batch::new(1)
                            .call("u", "upload", payload)
                            .timeout(Duration::from_secs(10)),
                    )
                    .await;
                // While the guard's socket still takes bytes the stream is
                // making progress: a batch past this client's share of the
                // queue is then shed to its own client (R25), never run.
                let d = match answer {
                    Ok(d) => d,
                    Err(e) => {
                        assert_eq!(
                            e.code(),
                            Some(tonic::Code::ResourceExhausted),
                            "{what}: every batch is answered or shed: {e}"
                        );
                        shed.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                };
                assert_failure_cancel(&d.calls[0], "stuck", &what);
                let status = status_of(&d, "stuck");
                assert!(
                    matches!(status, TraceStatus::Failed | TraceStatus::TimedOut),
                    "{what}: {status:?}"
                );
                // Not reading its stream, or (R25, R13) not answering the
                // requests it holds while others wait for room: either way
                // a failure of the guard, never load.
                let error = trace_error(&d, "stuck");
                if error.contains("not reading") || error.contains("makes no progress") {
                    not_reading.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .await;
    let after = self_vmrss_bytes();
    stop.store(true, Ordering::SeqCst);
    let canary_rounds = canary.await.expect("the canary's decisions were correct");

    let grew = after.saturating_sub(before);
    eprintln!(
        "r25 never-reading guard: {BATCHES} x 64 KiB batches, RSS {} -> {} MiB (+{} MiB), \
         queue bound {} MiB, {} failed as not reading, {} shed as busy, canary rounds {canary_rounds}",
        before >> 20,
        after >> 20,
        grew >> 20,
        bound >> 20,
        not_reading.load(Ordering::SeqCst),
        shed.load(Ordering::SeqCst)
    );
    assert!(
        grew < 64 << 20,
        "the mesh grew by {} MiB for a guard that never reads",
        grew >> 20
    );
    // Once the queue is full, batches fail at once with the reason.
    assert!(
        not_reading.load(Ordering::SeqCst) > BATCHES / 2,
        "{} of {BATCHES} failed as not reading",
        not_reading.load(Ordering::SeqCst)
    );
    assert!(canary_rounds > 0, "the canary was judged meanwhile");
    assert_eq!(stuck.streams.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------
// 9. R13: an abort is counted like any other failure
// ---------------------------------------------------------------------------

#[tokio::test]
async fn r13_abort_guard_failure_is_counted_in_guard_outcomes() {
    let mesh = TestMesh::start().await;
    let down = closed_port().await;
    let fine = proceed_guard().await;
    mesh.register(
        Registration::mutate("mab", &down, ["m.*"])
            .tools(["m.*"])
            .failure_policy(FailurePolicy::Abort),
    )
    .await;
    mesh.register(Registration::validate("fine", &fine.url))
        .await;
    mesh.register(
        Registration::validate("ab", &down)
            .tools(["c.*"])
            .failure_policy(FailurePolicy::Abort),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    for (tool, guard) in [("c.x", "ab"), ("m.x", "mab")] {
        let err = session
            .evaluate(Batch::new(0).call("c1", tool, "{}"))
            .await
            .expect_err("abort");
        assert!(err.to_string().contains(&format!("{guard:?}")), "{err}");
        let failed = metric(
            &mesh,
            &format!("guardmesh_guard_outcomes_total{{guard=\"{guard}\",status=\"failed\"}}"),
        );
        assert_eq!(failed, 1.0, "{guard}: {}", mesh.mesh.metrics.encode());
    }
    // The validate guard consulted alongside `ab` is counted too; nothing
    // is counted for guards never reached after `mab` aborted.
    let fine_total: f64 = ["proceeded", "superseded"]
        .iter()
        .map(|s| {
            metric(
                &mesh,
                &format!("guardmesh_guard_outcomes_total{{guard=\"fine\",status=\"{s}\"}}"),
            )
        })
        .sum();
    assert_eq!(fine_total, 1.0, "{}", mesh.mesh.metrics.encode());
    assert_eq!(
        metric(&mesh, "guardmesh_batches_total{outcome=\"aborted\"}"),
        2.0
    );
}

#[tokio::test]
async fn r23_unknown_rewrite_field_fails_a_mutate_guard_and_nothing_is_rewritten() {
    let mesh = TestMesh::start().await;
    let guard = raw_bytes_guard(|batch| {
        let verdicts: Vec<Vec<u8>> = batch
            .calls
            .iter()
            .map(|c| {
                // A rewrite of the arguments plus a field 3 a newer protocol
                // might add (say, "also drop these keys").
                let mut rewrite = Vec::new();
                raw_pb::bytes_field(&mut rewrite, 2, br#"{"path":"/tmp/safe"}"#);
                raw_pb::bytes_field(&mut rewrite, 3, b"drop: secrets");
                let mut outcome = Vec::new();
                raw_pb::bytes_field(&mut outcome, 3, &rewrite);
                raw_pb::verdict(&c.call_id, &outcome)
            })
            .collect();
        vec![raw_pb::judge_response(batch.request_id, &verdicts, &[])]
    })
    .await;
    let later = proceed_guard().await;
    mesh.register(
        Registration::mutate("m", &guard.url, ["fs.*"])
            .tools(["fs.*"])
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_secs(5)),
    )
    .await;
    mesh.register(Registration::validate("v", &later.url)).await;
    let (_session, d) = mesh
        .session_decides(
            Batch::new(0)
                .call("c1", "fs.write", r#"{"path":"/etc/passwd"}"#)
                .call("c2", "net.get", "{}"),
        )
        .await;
    assert_failure_cancel(&d.calls[0], "m", "unknown rewrite field");
    assert!(d.calls[0].rewritten_by.is_empty(), "{:?}", d.calls[0]);
    assert_eq!(d.calls[0].final_call.arguments, r#"{"path":"/etc/passwd"}"#);
    assert!(d.calls[1].proceeds());
    assert_eq!(status_of(&d, "m"), TraceStatus::Failed);
    let error = trace_error(&d, "m");
    assert!(error.contains("Rewrite field 3"), "{error}");
}
