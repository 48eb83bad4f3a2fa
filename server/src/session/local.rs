//! Session memory in the mesh's own memory: a single mesh, no store.
//! Bounded mesh-wide and per identity in sessions; the least recently
//! updated session goes first, counted and logged (R25, R34), and is
//! remembered as dropped (a [`SessionFilter`]): when it comes back, it reads as
//! a session that lost memory, never as a new one.

use super::filter::SessionFilter;
use super::key::SessionKey;
use super::limits::SessionLimits;
use super::memory::{Applied, Memory};
use super::store::{Put, Record, SessionStore, StoreError, Write};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The in-memory store.
#[derive(Debug)]
pub struct LocalStore {
    limits: SessionLimits,
    state: Mutex<State>,
    evicted_sessions: AtomicU64,
    /// Records beside the sessions (approval requests, R35).
    records: Mutex<Records>,
}

/// The most records a store in the mesh's memory holds: past it a new one
/// is refused (an error, never a silent drop). Asks are bounded per
/// session before they get here (R35).
pub const MAX_RECORDS: usize = 100_000;

/// Records by name, each with its version and the time it expires
/// (milliseconds since the Unix epoch); the expiry order finds the expired
/// without a walk over them all.
#[derive(Debug, Default)]
struct Records {
    by_name: BTreeMap<String, (Record, u64)>,
    expiry: BTreeSet<(u64, String)>,
    version: u64,
}

impl Records {
    fn purge(&mut self, now: u64) {
        while let Some((at, name)) = self.expiry.first().cloned() {
            if at > now {
                break;
            }
            self.expiry.pop_first();
            self.by_name.remove(&name);
        }
    }
}

/// One session the store holds.
#[derive(Debug)]
struct Slot {
    /// Its memory, shared with the readers of a snapshot: an update copies
    /// it only while a batch still reads the one before.
    memory: Arc<Memory>,
    /// When it was last updated, in the store's own order (see
    /// [`State::tick`]).
    tick: u64,
}

#[derive(Debug, Default)]
struct State {
    sessions: HashMap<Arc<SessionKey>, Slot>,
    /// The sessions by their last update, least recent first: the one to
    /// drop for room is the first, found without a walk over them all.
    order: BTreeMap<u64, Arc<SessionKey>>,
    /// Per identity, the last updates of its sessions (keys of `order`).
    per_identity: HashMap<String, BTreeSet<u64>>,
    /// The last update's place in the order: every update takes the next.
    tick: u64,
    bytes: usize,
    dropped: SessionFilter,
}

impl State {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Drops `key` at `now`, remembering that it was dropped.
    fn remove(&mut self, key: &SessionKey, now: u64, max_age_ms: u64) {
        if let Some(slot) = self.sessions.remove(key) {
            self.bytes = self.bytes.saturating_sub(slot.memory.bytes() + key.bytes());
            self.order.remove(&slot.tick);
            if let Some(ticks) = self.per_identity.get_mut(&key.identity) {
                ticks.remove(&slot.tick);
                if ticks.is_empty() {
                    self.per_identity.remove(&key.identity);
                }
            }
            self.dropped.insert(key, now, max_age_ms);
        }
    }

    /// The least recently updated session, of `identity` if given.
    fn oldest(&self, identity: Option<&str>) -> Option<Arc<SessionKey>> {
        let tick = match identity {
            Some(identity) => *self.per_identity.get(identity)?.first()?,
            None => *self.order.keys().next()?,
        };
        self.order.get(&tick).cloned()
    }
}

impl LocalStore {
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            state: Mutex::new(State {
                dropped: SessionFilter::new(&limits),
                ..State::default()
            }),
            evicted_sessions: AtomicU64::new(0),
            records: Mutex::default(),
        }
    }

    /// Sessions dropped to make room for others since the store began.
    pub fn evicted_sessions(&self) -> u64 {
        self.evicted_sessions.load(Ordering::Relaxed)
    }

    fn max_age_ms(&self) -> u64 {
        u64::try_from(self.limits.max_age.as_millis()).unwrap_or(u64::MAX)
    }

    fn evict(&self, state: &mut State, identity: Option<&str>, now: u64) {
        if let Some(oldest) = state.oldest(identity) {
            state.remove(&oldest, now, self.max_age_ms());
            self.evicted_sessions.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                per_identity = identity.is_some(),
                "session memory: the least recently used session was dropped to make room"
            );
        }
    }

    /// What a session the store does not hold reads as: nothing if it never
    /// was (or only longer ago than the age), a memory that lost entries if
    /// it was dropped for room.
    fn absent(&self, state: &mut State, key: &SessionKey) -> Option<Arc<Memory>> {
        state
            .dropped
            .contains(key, super::now_ms(), self.max_age_ms())
            .then(|| Arc::new(Memory::dropped_for_room()))
    }
}

#[tonic::async_trait]
impl SessionStore for LocalStore {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        Ok(self.snapshot(key).await?.map(|m| Memory::clone(&m)))
    }

    async fn snapshot(&self, key: &SessionKey) -> Result<Option<Arc<Memory>>, StoreError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match state.sessions.get(key) {
            Some(slot) => Ok(Some(Arc::clone(&slot.memory))),
            None => Ok(self.absent(&mut state, key)),
        }
    }

    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        let (update, limits, now) = (write.update, write.limits, write.now);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let tick = state.next_tick();
        let key = match state.sessions.get_key_value(key) {
            Some((key, slot)) => {
                let (key, old) = (Arc::clone(key), slot.tick);
                state.order.remove(&old);
                if let Some(ticks) = state.per_identity.get_mut(&key.identity) {
                    ticks.remove(&old);
                }
                key
            }
            None => {
                let mine = state
                    .per_identity
                    .get(&key.identity)
                    .map_or(0, BTreeSet::len);
                if mine >= self.limits.max_sessions_per_identity.max(1) {
                    self.evict(&mut state, Some(&key.identity), now);
                }
                if state.sessions.len() >= self.limits.max_sessions.max(1) {
                    self.evict(&mut state, None, now);
                }
                let memory = if state.dropped.contains(key, now, self.max_age_ms()) {
                    Arc::new(Memory::dropped_for_room())
                } else {
                    Arc::default()
                };
                let key = Arc::new(key.clone());
                state.bytes += key.bytes();
                state
                    .sessions
                    .insert(Arc::clone(&key), Slot { memory, tick });
                key
            }
        };
        state.order.insert(tick, Arc::clone(&key));
        match state.per_identity.get_mut(&key.identity) {
            Some(ticks) => {
                ticks.insert(tick);
            }
            None => {
                state
                    .per_identity
                    .insert(key.identity.clone(), BTreeSet::from([tick]));
            }
        }
        let State {
            sessions, bytes, ..
        } = &mut *state;
        let Some(slot) = sessions.get_mut(&*key) else {
            unreachable!("held or inserted above")
        };
        slot.tick = tick;
        let memory = Arc::make_mut(&mut slot.memory);
        let before = memory.bytes();
        let applied = memory.apply(update, limits, now);
        *bytes = bytes.saturating_sub(before) + applied.bytes;
        Ok(applied)
    }

    async fn record(&self, name: &str) -> Result<Option<Record>, StoreError> {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        records.purge(super::now_ms());
        Ok(records.by_name.get(name).map(|(record, _)| record.clone()))
    }

    async fn put_record(&self, put: Put<'_>) -> Result<bool, StoreError> {
        let Put { name, version, .. } = put;
        let now = super::now_ms();
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        records.purge(now);
        let there = records
            .by_name
            .get(name)
            .map(|(r, at)| (r.version.clone(), *at));
        if there.as_ref().map(|(v, _)| v.as_str()) != version {
            return Ok(false);
        }
        if there.is_none() && records.by_name.len() >= MAX_RECORDS {
            return Err(StoreError::Unavailable(format!(
                "the store in the mesh's memory holds {MAX_RECORDS} records, its most"
            )));
        }
        if let Some((_, at)) = there {
            records.expiry.remove(&(at, name.to_owned()));
        }
        records.version += 1;
        let expires = now.saturating_add(u64::try_from(put.ttl.as_millis()).unwrap_or(u64::MAX));
        let record = Record {
            value: put.value,
            version: records.version.to_string(),
        };
        records.expiry.insert((expires, name.to_owned()));
        records.by_name.insert(name.to_owned(), (record, expires));
        Ok(true)
    }

    async fn records(&self, prefix: &str, limit: usize) -> Result<Vec<Record>, StoreError> {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        records.purge(super::now_ms());
        Ok(records
            .by_name
            .range(prefix.to_owned()..)
            .take_while(|(name, _)| name.starts_with(prefix))
            .take(limit)
            .map(|(_, (record, _))| record.clone())
            .collect())
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn shared(&self) -> bool {
        false
    }

    fn held(&self) -> Option<(usize, usize)> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Some((state.sessions.len(), state.bytes + state.dropped.bytes()))
    }
}
