//! Several mesh replicas on one chain, kept in a real etcd (R15, R16, R17).
//!
//! Each test starts its own `etcd` process on free loopback ports in a
//! temporary data directory and kills it when the test ends. The binary comes
//! from Debian's `etcd-server` (3.4): `scripts/setup-etcd` installs it.
//!
//! Tests assert order and outcomes, never timings; every wait is a poll with
//! a deadline. `replica_registration_reaches_the_other_replica_promptly`
//! prints how long a registration takes to reach the other replica.

use crate::harness::*;
use guardmesh_cli::heartbeat::GuardHeartbeat;
use guardmesh_client::proto::{FailurePolicy, TraceStatus};
use guardmesh_client::verdict::steer;
use guardmesh_client::{Batch, BatchDecision, ClientError, Outcome, Registration};
use guardmesh_server::Registry;
use guardmesh_server::registry::etcd::{AfterWindow, EtcdConfig, EtcdRegistry, Liveness};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

// ---------------------------------------------------------------------------
// A real etcd server
// ---------------------------------------------------------------------------

/// An `etcd` process on loopback, with its data directory. Stopping it keeps
/// the data (a restart finds the same chain); dropping it kills the process
/// and removes the directory.
pub(crate) struct Etcd {
    bin: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

fn etcd_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join("etcd"))
        .find(|candidate| candidate.is_file());
    on_path
        .or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "the etcd binary is not installed: run scripts/setup-etcd \
                 (apt-get install -y etcd-server) and run the tests again"
            )
        })
}

fn loopback_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// An etcd not started yet, on ports chosen now (a mesh can be pointed
    /// at it first): [`Etcd::spawn`] starts it.
    pub(crate) fn unstarted() -> Self {
        Self {
            bin: etcd_binary(),
            dir: fresh_dir("etcd"),
            client_port: loopback_port(),
            peer_port: loopback_port(),
            child: None,
        }
    }

    pub(crate) async fn start() -> Self {
        let mut etcd = Self::unstarted();
        // A port chosen free can be taken by another process before etcd
        // binds it: then new ports, at most 3 times.
        for attempt in 1.. {
            match etcd.try_spawn().await {
                Ok(()) => break,
                Err(log) if attempt < 3 && log.contains("address already in use") => {
                    eprintln!("etcd: a port it was given was taken; starting again on new ports");
                    etcd.client_port = loopback_port();
                    etcd.peer_port = loopback_port();
                }
                Err(log) => panic!("etcd exited; its log: {log}"),
            }
        }
        etcd
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The process's id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    /// Its data directory.
    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Starts the process (again) on the same ports and data, and waits
    /// until it answers.
    pub(crate) async fn spawn(&mut self) {
        if let Err(log) = self.try_spawn().await {
            panic!("etcd exited; its log: {log}");
        }
    }

    /// [`Etcd::spawn`], with the log of a process that exited as the error.
    async fn try_spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "etcd is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .unwrap();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&self.bin)
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={}", self.url()))
            .arg(format!("--advertise-client-urls={}", self.url()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(mut client) = connect_within_2s(self.url()).await
                && let Ok(Ok(_)) =
                    tokio::time::timeout(Duration::from_secs(2), client.status()).await
            {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Err(format!(
                    "(exit {status}) {}",
                    std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
                ));
            }
            assert!(Instant::now() < deadline, "etcd did not answer within 30 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the process (like a crash); the data stays.
    pub(crate) fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.url()], None)
            .await
            .unwrap()
    }
}

/// A client of the etcd at `url`, if it connects within 2 s.
async fn connect_within_2s(url: String) -> Option<etcd_client::Client> {
    tokio::time::timeout(
        Duration::from_secs(2),
        etcd_client::Client::connect([url], None),
    )
    .await
    .ok()?
    .ok()
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------
// Mesh replicas
// ---------------------------------------------------------------------------

/// Short probes and leases so that outages are noticed quickly; a long
/// staleness window unless a test is about it.
fn settings(endpoint: String, prefix: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.to_owned(),
        dial_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_millis(700),
        heartbeat_interval: Duration::from_millis(200),
        lease_ttl: Duration::from_secs(2),
        staleness_window: Duration::from_secs(60),
        after_window: AfterWindow::Refuse,
        ..EtcdConfig::default()
    }
}

/// A registration as the config file's entries are: admitted once (R16),
/// with the replicas' default guard timeout and an open endpoint policy.
pub(crate) fn admitted(
    spec: guardmesh_client::proto::GuardSpec,
) -> guardmesh_server::registry::CheckedGuard {
    let admission = guardmesh_server::registry::Admission {
        default_timeout: Duration::from_secs(2),
        endpoint_policy: Arc::default(),
    };
    guardmesh_server::registry::admit_blocking(spec, &admission).unwrap()
}

/// A mesh replica in-process: a real gRPC server whose registry is on etcd.
const NOT_SERVING: i32 = 2;

/// `grpc.health.v1` status of `PreToolService` on a mesh.
async fn pre_tool_health(url: &str) -> i32 {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let channel = channel(url).await;
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "guardmesh.v1.PreToolService".into(),
        })
        .await
        .map(|r| r.into_inner().status)
        .unwrap_or(-1)
}

struct Replica {
    mesh: TestMesh,
    registry: Arc<EtcdRegistry>,
}

impl Replica {
    async fn start(config: EtcdConfig) -> Self {
        let mut mesh_config = fast_config();
        mesh_config.default_guard_timeout = Duration::from_secs(2);
        let registry = Arc::new(
            EtcdRegistry::connect(config, mesh_config.default_guard_timeout)
                .await
                .unwrap(),
        );
        let mesh = TestMesh::with_registry(mesh_config, registry.clone()).await;
        Self { mesh, registry }
    }

    fn names(&self) -> Vec<String> {
        self.registry
            .chain()
            .guards
            .iter()
            .map(|g| g.name.clone())
            .collect()
    }

    fn revision(&self) -> u64 {
        self.registry.chain().revision
    }

    async fn evaluate(&self, batch: Batch) -> Result<BatchDecision, ClientError> {
        self.mesh
            .coordinator()
            .await
            .evaluate_once("s", batch)
            .await
    }

    async fn sees(&self, revision: u64) {
        assert!(
            self.registry
                .wait_for(revision, Duration::from_secs(15))
                .await,
            "replica did not reach revision {revision} (it has {:?})",
            self.registry.status()
        );
    }

    async fn stop(self) {
        self.mesh.shutdown().await;
    }

    /// Registers through this replica's `GuardRegistry`.
    async fn try_register(
        &self,
        registration: Registration,
    ) -> Result<guardmesh_client::proto::RegisterResponse, ClientError> {
        self.mesh.registrar().await.register(registration).await
    }

    async fn register(
        &self,
        registration: Registration,
    ) -> guardmesh_client::proto::RegisterResponse {
        self.try_register(registration).await.unwrap()
    }

    /// Registers through this replica, which must refuse.
    async fn refused(&self, registration: Registration) -> ClientError {
        self.try_register(registration).await.unwrap_err()
    }

    /// Seeds `spec` as a config file's entry is (written only where absent).
    async fn seed(
        &self,
        spec: guardmesh_client::proto::GuardSpec,
    ) -> guardmesh_server::registry::Registered {
        self.registry
            .register_if_absent(admitted(spec))
            .await
            .unwrap()
    }
}

/// A fresh etcd and the settings of replicas under `prefix` on it.
async fn etcd_at(prefix: &str) -> (Etcd, EtcdConfig) {
    let etcd = Etcd::start().await;
    let config = settings(etcd.url(), prefix);
    (etcd, config)
}

/// [`etcd_at`] with two replicas on its settings, started one after the
/// other.
async fn two_replicas(prefix: &str) -> (Etcd, EtcdConfig, Replica, Replica) {
    let (etcd, config) = etcd_at(prefix).await;
    let a = Replica::start(config.clone()).await;
    let b = Replica::start(config.clone()).await;
    (etcd, config, a, b)
}

/// Stops `replicas` one after the other.
async fn stop_all<const N: usize>(replicas: [Replica; N]) {
    for replica in replicas {
        replica.stop().await;
    }
}

fn trace_names(decision: &BatchDecision) -> Vec<String> {
    decision.trace.iter().map(|t| t.guard.clone()).collect()
}

/// A guard that steers every call to `tool`.
async fn veto(tool: &'static str) -> TestGuard {
    call_guard(Duration::ZERO, move |c| {
        (c.tool == tool).then(|| steer(&c.call_id, format!("no {tool}")))
    })
    .await
}

/// Polls `check` every 50 ms until it holds or `within` passes.
async fn poll_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn two_calls() -> Batch {
    Batch::new(0).call("c1", "rm", "{}").call("c2", "ls", "{}")
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

/// Register through A, judge through B with the same chain and revision;
/// re-register and deregister through B, seen by A (R16, R17).
#[tokio::test]
async fn replica_registration_through_one_replica_is_judged_by_the_other() {
    let (_etcd, _, a, b) = two_replicas("/t/two").await;
    let rm = veto("rm").await;
    let ls = veto("ls").await;

    let out = a.register(Registration::validate("veto", &rm.url)).await;
    assert!(out.created);
    assert_eq!(out.position, 0);
    b.sees(out.revision).await;

    let on_b = b.evaluate(two_calls()).await.unwrap();
    assert_eq!(on_b.chain_revision, out.revision, "R17: etcd's revision");
    assert_eq!(on_b.calls[0].outcome, steered("no rm"));
    assert_eq!(on_b.calls[0].decided_by.as_deref(), Some("veto"));
    assert!(on_b.calls[1].proceeds());
    let on_a = a.evaluate(two_calls()).await.unwrap();
    assert_eq!(on_a.chain_revision, on_b.chain_revision);
    assert_eq!(trace_names(&on_a), trace_names(&on_b));
    assert_eq!(on_a.calls, on_b.calls);

    // Through B: a second guard, then re-register the first (to the `ls`
    // guard, fail_open): it is updated in place and keeps its position.
    let registrar_b = b.mesh.registrar().await;
    let audit = proceed_guard().await;
    let second = registrar_b
        .register(Registration::validate("audit", &audit.url))
        .await
        .unwrap();
    assert!(second.created);
    assert_eq!(second.position, 1);
    let again = registrar_b
        .register(Registration::validate("veto", &ls.url).failure_policy(FailurePolicy::FailOpen))
        .await
        .unwrap();
    assert!(!again.created, "R16: an existing name is updated");
    assert_eq!(again.position, 0, "R16: and keeps its position");
    a.sees(again.revision).await;
    let list_a = a.mesh.registrar().await.list().await.unwrap();
    let list_b = registrar_b.list().await.unwrap();
    assert_eq!(list_a, list_b, "both replicas list one chain");
    assert_eq!(list_a.revision, again.revision);
    let names: Vec<_> = list_a.guards.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["veto", "audit"]);
    assert_eq!(list_a.guards[0].endpoint, ls.url);
    assert_eq!(
        list_a.guards[0].failure_policy,
        FailurePolicy::FailOpen as i32
    );
    let on_a = a.evaluate(two_calls()).await.unwrap();
    assert_eq!(on_a.chain_revision, again.revision);
    assert!(on_a.calls[0].proceeds(), "the updated guard judges");
    assert_eq!(on_a.calls[1].outcome, steered("no ls"));
    assert_eq!(trace_names(&on_a), ["veto", "audit"]);

    // Deregister through B, seen by A.
    assert!(registrar_b.deregister("veto").await.unwrap());
    let gone = registrar_b.list().await.unwrap();
    a.sees(gone.revision).await;
    assert_eq!(a.names(), ["audit"]);
    assert_eq!(a.revision(), gone.revision);
    assert!(
        gone.revision > again.revision,
        "a deregistration moves the revision"
    );
    let on_a = a.evaluate(two_calls()).await.unwrap();
    assert!(on_a.calls.iter().all(|c| c.proceeds()));
    assert_eq!(on_a.chain_revision, gone.revision);
    assert!(!registrar_b.deregister("veto").await.unwrap());

    stop_all([a, b]).await;
}

/// The figure for docs/replicas.md: how long a registration through A takes to
/// show in B's chain. Printed, not asserted.
#[tokio::test]
async fn replica_registration_reaches_the_other_replica_promptly() {
    let (_etcd, _, a, b) = two_replicas("/t/latency").await;
    let guard = proceed_guard().await;
    let registrar = a.mesh.registrar().await;
    // Warm the channels.
    registrar
        .register(Registration::validate("warm", &guard.url))
        .await
        .unwrap();

    let mut on_b = Vec::new();
    let mut rpc = Vec::new();
    for i in 0..25 {
        let name = format!("g{i}");
        let mut applied = b.registry.applied_revisions();
        let registry = b.registry.clone();
        let started = Instant::now();
        let seen = {
            let name = name.clone();
            async move {
                loop {
                    if registry.chain().guards.iter().any(|g| g.name == name) {
                        return started.elapsed();
                    }
                    applied.changed().await.unwrap();
                }
            }
        };
        let register = async {
            let out = registrar
                .register(Registration::validate(name.clone(), &guard.url))
                .await
                .unwrap();
            (started.elapsed(), out)
        };
        let (seen, (took, out)) = tokio::time::timeout(Duration::from_secs(15), async {
            tokio::join!(seen, register)
        })
        .await
        .expect("registration reached B");
        assert!(out.created);
        on_b.push(seen);
        rpc.push(took);
    }
    on_b.sort();
    rpc.sort();
    let at = |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    eprintln!(
        "registration through replica A visible in replica B's chain, from the start of A's \
         Register call (n = {}): p50 {:?}, p90 {:?}, max {:?}; A's Register call itself: p50 {:?}, max {:?}",
        on_b.len(),
        at(&on_b, 0.5),
        at(&on_b, 0.9),
        on_b[on_b.len() - 1],
        at(&rpc, 0.5),
        rpc[rpc.len() - 1],
    );
    assert_eq!(a.names(), b.names());
    stop_all([a, b]).await;
}

/// Registrations racing through both replicas produce one order, the same
/// on both: priority, then etcd's create revision (R16).
#[tokio::test]
async fn replica_concurrent_registrations_agree_on_one_order() {
    let (_etcd, _, a, b) = two_replicas("/t/race").await;
    let guard = proceed_guard().await;
    let registrars = [
        ("a", a.mesh.registrar().await),
        ("b", b.mesh.registrar().await),
    ];
    let mut racing = Vec::new();
    for i in 0..8 {
        for (replica, registrar) in &registrars {
            let name = format!("{replica}{i}");
            let priority = (i % 3) - 1;
            let registration = Registration::validate(name.clone(), &guard.url).priority(priority);
            racing.push(async move {
                let out = registrar.register(registration).await.unwrap();
                (name, priority, out)
            });
        }
    }
    let results = futures::future::join_all(racing).await;
    let last = results
        .iter()
        .map(|(_, _, out)| out.revision)
        .max()
        .unwrap();
    a.sees(last).await;
    b.sees(last).await;

    assert_eq!(a.names(), b.names(), "one order on both replicas");
    assert_eq!(a.revision(), b.revision());
    assert_eq!(a.revision(), last);
    // A created key's revision is its create revision: the expected order.
    let mut expected = results.clone();
    expected.sort_by_key(|(_, priority, out)| (*priority, out.revision));
    let expected: Vec<String> = expected.into_iter().map(|(name, _, _)| name).collect();
    assert_eq!(a.names(), expected);
    let batch = || Batch::new(0).call("c1", "t", "{}");
    let on_a = a.evaluate(batch()).await.unwrap();
    let on_b = b.evaluate(batch()).await.unwrap();
    assert_eq!(trace_names(&on_a), expected);
    assert_eq!(trace_names(&on_b), expected);
    assert_eq!(on_a.chain_revision, on_b.chain_revision);
    stop_all([a, b]).await;
}

/// A guard whose heartbeat lease lapses stays in the chain and fails per its
/// policy (R15, R13); when it is back and heartbeats again it judges again.
/// The guards are real processes, killed like a crash.
#[tokio::test]
async fn lease_expired_guard_stays_in_chain_and_fails_per_its_policy() {
    let (_etcd, config, a, b) = two_replicas("/t/lease").await;
    // relaxed (fail_open) steers calls marked "veto"; strict (fail_closed)
    // cancels denied tools such as fs.delete.
    let mut relaxed = GuardProcess::start("veto-marker", 0, &[]);
    let mut strict = GuardProcess::start("deny-list", 0, &[]);
    let registrar = a.mesh.registrar().await;
    registrar
        .register(
            Registration::validate("relaxed", &relaxed.url)
                .priority(-1)
                .failure_policy(FailurePolicy::FailOpen),
        )
        .await
        .unwrap();
    let out = registrar
        .register(
            Registration::validate("strict", &strict.url)
                .tools(["fs.*"])
                .failure_policy(FailurePolicy::FailClosed),
        )
        .await
        .unwrap();
    b.sees(out.revision).await;
    let beats = [
        GuardHeartbeat::start(&config, "relaxed").await.unwrap(),
        GuardHeartbeat::start(&config, "strict").await.unwrap(),
    ];
    let all = |r: &Replica, want: Liveness| {
        let status = r.registry.status();
        status.liveness.len() == 2 && status.liveness.iter().all(|(_, l)| *l == want)
    };
    poll_until(
        Duration::from_secs(15),
        "both guards read alive",
        || async { all(&a, Liveness::Alive) && all(&b, Liveness::Alive) },
    )
    .await;
    let batch = || {
        Batch::new(0)
            .call("c1", "fs.delete", r#"{"path":"/etc"}"#)
            .call("c2", "ls", r#"{"note":"veto"}"#)
    };
    let judged_by_both = |d: &BatchDecision| {
        matches!(d.calls[0].outcome, Outcome::Cancel { .. })
            && !d.calls[0].failure
            && d.calls[0].decided_by.as_deref() == Some("strict")
            && matches!(d.calls[1].outcome, Outcome::Steer { .. })
            && d.calls[1].decided_by.as_deref() == Some("relaxed")
    };
    let judged = b.evaluate(batch()).await.unwrap();
    assert!(judged_by_both(&judged), "{judged:?}");
    let revision = judged.chain_revision;

    // Both guards crash: the processes die and nobody renews the leases.
    let (relaxed_port, strict_port) = (relaxed.port, strict.port);
    relaxed.kill();
    strict.kill();
    drop(beats);
    poll_until(Duration::from_secs(20), "the leases lapse", || async {
        all(&a, Liveness::Expired) && all(&b, Liveness::Expired)
    })
    .await;
    for replica in [&a, &b] {
        assert_eq!(
            replica.names(),
            ["relaxed", "strict"],
            "R15: still in the chain"
        );
        assert_eq!(
            replica.revision(),
            revision,
            "liveness is not a chain change"
        );
        let d = replica.evaluate(batch()).await.unwrap();
        assert_eq!(d.chain_revision, revision);
        // strict is fail_closed: its calls are cancelled, as a failure.
        assert!(
            matches!(d.calls[0].outcome, Outcome::Cancel { .. }),
            "{:?}",
            d.calls[0]
        );
        assert!(d.calls[0].failure);
        assert_eq!(d.calls[0].decided_by.as_deref(), Some("strict"));
        // relaxed is fail_open: bypassed, and the marked call proceeds.
        assert!(d.calls[1].proceeds(), "{:?}", d.calls[1]);
        assert_eq!(d.calls[1].bypassed, ["relaxed"]);
        assert_eq!(status_of(&d, "strict"), TraceStatus::Failed);
        assert_eq!(status_of(&d, "relaxed"), TraceStatus::Failed);
    }

    // Back on the same ports, heartbeating again: judged again.
    let _relaxed = GuardProcess::start("veto-marker", relaxed_port, &[]);
    let _strict = GuardProcess::start("deny-list", strict_port, &[]);
    let _beats = [
        GuardHeartbeat::start(&config, "relaxed").await.unwrap(),
        GuardHeartbeat::start(&config, "strict").await.unwrap(),
    ];
    poll_until(
        Duration::from_secs(15),
        "both guards read alive again",
        || async { all(&a, Liveness::Alive) && all(&b, Liveness::Alive) },
    )
    .await;
    for replica in [&a, &b] {
        poll_until(
            Duration::from_secs(30),
            "the guards judge again",
            || async { matches!(replica.evaluate(batch()).await, Ok(d) if judged_by_both(&d)) },
        )
        .await;
        assert_eq!(replica.revision(), revision);
    }
    stop_all([a, b]).await;
}

/// etcd stops: replicas keep judging with their last chain within the
/// staleness window, then refuse with UNAVAILABLE (or, under `serve_stale`,
/// keep judging); etcd restarts: they recover without a restart of their own.
#[tokio::test]
async fn etcd_outage_judges_within_window_then_refuses_then_recovers() {
    let mut etcd = Etcd::start().await;
    let window = Duration::from_secs(5);
    let config = EtcdConfig {
        staleness_window: window,
        ..settings(etcd.url(), "/t/outage")
    };
    let a = Replica::start(config.clone()).await;
    let b = Replica::start(config.clone()).await;
    let c = Replica::start(EtcdConfig {
        after_window: AfterWindow::ServeStale,
        ..config
    })
    .await;
    let rm = veto("rm").await;
    let out = a.register(Registration::validate("veto", &rm.url)).await;
    for r in [&a, &b, &c] {
        r.sees(out.revision).await;
        assert!(r.registry.status().connected);
    }
    let steered_by_rm = |d: &BatchDecision| {
        d.calls[0].outcome == steered("no rm") && d.chain_revision == out.revision
    };

    etcd.stop();
    poll_until(Duration::from_secs(15), "the replicas notice", || async {
        [&a, &b, &c].iter().all(|r| !r.registry.status().connected)
    })
    .await;
    // Within the window: judged with the last chain. (Asserted only for a
    // batch that provably ran within the window, so a slow machine cannot
    // make this flaky.)
    for r in [&a, &b, &c] {
        let result = r.evaluate(two_calls()).await;
        let status = r.registry.status();
        let stale_for = status.stale_for.expect("stale while etcd is down");
        if stale_for <= window {
            let d = result.unwrap();
            assert!(steered_by_rm(&d), "{d:?}");
            assert!(status.serving);
        }
        assert!(status.last_error.is_some());
    }
    // Writes need etcd: refused, not lost silently.
    let err = b.refused(Registration::validate("late", &rm.url)).await;
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");

    // After the window: A and B refuse; C (serve_stale) keeps judging.
    for r in [&a, &b] {
        poll_until(
            window + Duration::from_secs(20),
            "batches are refused",
            || async {
                matches!(
                    r.evaluate(two_calls()).await,
                    Err(e) if e.code() == Some(tonic::Code::Unavailable)
                )
            },
        )
        .await;
        assert!(!r.registry.status().serving);
        // Reported in health (so load balancers move away) and metrics.
        poll_until(
            Duration::from_secs(10),
            "health says NOT_SERVING",
            || async { pre_tool_health(&r.mesh.url).await == NOT_SERVING },
        )
        .await;
        let metrics = r.mesh.mesh.metrics.encode();
        assert!(metrics.contains("guardmesh_registry_usable 0"), "{metrics}");
        assert!(
            !metrics.contains("guardmesh_registry_stale_seconds 0.0\n"),
            "{metrics}"
        );
    }
    let err = a.evaluate(two_calls()).await.unwrap_err();
    assert!(err.to_string().contains("staleness window"), "{err}");
    // C lost etcd at about the same moment as A and B, not the same instant:
    // wait (bounded) until its own view is past the window too.
    poll_until(
        Duration::from_secs(10),
        "C's staleness passes the window",
        || async { c.registry.status().stale_for.is_some_and(|s| s > window) },
    )
    .await;
    assert!(c.registry.status().serving, "serve_stale keeps serving");
    let d = c.evaluate(two_calls()).await.unwrap();
    assert!(steered_by_rm(&d), "serve_stale keeps judging: {d:?}");

    // etcd is back (same data): every replica recovers on its own.
    etcd.spawn().await;
    for r in [&a, &b, &c] {
        poll_until(
            Duration::from_secs(30),
            "the replica judges again",
            || async { matches!(r.evaluate(two_calls()).await, Ok(d) if steered_by_rm(&d)) },
        )
        .await;
        // Judging again can precede the status catching up (the watch
        // reconnects first); wait for it, bounded.
        poll_until(
            Duration::from_secs(30),
            "the status is fresh again",
            || async {
                let status = r.registry.status();
                status.connected && status.serving && status.stale_for.is_none()
            },
        )
        .await;
        assert_eq!(r.revision(), out.revision);
    }
    // ...and follows the chain again.
    let audit = proceed_guard().await;
    let added = b
        .register(Registration::validate("audit", &audit.url))
        .await;
    for r in [&a, &b, &c] {
        r.sees(added.revision).await;
        assert_eq!(r.names(), ["veto", "audit"]);
    }
    stop_all([a, b, c]).await;
}

/// A replica that restarts lists the whole chain back from etcd: order,
/// settings and revision.
#[tokio::test]
async fn replica_restart_recovers_the_full_chain() {
    let (etcd, config, a, b) = two_replicas("/t/restart").await;
    let rm = veto("rm").await;
    let other = proceed_guard().await;
    let registrar = a.mesh.registrar().await;
    for registration in [
        Registration::validate("second", &other.url),
        Registration::validate("first", &rm.url).priority(-5),
        Registration::validate("third", &other.url).tools(["ls", "sql.*"]),
        Registration::validate("gone", &other.url),
        // Updated in place: keeps its place between first and third.
        Registration::validate("second", &other.url)
            .failure_policy(FailurePolicy::Abort)
            .timeout(Duration::from_millis(300)),
    ] {
        registrar.register(registration).await.unwrap();
    }
    assert!(registrar.deregister("gone").await.unwrap());
    let before = registrar.list().await.unwrap();
    let names: Vec<_> = before.guards.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["first", "second", "third"]);
    a.stop().await;
    drop(registrar);
    // More keys under the prefix than one page of a listing holds, sorted
    // before the registrations: the listing reads on to the end.
    let mut client = etcd.client().await;
    for batch in 0..5 {
        let puts: Vec<_> = (0..128)
            .map(|i| etcd_client::TxnOp::put(format!("/t/restart/a/{batch}-{i}"), "x", None))
            .collect();
        client
            .txn(etcd_client::Txn::new().and_then(puts))
            .await
            .unwrap();
    }

    let again = Replica::start(config).await;
    let listed = again.mesh.registrar().await.list().await.unwrap();
    assert_eq!(listed, before, "the full chain and its revision");
    assert_eq!(
        b.mesh.registrar().await.list().await.unwrap(),
        listed,
        "as the replica that stayed up has it"
    );
    let d = again.evaluate(two_calls()).await.unwrap();
    assert_eq!(d.chain_revision, before.revision);
    assert_eq!(trace_names(&d), ["first", "second", "third"]);
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("first"));
    stop_all([again, b]).await;
}

/// A TCP proxy between one replica and etcd that a test can cut, to
/// partition that replica alone while the other keeps writing.
struct Proxy {
    url: String,
    open: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    task: JoinHandle<()>,
}

impl Proxy {
    async fn start(target: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let open = Arc::new(AtomicBool::new(true));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let task = tokio::spawn({
            let open = open.clone();
            let connections = connections.clone();
            async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if !open.load(Ordering::SeqCst) {
                        continue;
                    }
                    connections.lock().unwrap().push(tokio::spawn(async move {
                        if let Ok(mut outbound) = TcpStream::connect(target).await {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                    }));
                }
            }
        });
        Self {
            url,
            open,
            connections,
            task,
        }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    fn heal(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}

/// A replica cut off from etcd while the other one changes the chain and
/// etcd compacts the history it missed: when it is reachable again its watch
/// cannot resume, so it lists the keys again and serves the same chain.
#[tokio::test]
async fn etcd_partitioned_replica_relists_after_compaction() {
    let etcd = Etcd::start().await;
    let proxy = Proxy::start(etcd.addr()).await;
    let a = Replica::start(settings(proxy.url.clone(), "/t/compact")).await;
    let b = Replica::start(settings(etcd.url(), "/t/compact")).await;
    let rm = veto("rm").await;
    let other = proceed_guard().await;
    let registrar_b = b.mesh.registrar().await;
    let out = b.register(Registration::validate("old", &other.url)).await;
    a.sees(out.revision).await;
    assert_eq!(a.registry.status().relists, 0);

    proxy.cut();
    poll_until(
        Duration::from_secs(15),
        "A notices the partition",
        || async { !a.registry.status().connected },
    )
    .await;
    // Within its (long) window A keeps judging with the chain it had.
    let d = a.evaluate(two_calls()).await.unwrap();
    assert_eq!(trace_names(&d), ["old"]);

    registrar_b
        .register(Registration::validate("veto", &rm.url).priority(-1))
        .await
        .unwrap();
    assert!(registrar_b.deregister("old").await.unwrap());
    let after = registrar_b.list().await.unwrap();
    let mut client = etcd.client().await;
    let now = client
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    client
        .compact(
            now,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
        .unwrap();
    assert_eq!(a.names(), ["old"], "A cannot have seen the changes");

    proxy.heal();
    poll_until(Duration::from_secs(20), "A has B's chain", || async {
        a.revision() == after.revision && a.names() == ["veto"]
    })
    .await;
    let status = a.registry.status();
    assert!(
        status.relists >= 1,
        "listed again after the compaction: {status:?}"
    );
    assert!(status.connected);
    let d = a.evaluate(two_calls()).await.unwrap();
    assert_eq!(d.chain_revision, after.revision);
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("veto"));
    stop_all([a, b]).await;
}

/// The config file's guards seed a shared chain only where absent: a
/// replica restarting with an older file does not roll back a change.
#[tokio::test]
async fn etcd_config_guards_seed_only_missing_registrations() {
    let (_etcd, config) = etcd_at("/t/seed").await;
    let a = Replica::start(config.clone()).await;
    let rm = veto("rm").await;
    let seeded = a
        .seed(Registration::validate("veto", &rm.url).build())
        .await;
    assert!(seeded.created);
    let changed = a
        .register(Registration::validate("veto", &rm.url).failure_policy(FailurePolicy::FailOpen))
        .await;
    let again = a
        .seed(Registration::validate("veto", &rm.url).build())
        .await;
    assert!(!again.created);
    assert_eq!(again.revision, changed.revision, "nothing written");
    assert_eq!(
        a.registry.chain().guards[0].failure_policy,
        FailurePolicy::FailOpen
    );
    // An invalid registration is refused before anything is written.
    let err = a
        .refused(Registration::validate("bad name!", &rm.url))
        .await;
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    assert_eq!(a.revision(), changed.revision);
    a.stop().await;
}

/// Credentials from the config: a replica authenticates as a user whose role
/// only covers its prefix; a wrong password or another prefix is refused at
/// start; after an etcd restart (which voids auth tokens) it recovers.
#[tokio::test]
async fn etcd_credentials_confine_a_replica_to_its_prefix() {
    let mut etcd = Etcd::start().await;
    let mut admin = etcd.client().await;
    admin.user_add("root", "root-pw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.role_add("mesh").await.unwrap();
    admin
        .role_grant_permission(
            "mesh",
            etcd_client::Permission::read_write("/t/auth/").with_prefix(),
        )
        .await
        .unwrap();
    admin.user_add("mesh", "mesh-pw", None).await.unwrap();
    admin.user_grant_role("mesh", "mesh").await.unwrap();
    admin.auth_enable().await.unwrap();

    let with_user = |prefix: &str, password: &str| EtcdConfig {
        username: Some("mesh".into()),
        password: Some(password.into()),
        dial_timeout: Duration::from_secs(3),
        ..settings(etcd.url(), prefix)
    };
    let a = Replica::start(with_user("/t/auth", "mesh-pw")).await;
    let b = Replica::start(with_user("/t/auth", "mesh-pw")).await;
    let rm = veto("rm").await;
    let out = a.register(Registration::validate("veto", &rm.url)).await;
    b.sees(out.revision).await;
    let d = b.evaluate(two_calls()).await.unwrap();
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("veto"));
    let beat = GuardHeartbeat::start(&with_user("/t/auth", "mesh-pw"), "veto")
        .await
        .unwrap();
    poll_until(
        Duration::from_secs(15),
        "the heartbeat reads alive",
        || async { b.registry.status().liveness == [("veto".to_owned(), Liveness::Alive)] },
    )
    .await;

    // A wrong password, then a prefix the role does not cover.
    for (prefix, password, says) in [
        ("/t/auth", "nope", "authentication failed"),
        ("/t/other", "mesh-pw", "permission denied"),
    ] {
        let err = EtcdRegistry::connect(with_user(prefix, password), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
    }

    // An etcd restart voids the replicas' tokens; they authenticate again.
    etcd.stop();
    poll_until(Duration::from_secs(15), "the replicas notice", || async {
        !a.registry.status().connected && !b.registry.status().connected
    })
    .await;
    etcd.spawn().await;
    let audit = proceed_guard().await;
    let registrar_b = b.mesh.registrar().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let added = loop {
        match registrar_b
            .register(Registration::validate("audit", &audit.url))
            .await
        {
            Ok(added) => break added,
            Err(e) => assert!(Instant::now() < deadline, "B cannot register again: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    a.sees(added.revision).await;
    assert_eq!(a.names(), ["veto", "audit"]);
    // The watch can deliver before the next probe confirms the chain.
    poll_until(
        Duration::from_secs(10),
        "A confirms its chain again",
        || async { a.registry.status().connected },
    )
    .await;
    drop(beat);
    stop_all([a, b]).await;
}

// ---------------------------------------------------------------------------
// A real 3-member etcd cluster, and a partition a test can make
// ---------------------------------------------------------------------------

/// Which members are cut off from the others. Every member's peer traffic
/// goes through a proxy that reads the sender from the first request on each
/// connection (etcd's peer requests carry `X-Server-From: <member id>`), so
/// one member can be isolated on loopback while the other two keep a quorum,
/// without any root network tricks.
#[derive(Default)]
struct Partition {
    /// Member id (hex, as etcd writes it) to member name.
    names: Mutex<std::collections::HashMap<String, String>>,
    /// Names of the members on the cut-off side.
    isolated: Mutex<std::collections::HashSet<String>>,
    connections: Mutex<Vec<PeerConnection>>,
}

/// An open peer connection through a proxy.
struct PeerConnection {
    /// The sender's member id, when its first request named it.
    from: Option<String>,
    /// The receiving member's name.
    to: String,
    copier: JoinHandle<()>,
}

impl Partition {
    /// Whether the partition separates the member with id `from` from the
    /// member named `to`.
    fn blocked(&self, from: Option<&str>, to: &str) -> bool {
        let from = from.and_then(|id| self.names.lock().unwrap().get(id).cloned());
        let isolated = self.isolated.lock().unwrap();
        match from {
            Some(from) => isolated.contains(&from) != isolated.contains(to),
            // Requests without a sender (version checks, probes) reach a
            // member only from its own side.
            None => isolated.contains(to),
        }
    }

    /// Cuts `name` off from every other member, including connections that
    /// are already open.
    fn isolate(&self, name: &str) {
        self.isolated.lock().unwrap().insert(name.to_owned());
        let mut connections = self.connections.lock().unwrap();
        connections.retain(|c| {
            let cut = self.blocked(c.from.as_deref(), &c.to);
            if cut {
                c.copier.abort();
            }
            !cut && !c.copier.is_finished()
        });
    }

    fn heal(&self) {
        self.isolated.lock().unwrap().clear();
    }
}

/// Forwards peer connections for member `to` from `listener` to `target`,
/// unless the partition separates the sender from `to`.
async fn peer_proxy(
    listener: TcpListener,
    target: std::net::SocketAddr,
    to: String,
    partition: Arc<Partition>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    while let Ok((mut inbound, _)) = listener.accept().await {
        let partition = partition.clone();
        let to = to.clone();
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
                match tokio::time::timeout(Duration::from_secs(10), inbound.read(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => head.extend_from_slice(&buf[..n]),
                    _ => return,
                }
            }
            let from = header_value(&String::from_utf8_lossy(&head), "X-Server-From");
            let mut connections = partition.connections.lock().unwrap();
            if partition.blocked(from.as_deref(), &to) {
                return;
            }
            let copier = tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(target).await
                    && outbound.write_all(&head).await.is_ok()
                {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
            connections.push(PeerConnection { from, to, copier });
        });
    }
}

/// One member of a [`Cluster`].
pub(crate) struct Member {
    name: String,
    dir: PathBuf,
    client_port: u16,
    child: Option<Child>,
}

impl Member {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills the process at once (SIGKILL), like a crash.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Three etcd members on loopback, each with its own client URL and data
/// directory, their peer traffic through a [`Partition`]. Dropping it kills
/// the members and removes their directories.
pub(crate) struct Cluster {
    pub(crate) members: Vec<Member>,
    partition: Arc<Partition>,
    proxies: Vec<JoinHandle<()>>,
}

impl Cluster {
    /// Starts the three members and waits for their quorum. A port is
    /// chosen free and then handed to etcd, so another process can take it
    /// in between: a member that says so is not a failure of the test, and
    /// the whole cluster starts again on new ports (at most 3 times).
    pub(crate) async fn start() -> Self {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::try_start().await {
                Ok(cluster) => return cluster,
                Err(taken) if attempt < 3 => {
                    eprintln!("etcd cluster: {taken}; starting again on new ports");
                }
                Err(taken) => panic!("etcd cluster: {taken}, {attempt} times"),
            }
        }
    }

    /// One try of [`Cluster::start`]: `Err` when a member could not bind a
    /// port it was given (the members started are killed on the way out).
    async fn try_start() -> Result<Self, String> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let token = format!(
            "guardmesh-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        let partition = Arc::new(Partition::default());
        let bin = etcd_binary();
        let mut proxies = Vec::new();
        let mut peers = Vec::new();
        for i in 0..3 {
            let name = format!("m{i}");
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let advertised = format!("http://{}", listener.local_addr().unwrap());
            let listen_port = loopback_port();
            proxies.push(tokio::spawn(peer_proxy(
                listener,
                std::net::SocketAddr::from(([127, 0, 0, 1], listen_port)),
                name.clone(),
                partition.clone(),
            )));
            peers.push((name, advertised, listen_port));
        }
        let initial = peers
            .iter()
            .map(|(name, url, _)| format!("{name}={url}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (name, advertised, listen_port) in &peers {
            let dir = std::env::temp_dir().join(format!("{token}-{name}"));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let client_port = loopback_port();
            let client = format!("http://127.0.0.1:{client_port}");
            let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
            let child = Command::new(&bin)
                .arg(format!("--name={name}"))
                .arg(format!("--data-dir={}", dir.join("data").display()))
                .arg(format!("--listen-client-urls={client}"))
                .arg(format!("--advertise-client-urls={client}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{listen_port}"))
                .arg(format!("--initial-advertise-peer-urls={advertised}"))
                .arg(format!("--initial-cluster={initial}"))
                .arg("--initial-cluster-state=new")
                .arg(format!("--initial-cluster-token={token}"))
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone().unwrap()))
                .stderr(Stdio::from(log))
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            members.push(Member {
                name: name.clone(),
                dir,
                client_port,
                child: Some(child),
            });
        }
        let cluster = Self {
            members,
            partition,
            proxies,
        };
        // Every member answers a linearizable read: the cluster has a leader
        // and a quorum.
        for member in &cluster.members {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Some(mut client) = connect_within_2s(member.url()).await
                    && let Ok(Ok(_)) =
                        tokio::time::timeout(Duration::from_secs(2), client.get("ready", None))
                            .await
                {
                    break;
                }
                let log = std::fs::read_to_string(member.dir.join("etcd.log")).unwrap_or_default();
                if log.contains("address already in use") {
                    return Err(format!(
                        "member {} found a port it was given taken",
                        member.name
                    ));
                }
                assert!(
                    Instant::now() < deadline,
                    "etcd member {} did not answer within 30 s; its log: {}",
                    member.name,
                    std::fs::read_to_string(member.dir.join("etcd.log")).unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let mut client = etcd_client::Client::connect([cluster.members[0].url()], None)
            .await
            .unwrap();
        let list = client.member_list().await.unwrap();
        let mut names = cluster.partition.names.lock().unwrap();
        for member in list.members() {
            names.insert(format!("{:x}", member.id()), member.name().to_owned());
        }
        assert_eq!(names.len(), 3, "{names:?}");
        drop(names);
        Ok(cluster)
    }

    pub(crate) fn urls(&self) -> Vec<String> {
        self.members.iter().map(Member::url).collect()
    }

    /// Index of a member that is not the leader.
    async fn follower(&self) -> usize {
        for (i, member) in self.members.iter().enumerate() {
            let mut client = etcd_client::Client::connect([member.url()], None)
                .await
                .unwrap();
            let status = client.status().await.unwrap();
            let own = status.header().map(|h| h.member_id()).unwrap_or_default();
            if status.leader() != own {
                return i;
            }
        }
        panic!("every member says it leads");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for proxy in &self.proxies {
            proxy.abort();
        }
        for connection in self.partition.connections.lock().unwrap().drain(..) {
            connection.copier.abort();
        }
        let failed = std::thread::panicking();
        for member in &mut self.members {
            member.kill();
            if failed {
                member.print_elections();
            }
            let _ = std::fs::remove_dir_all(&member.dir);
        }
    }
}

impl Member {
    /// Prints what the member logged about leaders and elections (the
    /// last 40 such lines), so that a failed cluster test says whether the
    /// quorum had a leader while it ran.
    fn print_elections(&self) {
        let Ok(log) = std::fs::read_to_string(self.dir.join("etcd.log")) else {
            return;
        };
        let lines: Vec<&str> = log
            .lines()
            .filter(|line| {
                [
                    "leader",
                    "elect",
                    "campaign",
                    "lost",
                    "became",
                    "partition",
                    "slow",
                ]
                .iter()
                .any(|word| line.contains(word))
            })
            .collect();
        eprintln!(
            "--- etcd {}: leader and election lines ({} in all)",
            self.name,
            lines.len()
        );
        for line in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("{line}");
        }
    }
}

/// The registry settings of a replica that talks to `endpoints` only.
pub(crate) fn cluster_settings(endpoints: Vec<String>, prefix: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints,
        ..settings(String::new(), prefix)
    }
}

/// Registers through `registrar`, retrying while the cluster elects a leader.
async fn register_eventually(
    registrar: &guardmesh_client::Registrar,
    registration: impl Fn() -> Registration,
) -> guardmesh_client::proto::RegisterResponse {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match registrar.register(registration()).await {
            Ok(out) => return out,
            Err(e) => assert!(Instant::now() < deadline, "cannot register: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A replica whose only etcd member is cut off from the other two: the
/// member still answers serializable reads, watches and progress requests,
/// but it cannot confirm the chain with the quorum, which meanwhile adds a
/// guard. The replica judges with its last chain only for the staleness
/// window, then refuses with UNAVAILABLE and says NOT_SERVING; when the
/// partition heals it serves again with the majority's chain (R17).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r17_a_replica_cut_off_from_the_quorum_refuses_after_the_window() {
    let cluster = Cluster::start().await;
    let window = Duration::from_secs(3);
    let prefix = "/t/partition";
    let a = Replica::start(EtcdConfig {
        staleness_window: window,
        ..cluster_settings(vec![cluster.members[2].url()], prefix)
    })
    .await;
    let b = Replica::start(EtcdConfig {
        request_timeout: Duration::from_secs(2),
        ..cluster_settings(cluster.urls()[..2].to_vec(), prefix)
    })
    .await;
    // C knows every member, the cut-off one included.
    let c = Replica::start(EtcdConfig {
        staleness_window: window,
        ..cluster_settings(cluster.urls(), prefix)
    })
    .await;
    let rm = veto("rm").await;
    let ls = veto("ls").await;
    let registrar_b = b.mesh.registrar().await;
    let out = b.register(Registration::validate("veto", &rm.url)).await;
    a.sees(out.revision).await;
    let d = a.evaluate(two_calls()).await.unwrap();
    assert_eq!(trace_names(&d), ["veto"]);
    assert_eq!(d.calls[1].outcome, Outcome::Proceed, "ls goes through");

    let cut = Instant::now();
    cluster.partition.isolate("m2");
    // The majority adds a guard that stops what A lets through.
    let added =
        register_eventually(&registrar_b, || Registration::validate("no-ls", &ls.url)).await;
    // A may judge with its old chain for the window, then refuses.
    let mut judged_for = Duration::ZERO;
    let deadline = Instant::now() + window + Duration::from_secs(15);
    loop {
        match a.evaluate(two_calls()).await {
            Err(e) if e.code() == Some(tonic::Code::Unavailable) => break,
            Err(e) => panic!("unexpected error: {e}"),
            Ok(d) => {
                judged_for = cut.elapsed();
                assert!(d.chain_revision <= added.revision, "{d:?}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "the cut-off replica still judges {:?} after the cut (window {window:?}): {:?}",
            cut.elapsed(),
            a.registry.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused_after = cut.elapsed();
    eprintln!(
        "cut-off replica: last judged {judged_for:?} after the cut, refusing {refused_after:?} after it \
         (staleness window {window:?})"
    );
    assert!(
        judged_for <= window + Duration::from_secs(5),
        "judged for {judged_for:?}"
    );
    let err = a.evaluate(two_calls()).await.unwrap_err();
    assert!(err.to_string().contains("staleness window"), "{err}");
    let status = a.registry.status();
    assert!(!status.serving && !status.connected, "{status:?}");
    poll_until(
        Duration::from_secs(10),
        "health says NOT_SERVING",
        || async { pre_tool_health(&a.mesh.url).await == NOT_SERVING },
    )
    .await;
    poll_until(Duration::from_secs(10), "metrics say unusable", || async {
        let metrics = a.mesh.mesh.metrics.encode();
        metrics.contains("guardmesh_registry_usable 0")
            && !metrics.contains("guardmesh_registry_stale_seconds 0.0\n")
    })
    .await;
    // The majority kept serving all along, and so did C, past the window,
    // with the majority's chain.
    let d = b.evaluate(two_calls()).await.unwrap();
    assert_eq!(trace_names(&d), ["veto", "no-ls"]);
    c.sees(added.revision).await;
    let d = c.evaluate(two_calls()).await.unwrap();
    assert_eq!(trace_names(&d), ["veto", "no-ls"]);
    assert!(c.registry.status().serving, "{:?}", c.registry.status());

    cluster.partition.heal();
    poll_until(
        Duration::from_secs(30),
        "A judges again, with the majority's chain",
        || async {
            matches!(a.evaluate(two_calls()).await,
                Ok(d) if d.chain_revision >= added.revision
                    && trace_names(&d) == ["veto", "no-ls"]
                    && d.calls[1].outcome != Outcome::Proceed)
        },
    )
    .await;
    poll_until(Duration::from_secs(10), "health says SERVING", || async {
        pre_tool_health(&a.mesh.url).await == 1
    })
    .await;
    poll_until(Duration::from_secs(10), "metrics say usable", || async {
        a.mesh
            .mesh
            .metrics
            .encode()
            .contains("guardmesh_registry_usable 1")
    })
    .await;
    stop_all([a, b, c]).await;
}

/// One member of three is killed (the quorum stays): a replica configured
/// with all three endpoints keeps registering and deregistering, every call
/// succeeding, by retrying on another member (R16, R17).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r17_registrations_succeed_while_one_member_is_down() {
    let mut cluster = Cluster::start().await;
    let a = Replica::start(EtcdConfig {
        request_timeout: Duration::from_secs(2),
        ..cluster_settings(cluster.urls(), "/t/member-down")
    })
    .await;
    let rm = veto("rm").await;
    let registrar = a.mesh.registrar().await;
    registrar
        .register(Registration::validate("veto", &rm.url))
        .await
        .unwrap();
    let down = cluster.follower().await;
    cluster.members[down].kill();
    let mut failures = Vec::new();
    for i in 0..30 {
        let name = format!("g{i}");
        if let Err(e) = registrar
            .register(Registration::validate(name.as_str(), &rm.url))
            .await
        {
            failures.push(format!("register {name}: {e}"));
        }
        match registrar.deregister(&name).await {
            Ok(true) => {}
            Ok(false) => failures.push(format!("deregister {name}: not found")),
            Err(e) => failures.push(format!("deregister {name}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 60 calls failed with member {} down: {failures:#?}",
        failures.len(),
        cluster.members[down].name
    );
    assert_eq!(a.names(), ["veto"]);
    let d = a.evaluate(two_calls()).await.unwrap();
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("veto"));
    assert!(a.registry.status().connected);
    a.stop().await;
}

/// A guard deregistered through the API stays gone when a replica starts
/// with an older config file that still lists it; registering it through
/// the API brings it back (R17).
#[tokio::test]
async fn r17_a_deregistered_guard_is_not_brought_back_by_an_old_config() {
    let (_etcd, config) = etcd_at("/t/tombstone").await;
    let a = Replica::start(config.clone()).await;
    let rm = veto("rm").await;
    let file_entry = || Registration::validate("veto", &rm.url).build();
    assert!(a.seed(file_entry()).await.created);
    assert_eq!(a.names(), ["veto"]);
    let registrar = a.mesh.registrar().await;
    assert!(registrar.deregister("veto").await.unwrap());
    assert!(a.names().is_empty());

    // A replica restarting with the old file: the entry is not applied.
    let b = Replica::start(config.clone()).await;
    let seeded = b.seed(file_entry()).await;
    assert!(!seeded.created, "{seeded:?}");
    assert!(b.names().is_empty());
    assert!(a.names().is_empty());
    let d = b.evaluate(two_calls()).await.unwrap();
    assert_eq!(d.calls[0].outcome, Outcome::Proceed);

    // An explicit registration brings it back, and the file's entry
    // still does not override it.
    let again = registrar
        .register(Registration::validate("veto", &rm.url).failure_policy(FailurePolicy::FailOpen))
        .await
        .unwrap();
    assert!(again.created);
    b.sees(again.revision).await;
    assert_eq!(b.names(), ["veto"]);
    assert!(!b.seed(file_entry()).await.created);
    assert_eq!(
        b.registry.chain().guards[0].failure_policy,
        FailurePolicy::FailOpen
    );
    // Deregistered again: gone again for the file.
    assert!(registrar.deregister("veto").await.unwrap());
    let c = Replica::start(config).await;
    assert!(!c.seed(file_entry()).await.created);
    assert!(c.names().is_empty());
    stop_all([a, b, c]).await;
}

/// A stored registration this replica cannot read (written by a newer
/// version, or by hand) is a guard it cannot apply: the replica refuses
/// batches with UNAVAILABLE naming the key, and serves again once the key
/// is deregistered. Leaving the guard out of the chain would let the calls
/// it would have judged through unjudged (R13, R15, R17).
#[tokio::test]
async fn r17_an_unreadable_stored_registration_refuses_batches_until_removed() {
    let etcd = Etcd::start().await;
    let a = Replica::start(settings(etcd.url(), "/t/unreadable")).await;
    let rm = veto("rm").await;
    let registered = a.register(Registration::validate("veto", &rm.url)).await;
    a.sees(registered.revision).await;
    let decision = a.evaluate(two_calls()).await.unwrap();
    assert!(!decision.calls[0].proceeds() && decision.calls[1].proceeds());

    // A value that is not a GuardSpec, under the guards prefix.
    let mut client = etcd.client().await;
    let put = client
        .put("/t/unreadable/guards/newer", vec![0xff, 0xff, 0xff], None)
        .await
        .unwrap();
    a.sees(u64::try_from(put.header().unwrap().revision()).unwrap())
        .await;
    let err = a.evaluate(two_calls()).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    assert!(
        err.to_string().contains("/t/unreadable/guards/newer"),
        "{err}"
    );
    assert_eq!(a.registry.status().invalid.len(), 1);

    // Deregistering it (the operator's fix) lets the replica judge again.
    let removed = a.mesh.registrar().await.deregister("newer").await.unwrap();
    assert!(removed);
    poll_until(
        Duration::from_secs(15),
        "the unreadable key is gone",
        || async { a.registry.status().invalid.is_empty() },
    )
    .await;
    let decision = a.evaluate(two_calls()).await.unwrap();
    assert!(!decision.calls[0].proceeds() && decision.calls[1].proceeds());
    assert!(a.registry.status().invalid.is_empty());
    a.stop().await;
}

/// `guardmesh heartbeat` (the liveness sidecar for guards of any language)
/// holds the guard's lease while the guard's health says SERVING, revokes it
/// when the guard dies, takes it again when the guard is back, and revokes it
/// on SIGTERM. Liveness never changes the chain (R15).
#[tokio::test]
async fn r15_heartbeat_sidecar_follows_the_guard_and_revokes_on_exit() {
    let (etcd, config) = etcd_at("/t/sidecar").await;
    let a = Replica::start(config.clone()).await;
    let mut guard = GuardProcess::start("deny-list", 0, &[]);
    let out = a.register(Registration::validate("deny", &guard.url)).await;
    let dir = fresh_dir("sidecar");
    let file = dir.join("mesh.toml");
    std::fs::write(
        &file,
        format!(
            "[registry]\nkind = \"etcd\"\nendpoints = [\"{}\"]\nprefix = \"/t/sidecar\"\n\
             heartbeat_interval_ms = 200\nlease_ttl_s = 2\n",
            etcd.url()
        ),
    )
    .unwrap();
    let mut sidecar = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["heartbeat", "--name", "deny", "--config"])
        .arg(&file)
        .args(["--guard", &format!("127.0.0.1:{}", guard.port)])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let liveness = |want: Liveness| a.registry.status().liveness == [("deny".to_owned(), want)];
    poll_until(
        Duration::from_secs(15),
        "the sidecar's lease reads alive",
        || async { liveness(Liveness::Alive) },
    )
    .await;

    // The guard dies: the sidecar revokes at its next health check, well
    // before the 2 s TTL would lapse on its own.
    let port = guard.port;
    guard.kill();
    poll_until(Duration::from_secs(10), "the lease is revoked", || async {
        liveness(Liveness::Expired)
    })
    .await;
    assert_eq!(a.revision(), out.revision, "liveness is not a chain change");

    // Back on the same port: alive again, without restarting the sidecar.
    let _guard = GuardProcess::start("deny-list", port, &[]);
    poll_until(Duration::from_secs(15), "alive again", || async {
        liveness(Liveness::Alive)
    })
    .await;

    // SIGTERM: the sidecar revokes the lease and exits cleanly.
    let pid = sidecar.id().to_string();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || sidecar.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    poll_until(Duration::from_secs(5), "revoked on exit", || async {
        liveness(Liveness::Expired)
    })
    .await;
    a.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A policy guard registered through one replica is judged by the other with
/// the same rules (R27: the rules travel in the registration); a new version
/// of the rules is a chain change both replicas see (R17).
#[tokio::test]
async fn r27_r17_replicas_judge_with_the_same_policy_rules() {
    let (_etcd, _, a, b) = two_replicas("/t/policy").await;
    let rules = |tool: &str| {
        format!(
            "[[rule]]\nname = \"no-{tool}\"\nwhen = 'call.tool == \"{tool}\"'\n\
             action = \"steer\"\nmessage = '\"no \" + call.tool'\n"
        )
    };
    let registrar = a.mesh.registrar().await;
    let first = registrar
        .register(Registration::policy("rules", rules("rm")))
        .await
        .unwrap();
    b.sees(first.revision).await;
    for replica in [&a, &b] {
        let d = replica.evaluate(two_calls()).await.unwrap();
        assert_eq!(d.chain_revision, first.revision);
        assert_eq!(d.calls[0].outcome, steered("no rm"));
        assert_eq!(d.calls[0].decided_by.as_deref(), Some("rules"));
        assert!(d.calls[1].proceeds());
    }

    // New rules in place: both replicas judge with them, at a new revision.
    let second = registrar
        .register(Registration::policy("rules", rules("ls")))
        .await
        .unwrap();
    assert!(second.revision > first.revision);
    b.sees(second.revision).await;
    for replica in [&a, &b] {
        let d = replica.evaluate(two_calls()).await.unwrap();
        assert_eq!(d.chain_revision, second.revision);
        assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
        assert_eq!(d.calls[1].outcome, steered("no ls"));
    }
    stop_all([a, b]).await;
}
