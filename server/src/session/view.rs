//! A session's memory as one batch reads it: labels, calls by tool and
//! time, and an index of the digests of values seen by server. Built once
//! per batch that needs it, shared by every rule and guard of the batch.

use super::digest::{self, Digest, Digester};
use super::encodings;
use super::memory::{CallRan, Memory};
use crate::wire::fields::{map_entry, session_call, session_memory};
use crate::wire::write;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Most forms of one argument value a `seen_from` question digests (its
/// pieces, and the forms `session::encodings` finds in them): past it the
/// question is an error (the call's own size, R13), never a "no".
pub const MAX_TOKENS_CHECKED: usize = 16_384;

/// Most labels, tools in `counts` and recent calls a guard is sent (R34).
pub const GUARD_MAX_ITEMS: usize = 64;

/// Most bytes of the session memory a guard is sent (R34).
pub const GUARD_MAX_BYTES: usize = 16 * 1024;

/// A read-only view of one session's memory: the memory as the store
/// handed it out (shared, not copied), the entries older than its age left
/// out as they are read. The index of values seen is built the first time
/// a rule asks about them, not for every batch.
#[derive(Debug, Clone)]
pub struct SessionView {
    memory: Arc<Memory>,
    /// Entries before it (ms since the epoch) are past the memory's age.
    cutoff: u64,
    labels: Vec<String>,
    seen: OnceLock<SeenIndex>,
    now: u64,
    digester: Digester,
}

/// The digests of values seen within the age, each with the servers it
/// was seen from; and whether one was kept as read (not in ASCII lower
/// case) by an earlier version.
#[derive(Debug, Clone, Default)]
struct SeenIndex {
    digests: HashMap<Digest, Vec<String>>,
    as_read: bool,
}

/// Why a count of calls could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CountError {
    #[error("its tool glob does not compile")]
    Glob(globset::Error),
    /// The memory dropped calls that ran within the window.
    #[error(
        "the session's memory dropped calls that ran within the window (a bound, or the \
         session lost), so a count over it would be too low"
    )]
    Forgotten,
}

/// A `seen_from` question over more text than it may digest.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the value holds more than {MAX_TOKENS_CHECKED} tokens to compare with values seen")]
pub struct TooManyTokens;

impl SessionView {
    /// The view of `memory` at `now`; entries older than `max_age` are not
    /// in it.
    pub fn new(memory: Arc<Memory>, digester: Digester, now: u64, max_age: Duration) -> Self {
        let cutoff = now.saturating_sub(u64::try_from(max_age.as_millis()).unwrap_or(u64::MAX));
        let labels = memory
            .labels
            .iter()
            .filter(|l| l.at >= cutoff)
            .map(|l| l.name.clone())
            .collect();
        Self {
            memory,
            cutoff,
            labels,
            seen: OnceLock::new(),
            now,
            digester,
        }
    }

    /// An empty session (nothing remembered yet).
    /// The updates applied to the memory when it was read
    /// ([`Memory::writes`]): what a batch judged on it writes with
    /// ([`super::Update::read_at`]).
    pub fn writes(&self) -> u64 {
        self.memory.writes
    }

    pub fn empty(digester: Digester, now: u64) -> Self {
        Self::new(Arc::default(), digester, now, Duration::ZERO)
    }

    /// The digests of values seen within the age, indexed.
    fn seen(&self) -> &SeenIndex {
        self.seen.get_or_init(|| {
            let mut seen = SeenIndex::default();
            for s in self.memory.seen.iter().filter(|s| s.at >= self.cutoff) {
                if let Some(d) = digest::from_hex(&s.digest) {
                    seen.as_read |= !s.folded;
                    let servers = seen.digests.entry(d).or_default();
                    if !servers.contains(&s.server) {
                        servers.push(s.server.clone());
                    }
                }
            }
            seen
        })
    }

    /// The calls remembered within the age, oldest first.
    fn live_calls(&self) -> impl Iterator<Item = &CallRan> {
        self.memory.calls.iter().filter(|c| c.at >= self.cutoff)
    }

    /// The server of the call a result answers, as this session recorded
    /// it (R34: a result belongs to the server of the call it answers):
    /// the call `call_id` of `tool` remembered within the age (the latest,
    /// if the id was used again). `sent` is the server the result named:
    /// empty (unknown) or the recorded one in any ASCII case is the
    /// recorded one; another is [`ResultError::OtherServer`]. A call
    /// recorded without a server (a tool name without a `.` and no
    /// metadata `server`) takes the one its result names. A result that
    /// names the id of a call that ran but another tool is
    /// [`ResultError::OtherTool`] (its values would otherwise be passed
    /// unremembered). A result whose call did not run in this session is
    /// [`ResultError::NoSuchCall`].
    pub fn call_answered<'a>(
        &'a self,
        call_id: &str,
        tool: &str,
        sent: &'a str,
    ) -> Result<&'a str, super::ResultError> {
        let Some(call) = self.live_calls().filter(|c| c.id == call_id).last() else {
            return Err(super::ResultError::NoSuchCall {
                call_id: call_id.to_owned(),
                tool: tool.to_owned(),
            });
        };
        if call.tool != tool {
            return Err(super::ResultError::OtherTool(super::Mismatch {
                call_id: call_id.to_owned(),
                sent: tool.to_owned(),
                recorded: call.tool.clone(),
            }));
        }
        if call.server.is_empty() {
            Ok(sent)
        } else if sent.is_empty() || sent.eq_ignore_ascii_case(&call.server) {
            Ok(&call.server)
        } else {
            Err(super::ResultError::OtherServer(super::Mismatch {
                call_id: call_id.to_owned(),
                sent: sent.to_owned(),
                recorded: call.server.clone(),
            }))
        }
    }

    /// Its labels, oldest first.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Entries its bounds dropped since the session began: a strict rule
    /// may treat a session that lost memory as tainted.
    pub fn evicted(&self) -> u64 {
        self.memory.evicted
    }

    /// Values seen that the memory no longer holds (a bound, the age, or
    /// the whole session lost): a value read then may be sent on unseen.
    pub fn values_lost(&self) -> u64 {
        self.memory.values_lost
    }

    /// Whether the session was dropped to make room for others and came
    /// back: what it held before is lost (its `evicted` counts it too).
    pub fn dropped(&self) -> bool {
        self.memory.dropped
    }

    /// Calls recorded since the session began.
    pub fn calls_total(&self) -> u64 {
        self.memory.calls_total
    }

    /// The calls remembered: tool, server, time (ms since the epoch).
    pub fn calls(&self) -> impl Iterator<Item = (&str, &str, u64)> {
        self.live_calls()
            .map(|c| (c.tool.as_str(), c.server.as_str(), c.at))
    }

    /// The session's memory as a guard is sent it (R34): labels, counts
    /// per tool, the most recent calls (tool, server, digest of the
    /// arguments, time), counters; never a value, and no digest of values
    /// seen. Within [`GUARD_MAX_ITEMS`] labels, tools and calls and
    /// [`GUARD_MAX_BYTES`] in all: the oldest calls are left out first,
    /// then the oldest labels, and `truncated` says so.
    pub fn for_guard(&self) -> guardmesh_proto::v1::SessionMemory {
        use guardmesh_proto::v1::{SessionCall, SessionMemory};
        use prost::Message;
        let calls: Vec<&CallRan> = self.live_calls().collect();
        let (counts, _, mut truncated) = tool_counts(calls.iter().copied());
        let skip_calls = calls.len().saturating_sub(GUARD_MAX_ITEMS);
        let skip_labels = self.labels.len().saturating_sub(GUARD_MAX_ITEMS);
        truncated |= skip_calls > 0 || skip_labels > 0;
        let mut memory = SessionMemory {
            labels: self.labels[skip_labels..].to_vec(),
            counts: counts
                .into_iter()
                .map(|(tool, n)| (tool.to_owned(), n))
                .collect(),
            recent: calls
                .iter()
                .skip(skip_calls)
                .map(|c| SessionCall {
                    tool: c.tool.clone(),
                    server: c.server.clone(),
                    args_digest: c.args.clone(),
                    at_ms: c.at,
                })
                .collect(),
            calls_total: self.memory.calls_total,
            results_total: self.memory.results_total,
            evicted: self.memory.evicted > 0,
            truncated,
            unavailable: String::new(),
            dropped: self.memory.dropped,
        };
        while memory.encoded_len() > GUARD_MAX_BYTES {
            memory.truncated = true;
            if !memory.recent.is_empty() {
                memory.recent.remove(0);
            } else if !memory.labels.is_empty() {
                memory.labels.remove(0);
            } else {
                memory.counts.clear();
            }
        }
        memory
    }

    /// [`SessionView::for_guard`] encoded as the field `tag` of the
    /// message it goes in, appended to `buf`: the same message, left out
    /// and truncated the same way, written straight from the memory (no
    /// string is copied but into `buf`). What a batch sends its guards.
    pub fn encode_for_guard(&self, tag: u32, buf: &mut Vec<u8>) {
        use session_memory::{
            CALLS_TOTAL, COUNTS, DROPPED, EVICTED, LABELS, RECENT, RESULTS_TOTAL, TRUNCATED,
        };
        // The calls are walked, not collected: once to count them, then
        // from the first one sent.
        let (mut counts, live, mut truncated) = tool_counts(self.live_calls());
        let mut skip_calls = live.saturating_sub(GUARD_MAX_ITEMS);
        let mut skip_labels = self.labels.len().saturating_sub(GUARD_MAX_ITEMS);
        truncated |= skip_calls > 0 || skip_labels > 0;
        let mut recent_bytes: usize = self.live_calls().skip(skip_calls).map(recent_len).sum();
        let mut oldest_sent = self.live_calls().skip(skip_calls);
        let mut labels_bytes: usize = self.labels[skip_labels..]
            .iter()
            .map(|l| write::string_len(LABELS, l, false))
            .sum();
        let mut counts_bytes: usize = counts.iter().map(|(t, n)| count_len(t, *n)).sum();
        let totals = write::varint_len(CALLS_TOTAL, self.memory.calls_total)
            + write::varint_len(RESULTS_TOTAL, self.memory.results_total)
            + write::varint_len(EVICTED, u64::from(self.memory.evicted > 0))
            + write::varint_len(DROPPED, u64::from(self.memory.dropped));
        let len = |labels: usize, counts: usize, recent: usize, truncated: bool| {
            labels + counts + recent + totals + write::varint_len(TRUNCATED, u64::from(truncated))
        };
        // As `for_guard`: the oldest calls go first, then the oldest
        // labels, then the counts.
        while len(labels_bytes, counts_bytes, recent_bytes, truncated) > GUARD_MAX_BYTES {
            truncated = true;
            if let Some(call) = oldest_sent.next() {
                recent_bytes -= recent_len(call);
                skip_calls += 1;
            } else if skip_labels < self.labels.len() {
                labels_bytes -= write::string_len(LABELS, &self.labels[skip_labels], false);
                skip_labels += 1;
            } else if !counts.is_empty() {
                counts.clear();
                counts_bytes = 0;
            } else {
                break;
            }
        }
        let total = len(labels_bytes, counts_bytes, recent_bytes, truncated);
        buf.reserve(total + 2 * prost::encoding::key_len(tag) + 8);
        write::header(tag, total, buf);
        for label in &self.labels[skip_labels..] {
            write::string(LABELS, label, false, buf);
        }
        for (tool, n) in &counts {
            write::header(COUNTS, count_body(tool, *n), buf);
            write::string(map_entry::KEY, tool, true, buf);
            write::varint(map_entry::VALUE, u64::from(*n), buf);
        }
        for call in self.live_calls().skip(skip_calls) {
            write::header(RECENT, recent_body(call), buf);
            write::string(session_call::TOOL, &call.tool, true, buf);
            write::string(session_call::SERVER, &call.server, true, buf);
            write::string(session_call::ARGS_DIGEST, &call.args, true, buf);
            write::varint(session_call::AT_MS, call.at, buf);
        }
        write::varint(CALLS_TOTAL, self.memory.calls_total, buf);
        write::varint(RESULTS_TOTAL, self.memory.results_total, buf);
        write::varint(EVICTED, u64::from(self.memory.evicted > 0), buf);
        write::varint(TRUNCATED, u64::from(truncated), buf);
        write::varint(DROPPED, u64::from(self.memory.dropped), buf);
    }

    /// Calls of a tool matching `glob` (ASCII case ignored, as guards'
    /// tool patterns, R9) that ran within `window` before now.
    /// [`CountError::Forgotten`] when the memory dropped calls that ran
    /// within the window (a bound, or the whole session lost): the count
    /// would be too low (R34: forgetting is never innocence).
    pub fn count(&self, glob: &str, window: Duration) -> Result<u64, CountError> {
        self.count_with(glob, window, &[])
    }

    /// [`SessionView::count`], plus those of `earlier` (the tools of the
    /// calls before the one judged in its own batch, which have not run
    /// yet, R34) that match `glob`.
    pub fn count_with(
        &self,
        glob: &str,
        window: Duration,
        earlier: &[String],
    ) -> Result<u64, CountError> {
        let matcher = globset::GlobBuilder::new(glob)
            .case_insensitive(true)
            .build()
            .map_err(CountError::Glob)?
            .compile_matcher();
        let since = self
            .now
            .saturating_sub(u64::try_from(window.as_millis()).unwrap_or(u64::MAX));
        let lost_at = match self.memory.calls_lost_at {
            // Found lost, not yet written again: lost until now.
            0 if self.memory.dropped => self.now,
            at => at,
        };
        if lost_at != 0 && lost_at >= since {
            return Err(CountError::Forgotten);
        }
        let ran = self
            .live_calls()
            .filter(|c| c.at >= since && matcher.is_match(&c.tool))
            .count();
        let before = earlier
            .iter()
            .filter(|t| matcher.is_match(t.as_str()))
            .count();
        Ok((ran + before) as u64)
    }

    /// Whether one of `texts` (or a token in it, in any ASCII case, or in
    /// one of the forms `session::encodings` follows) is a value seen in a
    /// result from `server` (`*`: any server; ASCII case ignored).
    pub fn seen_from<'t>(
        &self,
        texts: impl IntoIterator<Item = &'t str>,
        server: &str,
    ) -> Result<bool, TooManyTokens> {
        self.seen_where(texts, |s| server == "*" || s.eq_ignore_ascii_case(server))
    }

    /// Whether one of `texts` is a value seen in a result from a server
    /// other than `server`.
    pub fn seen_from_other<'t>(
        &self,
        texts: impl IntoIterator<Item = &'t str>,
        server: &str,
    ) -> Result<bool, TooManyTokens> {
        self.seen_where(texts, |s| !s.eq_ignore_ascii_case(server))
    }

    fn seen_where<'t>(
        &self,
        texts: impl IntoIterator<Item = &'t str>,
        server: impl Fn(&str) -> bool,
    ) -> Result<bool, TooManyTokens> {
        if self.memory.seen.is_empty() {
            return Ok(false);
        }
        let seen = self.seen();
        if seen.digests.is_empty() {
            return Ok(false);
        }
        let found = |d: &Digest| {
            seen.digests
                .get(d)
                .is_some_and(|servers| servers.iter().any(|s| server(s)))
        };
        let mut checked = 0;
        let mut too_many = false;
        let mut visit = |form: &str, as_sent: bool| {
            checked += 1;
            if checked > MAX_TOKENS_CHECKED {
                too_many = true;
                return ControlFlow::Break(());
            }
            // Values seen are kept in ASCII lower case; while the memory
            // holds one an earlier version kept as read, a form as sent is
            // also looked up as it is.
            if found(&self.digester.folded(form))
                || (as_sent
                    && seen.as_read
                    && form.bytes().any(|b| b.is_ascii_uppercase())
                    && found(&self.digester.digest(form)))
            {
                return ControlFlow::Break(());
            }
            ControlFlow::Continue(())
        };
        for text in texts {
            for piece in digest::pieces(text) {
                if encodings::forms(piece, &mut visit).is_break() {
                    return if too_many {
                        Err(TooManyTokens)
                    } else {
                        Ok(true)
                    };
                }
            }
        }
        Ok(false)
    }
}

// The lengths of `SessionMemory`'s nested fields, written by hand as prost
// writes them (`wire::write`): a map entry leaves out a key or value at its
// default, as a `SessionCall` its fields.

/// An entry of `counts`, within it.
fn count_body(tool: &str, n: u32) -> usize {
    write::string_len(map_entry::KEY, tool, true)
        + write::varint_len(map_entry::VALUE, u64::from(n))
}

fn count_len(tool: &str, n: u32) -> usize {
    write::nested_len(session_memory::COUNTS, count_body(tool, n))
}

/// A `SessionCall` of `recent`, within it.
fn recent_body(call: &CallRan) -> usize {
    write::string_len(session_call::TOOL, &call.tool, true)
        + write::string_len(session_call::SERVER, &call.server, true)
        + write::string_len(session_call::ARGS_DIGEST, &call.args, true)
        + write::varint_len(session_call::AT_MS, call.at)
}

fn recent_len(call: &CallRan) -> usize {
    write::nested_len(session_memory::RECENT, recent_body(call))
}

/// A window as rules write it: `30s`, `15m`, `1h`, `7d`, `500ms`.
pub fn parse_window(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let ms = match unit {
        "ms" => n,
        "s" => n.checked_mul(1000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The calls per tool of `calls` (at most [`GUARD_MAX_ITEMS`] tools, in
/// name order), how many calls there are, and whether a tool was left out.
fn tool_counts<'a>(
    calls: impl Iterator<Item = &'a CallRan>,
) -> (std::collections::BTreeMap<&'a str, u32>, usize, bool) {
    let mut counts: std::collections::BTreeMap<&str, u32> = Default::default();
    let mut live = 0;
    let mut truncated = false;
    for call in calls {
        live += 1;
        let tool = call.tool.as_str();
        if let Some(n) = counts.get_mut(tool) {
            *n = n.saturating_add(1);
        } else if counts.len() < GUARD_MAX_ITEMS {
            counts.insert(tool, 1);
        } else {
            truncated = true;
        }
    }
    (counts, live, truncated)
}
