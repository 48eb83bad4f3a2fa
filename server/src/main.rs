//! `guardmesh`: the mesh server and its command-line tools.

use clap::{Parser, Subcommand};
use guardmesh_client::proto::{
    FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant, ToolCall,
};
use guardmesh_client::{Batch, Coordinator, Registrar};
use guardmesh_server::config::Config;
use guardmesh_server::examples::{Example, Kind};
use guardmesh_server::telemetry::{self, LogFormat};
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
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the mesh.
    Serve {
        /// TOML config file (see README). Without one, defaults apply.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Overrides the config's listen address (default 127.0.0.1:50051).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Lists, registers or deregisters guards of a running mesh.
    Guards {
        /// The mesh's address.
        #[arg(long, default_value = "http://127.0.0.1:50051", global = true)]
        mesh: String,
        #[command(subcommand)]
        action: GuardsAction,
    },
    /// Evaluates one batch from a JSON file and prints the decision.
    ///
    /// The file: {"session_id": "s", "turn_index": 0, "model_text": "...",
    /// "metadata": {...}, "calls": [{"call_id": "c1", "tool": "t",
    /// "arguments": {...}}]}
    Evaluate {
        #[arg(long, default_value = "http://127.0.0.1:50051")]
        mesh: String,
        file: PathBuf,
    },
    /// Starts a mesh and example guards on loopback and drives a coordinator
    /// through a few rounds, printing decisions and traces.
    Demo,
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
}

#[derive(Subcommand)]
enum GuardsAction {
    /// Prints the chain in order.
    List,
    /// Registers a guard, or updates it in place.
    Register {
        #[arg(long)]
        name: String,
        #[arg(long)]
        endpoint: String,
        #[arg(long, value_enum, default_value_t = RoleArg::Validate)]
        role: RoleArg,
        /// Tools judged (names or globs, comma separated); default all.
        #[arg(long, value_delimiter = ',')]
        tools: Vec<String>,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u32,
        #[arg(long, value_enum, default_value_t = PolicyArg::FailClosed)]
        failure_policy: PolicyArg,
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
    },
    /// Removes a guard.
    Deregister { name: String },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RoleArg {
    Validate,
    Mutate,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    FailClosed,
    FailOpen,
    Abort,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!(
                "error: {}",
                guardmesh_server::link::error_chain(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Error> {
    match cli.command {
        Command::Serve { config, listen } => {
            telemetry::init(cli.log_format, "info");
            serve(config, listen).await?;
        }
        Command::Guards { mesh, action } => {
            telemetry::init(cli.log_format, "warn");
            guards(&mesh, action).await?;
        }
        Command::Evaluate { mesh, file } => {
            telemetry::init(cli.log_format, "warn");
            evaluate(&mesh, &file).await?;
        }
        Command::Demo => {
            telemetry::init(cli.log_format, "error");
            guardmesh_server::demo::run().await?;
        }
        Command::ExampleGuard {
            kind,
            listen,
            delay_ms,
        } => {
            telemetry::init(cli.log_format, "warn");
            let listener = tokio::net::TcpListener::bind(listen).await?;
            println!("LISTENING {}", listener.local_addr()?.port());
            let guard = Example::delayed(kind, Duration::from_millis(delay_ms));
            guardmesh_client::serve(guard, listener, shutdown_signal()).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
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
    let config = match config {
        Some(path) => Config::load(&path)?,
        None => Config::default(),
    };
    let mesh_config = config.mesh_config();
    let registry = Arc::new(MemoryRegistry::new(mesh_config.default_guard_timeout));
    for guard in &config.guards {
        registry
            .register(guard.to_spec())
            .await
            .map_err(|e| format!("config guard {:?}: {e}", guard.name))?;
    }
    let mesh = Mesh::new(mesh_config, registry);
    let addr = listen.unwrap_or(config.listen);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    tracing::info!(addr = %listener.local_addr()?, guards = config.guards.len(), "guardmesh serving");
    if let Some(metrics_addr) = config.metrics_listen {
        guardmesh_server::metrics_http::spawn(metrics_addr, mesh.metrics.clone()).await?;
    }
    guardmesh_server::server::run(listener, mesh, shutdown_signal()).await?;
    tracing::info!("guardmesh stopped");
    Ok(())
}

async fn guards(mesh: &str, action: GuardsAction) -> Result<(), Error> {
    let registrar = Registrar::connect(mesh.to_owned()).await?;
    match action {
        GuardsAction::List => {
            let list = registrar.list().await?;
            println!("chain revision {}", list.revision);
            println!(
                "{:<4} {:<20} {:<9} {:<8} {:<12} {:>8}  {:<24} endpoint",
                "#", "name", "role", "mode", "on failure", "timeout", "tools"
            );
            for (i, g) in list.guards.iter().enumerate() {
                println!(
                    "{:<4} {:<20} {:<9} {:<8} {:<12} {:>6}ms  {:<24} {}",
                    i,
                    g.name,
                    if g.role == GuardRole::Mutate as i32 {
                        "mutate"
                    } else {
                        "validate"
                    },
                    if g.mode == GuardMode::DryRun as i32 {
                        "dry_run"
                    } else {
                        "enforce"
                    },
                    FailurePolicy::try_from(g.failure_policy)
                        .map(|p| p
                            .as_str_name()
                            .trim_start_matches("FAILURE_POLICY_")
                            .to_ascii_lowercase())
                        .unwrap_or_default(),
                    g.timeout_ms,
                    if g.tools.is_empty() {
                        "*".to_owned()
                    } else {
                        g.tools.join(",")
                    },
                    g.endpoint
                );
            }
        }
        GuardsAction::Register {
            name,
            endpoint,
            role,
            tools,
            timeout_ms,
            failure_policy,
            priority,
            dry_run,
            grant_tools,
            may_rename,
        } => {
            let role = match role {
                RoleArg::Validate => GuardRole::Validate,
                RoleArg::Mutate => GuardRole::Mutate,
            };
            let spec = GuardSpec {
                name,
                endpoint,
                role: role as i32,
                tools,
                timeout_ms,
                failure_policy: match failure_policy {
                    PolicyArg::FailClosed => FailurePolicy::FailClosed,
                    PolicyArg::FailOpen => FailurePolicy::FailOpen,
                    PolicyArg::Abort => FailurePolicy::Abort,
                } as i32,
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
            };
            let out = registrar.register(spec).await?;
            println!(
                "{} at position {} (chain revision {})",
                if out.created { "registered" } else { "updated" },
                out.position,
                out.revision
            );
        }
        GuardsAction::Deregister { name } => {
            if registrar.deregister(name.clone()).await? {
                println!("deregistered {name}");
            } else {
                println!("no guard named {name}");
            }
        }
    }
    Ok(())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchFile {
    #[serde(default)]
    session_id: String,
    #[serde(default)]
    turn_index: u32,
    #[serde(default)]
    model_text: String,
    #[serde(default)]
    metadata: std::collections::HashMap<String, String>,
    calls: Vec<CallFile>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CallFile {
    call_id: String,
    tool: String,
    #[serde(default)]
    arguments: serde_json::Value,
}

async fn evaluate(mesh: &str, file: &std::path::Path) -> Result<(), Error> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let input: BatchFile = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a batch: {e}", file.display()))?;
    let mut batch = Batch::new(input.turn_index).model_text(input.model_text);
    batch.metadata = input.metadata;
    batch.calls = input
        .calls
        .into_iter()
        .map(|c| ToolCall {
            call_id: c.call_id,
            tool: c.tool,
            arguments: if c.arguments.is_null() {
                String::new()
            } else {
                c.arguments.to_string()
            },
        })
        .collect();
    let coordinator = Coordinator::connect(mesh.to_owned()).await?;
    let session = if input.session_id.is_empty() {
        "cli"
    } else {
        &input.session_id
    };
    let decision = coordinator.evaluate_once(session, batch).await?;
    print!("{}", guardmesh_server::demo::render(&decision));
    Ok(())
}
