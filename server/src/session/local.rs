//! Session memory in the mesh's own memory: a single mesh, no store.
//! Bounded mesh-wide and per identity in sessions; the least recently
//! updated session goes first, counted and logged (R25, R34).

use super::key::SessionKey;
use super::limits::SessionLimits;
use super::memory::{Applied, Memory, Update};
use super::store::{SessionStore, StoreError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The in-memory store.
#[derive(Debug)]
pub struct LocalStore {
    limits: SessionLimits,
    state: Mutex<State>,
    evicted_sessions: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// Each session's memory, shared with the readers of a snapshot: an
    /// update copies it only while a batch still reads the one before.
    sessions: HashMap<SessionKey, Arc<Memory>>,
    per_identity: HashMap<String, usize>,
    bytes: usize,
}

impl State {
    fn remove(&mut self, key: &SessionKey) {
        if let Some(memory) = self.sessions.remove(key) {
            self.bytes = self.bytes.saturating_sub(memory.bytes() + key.bytes());
            if let Some(n) = self.per_identity.get_mut(&key.identity) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.per_identity.remove(&key.identity);
                }
            }
        }
    }

    /// The least recently updated session, of `identity` if given.
    fn oldest(&self, identity: Option<&str>) -> Option<SessionKey> {
        self.sessions
            .iter()
            .filter(|(k, _)| identity.is_none_or(|i| k.identity == i))
            .min_by_key(|(_, m)| m.updated)
            .map(|(k, _)| k.clone())
    }
}

impl LocalStore {
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            state: Mutex::new(State::default()),
            evicted_sessions: AtomicU64::new(0),
        }
    }

    /// Sessions dropped to make room for others since the store began.
    pub fn evicted_sessions(&self) -> u64 {
        self.evicted_sessions.load(Ordering::Relaxed)
    }

    fn evict(&self, state: &mut State, identity: Option<&str>) {
        if let Some(oldest) = state.oldest(identity) {
            state.remove(&oldest);
            self.evicted_sessions.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                per_identity = identity.is_some(),
                "session memory: the least recently used session was dropped to make room"
            );
        }
    }
}

#[tonic::async_trait]
impl SessionStore for LocalStore {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(state.sessions.get(key).map(|m| Memory::clone(m)))
    }

    async fn snapshot(&self, key: &SessionKey) -> Result<Option<Arc<Memory>>, StoreError> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(state.sessions.get(key).cloned())
    }

    async fn update(
        &self,
        key: &SessionKey,
        update: &Update,
        limits: &SessionLimits,
        now: u64,
    ) -> Result<Applied, StoreError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.sessions.contains_key(key) {
            let mine = state.per_identity.get(&key.identity).copied().unwrap_or(0);
            if mine >= self.limits.max_sessions_per_identity.max(1) {
                self.evict(&mut state, Some(&key.identity));
            }
            if state.sessions.len() >= self.limits.max_sessions.max(1) {
                self.evict(&mut state, None);
            }
            *state.per_identity.entry(key.identity.clone()).or_default() += 1;
            state.bytes += key.bytes();
            state.sessions.insert(key.clone(), Arc::default());
        }
        let State {
            sessions, bytes, ..
        } = &mut *state;
        // (The key is cloned only for a new session, above.)
        let Some(memory) = sessions.get_mut(key) else {
            unreachable!("inserted above when missing")
        };
        let memory = Arc::make_mut(memory);
        let before = memory.bytes();
        let applied = memory.apply(update, limits, now);
        *bytes = bytes.saturating_sub(before) + applied.bytes;
        Ok(applied)
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn held(&self) -> Option<(usize, usize)> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Some((state.sessions.len(), state.bytes))
    }
}
