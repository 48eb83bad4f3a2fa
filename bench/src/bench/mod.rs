//! `guardmesh bench`: the mesh against calling guards directly, on loopback,
//! in one run.
//!
//! What runs where:
//!
//! * **one guard process** (`guardmesh bench-guards`, this executable): every
//!   guard of every scenario, served by the Rust SDK, each on its own port,
//!   each with its own simulated latency; next to each, the same guard
//!   behind a unary `DirectGuard` port; and one raw unary `Echo` port
//!   (`proto/guardmesh/bench/v1/bench.proto`);
//! * **a fresh mesh process per scenario** (`guardmesh serve --config
//!   <tmp.toml>`, the guards of the scenario declared in the file), so that
//!   the chain differs per scenario without registry traffic in between,
//!   nothing carries over from one scenario to the next, and the mesh's CPU
//!   time (`/proc/<pid>/stat`) and memory (`/proc/<pid>/status`) are its own;
//! * **this process**: the coordinator load generator, using the SDK
//!   (`Session::evaluate` on an `Evaluate` stream; the generated unary
//!   clients for the baselines).
//!
//! Every batch has 4 calls with 500 bytes of JSON arguments each. Latency
//! scenarios keep one batch in flight and are run in groups whose scenarios
//! alternate round by round after their warm-up, so that a change of the
//! machine's state (on these VMs latency is bimodal with vCPU placement)
//! hits both sides of a ratio alike:
//!
//! | group | scenarios |
//! |---|---|
//! | zero-latency guards | `direct_unary`, `direct_parallel_4`, `stream_floor`, `mesh_1`, `mesh_4`, `relay_floor_4` |
//! | 5 ms guards | `direct_unary_5ms`, `direct_parallel_4_5ms`, `mesh_4_5ms`, `relay_floor_4_5ms`, `sequential_4_5ms` |
//! | veto | `veto_1ms`, `early_veto` |
//! | decision log | `log_off`, `log_fsync_record`, `log_fsync_interval` (after the throughput runs, with their own; see [`decision_log`]) |
//! | MCP gateway ([`mcp`]) | `mcp_direct`, `mcp_stdio`, `mcp_stdio_w0`, `mcp_relay_w0`, `mcp_embedded_w0`, `mcp_embedded_relay_w0` |
//! | session memory and results ([`sessions`]) | `session_off`, `session_on`, `session_on_etcd`, `remote_session_off`, `remote_session_on`, `call_batch`, `result_batch`, `result_batch_etcd`, `session_on_redis`, `result_batch_redis` |
//!
//! After the throughput runs, a CPU-bound guard with 1, 2 and 4 replica
//! processes ([`replicas`]).
//!
//! `relay_floor_*` is the relay floor ([`relay`]): the mesh's hops on the
//! same protocols and crates with none of the mesh's work, the floor every
//! mesh-vs-baseline ratio has to clear on the machine that runs the bench.
//!
//! Then throughput (closed loop, 64 batches in flight on 64 sessions, against
//! the echo with 64 calls in flight; windows alternate; `mesh_4` as `serve`
//! runs by default, then with `--worker-threads 1` and `2`, and the relay
//! floor), the CPU per batch of
//! the mesh and per call of the echo server in those windows, and the mesh's
//! RSS with 1,000 idle coordinator streams.
//!
//! Where the processes run is the scheduler's choice unless `--placement`
//! pins them ([`placement`]): `split` puts this process on one CPU and its
//! children on the others, `one` everything on one CPU.
//!
//! Every child process is killed when the benchmark ends, fails, panics or is
//! interrupted ([`child::Child`] kills on drop; children also get a
//! parent-death signal). No timing is asserted anywhere: a run fails only if
//! something does not work.

mod busy;
mod child;
mod compare;
mod decision_log;
mod guards;
mod mcp;
mod placement;
mod policy;
mod relay;
mod replicas;
mod report;
mod sessions;
mod tripwire;

pub use guards::GuardsArgs;
pub use placement::Placement;
pub use relay::RelayArgs;
pub use sessions::SessionMeshArgs;

use crate::proto::EchoMessage;
use crate::proto::direct_guard_client::DirectGuardClient;
use crate::proto::echo_client::EchoClient;
use child::{Child, TempDir};
use futures::{StreamExt, TryStreamExt};
use guardmesh_client::proto::{BatchContext, EvaluateRequest, GuardBatch, ToolCall};
use guardmesh_client::{Batch, Coordinator, Outcome, Registrar, Session};
use guards::GuardDef;
use hdrhistogram::Histogram;
use prost::Message;
use report::{Cpu, Latency, Memory, Results, Throughput};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// How long a child process may take to get ready.
const START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long one operation may take before the run fails.
const OP_TIMEOUT: Duration = Duration::from_secs(10);
/// Calls per batch, and the size of each call's JSON arguments.
const CALLS: usize = 4;
const ARGUMENT_BYTES: usize = 500;
/// Idle coordinator streams for the memory figure.
const IDLE_STREAMS: usize = 1000;

/// A tokio runtime flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Flavor {
    /// One thread (`new_current_thread`).
    Current,
    /// One worker per core (`new_multi_thread`).
    Multi,
}

impl Flavor {
    fn build(self) -> std::io::Result<tokio::runtime::Runtime> {
        match self {
            Self::Current => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
            Self::Multi => tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build(),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Current => "current",
            Self::Multi => "multi",
        }
    }
}

/// Arguments of `guardmesh bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Smoke run: small samples, done within a minute. Its figures are noisy.
    #[arg(long)]
    pub quick: bool,
    /// Writes every figure and ratio to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Interleaved rounds per latency group (default 10; 3 with --quick).
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Batches (and echo calls) in flight in the throughput runs.
    #[arg(long, default_value_t = 64)]
    pub in_flight: usize,
    /// Coordinator connections the 1,000 idle streams are spread over.
    #[arg(long, default_value_t = 10)]
    pub idle_connections: usize,
    /// Worker threads of the extra throughput runs of `mesh_4` (`guardmesh
    /// serve --worker-threads N`), next to the one with the default;
    /// comma-separated; `--mesh-threads` with no value for none.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_values_t = [1, 2])]
    pub mesh_threads: Vec<usize>,
    /// Runtime flavour of the load generator (this process).
    #[arg(long, value_enum, default_value_t = Flavor::Current)]
    pub client_runtime: Flavor,
    /// Runtime flavour of the guard process. The mesh runs as `guardmesh
    /// serve` does.
    #[arg(long, value_enum, default_value_t = Flavor::Current)]
    pub guard_runtime: Flavor,
    /// Diagnostic: serves the guards' `Judge` streams with `TCP_NODELAY` on
    /// the accepted sockets, rather than through the SDK's `serve`.
    #[arg(long)]
    pub guard_nodelay: bool,
    /// Diagnostic: the CPU-bound guard of `replicas` does its work on its
    /// runtime's one thread and times it by the wall clock, as the
    /// benchmark did before (its reads and answers wait for the work, and
    /// time it is preempted counts as work), to measure what that changed.
    #[arg(long)]
    pub cpu_guard_inline: bool,
    /// Where the processes run: `os` (unpinned), `split` (this load
    /// generator on the first CPU, meshes, guards and gateways on the
    /// others) or `one` (everything on the first CPU). Latency on small VMs
    /// is bimodal with placement; `split` and `one` fix it for a whole run.
    #[arg(long, value_enum, default_value_t = Placement::Os)]
    pub placement: Placement,
    /// Runs one group only: `decision-log`, the decision log's cost (log
    /// off, on, on with signed checkpoints), latency and throughput;
    /// `compare`, this build against `--baseline` in one interleaved group;
    /// `mcp`, the MCP gateway's group (the same counts as in a full run);
    /// `replicas`, a CPU-bound guard with 1, 2 and 4 replicas; `sessions`,
    /// session memory on and off, a result batch against a call batch, and
    /// the etcd and Redis stores against the mesh's own memory; `busy`, a
    /// steady client's p99 while another bursts at a busy guard, against
    /// the same client alone; `memory`, the mesh's resident memory idle and
    /// with 1,000 coordinator streams each answered once
    /// (`rss_mib_1000_streams`, as in a full run); `throughput`, `mesh_4`
    /// against the relay floor and the echo with `--in-flight` batches in
    /// flight (the tripwire's two figures, and a window to profile).
    #[arg(long, value_enum)]
    pub only: Option<Only>,
    /// After the run, fails when `cpu_per_batch_mesh4_vs_relay_floor4` or
    /// `throughput_mesh4_vs_relay_floor4` is more than 1.5 times worse than
    /// in this file of committed figures (`bench/last-full-run.json`, the
    /// last full run's). Ratios in one run; meant for `--quick --placement
    /// split`, alone or with `--only throughput` (which measures just the
    /// two figures).
    #[arg(long, value_name = "FILE")]
    pub tripwire: Option<PathBuf>,
    /// Another build's `guardmesh` executable, for `--only compare`: its
    /// meshes run beside this build's, round by round.
    #[arg(long, value_name = "EXE", requires = "only")]
    pub baseline: Option<PathBuf>,
}

/// `guardmesh bench --only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Only {
    DecisionLog,
    Compare,
    Mcp,
    Replicas,
    Sessions,
    Busy,
    Memory,
    Throughput,
}

/// Logs to stderr, `RUST_LOG` or `default_filter`.
fn init_logs(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Completes on SIGINT or SIGTERM.
async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(mut int), Ok(mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The runtime threads `guardmesh serve` takes by default on this machine,
/// as the product binary said when it started the run ([`main`]): the
/// runtime of the `mesh_4` throughput run without `--worker-threads`.
static MESH_DEFAULT_WORKER_THREADS: AtomicUsize = AtomicUsize::new(1);

fn mesh_default_worker_threads() -> usize {
    MESH_DEFAULT_WORKER_THREADS.load(Ordering::Relaxed)
}

/// Entry point of `guardmesh bench`. `mesh_default_worker_threads` is the
/// number of runtime threads `guardmesh serve` takes by default here (the
/// product binary knows it; the run reports it).
pub fn main(args: BenchArgs, mesh_default_worker_threads: usize) -> ExitCode {
    MESH_DEFAULT_WORKER_THREADS.store(mesh_default_worker_threads, Ordering::Relaxed);
    init_logs("warn");
    // Before the runtime starts: its threads inherit this thread's CPUs.
    let pinning = match placement::apply(args.placement) {
        Ok(pinning) => pinning,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    if args.placement != Placement::Os {
        eprintln!(
            "[bench] placement {}: load generator on CPUs {:?}, children on CPUs {:?}",
            args.placement.label(),
            pinning.load.unwrap_or_default(),
            pinning.children.unwrap_or_default()
        );
    }
    let runtime = match args.client_runtime.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tokio::select! {
            result = run(&args) => result,
            () = interrupted() => Err("interrupted".into()),
        }
    });
    // Stops whatever the run left (its tasks hold nothing but sockets).
    runtime.shutdown_timeout(Duration::from_secs(1));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", guardmesh_server::error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Entry point of the hidden `guardmesh bench-mcp-upstream`: the MCP server
/// the gateway scenarios call.
pub fn serve_mcp_upstream() -> ExitCode {
    mcp::serve_upstream()
}

/// The lines a child of the benchmark prints before `READY`, within
/// [`START_TIMEOUT`].
async fn ready_lines(
    rx: &mut mpsc::UnboundedReceiver<String>,
    child: &mut Child,
    what: &str,
) -> Result<Vec<String>, Error> {
    let deadline = Instant::now() + START_TIMEOUT;
    let mut lines = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(line)) if line.trim() == "READY" => return Ok(lines),
            Ok(Some(line)) => lines.push(line),
            Ok(None) => {
                child.check_alive()?;
                return Err(format!("{what} closed its output before READY").into());
            }
            Err(_) => {
                return Err(format!(
                    "{what} was not ready within {START_TIMEOUT:?}{}",
                    child.log_tail()
                )
                .into());
            }
        }
    }
}

/// Runs until the benchmark closes this child's stdin (it holds the other
/// end, so this also happens when it dies), or until SIGINT or SIGTERM.
async fn until_released() -> Result<(), Error> {
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("bench-stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = [0u8; 256];
            while let Ok(n) = std::io::Read::read(&mut stdin, &mut buf) {
                if n == 0 {
                    break;
                }
            }
            let _ = closed_tx.send(());
        })?;
    tokio::select! {
        _ = closed_rx => {}
        () = interrupted() => {}
    }
    Ok(())
}

/// Runs a benchmark child's `serve` on `runtime` and turns the outcome
/// into its exit code, printing why it failed.
fn run_child(
    runtime: std::io::Result<tokio::runtime::Runtime>,
    serve: impl std::future::Future<Output = Result<(), Error>>,
) -> ExitCode {
    init_logs("warn");
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", guardmesh_server::error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Entry point of the hidden `guardmesh bench-relay`; without
/// `--worker-threads`, it runs with `mesh_default_worker_threads`, as
/// `guardmesh serve` would.
pub fn serve_relay(args: RelayArgs, mesh_default_worker_threads: usize) -> ExitCode {
    relay::main(args, mesh_default_worker_threads)
}

/// Entry point of the hidden `guardmesh bench-session-mesh`: a mesh of the
/// session scenarios ([`sessions`]); without `--worker-threads`, it runs
/// with `mesh_default_worker_threads`, as `guardmesh serve` would.
pub fn serve_session_mesh(args: SessionMeshArgs, mesh_default_worker_threads: usize) -> ExitCode {
    sessions::serve_mesh(args, mesh_default_worker_threads)
}

/// Entry point of the hidden `guardmesh bench-guards`.
pub fn serve_guards(args: GuardsArgs) -> ExitCode {
    guards::main(args)
}

/// Sample sizes of a run.
#[derive(Debug, Clone, Copy)]
struct Plan {
    rounds: u32,
    /// (warm-up, per round) for scenarios with zero-latency guards.
    fast: (u64, u64),
    /// (warm-up, per round) for the 5 ms scenarios with one call per batch
    /// and guard.
    slow: (u64, u64),
    /// (warm-up, per round) for `sequential_4_5ms`.
    sequential: (u64, u64),
    /// (warm-up, per round) for the veto scenarios.
    veto: (u64, u64),
    throughput_windows: u32,
    throughput_warmup: Duration,
    throughput_window: Duration,
    /// Pause before reading the RSS, for the streams to settle.
    settle: Duration,
    /// Batches judged in process to time the policy's evaluation.
    policy_iterations: u32,
}

impl Plan {
    fn new(args: &BenchArgs) -> Self {
        let plan = if args.quick {
            Self {
                rounds: 3,
                fast: (500, 700),
                slow: (20, 40),
                sequential: (5, 12),
                veto: (50, 80),
                // Two windows a load, alternating: a burst of the machine's
                // other work during one of them moves the tripwire's
                // ratios half as much as with one.
                throughput_windows: 2,
                throughput_warmup: Duration::from_millis(300),
                throughput_window: Duration::from_secs(1),
                settle: Duration::from_millis(300),
                policy_iterations: 2_000,
            }
        } else {
            Self {
                rounds: 10,
                fast: (2000, 3000),
                slow: (50, 150),
                sequential: (20, 40),
                veto: (200, 300),
                throughput_windows: 3,
                throughput_warmup: Duration::from_millis(500),
                throughput_window: Duration::from_secs(3),
                settle: Duration::from_secs(1),
                policy_iterations: 20_000,
            }
        };
        Self {
            rounds: args.rounds.unwrap_or(plan.rounds).max(1),
            ..plan
        }
    }
}

/// What every operation sends: one batch of [`CALLS`] calls.
struct Work {
    /// For the mesh (`Session::evaluate`).
    batch: Batch,
    /// For a direct call: what the mesh would send a guard.
    guard_batch: GuardBatch,
    /// For the echo: the encoded `EvaluateRequest` of the batch.
    echo: prost::bytes::Bytes,
    request_bytes: usize,
}

/// JSON arguments of exactly [`ARGUMENT_BYTES`] bytes.
fn arguments(i: usize, tool: &str) -> String {
    let base = json!({
        "request": i,
        "tool": tool,
        "query": "SELECT id, name, email, created_at FROM customers WHERE region = 'emea' ORDER BY created_at DESC",
        "options": { "timeout_s": 30, "retries": 2, "dry_run": false },
        "note": "",
    })
    .to_string();
    let filler = "The agent asked for this call while working through the user's request; ";
    let pad = ARGUMENT_BYTES.saturating_sub(base.len());
    let note: String = filler.chars().cycle().take(pad).collect();
    base.replace("\"note\":\"\"", &format!("\"note\":\"{note}\""))
}

impl Work {
    fn new() -> Self {
        let tools = ["sql.query", "http.get", "fs.read", "shell.exec"];
        let mut batch = Batch::new(7)
            .model_text("Looking up the customer records and the related files before answering.")
            .meta("tenant", "acme")
            .meta("user", "u-1042")
            .meta("agent", "support-bot");
        for i in 0..CALLS {
            let tool = tools[i % tools.len()];
            batch = batch.call(format!("call-{i}"), tool, arguments(i, tool));
        }
        let context = BatchContext {
            session_id: "bench".into(),
            turn_index: batch.turn_index,
            model_text: batch.model_text.clone(),
            metadata: batch.metadata.clone(),
        };
        let request = EvaluateRequest {
            batch_id: "bench/7/1".into(),
            context: Some(context.clone()),
            calls: batch.calls.clone(),
            ..EvaluateRequest::default()
        };
        let guard_batch = GuardBatch {
            request_id: 0,
            batch_id: request.batch_id.clone(),
            guard: String::new(),
            context: Some(context),
            calls: batch.calls.clone(),
            deadline_ms: 1000,
            ..GuardBatch::default()
        };
        let encoded = request.encode_to_vec();
        Self {
            batch,
            guard_batch,
            request_bytes: encoded.len(),
            echo: encoded.into(),
        }
    }

    fn calls(&self) -> &[ToolCall] {
        &self.batch.calls
    }
}

/// The guard process and where its guards listen.
struct GuardProcess {
    child: Child,
    /// Name to (stream port, direct port).
    ports: HashMap<String, (u16, u16)>,
    echo_port: u16,
}

impl GuardProcess {
    async fn start(
        exe: &Path,
        dir: &Path,
        defs: &[GuardDef],
        args: &BenchArgs,
    ) -> Result<Self, Error> {
        let mut command = Command::new(exe);
        command
            .arg("bench-guards")
            .arg("--echo")
            .arg("--runtime")
            .arg(args.guard_runtime.label());
        if args.guard_nodelay {
            command.arg("--stream-nodelay");
        }
        if args.cpu_guard_inline {
            command.arg("--cpu-inline");
        }
        for def in defs {
            command.arg("--guard").arg(def.to_arg());
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut child = Child::spawn(
            "the guard process",
            command,
            Some(dir.join("guards.log")),
            Some(tx),
        )?;
        let mut ports = HashMap::new();
        let mut echo_port = None;
        for line in ready_lines(&mut rx, &mut child, "the guard process").await? {
            match line.split_whitespace().collect::<Vec<_>>().as_slice() {
                ["GUARD", name, stream, direct] => {
                    ports.insert((*name).to_owned(), (stream.parse()?, direct.parse()?));
                }
                ["ECHO", port] => echo_port = Some(port.parse()?),
                _ => return Err(format!("unexpected line from the guard process: {line:?}").into()),
            }
        }
        let echo_port = echo_port.ok_or("the guard process serves no echo")?;
        Ok(Self {
            child,
            ports,
            echo_port,
        })
    }

    fn ports(&self, name: &str) -> Result<(u16, u16), Error> {
        self.ports
            .get(name)
            .copied()
            .ok_or_else(|| format!("the guard process serves no guard {name:?}").into())
    }

    fn stream_url(&self, name: &str) -> Result<String, Error> {
        Ok(format!("http://127.0.0.1:{}", self.ports(name)?.0))
    }

    async fn direct(&self, name: &str) -> Result<(String, DirectGuardClient<Channel>), Error> {
        let url = format!("http://127.0.0.1:{}", self.ports(name)?.1);
        Ok((name.to_owned(), DirectGuardClient::new(connect(url).await?)))
    }

    async fn echo(&self) -> Result<EchoClient<Channel>, Error> {
        let url = format!("http://127.0.0.1:{}", self.echo_port);
        Ok(EchoClient::new(connect(url).await?))
    }
}

/// A channel set up as the SDK's coordinator sets up its own.
async fn connect(url: String) -> Result<Channel, Error> {
    Ok(tonic::transport::Endpoint::from_shared(url)?
        .tcp_nodelay(true)
        .connect_timeout(START_TIMEOUT)
        .connect()
        .await?)
}

/// A free loopback port (free when asked; the mesh binds it right after).
fn free_port() -> Result<u16, Error> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// One mesh, `guardmesh serve --config <tmp.toml>`, with its guards declared
/// in the file.
struct MeshProcess {
    label: String,
    child: Child,
    url: String,
}

impl MeshProcess {
    async fn start(
        exe: &Path,
        dir: &Path,
        label: &str,
        guards: &GuardProcess,
        names: &[&str],
    ) -> Result<Self, Error> {
        Self::start_with(exe, dir, label, guards, names, None).await
    }

    /// As [`MeshProcess::start`], with `--worker-threads` when given (the
    /// default of `guardmesh serve` otherwise).
    async fn start_with(
        exe: &Path,
        dir: &Path,
        label: &str,
        guards: &GuardProcess,
        names: &[&str],
        threads: Option<usize>,
    ) -> Result<Self, Error> {
        let sections = Self::guard_sections(guards, names)?;
        Self::start_config(exe, dir, label, &sections, names.len(), threads).await
    }

    /// The `[[guard]]` sections of the guards `names` of `guards`.
    fn guard_sections(guards: &GuardProcess, names: &[&str]) -> Result<String, Error> {
        let mut sections = String::new();
        for name in names {
            sections.push_str(&format!(
                "\n[[guard]]\nname = \"{name}\"\nendpoint = \"{}\"\n",
                guards.stream_url(name)?
            ));
        }
        Ok(sections)
    }

    /// A mesh whose config has the sections `sections` (`count` guards,
    /// and any other section, such as `[decision_log]`).
    async fn start_config(
        exe: &Path,
        dir: &Path,
        label: &str,
        sections: &str,
        count: usize,
        threads: Option<usize>,
    ) -> Result<Self, Error> {
        let mut last_error: Option<Error> = None;
        // A port found free may be taken before the mesh binds it: retry.
        for attempt in 0..3 {
            let port = free_port()?;
            let mut config =
                format!("# guardmesh bench, scenario {label}\nlisten = \"127.0.0.1:{port}\"\n");
            config.push_str(sections);
            let config_path = dir.join(format!("{label}.toml"));
            std::fs::write(&config_path, config)
                .map_err(|e| format!("cannot write {}: {e}", config_path.display()))?;
            let mut command = Command::new(exe);
            command.arg("serve").arg("--config").arg(&config_path);
            if let Some(threads) = threads {
                command.arg("--worker-threads").arg(threads.to_string());
            }
            let log = dir.join(format!("{label}-{attempt}.log"));
            let child = Child::spawn(format!("the mesh of {label}"), command, Some(log), None)?;
            let mut mesh = Self {
                label: label.to_owned(),
                child,
                url: format!("http://127.0.0.1:{port}"),
            };
            match mesh.wait_ready(count).await {
                Ok(()) => return Ok(mesh),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| format!("the mesh of {label} did not start").into()))
    }

    /// The relay floor ([`relay`]) in front of the guards `names` of
    /// `guards`, in a process of its own with the runtime `guardmesh serve`
    /// would use (or `threads`), driven and measured like a mesh.
    async fn start_relay(
        exe: &Path,
        dir: &Path,
        label: &str,
        guards: &GuardProcess,
        names: &[&str],
        threads: Option<usize>,
    ) -> Result<Self, Error> {
        let mut command = Command::new(exe);
        command.arg("bench-relay");
        for name in names {
            command
                .arg("--guard")
                .arg(format!("{name}={}", guards.stream_url(name)?));
        }
        if let Some(threads) = threads {
            command.arg("--worker-threads").arg(threads.to_string());
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut child = Child::spawn(
            format!("the relay of {label}"),
            command,
            Some(dir.join(format!("{label}.log"))),
            Some(tx),
        )?;
        let mut port: Option<u16> = None;
        let what = format!("the relay of {label}");
        for line in ready_lines(&mut rx, &mut child, &what).await? {
            match line.split_whitespace().collect::<Vec<_>>().as_slice() {
                ["RELAY", p] => port = Some(p.parse()?),
                _ => return Err(format!("unexpected line from {what}: {line:?}").into()),
            }
        }
        let port = port.ok_or("the relay printed no port")?;
        Ok(Self {
            label: label.to_owned(),
            child,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    /// Waits until the mesh answers `GuardRegistry.List` with its guards.
    async fn wait_ready(&mut self, guards: usize) -> Result<(), Error> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.child.check_alive()?;
            let url = self.url.clone();
            let listed = tokio::time::timeout(Duration::from_secs(1), async move {
                Registrar::connect(url).await?.list().await
            })
            .await;
            match listed {
                Ok(Ok(list)) if list.guards.len() == guards => {
                    self.child.check_alive()?;
                    return Ok(());
                }
                Ok(Ok(list)) => {
                    return Err(format!(
                        "the mesh of {} on {} lists {} guards, not {guards}",
                        self.label,
                        self.url,
                        list.guards.len()
                    )
                    .into());
                }
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(Err(error)) => {
                    return Err(
                        format!("the mesh of {} on {}: {error}", self.label, self.url).into(),
                    );
                }
                Err(_) => {
                    return Err(format!(
                        "the mesh of {} on {} was not ready within {START_TIMEOUT:?}",
                        self.label, self.url
                    )
                    .into());
                }
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }

    async fn coordinator(&self) -> Result<Coordinator, Error> {
        Ok(Coordinator::from_channel(connect(self.url.clone()).await?))
    }

    async fn session(&self, name: &str) -> Result<Session, Error> {
        Ok(self.coordinator().await?.session(name).await?)
    }
}

/// CPU time of the mesh (if any), the guard process and this process.
fn cpu_now(mesh: Option<u32>, guards: u32) -> Result<Cpu, Error> {
    Ok(Cpu {
        mesh: mesh.map(child::cpu_time).transpose()?.unwrap_or_default(),
        guards: child::cpu_time(guards)?,
        client: child::cpu_time(std::process::id())?,
    })
}

/// Checks a mesh decision: every call proceeds, or every call was steered
/// (by the vetoing guard).
fn check_decision(
    decision: &guardmesh_client::BatchDecision,
    work: &Work,
    veto: bool,
) -> Result<(), Error> {
    if decision.calls.len() != work.calls().len() {
        return Err(format!(
            "the mesh decided {} calls of {}",
            decision.calls.len(),
            work.calls().len()
        )
        .into());
    }
    for call in &decision.calls {
        let ok = match &call.outcome {
            Outcome::Proceed => !veto,
            Outcome::Steer { .. } => veto,
            Outcome::Cancel { .. } | Outcome::Ask { .. } => false,
        };
        if !ok {
            return Err(format!(
                "unexpected decision for {}: {:?} by {:?}",
                call.call_id, call.outcome, call.decided_by
            )
            .into());
        }
    }
    Ok(())
}

/// One unary `DirectGuard.Judge` call, its answer checked.
async fn direct_judge(
    work: &Work,
    name: &str,
    client: &mut DirectGuardClient<Channel>,
    request_id: u64,
    expected_verdicts: usize,
) -> Result<(), Error> {
    let mut batch = work.guard_batch.clone();
    name.clone_into(&mut batch.guard);
    batch.request_id = request_id;
    let answer = client.judge(batch).await?.into_inner();
    if !answer.error.is_empty()
        || answer.request_id != request_id
        || answer.verdicts.len() != expected_verdicts
    {
        return Err(format!("unexpected answer from guard {name}: {answer:?}").into());
    }
    Ok(())
}

/// An open bidi `EchoStream`.
struct EchoStream {
    requests: mpsc::Sender<EchoMessage>,
    answers: tonic::Streaming<EchoMessage>,
}

impl EchoStream {
    async fn open(client: &mut EchoClient<Channel>) -> Result<Self, Error> {
        let (requests, rx) = mpsc::channel(1);
        let answers = client
            .echo_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Self { requests, answers })
    }

    /// Sends `payload` and waits for it to come back.
    async fn round_trip(&mut self, payload: &prost::bytes::Bytes) -> Result<(), Error> {
        self.requests
            .send(EchoMessage {
                payload: payload.clone(),
            })
            .await
            .map_err(|_| "the echo stream is closed")?;
        let answer = self
            .answers
            .message()
            .await?
            .ok_or("the echo stream ended")?;
        if answer.payload.len() == payload.len() {
            Ok(())
        } else {
            Err("the echo stream changed the payload".into())
        }
    }
}

/// How a latency scenario judges a batch.
enum Op {
    /// Unary `DirectGuard.Judge` calls, one guard after another.
    Direct(Vec<(String, DirectGuardClient<Channel>)>),
    /// Unary `DirectGuard.Judge` calls to every guard at once: what a
    /// coordinator without a mesh does with several guards.
    DirectParallel(Vec<(String, DirectGuardClient<Channel>)>),
    /// One message round trip on an open bidi `EchoStream` (the batch's
    /// bytes): the floor of one hop on a stream.
    StreamEcho(EchoStream),
    /// One `Session::evaluate` on the mesh.
    Mesh(Session),
}

/// A latency scenario.
struct Scenario {
    name: &'static str,
    what: &'static str,
    op: Op,
    /// Every call is expected to be vetoed.
    veto: bool,
    mesh_pid: Option<u32>,
    /// (warm-up, per round).
    counts: (u64, u64),
    histogram: Histogram<u64>,
    cpu: Cpu,
    next_request: u64,
}

impl Scenario {
    fn new(
        name: &'static str,
        what: &'static str,
        op: Op,
        veto: bool,
        mesh: Option<&MeshProcess>,
        counts: (u64, u64),
    ) -> Result<Self, Error> {
        Ok(Self {
            name,
            what,
            op,
            veto,
            mesh_pid: mesh.map(MeshProcess::pid),
            counts,
            histogram: report::histogram()?,
            cpu: Cpu::default(),
            next_request: 0,
        })
    }

    async fn once(&mut self, work: &Work) -> Result<(), Error> {
        let expected = if self.veto { work.calls().len() } else { 0 };
        match &mut self.op {
            Op::Direct(clients) => {
                for (name, client) in clients.iter_mut() {
                    self.next_request += 1;
                    let request_id = self.next_request;
                    direct_judge(work, name, client, request_id, expected).await?;
                }
                Ok(())
            }
            Op::DirectParallel(clients) => {
                let first = self.next_request + 1;
                self.next_request += clients.len() as u64;
                futures::future::try_join_all(clients.iter_mut().zip(first..).map(
                    |((name, client), request_id)| {
                        direct_judge(work, name, client, request_id, expected)
                    },
                ))
                .await?;
                Ok(())
            }
            Op::StreamEcho(stream) => stream.round_trip(&work.echo).await,
            Op::Mesh(session) => {
                let decision = session.evaluate(work.batch.clone()).await?;
                check_decision(&decision, work, self.veto)
            }
        }
    }

    async fn timed(&mut self, work: &Work) -> Result<Duration, Error> {
        let started = Instant::now();
        match tokio::time::timeout(OP_TIMEOUT, self.once(work)).await {
            Ok(Ok(())) => Ok(started.elapsed()),
            Ok(Err(error)) => Err(format!("{}: {error}", self.name).into()),
            Err(_) => Err(format!("{}: no answer within {OP_TIMEOUT:?}", self.name).into()),
        }
    }

    async fn warm_up(&mut self, work: &Work) -> Result<(), Error> {
        for _ in 0..self.counts.0 {
            self.timed(work).await?;
        }
        Ok(())
    }

    async fn measure_round(&mut self, work: &Work, guards_pid: u32) -> Result<(), Error> {
        let before = cpu_now(self.mesh_pid, guards_pid)?;
        for _ in 0..self.counts.1 {
            let elapsed = self.timed(work).await?;
            report::record(&mut self.histogram, elapsed);
        }
        self.cpu
            .add(cpu_now(self.mesh_pid, guards_pid)?.since(before));
        Ok(())
    }

    fn figures(&self) -> Latency {
        Latency::new(
            self.name,
            self.what,
            &self.histogram,
            self.cpu,
            self.mesh_pid.is_some(),
        )
    }
}

/// The order in which `n` scenarios take turns in round `round`: each round
/// starts one scenario later, so that over `n` rounds each scenario is
/// measured once in each place of the round (whatever being first, or
/// following a given scenario, does to a measurement is shared by all).
fn round_order(round: u32, n: usize) -> impl Iterator<Item = usize> {
    let start = usize::try_from(round).unwrap_or(0) % n.max(1);
    (0..n).map(move |k| (start + k) % n)
}

/// Runs a group: each scenario's warm-up, then `rounds` rounds in which the
/// scenarios take turns, each round starting one scenario later.
async fn run_group(
    title: &str,
    scenarios: &mut [Scenario],
    rounds: u32,
    work: &Work,
    guards: &mut GuardProcess,
    meshes: &mut [&mut MeshProcess],
) -> Result<Vec<Latency>, Error> {
    let names: Vec<&str> = scenarios.iter().map(|s| s.name).collect();
    eprintln!("[bench] {title}: {}", names.join(", "));
    let result = async {
        for scenario in scenarios.iter_mut() {
            scenario.warm_up(work).await?;
        }
        for round in 0..rounds {
            for i in round_order(round, scenarios.len()) {
                scenarios[i].measure_round(work, guards.child.pid()).await?;
            }
        }
        Ok::<(), Error>(())
    }
    .await;
    if let Err(error) = result {
        // Name a dead process rather than its symptom.
        guards.child.check_alive()?;
        for mesh in meshes.iter_mut() {
            mesh.child.check_alive()?;
        }
        return Err(error);
    }
    Ok(scenarios.iter().map(Scenario::figures).collect())
}

/// What a throughput worker calls.
#[derive(Clone)]
enum Load {
    Mesh(Arc<Session>),
    Echo(EchoClient<Channel>),
}

impl Load {
    async fn once(&mut self, work: &Work) -> Result<(), Error> {
        match self {
            Self::Mesh(session) => {
                let decision = session.evaluate(work.batch.clone()).await?;
                check_decision(&decision, work, false)
            }
            Self::Echo(client) => {
                let answer = client
                    .echo(EchoMessage {
                        payload: work.echo.clone(),
                    })
                    .await?
                    .into_inner();
                if answer.payload.len() == work.echo.len() {
                    Ok(())
                } else {
                    Err("the echo changed the payload".into())
                }
            }
        }
    }
}

/// Sums of a throughput run's windows.
struct LoadTotals {
    histogram: Histogram<u64>,
    elapsed: Duration,
    cpu: Cpu,
}

impl LoadTotals {
    fn new() -> Result<Self, Error> {
        Ok(Self {
            histogram: report::histogram()?,
            elapsed: Duration::ZERO,
            cpu: Cpu::default(),
        })
    }
}

/// Runs the closed-loop windows of `runs`, interleaved window by window;
/// when one fails, says which process died if one did.
async fn run_windows(
    runs: &mut [LoadRun],
    guards: &mut GuardProcess,
    work: &Arc<Work>,
    plan: &Plan,
) -> Result<(), Error> {
    let guards_pid = guards.child.pid();
    let result = async {
        for _ in 0..plan.throughput_windows {
            for run in runs.iter_mut() {
                closed_loop(
                    &run.loads,
                    work,
                    plan.throughput_warmup,
                    plan.throughput_window,
                    run.mesh.as_ref().map(MeshProcess::pid),
                    guards_pid,
                    &mut run.totals,
                )
                .await
                .map_err(|e| format!("throughput {}: {e}", run.name))?;
            }
        }
        Ok::<(), Error>(())
    }
    .await;
    if let Err(error) = result {
        guards.child.check_alive()?;
        for run in runs.iter_mut() {
            if let Some(mesh) = &mut run.mesh {
                mesh.child.check_alive()?;
            }
        }
        return Err(error);
    }
    Ok(())
}

/// One closed-loop window: `loads.len()` workers, each with one operation
/// in flight; after `warmup`, the operations that complete within `window`
/// are counted (and their latency recorded) along with the CPU used.
async fn closed_loop(
    loads: &[Load],
    work: &Arc<Work>,
    warmup: Duration,
    window: Duration,
    mesh_pid: Option<u32>,
    guards_pid: u32,
    totals: &mut LoadTotals,
) -> Result<(), Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let recording = Arc::new(AtomicBool::new(false));
    let mut workers = JoinSet::new();
    for load in loads {
        let mut load = load.clone();
        let work = work.clone();
        let stop = stop.clone();
        let recording = recording.clone();
        workers.spawn(async move {
            let mut histogram = report::histogram()?;
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                match tokio::time::timeout(OP_TIMEOUT, load.once(&work)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => return Err(error),
                    Err(_) => return Err(format!("no answer within {OP_TIMEOUT:?}").into()),
                }
                if recording.load(Ordering::Relaxed) {
                    report::record(&mut histogram, started.elapsed());
                }
            }
            Ok::<_, Error>(histogram)
        });
    }
    let measured = async {
        tokio::time::sleep(warmup).await;
        let before = cpu_now(mesh_pid, guards_pid)?;
        let started = Instant::now();
        recording.store(true, Ordering::Relaxed);
        tokio::time::sleep(window).await;
        recording.store(false, Ordering::Relaxed);
        let elapsed = started.elapsed();
        let cpu = cpu_now(mesh_pid, guards_pid)?.since(before);
        Ok::<_, Error>((elapsed, cpu))
    };
    // A worker that fails ends the window early.
    let (elapsed, cpu) = tokio::select! {
        measured = measured => measured?,
        Some(joined) = workers.join_next() => {
            stop.store(true, Ordering::Relaxed);
            return Err(match joined {
                Ok(Err(error)) => error,
                Ok(Ok(_)) => "a worker stopped early".into(),
                Err(error) => error.into(),
            });
        }
    };
    stop.store(true, Ordering::Relaxed);
    while let Some(joined) = workers.join_next().await {
        let histogram = joined??;
        totals
            .histogram
            .add(&histogram)
            .map_err(|e| format!("histogram: {e}"))?;
    }
    totals.elapsed += elapsed;
    totals.cpu.add(cpu);
    Ok(())
}

/// One closed-loop load of the throughput runs, and its sums.
struct LoadRun {
    name: String,
    what: String,
    mesh: Option<MeshProcess>,
    loads: Vec<Load>,
    totals: LoadTotals,
}

impl LoadRun {
    /// `in_flight` batches at a time through `mesh`, each worker on a
    /// session of its own.
    async fn on_mesh(
        name: String,
        what: String,
        mesh: MeshProcess,
        in_flight: usize,
    ) -> Result<Self, Error> {
        let coordinator = mesh.coordinator().await?;
        let mut loads = Vec::with_capacity(in_flight);
        for i in 0..in_flight {
            loads.push(Load::Mesh(Arc::new(
                coordinator.session(format!("load-{i}")).await?,
            )));
        }
        Ok(Self {
            name,
            what,
            mesh: Some(mesh),
            loads,
            totals: LoadTotals::new()?,
        })
    }

    /// The run's figures, its windows summed.
    fn figures(self) -> Throughput {
        Throughput::new(
            self.name,
            self.what,
            &self.totals.histogram,
            self.totals.elapsed,
            self.totals.cpu,
            self.mesh.is_some(),
        )
    }
}

/// Throughput of `mesh_4` (the mesh as `guardmesh serve` runs by default,
/// then with each of `threads` worker threads) against the raw echo,
/// windows alternating.
async fn throughput(
    exe: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    work: &Arc<Work>,
    plan: &Plan,
    in_flight: usize,
    threads: &[usize],
) -> Result<Vec<Throughput>, Error> {
    eprintln!(
        "[bench] throughput: mesh_4 (default: {} worker thread(s) here), mesh_4 with --worker-threads {threads:?}, echo; {in_flight} in flight",
        mesh_default_worker_threads()
    );
    let mut variants = vec![(
        "mesh_4".to_owned(),
        "batches through the mesh, 4 zero-latency guards (default runtime)".to_owned(),
        None,
        false,
    )];
    for &t in threads {
        variants.push((
            format!("mesh_4_threads_{t}"),
            format!("the same, the mesh run with --worker-threads {t}"),
            Some(t),
            false,
        ));
    }
    variants.push((
        "relay_floor_4".to_owned(),
        "batches through the relay floor: the mesh's hops, none of its work".to_owned(),
        None,
        true,
    ));
    let mut runs = Vec::new();
    for (name, what, t, relay) in variants {
        let label = format!("throughput_{name}");
        let mesh = if relay {
            MeshProcess::start_relay(exe, dir, &label, guards, &ZERO, t).await?
        } else {
            MeshProcess::start_with(exe, dir, &label, guards, &ZERO, t).await?
        };
        runs.push(LoadRun::on_mesh(name, what, mesh, in_flight).await?);
    }
    let echo = guards.echo().await?;
    runs.push(LoadRun {
        name: "echo".into(),
        what: "raw unary echo of the batch's bytes".into(),
        mesh: None,
        loads: (0..in_flight).map(|_| Load::Echo(echo.clone())).collect(),
        totals: LoadTotals::new()?,
    });
    run_windows(&mut runs, guards, work, plan).await?;
    Ok(runs.into_iter().map(LoadRun::figures).collect())
}

/// The RSS of a fresh `mesh_4` mesh, then with [`IDLE_STREAMS`] idle
/// coordinator streams open (each has judged one batch).
async fn memory(
    exe: &Path,
    dir: &Path,
    guards: &GuardProcess,
    work: &Work,
    plan: &Plan,
    connections: usize,
) -> Result<Memory, Error> {
    eprintln!(
        "[bench] memory: {IDLE_STREAMS} idle coordinator streams on {connections} connections"
    );
    let mut mesh = MeshProcess::start(exe, dir, "memory_mesh_4", guards, &ZERO).await?;
    {
        let session = mesh.session("warm-up").await?;
        for _ in 0..100 {
            let decision = session.evaluate(work.batch.clone()).await?;
            check_decision(&decision, work, false)?;
        }
    }
    tokio::time::sleep(plan.settle).await;
    let idle_bytes = mesh.child.rss()?;
    let connections = connections.max(1);
    let mut coordinators = Vec::with_capacity(connections);
    for _ in 0..connections {
        coordinators.push(mesh.coordinator().await?);
    }
    let coordinators = &coordinators;
    let opened = tokio::time::timeout(Duration::from_secs(60), async {
        let sessions: Vec<Session> = futures::stream::iter(0..IDLE_STREAMS)
            .map(|i| async move {
                coordinators[i % coordinators.len()]
                    .session(format!("idle-{i}"))
                    .await
            })
            .buffer_unordered(64)
            .try_collect()
            .await?;
        futures::stream::iter(&sessions)
            .map(|session| async move {
                let decision = session.evaluate(work.batch.clone()).await?;
                check_decision(&decision, work, false)
            })
            .buffer_unordered(64)
            .try_collect::<Vec<()>>()
            .await?;
        Ok::<_, Error>(sessions)
    })
    .await
    .map_err(|_| "opening the idle streams took over 60 s")??;
    tokio::time::sleep(plan.settle).await;
    mesh.child.check_alive()?;
    let with_streams_bytes = mesh.child.rss()?;
    drop(opened);
    Ok(Memory {
        idle_bytes,
        streams: IDLE_STREAMS,
        connections,
        with_streams_bytes,
    })
}

/// The in-process policy figures' setup, for the JSON.
fn put_policy_setup(setup: &mut Map<String, Value>, evaluation: &policy::Evaluation) {
    setup.insert("policy_rules".into(), json!(evaluation.rules));
    setup.insert(
        "policy_rule_evaluations_per_batch".into(),
        json!(evaluation.evaluations),
    );
    setup.insert(
        "policy_eval_iterations".into(),
        json!(evaluation.iterations),
    );
}

/// The session group's setup, for the JSON: its counts and what it
/// skipped (`skipped` is printed with the report).
fn put_sessions_setup(
    setup: &mut Map<String, Value>,
    figures: &sessions::SessionFigures,
    quick: bool,
) {
    let (warm_up, per_round) = sessions::counts(quick);
    setup.insert("counts_sessions".into(), json!([warm_up, per_round]));
    setup.insert(
        "session_store_ops_batches".into(),
        json!(sessions::COUNTED_BATCHES),
    );
    if !figures.skipped.is_empty() {
        setup.insert("skipped".into(), json!(figures.skipped));
    }
}

const ZERO: [&str; 4] = ["zero-1", "zero-2", "zero-3", "zero-4"];
const FIVE: [&str; 4] = ["ms5-1", "ms5-2", "ms5-3", "ms5-4"];
const EARLY_VETO: [&str; 4] = ["veto-1ms", "ms200-2", "ms200-3", "ms200-4"];

/// Every guard the scenarios use.
fn catalog() -> Vec<GuardDef> {
    let mut defs = Vec::new();
    for name in ZERO {
        defs.push(GuardDef::new(name, 0, false));
    }
    for name in FIVE {
        defs.push(GuardDef::new(name, 5, false));
    }
    defs.push(GuardDef::new("veto-1ms", 1, true));
    for name in &EARLY_VETO[1..] {
        defs.push(GuardDef::new(name, 200, false));
    }
    defs
}

async fn run(args: &BenchArgs) -> Result<(), Error> {
    let started = Instant::now();
    let plan = Plan::new(args);
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let temp = TempDir::new("guardmesh-bench")?;
    let dir = temp.path();
    let work = Arc::new(Work::new());
    let mode = if args.quick { "quick" } else { "full" };
    eprintln!(
        "[bench] {mode} run: batches of {CALLS} calls with {ARGUMENT_BYTES} B of JSON arguments ({} B per EvaluateRequest); logs in {}",
        work.request_bytes,
        dir.display()
    );
    if args.tripwire.is_some() && args.only.is_some_and(|only| only != Only::Throughput) {
        return Err("--tripwire reads the figures of a whole run or of --only throughput, not of another --only".into());
    }
    if args.only == Some(Only::Compare) && args.baseline.is_none() {
        return Err("--only compare needs --baseline EXE: the guardmesh executable to compare this build against".into());
    }
    let mut guards = GuardProcess::start(&exe, dir, &catalog(), args).await?;
    if let (Some(Only::Compare), Some(baseline)) = (args.only, &args.baseline) {
        let in_flight = args.in_flight.max(1);
        let figures =
            compare::run(&exe, baseline, dir, &mut guards, &work, &plan, in_flight).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("compare"));
        setup.insert("baseline".into(), json!(baseline.display().to_string()));
        setup.insert("rounds".into(), json!(plan.rounds));
        setup.insert("in_flight".into(), json!(in_flight));
        setup.insert("throughput_windows".into(), json!(plan.throughput_windows));
        setup.insert(
            "throughput_window_s".into(),
            json!(plan.throughput_window.as_secs_f64()),
        );
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency: figures.latency,
            throughput: figures.throughput,
            memory: Memory::none(),
            extra_ratios: Vec::new(),
        };
        return report(&results, args, mode, started, guards);
    }
    if args.only == Some(Only::DecisionLog) {
        let in_flight = args.in_flight.max(1);
        let (latency, throughput) =
            decision_log::run(&exe, dir, &mut guards, &work, &plan, in_flight).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("decision-log"));
        setup.insert("rounds".into(), json!(plan.rounds));
        setup.insert("in_flight".into(), json!(in_flight));
        setup.insert("throughput_windows".into(), json!(plan.throughput_windows));
        setup.insert(
            "throughput_window_s".into(),
            json!(plan.throughput_window.as_secs_f64()),
        );
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency,
            throughput,
            memory: Memory::none(),
            extra_ratios: Vec::new(),
        };
        return report(&results, args, mode, started, guards);
    }
    // The MCP gateway against calling the MCP server directly (R31).
    let mcp_counts = if args.quick { (100, 200) } else { (300, 1000) };
    if args.only == Some(Only::Mcp) {
        let mcp = mcp::run(&exe, dir, &mut guards, plan.rounds, mcp_counts).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("mcp"));
        setup.insert("rounds".into(), json!(plan.rounds));
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency: mcp.latency,
            throughput: Vec::new(),
            memory: Memory::none(),
            extra_ratios: mcp.ratios,
        };
        return report(&results, args, mode, started, guards);
    }
    if args.only == Some(Only::Replicas) {
        let figures = replicas::run(&exe, dir, &work, &plan, args).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("replicas"));
        setup.insert("in_flight".into(), json!(args.in_flight.max(1)));
        setup.insert("throughput_windows".into(), json!(plan.throughput_windows));
        setup.insert(
            "throughput_window_s".into(),
            json!(plan.throughput_window.as_secs_f64()),
        );
        setup.insert("replica_cpu_ms".into(), json!(replicas::CPU_MS));
        setup.insert(
            "cpus".into(),
            json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
        );
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency: Vec::new(),
            throughput: figures.throughput,
            memory: Memory::none(),
            extra_ratios: figures.ratios,
        };
        return report(&results, args, mode, started, guards);
    }
    if args.only == Some(Only::Busy) {
        let figures = busy::run(&exe, dir, args.quick).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("busy"));
        setup.extend(figures.setup);
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency: Vec::new(),
            throughput: Vec::new(),
            memory: Memory::none(),
            extra_ratios: figures.ratios,
        };
        return report(&results, args, mode, started, guards);
    }
    if args.only == Some(Only::Memory) {
        let memory = memory(&exe, dir, &guards, &work, &plan, args.idle_connections).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("memory"));
        setup.insert("idle_streams".into(), json!(IDLE_STREAMS));
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let rss = (
            "rss_mib_1000_streams".to_owned(),
            Memory::mib(memory.with_streams_bytes),
        );
        let results = Results {
            quick: args.quick,
            setup,
            latency: Vec::new(),
            throughput: Vec::new(),
            memory,
            extra_ratios: vec![rss],
        };
        return report(&results, args, mode, started, guards);
    }
    if args.only == Some(Only::Throughput) {
        let in_flight = args.in_flight.max(1);
        let throughput = throughput(
            &exe,
            dir,
            &mut guards,
            &work,
            &plan,
            in_flight,
            &args.mesh_threads,
        )
        .await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("throughput"));
        setup.insert("in_flight".into(), json!(in_flight));
        setup.insert("throughput_windows".into(), json!(plan.throughput_windows));
        setup.insert(
            "throughput_window_s".into(),
            json!(plan.throughput_window.as_secs_f64()),
        );
        setup.insert("mesh_threads".into(), json!(args.mesh_threads));
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency: Vec::new(),
            throughput,
            memory: Memory::none(),
            extra_ratios: Vec::new(),
        };
        return report(&results, args, mode, started, guards);
    }
    if args.only == Some(Only::Sessions) {
        let figures = sessions::run(&exe, dir, &mut guards, &work, &plan, args.quick).await?;
        let mut setup = Map::new();
        setup.insert("only".into(), json!("sessions"));
        setup.insert("rounds".into(), json!(plan.rounds));
        put_sessions_setup(&mut setup, &figures, args.quick);
        setup.insert("elapsed_s".into(), json!(started.elapsed().as_secs_f64()));
        let results = Results {
            quick: args.quick,
            setup,
            latency: figures.latency,
            throughput: Vec::new(),
            memory: Memory::none(),
            extra_ratios: figures.ratios,
        };
        return report(&results, args, mode, started, guards);
    }
    let mut latency = Vec::new();
    let mut extra_setup = Map::new();

    // Zero-latency guards: direct_unary, direct_parallel_4, stream_floor,
    // mesh_1, mesh_4.
    {
        let mut parallel = Vec::new();
        for name in ZERO {
            parallel.push(guards.direct(name).await?);
        }
        let mut mesh1 = MeshProcess::start(&exe, dir, "mesh_1", &guards, &ZERO[..1]).await?;
        let mut mesh4 = MeshProcess::start(&exe, dir, "mesh_4", &guards, &ZERO).await?;
        let mut relay4 =
            MeshProcess::start_relay(&exe, dir, "relay_floor_4", &guards, &ZERO, None).await?;
        let mut scenarios = vec![
            Scenario::new(
                "direct_unary",
                "one unary call to one zero-latency guard",
                Op::Direct(vec![guards.direct(ZERO[0]).await?]),
                false,
                None,
                plan.fast,
            )?,
            Scenario::new(
                "direct_parallel_4",
                "unary calls to 4 zero-latency guards at once",
                Op::DirectParallel(parallel),
                false,
                None,
                plan.fast,
            )?,
            Scenario::new(
                "stream_floor",
                "one message round trip on an open bidi echo stream",
                Op::StreamEcho(EchoStream::open(&mut guards.echo().await?).await?),
                false,
                None,
                plan.fast,
            )?,
            Scenario::new(
                "mesh_1",
                "the mesh, 1 zero-latency guard",
                Op::Mesh(mesh1.session("mesh_1").await?),
                false,
                Some(&mesh1),
                plan.fast,
            )?,
            Scenario::new(
                "mesh_4",
                "the mesh, 4 zero-latency guards",
                Op::Mesh(mesh4.session("mesh_4").await?),
                false,
                Some(&mesh4),
                plan.fast,
            )?,
            Scenario::new(
                "relay_floor_4",
                "the relay floor: the mesh's hops to 4 zero-latency guards, none of its work",
                Op::Mesh(relay4.session("relay_floor_4").await?),
                false,
                Some(&relay4),
                plan.fast,
            )?,
        ];
        latency.extend(
            run_group(
                "zero-latency guards",
                &mut scenarios,
                plan.rounds,
                &work,
                &mut guards,
                &mut [&mut mesh1, &mut mesh4, &mut relay4],
            )
            .await?,
        );
    }

    // Guards that take 5 ms: direct_unary_5ms, direct_parallel_4_5ms,
    // mesh_4_5ms, sequential_4_5ms.
    {
        let mut mesh = MeshProcess::start(&exe, dir, "mesh_4_5ms", &guards, &FIVE).await?;
        let mut relay =
            MeshProcess::start_relay(&exe, dir, "relay_floor_4_5ms", &guards, &FIVE, None).await?;
        let mut sequential = Vec::new();
        let mut parallel = Vec::new();
        for name in FIVE {
            sequential.push(guards.direct(name).await?);
            parallel.push(guards.direct(name).await?);
        }
        let mut scenarios = vec![
            Scenario::new(
                "direct_unary_5ms",
                "one unary call to one 5 ms guard",
                Op::Direct(vec![guards.direct(FIVE[0]).await?]),
                false,
                None,
                plan.slow,
            )?,
            Scenario::new(
                "direct_parallel_4_5ms",
                "unary calls to 4 guards of 5 ms at once",
                Op::DirectParallel(parallel),
                false,
                None,
                plan.slow,
            )?,
            Scenario::new(
                "mesh_4_5ms",
                "the mesh, 4 guards of 5 ms",
                Op::Mesh(mesh.session("mesh_4_5ms").await?),
                false,
                Some(&mesh),
                plan.slow,
            )?,
            Scenario::new(
                "relay_floor_4_5ms",
                "the relay floor in front of 4 guards of 5 ms",
                Op::Mesh(relay.session("relay_floor_4_5ms").await?),
                false,
                Some(&relay),
                plan.slow,
            )?,
            Scenario::new(
                "sequential_4_5ms",
                "unary calls to 4 guards of 5 ms, one after another",
                Op::Direct(sequential),
                false,
                None,
                plan.sequential,
            )?,
        ];
        latency.extend(
            run_group(
                "5 ms guards",
                &mut scenarios,
                plan.rounds,
                &work,
                &mut guards,
                &mut [&mut mesh, &mut relay],
            )
            .await?,
        );
    }

    // Veto: veto_1ms against early_veto.
    {
        let mut alone =
            MeshProcess::start(&exe, dir, "veto_1ms", &guards, &EARLY_VETO[..1]).await?;
        let mut early = MeshProcess::start(&exe, dir, "early_veto", &guards, &EARLY_VETO).await?;
        let mut scenarios = vec![
            Scenario::new(
                "veto_1ms",
                "the mesh, 1 guard that vetoes every call after 1 ms",
                Op::Mesh(alone.session("veto_1ms").await?),
                true,
                Some(&alone),
                plan.veto,
            )?,
            Scenario::new(
                "early_veto",
                "the mesh, the same guard first, then 3 guards of 200 ms",
                Op::Mesh(early.session("early_veto").await?),
                true,
                Some(&early),
                plan.veto,
            )?,
        ];
        latency.extend(
            run_group(
                "veto",
                &mut scenarios,
                plan.rounds,
                &work,
                &mut guards,
                &mut [&mut alone, &mut early],
            )
            .await?,
        );
    }

    let mcp = mcp::run(&exe, dir, &mut guards, plan.rounds, mcp_counts).await?;
    latency.extend(mcp.latency);
    // Policy guards (R27): no_guard, policy20, policy20_match, policy1, and
    // no_guard_again (the same as no_guard, for the ratios' noise floor).
    let policy_figures = {
        let (rules, matching, one) = policy::write(dir)?;
        let mut none = MeshProcess::start_config(&exe, dir, policy::NO_GUARD, "", 0, None).await?;
        let mut again =
            MeshProcess::start_config(&exe, dir, policy::NO_GUARD_AGAIN, "", 0, None).await?;
        // A mesh with one policy guard, `guard`, of the rules in `file`.
        let with_policy = async |scenario: &str, guard: &str, file: &Path| {
            let section = policy::guard_section(guard, file);
            MeshProcess::start_config(&exe, dir, scenario, &section, 1, None).await
        };
        let mut with_rules = with_policy(policy::POLICY20, "policy20", &rules).await?;
        let mut with_match = with_policy(policy::POLICY20_MATCH, "policy20", &matching).await?;
        let mut with_one = with_policy(policy::POLICY1, "policy1", &one).await?;
        let mut scenarios = vec![
            Scenario::new(
                policy::NO_GUARD,
                "the mesh, no guard",
                Op::Mesh(none.session(policy::NO_GUARD).await?),
                false,
                Some(&none),
                plan.fast,
            )?,
            Scenario::new(
                policy::POLICY20,
                "the mesh, one policy guard of 20 rules, none matching",
                Op::Mesh(with_rules.session(policy::POLICY20).await?),
                false,
                Some(&with_rules),
                plan.fast,
            )?,
            Scenario::new(
                policy::POLICY20_MATCH,
                "the same, its 20th rule steering every call",
                Op::Mesh(with_match.session(policy::POLICY20_MATCH).await?),
                true,
                Some(&with_match),
                plan.fast,
            )?,
            Scenario::new(
                policy::POLICY1,
                "the mesh, one policy guard of one rule (the 20th), not matching",
                Op::Mesh(with_one.session(policy::POLICY1).await?),
                false,
                Some(&with_one),
                plan.fast,
            )?,
            Scenario::new(
                policy::NO_GUARD_AGAIN,
                "another mesh process, no guard (the same config as no_guard)",
                Op::Mesh(again.session(policy::NO_GUARD_AGAIN).await?),
                false,
                Some(&again),
                plan.fast,
            )?,
        ];
        let group = run_group(
            "policy guards",
            &mut scenarios,
            plan.rounds,
            &work,
            &mut guards,
            &mut [
                &mut none,
                &mut with_rules,
                &mut with_match,
                &mut with_one,
                &mut again,
            ],
        )
        .await?;
        let evaluation = policy::evaluate(&work, plan.policy_iterations)?;
        let figures = policy::figures(&group, &evaluation)?;
        latency.extend(group);
        put_policy_setup(&mut extra_setup, &evaluation);
        figures
    };
    // Session memory on and off, results against calls, the stores (R33,
    // R34).
    let session_figures = sessions::run(&exe, dir, &mut guards, &work, &plan, args.quick).await?;
    put_sessions_setup(&mut extra_setup, &session_figures, args.quick);
    latency.extend(session_figures.latency);

    let in_flight = args.in_flight.max(1);
    let mut throughput = throughput(
        &exe,
        dir,
        &mut guards,
        &work,
        &plan,
        in_flight,
        &args.mesh_threads,
    )
    .await?;
    // The decision log's cost: mesh_4 with the log off, fsync per record,
    // fsync per interval.
    let (log_latency, log_throughput) =
        decision_log::run(&exe, dir, &mut guards, &work, &plan, in_flight).await?;
    latency.extend(log_latency);
    throughput.extend(log_throughput);
    // A CPU-bound guard with 1, 2 and 4 replicas (R32).
    let replica_figures = replicas::run(&exe, dir, &work, &plan, args).await?;
    throughput.extend(replica_figures.throughput);
    // A busy guard shared by a bursting and a steady client (R25).
    let busy_figures = busy::run(&exe, dir, args.quick).await?;
    let memory = memory(&exe, dir, &guards, &work, &plan, args.idle_connections).await?;

    let mut setup = Map::new();
    let mut put = |key: &str, value: Value| {
        setup.insert(key.into(), value);
    };
    put("calls_per_batch", json!(CALLS));
    put("argument_bytes", json!(ARGUMENT_BYTES));
    put("evaluate_request_bytes", json!(work.request_bytes));
    put("rounds", json!(plan.rounds));
    put("counts_fast", json!([plan.fast.0, plan.fast.1]));
    put("counts_5ms", json!([plan.slow.0, plan.slow.1]));
    put(
        "counts_sequential",
        json!([plan.sequential.0, plan.sequential.1]),
    );
    put("counts_veto", json!([plan.veto.0, plan.veto.1]));
    put("counts_mcp", json!([mcp_counts.0, mcp_counts.1]));
    put("in_flight", json!(in_flight));
    put("throughput_windows", json!(plan.throughput_windows));
    put(
        "throughput_window_s",
        json!(plan.throughput_window.as_secs_f64()),
    );
    put("idle_streams", json!(IDLE_STREAMS));
    put(
        "mesh_default_worker_threads",
        json!(mesh_default_worker_threads()),
    );
    put("mesh_threads", json!(args.mesh_threads));
    put("client_runtime", json!(args.client_runtime.label()));
    put("guard_runtime", json!(args.guard_runtime.label()));
    put("placement", json!(args.placement.label()));
    put(
        "cpu_guard",
        json!(if args.cpu_guard_inline {
            "work on the runtime thread, wall clock (--cpu-guard-inline)"
        } else {
            "work on a thread of its own, one request at a time, thread CPU clock"
        }),
    );
    put(
        "guard_streams",
        json!(if args.guard_nodelay {
            "GuardServer on TCP_NODELAY sockets (--guard-nodelay)"
        } else {
            "guardmesh_client::GuardServer::serve"
        }),
    );
    put(
        "mesh",
        json!("guardmesh serve --config <tmp.toml>, a fresh process per scenario"),
    );
    put(
        "cpus",
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );
    put("elapsed_s", json!(started.elapsed().as_secs_f64()));
    setup.extend(extra_setup);
    setup.extend(busy_figures.setup);
    let results = Results {
        quick: args.quick,
        setup,
        latency,
        throughput,
        memory,
        extra_ratios: mcp
            .ratios
            .into_iter()
            .chain(policy_figures)
            .chain(session_figures.ratios)
            .chain(replica_figures.ratios)
            .chain(busy_figures.ratios)
            .collect(),
    };
    report(&results, args, mode, started, guards)
}

/// Prints the report, and writes the JSON when asked.
fn report(
    results: &Results,
    args: &BenchArgs,
    mode: &str,
    started: Instant,
    guards: GuardProcess,
) -> Result<(), Error> {
    println!(
        "guardmesh bench ({mode} run, {:.0} s): batches of {CALLS} calls, {ARGUMENT_BYTES} B of JSON arguments each",
        started.elapsed().as_secs_f64()
    );
    print!("{}", results.table()?);
    if let Some(path) = &args.json {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        let text = serde_json::to_string_pretty(&results.json()?)?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("\nwrote {}", path.display());
    }
    drop(guards);
    if let Some(path) = &args.tripwire {
        tripwire::check(&results.json()?, path)?;
    }
    Ok(())
}

/// Not a timing: the order scenarios take turns in.
#[cfg(test)]
mod tests {
    use super::round_order;

    #[test]
    fn over_n_rounds_each_scenario_is_measured_once_in_each_place() {
        for n in 1..=6 {
            let mut places = vec![vec![0u32; n]; n];
            for round in 0..u32::try_from(n).unwrap() {
                let order: Vec<usize> = round_order(round, n).collect();
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "each once per round");
                for (place, scenario) in order.into_iter().enumerate() {
                    places[scenario][place] += 1;
                }
            }
            assert!(
                places.iter().flatten().all(|&c| c == 1),
                "n {n}: {places:?}"
            );
        }
        // Round 0 keeps the written order.
        assert_eq!(round_order(0, 4).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(round_order(5, 4).collect::<Vec<_>>(), vec![1, 2, 3, 0]);
    }
}
