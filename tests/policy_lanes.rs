//! Fair lanes for policy evaluation (R25, R13): one client flooding a
//! policy guard with costly batches neither delays another client's costly
//! batch by more than one batch per evaluation thread, nor makes it fail or
//! be shed; the flooding client's batches past its share of the queue are
//! shed with RESOURCE_EXHAUSTED, never cancelled. Against a real
//! `guardmesh serve` on loopback, each client on a connection of its own.

use crate::harness::*;
use guardmesh_client::proto::{FailurePolicy, TraceStatus};
use guardmesh_client::{Batch, BatchDecision, Coordinator, Registrar, Registration};
use std::time::{Duration, Instant};

/// Quadratic work on a string: legal (within every bound of one call),
/// but hundreds of milliseconds of evaluation per call.
const COSTLY: &str = policy_rule!(name: "costly", action: "steer",
    when: "'call.args.l.exists(a, call.args.l.exists(b, call.args.s.lowerAscii().size() < 0))'",
    message: r#"'"never"'"#);

/// A one-call batch costing the guard about as much as any other.
fn costly_batch(turn: u32) -> Batch {
    costly_calls(turn, 1)
}

/// A batch of `calls` costly calls, `c` the first.
fn costly_calls(turn: u32, calls: usize) -> Batch {
    let l: Vec<u32> = (0..60).collect();
    let args = serde_json::json!({ "l": l, "s": "A".repeat(10_000) }).to_string();
    (0..calls)
        .fold(Batch::new(turn), |batch, i| {
            let id = if i == 0 {
                "c".to_owned()
            } else {
                format!("c{i}")
            };
            batch.call(id, "probe", &args)
        })
        .timeout(Duration::from_secs(60))
}

/// Two coordinators of `mesh`, each on a connection of its own: one
/// floods, the other is its victim.
async fn flooder_and_victim(mesh: &MeshProcess) -> (Coordinator, Coordinator) {
    (
        Coordinator::connect(&mesh.url).await.unwrap(),
        Coordinator::connect(&mesh.url).await.unwrap(),
    )
}

/// How long a costly batch of turn `turn` takes alone, judged (as
/// [`assert_judged`] says).
async fn judged_alone(victim: &Coordinator, turn: u32) -> Duration {
    let started = Instant::now();
    let d = victim
        .evaluate_once("victim", costly_batch(turn))
        .await
        .unwrap();
    let alone = started.elapsed();
    assert_judged(&d, "alone");
    alone
}

/// The batch was judged by the guard and let through: not failed, not
/// bounded, not shed.
fn assert_judged(d: &BatchDecision, what: &str) {
    let call = d.call("c").unwrap();
    assert!(call.proceeds(), "{what}: {call:?}");
    assert!(
        !call.failure && call.bypassed.is_empty(),
        "{what}: {call:?}"
    );
    assert_eq!(d.status("lanes"), Some(TraceStatus::Proceeded), "{what}");
}

#[tokio::test]
async fn r25_a_flooding_client_is_shed_and_another_clients_costly_batch_keeps_its_turn() {
    const FLOOD: usize = 24;
    let _heavy = HEAVY.lock().await;
    let mesh = MeshProcess::start("lanes", "", Some("warn")).await;
    Registrar::connect(&mesh.url)
        .await
        .unwrap()
        .register(
            Registration::policy("lanes", COSTLY)
                .failure_policy(FailurePolicy::FailClosed)
                .timeout(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let (flooder, victim) = flooder_and_victim(&mesh).await;
    // One costly batch alone: what the bound below is made of.
    let alone = judged_alone(&victim, 0).await;

    let flood = {
        let flooder = flooder.clone();
        tokio::spawn(async move {
            let batches = (0..FLOOD).map(|i| {
                let flooder = flooder.clone();
                async move {
                    flooder
                        .evaluate_once("flooder", costly_batch(i as u32))
                        .await
                }
            });
            futures::future::join_all(batches).await
        })
    };
    // The victim's costly batch, once the flood is queued.
    tokio::time::sleep(Duration::from_millis(300) + alone / 4).await;
    let started = Instant::now();
    let d = victim
        .evaluate_once("victim", costly_batch(1))
        .await
        .unwrap_or_else(|e| panic!("the victim's batch is judged, never shed or failed: {e}"));
    let took = started.elapsed();
    assert_judged(&d, "during the flood");
    let results = flood.await.unwrap();

    let mut shed = 0;
    for (i, result) in results.iter().enumerate() {
        match result {
            Ok(d) => assert_judged(d, &format!("flood batch {i}")),
            Err(e) => {
                assert_shed(e, "lanes", &format!("flood batch {i}"));
                shed += 1;
            }
        }
    }
    eprintln!(
        "alone {alone:?}; the victim's batch during the flood {took:?}; {shed} of {FLOOD} flood batches shed"
    );
    assert!(shed > 0, "past its share, the flooding client is shed");
    assert!(
        shed < FLOOD,
        "the flooding client still gets its share of the threads"
    );
    // Its turn comes after at most one flood batch per thread, then its own
    // evaluation, while the flood keeps the other thread busy: 2 batches'
    // time, here with twice that as margin. Served first in, first out, it
    // would wait for every flood batch queued before it.
    let bound = alone * 4 + Duration::from_secs(1);
    assert!(
        took < bound,
        "the victim waited {took:?}, over {bound:?} (alone: {alone:?})"
    );
}

/// A cheap rule, for a guard with a short timeout.
const QUICK: &str = policy_rule!(name: "quick", action: "cancel",
    when: "'call.args.s.size() < 0'",
    message: r#"'"never"'"#);

/// R25 over R14: a batch that waits for an evaluation thread past its
/// policy guard's time was never being evaluated: the wait is load, so the
/// batch is shed with RESOURCE_EXHAUSTED, never timed out into a cancel
/// under the guard's `fail_closed`.
#[tokio::test]
async fn r25_a_batch_that_waits_past_its_guards_time_is_shed_not_cancelled() {
    let _heavy = HEAVY.lock().await;
    let mesh = MeshProcess::start("lanes-wait", "", Some("warn")).await;
    let registrar = Registrar::connect(&mesh.url).await.unwrap();
    registrar
        .register(
            Registration::policy("lanes", COSTLY)
                .tools(["probe"])
                .timeout(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    registrar
        .register(
            Registration::policy("quick", QUICK)
                .tools(["other"])
                .failure_policy(FailurePolicy::FailClosed)
                .timeout(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    let (flooder, victim) = flooder_and_victim(&mesh).await;
    // Over the inline bound in bytes, cheap to judge: it needs a thread.
    let other = |turn: u32| {
        let args = serde_json::json!({ "s": "b".repeat(20_000) }).to_string();
        Batch::new(turn)
            .call("o", "other", &args)
            .timeout(Duration::from_secs(60))
    };
    // Alone, it is judged well within the guard's time.
    let d = victim.evaluate_once("victim", other(0)).await.unwrap();
    assert!(d.call("o").unwrap().proceeds(), "{d:?}");
    let alone = judged_alone(&victim, 1).await;

    // The flood takes every thread, each for about 3 s.
    let calls = (3000 / alone.as_millis().max(1)).clamp(4, 256) as usize;
    let flood = {
        let flooder = flooder.clone();
        tokio::spawn(async move {
            let batches = (0..4).map(|i| {
                let flooder = flooder.clone();
                async move {
                    flooder
                        .evaluate_once("flooder", costly_calls(i as u32, calls))
                        .await
                }
            });
            futures::future::join_all(batches).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shed = victim.evaluate_once("victim", other(2)).await;
    for result in flood.await.unwrap() {
        match result {
            Ok(d) => assert_judged(&d, "flood batch"),
            Err(e) => assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}"),
        }
    }
    eprintln!(
        "alone {alone:?}, flood batches of {calls} calls; the waiting batch: {:?}",
        shed.as_ref().map(|d| &d.call("o").unwrap().outcome)
    );
    if alone * (calls as u32) < Duration::from_millis(1200) {
        // The threads freed within the guard's time: nothing to check.
        return;
    }
    let e = match shed {
        Err(e) => e,
        Ok(d) => panic!(
            "waiting for a thread is load, never a cancel or a failure: {:?}",
            d.call("o").unwrap().outcome
        ),
    };
    assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
    assert!(
        e.to_string().contains("quick") && e.to_string().contains("busy"),
        "the refusal names the guard and the cause: {e}"
    );
}
