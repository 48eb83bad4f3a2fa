//! One session's memory: the calls that ran, the labels set, the digests
//! of values seen in results, and counters; bounded in bytes, entries and
//! age, the oldest entries going first (R34). "Oldest" is the order in
//! which the session recorded them (each entry's sequence number), never
//! their millisecond: entries recorded in one millisecond still have an
//! order, and the clock may step back.

use super::limits::SessionLimits;
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};

/// Bytes an entry is charged beyond its strings (its time, its sequence
/// number and framing as stored).
const ENTRY_OVERHEAD: usize = 40;

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
    /// Its place in the order the session recorded its entries (see
    /// [`Memory::seq`]); 0 in memories stored before entries had one,
    /// which are older than every entry that has one.
    #[serde(default)]
    pub seq: u64,
}

/// A label of the session (`secret:fs`), set by a guard's verdict or a
/// policy rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Label {
    pub name: String,
    pub at: u64,
    #[serde(default)]
    pub seq: u64,
}

/// The keyed digest (hex) of a value seen in a result from `server`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    pub server: String,
    pub digest: String,
    pub at: u64,
    #[serde(default)]
    pub seq: u64,
    /// The digest is of the value in ASCII lower case (`Digester::folded`),
    /// as this version keeps values; false for one an earlier version kept
    /// as read (until it ages out, `seen_from` also looks values up as
    /// sent).
    #[serde(default, rename = "f", skip_serializing_if = "std::ops::Not::not")]
    pub folded: bool,
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
    /// Entries dropped by the bounds since the session began (at least 1
    /// once the session was dropped for room, see `dropped`).
    #[serde(default)]
    pub evicted: u64,
    /// Values seen that the memory no longer holds: dropped by a bound or
    /// the age (at least 1 once the whole session was lost). A value the
    /// model read may then be sent on unseen: a flow rule treats a session
    /// with values lost as tainted (R34: forgetting is never innocence).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub values_lost: u64,
    /// When the newest call a bound dropped had run (ms since the epoch),
    /// or when the session was found lost: a count over a window reaching
    /// back past it cannot be complete (R34).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub calls_lost_at: u64,
    /// The session was dropped to make room for others and came back: all
    /// it held before is lost (R34: read as lost, never as new).
    #[serde(default, skip_serializing_if = "is_false")]
    pub dropped: bool,
    /// When it last changed.
    #[serde(default)]
    pub updated: u64,
    /// The sequence number of the last entry recorded: each entry gets the
    /// next, so the oldest entry is the one with the lowest (R34).
    #[serde(default)]
    pub seq: u64,
    /// Updates applied since the session began: a batch that judged on
    /// the memory as it was after `writes` updates writes only if no
    /// other was applied since (R34, [`Update::read_at`]).
    #[serde(default)]
    pub writes: u64,
    /// In etcd: when the lease the session's key is on was granted (a
    /// lease lives the memory's age from then, so it is renewed before).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lease_at: u64,
    /// The bytes it is charged, kept in step by the methods that change
    /// its entries (see [`Held`]).
    #[serde(skip)]
    held: Held,
}

/// The bytes a [`Memory`] is charged, once counted: kept in step with its
/// entries by every change [`Memory::apply`] and [`Memory::expire`] make,
/// so that a batch does not add up the whole memory again (in debug builds
/// [`Memory::bytes`] checks it against the sum). Not stored: a memory read
/// from a store counts its bytes on its first change. Derived from the
/// entries, so no part of a memory's equality.
#[derive(Debug, Clone, Copy, Default)]
struct Held(Option<usize>);

impl PartialEq for Held {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Held {}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// What one batch (or one result) adds to a session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Update {
    pub calls: Vec<CallRan>,
    pub labels: Vec<String>,
    pub seen: Vec<Seen>,
    /// Results this update records.
    pub results: u64,
    /// The memory's [`Memory::writes`] when the batch that makes this
    /// update read it, when the batch was judged on it: a shared store
    /// applies the update only if the memory is still as read, else it
    /// answers [`super::StoreError::Changed`] and the batch is judged again
    /// on the memory as it is now (R34: two batches of one session on two
    /// replicas are judged as if one ran after the other). `None`: applied
    /// whatever was written since. A store of one mesh ignores it: the
    /// mesh's session turns already keep a batch's read and write
    /// together.
    #[serde(skip)]
    pub read_at: Option<u64>,
    /// Whether a store that holds no memory for the session begins it as
    /// one that lost its memory ([`Memory::dropped_for_room`]) rather than
    /// as a new one: the mesh wrote the session within the age, so the
    /// store lost it (R34).
    #[serde(skip)]
    pub lost_if_absent: bool,
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
    /// This update is the first to drop entries of the session (by the
    /// bounds or by age): from it on, the session has lost memory. Logged
    /// once per session, not at every update that drops more.
    #[serde(default)]
    pub began_to_forget: bool,
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
    /// The memory of a session that was dropped to make room for others
    /// and comes back: nothing of what it held, and marked as having lost
    /// it (how many entries is not kept: at least one).
    /// The memory a store begins for a session it holds none of: a new
    /// one, or one that lost its memory when `update` says the session was
    /// written before ([`Update::lost_if_absent`]).
    pub fn begun(update: &Update) -> Self {
        if update.lost_if_absent {
            Self::dropped_for_room()
        } else {
            Self::default()
        }
    }

    pub fn dropped_for_room() -> Self {
        Self {
            evicted: 1,
            values_lost: 1,
            dropped: true,
            ..Self::default()
        }
    }

    /// Its entries: calls, labels and values seen.
    pub fn entries(&self) -> usize {
        self.calls.len() + self.labels.len() + self.seen.len()
    }

    /// The bytes it is charged: kept as it changes, not added up again.
    pub fn bytes(&self) -> usize {
        match self.held.0 {
            Some(held) => {
                debug_assert_eq!(held, self.count_bytes(), "bytes kept out of step");
                held
            }
            None => self.count_bytes(),
        }
    }

    /// The bytes it is charged, added up entry by entry.
    fn count_bytes(&self) -> usize {
        self.calls.iter().map(call_bytes).sum::<usize>()
            + self.labels.iter().map(label_bytes).sum::<usize>()
            + self.seen.iter().map(seen_bytes).sum::<usize>()
    }

    /// The bytes it is charged, counted once if not yet kept: before a
    /// change.
    fn held_bytes(&mut self) -> usize {
        match self.held.0 {
            Some(held) => held,
            None => {
                let held = self.count_bytes();
                self.held = Held(Some(held));
                held
            }
        }
    }

    fn charge(&mut self, bytes: usize) {
        let held = self.held_bytes() + bytes;
        self.held = Held(Some(held));
    }

    fn free(&mut self, bytes: usize) {
        let held = self.held_bytes().saturating_sub(bytes);
        self.held = Held(Some(held));
    }

    /// The sequence number of the next entry.
    fn next_seq(&mut self) -> u64 {
        self.seq = self.seq.saturating_add(1);
        self.seq
    }

    /// Drops the entries older than the bounds' age; returns how many.
    pub fn expire(&mut self, limits: &SessionLimits, now: u64) -> usize {
        let age = u64::try_from(limits.max_age.as_millis()).unwrap_or(u64::MAX);
        let cutoff = now.saturating_sub(age);
        let before = self.entries();
        let mut freed = 0;
        self.calls.retain(|c| {
            let keep = c.at >= cutoff;
            freed += if keep { 0 } else { call_bytes(c) };
            keep
        });
        self.labels.retain(|l| {
            let keep = l.at >= cutoff;
            freed += if keep { 0 } else { label_bytes(l) };
            keep
        });
        let seen = self.seen.len();
        self.seen.retain(|s| {
            let keep = s.at >= cutoff;
            freed += if keep { 0 } else { seen_bytes(s) };
            keep
        });
        self.values_lost += (seen - self.seen.len()) as u64;
        self.free(freed);
        let dropped = before - self.entries();
        self.evicted += dropped as u64;
        dropped
    }

    /// Applies `update` at `now` within `limits`.
    pub fn apply(&mut self, update: &Update, limits: &SessionLimits, now: u64) -> Applied {
        let whole = self.evicted == 0;
        let mut applied = Applied {
            evicted: self.expire(limits, now),
            ..Applied::default()
        };
        if self.dropped && self.calls_lost_at == 0 {
            self.calls_lost_at = now;
        }
        self.writes = self.writes.saturating_add(1);
        for call in &update.calls {
            self.charge(call_bytes(call));
            let seq = self.next_seq();
            self.calls.push_back(CallRan {
                at: now,
                seq,
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
            // Set again: it moves to the end, with this time, as if set
            // now (its age and its place in the eviction order start
            // again).
            let again = self.labels.iter().position(|l| &l.name == label);
            if let Some(old) = again.and_then(|i| self.labels.remove(i)) {
                self.free(label_bytes(&old));
            }
            let label = Label {
                name: label.clone(),
                at: now,
                seq: self.next_seq(),
            };
            self.charge(label_bytes(&label));
            if again.is_none() {
                applied.labels.push(label.name.clone());
            }
            self.labels.push_back(label);
        }
        if !update.seen.is_empty() {
            self.add_seen(&update.seen, now, &mut applied);
        }
        // `expire` counted its own drops; these are counted here.
        let mut dropped = 0;
        while self.labels.len() > limits.max_labels {
            if let Some(label) = self.labels.pop_front() {
                self.free(label_bytes(&label));
            }
            dropped += 1;
        }
        dropped += self.shrink(limits);
        self.evicted += dropped as u64;
        applied.evicted += dropped;
        applied.began_to_forget = whole && self.evicted > 0;
        self.updated = now;
        applied.entries = self.entries();
        applied.bytes = self.bytes();
        applied
    }

    /// Adds the values of `seen`, each once (a request of results brings
    /// several results in one update). A value seen before moves to the
    /// end with this time, as if seen now: its age and its place in the
    /// eviction order start again, so a value the model keeps reading is
    /// not forgotten by the age of its first reading (R34).
    fn add_seen(&mut self, seen: &[Seen], now: u64, applied: &mut Applied) {
        let mut unique: HashSet<(&str, &str)> = HashSet::with_capacity(seen.len());
        let fresh: Vec<&Seen> = seen
            .iter()
            .filter(|s| unique.insert((s.server.as_str(), s.digest.as_str())))
            .collect();
        let before = self.seen.len();
        let mut freed = 0;
        self.seen.retain(|s| {
            let again = unique.contains(&(s.server.as_str(), s.digest.as_str()));
            if again {
                freed += seen_bytes(s);
            }
            !again
        });
        let again = before - self.seen.len();
        self.free(freed);
        let first = self.seq;
        let fresh: Vec<Seen> = fresh
            .into_iter()
            .zip(1..)
            .map(|(s, n)| Seen {
                at: now,
                seq: first.saturating_add(n),
                ..s.clone()
            })
            .collect();
        self.seq = first.saturating_add(fresh.len() as u64);
        applied.seen = fresh.len().saturating_sub(again);
        self.charge(fresh.iter().map(seen_bytes).sum());
        self.seen.extend(fresh);
    }

    /// Drops the oldest entries until the session is within its entries
    /// and bytes; labels go last (a flood of values must not wash a label
    /// away before it washes away the values). Between a call and a value
    /// seen, the one recorded first goes: by sequence number, never by a
    /// tie of milliseconds (a call just recorded must outlive values seen
    /// before it, or its result would be refused). Entries stored without
    /// a sequence number (0) are older than every entry with one, and
    /// among themselves go by time. Returns how many.
    /// Drops the oldest call for a bound; its bytes.
    fn pop_call(&mut self) -> Option<usize> {
        let call = self.calls.pop_front()?;
        self.calls_lost_at = self.calls_lost_at.max(call.at);
        Some(call_bytes(&call))
    }

    fn shrink(&mut self, limits: &SessionLimits) -> usize {
        let mut bytes = self.held_bytes();
        let mut dropped = 0;
        while self.entries() > limits.max_entries || bytes > limits.max_bytes {
            let call = self.calls.front().map(|c| (c.seq, c.at));
            let seen = self.seen.front().map(|s| (s.seq, s.at));
            let freed = match (call, seen) {
                (Some(c), Some(s)) if c <= s => self.pop_call(),
                (Some(_), None) => self.pop_call(),
                (_, Some(_)) => self.seen.pop_front().map(|s| {
                    self.values_lost += 1;
                    seen_bytes(&s)
                }),
                (None, None) => self.labels.pop_front().map(|l| label_bytes(&l)),
            };
            let Some(freed) = freed else { break };
            bytes = bytes.saturating_sub(freed);
            dropped += 1;
        }
        self.held = Held(Some(bytes));
        dropped
    }
}

fn label_bytes(l: &Label) -> usize {
    l.name.len() + ENTRY_OVERHEAD
}

fn call_bytes(c: &CallRan) -> usize {
    c.id.len() + c.tool.len() + c.server.len() + c.args.len() + ENTRY_OVERHEAD
}

fn seen_bytes(s: &Seen) -> usize {
    s.server.len() + s.digest.len() + ENTRY_OVERHEAD
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn call(id: usize, tool: &str) -> CallRan {
        CallRan {
            id: format!("call-{id}"),
            tool: tool.to_owned(),
            server: "fs".to_owned(),
            args: "0123456789abcdef0123456789abcdef".to_owned(),
            at: 0,
            seq: 0,
        }
    }

    fn seen(n: usize) -> Seen {
        Seen {
            server: "fs".to_owned(),
            digest: format!("{n:032x}"),
            at: 0,
            seq: 0,
            folded: true,
        }
    }

    /// R34: a value seen again, or a label set again, starts its age and
    /// its place in the eviction order again: read again just before the
    /// memory's age, it is still remembered after the first reading's age
    /// has passed, and a flood of other values evicts the entries older
    /// than its last reading first. Its bytes are counted once.
    #[test]
    fn r34_a_value_seen_again_or_a_label_set_again_is_remembered_from_then() {
        let limits = SessionLimits {
            max_age: Duration::from_secs(100),
            max_entries: 4,
            ..SessionLimits::default()
        };
        let once = |seen: Vec<Seen>, labels: Vec<String>| Update {
            seen,
            labels,
            ..Update::default()
        };
        let mut memory = Memory::default();
        let t0 = 1_000_000;
        memory.apply(&once(vec![seen(1)], vec!["secret:fs".into()]), &limits, t0);
        memory.apply(&once(vec![seen(2)], Vec::new()), &limits, t0 + 1);
        // Seen and set again just before the age.
        let again = memory.apply(
            &once(vec![seen(1)], vec!["secret:fs".into()]),
            &limits,
            t0 + 99_000,
        );
        assert_eq!((again.seen, again.labels.len()), (0, 0), "counted as new");
        assert_eq!(memory.seen.len(), 1 + 1);
        assert_eq!(memory.bytes(), memory.count_bytes(), "bytes charged twice");
        // Past the first reading's age: value 1 and the label remain,
        // value 2 (seen once, at t0 + 1) is gone.
        memory.apply(&Update::default(), &limits, t0 + 101_000);
        let digests: Vec<&str> = memory.seen.iter().map(|s| s.digest.as_str()).collect();
        assert_eq!(
            digests,
            [seen(1).digest.as_str()],
            "value read again forgotten"
        );
        assert_eq!(memory.labels.len(), 1, "label set again forgotten");
        // A flood: the entries older than value 1's last reading go first.
        memory.apply(
            &once(vec![seen(3), seen(4)], Vec::new()),
            &limits,
            t0 + 102_000,
        );
        memory.apply(&once(vec![seen(1)], Vec::new()), &limits, t0 + 103_000);
        memory.apply(
            &once(vec![seen(5), seen(6)], Vec::new()),
            &limits,
            t0 + 104_000,
        );
        assert!(
            memory.seen.iter().any(|s| s.digest == seen(1).digest),
            "a value read again was washed out before older ones: {:?}",
            memory.seen
        );
        assert!(!memory.seen.iter().any(|s| s.digest == seen(3).digest));
    }

    /// The bytes kept as the memory changes are those its entries add up
    /// to, after every kind of change.
    fn in_step(memory: &Memory, after: &str) {
        assert_eq!(memory.held.0, Some(memory.count_bytes()), "after {after}");
        assert_eq!(memory.bytes(), memory.count_bytes(), "after {after}");
    }

    #[test]
    fn r34_the_bytes_kept_stay_in_step_through_inserts_evictions_and_expiry() {
        let limits = SessionLimits {
            max_bytes: 4 * 1024,
            max_entries: 40,
            max_labels: 3,
            max_age: Duration::from_secs(60),
            ..SessionLimits::default()
        };
        let mut memory = Memory::default();
        let mut now = 1_000_000;
        // Inserts of calls, labels (some twice, some refused) and values.
        for i in 0..10 {
            let update = Update {
                calls: vec![call(i, "fs.read")],
                labels: vec![format!("l{}", i % 5), "bad label!".to_owned()],
                seen: vec![seen(i), seen(i), seen(i + 1)],
                results: 1,
                read_at: None,
                lost_if_absent: false,
            };
            let applied = memory.apply(&update, &limits, now);
            assert_eq!(applied.bytes, memory.count_bytes());
            in_step(&memory, &format!("insert {i}"));
            now += 1;
        }
        assert_eq!(memory.labels.len(), 3, "labels past their bound went");
        // Evictions by entries, then by bytes.
        let many = Update {
            calls: (100..160).map(|i| call(i, "fs.write")).collect(),
            ..Update::default()
        };
        let applied = memory.apply(&many, &limits, now);
        assert!(applied.evicted > 0 && memory.entries() <= limits.max_entries);
        in_step(&memory, "eviction by entries");
        let wide = SessionLimits {
            max_entries: 1000,
            max_bytes: 1024,
            ..limits
        };
        let applied = memory.apply(&many, &wide, now);
        assert!(applied.evicted > 0 && memory.bytes() <= wide.max_bytes);
        in_step(&memory, "eviction by bytes");
        // Expiry of some entries, then of all.
        now += 30_000;
        memory.apply(&Update::default(), &limits, now);
        memory.apply(
            &Update {
                calls: vec![call(500, "fs.read")],
                labels: vec!["late".to_owned()],
                ..Update::default()
            },
            &limits,
            now,
        );
        now += 40_000;
        assert!(memory.expire(&limits, now) > 0);
        in_step(&memory, "partial expiry");
        assert_eq!(memory.entries(), 2, "only the late entries are left");
        now += 120_000;
        memory.expire(&limits, now);
        in_step(&memory, "full expiry");
        assert_eq!(memory.bytes(), 0);
    }

    #[test]
    fn r34_a_memory_read_from_a_store_counts_its_bytes_and_equals_the_one_written() {
        let limits = SessionLimits::default();
        let mut memory = Memory::default();
        let update = Update {
            calls: vec![call(1, "fs.read"), call(2, "fs.read")],
            labels: vec!["secret:fs".to_owned()],
            seen: vec![seen(1)],
            results: 1,
            read_at: None,
            lost_if_absent: false,
        };
        memory.apply(&update, &limits, 5);
        let stored = serde_json::to_string(&memory).unwrap();
        assert!(
            !stored.contains("held"),
            "the count is not stored: {stored}"
        );
        let mut read: Memory = serde_json::from_str(&stored).unwrap();
        assert_eq!(read, memory, "the count is no part of equality");
        assert_eq!(read.held.0, None);
        assert_eq!(read.bytes(), memory.bytes());
        read.apply(&update, &limits, 6);
        in_step(&read, "an update of a memory read from a store");
    }

    /// R34: the oldest entries go first, by the order they were recorded
    /// in, never by a tie of their milliseconds. A session at its byte
    /// bound fed calls and values in one millisecond keeps each call it
    /// has just recorded (its result, coming next, must find it).
    #[test]
    fn r34_a_full_session_never_evicts_the_call_it_just_recorded_on_a_millisecond_tie() {
        let limits = SessionLimits {
            max_bytes: 2 * 1024,
            ..SessionLimits::default()
        };
        let mut memory = Memory::default();
        let now = 1_000_000;
        // Values seen fill the session past its byte bound.
        memory.apply(
            &Update {
                seen: (0..100).map(seen).collect(),
                results: 1,
                ..Update::default()
            },
            &limits,
            now,
        );
        assert!(memory.evicted > 0, "the session is at its bound");
        for i in 0..50 {
            memory.apply(
                &Update {
                    calls: vec![call(i, "fs.read")],
                    ..Update::default()
                },
                &limits,
                now,
            );
            let id = format!("call-{i}");
            assert!(
                memory.calls.iter().any(|c| c.id == id),
                "update {i}: the call just recorded was evicted before older values"
            );
            in_step(&memory, &format!("call {i}"));
            // Its result's values, in the same millisecond.
            memory.apply(
                &Update {
                    seen: (1000 + 10 * i..1010 + 10 * i).map(seen).collect(),
                    results: 1,
                    ..Update::default()
                },
                &limits,
                now,
            );
            assert!(
                memory.calls.iter().any(|c| c.id == id),
                "update {i}: the call was evicted before values seen before it"
            );
            in_step(&memory, &format!("values {i}"));
        }
        assert!(memory.bytes() <= limits.max_bytes);
    }

    /// A memory stored before entries had sequence numbers still reads,
    /// and its entries are older than any recorded since.
    #[test]
    fn r34_a_memory_stored_without_sequence_numbers_reads_and_its_entries_go_first() {
        let stored = r#"{"calls":[{"id":"old","tool":"fs.read","server":"fs",
            "args":"00","at":5000}],"seen":[{"server":"fs","digest":"ab","at":5000}],
            "calls_total":1,"results_total":1,"updated":5000}"#;
        let mut memory: Memory = serde_json::from_str(stored).unwrap();
        let limits = SessionLimits {
            max_entries: 3,
            ..SessionLimits::default()
        };
        // Recorded at an earlier millisecond (the clock stepped back).
        memory.apply(
            &Update {
                calls: vec![call(1, "fs.read"), call(2, "fs.read")],
                ..Update::default()
            },
            &limits,
            4000,
        );
        let ids: Vec<&str> = memory.calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["call-1", "call-2"], "the stored call went first");
        assert_eq!(memory.seen.len(), 1);
        assert_eq!(memory.evicted, 1);
        in_step(
            &memory,
            "an update of a memory stored without sequence numbers",
        );
    }

    #[test]
    fn r34_an_update_says_when_the_session_first_loses_entries() {
        let limits = SessionLimits {
            max_entries: 4,
            ..SessionLimits::default()
        };
        let mut memory = Memory::default();
        let firsts: Vec<bool> = (0..10)
            .map(|i| {
                let update = Update {
                    calls: vec![call(i, "fs.read")],
                    ..Update::default()
                };
                memory
                    .apply(&update, &limits, 10 + i as u64)
                    .began_to_forget
            })
            .collect();
        // The fifth call is the first past the bound, the only one said.
        let expected: Vec<bool> = (0..10).map(|i| i == 4).collect();
        assert_eq!(firsts, expected);
        assert_eq!(memory.evicted, 6);
    }
}
