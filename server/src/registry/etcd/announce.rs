//! Replica announcements (R32): the replicas of a guard that heartbeats
//! announce under `<prefix>/replicas/`, each held to the endpoint policy.

use super::view::View;
use super::{EtcdRegistry, Shared};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tokio::sync::watch;

impl EtcdRegistry {
    /// The replicas of guard `name` that heartbeats announce (R32), each
    /// held to `policy` as a registered endpoint is (an address that is
    /// malformed, ambiguous or refused is left out, logged and counted in
    /// [`Self::replicas_refused`]), at most
    /// [`MAX_ADDRESSES_PER_NAME`](crate::link::discover::dns::MAX_ADDRESSES_PER_NAME)
    /// of them. The set follows the replicas' leases: a replica whose
    /// heartbeat ends leaves it, the others stay. These are in addition to
    /// the registration's own endpoint (join them with
    /// [`crate::link::discover::union`]), so a guard whose announced
    /// replicas all left keeps its registered endpoint and stays in the
    /// chain (R15). Must be called within a tokio runtime; the task ends
    /// with the last reader or with the registry.
    pub fn replicas(
        &self,
        name: &str,
        policy: Arc<crate::link::dial::EndpointPolicy>,
    ) -> crate::link::discover::Replicas {
        let mut all = self.shared.announced.subscribe();
        let filter = AnnouncedFilter {
            guard: name.trim().to_owned(),
            policy,
            refused: self.shared.replicas_refused.clone(),
        };
        let mut raw = all.borrow_and_update().get(&filter.guard).cloned();
        let (tx, rx) = watch::channel(filter.apply(raw.as_ref()));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = all.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let next = all.borrow_and_update().get(&filter.guard).cloned();
                        if next == raw {
                            continue;
                        }
                        raw = next;
                        let targets = filter.apply(raw.as_ref());
                        tx.send_if_modified(|current| {
                            let changed = *current != targets;
                            if changed {
                                *current = targets;
                            }
                            changed
                        });
                    }
                    () = tx.closed() => return,
                }
            }
        });
        rx
    }

    /// Announced replica addresses the endpoint policy refused (R32).
    pub fn replicas_refused(&self) -> u64 {
        self.shared
            .replicas_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Shared {
    /// Publishes the announced replicas when they changed.
    pub(super) fn publish_replicas(&self, view: &View) {
        let next: BTreeMap<String, BTreeSet<String>> = view
            .replicas
            .iter()
            .map(|(name, set)| (name.clone(), set.values().cloned().collect()))
            .collect();
        self.announced.send_if_modified(|current| {
            if **current == next {
                return false;
            }
            *current = Arc::new(next);
            true
        });
    }
}

/// Holds one guard's announced addresses to the endpoint policy.
struct AnnouncedFilter {
    guard: String,
    policy: Arc<crate::link::dial::EndpointPolicy>,
    refused: Arc<std::sync::atomic::AtomicU64>,
}

impl AnnouncedFilter {
    fn apply(
        &self,
        addresses: Option<&BTreeSet<String>>,
    ) -> Arc<[crate::link::discover::ReplicaTarget]> {
        use crate::link::discover::{ReplicaTarget, dns};
        let mut targets = Vec::new();
        for address in addresses.into_iter().flatten() {
            let checked = dns::parse_endpoint(address)
                .map_err(|e| e.to_string())
                .and_then(|p| {
                    match p.literal {
                        Some(ip) => self.policy.check_ip(ip, None),
                        None => self.policy.check_host(&p.host),
                    }
                    .map_err(|e| e.to_string())?;
                    Ok(format!(
                        "{}://{}",
                        p.scheme,
                        match p.literal {
                            Some(ip) => std::net::SocketAddr::new(ip, p.port).to_string(),
                            None => format!("{}:{}", p.host, p.port),
                        }
                    ))
                });
            match checked {
                Ok(endpoint) if targets.len() < dns::MAX_ADDRESSES_PER_NAME => {
                    targets.push(ReplicaTarget::new(endpoint));
                }
                Ok(_) => {
                    tracing::warn!(guard = %self.guard, address, "etcd registry: more announced replicas than a guard may have; left out");
                }
                Err(why) => {
                    self.refused
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(guard = %self.guard, address, %why, "etcd registry: announced replica refused by the endpoint policy; it is not dialed");
                }
            }
        }
        targets.dedup();
        targets.into()
    }
}
