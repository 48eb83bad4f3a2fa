//! Rust SDK for guardmesh.
//!
//! Two audiences, one crate:
//!
//! * **Coordinators** (agent loops, feature `coordinator`): a [`Coordinator`]
//!   connects to a mesh, opens one [`Session`] stream per agent session and
//!   evaluates each round of tool calls (a [`Batch`]) into a typed
//!   [`BatchDecision`], one [`CallDecision`] per call. A round with no calls
//!   is answered locally, without any RPC (R1). A [`Registrar`] registers
//!   guards with a mesh. Both connect through one [`Connection`] (TLS, mTLS,
//!   token), to an address given as `host:port` or as a URL, checked
//!   before it is dialed; [`Coordinator::builder`] adds a connect timeout
//!   and retries. A [`Session`] opens a new stream after the mesh
//!   restarts; batches in flight then fail with
//!   [`ClientError::NotJudged`]. `client/examples/coordinator.rs` is a
//!   whole agent loop.
//! * **Guard authors** (feature `guard`): implement [`Guard`] (a guard only
//!   says what it objects to: proceeding is the default), then either add
//!   [`GuardServer::into_service`] to your own tonic server or run it alone
//!   with [`serve`], which adds gRPC health and reflection. [`verdict`] has
//!   the constructors for steer, cancel and rewrite verdicts.
//!
//! [`casefold`] tells which member names Go's `encoding/json` takes for
//! one (`path` and `PATH`, `s` and `ſ`), for whoever must refuse them.
//!
//! [`trace`] carries W3C trace context (R22) from the coordinator's span
//! into the mesh and from each batch into the guard's span.
//!
//! The wire types are re-exported as [`proto`], and tonic's [`Status`] and
//! [`Code`], so that guards and coordinators need no direct tonic
//! dependency. This crate does not depend on the mesh server.
//!
//! Features (all on by default): `coordinator` (tonic's client transport
//! only: no hyper server, axum, health or reflection), `guard` (the guard
//! server), `otel` (trace context from and into OpenTelemetry spans), `tls`
//! (rustls with ring, on either side). Off by default: `args`, the clap
//! flags that say how a command reaches a mesh (`args::MeshArgs`), as the
//! `guardmesh` commands and the MCP gateway read them; `listener`, the
//! hardening of a TCP listener (the pause between failed accepts, the
//! open-file limit) that the mesh and the MCP gateway share
//! (`listener`).

#![deny(missing_docs)]

#[cfg(feature = "coordinator")]
pub mod approver;
#[cfg(feature = "args")]
pub mod args;
#[cfg(feature = "coordinator")]
pub mod builder;
pub mod casefold;
#[cfg(feature = "coordinator")]
pub mod connect;
#[cfg(feature = "coordinator")]
pub mod coordinator;
#[cfg(feature = "coordinator")]
pub mod error;
#[cfg(feature = "guard")]
pub mod guard;
#[cfg(feature = "listener")]
pub mod listener;
#[cfg(feature = "coordinator")]
pub mod registry;
pub mod trace;
pub mod verdict;

#[cfg(feature = "coordinator")]
pub use approver::Approver;
#[cfg(feature = "args")]
pub use args::{MeshArgs, MeshArgsError};
#[cfg(feature = "coordinator")]
pub use builder::CoordinatorBuilder;
#[cfg(feature = "coordinator")]
pub use connect::{Connection, Credentials, Tls};
#[cfg(feature = "coordinator")]
pub use coordinator::{
    Batch, BatchDecision, CallDecision, Coordinator, Outcome, ResultDecision, ResultOutcome,
    Session,
};
#[cfg(feature = "coordinator")]
pub use error::ClientError;
#[cfg(feature = "guard")]
pub use guard::{Guard, GuardServer, ServeError, ServerTls, serve};
pub use guardmesh_proto::v1 as proto;
/// The bounds of a `PreToolService.AlwaysSkipped` request (tool visibility).
pub use guardmesh_proto::{ALWAYS_SKIPPED_MAX_NAME_BYTES, ALWAYS_SKIPPED_MAX_TOOLS};
pub use proto::TraceStatus;
#[cfg(feature = "coordinator")]
pub use registry::{Registrar, Registration};
pub use tonic::{Code, Status};

/// The largest message the SDK's clients and guard server send or accept,
/// either way: 64 MiB.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
