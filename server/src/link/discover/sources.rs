//! The replica set of one registered guard (R32): the union of each of
//! its registered targets (an address is itself, a DNS name is every
//! address it resolves to, followed over time) and the replicas the
//! registry's heartbeats announce.
//!
//! The registered list changes when the guard is registered again; the
//! per-target watches of the targets still listed are kept (a name is not
//! resolved anew, its addresses stay), and so is the heartbeat source, so
//! a new list drains only the replicas that really left.

use super::dns::{self, Resolve, ResolveHandle};
use super::{Replicas, fixed, union};
use crate::link::dial::EndpointPolicy;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How a guard's registered names are followed.
#[derive(Clone)]
pub struct NameSettings {
    /// The endpoint policy every resolved address is held to.
    pub policy: Arc<EndpointPolicy>,
    /// How often a name is resolved again.
    pub interval: Duration,
    pub resolver: Arc<dyn Resolve>,
}

impl std::fmt::Debug for NameSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NameSettings")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// One registered target's watch.
struct TargetWatch {
    replicas: Replicas,
    /// For a name: asks it to be resolved again.
    resolve: Option<ResolveHandle>,
}

/// Where one guard's replicas come from.
pub struct GuardSources {
    guard: String,
    /// `None`: registered names are dialed as written, one replica each.
    names: Option<NameSettings>,
    registered: Vec<String>,
    watches: HashMap<String, TargetWatch>,
    announced: Option<Replicas>,
}

impl std::fmt::Debug for GuardSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardSources")
            .field("guard", &self.guard)
            .field("registered", &self.registered)
            .field("announced", &self.announced.is_some())
            .finish()
    }
}

impl GuardSources {
    /// The sources of guard `guard`: its registered targets (set with
    /// [`Self::relist`]), names followed with `names`, and the heartbeat
    /// source `announced`, if the registry has one.
    pub fn new(guard: &str, names: Option<NameSettings>, announced: Option<Replicas>) -> Self {
        Self {
            guard: guard.to_owned(),
            names,
            registered: Vec::new(),
            watches: HashMap::new(),
            announced,
        }
    }

    /// The registered targets, as last listed.
    pub fn registered(&self) -> &[String] {
        &self.registered
    }

    /// Makes `endpoints` the registered targets and returns the union of
    /// every source to follow from now on. The watches of targets still
    /// listed are kept; the others end with their last reader. Must be
    /// called within a tokio runtime.
    pub fn relist(&mut self, endpoints: &[String]) -> Replicas {
        let mut registered: Vec<String> = Vec::with_capacity(endpoints.len());
        for endpoint in endpoints {
            if !registered.contains(endpoint) {
                registered.push(endpoint.clone());
            }
        }
        let mut watches = HashMap::with_capacity(registered.len());
        for endpoint in &registered {
            let watch = match self.watches.remove(endpoint) {
                Some(kept) => kept,
                None => self.watch(endpoint),
            };
            watches.insert(endpoint.clone(), watch);
        }
        self.watches = watches;
        self.registered = registered;
        let mut all: Vec<Replicas> = self
            .registered
            .iter()
            .filter_map(|e| self.watches.get(e))
            .map(|w| w.replicas.clone())
            .collect();
        all.extend(self.announced.clone());
        union(all)
    }

    /// The handle that asks registered name `registered` to be resolved
    /// again, while it is listed.
    pub fn resolver(&self, registered: &str) -> Option<ResolveHandle> {
        self.watches.get(registered)?.resolve.clone()
    }

    fn watch(&self, endpoint: &str) -> TargetWatch {
        let as_written = || TargetWatch {
            replicas: fixed([endpoint.to_owned()]),
            resolve: None,
        };
        let Some(names) = &self.names else {
            return as_written();
        };
        match dns::parse_endpoint(endpoint) {
            Ok(parsed) if parsed.literal.is_none() => {}
            // An address, or what admission let through that this cannot
            // read: dialed as written, as before R32.
            _ => return as_written(),
        }
        match dns::watch_name(&self.guard, endpoint, names) {
            Ok((replicas, handle)) => TargetWatch {
                replicas,
                resolve: Some(handle),
            },
            Err(_) => as_written(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::discover::ReplicaTarget;
    use futures::future::BoxFuture;
    use std::net::IpAddr;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::sync::watch;

    /// Resolves every name to 127.0.0.2 and 127.0.0.3, counting lookups.
    struct Two(AtomicU64);

    impl Resolve for Two {
        fn lookup<'a>(&'a self, _: &'a str, _: u16) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Box::pin(async {
                Ok(vec![
                    "127.0.0.3".parse().unwrap(),
                    "127.0.0.2".parse().unwrap(),
                ])
            })
        }
    }

    fn endpoints(rx: &Replicas) -> Vec<String> {
        rx.borrow().iter().map(|t| t.endpoint.clone()).collect()
    }

    async fn until(rx: &mut Replicas, want: &[&str]) {
        for _ in 0..50 {
            if endpoints(rx) == want {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
        }
        assert_eq!(endpoints(rx), want);
    }

    #[tokio::test(start_paused = true)]
    async fn r32_a_guard_is_its_targets_its_names_addresses_and_its_announced_replicas() {
        let resolver = Arc::new(Two(AtomicU64::new(0)));
        let (heartbeats, announced) =
            watch::channel::<Arc<[ReplicaTarget]>>(Arc::from(vec![ReplicaTarget::new(
                "http://127.0.0.7:1",
            )]));
        let mut sources = GuardSources::new(
            "g",
            Some(NameSettings {
                policy: Arc::new(EndpointPolicy::default()),
                interval: Duration::from_secs(3600),
                resolver: resolver.clone(),
            }),
            Some(announced),
        );
        let mut rx = sources.relist(&[
            "http://guard.test:1".to_string(),
            "http://127.0.0.9:1".to_string(),
        ]);
        // Not blocked on the resolution: the name itself first.
        assert_eq!(
            endpoints(&rx),
            [
                "http://guard.test:1",
                "http://127.0.0.9:1",
                "http://127.0.0.7:1"
            ]
        );
        until(
            &mut rx,
            &[
                "http://127.0.0.2:1",
                "http://127.0.0.3:1",
                "http://127.0.0.9:1",
                "http://127.0.0.7:1",
            ],
        )
        .await;
        let first = rx.borrow()[0].clone();
        assert_eq!(first.registered.as_deref(), Some("http://guard.test:1"));
        assert_eq!(rx.borrow()[2].registered, None);
        assert!(sources.resolver("http://guard.test:1").is_some());
        assert!(sources.resolver("http://127.0.0.9:1").is_none());
        assert_eq!(resolver.0.load(Ordering::Relaxed), 1);
        // A new list without the address: the name's addresses and the
        // announced replicas are there at once, the name not resolved anew.
        let rx = sources.relist(&["http://guard.test:1".to_string()]);
        assert_eq!(
            endpoints(&rx),
            [
                "http://127.0.0.2:1",
                "http://127.0.0.3:1",
                "http://127.0.0.7:1"
            ]
        );
        assert_eq!(sources.registered(), ["http://guard.test:1"]);
        assert_eq!(resolver.0.load(Ordering::Relaxed), 1);
        // The announced replicas follow their source in the new union.
        let mut rx = rx;
        heartbeats.send_replace(Arc::from(Vec::new()));
        until(&mut rx, &["http://127.0.0.2:1", "http://127.0.0.3:1"]).await;
    }

    #[tokio::test(start_paused = true)]
    async fn r32_without_name_settings_a_name_is_one_replica_dialed_as_written() {
        let mut sources = GuardSources::new("g", None, None);
        let rx = sources.relist(&["http://guard.test:1".to_string()]);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(endpoints(&rx), ["http://guard.test:1"]);
        assert_eq!(rx.borrow()[0].registered, None);
    }
}
