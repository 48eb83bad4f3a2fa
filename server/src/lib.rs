//! guardmesh: a gRPC guard mesh for AI agent tool calls.
//!
//! A coordinator streams each round of tool calls (a *batch*) to the mesh's
//! `PreToolService`; the mesh fans it out to the registered *guards* and folds
//! their verdicts into one decision per call, under the rules of SPEC.md.
//!
//! The modules, from the wire inwards:
//!
//! * [`server`]: `run(listener, mesh, shutdown)`, the gRPC server with health
//!   and reflection, and the layers around the services.
//! * [`service`]: `PreToolService` (coordinators) and `GuardRegistry`.
//! * [`batch`]: judging one batch: mutate guards in order, validate guards
//!   concurrently, decisions and traces.
//! * [`fold`]: the pure fold that makes concurrent verdicts equal sequential
//!   ones (R3, R4, R5).
//! * [`link`]: one long-lived `Judge` stream per guard, with reconnects.
//! * [`mesh`]: the mesh's settings, its registry and chain snapshots (R17).
//! * [`registry`]: where registrations live, behind a small trait.
//! * [`spec`]: a registration checked and compiled.
//! * [`validate`]: refusing bad batches before any guard sees them (R20).
//! * [`config`]: the TOML config file.
//! * [`metrics`]: counters and histograms in the Prometheus text format;
//!   [`metrics_http`] serves them.
//! * [`telemetry`]: logs (and traces).
//! * [`examples`]: example guards written with the Rust SDK.
//! * [`demo`]: the self-contained demo behind `guardmesh demo`.

pub mod batch;
pub mod config;
pub mod demo;
pub mod examples;
pub mod fold;
pub mod link;
pub mod mesh;
pub mod metrics;
pub mod metrics_http;
pub mod registry;
pub mod server;
pub mod service;
pub mod spec;
pub mod telemetry;
pub mod validate;

pub use batch::TraceContext;
pub use mesh::{Mesh, MeshConfig};
pub use registry::{MemoryRegistry, Registry};
