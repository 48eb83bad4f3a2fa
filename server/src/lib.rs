//! guardmesh: a gRPC guard mesh for AI agent tool calls.
//!
//! A coordinator streams each round of tool calls (a *batch*) to the mesh's
//! `PreToolService`; the mesh fans it out to the registered *guards* and folds
//! their verdicts into one decision per call, under the rules of SPEC.md.
//!
//! This crate is the mesh and nothing else; the `guardmesh` command, the demo,
//! the benchmark and the conformance kit live in the `cli/` crate. The
//! modules, from the wire inwards:
//!
//! * [`server`]: `run(listener, mesh, shutdown)`, the gRPC server with health
//!   and reflection; `server/service.rs` holds `PreToolService` (coordinators)
//!   and `GuardRegistry` (registrars), `server/inbound.rs` checks a batch's
//!   sizes and counts on its wire form before it is decoded (R20, R25).
//! * `admit`: the admission stage, everything a batch must pass before any
//!   guard sees it (sizes, ids, budgets, I-JSON, registry freshness, R1),
//!   with one typed refusal mapped to its gRPC status in one place.
//! * `validate`: the content rules of a batch (R20), with the one-pass
//!   I-JSON check of arguments in `validate/ijson.rs`.
//! * `judge`: judging one batch: mutate guards in order, validate guards
//!   concurrently, decisions and traces; it returns an outcome and writes no
//!   metrics or records. `judge/fold.rs` is the pure fold that makes
//!   concurrent verdicts equal sequential ones (R3, R4, R5);
//!   `judge/verdicts.rs` the pure checks on one guard's verdicts (R8, R11).
//! * `link`: one long-lived `Judge` stream per guard, with reconnects
//!   (`link/backoff.rs`) and a circuit breaker (`link/breaker.rs`), both small
//!   pure state machines; [`link::dial`]: which endpoints may be dialed and
//!   the TLS towards guards.
//! * [`mesh`]: the mesh's settings, its registry and chain snapshots (R17);
//!   `Mesh::evaluate` (`mesh/evaluate.rs`) runs one batch through admission
//!   and judging, and `mesh/record.rs` is the batch's record: it takes the
//!   outcome once and emits metrics, logs, spans and the decision record.
//!
//! The modules are layered: no module imports one that imports it back
//! (`scripts/check-import-cycles`); telemetry (`observe`) imports none of
//! the others.
//! * [`registry`]: where registrations live, behind the [`Registry`] trait:
//!   in memory, or shared by replicas in [`registry::etcd`]; a registration
//!   is checked and compiled in `registry/spec.rs`.
//! * [`security`]: TLS/mTLS on the listener ([`security::tls`]), identities
//!   and roles ([`security::auth`]).
//! * `accept`: the line the mesh's listeners log when an accept fails; the
//!   pauses between failed accepts and the open-file limit are
//!   `guardmesh_client::listener`'s, shared with the MCP gateway.
//! * [`observe`]: counters and histograms (`observe/metrics.rs`), the
//!   Prometheus endpoint ([`observe::metrics_http`]), logs and traces
//!   ([`observe::telemetry`]).
//! * [`policy`]: policy guards, CEL rules evaluated inside the mesh (R27),
//!   with the fast path beside the CEL interpreter in `policy/plan/`.
//! * [`decision_log`]: the tamper-evident decision log (R29): records,
//!   masking, the hash chain across rotated files, the writer
//!   (`decision_log/writer/`: the handle, its task, the write path,
//!   opening), `verify`.
//! * [`config`]: the TOML config file.
//! * [`run`]: [`Server`], the mesh assembled from a config (registry,
//!   decision log, policy watch and reload, metrics endpoint) and run until
//!   shutdown: what `guardmesh serve` and the integration tests both run.

mod accept;
mod admit;
pub mod config;
pub mod decision_log;
pub mod etcd_tls;
pub mod files;
mod judge;
pub mod link;
pub mod mesh;
pub mod observe;
pub mod policy;
pub mod registry;
pub mod run;
pub mod secret_formats;
pub mod security;
pub mod server;
pub mod session;
mod validate;

#[cfg(test)]
mod properties;

pub use judge::TraceContext;
pub use link::error_chain;
pub use mesh::{Mesh, MeshConfig};
pub use registry::{MemoryRegistry, Registry};
pub use run::{Server, ServerError};
pub use validate::RESERVED_BATCH_PREFIX;

/// Internals for the `cargo fuzz` targets in `fuzz/` (feature `fuzzing`);
/// not an API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::judge::fold::{Fold, FoldGuard, Resolution};
    pub use crate::registry::spec::Guard;
    pub use crate::validate::{Limits, check};
}
