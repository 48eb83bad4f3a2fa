//! Busy is not failed (R25, R13): a healthy guard that judges one batch at a
//! time, slowly, and a client that floods it with large batches. The
//! flood's batches that do not fit the guard link's queue are shed with
//! RESOURCE_EXHAUSTED to that client; no call is ever cancelled for load,
//! the guard's circuit stays closed, and another client's batches are
//! judged by the guard meanwhile. A guard that takes nothing off its stream
//! for its timeout still fails, per its policy.

use crate::harness::*;
use guardmesh_client::proto::FailurePolicy;
use guardmesh_client::proto::guard_service_server::{GuardService, GuardServiceServer};
use guardmesh_client::proto::{JudgeRequest, JudgeResponse, judge_request};
use guardmesh_client::{Batch, BatchDecision, Coordinator, Outcome, Registration};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tonic::Status;

/// A guard that reads one batch off its stream, takes `delay` over it,
/// answers, and only then reads the next: a slow single-worker guard. It
/// steers every call to the tool `forbidden` and proceeds the others.
struct SerialGuard {
    delay: Duration,
    judged: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl GuardService for SerialGuard {
    type JudgeStream = tokio_stream::wrappers::ReceiverStream<Result<JudgeResponse, Status>>;

    async fn judge(
        &self,
        request: tonic::Request<tonic::Streaming<JudgeRequest>>,
    ) -> Result<tonic::Response<Self::JudgeStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let delay = self.delay;
        let judged = self.judged.clone();
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                let Some(judge_request::Kind::Batch(batch)) = message.kind else {
                    continue;
                };
                tokio::time::sleep(delay).await;
                let verdicts = batch
                    .calls
                    .iter()
                    .filter(|c| c.tool == "forbidden")
                    .map(|c| guardmesh_client::verdict::steer(&c.call_id, "not that one"))
                    .collect();
                judged.fetch_add(1, Ordering::SeqCst);
                if tx.send(Ok(final_answer(&batch, verdicts))).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// Serves a [`SerialGuard`] on loopback; its URL and its count of batches
/// judged.
async fn serial_guard(delay: Duration) -> (String, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let judged = Arc::new(AtomicUsize::new(0));
    let service = SerialGuard {
        delay,
        judged: judged.clone(),
    };
    let (url, task) =
        serve_guard_service(GuardServiceServer::new(service).max_decoding_message_size(32 << 20))
            .await;
    (url, judged, task)
}

fn trace_status(d: &BatchDecision, guard: &str) -> Option<guardmesh_client::proto::TraceStatus> {
    d.status(guard)
}

/// The victim's batch: one call the guard steers, one it proceeds.
async fn victim_round(coordinator: &Coordinator, round: u32) -> BatchDecision {
    coordinator
        .evaluate_once(
            "victim",
            Batch::new(round)
                .call("bad", "forbidden", "{}")
                .call("ok", "read", "{}")
                .timeout(Duration::from_secs(30)),
        )
        .await
        .unwrap_or_else(|e| panic!("victim round {round}: every batch is judged: {e}"))
}

fn assert_judged_by_guard(d: &BatchDecision, what: &str) {
    assert_eq!(
        d.calls[0].outcome,
        steered("not that one"),
        "{what}: {:?}",
        d.calls[0]
    );
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("slow"), "{what}");
    assert!(!d.calls[0].failure, "{what}: {:?}", d.calls[0]);
    assert!(d.calls[1].proceeds(), "{what}: {:?}", d.calls[1]);
}

#[tokio::test]
async fn r25_a_busy_guard_sheds_the_flooding_client_and_never_cancels_or_opens_its_circuit() {
    const FLOOD: usize = 16;
    let mesh = TestMesh::start().await;
    let (url, judged, _guard) = serial_guard(Duration::from_millis(300)).await;
    mesh.register(
        Registration::validate("slow", &url)
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_secs(20)),
    )
    .await;
    let attacker = mesh.coordinator().await;
    let victim = mesh.coordinator().await;
    // The link is open and the guard judges.
    assert_judged_by_guard(&victim_round(&victim, 0).await, "before the flood");

    // ~3.9 MB per batch (4 calls of 0.97 MB, within the mesh's bounds per
    // call and per batch): four fill the link's 16 MiB queue.
    let blob = serde_json::json!({ "blob": "x".repeat(970_000) }).to_string();
    let flood = {
        let attacker = attacker.clone();
        let blob = blob.clone();
        tokio::spawn(async move {
            let rounds = (0..FLOOD).map(|i| {
                let attacker = attacker.clone();
                let blob = blob.clone();
                async move {
                    attacker
                        .evaluate_once(
                            "attacker",
                            Batch::new(i as u32)
                                .call("u1", "upload", &blob)
                                .call("u2", "upload", &blob)
                                .call("u3", "upload", &blob)
                                .call("u4", "upload", &blob)
                                .timeout(Duration::from_secs(30)),
                        )
                        .await
                }
            });
            futures::future::join_all(rounds).await
        })
    };
    // The victim, on its own connection, while the flood is queued.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut victim_rounds = 0;
    for round in 1..=3 {
        let d = victim_round(&victim, round).await;
        assert_judged_by_guard(&d, &format!("victim round {round} during the flood"));
        victim_rounds += 1;
    }
    let results = flood.await.unwrap();

    let mut shed = 0;
    let mut judged_flood = 0;
    for (i, result) in results.iter().enumerate() {
        match result {
            Ok(d) => {
                for call in &d.calls {
                    assert!(
                        call.proceeds(),
                        "flood batch {i}: load is never a cancel: {} got {:?} (trace {:?})",
                        call.call_id,
                        call.outcome,
                        d.trace.iter().map(|t| &t.error).collect::<Vec<_>>()
                    );
                }
                assert_eq!(
                    trace_status(d, "slow"),
                    Some(guardmesh_client::proto::TraceStatus::Proceeded),
                    "flood batch {i}"
                );
                judged_flood += 1;
            }
            Err(e) => {
                assert_shed(e, "slow", &format!("flood batch {i}"));
                shed += 1;
            }
        }
    }
    eprintln!(
        "r25 busy guard: {FLOOD} flood batches of 3.9 MB: {judged_flood} judged, {shed} shed; \
         {victim_rounds} victim rounds judged; guard judged {} batches",
        judged.load(Ordering::SeqCst)
    );
    assert!(shed > 0, "the flood overflowed the link's queue");
    assert!(judged_flood > 0, "the flood's first batches were judged");
    assert_eq!(
        metric(
            &mesh,
            "guardmesh_guard_circuit_opened_total{guard=\"slow\"}"
        ),
        0.0,
        "load never opens a healthy guard's circuit"
    );
    assert_eq!(
        metric(
            &mesh,
            "guardmesh_batches_refused_total{reason=\"guard_busy\"}"
        ),
        shed as f64,
        "each shed batch is counted"
    );
    // The flooding client itself is served again once the flood is over.
    let d = attacker
        .evaluate_once(
            "attacker",
            Batch::new(99)
                .call("bad", "forbidden", "{}")
                .call("ok", "read", "{}"),
        )
        .await
        .unwrap();
    assert_judged_by_guard(&d, "after the flood");
}

#[tokio::test]
async fn r13_a_guard_that_takes_nothing_for_its_timeout_still_fails_as_not_reading() {
    let mut config = fast_config();
    config.link.max_queued_bytes = 1 << 20;
    let mesh = TestMesh::with_config(config).await;
    let stuck = never_reading_guard().await;
    mesh.register(
        Registration::validate("stuck", &stuck.url)
            .failure_policy(FailurePolicy::FailClosed)
            .timeout(Duration::from_millis(300)),
    )
    .await;
    let coordinator = mesh.coordinator().await;
    let blob = serde_json::json!({ "blob": "x".repeat(256 * 1024) }).to_string();
    // Fills the stream's windows and then the queue; the guard takes
    // nothing, so past its timeout a batch that finds the queue full fails
    // at once as not reading, per its policy: never shed as busy.
    let mut not_reading = 0;
    for round in 0..40u32 {
        let d = coordinator
            .evaluate_once(
                "s",
                Batch::new(round)
                    .call("u", "upload", &blob)
                    .timeout(Duration::from_secs(10)),
            )
            .await;
        let d = match d {
            Ok(d) => d,
            Err(e) => {
                // Before the guard has been stuck for its timeout, a full
                // queue is load.
                assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        assert!(
            matches!(d.calls[0].outcome, Outcome::Cancel { .. }) && d.calls[0].failure,
            "round {round}: {:?}",
            d.calls[0]
        );
        let error = d
            .trace
            .iter()
            .find(|t| t.guard == "stuck")
            .map(|t| t.error.clone())
            .unwrap_or_default();
        if error.contains("not reading") {
            not_reading += 1;
            if not_reading == 3 {
                break;
            }
        }
    }
    assert!(
        not_reading >= 3,
        "a guard that reads nothing for its timeout fails as not reading ({not_reading})"
    );
}
