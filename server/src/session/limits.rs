//! The bounds of session memory (R25, R34): per session in bytes, entries
//! and age; per identity and mesh-wide in sessions.

use std::time::Duration;

/// The bounds of session memory; `[sessions]` in the config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Bytes one session's memory may hold (its calls, labels and digests,
    /// as the store holds them).
    pub max_bytes: usize,
    /// Entries one session may hold: calls, labels and values seen.
    pub max_entries: usize,
    /// Entries older than this are dropped.
    pub max_age: Duration,
    /// Labels one session may hold (the oldest go first).
    pub max_labels: usize,
    /// Bytes of one label.
    pub max_label_bytes: usize,
    /// Digests kept of one result (its values and their tokens).
    pub max_values_per_result: usize,
    /// Sessions the mesh keeps in memory (the least recently used go first).
    pub max_sessions: usize,
    /// Sessions one identity may have (its least recently used go first).
    pub max_sessions_per_identity: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_bytes: 16 * 1024,
            max_entries: 1024,
            max_age: Duration::from_secs(24 * 3600),
            max_labels: 64,
            max_label_bytes: 128,
            max_values_per_result: 256,
            max_sessions: 4_096,
            max_sessions_per_identity: 1_024,
        }
    }
}

/// Labels one verdict (or one policy rule) may add to its session (R34);
/// past it they are refused and counted.
pub(crate) const MAX_LABELS_PER_VERDICT: usize = 8;

/// Bytes of one label (R34), as session memory bounds them.
pub(crate) const MAX_LABEL_BYTES: usize = 128;
