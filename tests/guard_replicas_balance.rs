//! How a guard's replicas are priced and what a timeout does (R32, R13,
//! R14), through a mesh on loopback and Rust SDK guards each on its own
//! port: a replica that hangs from the start or after working costs no
//! call while two others judge, and a replica slow for a second is chosen
//! again once it is fast.

use crate::guard_replicas::{batch, replicated};
use crate::harness::*;
use guardmesh_client::proto::{GuardBatch, Verdict};
use guardmesh_client::verdict::cancel;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longer than any test: a replica told to wait this long never answers.
const HANG: Duration = Duration::from_secs(3600);

/// What the deny-list guard says about [`batch`]: `fs.delete` cancelled.
fn deny(batch: &GuardBatch) -> Vec<Verdict> {
    batch
        .calls
        .iter()
        .filter(|c| c.tool == "fs.delete")
        .map(|c| cancel(&c.call_id, "Deleting files is not allowed."))
        .collect()
}

/// A replica that judges as [`deny`] after what `delay` says for each
/// batch ([`HANG`]: never), noting when it read each.
async fn replica(
    delay: impl Fn() -> Duration + Send + Sync + 'static,
) -> (TestGuard, Arc<Mutex<Vec<Instant>>>) {
    let read = Arc::new(Mutex::new(Vec::new()));
    let noted = read.clone();
    let guard = script_guard(move |b| {
        noted.lock().unwrap().push(Instant::now());
        Script {
            delay: delay(),
            verdicts: deny(b),
            error: None,
        }
    })
    .await;
    (guard, read)
}

/// One batch's fate: when it was sent, how long it took, the replica that
/// judged it, and whether it was judged (else what failed).
struct Fate {
    sent: Instant,
    took: Duration,
    replica: String,
    failed: Option<String>,
}

/// `total` batches from `sessions` sessions, each sending its next batch
/// once its last is decided and at most every `pace`; every fate.
async fn load(mesh: &TestMesh, sessions: usize, total: usize, pace: Duration) -> Vec<Fate> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for worker in 0..sessions {
        let session = mesh
            .coordinator()
            .await
            .session(format!("w{worker}"))
            .await
            .unwrap();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut fates = Vec::new();
            let mut ticks = tokio::time::interval(pace);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let round = next.fetch_add(1, Ordering::Relaxed);
                if round >= total {
                    return fates;
                }
                let sent = Instant::now();
                let outcome = session.evaluate(batch(round)).await;
                let took = sent.elapsed();
                fates.push(match outcome {
                    Ok(d) => Fate {
                        sent,
                        took,
                        replica: replica_of(&d, "deny"),
                        failed: (!deny_list_decided(&d, "deny")).then(|| format!("{:?}", d.trace)),
                    },
                    Err(e) => Fate {
                        sent,
                        took,
                        replica: String::new(),
                        failed: Some(e.to_string()),
                    },
                });
            }
        }));
    }
    let mut fates = Vec::new();
    for task in tasks {
        fates.extend(
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .expect("every batch is answered")
                .unwrap(),
        );
    }
    fates
}

async fn register(mesh: &TestMesh, urls: &[String], timeout: Duration) {
    mesh.registrar()
        .await
        .register(replicated("deny", urls, timeout))
        .await
        .unwrap();
}

/// Registers `first` and two replicas that judge at once as the guard
/// `deny` with `timeout`: the two, which judge as long as they are held.
async fn beside_two_judging(
    mesh: &TestMesh,
    first: &TestGuard,
    timeout: Duration,
) -> [TestGuard; 2] {
    let (a, _) = replica(|| Duration::ZERO).await;
    let (b, _) = replica(|| Duration::ZERO).await;
    register(
        mesh,
        &[first.url.clone(), a.url.clone(), b.url.clone()],
        timeout,
    )
    .await;
    [a, b]
}

/// `total` batches from 4 sessions, every 10 ms: none fails, and `first`
/// judges some of them.
async fn warm_up(mesh: &TestMesh, total: usize, first: &TestGuard) {
    let warm = load(mesh, 4, total, Duration::from_millis(10)).await;
    assert!(failures(&warm).is_empty());
    assert!(
        warm.iter().any(|f| f.replica == first.url),
        "the first replica judged while it was fast"
    );
}

fn failures(fates: &[Fate]) -> Vec<&str> {
    fates.iter().filter_map(|f| f.failed.as_deref()).collect()
}

/// Fails unless every batch of `fates` was judged while two replicas
/// judged (R32).
fn assert_none_failed(fates: &[Fate]) {
    let failed = failures(fates);
    assert!(
        failed.is_empty(),
        "R32: {} of {} batches failed while two replicas judged; first: {:?}",
        failed.len(),
        fates.len(),
        failed.first()
    );
}

/// How many batches of `fates` waited for a replica that held them (took
/// 400 ms or more).
fn waited(fates: &[Fate]) -> usize {
    fates
        .iter()
        .filter(|f| f.took >= Duration::from_millis(400))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_a_replica_hung_from_the_start_costs_no_call_while_two_judge() {
    let mesh = TestMesh::start().await;
    // It takes its stream and every batch, and never answers.
    let (hung, hung_read) = replica(|| HANG).await;
    let _judging = beside_two_judging(&mesh, &hung, Duration::from_secs(1)).await;
    let started = Instant::now();
    let fates = load(&mesh, 4, 100, Duration::from_millis(10)).await;
    let elapsed = started.elapsed();
    let failed = failures(&fates);
    let waited = waited(&fates);
    let to_hung = hung_read.lock().unwrap().len();
    eprintln!(
        "hung from the start: 100 batches in {elapsed:?}, {} failed, {to_hung} sent to the hung replica, {waited} waited for it",
        failed.len()
    );
    assert_none_failed(&fates);
    assert!(
        fates.iter().all(|f| f.replica != hung.url),
        "the hung replica never judges"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_a_replica_that_hangs_after_working_costs_no_call_while_two_judge() {
    let mesh = TestMesh::start().await;
    let hang = Arc::new(AtomicBool::new(false));
    let flag = hang.clone();
    let (flaky, flaky_read) = replica(move || {
        if flag.load(Ordering::Relaxed) {
            HANG
        } else {
            Duration::ZERO
        }
    })
    .await;
    let _judging = beside_two_judging(&mesh, &flaky, Duration::from_secs(1)).await;
    // All three judge.
    warm_up(&mesh, 60, &flaky).await;
    // It hangs: it takes batches and never answers them.
    hang.store(true, Ordering::Relaxed);
    let hung_at = Instant::now();
    let fates = load(&mesh, 4, 100, Duration::from_millis(10)).await;
    let failed = failures(&fates);
    let to_hung = flaky_read
        .lock()
        .unwrap()
        .iter()
        .filter(|at| **at >= hung_at)
        .count();
    let waited = waited(&fates);
    eprintln!(
        "hung after working: 100 batches, {} failed, {to_hung} sent to the hung replica, {waited} waited for it",
        failed.len()
    );
    assert_none_failed(&fates);
    // The batches it held moved to another replica, each after half the
    // guard's time; the others never went to it.
    assert!(waited <= 10, "{waited} batches waited for the hung replica");
    assert!(
        fates
            .iter()
            .filter(|f| f.sent >= hung_at)
            .all(|f| f.replica != flaky.url),
        "the hung replica judged nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_a_replica_slow_for_a_second_is_chosen_again_once_fast() {
    let mesh = TestMesh::start().await;
    // 300 ms slower while `slow_until` is ahead.
    let slow_until: Arc<Mutex<Option<Instant>>> = Arc::default();
    let until = slow_until.clone();
    let (slow, slow_read) = replica(move || {
        let slow = until.lock().unwrap().is_some_and(|u| Instant::now() < u);
        if slow {
            Duration::from_millis(300)
        } else {
            Duration::ZERO
        }
    })
    .await;
    let _judging = beside_two_judging(&mesh, &slow, Duration::from_secs(2)).await;
    warm_up(&mesh, 100, &slow).await;
    // Slow for one second, under load (4 sessions, a batch each every
    // 10 ms, about 7 s in all).
    let slowed = Instant::now();
    let recovered = slowed + Duration::from_secs(1);
    *slow_until.lock().unwrap() = Some(recovered);
    let fates = load(&mesh, 4, 2400, Duration::from_millis(10)).await;
    let failed = failures(&fates);
    assert!(failed.is_empty(), "{:?}", failed.first());
    let read: Vec<Duration> = slow_read
        .lock()
        .unwrap()
        .iter()
        .filter(|at| **at >= slowed)
        .map(|at| *at - slowed)
        .collect();
    let ended = fates.iter().map(|f| f.sent).max().unwrap_or(slowed) - slowed;
    // The last batch it read while slow was answered by 1.3 s.
    let again: Vec<&Duration> = read
        .iter()
        .filter(|at| **at >= Duration::from_millis(1300))
        .collect();
    eprintln!(
        "slow for a second: read {} while slow, {} after 1.3 s (first at {:?}) of a run of {ended:?}",
        read.len() - again.len(),
        again.len(),
        again.first()
    );
    assert!(
        again
            .first()
            .is_some_and(|at| **at < Duration::from_secs(6)),
        "R32: the replica slow for a second was not chosen again within 4.7 s of recovering: {read:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r13_every_replica_hung_fails_per_policy_within_the_guard_s_time() {
    let mesh = TestMesh::start().await;
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(replica(|| HANG).await);
    }
    let urls: Vec<String> = replicas.iter().map(|(g, _)| g.url.clone()).collect();
    register(&mesh, &urls, Duration::from_secs(1)).await;
    let fates = load(&mesh, 1, 5, Duration::from_millis(10)).await;
    for fate in &fates {
        // R13 (fail_closed): every call cancelled as a failure, at the
        // guard's time (R14), not later.
        assert!(
            fate.failed
                .as_deref()
                .is_some_and(|t| t.contains("TimedOut")),
            "{:?}",
            fate.failed
        );
        assert!(
            fate.took >= Duration::from_secs(1) && fate.took < Duration::from_millis(1500),
            "{:?}",
            fate.took
        );
    }
    // Each batch was sent to two replicas at most.
    let sent: usize = replicas
        .iter()
        .map(|(_, read)| read.lock().unwrap().len())
        .sum();
    eprintln!("every replica hung: 5 batches, {sent} requests");
    assert!(sent <= 10, "{sent} requests for 5 batches");
}
