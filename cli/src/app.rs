//! The `guardmesh` command line: parsing, the runtime, and the commands that
//! talk to a mesh (`serve`, `guards`, `evaluate`, `certs`, `example-guard`;
//! `approvals` is in `approvals.rs`).

use crate::examples::{Example, Kind};
use crate::runtime::default_worker_threads;
use clap::{Parser, Subcommand};
use guardmesh_client::proto::{
    FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant, ToolCall,
};
use guardmesh_client::{Batch, Coordinator, Registrar};
use guardmesh_server::Server;
use guardmesh_server::config::Config;
use guardmesh_server::observe::telemetry::{self, LogFormat};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// `guardmesh --version`: the crate's version and the commit it was built
/// from, `-dirty` when tracked files differed from it (cli/build.rs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GUARDMESH_COMMIT"),
    ")"
);

#[derive(Parser)]
#[command(
    name = "guardmesh",
    version = VERSION,
    about = "A gRPC guard mesh for AI agent tool calls"
)]
struct Cli {
    /// Log format on stderr: human or json.
    #[arg(long, global = true, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    /// Runtime threads. 1 runs everything on one thread; 0: one worker per
    /// core. The default depends on the machine: 1 on up to 2 cores, where
    /// it measured best (the mesh waits on the network, and cross-thread
    /// wakeups cost more than a second worker gains), one per core above
    /// (see docs/performance.md).
    #[arg(
        long,
        global = true,
        env = "GUARDMESH_WORKER_THREADS",
        default_value_t = default_worker_threads()
    )]
    worker_threads: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the mesh.
    Serve {
        /// TOML config file (see docs/configuration.md). Without one, defaults apply.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Overrides the config's listen address (default 127.0.0.1:50051).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Keeps a guard's liveness lease in the etcd registry (a sidecar for
    /// guards in any language), following the guard's health with --guard.
    Heartbeat(crate::heartbeat::HeartbeatArgs),
    /// Lists, registers or deregisters guards of a running mesh.
    Guards {
        #[command(flatten)]
        mesh: MeshArgs,
        #[command(subcommand)]
        action: GuardsAction,
    },
    /// Lists, approves or denies the approval requests guards' asks made
    /// (R35). Needs the approver (or admin) role on a mesh with principals.
    Approvals(crate::approvals::ApprovalsArgs),
    /// Evaluates batches from a JSON file (or stdin) and prints the
    /// decisions; the exit code says whether every call may proceed.
    ///
    /// A batch: {"session_id": "s", "turn_index": 0, "model_text": "...",
    /// "metadata": {...}, "calls": [{"call_id": "c1", "tool": "t",
    /// "arguments": {...}}], "results": [{"call_id": "c1", "tool": "t",
    /// "server": "fs", "result": {"content": [...]}}]}. The input is one
    /// batch, or one batch per line (JSON Lines), each judged in turn, so a
    /// session's flow (a call, its result, a later call) can be replayed.
    #[command(after_help = crate::evaluate::EXIT_CODES_HELP)]
    Evaluate {
        #[command(flatten)]
        mesh: MeshArgs,
        /// Prints each batch's decision as one line of JSON (the proto's
        /// BatchDecision, enums by name, arguments as objects) instead of
        /// tables.
        #[arg(long)]
        json: bool,
        /// The batch file; `-` reads stdin.
        file: PathBuf,
    },
    /// Starts a mesh and example guards on loopback and drives a coordinator
    /// through a few rounds, printing decisions and traces.
    Demo {
        /// Run with mTLS and roles on the coordinator and registrar links
        /// (certificates from a CA made for the run).
        #[arg(long)]
        mtls: bool,
    },
    /// Creates a local CA and certificates (mesh, coordinator, registrar,
    /// admin, guard) with SPIFFE-style identities, for development and the
    /// demo. Not for production.
    Certs {
        /// Folder to write into.
        #[arg(default_value = "certs")]
        dir: PathBuf,
        /// Also names the mesh's certificate for the Service `guardmesh`
        /// in this namespace, and writes `secrets.yaml`: the Secrets the
        /// production overlay mounts (guardmesh-tls) and its clients use
        /// (guardmesh-coordinator, -registrar, -admin), for clusters
        /// without cert-manager (`kubectl apply -f DIR/secrets.yaml`).
        #[arg(long, value_name = "NAMESPACE")]
        kubernetes: Option<String>,
    },
    /// Serves one of the example guards (prints `LISTENING <port>`).
    ExampleGuard {
        #[arg(value_enum)]
        kind: Kind,
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
        /// Artificial latency per batch.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
        /// Judges at most this many batches at a time; the others wait
        /// their turn inside the guard (0: no bound).
        #[arg(long, default_value_t = 0)]
        workers: usize,
    },
    /// Checks a running guard, of any language, against the Judge protocol
    /// (one PASS/FAIL line per check; exits non-zero on any failure).
    Conformance(guardmesh_conformance::ConformanceArgs),
    /// Benchmarks the mesh against calling guards directly, all on loopback
    /// (see docs/performance.md). `--quick` is a smoke run.
    Bench(guardmesh_bench::BenchArgs),
    /// Serves the benchmark's guards and baselines (started by `bench`).
    #[command(hide = true)]
    BenchGuards(guardmesh_bench::GuardsArgs),
    /// Serves the benchmark's relay floor: the mesh's hops without its work
    /// (started by `bench`).
    #[command(hide = true)]
    BenchRelay(guardmesh_bench::RelayArgs),
    /// Serves the benchmark's upstream MCP server on stdio (started by
    /// `bench`).
    #[command(hide = true)]
    BenchMcpUpstream,
    /// Serves a mesh of the benchmark's session scenarios: `serve`'s config
    /// and server, session memory in the store named (started by `bench`).
    #[command(hide = true)]
    BenchSessionMesh(guardmesh_bench::SessionMeshArgs),
    /// MCP gateway: judges every tools/call through the mesh (R31).
    Mcp(guardmesh_gateway::McpArgs),
    /// Agent-host hooks (PreToolUse).
    Hook(guardmesh_gateway::HookArgs),
    /// Checks a policy file (CEL rules, R27), or tests it against cases.
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Reads the decision log (R29).
    Log {
        #[command(subcommand)]
        action: crate::log::LogAction,
    },
    /// Judges recorded batches again against the chain of a config file
    /// (--config) or of a running mesh (--mesh), and reports every call
    /// whose decision differs from the recorded one (R30). Exits 0 when
    /// none differs, 1 when one does, 2 when the replay cannot run.
    Replay(crate::replay::ReplayArgs),
    /// Checks a config file without starting a mesh, or prints every key.
    Config(crate::config_cmd::ConfigArgs),
}

#[derive(Subcommand)]
enum PolicyAction {
    /// Compiles a policy file and lists its rules with their cost; exits
    /// non-zero, naming the line and the reason, if it does not compile.
    /// With `--tools` (the guard's tool patterns, comma-separated), also
    /// exits non-zero naming every rule that names a tool those patterns
    /// never send the guard (R27).
    Check {
        file: PathBuf,
        #[arg(long, value_delimiter = ',')]
        tools: Vec<String>,
    },
    /// Runs a cases file against a policy file; exits non-zero on any case
    /// whose expectation does not hold.
    Test { file: PathBuf, cases: PathBuf },
}

/// How the command-line tools reach a mesh: its address and the
/// credentials sent on every call (R24). One definition, shared with the
/// MCP gateway and hooks (`guardmesh mcp`, `guardmesh hook`).
pub(crate) use guardmesh_client::MeshArgs;

/// Adds what to do about a refusal for want of credentials.
fn explain(error: guardmesh_client::ClientError) -> Error {
    match error.code() {
        Some(tonic::Code::Unauthenticated) => format!(
            "{error} (this mesh wants credentials: --cert-file/--key-file for mTLS, or a \
             token with --token-file or GUARDMESH_TOKEN, over https:// with --ca-file)"
        )
        .into(),
        Some(tonic::Code::PermissionDenied) => {
            format!("{error} (the credentials given lack the role this needs)").into()
        }
        _ => error.into(),
    }
}

/// What to tell the user about a failed call to the mesh `--mesh` names.
pub(crate) trait Explain {
    /// [`explain`], plus a hint when the connection failed under TLS
    /// without a client certificate: a mesh that requires one refuses the
    /// handshake before any RPC (R24), which reaches the client as a
    /// transport error rather than `UNAUTHENTICATED`.
    fn explain(&self) -> impl Fn(guardmesh_client::ClientError) -> Error + '_;
}

impl Explain for MeshArgs {
    fn explain(&self) -> impl Fn(guardmesh_client::ClientError) -> Error + '_ {
        move |error| {
            let transport = error.is_connect()
                || matches!(
                    error.code(),
                    // A closed handshake reaches the client as any of these,
                    // depending on when the connection is cut.
                    Some(tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled)
                );
            // A plaintext client's HTTP/2 preface reaches a TLS listener as a
            // malformed handshake: the answer it reads is not HTTP/2.
            let plaintext = !self.https();
            let chain = guardmesh_server::error_chain(&error);
            // The TLS alert it gets back reads as an HTTP/2 frame of an
            // impossible size.
            let not_http2 = chain.contains("h2 protocol error");
            if plaintext && !error.is_connect() && (transport || not_http2) {
                return format!(
                    "{chain} (if this mesh serves TLS, use --mesh https://... with --ca-file)"
                )
                .into();
            }
            if transport && self.ca_file.is_some() && self.cert_file.is_none() {
                return format!(
                    "{chain} (if this mesh requires client certificates, pass \
                     --cert-file and --key-file)"
                )
                .into();
            }
            explain(error)
        }
    }
}

#[derive(Subcommand)]
enum GuardsAction {
    /// Prints the chain in order.
    List,
    /// Registers a guard, or updates it in place.
    Register {
        #[arg(long)]
        name: String,
        /// A remote guard's address; or `--replica`, or `--policy-file`.
        #[arg(long, required_unless_present_any = ["policy_file", "replica"])]
        endpoint: Option<String>,
        /// A replica of the guard (R32), repeatable: each request goes to
        /// one replica, chosen by load; with `--endpoint`, that address is
        /// one more replica.
        #[arg(long = "replica", value_name = "ADDR")]
        replica: Vec<String>,
        /// A policy guard (R27): a file of CEL rules, sent whole with the
        /// registration and judged inside the mesh.
        #[arg(long, conflicts_with_all = ["endpoint", "replica"])]
        policy_file: Option<PathBuf>,
        /// validate or mutate.
        #[arg(long, default_value_t = GuardRole::Validate)]
        role: GuardRole,
        /// Tools judged (names or globs, comma separated); default all.
        #[arg(long, value_delimiter = ',')]
        tools: Vec<String>,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u32,
        /// fail_closed, fail_open or abort (R13).
        #[arg(long, default_value_t = FailurePolicy::FailClosed)]
        failure_policy: FailurePolicy,
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        priority: i32,
        #[arg(long)]
        dry_run: bool,
        /// For mutate guards: tools it may rewrite.
        #[arg(long, value_delimiter = ',')]
        grant_tools: Vec<String>,
        /// For mutate guards: may rename tools.
        #[arg(long)]
        may_rename: bool,
        /// For https endpoints: the identity the guard must present (DNS
        /// name or spiffe:// ID).
        #[arg(long)]
        server_identity: Option<String>,
    },
    /// Removes a guard.
    Deregister { name: String },
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Parses the command line, runs the command, and says how it went.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The benchmark picks its own runtime flavours.
    let cli = match cli.command {
        Command::Policy { action } => return policy(action),
        Command::Log { action } => return crate::log::run(action),
        Command::Replay(args) => return crate::replay::main(args),
        Command::Config(args) => return crate::config_cmd::main(args),
        Command::Bench(args) => return guardmesh_bench::run(args, default_worker_threads()),
        Command::BenchGuards(args) => return guardmesh_bench::serve_guards(args),
        Command::BenchRelay(args) => {
            return guardmesh_bench::serve_relay(args, default_worker_threads());
        }
        Command::BenchMcpUpstream => return guardmesh_bench::serve_mcp_upstream(),
        Command::BenchSessionMesh(args) => {
            return guardmesh_bench::serve_session_mesh(args, default_worker_threads());
        }
        Command::Mcp(args) => {
            let source = match &args.command {
                guardmesh_gateway::McpCommand::Stdio(_) => "mcp-stdio",
                guardmesh_gateway::McpCommand::Http(_) => "mcp-http",
            };
            return guardmesh_gateway::main_mcp_with(args, Some(crate::embedded::loader(source)));
        }
        Command::Hook(args) => return guardmesh_gateway::main_hook(args),
        command => Cli { command, ..cli },
    };
    let mut builder = match cli.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(n);
            builder
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {}", guardmesh_server::error_chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Error> {
    let default_filter = match cli.command {
        Command::Serve { .. } | Command::Heartbeat(_) => "info",
        Command::Demo { .. } => "error",
        _ => "warn",
    };
    let telemetry = telemetry::init(cli.log_format, default_filter)?;
    // `evaluate` says how the batches went in its exit code.
    if let Command::Evaluate { mesh, json, file } = cli.command {
        let code = evaluate(&mesh, &file, json).await;
        telemetry.shutdown().await;
        return Ok(code);
    }
    let result = match cli.command {
        Command::Serve { config, listen } => serve(config, listen).await,
        Command::Guards { mesh, action } => guards(&mesh, action).await,
        Command::Approvals(args) => crate::approvals::run(args).await,
        Command::Heartbeat(args) => crate::heartbeat::run(args, shutdown_signal()).await,
        Command::Evaluate { .. } => Err("evaluate is handled above".into()),
        Command::Demo { mtls } => crate::demo::run(mtls).await,
        Command::Certs { dir, kubernetes } => certs(&dir, kubernetes.as_deref()),
        Command::ExampleGuard {
            kind,
            listen,
            delay_ms,
            workers,
        } => example_guard(kind, listen, delay_ms, workers).await,
        Command::Conformance(args) => {
            let report = guardmesh_conformance::run(&args).await;
            out!("{}", report.render(args.json)?);
            report.verdict()
        }
        Command::Bench(_)
        | Command::BenchGuards(_)
        | Command::BenchRelay(_)
        | Command::BenchMcpUpstream
        | Command::BenchSessionMesh(_)
        | Command::Mcp(_)
        | Command::Hook(_)
        | Command::Policy { .. }
        | Command::Log { .. }
        | Command::Replay(_)
        | Command::Config(_) => Err("this command runs without the runtime".into()),
    };
    // Flush spans on the way out, also after an error.
    telemetry.shutdown().await;
    result.map(|()| ExitCode::SUCCESS)
}

/// `guardmesh policy check|test`: no runtime, no mesh. Exit 0 when the
/// file compiles (and every case holds), 1 otherwise, with the line and the
/// reason on stderr.
fn policy(action: PolicyAction) -> ExitCode {
    use guardmesh_server::policy;
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let result = match action {
        PolicyAction::Check { file, tools } => read(&file).and_then(|source| {
            policy::check(&source)
                .map_err(|e| format!("{}: {e}", file.display()))
                .and_then(|report| print_report(&report.to_string()))?;
            let never = policy::never_sent(&source, &tools)
                .map_err(|e| format!("{}: {e}", file.display()))?;
            if never.is_empty() {
                return Ok(());
            }
            let lines: Vec<String> = never.iter().map(ToString::to_string).collect();
            Err(format!(
                "{}: {} rule(s) name a tool the guard's tools ({}) never send it:\n  {}",
                file.display(),
                never.len(),
                tools.join(","),
                lines.join("\n  ")
            ))
        }),
        PolicyAction::Test { file, cases } => read(&file).and_then(|source| {
            let compiled =
                policy::Policy::compile(&source).map_err(|e| format!("{}: {e}", file.display()))?;
            let cases_text = read(&cases)?;
            let report = policy::test(&compiled, &cases_text)
                .map_err(|e| format!("{}: {e}", cases.display()))?;
            if report.passed() {
                print_report(&report.to_string())
            } else {
                Err(report.to_string().trim_end().to_owned())
            }
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Writes a report on stdout. A reader that stopped early (`| head`) is not
/// an error: the rest of the report has nowhere to go.
fn print_report(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("cannot write the report: {error}"))
        }
        _ => Ok(()),
    }
}

async fn example_guard(
    kind: Kind,
    listen: std::net::SocketAddr,
    delay_ms: u64,
    workers: usize,
) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    outln!("LISTENING {}", listener.local_addr()?.port());
    let guard = Example::delayed(kind, Duration::from_millis(delay_ms)).with_workers(workers);
    guardmesh_client::serve(guard, listener, shutdown_signal()).await?;
    Ok(())
}

fn certs(dir: &std::path::Path, namespace: Option<&str>) -> Result<(), Error> {
    let files = crate::certs::generate_for(dir, namespace)?;
    outln!("wrote {} files to {}:", files.len(), dir.display());
    for file in files {
        outln!("  {}", file.display());
    }
    outln!(
        "identities: spiffe://{}/{{mesh,coordinator,registrar,admin,guard}}",
        crate::certs::TRUST_DOMAIN
    );
    Ok(())
}

/// Completes on SIGINT or SIGTERM.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    guardmesh_server::run::shutdown_signal()
}

/// `guardmesh serve`: the mesh the config describes (defaults without
/// one), on `--listen` or the config's address, until SIGINT or SIGTERM.
async fn serve(config: Option<PathBuf>, listen: Option<std::net::SocketAddr>) -> Result<(), Error> {
    let server = match config {
        Some(path) => Server::load(&path).await?,
        None => Server::from_config(Config::default()).await?,
    };
    let addr = listen.unwrap_or_else(|| server.listen_addr());
    crate::systemd::spawn(server.probes().clone());
    let shutdown = async {
        shutdown_signal().await;
        crate::systemd::stopping();
    };
    server
        .second_signal_cuts_drain()
        .serve(addr, shutdown)
        .await?;
    Ok(())
}

async fn guards(mesh: &MeshArgs, action: GuardsAction) -> Result<(), Error> {
    let registrar = Registrar::connect_with(mesh.mesh.clone(), &mesh.connection()?)
        .await
        .map_err(mesh.explain())?;
    match action {
        GuardsAction::List => {
            let list = registrar.list().await.map_err(mesh.explain())?;
            outln!("chain revision {}", list.revision);
            outln!(
                "{:<4} {:<20} {:<9} {:<8} {:<12} {:>8}  {:<24} endpoint",
                "#",
                "name",
                "role",
                "mode",
                "on failure",
                "timeout",
                "tools"
            );
            for (i, g) in list.guards.iter().enumerate() {
                outln!(
                    "{:<4} {:<20} {:<9} {:<8} {:<12} {:>6}ms  {:<24} {}",
                    i,
                    g.name,
                    g.role().name(),
                    g.mode().name(),
                    g.failure_policy().name(),
                    g.timeout_ms,
                    if g.tools.is_empty() {
                        "*".to_owned()
                    } else {
                        g.tools.join(",")
                    },
                    if g.policy.is_empty() {
                        // R32: every replica, `endpoint` first.
                        std::iter::once(&g.endpoint)
                            .filter(|e| !e.is_empty())
                            .chain(&g.replicas)
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(",")
                    } else {
                        format!("(policy, {} bytes)", g.policy.len())
                    }
                );
            }
        }
        GuardsAction::Register {
            name,
            endpoint,
            replica,
            policy_file,
            role,
            tools,
            timeout_ms,
            failure_policy,
            priority,
            dry_run,
            grant_tools,
            may_rename,
            server_identity,
        } => {
            let policy = match &policy_file {
                Some(path) => std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?,
                None => String::new(),
            };
            let spec = GuardSpec {
                name,
                endpoint: endpoint.unwrap_or_default(),
                role: role as i32,
                tools,
                timeout_ms,
                failure_policy: failure_policy as i32,
                priority,
                mode: if dry_run {
                    GuardMode::DryRun
                } else {
                    GuardMode::Enforce
                } as i32,
                grant: (role == GuardRole::Mutate).then_some(RewriteGrant {
                    tools: grant_tools,
                    may_rename,
                }),
                server_identity: server_identity.unwrap_or_default(),
                policy,
                replicas: replica,
                ..GuardSpec::default()
            };
            if role == GuardRole::Mutate && spec.grant.as_ref().is_none_or(|g| g.tools.is_empty()) {
                eprintln!(
                    "warning: guard {:?} is a mutate guard with an empty grant: every rewrite \
                     it sends is rejected (R11); pass --grant-tools",
                    spec.name
                );
            }
            let out = registrar.register(spec).await.map_err(mesh.explain())?;
            outln!(
                "{} at position {} (chain revision {})",
                if out.created { "registered" } else { "updated" },
                out.position,
                out.revision
            );
        }
        GuardsAction::Deregister { name } => {
            if registrar
                .deregister(name.clone())
                .await
                .map_err(mesh.explain())?
            {
                outln!("deregistered {name}");
            } else {
                outln!("no guard named {name}");
            }
        }
    }
    Ok(())
}

/// `guardmesh evaluate`: judges each batch of the input in turn, prints
/// the decisions (tables, or JSON Lines with `--json`), and returns the exit
/// code of [`crate::evaluate`]. A mesh that cannot be reached stops the run.
async fn evaluate(mesh: &MeshArgs, file: &std::path::Path, json: bool) -> ExitCode {
    use crate::evaluate::{self as eval, Judged};
    let fail = |message: String| {
        eprintln!("error: {message}");
        ExitCode::from(eval::EXIT_ERROR)
    };
    let (text, source) = if file.as_os_str() == "-" {
        let mut text = String::new();
        match std::io::Read::read_to_string(&mut std::io::stdin(), &mut text) {
            Ok(_) => (text, "stdin".to_owned()),
            Err(e) => return fail(format!("cannot read stdin: {e}")),
        }
    } else {
        match std::fs::read_to_string(file) {
            Ok(text) => (text, file.display().to_string()),
            Err(e) => return fail(format!("cannot read {}: {e}", file.display())),
        }
    };
    let batches = match eval::parse_batches(&text, &source) {
        Ok(batches) => batches,
        Err(message) => return fail(message),
    };
    let connection = match mesh.connection() {
        Ok(connection) => connection,
        Err(e) => return fail(e.to_string()),
    };
    let coordinator = match Coordinator::connect_with(mesh.mesh.clone(), &connection).await {
        Ok(coordinator) => coordinator,
        Err(e) => return fail(guardmesh_server::error_chain(mesh.explain()(e).as_ref())),
    };
    let mut judged = Vec::with_capacity(batches.len());
    for (n, input) in batches.into_iter().enumerate() {
        let mut batch = Batch::new(input.turn_index).model_text(input.model_text);
        batch.metadata = input.metadata;
        batch.calls = input
            .calls
            .into_iter()
            .map(|c| c.into_call())
            .collect::<Vec<ToolCall>>();
        batch.results = input.results.into_iter().map(|r| r.into_result()).collect();
        let session = if input.session_id.is_empty() {
            "cli".to_owned()
        } else {
            input.session_id
        };
        let result = match coordinator.evaluate_once(&session, batch).await {
            Ok(decision) => Judged::Decided(Box::new(decision)),
            Err(error) => match eval::refusal(error) {
                Ok(status) => Judged::Refused(status),
                Err(error) => {
                    return fail(guardmesh_server::error_chain(
                        mesh.explain()(error).as_ref(),
                    ));
                }
            },
        };
        match (&result, json) {
            (Judged::Decided(decision), true) => {
                outln!("{}", eval::decision_json(&session, decision));
            }
            (Judged::Decided(decision), false) => out!("{}", crate::demo::render(decision)),
            (Judged::Refused(status), _) => {
                if json {
                    outln!("{}", eval::refusal_json(&session, status));
                }
                let error = mesh.explain()(guardmesh_client::ClientError::Status(status.clone()));
                eprintln!("error: batch {} refused: {error}", n + 1);
            }
        }
        judged.push(result);
    }
    ExitCode::from(eval::exit_code(&judged))
}
