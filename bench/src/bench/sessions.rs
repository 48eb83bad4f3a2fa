//! Session memory (R34) and results (R33) in the benchmark: what a batch
//! pays when its chain reads the session's memory, what a batch of results
//! pays against a batch of calls through the same chain, and what a shared
//! store adds to a session-reading batch, in one interleaved group
//! (`guardmesh bench --only sessions`, and part of a full run).
//!
//! | scenario | mesh | batch |
//! |---|---|---|
//! | `session_off` | one policy guard: `examples/policy/relaybleed.toml` with each `session.*` term replaced by one on the batch ([`rules_off`]) | the standard batch |
//! | `session_on` | one policy guard: `relaybleed.toml` as shipped (memory store) | the standard batch |
//! | `session_on_etcd` | the same, its memory in a single-member etcd on loopback | the standard batch |
//! | `remote_session_off` | one zero-latency remote guard that says nothing of session memory (the default: not sent) | the standard batch |
//! | `remote_session_on` | the same guard with `session_memory = "read"`: sent the session's memory | the standard batch |
//! | `call_batch` | the `redact-formats` example guard, mutate, calls and results, asking for the session memory | 4 calls, one holding an AWS access key |
//! | `result_batch` | the same chain (a mesh of its own) | the 4 results of those calls, one holding the key |
//! | `result_batch_etcd` | the same, its memory in the etcd | the same |
//! | `session_on_redis` | as `session_on_etcd`, its memory in a `redis-server` on loopback (no persistence) | the standard batch |
//! | `result_batch_redis` | the same, its memory in that Redis | the same |
//!
//! Every scenario keeps to one session, so from the warm-up on its memory
//! is full (16 KiB by default) and every measured batch reads and writes a
//! whole session: a long session's cost, not a new one's. Each
//! `result_batch` is preceded, untimed, by the batch of its calls (a result
//! is remembered only for a call that ran in its session, R34), as the MCP
//! gateway sends them; its CPU figures are of the pair.
//!
//! Each mesh is a process of its own, `guardmesh bench-session-mesh`
//! ([`serve_mesh`]): `guardmesh serve`'s config file and server, with the
//! session memory attached on the store named (`memory`, `etcd=URL` or `redis=URL`)
//! behind a counter of store operations, which the benchmark reads after
//! the timed rounds with a separate, counted pass per scenario: loads and
//! updates per batch. A scenario whose figures say "off" must not touch the
//! store, and one that says "on" must: otherwise the run fails.
//!
//! The store kinds beyond the mesh's own memory are [`STORES`]: a kind is
//! a line there, a way to start its server ([`StoreServer::start`]) and a
//! way for the mesh process to connect ([`connect_store`]). Without the
//! store's executable on `PATH` (`etcd`, `redis-server`), its scenarios
//! are skipped, said on stderr and in the report, and their figures are
//! `NaN`.

use super::child::Child;
use super::report::{self, Cpu, Latency};
use super::{
    Error, GuardProcess, MeshProcess, OP_TIMEOUT, Plan, START_TIMEOUT, Work, ZERO, cpu_now,
    free_port, round_order,
};
use guardmesh_client::{Batch, BatchDecision, Outcome, ResultOutcome, Session};
use guardmesh_server::session::etcd::EtcdStore;
use guardmesh_server::session::redis::{RedisSettings, RedisStore};
use guardmesh_server::session::{
    Applied, Digester, LocalStore, Memory, SessionKey, SessionLimits, SessionMemory, SessionStore,
    StoreError,
};
use hdrhistogram::Histogram;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The flow policy the session scenarios run, as shipped.
pub(super) const RELAYBLEED: &str = include_str!("../../../examples/policy/relaybleed.toml");

/// `relaybleed.toml`'s terms on `session`, and what [`rules_off`] puts in
/// their place: a term of the same rule on the call, the batch or the
/// context, so that the same rules, scoped to the same tools, are
/// evaluated on the same calls, with no read of the memory.
const SESSION_TERMS: [(&str, &str); 4] = [
    (
        r#"session.seen_from(call.args, "fs")"#,
        r#""exfil" in call.args"#,
    ),
    (r#"session.values_lost > 0"#, r#""forgotten" in call.args"#),
    (
        r#"session.count("email.send", "1h") >= 3"#,
        r#"calls.filter(c, c.tool == "email.send").size() >= 3"#,
    ),
    (
        r#""secret:fs" in session.labels"#,
        r#""secret:fs" in context.metadata"#,
    ),
];

/// The policy of `session_off`: [`RELAYBLEED`] with every term on
/// `session` replaced ([`SESSION_TERMS`]).
pub(super) fn rules_off() -> Result<String, Error> {
    let mut rules = RELAYBLEED.to_owned();
    for (on, off) in SESSION_TERMS {
        if !rules.contains(on) {
            return Err(format!(
                "examples/policy/relaybleed.toml no longer holds {on:?}: update SESSION_TERMS in bench/src/bench/sessions.rs"
            )
            .into());
        }
        rules = rules.replace(on, off);
    }
    let compiled = guardmesh_server::policy::Policy::compile(&rules)
        .map_err(|e| format!("relaybleed without session terms: {e}"))?;
    if compiled.reads_session() {
        return Err(
            "examples/policy/relaybleed.toml reads session in a term SESSION_TERMS does not replace"
                .into(),
        );
    }
    Ok(rules)
}

/// The scenarios' names.
pub(super) const SESSION_OFF: &str = "session_off";
pub(super) const SESSION_ON: &str = "session_on";
pub(super) const REMOTE_OFF: &str = "remote_session_off";
pub(super) const REMOTE_ON: &str = "remote_session_on";
pub(super) const CALL_BATCH: &str = "call_batch";
pub(super) const RESULT_BATCH: &str = "result_batch";

/// A kind of shared store of session memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StoreKind {
    Etcd,
    Redis,
}

/// A shared store the session scenarios measure against the mesh's own
/// memory: `session_on`'s chain and `result_batch`'s, their memory in the
/// store.
#[derive(Debug, Clone, Copy)]
pub(super) struct StoreDef {
    pub kind: StoreKind,
    /// `--store` of the mesh process: `<name>=URL`.
    pub name: &'static str,
    /// The scenario of `session_on`'s chain, and what it is.
    pub scenario: &'static str,
    pub what: &'static str,
    /// The scenario of `result_batch`'s chain, and what it is.
    pub results_scenario: &'static str,
    pub results_what: &'static str,
    /// How to install its server, said when it is not on `PATH`.
    pub install: &'static str,
}

/// The shared stores measured, in order.
pub(super) const STORES: &[StoreDef] = &[
    StoreDef {
        kind: StoreKind::Etcd,
        name: "etcd",
        scenario: "session_on_etcd",
        what: "as session_on, the memory in a single-member etcd on loopback (fsync on)",
        results_scenario: "result_batch_etcd",
        results_what: "as result_batch, the memory in the same etcd (CPU: with the calls)",
        install: "scripts/setup-etcd installs etcd",
    },
    StoreDef {
        kind: StoreKind::Redis,
        name: "redis",
        scenario: "session_on_redis",
        what: "as session_on, the memory in a redis-server on loopback (no persistence)",
        results_scenario: "result_batch_redis",
        results_what: "as result_batch, the memory in the same redis-server (CPU: with the calls)",
        install: "scripts/setup-redis installs redis-server",
    },
];

/// Where the mesh process keeps session memory (`--store`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum StoreSpec {
    /// The mesh's own memory, as `guardmesh serve` keeps it.
    Memory,
    /// A shared store at a URL.
    Shared(StoreKind, String),
}

impl StoreSpec {
    fn parse(text: &str) -> Result<Self, Error> {
        if text == "memory" {
            return Ok(Self::Memory);
        }
        let (name, url) = text
            .split_once('=')
            .filter(|(_, url)| !url.is_empty())
            .ok_or_else(|| format!("bad --store {text:?}: expected memory or KIND=URL"))?;
        let def = STORES
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| format!("bad --store {text:?}: no store kind {name:?}"))?;
        Ok(Self::Shared(def.kind, url.to_owned()))
    }

    fn arg(&self) -> String {
        match self {
            Self::Memory => "memory".to_owned(),
            Self::Shared(kind, url) => {
                let name = STORES
                    .iter()
                    .find(|d| d.kind == *kind)
                    .map_or("?", |d| d.name);
                format!("{name}={url}")
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The mesh process: `guardmesh bench-session-mesh`
// ---------------------------------------------------------------------------

/// Arguments of `guardmesh bench-session-mesh` (hidden).
#[derive(Debug, Clone, clap::Args)]
pub struct SessionMeshArgs {
    /// The mesh's config file, as `guardmesh serve --config` reads it.
    #[arg(long)]
    pub config: PathBuf,
    /// Where session memory is kept: `memory` (the mesh's own, as
    /// `guardmesh serve` keeps it), `etcd=URL` or `redis=URL`.
    #[arg(long, default_value = "memory")]
    pub store: String,
    /// Runtime threads, as `guardmesh serve --worker-threads` (by default
    /// as many as `guardmesh serve` takes on this machine).
    #[arg(long)]
    pub worker_threads: Option<usize>,
}

/// The key prefix of the bench's sessions in a shared store.
const STORE_PREFIX: &str = "/guardmesh-bench/";

/// A store of session memory that counts what it is asked.
#[derive(Debug)]
struct Counted {
    inner: Arc<dyn SessionStore>,
    loads: AtomicU64,
    updates: AtomicU64,
    failures: AtomicU64,
    /// The largest session after an update, in the bytes it is charged.
    bytes: AtomicUsize,
}

impl Counted {
    fn new(inner: Arc<dyn SessionStore>) -> Self {
        Self {
            inner,
            loads: AtomicU64::new(0),
            updates: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            bytes: AtomicUsize::new(0),
        }
    }

    /// `STATS <loads> <updates> <failures> <bytes>`.
    fn line(&self) -> String {
        format!(
            "STATS {} {} {} {}",
            self.loads.load(Ordering::Relaxed),
            self.updates.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed)
        )
    }
}

#[tonic::async_trait]
impl SessionStore for Counted {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        let loaded = self.inner.load(key).await;
        if loaded.is_err() {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        loaded
    }

    /// A read of the mesh: the store's shared snapshot where it has one
    /// (the mesh's own memory), counted as a load.
    async fn snapshot(&self, key: &SessionKey) -> Result<Option<Arc<Memory>>, StoreError> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        let loaded = self.inner.snapshot(key).await;
        if loaded.is_err() {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        loaded
    }

    async fn update(
        &self,
        key: &SessionKey,
        write: guardmesh_server::session::Write<'_>,
    ) -> Result<Applied, StoreError> {
        self.updates.fetch_add(1, Ordering::Relaxed);
        let applied = self.inner.update(key, write).await;
        match &applied {
            Ok(applied) => {
                self.bytes.fetch_max(applied.bytes, Ordering::Relaxed);
            }
            Err(_) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        applied
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn held(&self) -> Option<(usize, usize)> {
        self.inner.held()
    }
}

/// The store the mesh process keeps session memory in.
async fn connect_store(
    spec: &StoreSpec,
    limits: SessionLimits,
    digester: &Digester,
) -> Result<Arc<dyn SessionStore>, Error> {
    Ok(match spec {
        StoreSpec::Memory => Arc::new(LocalStore::new(limits)),
        StoreSpec::Shared(StoreKind::Etcd, url) => {
            let client = tokio::time::timeout(
                START_TIMEOUT,
                etcd_client::Client::connect([url.as_str()], None),
            )
            .await
            .map_err(|_| format!("etcd at {url} did not answer within {START_TIMEOUT:?}"))?
            .map_err(|e| format!("cannot connect to etcd at {url}: {e}"))?;
            Arc::new(EtcdStore::new(client, STORE_PREFIX, digester))
        }
        StoreSpec::Shared(StoreKind::Redis, url) => {
            let settings = RedisSettings {
                url: url.clone(),
                password: None,
                prefix: STORE_PREFIX.to_owned(),
                request_timeout: OP_TIMEOUT,
                dial_timeout: START_TIMEOUT,
            };
            Arc::new(
                RedisStore::connect(&settings, digester)
                    .await
                    .map_err(|e| format!("cannot connect to redis at {url}: {e}"))?,
            )
        }
    })
}

/// Entry point of `guardmesh bench-session-mesh`: the mesh of the config
/// file, as `guardmesh serve` runs it, its session memory in the store
/// named, counted. Answers a line `stats` on stdin with a `STATS` line on
/// stdout; exits when stdin closes (the benchmark holds the other end), on
/// SIGINT or SIGTERM.
pub(super) fn serve_mesh(args: SessionMeshArgs, mesh_default_worker_threads: usize) -> ExitCode {
    let runtime = match args.worker_threads.unwrap_or(mesh_default_worker_threads) {
        0 | 1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    };
    super::run_child(runtime, serve(args))
}

async fn serve(args: SessionMeshArgs) -> Result<(), Error> {
    let spec = StoreSpec::parse(&args.store)?;
    let server = guardmesh_server::run::Server::load_without_sessions(&args.config).await?;
    let limits = server.mesh().config.sessions;
    // Keyed with a random secret, as a single mesh's own memory is.
    let digester = Digester::random();
    let counted = Arc::new(Counted::new(connect_store(&spec, limits, &digester).await?));
    let memory = SessionMemory::new(counted.clone(), digester, limits);
    if server.mesh().attach_sessions(Arc::new(memory)).is_err() {
        return Err(
            "the mesh's session memory was attached before the bench attached its own".into(),
        );
    }
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("bench-stdin".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if line.trim() == "stats" {
                    let mut stdout = std::io::stdout().lock();
                    if writeln!(stdout, "{}", counted.line())
                        .and_then(|()| stdout.flush())
                        .is_err()
                    {
                        break;
                    }
                }
            }
            let _ = closed_tx.send(());
        })?;
    let addr = server.listen_addr();
    server
        .serve(addr, async {
            tokio::select! {
                _ = closed_rx => {}
                () = super::interrupted() => {}
            }
        })
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// The benchmark's side
// ---------------------------------------------------------------------------

/// Store operations over a number of batches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct StoreOps {
    loads: u64,
    updates: u64,
    failures: u64,
    /// The largest session seen, in the bytes it is charged.
    bytes: u64,
}

impl StoreOps {
    fn parse(line: &str) -> Result<Self, Error> {
        let bad = || format!("unexpected line from a session mesh: {line:?}");
        let parts: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| -> Result<u64, Error> {
            parts
                .get(i)
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| bad().into())
        };
        if parts.first() != Some(&"STATS") || parts.len() != 5 {
            return Err(bad().into());
        }
        Ok(Self {
            loads: number(1)?,
            updates: number(2)?,
            failures: number(3)?,
            bytes: number(4)?,
        })
    }

    fn since(self, before: Self) -> Self {
        Self {
            loads: self.loads.saturating_sub(before.loads),
            updates: self.updates.saturating_sub(before.updates),
            failures: self.failures.saturating_sub(before.failures),
            bytes: self.bytes,
        }
    }
}

/// A `bench-session-mesh` process.
struct SessionMesh {
    mesh: MeshProcess,
    lines: mpsc::UnboundedReceiver<String>,
}

impl SessionMesh {
    async fn start(
        exe: &Path,
        dir: &Path,
        label: &str,
        sections: &str,
        guards: usize,
        store: &StoreSpec,
    ) -> Result<Self, Error> {
        let mut last_error: Option<Error> = None;
        // A port found free may be taken before the mesh binds it: retry.
        for attempt in 0..3 {
            let port = free_port()?;
            let config = format!(
                "# guardmesh bench, scenario {label}\nlisten = \"127.0.0.1:{port}\"\n{sections}"
            );
            let config_path = dir.join(format!("{label}.toml"));
            std::fs::write(&config_path, config)
                .map_err(|e| format!("cannot write {}: {e}", config_path.display()))?;
            let mut command = Command::new(exe);
            command
                .arg("bench-session-mesh")
                .arg("--config")
                .arg(&config_path)
                .arg("--store")
                .arg(store.arg());
            let (tx, lines) = mpsc::unbounded_channel();
            let log = dir.join(format!("{label}-{attempt}.log"));
            let child = Child::spawn(format!("the mesh of {label}"), command, Some(log), Some(tx))?;
            let mut mesh = MeshProcess {
                label: label.to_owned(),
                child,
                url: format!("http://127.0.0.1:{port}"),
            };
            match mesh.wait_ready(guards).await {
                Ok(()) => return Ok(Self { mesh, lines }),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| format!("the mesh of {label} did not start").into()))
    }

    /// The store operations of this mesh so far.
    async fn ops(&mut self) -> Result<StoreOps, Error> {
        self.mesh.child.send_line("stats")?;
        match tokio::time::timeout(START_TIMEOUT, self.lines.recv()).await {
            Ok(Some(line)) => StoreOps::parse(&line),
            Ok(None) => {
                self.mesh.child.check_alive()?;
                Err(format!("the mesh of {} closed its output", self.mesh.label).into())
            }
            Err(_) => Err(format!(
                "the mesh of {} did not say its store operations within {START_TIMEOUT:?}",
                self.mesh.label
            )
            .into()),
        }
    }
}

/// A shared store's server, started by the benchmark on loopback.
pub(super) struct StoreServer {
    _child: Child,
    pub(super) url: String,
}

/// An executable on `PATH`.
fn executable(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

impl StoreServer {
    /// Starts the store of `def` in `dir`; `Ok(None)` when its server is
    /// not installed.
    async fn start(def: &StoreDef, dir: &Path) -> Result<Option<Self>, Error> {
        match def.kind {
            StoreKind::Etcd => Self::etcd(dir).await,
            StoreKind::Redis => Self::redis(dir).await,
        }
    }

    /// A `redis-server` on a free loopback port, nothing saved (no RDB
    /// snapshots, no append-only file), its files in `dir`.
    pub(super) async fn redis(dir: &Path) -> Result<Option<Self>, Error> {
        let Some(bin) = executable("redis-server") else {
            return Ok(None);
        };
        let mut last_error: Option<Error> = None;
        // A port found free may be taken before redis binds it: retry.
        for attempt in 0..3 {
            let port = free_port()?;
            let data = dir.join(format!("redis-data-{attempt}"));
            std::fs::create_dir_all(&data)
                .map_err(|e| format!("cannot create {}: {e}", data.display()))?;
            let mut command = Command::new(&bin);
            command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(&data);
            let log = dir.join(format!("redis-{attempt}.log"));
            let mut child = Child::spawn("redis-server", command, Some(log), None)?;
            match Self::redis_ready(port, &mut child).await {
                Ok(()) => {
                    let url = format!("redis://127.0.0.1:{port}");
                    return Ok(Some(Self { _child: child, url }));
                }
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| "redis-server did not start".into()))
    }

    /// Waits until redis on `port` answers `PING`.
    async fn redis_ready(port: u16, child: &mut Child) -> Result<(), Error> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let deadline = Instant::now() + 2 * START_TIMEOUT;
        loop {
            child.check_alive()?;
            let pong = tokio::time::timeout(Duration::from_secs(2), async {
                let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                stream.write_all(b"PING\r\n").await?;
                let mut answer = [0u8; 7];
                stream.read_exact(&mut answer).await?;
                Ok::<bool, std::io::Error>(&answer == b"+PONG\r\n")
            })
            .await;
            if let Ok(Ok(true)) = pong {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "redis-server on port {port} did not answer PING within {:?}{}",
                    2 * START_TIMEOUT,
                    child.log_tail()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A single-member etcd on two free loopback ports, its data in `dir`.
    async fn etcd(dir: &Path) -> Result<Option<Self>, Error> {
        let Some(bin) = executable("etcd") else {
            return Ok(None);
        };
        let mut last_error: Option<Error> = None;
        // A port found free may be taken before etcd binds it: retry.
        for attempt in 0..3 {
            let (client, peer) = (free_port()?, free_port()?);
            let url = format!("http://127.0.0.1:{client}");
            let peer = format!("http://127.0.0.1:{peer}");
            let data = dir.join(format!("etcd-data-{attempt}"));
            let mut command = Command::new(&bin);
            command
                .arg("--name=bench")
                .arg(format!("--data-dir={}", data.display()))
                .arg(format!("--listen-client-urls={url}"))
                .arg(format!("--advertise-client-urls={url}"))
                .arg(format!("--listen-peer-urls={peer}"))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .arg(format!("--initial-cluster=bench={peer}"));
            let log = dir.join(format!("etcd-{attempt}.log"));
            let mut child = Child::spawn("etcd", command, Some(log), None)?;
            match Self::etcd_ready(&url, &mut child).await {
                Ok(()) => {
                    return Ok(Some(Self { _child: child, url }));
                }
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| "etcd did not start".into()))
    }

    /// Waits until etcd at `url` answers a status request.
    async fn etcd_ready(url: &str, child: &mut Child) -> Result<(), Error> {
        let deadline = Instant::now() + 2 * START_TIMEOUT;
        loop {
            child.check_alive()?;
            let status = tokio::time::timeout(Duration::from_secs(2), async {
                let mut client = etcd_client::Client::connect([url], None).await?;
                client.status().await
            })
            .await;
            if let Ok(Ok(_)) = status {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "etcd on {url} did not answer within {:?}{}",
                    2 * START_TIMEOUT,
                    child.log_tail()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What a scenario sends. Built once per scenario, not per batch.
#[allow(clippy::large_enum_variant)]
enum Op {
    /// One batch of calls, timed.
    Calls(Batch),
    /// The batch of calls (untimed), then the batch of their results
    /// (timed).
    Results { calls: Batch, results: Batch },
}

/// The batches of the redaction scenarios: the standard batch with an AWS
/// access key in the arguments of its second call, and the results of its
/// calls, the second holding the same key.
struct Redaction {
    calls: Batch,
    results: Batch,
}

/// An AWS access key of the documented example form: the redaction guard
/// replaces it with `[REDACTED:aws-access-key]`.
const AWS_KEY: &str = "AKIAIOSFODNN7EXAMPLE";
const REDACTED: &str = "[REDACTED:aws-access-key]";
/// The call (and result) that holds [`AWS_KEY`].
const SECRET_CALL: usize = 1;

impl Redaction {
    fn new(work: &Work) -> Result<Self, Error> {
        let mut calls = work.batch.clone();
        let call = calls
            .calls
            .get_mut(SECRET_CALL)
            .ok_or("the standard batch has too few calls")?;
        let with_key =
            call.arguments
                .replacen("The agent", &format!("key {AWS_KEY}. The agent"), 1);
        if with_key == call.arguments {
            return Err("the standard batch's arguments have no note to put a key in".into());
        }
        call.arguments = with_key;
        let mut results = Batch::new(calls.turn_index).model_text(calls.model_text.clone());
        results.metadata = calls.metadata.clone();
        for (i, call) in calls.calls.iter().enumerate() {
            let server = call.tool.split_once('.').map_or("", |(server, _)| server);
            results = results.result(
                call.call_id.clone(),
                call.tool.clone(),
                server,
                result_json(i, &call.tool),
            );
        }
        Ok(Self { calls, results })
    }
}

/// A `CallToolResult` of about [`super::ARGUMENT_BYTES`] bytes: rows a
/// tool returned; the [`SECRET_CALL`]th holds [`AWS_KEY`].
fn result_json(i: usize, tool: &str) -> String {
    let mut text = format!("{tool} returned 6 rows\nid,name,email,region,created_at\n");
    for row in 0..6 {
        text.push_str(&format!(
            "{},customer-{:04},customer{:04}@example.com,emea,2026-11-{:02}T10:00:00Z\n",
            1000 + row,
            i * 10 + row,
            i * 10 + row,
            row + 1
        ));
    }
    if i == SECRET_CALL {
        text.push_str(&format!("aws_access_key_id = {AWS_KEY}\n"));
    }
    let filler = "and the notes the tool attached to its answer; ";
    let pad = super::ARGUMENT_BYTES.saturating_sub(text.len() + 40);
    text.extend(filler.chars().cycle().take(pad));
    serde_json::json!({ "content": [{ "type": "text", "text": text }] }).to_string()
}

/// Checks the decision on a batch of calls: every call proceeds; with
/// `redacts`, the secret call, and only it, was rewritten with the key
/// replaced.
fn check_calls(decision: &BatchDecision, batch: &Batch, redacts: bool) -> Result<(), Error> {
    if decision.calls.len() != batch.calls.len() {
        return Err(format!(
            "the mesh decided {} calls of {}",
            decision.calls.len(),
            batch.calls.len()
        )
        .into());
    }
    for (i, call) in decision.calls.iter().enumerate() {
        if call.outcome != Outcome::Proceed {
            return Err(format!(
                "unexpected decision for {}: {:?} by {:?}",
                call.call_id, call.outcome, call.decided_by
            )
            .into());
        }
        let rewritten = call.final_call.arguments.contains(REDACTED)
            && !call.final_call.arguments.contains(AWS_KEY);
        if redacts && rewritten != (i == SECRET_CALL) {
            return Err(format!(
                "call {}: redacted {rewritten}, expected {}",
                call.call_id,
                i == SECRET_CALL
            )
            .into());
        }
    }
    Ok(())
}

/// Checks the decision on a batch of results: every result is read (never
/// blocked); with `redacts`, the secret result, and only it, was rewritten
/// with the key replaced.
fn check_results(decision: &BatchDecision, batch: &Batch, redacts: bool) -> Result<(), Error> {
    if decision.results.len() != batch.results.len() {
        return Err(format!(
            "the mesh decided {} results of {}",
            decision.results.len(),
            batch.results.len()
        )
        .into());
    }
    for (i, result) in decision.results.iter().enumerate() {
        let expected = if redacts && i == SECRET_CALL {
            ResultOutcome::Rewrite
        } else {
            ResultOutcome::Pass
        };
        let redacted = result.result.contains(REDACTED) && !result.result.contains(AWS_KEY);
        if result.outcome != expected || (expected == ResultOutcome::Rewrite && !redacted) {
            return Err(format!(
                "unexpected decision for the result of {}: {:?} by {:?}, expected {expected:?}",
                result.call_id, result.outcome, result.decided_by
            )
            .into());
        }
    }
    Ok(())
}

/// How a scenario is set up: its mesh (guard sections and store), what it
/// sends, and how many.
struct Setup {
    name: &'static str,
    what: &'static str,
    sections: String,
    store: StoreSpec,
    op: Op,
    redacts: bool,
    /// The process of the chain's remote guard (its CPU is the "guard"
    /// column).
    guard_pid: u32,
    /// (warm-up, per round).
    counts: (u64, u64),
}

/// [`check_calls`] or [`check_results`].
type Check = fn(&BatchDecision, &Batch, bool) -> Result<(), Error>;

/// One scenario of the group.
struct Scenario {
    name: &'static str,
    what: &'static str,
    mesh: SessionMesh,
    session: Session,
    op: Op,
    redacts: bool,
    /// The process of the chain's remote guard, if any (its CPU is the
    /// "guard" column).
    guard_pid: u32,
    /// (warm-up, per round).
    counts: (u64, u64),
    histogram: Histogram<u64>,
    cpu: Cpu,
    /// Store operations per measured batch, from the counted pass.
    ops: StoreOps,
    ops_batches: u64,
}

impl Scenario {
    async fn new(setup: Setup, mesh: SessionMesh) -> Result<Self, Error> {
        let session = mesh.mesh.session(setup.name).await?;
        Ok(Self {
            name: setup.name,
            what: setup.what,
            mesh,
            session,
            op: setup.op,
            redacts: setup.redacts,
            guard_pid: setup.guard_pid,
            counts: setup.counts,
            histogram: report::histogram()?,
            cpu: Cpu::default(),
            ops: StoreOps::default(),
            ops_batches: 0,
        })
    }

    async fn evaluate(&self, batch: &Batch) -> Result<BatchDecision, Error> {
        match tokio::time::timeout(OP_TIMEOUT, self.session.evaluate(batch.clone())).await {
            Ok(Ok(decision)) => Ok(decision),
            Ok(Err(error)) => Err(format!("{}: {error}", self.name).into()),
            Err(_) => Err(format!("{}: no answer within {OP_TIMEOUT:?}", self.name).into()),
        }
    }

    /// The untimed part of one operation: the calls whose results follow.
    async fn prepare(&self) -> Result<(), Error> {
        if let Op::Results { calls, .. } = &self.op {
            let decision = self.evaluate(calls).await?;
            check_calls(&decision, calls, self.redacts)
                .map_err(|e| format!("{}: {e}", self.name))?;
        }
        Ok(())
    }

    /// The timed part of one operation.
    async fn timed(&self) -> Result<Duration, Error> {
        let (batch, check): (&Batch, Check) = match &self.op {
            Op::Calls(batch) => (batch, check_calls),
            Op::Results { results, .. } => (results, check_results),
        };
        let started = Instant::now();
        let decision = self.evaluate(batch).await?;
        let elapsed = started.elapsed();
        check(&decision, batch, self.redacts).map_err(|e| format!("{}: {e}", self.name))?;
        Ok(elapsed)
    }

    async fn once(&self) -> Result<Duration, Error> {
        self.prepare().await?;
        self.timed().await
    }

    async fn warm_up(&self) -> Result<(), Error> {
        for _ in 0..self.counts.0 {
            self.once().await?;
        }
        Ok(())
    }

    async fn measure_round(&mut self) -> Result<(), Error> {
        let mesh_pid = self.mesh.mesh.pid();
        let before = cpu_now(Some(mesh_pid), self.guard_pid)?;
        for _ in 0..self.counts.1 {
            let elapsed = self.once().await?;
            report::record(&mut self.histogram, elapsed);
        }
        self.cpu
            .add(cpu_now(Some(mesh_pid), self.guard_pid)?.since(before));
        Ok(())
    }

    /// The counted pass: the store operations of `n` timed batches alone
    /// (the calls before each result batch are sent first, all of them,
    /// then counted out).
    async fn count_ops(&mut self, n: u64) -> Result<(), Error> {
        if matches!(self.op, Op::Results { .. }) {
            // One batch of calls, then its results, n times; the calls'
            // operations are those of a call batch of this chain, counted
            // in a pass of their own and taken off.
            let before = self.mesh.ops().await?;
            for _ in 0..n {
                self.prepare().await?;
            }
            let calls = self.mesh.ops().await?.since(before);
            let before = self.mesh.ops().await?;
            for _ in 0..n {
                self.once().await?;
            }
            let both = self.mesh.ops().await?.since(before);
            self.ops = StoreOps {
                loads: both.loads.saturating_sub(calls.loads),
                updates: both.updates.saturating_sub(calls.updates),
                failures: both.failures + calls.failures,
                bytes: both.bytes,
            };
        } else {
            let before = self.mesh.ops().await?;
            for _ in 0..n {
                self.timed().await?;
            }
            self.ops = self.mesh.ops().await?.since(before);
        }
        self.ops_batches = n;
        Ok(())
    }

    fn per_batch(&self, ops: u64) -> f64 {
        ops as f64 / self.ops_batches.max(1) as f64
    }

    fn figures(&self) -> Latency {
        Latency::new(self.name, self.what, &self.histogram, self.cpu, true)
    }
}

/// What the group measured.
pub(super) struct SessionFigures {
    pub latency: Vec<Latency>,
    pub ratios: Vec<(String, f64)>,
    /// Scenarios not run, and why.
    pub skipped: Vec<String>,
}

/// Batches of the counted pass of each scenario.
pub(super) const COUNTED_BATCHES: u64 = 20;

/// (warm-up, per round) of the group: at least enough warm-up batches to
/// fill a session's memory (about 50 standard batches with the default
/// bounds).
pub(super) fn counts(quick: bool) -> (u64, u64) {
    if quick { (60, 60) } else { (200, 400) }
}

/// (warm-up, per round) of the result batches on a shared store: each is
/// preceded by its calls, and each of its results is a write of its own
/// (tens of milliseconds per pair on etcd with fsync).
fn store_results_counts(quick: bool) -> (u64, u64) {
    if quick { (10, 20) } else { (40, 100) }
}

/// The redaction example guard (`guardmesh example-guard redact-formats`),
/// a process of its own.
async fn redaction_guard(exe: &Path, dir: &Path) -> Result<(Child, u16), Error> {
    let mut command = Command::new(exe);
    command
        .arg("example-guard")
        .arg("redact-formats")
        .arg("--listen")
        .arg("127.0.0.1:0");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut child = Child::spawn(
        "the redaction guard",
        command,
        Some(dir.join("redact-formats.log")),
        Some(tx),
    )?;
    let line = match tokio::time::timeout(START_TIMEOUT, rx.recv()).await {
        Ok(Some(line)) => line,
        Ok(None) => {
            child.check_alive()?;
            return Err("the redaction guard closed its output before LISTENING".into());
        }
        Err(_) => {
            return Err(format!(
                "the redaction guard did not listen within {START_TIMEOUT:?}{}",
                child.log_tail()
            )
            .into());
        }
    };
    let port = line
        .strip_prefix("LISTENING ")
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| format!("unexpected line from the redaction guard: {line:?}"))?;
    Ok((child, port))
}

/// Runs the group: the meshes, the interleaved rounds, the counted pass.
pub(super) async fn run(
    exe: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    work: &Work,
    plan: &Plan,
    quick: bool,
) -> Result<SessionFigures, Error> {
    let counts = counts(quick);
    let mut skipped = Vec::new();
    // The shared stores, each on loopback.
    let mut servers = Vec::new();
    for def in STORES {
        match StoreServer::start(def, dir).await? {
            Some(server) => servers.push((def, server)),
            None => {
                let why = format!(
                    "{} and {}: no `{}` executable on PATH ({}); their figures are NaN",
                    def.scenario,
                    def.results_scenario,
                    match def.kind {
                        StoreKind::Etcd => "etcd",
                        StoreKind::Redis => "redis-server",
                    },
                    def.install
                );
                eprintln!("[bench] WARNING: SKIPPED {why}");
                skipped.push(why);
            }
        }
    }
    let relaybleed = dir.join("rules_relaybleed.toml");
    let off = dir.join("rules_relaybleed_off.toml");
    std::fs::write(&relaybleed, RELAYBLEED)
        .map_err(|e| format!("cannot write {}: {e}", relaybleed.display()))?;
    std::fs::write(&off, rules_off()?)
        .map_err(|e| format!("cannot write {}: {e}", off.display()))?;
    let policy = |file: &Path| super::policy::guard_section("flows", file);
    // `None`: the guard says nothing of session memory (the default).
    let remote = |memory: Option<&str>| -> Result<String, Error> {
        let memory = memory.map_or(String::new(), |m| format!("session_memory = \"{m}\"\n"));
        Ok(format!(
            "\n[[guard]]\nname = \"{}\"\nendpoint = \"{}\"\n{memory}",
            ZERO[0],
            guards.stream_url(ZERO[0])?
        ))
    };
    let (redactor, redact_port) = redaction_guard(exe, dir).await?;
    let redact = format!(
        "\n[[guard]]\nname = \"redact\"\nendpoint = \"http://127.0.0.1:{redact_port}\"\nrole = \"mutate\"\nphases = \"both\"\ngrant = {{ tools = [\"*\"] }}\nresult_grant = {{ tools = [\"*\"] }}\nsession_memory = \"read\"\n"
    );
    let redaction = Redaction::new(work)?;
    let memory = StoreSpec::Memory;
    let guards_pid = guards.child.pid();
    let redactor_pid = redactor.pid();
    let standard = || Op::Calls(work.batch.clone());
    let results = || Op::Results {
        calls: redaction.calls.clone(),
        results: redaction.results.clone(),
    };
    let store_counts = store_results_counts(quick);
    // (name, what, the mesh's guard sections, its store, what it sends,
    // whether the chain redacts, the guard process, counts).
    let mut setups = vec![
        Setup {
            name: SESSION_OFF,
            what: "one policy guard, relaybleed's rules with no session term (reads no memory)",
            sections: policy(&off),
            store: memory.clone(),
            op: standard(),
            redacts: false,
            guard_pid: guards_pid,
            counts,
        },
        Setup {
            name: SESSION_ON,
            what: "one policy guard, examples/policy/relaybleed.toml (session memory in the mesh)",
            sections: policy(&relaybleed),
            store: memory.clone(),
            op: standard(),
            redacts: false,
            guard_pid: guards_pid,
            counts,
        },
        Setup {
            name: REMOTE_OFF,
            what: "one zero-latency remote guard that does not ask for session memory (the default)",
            sections: remote(None)?,
            store: memory.clone(),
            op: standard(),
            redacts: false,
            guard_pid: guards_pid,
            counts,
        },
        Setup {
            name: REMOTE_ON,
            what: "the same guard, asking for the session's memory (session_memory = \"read\")",
            sections: remote(Some("read"))?,
            store: memory.clone(),
            op: standard(),
            redacts: false,
            guard_pid: guards_pid,
            counts,
        },
        Setup {
            name: CALL_BATCH,
            what: "the redact-formats guard (mutate, calls and results): 4 calls, one key redacted",
            sections: redact.clone(),
            store: memory.clone(),
            op: Op::Calls(redaction.calls.clone()),
            redacts: true,
            guard_pid: redactor_pid,
            counts,
        },
        Setup {
            name: RESULT_BATCH,
            what: "the same chain: the 4 results of those calls, one key redacted (CPU: with the calls)",
            sections: redact.clone(),
            store: memory.clone(),
            op: results(),
            redacts: true,
            guard_pid: redactor_pid,
            counts,
        },
    ];
    for (def, server) in &servers {
        let store = StoreSpec::Shared(def.kind, server.url.clone());
        setups.push(Setup {
            name: def.scenario,
            what: def.what,
            sections: policy(&relaybleed),
            store: store.clone(),
            op: standard(),
            redacts: false,
            guard_pid: guards_pid,
            counts,
        });
        setups.push(Setup {
            name: def.results_scenario,
            what: def.results_what,
            sections: redact.clone(),
            store,
            op: results(),
            redacts: true,
            guard_pid: redactor_pid,
            counts: store_counts,
        });
    }
    let mut scenarios = Vec::with_capacity(setups.len());
    for setup in setups {
        let mesh =
            SessionMesh::start(exe, dir, setup.name, &setup.sections, 1, &setup.store).await?;
        scenarios.push(Scenario::new(setup, mesh).await?);
    }

    let names: Vec<&str> = scenarios.iter().map(|s| s.name).collect();
    eprintln!("[bench] session memory and results: {}", names.join(", "));
    let measured = async {
        for scenario in &scenarios {
            scenario.warm_up().await?;
        }
        for round in 0..plan.rounds {
            for i in round_order(round, scenarios.len()) {
                scenarios[i].measure_round().await?;
            }
        }
        for scenario in &mut scenarios {
            scenario.count_ops(COUNTED_BATCHES).await?;
        }
        Ok::<(), Error>(())
    }
    .await;
    if let Err(error) = measured {
        // Name a dead process rather than its symptom.
        guards.child.check_alive()?;
        for scenario in &mut scenarios {
            scenario.mesh.mesh.child.check_alive()?;
        }
        return Err(error);
    }
    drop(redactor);
    drop(servers);
    for scenario in &scenarios {
        check_store_use(scenario)?;
    }
    let ratios = figures(&scenarios);
    Ok(SessionFigures {
        latency: scenarios.iter().map(Scenario::figures).collect(),
        ratios,
        skipped,
    })
}

/// A scenario said to read no memory must not touch the store, one said
/// to read it must load and update it once per batch at least, and no
/// store operation may fail: otherwise its figures would not measure what
/// they are named for.
fn check_store_use(scenario: &Scenario) -> Result<(), Error> {
    let ops = scenario.ops;
    let off = matches!(scenario.name, SESSION_OFF | REMOTE_OFF);
    let wrong = if ops.failures > 0 {
        Some(format!("{} store operations failed", ops.failures))
    } else if scenario.name == CALL_BATCH {
        // The redaction guard asks for the memory (`session_memory =
        // "read"`, as a guard that follows flows would): one read and one
        // write per batch.
        (ops.loads == 0 || ops.updates == 0)
            .then(|| "the chain's guard is sent the memory but the store was not used".to_owned())
    } else if off {
        (ops.loads + ops.updates > 0).then(|| {
            format!(
                "it reads no memory, yet made {} loads and {} updates",
                ops.loads, ops.updates
            )
        })
    } else {
        (scenario.per_batch(ops.loads) < 1.0 || scenario.per_batch(ops.updates) < 1.0).then(|| {
            format!(
                "it reads the memory, yet made {} loads and {} updates in {} batches",
                ops.loads, ops.updates, scenario.ops_batches
            )
        })
    };
    match wrong {
        Some(why) => Err(format!("{}: {why}", scenario.name).into()),
        None => Ok(()),
    }
}

/// The group's figures: the ratios, absolute p50s, added microseconds and
/// store operations per batch. A store that was skipped gives `NaN`.
fn figures(scenarios: &[Scenario]) -> Vec<(String, f64)> {
    let find = |name: &str| scenarios.iter().find(|s| s.name == name);
    let p50 = |name: &str| find(name).map_or(f64::NAN, |s| s.figures().p50);
    let mesh_cpu = |name: &str| {
        find(name)
            .and_then(|s| s.figures().cpu.mesh)
            .unwrap_or(f64::NAN)
    };
    let per_batch = |name: &str, f: fn(&StoreOps) -> u64| {
        find(name).map_or(f64::NAN, |s| s.per_batch(f(&s.ops)))
    };
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let mut out: Vec<(String, f64)> = vec![
        (
            "session_on_vs_off_p50".into(),
            ratio(p50(SESSION_ON), p50(SESSION_OFF)),
        ),
        ("session_on_p50_us".into(), p50(SESSION_ON)),
        ("session_off_p50_us".into(), p50(SESSION_OFF)),
        (
            "session_on_added_us_p50".into(),
            p50(SESSION_ON) - p50(SESSION_OFF),
        ),
        (
            "session_on_mesh_cpu_us_over_off".into(),
            mesh_cpu(SESSION_ON) - mesh_cpu(SESSION_OFF),
        ),
        (
            "remote_session_on_vs_off_p50".into(),
            ratio(p50(REMOTE_ON), p50(REMOTE_OFF)),
        ),
        ("remote_session_on_p50_us".into(), p50(REMOTE_ON)),
        ("remote_session_off_p50_us".into(), p50(REMOTE_OFF)),
        (
            "remote_session_on_mesh_cpu_us_over_off".into(),
            mesh_cpu(REMOTE_ON) - mesh_cpu(REMOTE_OFF),
        ),
        (
            "result_batch_vs_call_batch_p50".into(),
            ratio(p50(RESULT_BATCH), p50(CALL_BATCH)),
        ),
        ("result_batch_p50_us".into(), p50(RESULT_BATCH)),
        ("call_batch_p50_us".into(), p50(CALL_BATCH)),
        (
            // The result scenario's CPU is of the calls and the results.
            "result_batch_mesh_cpu_us".into(),
            mesh_cpu(RESULT_BATCH) - mesh_cpu(CALL_BATCH),
        ),
        ("call_batch_mesh_cpu_us".into(), mesh_cpu(CALL_BATCH)),
        (
            "session_store_memory_loads_per_batch".into(),
            per_batch(SESSION_ON, |o| o.loads),
        ),
        (
            "session_store_memory_updates_per_batch".into(),
            per_batch(SESSION_ON, |o| o.updates),
        ),
        (
            "remote_session_on_updates_per_batch".into(),
            per_batch(REMOTE_ON, |o| o.updates),
        ),
        (
            "call_batch_store_updates_per_batch".into(),
            per_batch(CALL_BATCH, |o| o.updates),
        ),
        (
            "result_batch_store_loads_per_batch".into(),
            per_batch(RESULT_BATCH, |o| o.loads),
        ),
        (
            "result_batch_store_updates_per_batch".into(),
            per_batch(RESULT_BATCH, |o| o.updates),
        ),
        (
            "session_kib_full".into(),
            find(SESSION_ON).map_or(f64::NAN, |s| s.ops.bytes as f64 / 1024.0),
        ),
    ];
    for def in STORES {
        let name = def.name;
        out.push((
            format!("session_store_{name}_vs_memory_p50"),
            ratio(p50(def.scenario), p50(SESSION_ON)),
        ));
        out.push((
            format!("session_store_{name}_added_us_p50"),
            p50(def.scenario) - p50(SESSION_ON),
        ));
        out.push((format!("session_on_{name}_p50_us"), p50(def.scenario)));
        out.push((
            format!("session_store_{name}_loads_per_batch"),
            per_batch(def.scenario, |o| o.loads),
        ));
        out.push((
            format!("session_store_{name}_updates_per_batch"),
            per_batch(def.scenario, |o| o.updates),
        ));
        out.push((
            format!("result_batch_{name}_vs_memory_p50"),
            ratio(p50(def.results_scenario), p50(RESULT_BATCH)),
        ));
        out.push((
            format!("result_batch_store_{name}_added_us_p50"),
            p50(def.results_scenario) - p50(RESULT_BATCH),
        ));
        out.push((
            format!("result_batch_{name}_store_updates_per_batch"),
            per_batch(def.results_scenario, |o| o.updates),
        ));
    }
    out
}

/// Not a timing: the policies the scenarios run, and the redaction batches.
#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_server::policy::Policy;

    #[test]
    fn session_off_is_relaybleed_without_its_session_terms_on_the_same_tools() {
        // R34: only a policy naming `session` reads the memory, so the
        // off/on pair differs in exactly that.
        let on = Policy::compile(RELAYBLEED).expect("relaybleed compiles");
        let off = Policy::compile(&rules_off().expect("every session term replaced"))
            .expect("the off rules compile");
        assert!(on.reads_session());
        assert!(!off.reads_session());
        assert_eq!(on.rules().len(), off.rules().len());
        let work = Work::new();
        for call in work.calls() {
            let on_tools: Vec<bool> = on
                .rules()
                .iter()
                .map(|r| r.applies_to(&call.tool))
                .collect();
            let off_tools: Vec<bool> = off
                .rules()
                .iter()
                .map(|r| r.applies_to(&call.tool))
                .collect();
            assert_eq!(on_tools, off_tools, "the same rules apply to {}", call.tool);
        }
    }

    #[test]
    fn the_redaction_batches_hold_one_key_each_in_the_same_call() {
        // R33: a result batch answers the calls of the call batch.
        let work = Work::new();
        let r = Redaction::new(&work).expect("the standard batch takes a key");
        assert_eq!(r.calls.calls.len(), r.results.results.len());
        for (i, (call, result)) in r.calls.calls.iter().zip(&r.results.results).enumerate() {
            assert_eq!(call.call_id, result.call_id);
            assert_eq!(call.tool, result.tool);
            assert_eq!(call.arguments.contains(AWS_KEY), i == SECRET_CALL);
            assert_eq!(result.result.contains(AWS_KEY), i == SECRET_CALL);
            let value: serde_json::Value =
                serde_json::from_str(&result.result).expect("a result is JSON");
            assert!(value["content"][0]["text"].is_string());
            assert!(result.result.len() > 400 && result.result.len() < 700);
        }
    }

    #[test]
    fn store_arguments_round_trip_and_bad_ones_are_refused() {
        // R34: the mesh process keeps the memory where it is told, or
        // refuses to start, naming the argument.
        assert_eq!(StoreSpec::parse("memory").ok(), Some(StoreSpec::Memory));
        let etcd = StoreSpec::Shared(StoreKind::Etcd, "http://127.0.0.1:2379".into());
        assert_eq!(StoreSpec::parse(&etcd.arg()).ok(), Some(etcd));
        let redis = StoreSpec::Shared(StoreKind::Redis, "redis://127.0.0.1:6379".into());
        assert_eq!(StoreSpec::parse(&redis.arg()).ok(), Some(redis));
        for bad in ["", "etcd", "etcd=", "nosuch=http://x", "memory=x"] {
            assert!(StoreSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
