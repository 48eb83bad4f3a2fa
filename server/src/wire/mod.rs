//! The protobuf wire where the mesh reads or writes it by hand, on hot
//! paths, rather than through prost's generated code: in one place.
//!
//! * `fields`: every field number read or written by hand, declared once
//!   per message, each checked by a test against the generated types.
//! * `read`: scanning fields without decoding them (varints, keys,
//!   length-delimited values, skipping); what the inbound scan of a batch
//!   (`grpc/inbound.rs`, R20) and the scan of guards' answers (R23) read.
//! * `write`: writing a field by hand as prost writes it, and its length;
//!   what the session memory sent to guards (`session/view.rs`, R34), the
//!   results sent to guards (`judge/results_phase.rs`, R33) and the parts of a
//!   batch encoded once are written with.
//! * `judge_stream`: the `Judge` stream's codec on the mesh's side:
//!   requests written once and shared by guards, answers scanned for
//!   unknown verdict fields (R23); reached as `link::wire`.
//!
//! This module imports none of the mesh's other modules.

pub(crate) mod fields;
pub mod judge_stream;
pub(crate) mod read;
pub(crate) mod write;
