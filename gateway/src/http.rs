//! `guardmesh mcp http`: Streamable HTTP in front of an upstream MCP server.

use crate::judge::MeshArgs;

/// `guardmesh mcp http`.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Address to serve on. Only loopback addresses unless TLS is set up.
    #[arg(long, default_value = "127.0.0.1:8808")]
    pub listen: std::net::SocketAddr,
    /// The upstream MCP server's Streamable HTTP endpoint URL.
    #[arg(long)]
    pub upstream: String,
}

/// Serves the proxy until interrupted.
pub async fn run(_args: HttpArgs) -> Result<(), String> {
    Err("not implemented yet".into())
}
