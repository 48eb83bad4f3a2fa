//! Session memory in the mesh's own memory: a single mesh, no store.
//! Bounded mesh-wide and per identity in sessions; the least recently
//! updated session goes first, counted and logged (R25, R34), and is
//! remembered as dropped (see [`Dropped`]): when it comes back, it reads as
//! a session that lost memory, never as a new one.

use super::key::SessionKey;
use super::limits::SessionLimits;
use super::memory::{Applied, Memory, Update};
use super::store::{SessionStore, StoreError};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The in-memory store.
#[derive(Debug)]
pub struct LocalStore {
    limits: SessionLimits,
    state: Mutex<State>,
    evicted_sessions: AtomicU64,
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
    dropped: Dropped,
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

/// Sessions dropped to make room for others, remembered for at least the
/// memory's age (R34: forgetting is never innocence): a keyed hash of each
/// one's key (a random key per process, so no caller can aim at another's
/// bits) set in a Bloom filter, one filter per half of the age, the last
/// three kept. A session dropped within the age is always found; a session
/// that never was may, rarely, be taken for one dropped (it then reads as
/// having lost memory: the safe side), more often as the drops within one
/// half of the age outnumber a tenth of a filter's bits (some 800 000 with
/// the default bounds). Each filter is 1/64 of what the sessions may hold
/// (`max_sessions` times `max_bytes`), from 8 KiB to 1 MiB, allocated at
/// the first drop of its half; counted in the store's bytes.
#[derive(Debug, Default)]
struct Dropped {
    hasher: RandomState,
    /// Bits of one filter (0: none allocated yet).
    bits: u64,
    /// Newest last.
    generations: VecDeque<Generation>,
}

struct Generation {
    /// When its first drop was set (ms since the epoch).
    start: u64,
    bits: Box<[u64]>,
}

/// Its time and size, not its bits (up to a megabyte of them).
impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("start", &self.start)
            .field("bytes", &(self.bits.len() * 8))
            .finish()
    }
}

/// Bytes of one filter of dropped sessions, at least and at most.
const DROPPED_MIN_BYTES: usize = 8 * 1024;
const DROPPED_MAX_BYTES: usize = 1024 * 1024;

/// Bits set per dropped session.
const DROPPED_HASHES: u64 = 7;

/// Filters kept: each covers half of the memory's age, so a drop set in the
/// oldest is kept at least the age.
const DROPPED_GENERATIONS: u64 = 3;

impl Dropped {
    fn new(limits: &SessionLimits) -> Self {
        let bytes = (limits.max_sessions.saturating_mul(limits.max_bytes) / 64)
            .clamp(DROPPED_MIN_BYTES, DROPPED_MAX_BYTES);
        Self {
            hasher: RandomState::new(),
            bits: (bytes * 8) as u64,
            generations: VecDeque::new(),
        }
    }

    /// Half of the memory's age (at least 1 ms): what one filter covers.
    fn period(max_age_ms: u64) -> u64 {
        max_age_ms.div_ceil(2).max(1)
    }

    /// Forgets the filters whose every drop is older than the age.
    fn expire(&mut self, now: u64, max_age_ms: u64) {
        let span = Self::period(max_age_ms).saturating_mul(DROPPED_GENERATIONS);
        while self
            .generations
            .front()
            .is_some_and(|g| g.start.saturating_add(span) <= now)
        {
            self.generations.pop_front();
        }
    }

    /// The bits of `key`.
    fn positions(&self, key: &SessionKey) -> impl Iterator<Item = usize> {
        let hash = self.hasher.hash_one(key);
        let (h1, h2, bits) = (hash & 0xffff_ffff, (hash >> 32) | 1, self.bits.max(1));
        (0..DROPPED_HASHES).map(move |i| {
            // Below `bits`, a `usize` of the filter's length.
            usize::try_from(h1.wrapping_add(i.wrapping_mul(h2)) % bits).unwrap_or(0)
        })
    }

    fn insert(&mut self, key: &SessionKey, now: u64, max_age_ms: u64) {
        self.expire(now, max_age_ms);
        let period = Self::period(max_age_ms);
        if self
            .generations
            .back()
            .is_none_or(|g| g.start.saturating_add(period) <= now)
        {
            self.generations.push_back(Generation {
                start: now,
                bits: vec![0u64; usize::try_from(self.bits.div_ceil(64)).unwrap_or(0)]
                    .into_boxed_slice(),
            });
        }
        let positions: Vec<usize> = self.positions(key).collect();
        if let Some(generation) = self.generations.back_mut() {
            for p in positions {
                if let Some(word) = generation.bits.get_mut(p / 64) {
                    *word |= 1 << (p % 64);
                }
            }
        }
    }

    /// Whether `key` was dropped within the age before `now`.
    fn contains(&mut self, key: &SessionKey, now: u64, max_age_ms: u64) -> bool {
        self.expire(now, max_age_ms);
        if self.generations.is_empty() {
            return false;
        }
        let positions: Vec<usize> = self.positions(key).collect();
        self.generations.iter().any(|generation| {
            positions.iter().all(|p| {
                generation
                    .bits
                    .get(p / 64)
                    .is_some_and(|w| w & (1 << (p % 64)) != 0)
            })
        })
    }

    fn bytes(&self) -> usize {
        self.generations.iter().map(|g| g.bits.len() * 8).sum()
    }
}

impl LocalStore {
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            state: Mutex::new(State {
                dropped: Dropped::new(&limits),
                ..State::default()
            }),
            evicted_sessions: AtomicU64::new(0),
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

    async fn update(
        &self,
        key: &SessionKey,
        update: &Update,
        limits: &SessionLimits,
        now: u64,
    ) -> Result<Applied, StoreError> {
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
