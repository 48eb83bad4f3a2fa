//! guardmesh: a gRPC guard mesh for AI agent tool calls.
//!
//! A coordinator streams each round of tool calls (a *batch*) to the mesh's
//! `PreToolService`; the mesh fans it out to the registered *guards* and folds
//! their verdicts into one decision per call, under the rules of the
//! behaviour contract, `docs/behaviour.md` (R1..R35).
//!
//! This crate is the mesh and nothing else: the `guardmesh` command and the
//! demo live in the `cli/` crate, the MCP gateway and the pre-tool hook in
//! `gateway/`, the benchmark and the conformance kit in crates of their own
//! (`bench/`, `conformance/`). The modules, from the wire inwards:
//!
//! * `wire`: the protobuf wire where the mesh reads or writes it by hand
//!   (hot paths), in one place: every field number so used, declared once
//!   per message in `wire/fields.rs` and checked by its tests against the
//!   generated types; scanning fields without decoding them
//!   (`wire/read.rs`) and writing them (`wire/write.rs`); the `Judge`
//!   stream's codec (`wire/judge_stream.rs`, [`link::wire`]). It imports
//!   none of the other modules.
//! * [`grpc`]: `run(listener, mesh, shutdown)`, the gRPC server with health
//!   and reflection; `grpc/service.rs` holds `PreToolService` (coordinators)
//!   and `GuardRegistry` (registrars): the transports of the stream and
//!   unary doors, and nothing of a batch's way past them;
//!   `grpc/interceptor_service.rs` the chain as MCP interceptors,
//!   `grpc/inbound.rs` checks a batch's sizes and counts on its wire form
//!   before it is decoded (R20, R25), with the scan of `wire/read.rs`.
//! * `admit`: the admission stage, everything a batch must pass before any
//!   guard sees it (sizes, ids, budgets, I-JSON, registry freshness, R1),
//!   with one typed refusal mapped to its gRPC status in one place;
//!   `admit/result_batch.rs` the same for a request of results (R33).
//! * `validate`: the content rules of a batch (R20), with the one-pass
//!   I-JSON check of arguments in `validate/ijson.rs`.
//! * `judge`: judging one batch: mutate guards in order, validate guards
//!   concurrently, decisions and traces; it returns an outcome and writes no
//!   metrics or records. `judge/fold.rs` is the pure fold that makes
//!   concurrent verdicts equal sequential ones (R3, R4, R5);
//!   `judge/verdicts.rs` the pure checks on one guard's verdicts (R8, R11);
//!   `judge/remote.rs` the guards consulted over their links,
//!   `judge/lanes.rs` the policy guards evaluated in the mesh (R27),
//!   `judge/results_phase.rs` the results phase (R33), `judge/guard_run.rs` what
//!   happened at one guard and its trace entry (R21).
//! * [`link`]: a pool per guard over its replicas ([`link::pool`]: choice by
//!   load, failover, ejection; [`link::discover`]: replicas from a list, a
//!   DNS name or heartbeats; R32), one long-lived `Judge` stream per replica
//!   (`link/guard_link.rs`, its task in `link/stream.rs`), the requests
//!   queued for it (`link/queue.rs`, R25), how a request fails
//!   (`link/failure.rs`), with reconnects (`link/backoff.rs`) and a circuit
//!   breaker (`link/breaker.rs`), both small pure state machines;
//!   [`link::dial`]: which endpoints may be dialed and the TLS towards
//!   guards.
//! * [`mesh`]: the mesh's settings, its registry and chain snapshots (R17);
//!   `mesh/pipeline.rs` is the one way of a batch, whatever door it came in
//!   by (stream, unary, in process, interceptor invoke, replay): each door
//!   hands it only what its transport knows. `mesh/evaluate.rs` is the
//!   mesh's part of it (admission checks, session read, judging, session
//!   write), `mesh/batch_session.rs` reads and writes the batch's session
//!   memory, `mesh/result_reads.rs` hands judged results on, and
//!   `mesh/record.rs` is the batch's record: it takes the outcome once and
//!   emits metrics, logs, spans and the decision record;
//!   `mesh/interceptor_chain.rs` the chain seen as MCP interceptors.
//! * [`session`]: session memory (R34), per caller and session, bounded,
//!   keyed digests of the values seen; in memory, in etcd or in Redis.
//! * [`registry`]: where registrations live, behind the [`Registry`] trait:
//!   in memory, or shared by replicas in [`registry::etcd`] (one file per
//!   concern in `registry/etcd/`). A registration is checked and compiled in
//!   `registry/spec.rs` and admitted in [`registry::registration`], the one
//!   place it is checked (R16); `admit` above is a batch's admission stage.
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
//! * [`secret_formats`]: common secret formats, masked in records and
//!   redacted by the redaction guard.
//! * [`config`]: the TOML config file (one file per table in `config/`,
//!   each key declared once in its table's type), its key reference and
//!   `config check`; [`files`]: reading the small files a config names;
//!   [`etcd_tls`]: TLS to etcd.
//! * [`run`]: [`Server`], the mesh assembled from a config (registry,
//!   decision log, policy watch and reload, metrics endpoint) and run until
//!   shutdown: what `guardmesh serve` and the integration tests both run.
//!
//! The modules are layered: no module imports one that imports it back
//! (`scripts/check-import-cycles`); telemetry (`observe`) imports none of
//! the others but `accept`, the leaf that paces failed accepts for every
//! listener.

mod accept;
mod admit;
pub mod approval;
pub mod config;
pub mod decision_log;
pub mod etcd_tls;
pub mod files;
pub mod grpc;
mod judge;
pub mod link;
pub mod mesh;
pub mod observe;
pub mod policy;
pub mod registry;
pub mod run;
pub mod secret_formats;
pub mod security;
pub mod session;
mod validate;
mod wire;

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
