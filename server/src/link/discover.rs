//! Where a guard's replicas are (R32).
//!
//! A guard's endpoint names a service: one address, a DNS name whose
//! addresses change over time, or a list of replicas, which may also join
//! and leave through the registry's heartbeats. Whatever the source, the
//! links see one thing: a [`Replicas`] watch holding the replica targets
//! the mesh should keep a link to right now. A source publishes a new set
//! when it changes; the guard's pool opens links to new targets and drains
//! the ones that left.

use std::sync::Arc;
use tokio::sync::watch;

/// One replica the mesh may send a guard's requests to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplicaTarget {
    /// What is dialed, in the form a single-address registration's
    /// `endpoint` takes (`http://host:port`, `https://host:port`).
    pub endpoint: String,
}

impl ReplicaTarget {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
        }
    }
}

/// The current replica set of one guard, as its sources see it.
pub type Replicas = watch::Receiver<Arc<[ReplicaTarget]>>;

/// A replica set that never changes (one address, or a fixed list).
pub fn fixed(endpoints: impl IntoIterator<Item = String>) -> Replicas {
    let targets: Arc<[ReplicaTarget]> = endpoints.into_iter().map(ReplicaTarget::new).collect();
    let (tx, rx) = watch::channel(targets);
    // The sender goes: readers keep the last value, and `changed()` ends.
    drop(tx);
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r32_a_fixed_set_holds_its_targets_in_order() {
        let rx = fixed([
            "http://127.0.0.2:1".to_string(),
            "http://127.0.0.3:1".to_string(),
        ]);
        let now = rx.borrow().clone();
        assert_eq!(
            now.iter().map(|t| t.endpoint.as_str()).collect::<Vec<_>>(),
            ["http://127.0.0.2:1", "http://127.0.0.3:1"]
        );
    }
}
