//! Where the chain's registrations live.
//!
//! The mesh talks to its registry through the small [`Registry`] trait so that
//! the store can change (the embedded in-memory registry today, a shared store
//! for several replicas later) without touching the fold. A registry only
//! keeps *registrations*: whether a guard is reachable is the link's business,
//! never the registry's (R15: liveness does not remove policy).

pub mod etcd;
pub(crate) mod spec;

use crate::registry::spec::{Guard, SpecError};
use futures::future::BoxFuture;
use guardmesh_proto::v1::GuardSpec;
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
    #[error("registry store unavailable: {0}")]
    Unavailable(String),
}

/// The store of registrations.
pub trait Registry: Send + Sync + 'static {
    /// The current chain. Cheap: called at the start of every batch.
    fn chain(&self) -> Arc<ChainSpec>;
    /// Adds a guard, or updates the one with the same name in place (R16).
    fn register(&self, spec: GuardSpec) -> BoxFuture<'_, Result<Registered, RegistryError>>;
    /// Removes a guard by name.
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
    pub fn new(default_timeout: Duration) -> Self {
        Self {
            default_timeout,
            state: Mutex::new(State::default()),
            chain: arc_swap::ArcSwap::from_pointee(ChainSpec::default()),
        }
    }

    fn apply(&self, spec: &GuardSpec) -> Result<Registered, RegistryError> {
        let guard = Arc::new(Guard::from_spec(spec, self.default_timeout)?);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
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

    fn register(&self, spec: GuardSpec) -> BoxFuture<'_, Result<Registered, RegistryError>> {
        Box::pin(async move { self.apply(&spec) })
    }

    fn deregister(&self, name: String) -> BoxFuture<'_, Result<Deregistered, RegistryError>> {
        Box::pin(async move {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let before = state.entries.len();
            state.entries.retain(|e| e.guard.name != name);
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

    fn spec(name: &str, priority: i32) -> GuardSpec {
        GuardSpec {
            name: name.into(),
            endpoint: "127.0.0.1:1".into(),
            priority,
            ..Default::default()
        }
    }

    fn names(r: &MemoryRegistry) -> Vec<String> {
        r.chain().guards.iter().map(|g| g.name.clone()).collect()
    }

    #[tokio::test]
    async fn r16_update_in_place_keeps_position() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        for n in ["a", "b", "c"] {
            assert!(r.register(spec(n, 0)).await.unwrap().created);
        }
        let mut again = spec("a", 0);
        again.timeout_ms = 77;
        let out = r.register(again).await.unwrap();
        assert!(!out.created);
        assert_eq!(out.position, 0);
        assert_eq!(names(&r), ["a", "b", "c"]);
        assert_eq!(r.chain().guards[0].timeout, Duration::from_millis(77));
        assert_eq!(r.chain().revision, 4);
    }

    #[tokio::test]
    async fn r16_priority_then_registration_order() {
        let r = MemoryRegistry::new(Duration::from_secs(1));
        r.register(spec("late", 5)).await.unwrap();
        r.register(spec("x", 0)).await.unwrap();
        r.register(spec("first", -1)).await.unwrap();
        r.register(spec("y", 0)).await.unwrap();
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
        r.register(spec("a", 0)).await.unwrap();
        let snapshot = r.chain();
        r.register(spec("b", 0)).await.unwrap();
        assert_eq!(snapshot.guards.len(), 1);
        assert_eq!(r.chain().guards.len(), 2);
        assert!(r.chain().revision > snapshot.revision);
    }
}
