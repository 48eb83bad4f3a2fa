//! Where the chain's registrations live.
//!
//! The mesh talks to its registry through the small [`Registry`] trait so that
//! the store can change (the embedded in-memory registry today, a shared store
//! for several replicas later) without touching the fold. A registry only
//! keeps *registrations*: whether a guard is reachable is the link's business,
//! never the registry's (R15: liveness does not remove policy).

pub mod etcd;
pub mod registration;
pub(crate) mod spec;

pub use registration::{
    Admission, AdmitError, CheckedGuard, Owner, QuotaError, admit, admit_blocking,
};

use crate::registry::spec::{Guard, SpecError};
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The registrations in chain order at one revision (R17).
#[derive(Debug, Default)]
pub struct ChainSpec {
    pub revision: u64,
    /// In chain order: by priority, then by registration order.
    pub guards: Vec<Arc<Guard>>,
}

/// Result of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    pub revision: u64,
    pub position: usize,
    pub created: bool,
}

/// Result of a deregistration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deregistered {
    pub revision: u64,
    pub removed: bool,
}

/// Why the registry refused or could not serve a request.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Invalid(#[from] SpecError),
    /// The registering identity is at its quota (RESOURCE_EXHAUSTED).
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error("registry store unavailable: {0}")]
    Unavailable(String),
}

/// The store of registrations.
pub trait Registry: Send + Sync + 'static {
    /// The current chain. Cheap: called at the start of every batch.
    fn chain(&self) -> Arc<ChainSpec>;
    /// Adds a guard, or updates the one with the same name in place (R16).
    /// The guard was checked once, by [`admit`]; the registry does not
    /// check it again. With an `owner`, the registry checks and counts the
    /// owner's quota in the same step (R25), and the guard is the owner's
    /// until deregistered (or registered by another identity).
    fn register(
        &self,
        guard: CheckedGuard,
        owner: Option<Owner>,
    ) -> BoxFuture<'_, Result<Registered, RegistryError>>;
    /// Removes a guard by name, and frees its place in its owner's quota.
    fn deregister(&self, name: String) -> BoxFuture<'_, Result<Deregistered, RegistryError>>;
    /// Whether the chain may be used to judge a batch right now. A shared
    /// store that has been unreachable for longer than its staleness window
    /// answers `Err(Unavailable)`, and the batch is refused with UNAVAILABLE
    /// rather than judged with a chain the mesh can no longer trust.
    fn check(&self) -> Result<(), RegistryError> {
        Ok(())
    }
    /// How long the chain has gone unconfirmed by its store (a shared store
    /// that is unreachable); `None` when it is current.
    fn staleness(&self) -> Option<std::time::Duration> {
        None
    }
    /// The replicas of guard `name` that join and leave through the
    /// registry's heartbeats (R32), held to `policy`; `None` for a registry
    /// without heartbeats. They add to the registration's own endpoint.
    fn announced_replicas(
        &self,
        name: &str,
        policy: Arc<crate::link::dial::EndpointPolicy>,
    ) -> Option<crate::link::discover::Replicas> {
        let _ = (name, policy);
        None
    }
}

/// One registration and its registration order.
#[derive(Debug)]
struct Entry {
    seq: u64,
    guard: Arc<Guard>,
}

#[derive(Debug, Default)]
struct State {
    next_seq: u64,
    revision: u64,
    entries: Vec<Entry>,
    /// Guard name -> the identity that registered it (R25 quotas).
    owners: HashMap<String, String>,
}

impl State {
    /// Orders the chain after a change and returns its new snapshot.
    fn rebuild(&mut self) -> ChainSpec {
        self.revision += 1;
        self.entries
            .sort_by_key(|entry| (entry.guard.priority, entry.seq));
        ChainSpec {
            revision: self.revision,
            guards: self.entries.iter().map(|e| e.guard.clone()).collect(),
        }
    }

    /// Checks `owner`'s quota for `guard` against what it owns now.
    fn admits(&self, owner: &Owner, guard: &Guard) -> Result<(), QuotaError> {
        let mut owned = 0;
        let mut used = 0usize;
        let mut already = false;
        for (name, identity) in &self.owners {
            if *identity != owner.identity {
                continue;
            }
            if *name == guard.name {
                already = true;
                continue;
            }
            owned += 1;
            if let Some(entry) = self.entries.iter().find(|e| e.guard.name == *name) {
                used = used.saturating_add(registration::policy_bytes(&entry.guard));
            }
        }
        owner.admits(guard, owned, already, used)
    }
}

/// The embedded registry: in memory, seeded from the config file. Needs
/// nothing installed; loses runtime registrations on restart.
#[derive(Debug)]
pub struct MemoryRegistry {
    default_timeout: Duration,
    /// Writers serialize on this lock.
    state: Mutex<State>,
    /// What every batch reads, without taking the lock.
    chain: arc_swap::ArcSwap<ChainSpec>,
}

impl MemoryRegistry {
    /// `default_timeout`: the mesh's default guard timeout, which the
    /// guards admitted for this registry were given (see [`Admission`]).
    pub fn new(default_timeout: Duration) -> Self {
        Self {
            default_timeout,
            state: Mutex::new(State::default()),
            chain: arc_swap::ArcSwap::from_pointee(ChainSpec::default()),
        }
    }

    /// The default guard timeout it was made with.
    pub fn default_timeout(&self) -> Duration {
        self.default_timeout
    }

    fn apply(
        &self,
        checked: CheckedGuard,
        owner: Option<Owner>,
    ) -> Result<Registered, RegistryError> {
        let guard = checked.guard().clone();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(owner) = &owner {
            state.admits(owner, &guard)?;
        }
        let name = guard.name.clone();
        let created = match state.entries.iter_mut().find(|e| e.guard.name == name) {
            Some(entry) => {
                entry.guard = guard;
                false
            }
            None => {
                let seq = state.next_seq;
                state.next_seq += 1;
                state.entries.push(Entry { seq, guard });
                true
            }
        };
        if let Some(owner) = owner {
            state.owners.insert(name.clone(), owner.identity);
        }
        self.chain.store(Arc::new(state.rebuild()));
        let position = state
            .entries
            .iter()
            .position(|e| e.guard.name == name)
            .unwrap_or_default();
        Ok(Registered {
            revision: state.revision,
            position,
            created,
        })
    }
}

impl Registry for MemoryRegistry {
    fn chain(&self) -> Arc<ChainSpec> {
        self.chain.load_full()
    }

    fn register(
        &self,
        guard: CheckedGuard,
        owner: Option<Owner>,
    ) -> BoxFuture<'_, Result<Registered, RegistryError>> {
        Box::pin(async move { self.apply(guard, owner) })
    }

    fn deregister(&self, name: String) -> BoxFuture<'_, Result<Deregistered, RegistryError>> {
        Box::pin(async move {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let before = state.entries.len();
            state.entries.retain(|e| e.guard.name != name);
            state.owners.remove(&name);
            let removed = state.entries.len() != before;
            if removed {
                self.chain.store(Arc::new(state.rebuild()));
            }
            Ok(Deregistered {
                revision: state.revision,
                removed,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::GuardSpec;

    fn admission() -> Admission {
        Admission {
            default_timeout: Duration::from_secs(1),
            endpoint_policy: Arc::default(),
        }
    }

    fn spec(name: &str, priority: i32) -> CheckedGuard {
        checked(GuardSpec {
            name: name.into(),
            endpoint: "127.0.0.1:1".into(),
            priority,
            ..Default::default()
        })
    }

    fn checked(spec: GuardSpec) -> CheckedGuard {
        admit_blocking(spec, &admission()).unwrap()
    }

    fn names(r: &MemoryRegistry) -> Vec<String> {
        r.chain().guards.iter().map(|g| g.name.clone()).collect()
    }

    #[tokio::test]
    async fn r16_update_in_place_keeps_position() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        for n in ["a", "b", "c"] {
            assert!(r.register(spec(n, 0), None).await.unwrap().created);
        }
        let again = checked(GuardSpec {
            name: "a".into(),
            endpoint: "127.0.0.1:1".into(),
            timeout_ms: 77,
            ..Default::default()
        });
        let out = r.register(again, None).await.unwrap();
        assert!(!out.created);
        assert_eq!(out.position, 0);
        assert_eq!(names(&r), ["a", "b", "c"]);
        assert_eq!(r.chain().guards[0].timeout, Duration::from_millis(77));
        assert_eq!(r.chain().revision, 4);
    }

    #[tokio::test]
    async fn r16_priority_then_registration_order() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        r.register(spec("late", 5), None).await.unwrap();
        r.register(spec("x", 0), None).await.unwrap();
        r.register(spec("first", -1), None).await.unwrap();
        r.register(spec("y", 0), None).await.unwrap();
        assert_eq!(names(&r), ["first", "x", "y", "late"]);
        let out = r.deregister("x".into()).await.unwrap();
        assert!(out.removed);
        assert_eq!(names(&r), ["first", "y", "late"]);
        let out = r.deregister("nope".into()).await.unwrap();
        assert!(!out.removed);
        assert_eq!(out.revision, r.chain().revision);
    }

    #[tokio::test]
    async fn r17_old_snapshot_is_unchanged_by_registration() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        r.register(spec("a", 0), None).await.unwrap();
        let snapshot = r.chain();
        r.register(spec("b", 0), None).await.unwrap();
        assert_eq!(snapshot.guards.len(), 1);
        assert_eq!(r.chain().guards.len(), 2);
        assert!(r.chain().revision > snapshot.revision);
    }

    /// R16/R25: the quota is counted by the registry; an update of an owned
    /// guard does not count, a deregistration frees a place, and another
    /// identity's guards are not counted.
    #[tokio::test]
    async fn r16_quota_is_counted_by_the_registry() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        let owner = |id: &str| {
            Some(Owner {
                identity: id.into(),
                max_guards: Some(2),
                max_policy_bytes: 1 << 20,
            })
        };
        r.register(spec("a", 0), owner("team")).await.unwrap();
        r.register(spec("b", 0), owner("team")).await.unwrap();
        r.register(spec("a", 0), owner("team")).await.unwrap();
        r.register(spec("x", 0), owner("other")).await.unwrap();
        let err = r.register(spec("c", 0), owner("team")).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "team already registered 2 guards, its limit"
        );
        assert!(matches!(err, RegistryError::Quota(_)));
        assert!(r.deregister("b".into()).await.unwrap().removed);
        r.register(spec("c", 0), owner("team")).await.unwrap();
        assert_eq!(names(&r), ["a", "x", "c"]);
    }

    /// R16: the registry keeps the guard admission checked and compiled;
    /// it does not build another.
    #[tokio::test]
    async fn r16_the_registry_keeps_the_admitted_guard() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        let guard = checked(GuardSpec {
            name: "p".into(),
            policy:
                "[[rule]]\nname = \"r\"\nwhen = \"true\"\naction = \"cancel\"\nmessage = '\"no\"'\n"
                    .into(),
            ..Default::default()
        });
        r.register(guard.clone(), None).await.unwrap();
        assert!(Arc::ptr_eq(&r.chain().guards[0], guard.guard()));
    }
}
