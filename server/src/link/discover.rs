//! Where a guard's replicas are (R32).
//!
//! A guard's endpoint names a service: one address, a DNS name whose
//! addresses change over time, or a list of replicas, which may also join
//! and leave through the registry's heartbeats. Whatever the source, the
//! links see one thing: a [`Replicas`] watch holding the replica targets
//! the mesh should keep a link to right now. A source publishes a new set
//! when it changes; the guard's pool opens links to new targets and drains
//! the ones that left.

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::sync::Arc;
use tokio::sync::watch;

pub mod dns;
pub mod sources;

/// One replica the mesh may send a guard's requests to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplicaTarget {
    /// What is dialed, in the form a single-address registration's
    /// `endpoint` takes (`http://host:port`, `https://host:port`).
    pub endpoint: String,
    /// The registered endpoint this target was found from, when that is a
    /// DNS name (the name's own endpoint, or one of its addresses): over
    /// TLS the replica must present that name (or the pinned identity),
    /// and a failed connection to it asks the name to be resolved again.
    /// `None` for an address as registered or announced.
    pub registered: Option<String>,
}

impl ReplicaTarget {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            registered: None,
        }
    }

    /// A target found from the registered name endpoint `registered`.
    pub fn of_name(endpoint: impl Into<String>, registered: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            registered: Some(registered.into()),
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

/// One replica set of several sources (R32): every target any of them
/// holds, each once, in the order of the sources. The registry gives a
/// guard's heartbeat-announced replicas and its registration gives its own
/// endpoint (an address, a name's addresses, or a list); the guard's
/// replicas are both. A source that ends keeps its last set in the union;
/// the union's task ends with its last reader, or when every source ended.
/// Must be called within a tokio runtime.
pub fn union(sources: Vec<Replicas>) -> Replicas {
    let mut sources = sources;
    let mut latest: Vec<Arc<[ReplicaTarget]>> = sources
        .iter_mut()
        .map(|rx| rx.borrow_and_update().clone())
        .collect();
    let (tx, rx) = watch::channel(merge(&latest));
    let mut pending: FuturesUnordered<_> = sources
        .into_iter()
        .enumerate()
        .map(|(i, rx)| next_change(i, rx))
        .collect();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                next = pending.next() => match next {
                    None => return,
                    Some((i, mut source, true)) => {
                        latest[i] = source.borrow_and_update().clone();
                        let next = merge(&latest);
                        tx.send_if_modified(|current| {
                            let changed = *current != next;
                            if changed {
                                *current = next;
                            }
                            changed
                        });
                        pending.push(next_change(i, source));
                    }
                    // That source ended: its last set stays.
                    Some((_, _, false)) => {}
                },
                () = tx.closed() => return,
            }
        }
    });
    rx
}

fn next_change(
    i: usize,
    mut rx: Replicas,
) -> futures::future::BoxFuture<'static, (usize, Replicas, bool)> {
    Box::pin(async move {
        let live = rx.changed().await.is_ok();
        (i, rx, live)
    })
}

fn merge(sets: &[Arc<[ReplicaTarget]>]) -> Arc<[ReplicaTarget]> {
    let mut seen = std::collections::HashSet::new();
    sets.iter()
        .flat_map(|set| set.iter())
        .filter(|t| seen.insert(t.endpoint.as_str()))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn endpoints(rx: &Replicas) -> Vec<String> {
        rx.borrow().iter().map(|t| t.endpoint.clone()).collect()
    }

    #[tokio::test]
    async fn r32_a_union_holds_every_source_once_and_follows_each() {
        let (heartbeats, announced) = watch::channel::<Arc<[ReplicaTarget]>>(Arc::from(vec![
            ReplicaTarget::new("http://127.0.0.3:1"),
            ReplicaTarget::new("http://127.0.0.2:1"),
        ]));
        let mut rx = union(vec![fixed(["http://127.0.0.2:1".to_string()]), announced]);
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:1", "http://127.0.0.3:1"]);
        heartbeats.send_replace(Arc::from(vec![ReplicaTarget::new("http://127.0.0.4:1")]));
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:1", "http://127.0.0.4:1"]);
        // Every announced replica left: the registration's own stays (R15).
        heartbeats.send_replace(Arc::from(Vec::new()));
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:1"]);
        // The source ends: its last set stays, and the union ends too.
        drop(heartbeats);
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:1"]);
    }

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
