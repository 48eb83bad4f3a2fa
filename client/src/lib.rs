//! Rust SDK for guardmesh.
//!
//! Two audiences, one crate:
//!
//! * **Coordinators** (agent loops): [`coordinator`] connects to a mesh,
//!   opens one stream per agent session and evaluates each round of tool
//!   calls into typed [`coordinator::Decision`]s. A round with no calls is
//!   answered locally, without any RPC (R1).
//! * **Guard authors**: implement [`guard::Guard`] (a guard only says what it
//!   objects to: proceeding is the default) and serve it with
//!   [`guard::serve`], which adds gRPC health and reflection. [`verdict`] has
//!   the constructors for steer, cancel and rewrite verdicts, and
//!   [`registry`] registers a guard with a mesh.
//!
//! [`trace`] carries W3C trace context (R22) from the coordinator's span
//! into the mesh and from each batch into the guard's span.
//!
//! The wire types are re-exported as [`proto`]. This crate does not depend on
//! the mesh server.

pub mod connect;
pub mod coordinator;
pub mod error;
pub mod guard;
pub mod registry;
pub mod trace;
pub mod verdict;

pub use connect::{Connection, Credentials, Tls};
pub use coordinator::{Batch, CallOutcome, Coordinator, Decision, Outcome, Session};
pub use error::ClientError;
pub use guard::{Guard, serve};
pub use guardmesh_proto::v1 as proto;
pub use registry::{Registrar, Registration};
