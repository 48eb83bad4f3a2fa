//! `guardmesh conformance`: checks a running guard, written in any language,
//! against the `GuardService.Judge` protocol (see [`conformance`] for the
//! checks).
//!
//! A crate of its own, apart from the operator commands of the product
//! binary; `guardmesh conformance` is a thin subcommand over [`run`] and
//! [`Report::render`]. [`batch_file`] is the batch input both it and
//! `guardmesh evaluate` read.

pub mod batch_file;
pub mod conformance;

pub use conformance::{CONCURRENT_BATCHES, Check, ConformanceArgs, Report, Role, Status, run};
