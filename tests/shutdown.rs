//! Graceful shutdown (issue 6, item 9), against the real `guardmesh serve`
//! process: on SIGTERM or SIGINT the mesh stops accepting new connections,
//! finishes the batches in flight with complete decisions, ends every
//! coordinator stream cleanly, and exits with status 0.
//!
//! Every wait is bounded; the tests assert outcomes and their order, never
//! how long something took.

use crate::harness::*;
use guardmesh_client::proto::TraceStatus;
use guardmesh_client::{Batch, BatchDecision, ClientError, Coordinator};
use std::time::Duration;

/// A decision judged to the end by both guards: nothing failed, nothing cut
/// short by the shutdown.
fn assert_complete(d: &BatchDecision, what: &str) {
    assert_eq!(d.calls.len(), 1, "{what}");
    assert!(d.calls[0].proceeds(), "{what}: {:?}", d.calls[0]);
    assert!(
        !d.calls[0].failure && d.calls[0].bypassed.is_empty(),
        "{what}"
    );
    assert_eq!(status_of(d, "slow"), TraceStatus::Proceeded, "{what}");
    assert_eq!(status_of(d, "probe"), TraceStatus::Proceeded, "{what}");
}

async fn drains_on(signal: &str) {
    // The slow guard is a real process; the probe, in this test, tells when
    // the batch is being judged (validate guards are asked together).
    let slow = GuardProcess::start("allow", 0, &["--delay-ms", "2000"]);
    let probe = proceed_guard().await;
    let config = format!(
        r#"
default_batch_timeout_ms = 30000

[[guard]]
name = "slow"
endpoint = "{}"
timeout_ms = 20000
failure_policy = "fail_closed"

[[guard]]
name = "probe"
endpoint = "{}"
timeout_ms = 20000
failure_policy = "fail_closed"
"#,
        slow.url, probe.url
    );
    let mut mesh = MeshProcess::start(signal, &config, None).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();

    let in_flight = session.evaluate(
        Batch::new(0)
            .call("c1", "t", "{}")
            .timeout(Duration::from_secs(30)),
    );
    tokio::pin!(in_flight);
    let reached = while_held(
        &mut in_flight,
        "answered before the slow guard could",
        eventually_within(500, || probe.guard.requests() == 1),
    )
    .await;
    assert!(reached, "the batch reached the guards");

    mesh.signal(signal);

    // Draining: new connections are refused while the batch is in flight.
    let refused = while_held(
        &mut in_flight,
        "the in-flight batch finished before the mesh stopped accepting",
        refuses_new_connections(&mesh.url),
    )
    .await;
    assert!(refused, "the draining mesh refuses new connections");

    // A batch sent on the old stream once draining began is answered: with
    // UNAVAILABLE when the mesh read it while draining (R25), never cut
    // short; or it is left unread when the stream ends cleanly.
    let late = session.evaluate(
        Batch::new(1)
            .call("c1", "t", "{}")
            .timeout(Duration::from_secs(30)),
    );

    // The in-flight batch gets its complete decision.
    let d = in_flight
        .await
        .unwrap_or_else(|e| panic!("the in-flight batch: {e}\n{}", mesh.log()));
    assert_complete(&d, "in-flight batch");
    match late.await {
        Ok(d) => assert_complete(&d, "batch sent while draining"),
        Err(ClientError::SessionClosed(_) | ClientError::NotJudged { .. }) => {}
        Err(ClientError::Status(status)) if status.code() == tonic::Code::Unavailable => {}
        Err(e) => panic!("a batch sent while draining: {e:?}\n{}", mesh.log()),
    }

    // The stream ended cleanly: the SDK reports a closed session, not a
    // transport error.
    let next = session
        .evaluate(Batch::new(2).call("c2", "t", "{}"))
        .await
        .expect_err("the stream has ended");
    assert!(
        matches!(next, ClientError::SessionClosed(_)),
        "a clean end of stream, not {next:?}"
    );

    let status = mesh.exit_status().await;
    assert!(
        status.success(),
        "the mesh exits with status 0 after draining, got {status}:\n{}",
        mesh.log()
    );
    assert!(
        Coordinator::connect(mesh.url.clone()).await.is_err(),
        "nothing listens after the exit"
    );
}

#[tokio::test]
async fn shutdown_on_sigterm_finishes_in_flight_batches_and_exits_cleanly() {
    drains_on("TERM").await;
}

#[tokio::test]
async fn shutdown_on_sigint_finishes_in_flight_batches_and_exits_cleanly() {
    drains_on("INT").await;
}

#[tokio::test]
async fn r25_a_draining_stream_answers_every_batch_it_read() {
    let held = held_guard().await;
    let config = held_guard_config(&held.url, 30000, "", 20000);
    let mut mesh = MeshProcess::start("r25-drain", &config, None).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let in_flight = session.evaluate(Batch::new(0).call("c1", "t", "{}"));
    tokio::pin!(in_flight);
    until_held(&mut in_flight, &held.guard).await;
    mesh.signal("TERM");
    refuses_while_held(&mut in_flight, &mesh.url).await;
    // Batches sent on the open stream while it drains: each is read and
    // answered, with an error, while the held batch is still in flight.
    let late = while_held(
        &mut in_flight,
        "answered while held",
        futures::future::join_all(
            (1..=3).map(|turn| session.evaluate(Batch::new(turn).call("c1", "t", "{}"))),
        ),
    )
    .await;
    for answer in late {
        match answer {
            Err(ClientError::Status(status)) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert!(status.message().contains("shutting down"), "{status:?}");
            }
            other => panic!("a batch read while draining is answered UNAVAILABLE: {other:?}"),
        }
    }
    assert_eq!(held.guard.requests(), 1, "no late batch reached the guard");
    held.guard.release();
    let d = in_flight
        .await
        .unwrap_or_else(|e| panic!("the in-flight batch: {e}\n{}", mesh.log()));
    assert!(d.calls[0].proceeds());
    let next = session
        .evaluate(Batch::new(9).call("c", "t", "{}"))
        .await
        .expect_err("the stream has ended");
    // Refused as not judged: the session could not reopen its stream, or
    // reopened it on the draining mesh, which ended it unanswered.
    assert!(next.not_judged(), "{next:?}");
    let status = mesh.exit_status().await;
    assert!(status.success(), "exit status {status}:\n{}", mesh.log());
}
