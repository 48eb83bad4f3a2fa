//! The MCP gateway's overhead (R31): the latency of one `tools/call` made
//! through `guardmesh mcp stdio` against the same call made directly to the
//! same upstream MCP server, in one run, the scenarios alternating round by
//! round.
//!
//! * **The client** is the official Rust MCP SDK's (`rmcp`) client service
//!   in this process, on the stdio of the process it starts: the upstream
//!   itself, or the gateway in front of it.
//! * **The upstream** is `guardmesh bench-mcp-upstream` ([`serve_upstream`]):
//!   a minimal MCP server over stdio with one tool, `echo`, that answers at
//!   once, so that what is measured is the gateway, not the tool. Against a
//!   real server the same added time is a smaller share of each call.
//! * **The gateway** judges each call through a fresh mesh with one
//!   zero-latency guard of the guard process (`mcp_stdio`, with the
//!   gateway's default grouping and with `--batch-window-ms 0`), or with no guard
//!   at all (`mcp_relay_w0`: the relay and one mesh round trip).
//! * **The embedded gateway** (`guardmesh mcp stdio --config`) judges
//!   with the mesh in its own process, built from a config with the same
//!   guard (`mcp_embedded_w0`) or none (`mcp_embedded_relay_w0`, its relay
//!   floor: the gateway alone). Its CPU figure holds the mesh's work; the
//!   one to set it beside is `mcp_gateway_w0_with_mesh_cpu_us_per_call`.
//!
//! Each call carries [`ARGUMENT_BYTES`](super::ARGUMENT_BYTES) of JSON
//! arguments, as the mesh scenarios do.

use super::report::{self, Cpu, Latency};
use super::{Error, GuardProcess, MeshProcess, OP_TIMEOUT, START_TIMEOUT, ZERO, child};
use hdrhistogram::Histogram;
use rmcp::RoleClient;
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, JsonObject};
use rmcp::service::RunningService;
use serde_json::{Value, json};
use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::Duration;
use tokio::time::Instant;

/// The upstream's one tool, and what it answers.
const TOOL: &str = "echo";
const ANSWER: &str = "ok";

/// Entry point of the hidden `guardmesh bench-mcp-upstream`: a minimal MCP
/// server on stdin/stdout (newline-delimited JSON-RPC) with one tool,
/// `echo`, that answers `ok` at once. Answers `initialize` with the
/// protocol version the client asks for, `tools/list`, `tools/call` and
/// `ping`; other requests get "method not found"; notifications are
/// ignored. Exits when stdin closes.
pub(super) fn serve_upstream() -> ExitCode {
    let stdin = std::io::stdin().lock();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in stdin.lines() {
        let Ok(line) = line else { break };
        let message: Value = match serde_json::from_str(&line) {
            Ok(message) => message,
            Err(error) => {
                eprintln!("bench-mcp-upstream: not JSON ({error}): {line}");
                continue;
            }
        };
        let (Some(id), Some(method)) = (
            message.get("id"),
            message.get("method").and_then(Value::as_str),
        ) else {
            continue; // a notification or a response
        };
        let result = match method {
            "initialize" => Ok(json!({
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "guardmesh-bench-upstream", "version": env!("CARGO_PKG_VERSION")},
            })),
            "tools/list" => Ok(json!({"tools": [{
                "name": TOOL,
                "description": "Answers ok.",
                "inputSchema": {"type": "object"},
            }]})),
            "tools/call" => {
                serde_json::to_value(CallToolResult::success(vec![ContentBlock::text(ANSWER)]))
                    .map_err(|e| e.to_string())
            }
            "ping" => Ok(json!({})),
            other => Err(format!("method not found: {other}")),
        };
        let answer = match result {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err(message) => {
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": message}})
            }
        };
        if writeln!(out, "{answer}")
            .and_then(|()| out.flush())
            .is_err()
        {
            break;
        }
    }
    ExitCode::SUCCESS
}

/// An MCP client session (rmcp) on the stdio of a child process.
struct McpClient {
    service: RunningService<RoleClient, ()>,
    child: tokio::process::Child,
    pid: u32,
}

impl McpClient {
    /// Starts `command` (its stderr to `log`) and runs the MCP handshake.
    async fn start(
        what: &str,
        mut command: tokio::process::Command,
        log: &Path,
    ) -> Result<Self, Error> {
        let stderr = std::fs::File::create(log)
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        super::placement::pin_child(command.as_std_mut());
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {what}: {e}"))?;
        let pid = child.id().ok_or("the child exited at once")?;
        let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
            return Err(format!("{what}: stdio not piped").into());
        };
        let service = tokio::time::timeout(START_TIMEOUT, rmcp::serve_client((), (stdout, stdin)))
            .await
            .map_err(|_| format!("{what}: no MCP handshake within {START_TIMEOUT:?}"))?
            .map_err(|e| format!("{what}: MCP handshake: {e}"))?;
        Ok(Self {
            service,
            child,
            pid,
        })
    }

    /// One `tools/call`, its answer checked.
    async fn call(&self, arguments: &JsonObject) -> Result<(), Error> {
        let params = CallToolRequestParams::new(TOOL).with_arguments(arguments.clone());
        let result = self.service.call_tool(params).await?;
        let text = result
            .content
            .first()
            .and_then(ContentBlock::as_text)
            .map(|t| t.text.as_str());
        if result.is_error == Some(true) || text != Some(ANSWER) {
            return Err(format!("unexpected tools/call answer: {result:?}").into());
        }
        Ok(())
    }

    async fn close(mut self) {
        let _ = self.service.cancel().await;
        let _ = self.child.kill().await;
    }
}

/// One scenario: a client session, timed call by call.
struct Scenario {
    name: &'static str,
    what: &'static str,
    client: McpClient,
    /// The mesh the gateway judges through (none when direct).
    mesh_pid: Option<u32>,
    histogram: Histogram<u64>,
    cpu: Cpu,
    /// CPU time of the process the client talks to (the gateway, or the
    /// upstream when direct).
    server_cpu: Duration,
}

impl Scenario {
    fn new(
        name: &'static str,
        what: &'static str,
        client: McpClient,
        mesh: Option<&MeshProcess>,
    ) -> Result<Self, Error> {
        Ok(Self {
            name,
            what,
            client,
            mesh_pid: mesh.map(MeshProcess::pid),
            histogram: report::histogram()?,
            cpu: Cpu::default(),
            server_cpu: Duration::ZERO,
        })
    }

    async fn timed(&self, arguments: &JsonObject) -> Result<Duration, Error> {
        let started = Instant::now();
        match tokio::time::timeout(OP_TIMEOUT, self.client.call(arguments)).await {
            Ok(Ok(())) => Ok(started.elapsed()),
            Ok(Err(error)) => Err(format!("{}: {error}", self.name).into()),
            Err(_) => Err(format!("{}: no answer within {OP_TIMEOUT:?}", self.name).into()),
        }
    }

    async fn round(
        &mut self,
        arguments: &JsonObject,
        count: u64,
        guards_pid: u32,
    ) -> Result<(), Error> {
        let before = super::cpu_now(self.mesh_pid, guards_pid)?;
        let server_before = child::cpu_time(self.client.pid)?;
        for _ in 0..count {
            let elapsed = self.timed(arguments).await?;
            report::record(&mut self.histogram, elapsed);
        }
        self.cpu
            .add(super::cpu_now(self.mesh_pid, guards_pid)?.since(before));
        self.server_cpu += child::cpu_time(self.client.pid)?.saturating_sub(server_before);
        Ok(())
    }

    fn server_cpu_us_per_call(&self) -> f64 {
        self.server_cpu.as_secs_f64() * 1e6 / self.histogram.len().max(1) as f64
    }
}

/// `guardmesh mcp stdio --mesh URL [extra] -- guardmesh bench-mcp-upstream`.
fn gateway(exe: &Path, mesh: &MeshProcess, extra: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(exe);
    command
        .args(["mcp", "stdio", "--mesh", &mesh.url, "--session", "bench"])
        .args(extra)
        .arg("--")
        .arg(exe)
        .arg("bench-mcp-upstream");
    command
}

/// `guardmesh mcp stdio --config CONFIG --batch-window-ms 0 --
/// guardmesh bench-mcp-upstream`: the gateway judging with the mesh of
/// `config` in its own process.
fn embedded(exe: &Path, config: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(exe);
    command
        .args(["mcp", "stdio", "--config"])
        .arg(config)
        .args(["--session", "bench", "--batch-window-ms", "0", "--"])
        .arg(exe)
        .arg("bench-mcp-upstream");
    command
}

/// Writes the config of a mesh judging in the gateway's process with the
/// guards `names` of `guards`.
fn embedded_config(
    dir: &Path,
    label: &str,
    guards: &GuardProcess,
    names: &[&str],
) -> Result<std::path::PathBuf, Error> {
    let path = dir.join(format!("{label}.toml"));
    let mut config = format!("# guardmesh bench, scenario {label}\n");
    config.push_str(&MeshProcess::guard_sections(guards, names)?);
    std::fs::write(&path, config).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// The figures of the MCP scenarios, and their ratios.
pub(super) struct McpFigures {
    pub latency: Vec<Latency>,
    pub ratios: Vec<(String, f64)>,
}

/// Runs the MCP scenarios: (warm-up, per round) calls each, `rounds`
/// interleaved rounds.
pub(super) async fn run(
    exe: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    rounds: u32,
    counts: (u64, u64),
) -> Result<McpFigures, Error> {
    let mut mesh1 = MeshProcess::start(exe, dir, "mcp_mesh_1", guards, &ZERO[..1]).await?;
    let mut mesh0 = MeshProcess::start(exe, dir, "mcp_mesh_0", guards, &[]).await?;
    let mut upstream = tokio::process::Command::new(exe);
    upstream.arg("bench-mcp-upstream");
    let direct =
        McpClient::start("the MCP upstream", upstream, &dir.join("mcp_direct.log")).await?;
    let through = McpClient::start(
        "guardmesh mcp stdio",
        gateway(exe, &mesh1, &[]),
        &dir.join("mcp_stdio.log"),
    )
    .await?;
    let through_w0 = McpClient::start(
        "guardmesh mcp stdio --batch-window-ms 0",
        gateway(exe, &mesh1, &["--batch-window-ms", "0"]),
        &dir.join("mcp_stdio_w0.log"),
    )
    .await?;
    let relay_w0 = McpClient::start(
        "guardmesh mcp stdio (no guard)",
        gateway(exe, &mesh0, &["--batch-window-ms", "0"]),
        &dir.join("mcp_relay_w0.log"),
    )
    .await?;
    let embedded_w0 = McpClient::start(
        "guardmesh mcp stdio --config (1 guard)",
        embedded(
            exe,
            &embedded_config(dir, "mcp_embedded_1", guards, &ZERO[..1])?,
        ),
        &dir.join("mcp_embedded_w0.log"),
    )
    .await?;
    let embedded_relay_w0 = McpClient::start(
        "guardmesh mcp stdio --config (no guard)",
        embedded(exe, &embedded_config(dir, "mcp_embedded_0", guards, &[])?),
        &dir.join("mcp_embedded_relay_w0.log"),
    )
    .await?;
    let mut scenarios = vec![
        Scenario::new(
            "mcp_direct",
            "tools/call to the MCP server directly (stdio)",
            direct,
            None,
        )?,
        Scenario::new(
            "mcp_stdio",
            "tools/call through guardmesh mcp stdio, 1 zero-latency guard, default grouping (calls read together)",
            through,
            Some(&mesh1),
        )?,
        Scenario::new(
            "mcp_stdio_w0",
            "tools/call through guardmesh mcp stdio, 1 zero-latency guard, --batch-window-ms 0",
            through_w0,
            Some(&mesh1),
        )?,
        Scenario::new(
            "mcp_relay_w0",
            "tools/call through guardmesh mcp stdio, a mesh with no guard, --batch-window-ms 0",
            relay_w0,
            Some(&mesh0),
        )?,
        Scenario::new(
            "mcp_embedded_w0",
            "tools/call through guardmesh mcp stdio --config (the mesh in the gateway's process), 1 zero-latency guard, --batch-window-ms 0",
            embedded_w0,
            None,
        )?,
        Scenario::new(
            "mcp_embedded_relay_w0",
            "tools/call through guardmesh mcp stdio --config, a mesh with no guard, --batch-window-ms 0",
            embedded_relay_w0,
            None,
        )?,
    ];
    let arguments: JsonObject = match serde_json::from_str(&super::arguments(0, TOOL))? {
        Value::Object(map) => map,
        _ => return Err("the bench arguments are not a JSON object".into()),
    };
    eprintln!(
        "[bench] MCP gateway: {}",
        scenarios
            .iter()
            .map(|s| s.name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    let guards_pid = guards.child.pid();
    let result = async {
        for scenario in &scenarios {
            for _ in 0..counts.0 {
                scenario.timed(&arguments).await?;
            }
        }
        for _ in 0..rounds {
            for scenario in scenarios.iter_mut() {
                scenario.round(&arguments, counts.1, guards_pid).await?;
            }
        }
        Ok::<(), Error>(())
    }
    .await;
    if let Err(error) = result {
        guards.child.check_alive()?;
        mesh1.child.check_alive()?;
        mesh0.child.check_alive()?;
        return Err(error);
    }
    let latency: Vec<Latency> = scenarios
        .iter()
        .map(|s| Latency::new(s.name, s.what, &s.histogram, s.cpu, s.mesh_pid.is_some()))
        .collect();
    let server_cpu: Vec<f64> = scenarios
        .iter()
        .map(Scenario::server_cpu_us_per_call)
        .collect();
    for scenario in scenarios {
        scenario.client.close().await;
    }
    let ratios = ratios(&latency, &server_cpu);
    Ok(McpFigures { latency, ratios })
}

/// The gateway against the direct call: ratios and the time added (µs), at
/// p50 and p99; the CPU per call of the gateway process and of the upstream
/// called directly.
fn ratios(latency: &[Latency], server_cpu: &[f64]) -> Vec<(String, f64)> {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let [
        direct,
        stdio,
        stdio_w0,
        relay_w0,
        embedded_w0,
        embedded_relay_w0,
    ] = latency
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, through) in [
        ("mcp_stdio", stdio),
        ("mcp_stdio_w0", stdio_w0),
        ("mcp_relay_w0", relay_w0),
        ("mcp_embedded_w0", embedded_w0),
        ("mcp_embedded_relay_w0", embedded_relay_w0),
    ] {
        out.push((
            format!("{key}_vs_direct_p50"),
            ratio(through.p50, direct.p50),
        ));
        out.push((
            format!("{key}_vs_direct_p99"),
            ratio(through.p99, direct.p99),
        ));
        out.push((format!("{key}_added_us_p50"), through.p50 - direct.p50));
        out.push((format!("{key}_added_us_p99"), through.p99 - direct.p99));
    }
    if let [upstream, _, gateway_w0, _, embedded_w0, embedded_relay_w0] = server_cpu {
        out.push(("mcp_upstream_cpu_us_per_call".into(), *upstream));
        out.push(("mcp_gateway_w0_cpu_us_per_call".into(), *gateway_w0));
        // The gateway and its mesh together: two processes with --mesh,
        // one with --config (whose mesh is in the gateway's figure).
        out.push((
            "mcp_gateway_w0_with_mesh_cpu_us_per_call".into(),
            gateway_w0 + stdio_w0.cpu.mesh.unwrap_or(f64::NAN),
        ));
        out.push(("mcp_embedded_w0_cpu_us_per_call".into(), *embedded_w0));
        out.push((
            "mcp_embedded_relay_w0_cpu_us_per_call".into(),
            *embedded_relay_w0,
        ));
    }
    out
}
