//! A bounded, keyed set of sessions that forgets each one at least the
//! memory's age after it was last put in: a rotating Bloom filter.

use super::key::SessionKey;
use super::limits::SessionLimits;
use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};

/// A set of sessions, each remembered for at least the memory's age from
/// when it was last put in (R34: forgetting is never innocence): the
/// sessions a store of one mesh dropped to make room for others, and the
/// sessions a mesh wrote to a store replicas share (so that one the store
/// lost reads as lost). A keyed hash of each one's key (a random key per process, so no caller can aim at another's
/// bits) set in a Bloom filter, one filter per half of the age, the last
/// three kept. A session dropped within the age is always found; a session
/// that never was may, rarely, be taken for one dropped (it then reads as
/// having lost memory: the safe side), more often as the drops within one
/// half of the age outnumber a tenth of a filter's bits (some 800 000 with
/// the default bounds). Each filter is 1/64 of what the sessions may hold
/// (`max_sessions` times `max_bytes`), from 8 KiB to 1 MiB, allocated at
/// the first drop of its half; counted in the store's bytes.
#[derive(Debug, Default)]
pub(crate) struct SessionFilter {
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

impl SessionFilter {
    pub(crate) fn new(limits: &SessionLimits) -> Self {
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

    pub(crate) fn insert(&mut self, key: &SessionKey, now: u64, max_age_ms: u64) {
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

    /// Whether `key` was put in within the age before `now`.
    pub(crate) fn contains(&mut self, key: &SessionKey, now: u64, max_age_ms: u64) -> bool {
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

    pub(crate) fn bytes(&self) -> usize {
        self.generations.iter().map(|g| g.bits.len() * 8).sum()
    }
}
