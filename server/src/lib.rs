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
//! * [`etcd`]: the registry shared by several replicas, kept in etcd.
//! * [`spec`]: a registration checked and compiled.
//! * [`validate`]: refusing bad batches before any guard sees them (R20);
//!   [`inbound`]: checking sizes and counts before a batch is decoded.
//! * [`tls`], [`auth`]: TLS/mTLS on the listener, identities and roles;
//!   [`dial`]: the endpoint policy and TLS towards guards; [`certs`]: a
//!   local CA for development.
//! * [`config`]: the TOML config file.
//! * [`metrics`]: counters and histograms in the Prometheus text format;
//!   [`metrics_http`] serves them.
//! * [`telemetry`]: logs (and traces).
//! * [`examples`]: example guards written with the Rust SDK.
//! * [`conformance`]: `guardmesh conformance`, which checks a running guard
//!   of any language against the `Judge` protocol.
//! * [`demo`]: the self-contained demo behind `guardmesh demo`.
//! * [`bench`]: `guardmesh bench`, the mesh against direct guard calls on
//!   loopback (latency, throughput, CPU, memory).

pub mod auth;
pub mod batch;
pub mod bench;
pub mod certs;
pub mod config;
pub mod conformance;
pub mod demo;
pub mod dial;
pub mod etcd;
pub mod examples;
pub mod fold;
pub mod inbound;
pub mod link;
pub mod mesh;
pub mod metrics;
pub mod metrics_http;
pub mod policy;
pub mod registry;
pub mod server;
pub mod service;
pub mod spec;
pub mod telemetry;
pub mod tls;
pub mod validate;

pub use batch::TraceContext;
pub use mesh::{Mesh, MeshConfig};
pub use registry::{MemoryRegistry, Registry};
