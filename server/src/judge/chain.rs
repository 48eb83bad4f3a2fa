//! What a batch is judged against: one consistent view of the chain (R17),
//! each guard with its link, and what becomes of a call no enforced guard
//! applies to (R28). The mesh builds the snapshots ([`crate::mesh`]); the
//! judge only reads them.

use crate::link::pool::GuardPool;
use crate::registry::ChainSpec;
use crate::registry::spec::Guard;
use std::sync::Arc;

/// A guard of a chain snapshot and its link: the pool of its replicas'
/// links (R32; one for a single-address guard). A policy guard (R27) has
/// no link: it is judged inside the mesh.
#[derive(Debug)]
pub struct ChainGuard {
    pub guard: Arc<Guard>,
    pub link: Option<Arc<GuardPool>>,
}

/// One consistent view of the chain (R17).
#[derive(Debug)]
pub struct Chain {
    pub revision: u64,
    pub guards: Vec<ChainGuard>,
    /// The registry's chain this snapshot was built from.
    pub(crate) spec: Arc<ChainSpec>,
}

/// What the mesh does with a call that no enforced guard applies to (R28).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unguarded {
    /// It proceeds, as a sequential chain would (the default).
    #[default]
    Proceed,
    /// It is cancelled with content naming its tool (default deny).
    Cancel,
}
