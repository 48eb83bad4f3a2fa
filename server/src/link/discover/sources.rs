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
        match dns::watch_name(
            &self.guard,
            endpoint,
            names.policy.clone(),
            names.interval,
            names.resolver.clone(),
        ) {
            Ok((replicas, handle)) => TargetWatch {
                replicas,
                resolve: Some(handle),
            },
            Err(_) => as_written(),
        }
    }
}
