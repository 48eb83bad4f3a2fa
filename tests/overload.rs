//! Circuit breaking and load shedding (issue 6, items 7 and 8): a failing
//! guard's policy applies at once once its circuit opens, and excess load
//! is refused quickly instead of queueing without bound.

mod common;

use common::*;
use guardmesh_client::proto::{EvaluateRequest, FailurePolicy, ToolCall, TraceStatus};
use guardmesh_client::{Batch, ClientError, Outcome, Registration};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn guard_entry(d: &guardmesh_client::Decision, name: &str) -> guardmesh_client::proto::GuardTrace {
    d.trace.iter().find(|t| t.guard == name).unwrap().clone()
}

#[tokio::test]
async fn circuit_opens_after_repeated_failures_and_fail_closed_still_blocks() {
    let mut config = fast_config();
    config.link.circuit_failures = 3;
    config.link.circuit_open_for = Duration::from_millis(300);
    let mesh = TestMesh::with_config(config).await;
    // Hangs while `hang` is set, proceeds otherwise.
    let hang = Arc::new(AtomicBool::new(true));
    let guard = script_guard({
        let hang = hang.clone();
        move |_| Script {
            delay: if hang.load(Ordering::SeqCst) {
                Duration::from_secs(5)
            } else {
                Duration::ZERO
            },
            ..Default::default()
        }
    })
    .await;
    mesh.register(Registration::validate("hangs", &guard.url).timeout(Duration::from_millis(100)))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    for turn in 0..3 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        assert_eq!(
            guard_entry(&d, "hangs").status,
            TraceStatus::TimedOut as i32
        );
    }
    let sent_before = guard.guard.requests();
    // Open: the policy applies without contacting the guard or waiting.
    let d = session
        .evaluate(Batch::new(3).call("c", "t", "{}"))
        .await
        .unwrap();
    let entry = guard_entry(&d, "hangs");
    assert_eq!(entry.status, TraceStatus::Failed as i32);
    assert!(entry.error.contains("circuit open"), "{}", entry.error);
    assert!(
        matches!(d.calls[0].outcome, Outcome::Cancel { .. }) && d.calls[0].failure,
        "an open circuit on a fail_closed guard means skip, not bypass"
    );
    assert_eq!(
        guard.guard.requests(),
        sent_before,
        "not contacted while open"
    );
    assert!(
        mesh.mesh
            .metrics
            .encode()
            .contains(r#"guardmesh_guard_circuit_opened_total{guard="hangs"} 1"#)
    );

    // The guard recovers; after the open period a half-open probe goes
    // through, succeeds, and the circuit closes.
    hang.store(false, Ordering::SeqCst);
    let mut closed = false;
    for turn in 4..100 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        if d.calls[0].proceeds() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(closed, "a successful probe closes the circuit");
    let d = session
        .evaluate(Batch::new(200).call("c", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
}

#[tokio::test]
async fn circuit_open_under_fail_open_is_recorded_as_bypass() {
    let mut config = fast_config();
    config.link.circuit_failures = 2;
    config.link.circuit_open_for = Duration::from_secs(60);
    let mesh = TestMesh::with_config(config).await;
    let down = closed_port().await;
    mesh.register(Registration::validate("down", &down).failure_policy(FailurePolicy::FailOpen))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let mut saw_open = false;
    for turn in 0..10 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        assert!(d.calls[0].proceeds());
        assert_eq!(d.calls[0].bypassed, ["down"], "a failure is never silent");
        saw_open |= guard_entry(&d, "down").error.contains("circuit open");
    }
    assert!(saw_open);
}

#[tokio::test]
async fn overload_excess_batches_are_refused_quickly_and_every_batch_answered_once() {
    let mut config = fast_config();
    config.limits.max_inflight_batches = 4;
    let mesh = TestMesh::with_config(config).await;
    let slow = script_guard(|_| Script {
        delay: Duration::from_millis(500),
        ..Default::default()
    })
    .await;
    mesh.register(Registration::validate("slow", &slow.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let results = futures::future::join_all((0..24).map(|i| {
        session.evaluate_raw(EvaluateRequest {
            batch_id: format!("b{i}"),
            calls: vec![ToolCall {
                call_id: "c".into(),
                tool: "t".into(),
                arguments: "{}".into(),
            }],
            ..Default::default()
        })
    }))
    .await;
    let mut decided = 0;
    let mut shed = 0;
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok(d) => {
                assert_eq!(d.batch_id, format!("b{i}"));
                assert_eq!(d.calls.len(), 1);
                decided += 1;
            }
            Err(ClientError::Status(status)) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                assert!(status.message().contains("overloaded"), "{status:?}");
                shed += 1;
            }
            Err(other) => panic!("batch b{i}: {other}"),
        }
    }
    assert_eq!(decided + shed, 24, "every batch answered exactly once");
    assert!(
        decided >= 4,
        "the limit's worth of batches are judged: {decided}"
    );
    assert!(shed >= 1, "the excess is shed, not queued");
    assert!(
        slow.guard.requests() <= decided,
        "shed batches reach no guard"
    );
    // Zero-call batches need no slot (R1) and the mesh keeps serving.
    let d = session
        .evaluate(Batch::new(99).call("after", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn overload_flood_keeps_memory_bounded() {
    let mut config = fast_config();
    config.limits.max_inflight_batches = 8;
    config.limits.max_batches_per_stream = 16;
    let mesh = TestMesh::with_config(config).await;
    let slow = script_guard(|_| Script {
        delay: Duration::from_millis(200),
        ..Default::default()
    })
    .await;
    mesh.register(Registration::validate("slow", &slow.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let args = format!(r#"{{"blob":"{}"}}"#, "x".repeat(4000));
    let before = rss_kib();
    let mut peak = before;
    let mut answered = 0usize;
    // 8 sessions x 5 waves x 100 batches = 4,000 batches of ~4 KB each.
    for _wave in 0..5 {
        let waves = (0..8).map(|s| {
            let coordinator = coordinator.clone();
            let args = args.clone();
            async move {
                let session = coordinator.session(format!("flood-{s}")).await.unwrap();
                let all = futures::future::join_all(
                    (0..100).map(|i| session.evaluate(Batch::new(i).call("c", "t", args.clone()))),
                )
                .await;
                all.len()
            }
        });
        answered += futures::future::join_all(waves)
            .await
            .into_iter()
            .sum::<usize>();
        peak = peak.max(rss_kib());
    }
    assert_eq!(answered, 4000);
    let growth_mib = peak.saturating_sub(before) / 1024;
    eprintln!(
        "flood: 4000 batches, RSS {} MiB -> peak {} MiB",
        before / 1024,
        peak / 1024
    );
    assert!(
        growth_mib < 256,
        "RSS grew by {growth_mib} MiB during the flood"
    );
}
