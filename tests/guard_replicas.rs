//! A guard run as several replicas (R32), against real guard processes:
//! Python kit guards (grpcio, default server options) and Rust example
//! guards, each replica a process on its own port. Requests spread by load,
//! a replica killed with SIGKILL loses no call while another lives, R13
//! applies only when none does, and a slow replica gets a small share.
//!
//! The Python tests need `scripts/setup-polyglot` (as `polyglot` does).

use crate::harness::*;
use guardmesh_client::proto::GuardSpec;
use guardmesh_client::{Batch, Outcome, Registration};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The chain's one guard: `endpoint` empty, `replicas` the urls.
pub(crate) fn replicated(name: &str, urls: &[String], timeout: Duration) -> GuardSpec {
    let mut spec = Registration::validate(name, "").timeout(timeout).build();
    spec.endpoint = String::new();
    spec.replicas = urls.to_vec();
    spec
}

/// A batch the deny-list guards (Python `no_delete`, Rust `deny-list`)
/// judge alike: `fs.delete` is cancelled, `fs.read` proceeds.
pub(crate) fn batch(round: usize) -> Batch {
    Batch::new(u32::try_from(round % 4_000_000_000).unwrap_or(0))
        .call("del", "fs.delete", r#"{"path":"/tmp/x"}"#)
        .call("read", "fs.read", r#"{"path":"/tmp/x"}"#)
        .timeout(Duration::from_secs(20))
}

async fn register(mesh: &TestMesh, spec: GuardSpec) {
    mesh.registrar().await.register(spec).await.unwrap();
}

async fn rust_replica(port: u16, delay_ms: u64) -> GuardProcess {
    tokio::task::spawn_blocking(move || {
        let delay = delay_ms.to_string();
        GuardProcess::start("deny-list", port, &["--delay-ms", &delay])
    })
    .await
    .expect("start a Rust replica")
}

/// Three Rust replicas answering after `delay_ms`, and their URLs.
async fn three_replicas(delay_ms: u64) -> (Vec<GuardProcess>, Vec<String>) {
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(rust_replica(0, delay_ms).await);
    }
    let urls = replicas.iter().map(|g| g.url.clone()).collect();
    (replicas, urls)
}

/// Sends `total` batches from `workers` concurrent coordinators, each
/// sending its next batch once its last is decided and, with `pace`, no
/// sooner than `pace` after it sent the last; returns the decisions'
/// replicas, counted, and how many decisions were wrong.
async fn steady_load(
    mesh: &TestMesh,
    guard: &'static str,
    workers: usize,
    total: usize,
    pace: Option<Duration>,
) -> (HashMap<String, usize>, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let coordinator = mesh.session(format!("w{worker}")).await;
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut seen: Vec<(String, bool)> = Vec::new();
            let mut ticks = pace.map(|pace| {
                let mut ticks = tokio::time::interval(pace);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticks
            });
            loop {
                if let Some(ticks) = ticks.as_mut() {
                    ticks.tick().await;
                }
                let round = next.fetch_add(1, Ordering::Relaxed);
                if round >= total {
                    return seen;
                }
                let d = coordinator
                    .evaluate(batch(round))
                    .await
                    .expect("a decision");
                seen.push((replica_of(&d, guard), deny_list_decided(&d, guard)));
            }
        }));
    }
    count_replicas(tasks).await
}

/// A Python kit guard (grpcio, default server options) that cancels
/// `fs.delete` as `no_delete.py` does, and counts the batches it judged:
/// `count` on its stdin prints `COUNT <n>`.
fn counting() -> String {
    let state = "import threading\n\njudged = 0\nlock = threading.Lock()\n";
    let work = r#"    global judged
    with lock:
        judged += 1"#;
    let answer = r#"    if command == "count":
        with lock:
            n = judged
        print(f"COUNT {n}", flush=True)"#;
    deny_list_script(state, work, "nd", answer)
}

/// The batches a [`counting`] replica says it judged.
fn judged(replica: &mut ScriptedReplica) -> usize {
    let line = replica.ask("count");
    line.strip_prefix("COUNT ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected answer to `count`: {line:?}"))
}

#[tokio::test]
async fn r32_requests_spread_evenly_over_three_python_replicas() {
    let mesh = TestMesh::start().await;
    let dir = folder("replica-spread");
    let script = dir.join("counting_guard.py");
    std::fs::write(&script, counting()).unwrap();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let script = script.clone();
        replicas.push(
            tokio::task::spawn_blocking(move || {
                ScriptedReplica::start(&script, "counting replica")
            })
            .await
            .unwrap(),
        );
    }
    let urls: Vec<String> = replicas.iter().map(|r| r.url.clone()).collect();
    register(&mesh, replicated("nd", &urls, Duration::from_secs(10))).await;
    // Steady load: 8 sessions, each sending a batch every 25 ms (320 a
    // second, well within what three replicas judge even on a busy
    // machine, so the share measures the choice rather than which replica
    // the machine lets run), 1,200 batches after a warm-up that opens every
    // replica's stream and sets its latency estimate.
    let pace = Some(Duration::from_millis(25));
    let (_, wrong) = steady_load(&mesh, "nd", 8, 80, pace).await;
    assert_eq!(wrong, 0);
    let before: Vec<usize> = replicas.iter_mut().map(judged).collect();
    let total = 1200;
    let started = Instant::now();
    let (counts, wrong) = steady_load(&mesh, "nd", 8, total, pace).await;
    let elapsed = started.elapsed();
    let after: Vec<usize> = replicas.iter_mut().map(judged).collect();
    let judged: Vec<usize> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    eprintln!("spread over 3 Python replicas in {elapsed:?}: the replicas counted {judged:?}");
    assert_eq!(wrong, 0, "every decision correct: {counts:?}");
    assert_eq!(
        judged.iter().sum::<usize>(),
        total,
        "each batch judged once, by one replica: {judged:?}"
    );
    // R32: within 25% of even, by the replicas' own count (the issue's
    // bound).
    let even = total / 3;
    for (url, n) in urls.iter().zip(&judged) {
        assert!(
            n * 4 >= even * 3 && n * 4 <= even * 5,
            "R32: {url} judged {n} of {total}, not within 25% of {even}: {judged:?}"
        );
    }
    // The mesh's account (trace entries, the replica metric) is the
    // replicas' own.
    for (url, n) in urls.iter().zip(&judged) {
        assert_eq!(
            counts.get(url).copied().unwrap_or(0),
            *n,
            "{url}: {counts:?}"
        );
    }
    assert_eq!(
        metric(
            &mesh,
            &format!(
                r#"guardmesh_guard_replica_requests_total{{guard="nd",replica="{}"}}"#,
                urls[0]
            )
        ),
        after[0] as f64,
        "the replica metric counts what the first replica judged"
    );
    drop(replicas);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn r32_kill_9_one_replica_every_half_second_loses_no_call() {
    let mesh = TestMesh::start().await;
    let (mut replicas, urls) = three_replicas(2).await;
    let ports: Vec<u16> = replicas.iter().map(|g| g.port).collect();
    register(&mesh, replicated("deny", &urls, Duration::from_secs(5))).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for worker in 0..20 {
        let coordinator = mesh.session(format!("w{worker}")).await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let (mut decided, mut failed, mut wrong) = (0usize, Vec::new(), 0usize);
            let mut round = worker * 1_000_000;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                match coordinator.evaluate(batch(round)).await {
                    Ok(d) => {
                        decided += 1;
                        if d.calls.iter().any(|c| c.failure) {
                            let error = d.trace.iter().map(|t| t.error.clone()).collect::<Vec<_>>();
                            failed.push(format!("{error:?}"));
                        } else if !deny_list_decided(&d, "deny") {
                            wrong += 1;
                        }
                    }
                    Err(e) => failed.push(e.to_string()),
                }
            }
            (decided, failed, wrong)
        }));
    }
    // ~10 s: one replica killed every 0.5 s, in rotation, and started again
    // on its port at once (so two at least are up, or coming up).
    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let i = kills % 3;
        replicas[i].kill();
        replicas[i] = rust_replica(ports[i], 2).await;
        kills += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let (mut decided, mut failed, mut wrong) = (0, Vec::new(), 0);
    for task in tasks {
        let (d, f, w) = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("R32: every batch is answered")
            .unwrap();
        decided += d;
        failed.extend(f);
        wrong += w;
    }
    eprintln!(
        "kill rotation: {kills} kills, {decided} batches decided, {} failed",
        failed.len()
    );
    // One kill per 0.5 s plus the restart's own time (more on a busy
    // machine).
    assert!(kills >= 5, "{kills} kills");
    assert!(decided > 100, "{decided} batches decided");
    assert!(
        failed.is_empty(),
        "R32: {} of {decided} batches had a failed or cancelled call while a replica lived; first: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(wrong, 0, "every decision correct");
    let ejections: f64 = urls
        .iter()
        .map(|url| {
            metric(
                &mesh,
                &format!(
                    r#"guardmesh_guard_replica_ejections_total{{guard="deny",replica="{url}"}}"#
                ),
            )
        })
        .sum();
    assert!(ejections >= 1.0, "the killed replicas were ejected");
}

#[tokio::test]
async fn r13_all_replicas_dead_fails_per_policy_within_the_guard_s_timeout() {
    let mesh = TestMesh::start().await;
    let (mut replicas, urls) = three_replicas(0).await;
    register(&mesh, replicated("deny", &urls, Duration::from_secs(2))).await;
    let coordinator = mesh.session("w0").await;
    let d = coordinator.evaluate(batch(0)).await.unwrap();
    assert!(deny_list_decided(&d, "deny"), "{d:?}");
    for replica in &mut replicas {
        replica.kill();
    }
    for round in 1..4 {
        let started = Instant::now();
        let d = coordinator.evaluate(batch(round)).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "R13 within the guard's timeout: {:?}",
            started.elapsed()
        );
        for call in &d.calls {
            assert!(
                call.failure && matches!(call.outcome, Outcome::Cancel { .. }),
                "R13 fail_closed: {call:?}"
            );
        }
    }
}

#[tokio::test]
async fn r32_a_replica_five_times_slower_gets_a_small_share() {
    let mesh = TestMesh::start().await;
    let fast_a = rust_replica(0, 20).await;
    let fast_b = rust_replica(0, 20).await;
    let slow = rust_replica(0, 100).await;
    let urls = vec![fast_a.url.clone(), fast_b.url.clone(), slow.url.clone()];
    register(&mesh, replicated("deny", &urls, Duration::from_secs(5))).await;
    let total = 600;
    let (counts, wrong) = steady_load(&mesh, "deny", 12, total, None).await;
    assert_eq!(wrong, 0);
    let share = counts.get(&slow.url).copied().unwrap_or(0);
    eprintln!("slow replica share: {share} of {total}: {counts:?}");
    // Even would be 200; by latency alone about 55.
    assert!(
        share * 100 <= total * 20,
        "R32: the slow replica judged {share} of {total}: {counts:?}"
    );
}

#[tokio::test]
async fn r32_registration_bounds_replicas_and_holds_each_to_the_endpoint_policy() {
    let mesh = TestMesh::start().await;
    let registrar = mesh.registrar().await;
    let many: Vec<String> = (0..65)
        .map(|i| format!("127.0.0.1:{}", 20000 + i))
        .collect();
    let refusal = async |urls: &[String]| {
        registrar
            .register(replicated("g", urls, Duration::from_secs(1)))
            .await
            .unwrap_err()
            .to_string()
    };
    let one_at = |address: &str| vec!["127.0.0.1:20001".to_string(), address.to_string()];
    let error = refusal(&many).await;
    assert!(
        error.contains("InvalidArgument") || error.contains("invalid"),
        "{error}"
    );
    assert!(error.contains("at most 64"), "{error}");
    // One replica at a metadata address: the whole registration is refused.
    let error = refusal(&one_at("169.254.169.254:80")).await;
    assert!(error.contains("169.254.169.254"), "{error}");
    // The same address twice.
    let error = refusal(&one_at("http://127.0.0.1:20001")).await;
    assert!(error.contains("twice"), "{error}");
    let listed = registrar.list().await.unwrap();
    assert!(listed.guards.is_empty(), "nothing was registered");
}
