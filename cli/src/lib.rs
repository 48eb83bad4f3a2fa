//! The `guardmesh` command and the tools around the mesh. The mesh itself is
//! the `guardmesh-server` library; nothing here is on a batch's path
//! but the glue of a gateway that embeds the mesh.
//!
//! * `app`: the command line (clap), the runtime, and the commands that run
//!   or talk to a mesh: `serve`, `guards`, `evaluate`, `policy`, `certs`,
//!   `example-guard`; `mcp` and `hook` delegate to the `guardmesh-gateway`
//!   crate, and `embedded` builds the mesh a gateway started with
//!   `--config` judges with in its own process.
//! * `approvals`: `guardmesh approvals list|approve|deny`, answering
//!   guards' asks (R35).
//! * `evaluate`: the input, `--json` output and exit codes of `guardmesh
//!   evaluate`; `config_cmd`: `guardmesh config check` and `guardmesh config
//!   reference`.
//! * `log`: `guardmesh log verify` and `guardmesh log keygen` (R29);
//!   `log_show`: `guardmesh log show` and `guardmesh log tail`;
//!   `replay`: `guardmesh replay` (R30).
//! * [`heartbeat`]: `guardmesh heartbeat`, a liveness sidecar for guards of
//!   any language on the etcd registry, and the lease it keeps
//!   ([`heartbeat::GuardHeartbeat`]).
//! * [`demo`]: `guardmesh demo`, a mesh, example guards and a coordinator in
//!   one process, printing decisions and traces.
//! * [`examples`]: the example guards, written with the Rust SDK;
//!   [`redact`]: the `redact-formats` example guard's redaction (R33, R34).
//! * `guardmesh conformance` (a check of a running guard of any language
//!   against the `Judge` protocol) and `guardmesh bench` (the mesh against
//!   what users would run instead, on loopback) are thin subcommands over
//!   their own crates, `guardmesh-conformance` and `guardmesh-bench`.
//! * [`certs`]: a local CA and certificates for development and tests.

#[macro_use]
mod out;
mod app;
mod approvals;
pub mod certs;
mod config_cmd;
pub mod demo;
mod embedded;
mod evaluate;
pub mod examples;
pub mod heartbeat;
mod log;
mod log_show;
pub mod redact;
mod replay;
mod runtime;
mod systemd;

pub use app::main;
