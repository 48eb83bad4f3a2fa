//! The guardmesh MCP gateway and agent-host hooks: tool calls from agents
//! that speak MCP, or that run pre-tool hooks, judged by the mesh before they
//! run (R31 of `docs/behaviour.md`).
//!
//! * [`stdio`]: `guardmesh mcp stdio -- COMMAND...`, a relay in front of an
//!   MCP server started over stdio.
//! * [`http`]: `guardmesh mcp http --upstream URL`, the same in front of a
//!   Streamable HTTP MCP server; the `Mcp-Session-Id` is the batch's session.
//! * [`judge`]: a set of `tools/call` requests as one mesh batch, and each
//!   decision as forward / tool result / JSON-RPC error; the mesh reached
//!   over gRPC (`--mesh`) or run in the gateway's process (`--config`).
//! * [`approval`]: a guard's ask put to the MCP client's user through
//!   elicitation, approved or denied with the gateway's approver token
//!   (R35).
//! * [`group`]: single `tools/call` requests arriving together judged as
//!   one batch.
//! * [`jsonrpc`]: strict reading of client messages, and the answers the
//!   gateway writes itself.
//! * [`json`]: the JSON tree messages are read into once and written out
//!   from.
//! * [`hook`](mod@hook): `guardmesh hook pre-tool-use`, an agent host's
//!   `PreToolUse` hook.
//! * [`interceptors`]: `interceptors/list` and `interceptor/invoke` (the
//!   MCP interceptor extension, SEP-2624) answered through the mesh.
//! * [`routing`]: the routing headers of the 2026-07-28 revision over HTTP.
//! * [`sampling`]: the `tool_use` blocks of a client's sampling answer
//!   judged as calls before the upstream receives them.
//! * [`upstream`]: what comes back from the upstream, read once and
//!   matched to its request by the gateway's own ids; `stream`: the
//!   upstream's HTTP answers relayed message by message.
//! * [`schemas`]: the tools' output schemas, so that every answer the
//!   gateway writes is one the official SDK clients accept.
//! * [`visibility`]: `tools/list` answers without the tools the chain
//!   skips whatever the arguments (`--hide-skipped-tools`).
//! * `pipes`: the process's stdin and stdout on the runtime's reactor, when
//!   they are pipes or sockets.
//!
//! # Forwarding what was judged, as the gateway writes it
//!
//! The gateway reads each client message once and forwards its own
//! serialization of what it read, never the client's bytes (R31). Bytes
//! relayed unchanged would be read again by the upstream's parser, which
//! may not read them as the gateway did: the Python SDK splits stdin at a
//! bare CR (universal newlines) where JSON sees whitespace; Python and
//! JavaScript take the last of two equal member names; Go's
//! `encoding/json` matches member names case-insensitively (`METHOD`,
//! `paramſ`, `PATH`). A call hidden in such a message would run unjudged.
//! So every message, `tools/call` or not, is parsed into the gateway's
//! tree ([`json`]), refused with a JSON-RPC error when any peer could read
//! it differently (names that collide under case folding at any depth,
//! unknown or repeated envelope members, a bare CR on stdio, a batch with
//! an element it cannot judge), and otherwise written out compactly from
//! the tree, with line breaks outside ASCII escaped.
//!
//! # Why not rmcp's service layer
//!
//! The official Rust SDK, `rmcp`, is used for what fits a relay: its protocol
//! types ([`rmcp::model::CallToolResult`], [`rmcp::model::ErrorData`],
//! [`rmcp::model::NumberOrString`]) for every answer the gateway writes
//! itself, and its JSON-RPC line codec
//! ([`rmcp::transport::async_rw::JsonRpcMessageCodec`], bounded) for the
//! upstream's stdio. Its client and server *services* are not used: they
//! deserialize every message into the typed enums of the MCP revisions rmcp
//! knows, so a method or field it does not know would be refused or
//! dropped. A relay must pass unknown methods, unknown fields, and numbers
//! of any size through (R31), so the gateway's tree keeps every member and
//! each number as its text (`serde_json::Value` would round numbers to
//! `f64`, and its `arbitrary_precision` feature would change number
//! handling for every crate of the build).

pub mod approval;
mod body_buffer;
pub mod group;
pub mod hook;
pub mod http;
pub mod interceptors;
pub mod json;
pub mod jsonrpc;
pub mod judge;
mod lane;
mod pipes;
pub mod routing;
pub mod sampling;
pub mod schemas;
pub mod sessions;
pub mod stdio;
mod stream;
pub mod upstream;
pub mod visibility;

pub use guardmesh_client::MeshArgs;
pub use hook::PreToolUseArgs;
pub use http::HttpArgs;
pub use judge::{InProcessMesh, JudgeArgs, LocalMesh};
pub use stdio::StdioArgs;

use std::process::ExitCode;

/// `guardmesh mcp ...`.
#[derive(clap::Args, Debug, Clone)]
pub struct McpArgs {
    #[command(subcommand)]
    pub command: McpCommand,
}

/// The MCP gateway's transports.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum McpCommand {
    /// Starts COMMAND as the upstream MCP server over stdio and relays
    /// every message, judging each tools/call through the mesh first.
    Stdio(StdioArgs),
    /// Serves Streamable HTTP in front of an upstream MCP server's URL,
    /// judging each tools/call through the mesh first.
    Http(HttpArgs),
}

/// `guardmesh hook ...`.
#[derive(clap::Args, Debug, Clone)]
pub struct HookArgs {
    #[command(subcommand)]
    pub command: HookCommand,
}

/// Agent-host hooks.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum HookCommand {
    /// A PreToolUse hook for agent hosts: the call on stdin, the
    /// decision as hook JSON on stdout (see docs/mcp-and-hooks.md for the exit codes).
    PreToolUse(PreToolUseArgs),
}

/// Runs `guardmesh mcp ...`; returns the process's exit code.
pub async fn mcp(args: McpArgs) -> i32 {
    let result = match args.command {
        McpCommand::Stdio(args) => stdio::run(args).await.map_err(|e| e.to_string()),
        McpCommand::Http(args) => http::run(args).await.map(|()| 0).map_err(|e| e.to_string()),
    };
    result.unwrap_or_else(|error| {
        eprintln!("error: {error}");
        1
    })
}

/// Runs `guardmesh hook ...`; returns the process's exit code.
pub async fn hook(args: HookArgs) -> i32 {
    match args.command {
        HookCommand::PreToolUse(args) => hook::pre_tool_use(args).await,
    }
}

/// Builds the mesh a config file describes, in this process (`--config`):
/// given by the `guardmesh` binary, which has the server.
pub type MeshLoader = Box<
    dyn FnOnce(
            std::path::PathBuf,
        )
            -> futures::future::BoxFuture<'static, Result<std::sync::Arc<dyn LocalMesh>, String>>
        + Send,
>;

/// [`mcp`] on its own runtime, logging to stderr only (stdout is the
/// protocol's).
pub fn main_mcp(args: McpArgs) -> ExitCode {
    main_mcp_with(args, None)
}

/// [`hook`] on its own runtime, logging to stderr only. The hook runs
/// once per call, so it reaches a mesh (`--mesh`) and never builds one:
/// `--config` blocks the call (exit 2) with the reason.
pub fn main_hook(args: HookArgs) -> ExitCode {
    let HookCommand::PreToolUse(pre) = &args.command;
    if pre.mesh.config.is_some() {
        eprintln!(
            "guardmesh: --config is for the MCP gateways; the hook runs once per call and reaches a mesh with --mesh; blocking the call"
        );
        return ExitCode::from(2);
    }
    block_on(hook(args))
}

/// [`main_mcp`], judging with the mesh `loader` builds when `--config` is
/// given.
pub fn main_mcp_with(mut args: McpArgs, loader: Option<MeshLoader>) -> ExitCode {
    block_on(async move {
        let judge = match &mut args.command {
            McpCommand::Stdio(args) => &mut args.mesh,
            McpCommand::Http(args) => &mut args.mesh,
        };
        match embed(judge, loader).await {
            Ok(local) => {
                let code = mcp(args).await;
                if let Some(local) = local {
                    local.close().await;
                }
                code
            }
            Err(error) => {
                eprintln!("error: {error}");
                1
            }
        }
    })
}

/// Loads the mesh of `--config` into `judge`, if given.
async fn embed(
    judge: &mut JudgeArgs,
    loader: Option<MeshLoader>,
) -> Result<Option<std::sync::Arc<dyn LocalMesh>>, String> {
    let Some(path) = judge.config.clone() else {
        return Ok(None);
    };
    let Some(loader) = loader else {
        return Err("--config: this build cannot judge in process; use --mesh".into());
    };
    if judge.connect.mesh != guardmesh_client::args::DEFAULT_MESH {
        tracing::warn!(
            mesh = %judge.connect.mesh,
            "judging with the mesh of --config: the mesh address (--mesh, GUARDMESH_MESH) is not used"
        );
    }
    let local = loader(path.clone())
        .await
        .map_err(|e| format!("the mesh of {}: {e}", path.display()))?;
    judge.local = Some(InProcessMesh(local.clone()));
    Ok(Some(local))
}

fn block_on(future: impl std::future::Future<Output = i32>) -> ExitCode {
    let _ = tracing_subscriber::fmt()
        // Through a bounded queue: a log line never blocks the relay when
        // nobody reads stderr (dropped and counted instead).
        .with_writer(|| pipes::LogWriter)
        // Colours only on a terminal: hosts keep an MCP server's stderr in
        // log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(future);
    // A read of stdin may still be blocked on its thread (the session ended
    // from the upstream's side): do not wait for it.
    runtime.shutdown_background();
    // The last log lines, and the count of dropped ones (bounded: nobody
    // may be reading).
    pipes::stderr().flush(std::time::Duration::from_secs(1));
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
