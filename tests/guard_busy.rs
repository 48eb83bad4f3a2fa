//! Busy is not failed across clients (R25, R13, R32): a guard that judges
//! two batches at a time, 50 ms each (`guardmesh example-guard deny-list
//! --workers 2 --delay-ms 50`, a real process), behind a real `guardmesh
//! serve`. One client bursts 200 batches at once while another sends one
//! batch every 100 ms: on separate connections, on one connection (two
//! sessions), and as two identities with tokens; and a guard whose every
//! replica is slow under load. In each, the steady client's batches are
//! judged (no call cancelled as a failure), and the bursting client's
//! excess is refused with RESOURCE_EXHAUSTED naming the guard, never a
//! failure-cancel.

use crate::harness::*;
use guardmesh_client::{Batch, BatchDecision, ClientError, Coordinator};
use std::time::{Duration, Instant};

/// The burst: batches sent at once by the bursting client.
const BURST: usize = 200;
/// The steady client's batches, one every [`PACE`].
const STEADY: usize = 30;
const PACE: Duration = Duration::from_millis(100);

/// A guard process judging two at a time, `delay_ms` each.
fn busy_guard(delay_ms: u64) -> GuardProcess {
    GuardProcess::start(
        "deny-list",
        0,
        &["--workers", "2", "--delay-ms", &delay_ms.to_string()],
    )
}

/// The chain: guard `busy` at `urls` (its replicas), timeout 1 s,
/// fail-closed (the default).
fn chain(urls: &[&str]) -> String {
    let replicas: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    format!(
        "[[guard]]\nname = \"busy\"\nreplicas = [{}]\ntimeout_ms = 1000\n",
        replicas.join(", ")
    )
}

/// A batch the deny-list guard judges: `fs.delete` cancelled (by the
/// guard, not a failure), `fs.read` proceeds.
fn batch(round: usize) -> Batch {
    Batch::new(u32::try_from(round).unwrap_or(0))
        .call("del", "fs.delete", r#"{"path":"/tmp/x"}"#)
        .call("read", "fs.read", r#"{"path":"/tmp/x"}"#)
        .timeout(Duration::from_secs(10))
}

/// What became of one client's batches.
#[derive(Debug, Default)]
struct Tally {
    judged: usize,
    /// Decided with a call cancelled as a failure (R13): what load must
    /// never cause.
    failed: Vec<String>,
    /// Refused with RESOURCE_EXHAUSTED naming the guard (R25).
    shed: usize,
    /// Refused otherwise.
    other: Vec<String>,
    /// The round trips of the batches judged.
    took: Vec<Duration>,
}

impl Tally {
    fn add(&mut self, outcome: Result<BatchDecision, ClientError>, took: Duration) {
        match outcome {
            Ok(d) if deny_list_decided(&d, "busy") => {
                self.judged += 1;
                self.took.push(took);
            }
            Ok(d) => self.failed.push(format!(
                "{:?}",
                d.trace.iter().map(|t| &t.error).collect::<Vec<_>>()
            )),
            Err(e)
                if e.code() == Some(tonic::Code::ResourceExhausted)
                    && e.to_string().contains("\"busy\"")
                    && e.to_string().contains("busy:") =>
            {
                self.shed += 1;
            }
            Err(e) => self.other.push(e.to_string()),
        }
    }

    fn p99(&self) -> Duration {
        let mut took = self.took.clone();
        took.sort();
        took.get((took.len() * 99 / 100).min(took.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
}

/// `BURST` batches from `burst` at once (in sessions `a0`..`a3`, or all
/// in `burst_session` when given) while `steady` sends one every
/// [`PACE`] in session `b`: both tallies.
async fn burst_and_steady(
    burst: &Coordinator,
    burst_session: Option<&str>,
    steady: &Coordinator,
) -> (Tally, Tally) {
    let bursting = {
        let burst = burst.clone();
        let session = burst_session.map(str::to_owned);
        tokio::spawn(async move {
            let rounds = (0..BURST).map(|i| {
                let burst = burst.clone();
                let session = session.clone().unwrap_or_else(|| format!("a{}", i % 4));
                async move {
                    let sent = Instant::now();
                    let outcome = burst.evaluate_once(&session, batch(i)).await;
                    (outcome, sent.elapsed())
                }
            });
            let mut tally = Tally::default();
            for (outcome, took) in futures::future::join_all(rounds).await {
                tally.add(outcome, took);
            }
            tally
        })
    };
    // The steady client starts once the burst is in.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut tally = Tally::default();
    let mut ticks = tokio::time::interval(PACE);
    for round in 0..STEADY {
        ticks.tick().await;
        let sent = Instant::now();
        let outcome = steady.evaluate_once("b", batch(1000 + round)).await;
        tally.add(outcome, sent.elapsed());
    }
    let burst = tokio::time::timeout(Duration::from_secs(60), bursting)
        .await
        .expect("every burst batch is answered")
        .unwrap();
    (burst, tally)
}

/// The steady client alone: its p99 round trip over [`STEADY`] batches.
async fn alone(steady: &Coordinator) -> Tally {
    let mut tally = Tally::default();
    for round in 0..STEADY / 2 {
        let sent = Instant::now();
        let outcome = steady.evaluate_once("b", batch(2000 + round)).await;
        tally.add(outcome, sent.elapsed());
        tokio::time::sleep(PACE / 2).await;
    }
    tally
}

/// The outcomes every attack must show: the steady client judged in full,
/// the bursting client shed (never failed), and both served afterwards.
async fn assert_busy_is_not_failed(
    what: &str,
    burst: &Coordinator,
    steady: &Coordinator,
    (bursting, steady_tally): (Tally, Tally),
    quiet: Duration,
) {
    eprintln!(
        "{what}: burst {BURST}: {} judged, {} shed, {} failed, {} other; steady {STEADY}: \
         {} judged, {} failed, {} shed, {} other; steady p99 {:?} under the burst, {:?} alone",
        bursting.judged,
        bursting.shed,
        bursting.failed.len(),
        bursting.other.len(),
        steady_tally.judged,
        steady_tally.failed.len(),
        steady_tally.shed,
        steady_tally.other.len(),
        steady_tally.p99(),
        quiet,
    );
    assert!(
        steady_tally.failed.is_empty() && steady_tally.other.is_empty(),
        "{what}: R25: the steady client's batches are judged, never failed for another's load: \
         {} failed (first {:?}), {} refused otherwise (first {:?})",
        steady_tally.failed.len(),
        steady_tally.failed.first(),
        steady_tally.other.len(),
        steady_tally.other.first()
    );
    // A margin for a machine shared with other work: a steady batch may
    // rarely find no room for its turn; none may fail.
    assert!(
        steady_tally.judged + 2 >= STEADY,
        "{what}: the steady client's batches are judged: {} of {STEADY} ({} shed)",
        steady_tally.judged,
        steady_tally.shed
    );
    assert!(
        bursting.failed.is_empty() && bursting.other.is_empty(),
        "{what}: R25: the bursting client sees RESOURCE_EXHAUSTED naming the guard, not \
         cancels: {} failed (first {:?}), {} other (first {:?})",
        bursting.failed.len(),
        bursting.failed.first(),
        bursting.other.len(),
        bursting.other.first()
    );
    assert!(
        bursting.shed > 0 && bursting.judged > 0,
        "{what}: the burst is judged as far as the guard can, and its excess shed"
    );
    // The circuit stayed closed: both are judged at once afterwards.
    for (who, client) in [("burst", burst), ("steady", steady)] {
        let d = client.evaluate_once("after", batch(9999)).await.unwrap();
        assert!(
            deny_list_decided(&d, "busy"),
            "{what}: {who} client after the burst: {:?}",
            d.trace
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_a_busy_guard_sheds_a_burst_on_its_own_connection_and_judges_a_steady_client() {
    let guard = busy_guard(50);
    let mesh = MeshProcess::start("busy-conns", &chain(&[&guard.url]), Some("warn")).await;
    let burst = mesh.coordinator().await;
    let steady = mesh.coordinator().await;
    let quiet = alone(&steady).await;
    assert_eq!(quiet.judged, STEADY / 2, "alone: {:?}", quiet.failed);
    let outcome = burst_and_steady(&burst, None, &steady).await;
    assert_busy_is_not_failed(
        "separate connections",
        &burst,
        &steady,
        outcome,
        quiet.p99(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_on_one_connection_a_bursting_session_is_shed_and_a_steady_session_judged() {
    let guard = busy_guard(50);
    let mesh = MeshProcess::start("busy-one-conn", &chain(&[&guard.url]), Some("warn")).await;
    // One connection: per-connection fairness cannot tell the two apart;
    // the sessions take turns.
    let shared = mesh.coordinator().await;
    let outcome = burst_and_steady(&shared, Some("a"), &shared).await;
    assert_busy_is_not_failed("one connection", &shared, &shared, outcome, Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_two_identities_with_tokens_a_burst_of_one_never_fails_the_other() {
    let guard = busy_guard(50);
    let pki = TestPki::new();
    let (cert, key) = pki.issue_files("mesh");
    let mut config = format!(
        "[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        cert.display().to_string(),
        key.display().to_string()
    );
    for id in ["agent-a", "agent-b"] {
        let token = pki.file(&format!("{id}.token"), &format!("{id}-token\n"));
        config.push_str(&format!(
            "[[auth.principal]]\nid = {id:?}\nroles = [\"evaluate\"]\ntoken_file = {:?}\n",
            token.display().to_string()
        ));
    }
    config.push_str(&chain(&[&guard.url]));
    let file = pki.file("mesh.toml", &config);
    let port = free_port();
    let log = pki.file("mesh.log", "");
    let _serve = KillOnDrop(spawn_serve(&file, port, &log, Some("warn")));
    wait_for_port(port, "guardmesh serve").await;
    let url = format!("https://localhost:{port}");
    let burst = pki.coordinator(&url, "agent-a-token").await;
    let steady = pki.coordinator(&url, "agent-b-token").await;
    let outcome = burst_and_steady(&burst, None, &steady).await;
    assert_busy_is_not_failed("two identities", &burst, &steady, outcome, Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_r32_a_guard_whose_every_replica_is_slow_sheds_under_load_never_fails() {
    // Slow, not hung: each replica judges two at a time, 200 ms each.
    let a = busy_guard(200);
    let b = busy_guard(200);
    let mesh = MeshProcess::start("busy-slow", &chain(&[&a.url, &b.url]), Some("warn")).await;
    let burst = mesh.coordinator().await;
    let steady = mesh.coordinator().await;
    let outcome = burst_and_steady(&burst, None, &steady).await;
    assert_busy_is_not_failed(
        "every replica slow",
        &burst,
        &steady,
        outcome,
        Duration::ZERO,
    )
    .await;
}
