//! One session's memory: the calls that ran, the labels set, the digests
//! of values seen in results, and counters; bounded in bytes, entries and
//! age, the oldest entries going first (R34).

use super::limits::SessionLimits;
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};

/// Bytes an entry is charged beyond its strings (its times and framing as
/// stored).
const ENTRY_OVERHEAD: usize = 32;

/// A call that ran in the session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRan {
    /// The call's id, as the coordinator chose it.
    pub id: String,
    pub tool: String,
    /// The server the tool belongs to (see `SessionMemory::server_of`).
    pub server: String,
    /// The keyed digest of the final arguments (hex), never the arguments.
    pub args: String,
    /// When it was judged to run, in milliseconds since the Unix epoch.
    pub at: u64,
}

/// A label of the session (`secret:fs`), set by a guard's verdict or a
/// policy rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Label {
    pub name: String,
    pub at: u64,
}

/// The keyed digest (hex) of a value seen in a result from `server`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    pub server: String,
    pub digest: String,
    pub at: u64,
}

/// One session's memory, as a store holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    #[serde(default)]
    pub calls: VecDeque<CallRan>,
    #[serde(default)]
    pub labels: VecDeque<Label>,
    #[serde(default)]
    pub seen: VecDeque<Seen>,
    /// Calls recorded since the session began (eviction does not lower it).
    #[serde(default)]
    pub calls_total: u64,
    /// Results recorded since the session began.
    #[serde(default)]
    pub results_total: u64,
    /// Entries dropped by the bounds since the session began.
    #[serde(default)]
    pub evicted: u64,
    /// When it last changed.
    #[serde(default)]
    pub updated: u64,
    /// In etcd: when the lease the session's key is on was granted (a
    /// lease lives the memory's age from then, so it is renewed before).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lease_at: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What one batch (or one result) adds to a session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Update {
    pub calls: Vec<CallRan>,
    pub labels: Vec<String>,
    pub seen: Vec<Seen>,
    /// Results this update records.
    pub results: u64,
}

impl Update {
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty() && self.labels.is_empty() && self.seen.is_empty()
    }
}

/// What an update did to a session: the changes a decision record carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// Tools of the calls recorded.
    pub calls: Vec<String>,
    /// Labels added (not those already set).
    pub labels: Vec<String>,
    /// Labels refused (over-long or outside the label grammar).
    pub refused_labels: usize,
    /// Digests of values seen added.
    pub seen: usize,
    /// Entries dropped by the bounds (the oldest first).
    pub evicted: usize,
    /// The session's entries and bytes after the update.
    pub entries: usize,
    pub bytes: usize,
}

/// Why a label is refused: it must be 1 to `max` bytes of ASCII letters,
/// digits and `_ - . : /`.
pub fn label_ok(label: &str, max: usize) -> bool {
    !label.is_empty()
        && label.len() <= max
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':' | b'/'))
}

impl Memory {
    /// Its entries: calls, labels and values seen.
    pub fn entries(&self) -> usize {
        self.calls.len() + self.labels.len() + self.seen.len()
    }

    /// The bytes it is charged.
    pub fn bytes(&self) -> usize {
        self.calls
            .iter()
            .map(|c| c.id.len() + c.tool.len() + c.server.len() + c.args.len())
            .chain(self.labels.iter().map(|l| l.name.len()))
            .chain(self.seen.iter().map(|s| s.server.len() + s.digest.len()))
            .map(|b| b + ENTRY_OVERHEAD)
            .sum()
    }

    /// Drops the entries older than the bounds' age; returns how many.
    pub fn expire(&mut self, limits: &SessionLimits, now: u64) -> usize {
        let age = u64::try_from(limits.max_age.as_millis()).unwrap_or(u64::MAX);
        let cutoff = now.saturating_sub(age);
        let before = self.entries();
        self.calls.retain(|c| c.at >= cutoff);
        self.labels.retain(|l| l.at >= cutoff);
        self.seen.retain(|s| s.at >= cutoff);
        let dropped = before - self.entries();
        self.evicted += dropped as u64;
        dropped
    }

    /// Applies `update` at `now` within `limits`.
    pub fn apply(&mut self, update: &Update, limits: &SessionLimits, now: u64) -> Applied {
        let mut applied = Applied {
            evicted: self.expire(limits, now),
            ..Applied::default()
        };
        for call in &update.calls {
            self.calls.push_back(CallRan {
                at: now,
                ..call.clone()
            });
            applied.calls.push(call.tool.clone());
        }
        self.calls_total += update.calls.len() as u64;
        self.results_total += update.results;
        for label in &update.labels {
            if !label_ok(label, limits.max_label_bytes) {
                applied.refused_labels += 1;
                continue;
            }
            if self.labels.iter().any(|l| &l.name == label) {
                continue;
            }
            self.labels.push_back(Label {
                name: label.clone(),
                at: now,
            });
            applied.labels.push(label.clone());
        }
        // Values already seen, and those earlier in this update (a
        // request of results brings several results in one update), are
        // not added twice.
        let mut known: HashSet<(&str, &str)> = self
            .seen
            .iter()
            .map(|s| (s.server.as_str(), s.digest.as_str()))
            .collect();
        let fresh: Vec<Seen> = update
            .seen
            .iter()
            .filter(|s| known.insert((s.server.as_str(), s.digest.as_str())))
            .map(|s| Seen {
                at: now,
                ..s.clone()
            })
            .collect();
        applied.seen = fresh.len();
        self.seen.extend(fresh);
        // `expire` counted its own drops; these are counted here.
        let mut dropped = 0;
        while self.labels.len() > limits.max_labels {
            self.labels.pop_front();
            dropped += 1;
        }
        dropped += self.shrink(limits);
        self.evicted += dropped as u64;
        applied.evicted += dropped;
        self.updated = now;
        applied.entries = self.entries();
        applied.bytes = self.bytes();
        applied
    }

    /// Drops the oldest entries until the session is within its entries
    /// and bytes; labels go last (a flood of values must not wash a label
    /// away before it washes away the values). Returns how many.
    fn shrink(&mut self, limits: &SessionLimits) -> usize {
        let mut bytes = self.bytes();
        let mut dropped = 0;
        while self.entries() > limits.max_entries || bytes > limits.max_bytes {
            let call = self.calls.front().map(|c| c.at);
            let seen = self.seen.front().map(|s| s.at);
            let freed = match (call, seen) {
                (Some(c), Some(s)) if c <= s => self.calls.pop_front().map(|c| call_bytes(&c)),
                (Some(_), None) => self.calls.pop_front().map(|c| call_bytes(&c)),
                (_, Some(_)) => self.seen.pop_front().map(|s| seen_bytes(&s)),
                (None, None) => self
                    .labels
                    .pop_front()
                    .map(|l| l.name.len() + ENTRY_OVERHEAD),
            };
            let Some(freed) = freed else { break };
            bytes = bytes.saturating_sub(freed);
            dropped += 1;
        }
        dropped
    }
}

fn call_bytes(c: &CallRan) -> usize {
    c.id.len() + c.tool.len() + c.server.len() + c.args.len() + ENTRY_OVERHEAD
}

fn seen_bytes(s: &Seen) -> usize {
    s.server.len() + s.digest.len() + ENTRY_OVERHEAD
}
