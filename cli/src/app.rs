//! The `guardmesh` command line: parsing, the runtime, and the commands that
//! talk to a mesh (`serve`, `guards`, `evaluate`, `certs`, `example-guard`).

use crate::examples::{Example, Kind};
use clap::{Parser, Subcommand};
use guardmesh_client::proto::{
    FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant, ToolCall,
};
use guardmesh_client::{Batch, Coordinator, Registrar};
use guardmesh_server::config::{Config, RegistryKind};
use guardmesh_server::observe::telemetry::{self, LogFormat};
use guardmesh_server::registry::etcd::EtcdRegistry;
use guardmesh_server::{MemoryRegistry, Mesh, Registry};
use std::path::PathBuf;
use std::process::ExitCode;

use std::sync::Arc;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "guardmesh",
    version,
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
        default_value_t = crate::runtime::default_worker_threads()
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
    /// Evaluates batches from a JSON file (or stdin) and prints the
    /// decisions; the exit code says whether every call may proceed.
    ///
    /// A batch: {"session_id": "s", "turn_index": 0, "model_text": "...",
    /// "metadata": {...}, "calls": [{"call_id": "c1", "tool": "t",
    /// "arguments": {...}}]}. The input is one batch, or one batch per line
    /// (JSON Lines), each judged in turn.
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
    },
    /// Checks a running guard, of any language, against the Judge protocol
    /// (one PASS/FAIL line per check; exits non-zero on any failure).
    Conformance(crate::conformance::ConformanceArgs),
    /// Benchmarks the mesh against calling guards directly, all on loopback
    /// (see docs/performance.md). `--quick` is a smoke run.
    Bench(crate::bench::BenchArgs),
    /// Serves the benchmark's guards and baselines (started by `bench`).
    #[command(hide = true)]
    BenchGuards(crate::bench::GuardsArgs),
    /// Serves the benchmark's relay floor: the mesh's hops without its work
    /// (started by `bench`).
    #[command(hide = true)]
    BenchRelay(crate::bench::RelayArgs),
    /// Serves the benchmark's upstream MCP server on stdio (started by
    /// `bench`).
    #[command(hide = true)]
    BenchMcpUpstream,
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
/// credentials sent on every call (R24).
#[derive(clap::Args)]
pub(crate) struct MeshArgs {
    /// The mesh's address: a URL (`https://` for a mesh with TLS), or
    /// `host:port` (https:// when --ca-file is given).
    #[arg(long, default_value = "http://127.0.0.1:50051", global = true)]
    pub(crate) mesh: String,
    /// PEM of the CA that signed the mesh's certificate (TLS).
    #[arg(long, global = true)]
    ca_file: Option<PathBuf>,
    /// This client's PEM certificate, for a mesh that requires mTLS.
    #[arg(long, global = true, requires = "key_file")]
    cert_file: Option<PathBuf>,
    /// The key of `--cert-file`, PEM.
    #[arg(long, global = true, requires = "cert_file")]
    key_file: Option<PathBuf>,
    /// The name to verify the mesh's certificate against, when it differs
    /// from the address's host.
    #[arg(long, global = true)]
    tls_domain: Option<String>,
    /// Bearer token. Prefer `--token-file` or the environment variable:
    /// a command line is visible to every user of the machine.
    #[arg(long, global = true, env = "GUARDMESH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file holding the bearer token (its first line); wins over
    /// `--token` and `GUARDMESH_TOKEN`.
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
}

/// Why the command-line tools could not build their connection to a mesh.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MeshArgsError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the token file {0} is empty")]
    EmptyToken(String),
    #[error(
        "--mesh {0} is https://: pass --ca-file with the CA that signed the mesh's certificate"
    )]
    NoCa(String),
    #[error("TLS settings given but --mesh {0} is not https://")]
    NotHttps(String),
}

impl MeshArgs {
    /// The SDK connection these flags describe.
    pub(crate) fn connection(&self) -> Result<guardmesh_client::Connection, MeshArgsError> {
        let read = |what: &'static str, path: &std::path::Path| {
            std::fs::read_to_string(path).map_err(|source| MeshArgsError::Read {
                what,
                path: path.display().to_string(),
                source,
            })
        };
        // A bare `host:port` is https:// when a CA is given (the SDK
        // completes it the same way), http:// otherwise.
        let mesh = self.mesh.trim_start();
        let https =
            mesh.starts_with("https://") || (!mesh.contains("://") && self.ca_file.is_some());
        let tls_flags =
            self.ca_file.is_some() || self.cert_file.is_some() || self.tls_domain.is_some();
        let tls = match &self.ca_file {
            Some(ca) if https => Some(guardmesh_client::Tls {
                ca_pem: read("CA file", ca)?,
                identity: match (&self.cert_file, &self.key_file) {
                    (Some(cert), Some(key)) => {
                        Some((read("certificate", cert)?, read("key", key)?))
                    }
                    _ => None,
                },
                domain: self.tls_domain.clone(),
            }),
            _ if https => return Err(MeshArgsError::NoCa(self.mesh.clone())),
            _ if tls_flags => return Err(MeshArgsError::NotHttps(self.mesh.clone())),
            _ => None,
        };
        let token = match (&self.token_file, &self.token) {
            (None, Some(token)) => Some(token.trim().to_owned()),
            (Some(path), _) => {
                let text = read("token file", path)?;
                let token = text.lines().next().unwrap_or_default().trim().to_owned();
                if token.is_empty() {
                    return Err(MeshArgsError::EmptyToken(path.display().to_string()));
                }
                Some(token)
            }
            (None, None) => None,
        }
        .filter(|t| !t.is_empty());
        Ok(guardmesh_client::Connection { tls, token })
    }
}

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

impl MeshArgs {
    /// [`explain`], plus a hint when the connection failed under TLS
    /// without a client certificate: a mesh that requires one refuses the
    /// handshake before any RPC (R24), which reaches the client as a
    /// transport error rather than `UNAUTHENTICATED`.
    pub(crate) fn explain(&self) -> impl Fn(guardmesh_client::ClientError) -> Error + '_ {
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
            let plaintext = self.mesh.starts_with("http://")
                || (!self.mesh.contains("://") && self.ca_file.is_none());
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
        /// A remote guard's address; or `--policy-file`.
        #[arg(long, required_unless_present = "policy_file")]
        endpoint: Option<String>,
        /// A policy guard (R27): a file of CEL rules, sent whole with the
        /// registration and judged inside the mesh.
        #[arg(long, conflicts_with = "endpoint")]
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
        Command::Bench(args) => return crate::bench::main(args),
        Command::BenchGuards(args) => return crate::bench::serve_guards(args),
        Command::BenchRelay(args) => return crate::bench::serve_relay(args),
        Command::BenchMcpUpstream => return crate::bench::serve_mcp_upstream(),
        Command::Mcp(args) => return guardmesh_gateway::main_mcp(args),
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
        Command::Heartbeat(args) => crate::heartbeat::run(args, shutdown_signal()).await,
        Command::Evaluate { .. } => Err("evaluate is handled above".into()),
        Command::Demo { mtls } => crate::demo::run(mtls).await,
        Command::Certs { dir } => certs(&dir),
        Command::ExampleGuard {
            kind,
            listen,
            delay_ms,
        } => example_guard(kind, listen, delay_ms).await,
        Command::Conformance(args) => crate::conformance::main(args).await,
        Command::Bench(_)
        | Command::BenchGuards(_)
        | Command::BenchRelay(_)
        | Command::BenchMcpUpstream
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
) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    outln!("LISTENING {}", listener.local_addr()?.port());
    let guard = Example::delayed(kind, Duration::from_millis(delay_ms));
    guardmesh_client::serve(guard, listener, shutdown_signal()).await?;
    Ok(())
}

fn certs(dir: &std::path::Path) -> Result<(), Error> {
    let files = crate::certs::generate(dir)?;
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
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

async fn serve(config: Option<PathBuf>, listen: Option<std::net::SocketAddr>) -> Result<(), Error> {
    let config_folder = config
        .as_deref()
        .and_then(std::path::Path::parent)
        .map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf);
    let config = match config {
        Some(path) => Config::load(&path)?,
        None => Config::default(),
    };
    for warning in config.insecure_settings() {
        tracing::warn!("insecure setting: {warning}");
    }
    for warning in config.guard_warnings() {
        tracing::warn!("{warning}");
    }
    // The probes answer from the start: /healthz at once, /readyz 503 until
    // the registry is loaded and the listener accepts.
    let probes = guardmesh_server::observe::metrics_http::Probes::new();
    if let Some(metrics_addr) = config.metrics_listen {
        guardmesh_server::observe::metrics_http::spawn_with_probes(metrics_addr, probes.clone())
            .await?;
    }
    // The soft open-file limit up to the hard one; the connection cap is
    // derived from it unless [server] max_connections is set (R25).
    if let Some(limit) = guardmesh_server::security::tls::raise_open_file_limit() {
        tracing::info!(open_files = limit, "open-file limit");
    }
    let (mesh_config, checked) = config.build_with_guards()?;
    let registry = build_registry(&config, checked, mesh_config.default_guard_timeout).await?;
    let mesh = Mesh::new(mesh_config, registry);
    let addr = listen.unwrap_or(config.listen);
    // Bound now, listening only once the mesh is ready: the decision log
    // names the mesh by the address bound (the port of `--listen
    // 127.0.0.1:0` is known here), and no connection is accepted before
    // the log has recorded the config's guards.
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .and_then(|socket| {
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        Ok(socket)
    })
    .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = socket.local_addr()?;
    // R29: the decision log is open before the first batch, or the mesh
    // does not start.
    if let Some(section) = &config.decision_log {
        use guardmesh_server::decision_log::{DecisionLog, MeshLog};
        // The instance is the address bound, not a port-0 address asked for.
        let settings = config.decision_log_settings(section, &bound.to_string())?;
        let limits = section.limits()?;
        let log = DecisionLog::open(settings)
            .await
            .map_err(|e| format!("[decision_log] cannot open the log: {e}"))?;
        let log =
            MeshLog::new(log, section.on_log_failure, mesh.metrics.clone()).with_limits(limits);
        let specs: Vec<_> = config.guards.iter().map(|g| g.to_spec()).collect();
        log.config_guards(&specs, mesh.registry().chain().revision)
            .await;
        let _ = mesh.attach_decision_log(log);
        tracing::info!(dir = %section.dir.display(), "decision log open");
    }
    probes.set_mesh(mesh.clone());
    // SIGHUP reloads the server certificate at once (it is also reloaded
    // when its files change), and the policy files of the config's policy
    // guards (R27), which are also reloaded when they change on disk.
    let guards: Vec<_> = config
        .guards
        .iter()
        .filter(|g| g.policy.is_some())
        .cloned()
        .collect();
    let _policy_watch = if guards.is_empty() || !config.watch_policies {
        None
    } else {
        let watched =
            crate::policy_reload::watch(mesh.clone(), config_folder.clone(), guards.clone())
                .map_err(|e| format!("cannot watch the policy files: {e}"))?;
        Some(watched)
    };
    #[cfg(unix)]
    if (mesh.config.security.server_tls.is_some() || !guards.is_empty())
        && let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
    {
        let tls = mesh.config.security.server_tls.clone();
        let mesh = mesh.clone();
        let folder = config_folder;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                if let Some(tls) = &tls {
                    tls.cert.reload();
                }
                for guard in &guards {
                    crate::policy_reload::reload_policy(
                        &mesh,
                        &folder,
                        guard.clone(),
                        crate::policy_reload::Trigger::Signal,
                    )
                    .await;
                }
            }
        });
    }
    let listener = socket
        .listen(1024)
        .map_err(|e| format!("cannot listen on {bound}: {e}"))?;
    tracing::info!(addr = %listener.local_addr()?, guards = config.guards.len(), "guardmesh serving");
    probes.set_listening();
    // On SIGTERM or SIGINT: /readyz turns 503, the server drains, and the
    // drain has `[server] shutdown_grace_ms` to finish before the process
    // exits anyway.
    let (stopping, mut stop) = tokio::sync::watch::channel(false);
    tokio::spawn({
        let probes = probes.clone();
        async move {
            shutdown_signal().await;
            probes.set_draining();
            let _ = stopping.send(true);
        }
    });
    let grace = config.server.shutdown_grace();
    let signalled = {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|s| *s).await;
        }
    };
    let grace_over = async move {
        let _ = stop.wait_for(|s| *s).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        served = guardmesh_server::server::run(listener, mesh.clone(), signalled) => served?,
        () = grace_over => tracing::warn!(
            grace_ms = grace.as_millis() as u64,
            "shutdown grace period over: exiting with batches still in flight"
        ),
    }
    if let Some(log) = mesh.decision_log()
        && let Err(error) = log.close().await
    {
        tracing::error!(%error, "decision log not closed cleanly");
    }
    tracing::info!("guardmesh stopped");
    Ok(())
}

/// The registry `[registry]` asks for, with the file's `[[guard]]` entries
/// registered in file order (R16). With etcd they are only created where
/// absent: the shared chain, not one replica's file, is the source of truth.
/// `guards`: the entries as admitted by `Config::build_with_guards`.
async fn build_registry(
    config: &Config,
    guards: Vec<guardmesh_server::registry::CheckedGuard>,
    default_timeout: Duration,
) -> Result<Arc<dyn Registry>, Error> {
    match config.registry.kind {
        RegistryKind::Memory => {
            let registry = Arc::new(MemoryRegistry::new(default_timeout));
            for guard in guards {
                let name = guard.name().to_owned();
                registry
                    .register(guard, None)
                    .await
                    .map_err(|e| format!("config guard {name:?}: {e}"))?;
            }
            Ok(registry)
        }
        RegistryKind::Etcd => {
            let etcd = config.registry.etcd()?;
            let registry = Arc::new(EtcdRegistry::connect(etcd, default_timeout).await?);
            for guard in guards {
                let name = guard.name().to_owned();
                registry
                    .register_if_absent(guard)
                    .await
                    .map_err(|e| format!("config guard {name:?}: {e}"))?;
            }
            Ok(registry)
        }
    }
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
                        g.endpoint.clone()
                    } else {
                        format!("(policy, {} bytes)", g.policy.len())
                    }
                );
            }
        }
        GuardsAction::Register {
            name,
            endpoint,
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
