//! `guardmesh bench`: the mesh against calling guards directly, on loopback,
//! in one run (see [`bench`] for what runs where, and docs/performance.md
//! for the figures).
//!
//! A crate of its own, apart from the operator commands of the product
//! binary: its load generator, latency histograms, MCP client and baseline
//! services are built here. The `guardmesh` binary keeps `guardmesh bench`
//! (and the hidden `bench-guards`, `bench-relay`, `bench-mcp-upstream` and
//! `bench-session-mesh` it starts as child processes from its own
//! executable) as thin subcommands over [`run`], [`serve_guards`],
//! [`serve_relay`], [`serve_mcp_upstream`] and [`serve_session_mesh`].

pub mod bench;

pub use bench::{
    BenchArgs, Flavor, GuardsArgs, Only, Placement, RelayArgs, SessionMeshArgs, main as run,
    serve_guards, serve_mcp_upstream, serve_relay, serve_session_mesh,
};

/// `guardmesh.bench.v1`: the unary baselines (`DirectGuard`, `Echo`) that
/// the benchmark measures the mesh against. Not part of the contract:
/// compiled here, so that the wire types and their descriptor set (what
/// meshes and SDK guards advertise by reflection) never carry them.
pub mod proto {
    #![allow(clippy::all, missing_docs, unreachable_pub)]
    tonic::include_proto!("guardmesh.bench.v1");
}
