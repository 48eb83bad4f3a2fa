//! Where a guard's replicas come from (R32): every address of a DNS name,
//! re-resolved as it changes and held to the endpoint policy at every
//! resolution; and replicas that join and leave through `guardmesh
//! heartbeat --replica` on a real 3-member etcd cluster (R15).
//!
//! These tests read the replica sets the sources publish (what the guard's
//! pool of links follows). The DNS test resolves through the system's own
//! resolver: it runs in a child process of this binary inside a private
//! mount namespace (`unshare -m`) whose `/etc/hosts` is a file the test
//! writes, so the test owns the name without touching the machine's.

use crate::harness::*;
use guardmesh_client::Registration;
use guardmesh_server::link::dial::EndpointPolicy;
use guardmesh_server::link::discover::dns::{SystemResolver, watch_endpoint};
use guardmesh_server::link::discover::sources::NameSettings;
use guardmesh_server::link::discover::{Replicas, union};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NAME: &str = "replicas.guardmesh.test";
const CHILD_HOSTS: &str = "GUARDMESH_DISCOVERY_HOSTS";

fn endpoints(rx: &Replicas) -> Vec<String> {
    rx.borrow().iter().map(|t| t.endpoint.clone()).collect()
}

fn write_hosts(path: &str, ips: &[&str]) {
    // Written in place (same inode): the bind mount shows the new content.
    let text: String = ips.iter().map(|ip| format!("{ip} {NAME}\n")).collect();
    std::fs::write(path, text).unwrap();
}

async fn until(rx: &mut Replicas, want: &[&str], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while endpoints(rx) != want {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: have {:?}, want {want:?}",
            endpoints(rx)
        );
        let _ = tokio::time::timeout(left, rx.changed()).await;
    }
}

/// Runs the ignored test `child` of this binary in a private mount
/// namespace whose `/etc/hosts` is a file of the test's (its path in
/// [`CHILD_HOSTS`]); the child prints `marker` when it passed.
fn run_in_namespace(child: &str, marker: &str) {
    let dir = fresh_dir("discovery");
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "").unwrap();
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount --bind '{}' /etc/hosts && exec '{}' {child} --exact \
         --include-ignored --test-threads=1 --nocapture",
        hosts.display(),
        exe.display()
    );
    let output = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .env(CHILD_HOSTS, &hosts)
        .output()
        .expect("unshare");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains(marker),
        "the child in its own mount namespace failed: {}\n{stdout}\n{stderr}",
        output.status
    );
    // What the child measured.
    for line in stderr.lines().filter(|l| l.starts_with("MEASURED ")) {
        eprintln!("{line}");
    }
}

/// Serves a proceeding script guard on `ip`:`port` (port 0: any); `None`
/// when that port is taken on `ip`.
async fn guard_on(ip: &str, port: u16) -> Option<TestGuard> {
    let listener = tokio::net::TcpListener::bind((ip, port)).await.ok()?;
    Some(serve_script_guard(listener, |_| Script::default()).await)
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// Sends `total` one-call batches from `workers` concurrent sessions; the
/// replicas that judged them for guard `guard` (trace entries), counted,
/// and the decisions that were not a plain proceed (a failure included).
async fn judged_by(
    mesh: &TestMesh,
    guard: &str,
    workers: usize,
    total: usize,
) -> (std::collections::HashMap<String, usize>, usize) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let session = mesh.session(format!("w{worker}")).await;
        let next = next.clone();
        let guard = guard.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let round = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if round >= total {
                    return seen;
                }
                let d = session.evaluate(one_call(round)).await.expect("a decision");
                seen.push((replica_of(&d, &guard), proceeded(&d)));
            }
        }));
    }
    count_replicas(tasks).await
}

/// Whether `d` is a plain proceed of its one call (no failure).
fn proceeded(d: &guardmesh_client::BatchDecision) -> bool {
    d.calls.len() == 1 && d.calls[0].proceeds() && !d.calls[0].failure
}

/// One-call batches from `workers` sessions until `stop`; each task
/// returns the replica that judged each batch and whether it proceeded.
async fn flowing(
    mesh: &TestMesh,
    guard: &str,
    workers: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<(String, bool)>>> {
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let session = mesh.session(format!("f{worker}")).await;
        let (guard, stop) = (guard.to_owned(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut round = worker * 1_000_000;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round += 1;
                match session.evaluate(one_call(round)).await {
                    Ok(d) => seen.push((replica_of(&d, &guard), proceeded(&d))),
                    Err(_) => seen.push((String::new(), false)),
                }
            }
            seen
        }));
    }
    tasks
}

/// The live replicas of the chain's guard `guard`.
fn live(mesh: &TestMesh, guard: &str) -> Vec<String> {
    mesh.mesh
        .chain()
        .guards
        .iter()
        .find(|g| g.guard.name == guard)
        .and_then(|g| g.link.as_ref())
        .map(|pool| pool.endpoints())
        .unwrap_or_default()
}

async fn until_live(mesh: &TestMesh, guard: &str, want: &[String], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut want = want.to_vec();
    want.sort();
    let sorted = || {
        let mut have = live(mesh, guard);
        have.sort();
        have
    };
    while sorted() != want {
        assert!(
            Instant::now() < deadline,
            "{what}: have {:?}, want {want:?}",
            sorted()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A mesh whose guard is registered by a name resolving to two loopback
/// addresses, a real guard on each: batches are judged by both replicas;
/// while batches flow, a third address joins, one leaves, and the name
/// starts resolving to the metadata address too, which is refused at that
/// re-resolution while the others keep judging, no call failing (R32). A name resolving to 127.0.0.1 and
/// ::1 with a guard listening on 127.0.0.1 only: every batch is judged
/// there, no call fails (the refusing address is ejected and its requests
/// fail over).
#[test]
fn r32_a_mesh_follows_a_dns_name_over_real_guards() {
    run_in_namespace("guard_discovery::dns_mesh_child", "DNS-MESH-CHILD-PASSED");
}

const DUAL: &str = "dual.guardmesh.test";

/// The body of the mesh DNS test, run only as the child above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by r32_a_mesh_follows_a_dns_name_over_real_guards"]
async fn dns_mesh_child() {
    let Ok(hosts) = std::env::var(CHILD_HOSTS) else {
        return;
    };
    // Three guards on one port, on 127.0.0.2, 127.0.0.3 and 127.0.0.4.
    let mut triple = None;
    for _ in 0..20 {
        let a = guard_on("127.0.0.2", 0).await.unwrap();
        let Some(b) = guard_on("127.0.0.3", port_of(&a.url)).await else {
            continue;
        };
        if let Some(c) = guard_on("127.0.0.4", port_of(&a.url)).await {
            triple = Some((a, b, c));
            break;
        }
    }
    let (a, b, c) = triple.expect("one free port on 127.0.0.2, 127.0.0.3 and 127.0.0.4");
    let port = port_of(&a.url);
    // A guard on 127.0.0.1 only, for the dual-family name.
    let single = guard_on("127.0.0.1", 0).await.unwrap();
    let dual_port = port_of(&single.url);
    let write = |ips: &[&str]| {
        let mut text: String = ips.iter().map(|ip| format!("{ip} {NAME}\n")).collect();
        text.push_str(&format!("127.0.0.1 {DUAL}\n::1 {DUAL}\n"));
        std::fs::write(&hosts, text).unwrap();
    };
    write(&["127.0.0.2", "127.0.0.3"]);

    let mut config = fast_config();
    config.link.resolve_interval = Duration::from_secs(1);
    let mesh = TestMesh::with_config(config).await;
    mesh.register(Registration::validate("g", format!("http://{NAME}:{port}")))
        .await;
    let (ra, rb, rc) = (
        format!("http://127.0.0.2:{port}"),
        format!("http://127.0.0.3:{port}"),
        format!("http://127.0.0.4:{port}"),
    );
    until_live(
        &mesh,
        "g",
        &[ra.clone(), rb.clone()],
        "the name's two addresses",
    )
    .await;
    let (counts, wrong) = judged_by(&mesh, "g", 8, 200).await;
    eprintln!("MEASURED two addresses: {counts:?}");
    assert_eq!(wrong, 0, "{counts:?}");
    for replica in [&ra, &rb] {
        let n = counts.get(replica.as_str()).copied().unwrap_or(0);
        assert!(n >= 20, "{replica} judged {n} of 200: {counts:?}");
    }
    assert!(a.guard.requests() >= 20 && b.guard.requests() >= 20);

    // While batches flow: 127.0.0.4 joins the name, then 127.0.0.3 leaves,
    // then the name also resolves to the metadata address, which is
    // refused at that re-resolution while the others keep serving.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flowing = flowing(&mesh, "g", 6, stop.clone()).await;
    write(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]);
    until_live(
        &mesh,
        "g",
        &[ra.clone(), rb.clone(), rc.clone()],
        "127.0.0.4 added",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let joined = c.guard.requests();
    write(&["127.0.0.2", "127.0.0.4"]);
    until_live(&mesh, "g", &[ra.clone(), rc.clone()], "127.0.0.3 removed").await;
    // What it held when it left is answered; then it gets nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left = b.guard.requests();
    write(&["127.0.0.2", "169.254.169.254", "127.0.0.4"]);
    // Three re-resolutions at least: the metadata address never joins.
    let until = Instant::now() + Duration::from_millis(3500);
    while Instant::now() < until {
        let mut have = live(&mesh, "g");
        have.sort();
        assert_eq!(
            have,
            [ra.clone(), rc.clone()],
            "R32: a metadata address is refused at re-resolution"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (during, wrong) = count_replicas(flowing).await;
    eprintln!(
        "MEASURED added, removed, metadata refused while batches flowed: {during:?}; \
         127.0.0.4 judged {joined} within 1 s of joining"
    );
    assert_eq!(
        wrong, 0,
        "R32: no call failed as replicas came and went: {during:?}"
    );
    assert!(joined >= 1, "the added address judged");
    assert_eq!(
        b.guard.requests(),
        left,
        "the removed address got a request"
    );
    assert!(!during.keys().any(|r| r.contains("169.254")), "{during:?}");

    // 127.0.0.4 and the metadata address leave: only 127.0.0.2 judges.
    write(&["127.0.0.2"]);
    until_live(&mesh, "g", std::slice::from_ref(&ra), "re-resolved").await;
    let before = c.guard.requests();
    let (counts, wrong) = judged_by(&mesh, "g", 8, 100).await;
    eprintln!("MEASURED one address: {counts:?}");
    assert_eq!(wrong, 0, "{counts:?}");
    assert_eq!(counts.get(ra.as_str()), Some(&100), "{counts:?}");
    assert_eq!(
        c.guard.requests(),
        before,
        "the removed address got a request"
    );

    // A name on 127.0.0.1 and ::1, a guard on 127.0.0.1 only: two
    // replicas, one refusing; no call fails and 127.0.0.1 judges them all.
    mesh.register(Registration::validate(
        "h",
        format!("http://{DUAL}:{dual_port}"),
    ))
    .await;
    let (v4, v6) = (
        format!("http://127.0.0.1:{dual_port}"),
        format!("http://[::1]:{dual_port}"),
    );
    until_live(&mesh, "h", &[v4.clone(), v6.clone()], "both families").await;
    let (counts, wrong) = judged_by(&mesh, "h", 8, 200).await;
    let failovers = metric(
        &mesh,
        &format!("guardmesh_guard_replica_failovers_total{{guard=\"h\",replica=\"{v6}\"}}"),
    );
    let ejections = metric(
        &mesh,
        &format!("guardmesh_guard_replica_ejections_total{{guard=\"h\",replica=\"{v6}\"}}"),
    );
    eprintln!(
        "MEASURED 127.0.0.1 and ::1, a guard on 127.0.0.1: {counts:?}; ::1 ejected {ejections} times, \
         {failovers} requests failed over"
    );
    assert_eq!(wrong, 0, "no call fails: {counts:?}");
    assert_eq!(counts.get(v4.as_str()), Some(&200), "{counts:?}");
    println!("DNS-MESH-CHILD-PASSED");
}

/// A name resolving to three loopback addresses is three replicas;
/// addresses added and removed in the hosts file are followed while the
/// watch is read; a name that re-resolves to the metadata address loses
/// that address and never publishes it (R32, endpoint policy).
#[test]
fn r32_a_dns_name_is_every_address_it_resolves_to_and_never_metadata() {
    run_in_namespace("guard_discovery::dns_child", "DNS-CHILD-PASSED");
}

/// The body of the DNS test, run only as the child above (in a mount
/// namespace whose /etc/hosts is the test's).
#[tokio::test]
#[ignore = "run by r32_a_dns_name_is_every_address_it_resolves_to_and_never_metadata"]
async fn dns_child() {
    let Ok(hosts) = std::env::var(CHILD_HOSTS) else {
        return;
    };
    write_hosts(&hosts, &["127.0.0.3", "127.0.0.2", "127.0.0.4"]);
    let endpoint = format!("http://{NAME}:7001");
    let names = NameSettings {
        policy: Arc::new(EndpointPolicy::default()),
        interval: Duration::from_secs(1),
        resolver: Arc::new(SystemResolver),
    };
    let (mut rx, handle) = watch_endpoint("g", &endpoint, &names).await.unwrap();
    assert_eq!(
        endpoints(&rx),
        [
            "http://127.0.0.2:7001",
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001"
        ],
        "every address of the name is a replica"
    );
    // One removed, one added: followed on the interval.
    write_hosts(&hosts, &["127.0.0.3", "127.0.0.4", "127.0.0.5"]);
    until(
        &mut rx,
        &[
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001",
            "http://127.0.0.5:7001",
        ],
        "re-resolved on the interval",
    )
    .await;
    // A link asks after a failure: resolved again without waiting.
    write_hosts(&hosts, &["127.0.0.4"]);
    handle.resolve_now();
    until(
        &mut rx,
        &["http://127.0.0.4:7001"],
        "re-resolved on request",
    )
    .await;
    // The name now also points at the metadata address: refused, counted,
    // never published.
    let refused = handle.refused();
    write_hosts(&hosts, &["127.0.0.4", "169.254.169.254", "127.0.0.6"]);
    until(
        &mut rx,
        &["http://127.0.0.4:7001", "http://127.0.0.6:7001"],
        "metadata refused",
    )
    .await;
    assert!(handle.refused() > refused, "the refusal is counted");
    write_hosts(&hosts, &["169.254.169.254"]);
    until(&mut rx, &[], "only metadata left: no replica").await;
    // Unresolvable: the last set stays (empty here), nothing else appears.
    write_hosts(&hosts, &["127.0.0.7"]);
    until(&mut rx, &["http://127.0.0.7:7001"], "back").await;
    println!("DNS-CHILD-PASSED");
}

/// `guardmesh heartbeat --replica` processes, one per replica.
struct Heartbeats(Vec<Child>);

impl Drop for Heartbeats {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Three replicas announced by three heartbeat processes on a real 3-member
/// etcd cluster: killing one heartbeat (SIGKILL) removes only that replica
/// when its lease lapses; the registration's own endpoint stays in the
/// union, and the guard stays in the chain (R32, R15). A heartbeat that
/// announces the metadata address is refused by the endpoint policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_heartbeat_replicas_leave_with_their_own_lease_only() {
    use guardmesh_server::Registry;
    use guardmesh_server::registry::etcd::{EtcdRegistry, Liveness};
    let cluster = crate::etcd::Cluster::start().await;
    let mut config = crate::etcd::cluster_settings(cluster.urls(), "/t/discovery");
    config.lease_ttl = Duration::from_secs(2);
    let registry = EtcdRegistry::connect(config, Duration::from_secs(2))
        .await
        .unwrap();
    let spec = guardmesh_client::proto::GuardSpec {
        name: "g".into(),
        endpoint: "http://127.0.0.2:7001".into(),
        ..Default::default()
    };
    registry
        .register(crate::etcd::admitted(spec), None)
        .await
        .unwrap();

    let file = heartbeat_config(&cluster, "etcd", "/t/discovery");
    let beat = |replica: &str| heartbeat(&file, replica);
    let mut beats = Heartbeats(vec![
        beat("127.0.0.3:7001"),
        beat("http://127.0.0.4:7001"),
        beat("http://127.0.0.5:7001"),
        beat("http://169.254.169.254:80"),
    ]);

    let policy = Arc::new(EndpointPolicy::default());
    let mut announced = registry.replicas("g", policy.clone());
    let mut all = union(vec![
        guardmesh_server::link::discover::fixed(["http://127.0.0.2:7001".to_string()]),
        registry.announced_replicas("g", policy).unwrap(),
    ]);
    until(
        &mut announced,
        &[
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001",
            "http://127.0.0.5:7001",
        ],
        "three heartbeats, three replicas; metadata never",
    )
    .await;
    until(
        &mut all,
        &[
            "http://127.0.0.2:7001",
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001",
            "http://127.0.0.5:7001",
        ],
        "the registration's endpoint and the announced replicas",
    )
    .await;
    // The metadata heartbeat may write its key after the three others.
    let refused_by = Instant::now() + Duration::from_secs(20);
    while registry.replicas_refused() < 1 && Instant::now() < refused_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        registry.replicas_refused() >= 1,
        "the metadata address is refused and counted"
    );
    assert_eq!(
        registry.status().liveness,
        [("g".to_owned(), Liveness::Alive)]
    );

    // kill -9 the heartbeat of 127.0.0.4: its lease lapses (2 s TTL).
    let mut killed = beats.0.remove(1);
    killed.kill().unwrap();
    killed.wait().unwrap();
    until(
        &mut announced,
        &["http://127.0.0.3:7001", "http://127.0.0.5:7001"],
        "only the killed replica leaves",
    )
    .await;
    // The others stay over more than a lease's time.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        endpoints(&announced),
        ["http://127.0.0.3:7001", "http://127.0.0.5:7001"]
    );

    // Every announced replica gone: the guard stays in the chain with its
    // registered endpoint (R15).
    drop(beats);
    until(&mut announced, &[], "every announced replica left").await;
    until(
        &mut all,
        &["http://127.0.0.2:7001"],
        "the registration stays",
    )
    .await;
    assert_eq!(
        registry.chain().guards.len(),
        1,
        "liveness never removes policy"
    );
    let _ = std::fs::remove_dir_all(file.parent().expect("the config's folder"));
}

/// A mesh on a real 3-member etcd cluster whose guard is registered at one
/// address and has three more replicas announced by three `guardmesh
/// heartbeat --replica` processes, a real guard behind each: batches reach
/// the announced replicas; a heartbeat killed with SIGKILL, its replica
/// gets no more batches once its lease lapses, and the others keep judging
/// (R32, R15).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_a_mesh_sends_to_heartbeat_replicas_and_stops_with_their_lease() {
    use guardmesh_server::registry::etcd::EtcdRegistry;
    let cluster = crate::etcd::Cluster::start().await;
    let mut config = crate::etcd::cluster_settings(cluster.urls(), "/t/discovery-mesh");
    config.lease_ttl = Duration::from_secs(2);
    let registry = Arc::new(
        EtcdRegistry::connect(config, Duration::from_secs(2))
            .await
            .unwrap(),
    );
    let mesh = TestMesh::with_registry(fast_config(), registry.clone()).await;
    let mut guards = Vec::new();
    for _ in 0..4 {
        guards.push(guard_on("127.0.0.1", 0).await.unwrap());
    }
    let urls: Vec<String> = guards.iter().map(|g| g.url.clone()).collect();
    mesh.register(Registration::validate("g", &urls[0])).await;

    let file = heartbeat_config(&cluster, "mesh", "/t/discovery-mesh");
    let beat = |replica: &str| heartbeat(&file, replica);
    let mut beats = Heartbeats(urls[1..].iter().map(|u| beat(u)).collect());
    until_live(
        &mesh,
        "g",
        &urls,
        "the registered replica and three announced",
    )
    .await;

    let (counts, wrong) = judged_by(&mesh, "g", 8, 200).await;
    eprintln!("registered + 3 announced: {counts:?}");
    assert_eq!(wrong, 0, "{counts:?}");
    for url in &urls {
        let n = counts.get(url.as_str()).copied().unwrap_or(0);
        assert!(n >= 10, "{url} judged {n} of 200: {counts:?}");
    }

    // kill -9 the heartbeat of the second announced replica while batches
    // flow: its replica leaves when its lease lapses, the others keep
    // judging, and no call fails.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = flowing(&mesh, "g", 6, stop.clone()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut killed = beats.0.remove(1);
    killed.kill().unwrap();
    killed.wait().unwrap();
    let gone = urls[2].clone();
    let kept: Vec<String> = urls.iter().filter(|u| **u != gone).cloned().collect();
    until_live(
        &mesh,
        "g",
        &kept,
        "only the killed heartbeat's replica leaves",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (during, failed) = count_replicas(load).await;
    eprintln!("while the heartbeat was killed and its lease lapsed: {during:?}");
    assert_eq!(failed, 0, "R32: no call failed: {during:?}");
    for url in &kept {
        assert!(
            during.get(url.as_str()).copied().unwrap_or(0) >= 5,
            "{url} kept judging: {during:?}"
        );
    }
    let before = guards[2].guard.requests();
    let (counts, wrong) = judged_by(&mesh, "g", 8, 150).await;
    eprintln!("after one heartbeat was killed: {counts:?}");
    assert_eq!(wrong, 0, "{counts:?}");
    assert_eq!(
        guards[2].guard.requests(),
        before,
        "the left replica got a batch"
    );
    assert!(!counts.contains_key(gone.as_str()), "{counts:?}");
    for url in &kept {
        assert!(
            counts.get(url.as_str()).copied().unwrap_or(0) >= 10,
            "{url}: {counts:?}"
        );
    }
    drop(beats);
    let _ = std::fs::remove_dir_all(file.parent().expect("the config's folder"));
}

/// A mesh config for `guardmesh heartbeat`: the etcd registry of `cluster`
/// under `prefix`, heartbeats every 200 ms on a 2 s lease.
fn heartbeat_config(cluster: &crate::etcd::Cluster, tag: &str, prefix: &str) -> std::path::PathBuf {
    let dir = fresh_dir(&format!("discovery-{tag}"));
    let file = dir.join("mesh.toml");
    let endpoints_toml: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    std::fs::write(
        &file,
        format!(
            "[registry]\nkind = \"etcd\"\nendpoints = [{}]\nprefix = {prefix:?}\n\
             heartbeat_interval_ms = 200\nlease_ttl_s = 2\n",
            endpoints_toml.join(", ")
        ),
    )
    .unwrap();
    file
}

/// `guardmesh heartbeat` announcing `replica` of the guard `g`.
fn heartbeat(file: &std::path::Path, replica: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["heartbeat", "--name", "g", "--config"])
        .arg(file)
        .args(["--replica", replica])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}
