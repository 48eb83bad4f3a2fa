//! Draining replicas (R32): a replica whose `grpc.health.v1` status turns
//! NOT_SERVING gets no new requests and finishes what it holds; back to
//! SERVING it gets requests again; a replica that shuts down gracefully
//! (NOT_SERVING, then GOAWAY and its streams ended once drained) loses no
//! call. Real Python kit guards (grpcio, default server options), steered
//! through their stdin.
//!
//! Needs `scripts/setup-polyglot` (as `polyglot` does).

use crate::guard_replicas::batch;
use crate::harness::*;
use guardmesh_client::Outcome;
use guardmesh_client::proto::GuardSpec;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A kit guard that cancels `fs.delete` after 20 ms of work per batch and
/// takes commands on stdin: `down` / `up` (its health status, through the
/// kit's `GuardServer.set_serving`), `stop` (the kit's graceful stop).
fn script_text() -> String {
    let answer = r#"    if command == "down":
        server.set_serving(False)
    elif command == "up":
        server.set_serving(True)
    elif command == "stop":
        server.stop(5.0)
    print(f"OK {command}", flush=True)"#;
    deny_list_script("import time\n", "    time.sleep(0.02)", "hg", answer)
}

/// Sends a replica of [`script_text`] `command` (`down`, `up`, `stop`) and
/// checks it was done.
fn command(replica: &mut ScriptedReplica, command: &str) {
    assert_eq!(replica.ask(command), format!("OK {command}"));
}

fn script() -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = fresh_dir("health");
    let path = dir.join("health_guard.py");
    std::fs::write(&path, script_text()).unwrap();
    (dir, path)
}

async fn replicas(n: usize) -> (std::path::PathBuf, Vec<ScriptedReplica>) {
    let (dir, path) = script();
    let mut out = Vec::new();
    for _ in 0..n {
        let path = path.clone();
        out.push(
            tokio::task::spawn_blocking(move || ScriptedReplica::start(&path, "health replica"))
                .await
                .unwrap(),
        );
    }
    (dir, out)
}

fn replicated(name: &str, urls: &[String]) -> GuardSpec {
    crate::guard_replicas::replicated(name, urls, Duration::from_secs(5))
}

/// What a load run saw: each decision's send and answer times and its
/// replica; and every failure.
#[derive(Default)]
struct Seen {
    judged: Vec<(Instant, Instant, String)>,
    failed: Vec<(Instant, String)>,
}

/// Batches from `workers` sessions until `stop`.
async fn load(
    mesh: &TestMesh,
    workers: usize,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let session = mesh.session(format!("w{worker}")).await;
        let (stop, seen) = (stop.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            let mut round = worker * 1_000_000;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let sent = Instant::now();
                let outcome = session.evaluate(batch(round)).await;
                let mut seen = seen.lock().unwrap();
                match outcome {
                    Ok(d) if deny_list_decided(&d, "hg") => {
                        seen.judged
                            .push((sent, Instant::now(), replica_of(&d, "hg")));
                    }
                    Ok(d) => seen.failed.push((sent, format!("{:?}", d.trace))),
                    Err(e) => seen.failed.push((sent, e.to_string())),
                }
            }
        }));
    }
    tasks
}

/// Three replicas of [`script_text`] as the guard `hg` of a mesh, under load
/// from 8 sessions (started 1.5 s before [`Draining::start`] returns).
struct Draining {
    mesh: TestMesh,
    dir: std::path::PathBuf,
    guards: Vec<ScriptedReplica>,
    urls: Vec<String>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// When the load started.
    started: Instant,
}

impl Draining {
    async fn start() -> Self {
        let mesh = TestMesh::start().await;
        let (dir, guards) = replicas(3).await;
        let urls: Vec<String> = guards.iter().map(|g| g.url.clone()).collect();
        mesh.registrar()
            .await
            .register(replicated("hg", &urls))
            .await
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let started = Instant::now();
        let tasks = load(&mesh, 8, stop.clone(), seen.clone()).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Self {
            mesh,
            dir,
            guards,
            urls,
            stop,
            seen,
            tasks,
            started,
        }
    }

    /// Stops the load once every batch is answered (R32): what it saw.
    async fn stop(&mut self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks.drain(..) {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("R32: every batch is answered")
                .unwrap();
        }
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        self.guards.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Seen {
    /// Fails unless no batch failed (R32), naming each kind of failure,
    /// how often, and when it was first sent (from `phases`: the moments
    /// the test changed the replicas' health, by name).
    fn assert_none_failed(&self, phases: &[(&str, Instant)]) {
        if self.failed.is_empty() {
            return;
        }
        let when = |at: Instant| {
            phases
                .iter()
                .rev()
                .find(|(_, since)| at >= *since)
                .map_or_else(
                    || "before the first phase".to_owned(),
                    |(name, since)| format!("{} ms after {name}", (at - *since).as_millis()),
                )
        };
        let mut kinds: Vec<(String, usize, Instant)> = Vec::new();
        for (at, why) in &self.failed {
            match kinds.iter_mut().find(|(kind, ..)| kind == why) {
                Some((_, n, _)) => *n += 1,
                None => kinds.push((why.clone(), 1, *at)),
            }
        }
        let kinds: Vec<String> = kinds
            .iter()
            .map(|(why, n, first)| format!("{n}x, first sent {}: {why}", when(*first)))
            .collect();
        panic!(
            "R32: {} of {} batches failed:\n{}",
            self.failed.len(),
            self.failed.len() + self.judged.len(),
            kinds.join("\n")
        );
    }
}

/// Batches sent from `from` and answered before `to` that `replica`
/// judged, and all such batches: each was sent to its replica within
/// `[from, to)`. (By the send time alone, a batch sent just before `to`
/// may wait for room in the mesh and reach a replica after it.)
fn judged_between(seen: &Seen, replica: &str, from: Instant, to: Instant) -> (usize, usize) {
    let window: Vec<_> = seen
        .judged
        .iter()
        .filter(|(sent, answered, _)| *sent >= from && *answered < to)
        .collect();
    (
        window.iter().filter(|(_, _, r)| r == replica).count(),
        window.len(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_a_not_serving_replica_gets_no_new_requests_then_serves_again() {
    let mut run = Draining::start().await;
    let urls = run.urls.clone();
    let settle = Duration::from_millis(500);

    // The first replica says NOT_SERVING: after a settling time (the watch
    // message, and the batches it already held), it judges nothing new.
    // The draining gauge names the replica that drains, and only it.
    let draining = |url: &str| {
        metric(
            &run.mesh,
            &format!(r#"guardmesh_guard_replica_draining{{guard="hg",replica="{url}"}}"#),
        )
    };
    let told_down = Instant::now();
    command(&mut run.guards[0], "down");
    // Measured from when the mesh has heard it (its gauge says so): on a
    // loaded machine the health message itself can take a while.
    let heard = Instant::now() + Duration::from_secs(10);
    while draining(&urls[0]) != 1.0 && Instant::now() < heard {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(draining(&urls[0]), 1.0, "R32: the draining replica's gauge");
    let down = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(draining(&urls[1]), 0.0, "R32: a serving replica's gauge");
    // Taken before the command: the replica says SERVING before it
    // answers it, so a batch answered before this instant was sent to a
    // replica while the first one drained.
    let up = Instant::now();
    command(&mut run.guards[0], "up");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(draining(&urls[0]), 0.0, "R32: serving again");
    // Every replica NOT_SERVING: they still judge (R15: a guard is never
    // left without replicas by their health; none fails).
    let all_down = Instant::now();
    for guard in &mut run.guards {
        command(guard, "down");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for url in &urls {
        assert_eq!(draining(url), 1.0, "R32: {url} drains");
    }
    let seen = run.stop().await;
    let (drained, total) = judged_between(&seen, &urls[0], down + settle, up);
    eprintln!("NOT_SERVING for 3 s: the replica judged {drained} of {total}");
    assert!(total >= 30, "load flowed while it drained: {total}");
    // What the replicas' metrics said, should it fail: a request the
    // others failed (failovers, ejections) may go to a draining replica
    // as the last resort, a reconnected stream (streams opened) starts
    // a new health watch, and a request the serving replicas' links were
    // too busy to take goes to the draining one rather than be shed (the
    // guard's flow and shed series show that load).
    let replica_metrics = || {
        run.mesh
            .mesh
            .metrics
            .encode()
            .lines()
            .filter(|l| {
                l.starts_with("guardmesh_guard_replica_")
                    || l.starts_with("guardmesh_guard_streams_opened")
                    || l.starts_with("guardmesh_guard_shed")
                    || l.starts_with("guardmesh_guard_waiting")
                    || l.starts_with("guardmesh_guard_in_flight")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        drained,
        0,
        "R32: a NOT_SERVING replica got {drained} of {total} new requests\n{}",
        replica_metrics()
    );
    let (back, total) = judged_between(&seen, &urls[0], up + settle, all_down);
    eprintln!("SERVING again: the replica judged {back} of {total}");
    assert!(
        back * 10 >= total,
        "R32: back to SERVING, it judges again: {back} of {total}"
    );
    let (_, total) = judged_between(&seen, &urls[0], all_down + settle, Instant::now());
    assert!(
        total >= 10,
        "every replica NOT_SERVING still judges: {total}"
    );
    seen.assert_none_failed(&[
        ("the load started", run.started),
        ("the first replica was told NOT_SERVING", told_down),
        ("the mesh heard it", down),
        ("the first replica was told SERVING", up),
        ("every replica was told NOT_SERVING", all_down),
    ]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_a_replica_shutting_down_gracefully_finishes_its_requests_and_gets_no_more() {
    let mut run = Draining::start().await;
    let urls = run.urls.clone();
    // The kit's graceful stop: NOT_SERVING, new RPCs refused (GOAWAY), each
    // Judge stream ended once it has no request outstanding, 5 s grace.
    command(&mut run.guards[0], "stop");
    let stopped = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let seen = run.stop().await;
    let (after, total) = judged_between(
        &seen,
        &urls[0],
        stopped + Duration::from_millis(500),
        Instant::now(),
    );
    eprintln!("after a graceful stop: the replica judged {after} of {total}");
    assert!(total >= 30, "load flowed: {total}");
    assert_eq!(after, 0, "R32: a stopping replica got new requests");
    seen.assert_none_failed(&[
        ("the load started", run.started),
        ("the first replica was told to stop", stopped),
    ]);
}

/// A TLS script guard on 127.0.0.1 whose certificate names `id`
/// (`spiffe://guardmesh.local/ID`), steering every call.
async fn tls_replica(pki: &TestPki, id: &str) -> (String, Arc<ScriptGuard>) {
    let issued = pki
        .ca
        .issue(&guardmesh_cli::certs::Subject::loopback(id))
        .unwrap();
    tls_steering_guard("127.0.0.1", issued.cert_pem, issued.key_pem, None).await
}

/// Three TLS replicas of a guard pinned to one identity, one of them an
/// impostor (a certificate of the same CA for another identity): the
/// impostor never receives a request, the two others judge every batch,
/// none fails, and the impostor is named with the reason (R32, R24).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_an_impostor_replica_gets_no_request_and_is_named() {
    let pki = TestPki::new();
    let mut config = fast_config();
    config.security.guard_tls = Some(Arc::new(
        guardmesh_server::link::dial::GuardTls::new(&pki.ca_file(), None, None).unwrap(),
    ));
    let mesh = TestMesh::with_config(config).await;
    let (real_a, guard_a) = tls_replica(&pki, "guard/real").await;
    let (impostor, impostor_guard) = tls_replica(&pki, "guard/impostor").await;
    let (real_b, guard_b) = tls_replica(&pki, "guard/real").await;
    let mut spec = replicated("tg", &[real_a.clone(), impostor.clone(), real_b.clone()]);
    spec.server_identity = "spiffe://guardmesh.local/guard/real".into();
    mesh.registrar().await.register(spec).await.unwrap();
    let total = 120;
    let mut tasks = Vec::new();
    for worker in 0..6 {
        let session = mesh.session(format!("w{worker}")).await;
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for round in 0..total / 6 {
                let d = session
                    .evaluate(one_call(worker * 1000 + round))
                    .await
                    .expect("a decision");
                let steered =
                    matches!(d.calls[0].outcome, Outcome::Steer { .. }) && !d.calls[0].failure;
                seen.push((replica_of(&d, "tg"), steered));
            }
            seen
        }));
    }
    let (counts, wrong) = count_replicas(tasks).await;
    assert_eq!(wrong, 0, "R32: every batch judged by a real replica");
    eprintln!("pinned replicas with an impostor: {counts:?}");
    assert_eq!(
        impostor_guard.requests(),
        0,
        "R32: the impostor got a request"
    );
    assert!(!counts.contains_key(&impostor), "{counts:?}");
    assert_eq!(counts.values().sum::<usize>(), total);
    assert!(
        guard_a.requests() >= 10 && guard_b.requests() >= 10,
        "{counts:?}"
    );
    // Requests its link queued while it was first dialed went to a real
    // replica once the handshake refused the impostor: the impostor
    // process itself saw none (above).
    // The pool names the impostor and why it cannot be reached.
    let pool = mesh
        .mesh
        .chain()
        .guards
        .iter()
        .find(|g| g.guard.name == "tg")
        .and_then(|g| g.link.clone())
        .expect("the guard's pool");
    let mut unreachable = pool.unreachable();
    let deadline = Instant::now() + Duration::from_secs(5);
    while unreachable.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        unreachable = pool.unreachable();
    }
    eprintln!("unreachable replicas: {unreachable:?}");
    let (_, reason) = unreachable
        .iter()
        .find(|(r, _)| *r == impostor)
        .expect("the impostor is named");
    assert!(reason.contains("guard/impostor"), "{reason}");
    assert!(
        unreachable.iter().all(|(r, _)| *r == impostor),
        "{unreachable:?}"
    );
    // R24: its refused certificate is counted under its own name, and
    // only its own.
    let refused = |url: &str| {
        metric(
            &mesh,
            &format!(
                r#"guardmesh_guard_replica_certificate_refused_total{{guard="tg",replica="{url}"}}"#
            ),
        )
    };
    assert!(refused(&impostor) >= 1.0, "{}", mesh.mesh.metrics.encode());
    assert_eq!(refused(&real_a) + refused(&real_b), 0.0);
}
