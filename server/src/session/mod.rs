//! Session memory (R34): what the mesh remembers of a session across its
//! batches, so that rules can judge flows ("a value read from server A is
//! being sent to server B"), rates and budgets.
//!
//! * [`key`]: whose memory: the caller's identity *and* the session id;
//! * [`memory`]: one session's memory (calls, labels, digests of values
//!   seen, counters), bounded in bytes, entries and age;
//! * [`digest`]: values seen kept only as keyed digests (HMAC-SHA256 under
//!   the mesh's session secret), short values not at all;
//! * [`encodings`]: the forms of a sent value `seen_from` also looks up
//!   (another ASCII case, URL path segments, percent-escapes, base64, hex);
//! * [`view`]: a session's memory as a batch reads it (`session.*` in CEL);
//! * [`store`]: the [`SessionStore`] trait; [`local`]: in the mesh's memory
//!   (a single mesh); [`etcd`]: shared by replicas through the registry's
//!   etcd; [`redis`]: shared through Redis or Valkey;
//! * [`secret`]: the session secret replicas that share a store share;
//! * [`limits`]: the bounds.
//!
//! [`SessionMemory`] is what the mesh holds: a store, the secret and the
//! bounds. Per batch that needs it, one read before the guards are
//! consulted and one write after the decision (the calls that run, the
//! labels that rules and verdicts set).

pub mod digest;
pub mod encodings;
pub mod etcd;
mod filter;
pub mod key;
pub mod limits;
pub mod local;
pub mod memory;
pub mod redis;
pub mod secret;
pub mod store;
pub mod view;

#[cfg(test)]
mod tests;

pub use digest::{Digester, MIN_VALUE_CHARS};
pub use key::{IDENTITY_SESSION_ID, SessionKey, is_reserved_session_id};
pub use limits::SessionLimits;
pub use local::LocalStore;
pub use memory::{Applied, CallRan, Memory, Seen, Update};
pub use store::{Put, SessionStore, StoreError, Write};
pub use view::SessionView;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The default deadline of one store operation.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(500);

/// Session memory: a store, the secret its digests are keyed with, and the
/// bounds.
#[derive(Debug)]
pub struct SessionMemory {
    store: Arc<dyn SessionStore>,
    digester: Digester,
    limits: SessionLimits,
    timeout: Duration,
    stats: Stats,
    /// In a store replicas share, the sessions this mesh wrote within the
    /// age: one the store no longer holds reads as lost (R34).
    written: Option<Mutex<filter::SessionFilter>>,
}

/// What session memory did since the mesh began.
#[derive(Debug, Default)]
pub struct Stats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub failures: AtomicU64,
    pub evicted_entries: AtomicU64,
    /// Writes that found the memory changed by another replica since the
    /// batch read it (the batch was judged again).
    pub changed: AtomicU64,
    /// Reads of a session this mesh wrote that the shared store no longer
    /// held (read as lost).
    pub lost_sessions: AtomicU64,
}

/// Why a result was not recorded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ResultError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No call with that id and tool ran in this session (within the
    /// memory's age): a result for a call never made, or made in another
    /// session, washes nothing and teaches nothing.
    #[error("no call {call_id:?} of tool {tool:?} ran in this session")]
    NoSuchCall { call_id: String, tool: String },
    /// The result names another server than the one its call was recorded
    /// with (R34: a result belongs to the server of the call it answers).
    #[error(
        "the result of call {:?} names server {:?}, but its call was recorded as a call to \
         server {:?}",
        .0.call_id, .0.sent, .0.recorded
    )]
    OtherServer(Mismatch),
    /// The result names the id of a call that ran in this session, but
    /// another tool than the one the call was recorded with.
    #[error(
        "the result of call {:?} names tool {:?}, but the call was recorded as a call of \
         tool {:?}",
        .0.call_id, .0.sent, .0.recorded
    )]
    OtherTool(Mismatch),
    #[error("the result is not JSON: {0}")]
    NotJson(String),
}

/// A result's call as the result named it against what the call was
/// recorded with ([`ResultError::OtherServer`], [`ResultError::OtherTool`]).
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// The call id the result named.
    pub call_id: String,
    /// The server or tool the result named.
    pub sent: String,
    /// The server or tool its call was recorded with.
    pub recorded: String,
}

/// One result read in a session, for [`SessionMemory::results_seen`].
#[derive(Debug, Clone, Copy)]
pub struct ResultSeen<'a> {
    /// The id and tool of the call it is the result of.
    pub call_id: &'a str,
    pub tool: &'a str,
    /// The server the result named (empty when unknown). Its values are
    /// remembered from the server its call was recorded with (R34).
    pub server: &'a str,
    /// The result as the model reads it (JSON).
    pub result_json: &'a str,
    /// Labels a result verdict set.
    pub labels: &'a [String],
}

/// What [`SessionMemory::results_seen`] did.
#[derive(Debug, Clone, Default)]
pub struct ResultsSeen {
    /// The update of the session, when a result was kept.
    pub applied: Option<Applied>,
    /// Per result, in order: kept, or why not.
    pub outcomes: Vec<Result<(), ResultError>>,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SessionMemory {
    pub fn new(store: Arc<dyn SessionStore>, digester: Digester, limits: SessionLimits) -> Self {
        let written = store
            .shared()
            .then(|| Mutex::new(filter::SessionFilter::new(&limits)));
        Self {
            written,
            store,
            digester,
            limits,
            timeout: DEFAULT_STORE_TIMEOUT,
            stats: Stats::default(),
        }
    }

    /// In the mesh's memory, keyed with a random secret: a single mesh.
    pub fn in_memory(limits: SessionLimits) -> Self {
        Self::new(
            Arc::new(LocalStore::new(limits)),
            Digester::random(),
            limits,
        )
    }

    /// With `timeout` as the deadline of each store operation.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn limits(&self) -> &SessionLimits {
        &self.limits
    }

    /// The name a shared store knows `key` by: a keyed digest of the
    /// identity and the session id (64 hex digits).
    pub fn stored_name(&self, key: &SessionKey) -> String {
        key.stored_name(&self.digester)
    }

    /// The prefix approval requests (R35) of `key` are stored under: 16 hex
    /// digits naming its identity alone (keyed), then 16 of its session's
    /// stored name. An identity's requests share the first half, a
    /// session's the whole.
    pub fn approval_prefix(&self, key: &SessionKey) -> String {
        let identity = self
            .digester
            .session_name(&format!("approvals-identity\0{}", key.identity));
        let session = self.stored_name(key);
        format!("{}{}", &identity[..16], &session[..16])
    }

    pub fn store(&self) -> &dyn SessionStore {
        self.store.as_ref()
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub(crate) async fn bounded<T>(
        &self,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(self.timeout, op).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::TimedOut(self.timeout)),
        };
        if let Err(StoreError::Changed) = &result {
            // Not a failure: the batch is judged again (R34).
            self.stats.changed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                store = self.store.kind(),
                "session memory changed by another replica since it was read"
            );
        } else if let Err(error) = &result {
            self.stats.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(store = self.store.kind(), %error, "session memory unavailable");
        }
        result
    }

    /// The memory of `key` as a batch reads it. An error is never read as
    /// an empty session (R34).
    pub async fn read(&self, key: &SessionKey) -> Result<Arc<SessionView>, StoreError> {
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        let now = now_ms();
        let mut memory = self.bounded(self.store.snapshot(key)).await?;
        if memory.is_none() && self.wrote(key, now) {
            // R34: the store lost a session this mesh wrote within the age
            // (a restart without persistence, a flush, an eviction): read
            // as lost, never as new.
            self.stats.lost_sessions.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                store = self.store.kind(),
                "session memory: the store no longer holds a session this mesh wrote \
                 within the memory's age; it reads as a session that lost its memory"
            );
            memory = Some(Arc::new(Memory::dropped_for_room()));
        }
        Ok(Arc::new(match memory {
            Some(memory) => {
                SessionView::new(memory, self.digester.clone(), now, self.limits.max_age)
            }
            None => SessionView::empty(self.digester.clone(), now),
        }))
    }

    /// Whether this mesh wrote `key` to a store replicas share within the
    /// memory's age before `now`.
    fn wrote(&self, key: &SessionKey, now: u64) -> bool {
        self.written.as_ref().is_some_and(|written| {
            written
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(key, now, self.max_age_ms())
        })
    }

    fn max_age_ms(&self) -> u64 {
        u64::try_from(self.limits.max_age.as_millis()).unwrap_or(u64::MAX)
    }

    /// Adds `update` to the memory of `key`. In a store replicas share, a
    /// session this mesh wrote within the age that the store no longer
    /// holds begins again as one that lost its memory (R34).
    pub async fn record(&self, key: &SessionKey, update: &Update) -> Result<Applied, StoreError> {
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        let now = now_ms();
        let update = if !update.lost_if_absent && self.wrote(key, now) {
            std::borrow::Cow::Owned(Update {
                lost_if_absent: true,
                ..update.clone()
            })
        } else {
            std::borrow::Cow::Borrowed(update)
        };
        let applied = self
            .bounded(self.store.update(
                key,
                Write {
                    update: &update,
                    limits: &self.limits,
                    now,
                },
            ))
            .await?;
        if let Some(written) = &self.written {
            written
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(key, now, self.max_age_ms());
        }
        if applied.evicted > 0 {
            self.stats
                .evicted_entries
                .fetch_add(applied.evicted as u64, Ordering::Relaxed);
        }
        // At `info` once per session, when it first loses entries: a
        // session at its bounds drops some at every batch from then on (a
        // line per batch would flood the log); those are counted above and
        // in the session's own count (`session.evicted`), and logged at
        // `debug`.
        if applied.began_to_forget {
            tracing::info!(
                evicted = applied.evicted,
                entries = applied.entries,
                bytes = applied.bytes,
                "session memory: the oldest entries were dropped to stay within bounds \
                 (logged once per session; later drops are counted, and logged at debug)"
            );
        } else if applied.evicted > 0 {
            tracing::debug!(
                evicted = applied.evicted,
                entries = applied.entries,
                bytes = applied.bytes,
                "session memory: the oldest entries were dropped to stay within bounds"
            );
        }
        Ok(applied)
    }

    /// A call that runs: its final arguments kept as a keyed digest of
    /// their canonical JSON, never as text.
    pub fn call(&self, id: &str, tool: &str, server: &str, arguments: &str) -> CallRan {
        let canonical = serde_json::from_str::<serde_json::Value>(arguments)
            .map_or_else(|_| arguments.to_owned(), |v| v.to_string());
        CallRan {
            id: id.to_owned(),
            tool: tool.to_owned(),
            server: server.to_owned(),
            args: digest::to_hex(&self.digester.digest(&canonical)),
            at: 0,
            seq: 0,
        }
    }

    /// The digests of the values of a result from `server` (every string
    /// in it, and their tokens, long enough; at most
    /// `max_values_per_result`). Returns them and whether some were left
    /// out.
    pub fn seen(&self, server: &str, result: &serde_json::Value) -> (Vec<Seen>, bool) {
        let max = self.limits.max_values_per_result;
        let mut digests = Vec::new();
        let mut cut = false;
        let mut stack = vec![result];
        while let Some(value) = stack.pop() {
            match value {
                serde_json::Value::String(text) => {
                    cut |= self.digester.of_value(text, max, &mut digests);
                }
                serde_json::Value::Array(items) => stack.extend(items.iter().rev()),
                serde_json::Value::Object(members) => stack.extend(members.values().rev()),
                _ => {}
            }
            if cut {
                break;
            }
        }
        let seen = digests
            .iter()
            .map(|d| Seen {
                server: server.to_owned(),
                digest: digest::to_hex(d),
                at: 0,
                seq: 0,
                folded: true,
            })
            .collect();
        (seen, cut)
    }

    /// The hook of the results phase (R33) for one result: see
    /// [`SessionMemory::results_seen`].
    pub async fn result_seen(
        &self,
        key: &SessionKey,
        call_id: &str,
        tool: &str,
        server: &str,
        result_json: &str,
        labels: &[String],
    ) -> Result<Applied, ResultError> {
        let seen = self
            .results_seen(
                key,
                &[ResultSeen {
                    call_id,
                    tool,
                    server,
                    result_json,
                    labels,
                }],
            )
            .await?;
        match seen.outcomes.into_iter().next() {
            Some(Err(error)) => Err(error),
            _ => Ok(seen.applied.unwrap_or_default()),
        }
    }

    /// The hook of the results phase (R33) for a request of results, read
    /// in the session `key`: each result's values are remembered as
    /// digests, from the server its call was recorded with (R34), with its
    /// `labels` (a result verdict's). A result for a call that did not run
    /// in this session ([`ResultError::NoSuchCall`]), one naming another
    /// server than its call's ([`ResultError::OtherServer`]) or one that is
    /// not JSON is refused on its own; the others are kept. One load and at
    /// most one update of the session for the whole request, however many
    /// results it holds. A store that cannot answer fails the whole
    /// request.
    pub async fn results_seen(
        &self,
        key: &SessionKey,
        results: &[ResultSeen<'_>],
    ) -> Result<ResultsSeen, StoreError> {
        if results.is_empty() {
            return Ok(ResultsSeen::default());
        }
        let view = self.read(key).await?;
        let calls: Vec<Result<String, ResultError>> = results
            .iter()
            .map(|r| {
                view.call_answered(r.call_id, r.tool, r.server)
                    .map(str::to_owned)
            })
            .collect();
        // The snapshot is let go before the write: a store in this
        // process then updates the memory in place, without copying it.
        drop(view);
        self.remember_results(key, results, calls, Vec::new(), None)
            .await
    }

    /// Remembers a request of results in the session `key`, its calls
    /// already looked up ([`SessionView::call_answered`]): `calls[i]` is
    /// the server result `i`'s call was recorded with (its values are
    /// remembered from it, whatever server the result named), or why the
    /// result is not remembered. `labels` are the batch's (its guards'
    /// verdicts'), added in the same update. At most one update; none when
    /// nothing is to be remembered. `read_at`: see [`Update::read_at`].
    pub async fn remember_results(
        &self,
        key: &SessionKey,
        results: &[ResultSeen<'_>],
        calls: Vec<Result<String, ResultError>>,
        labels: Vec<String>,
        read_at: Option<u64>,
    ) -> Result<ResultsSeen, StoreError> {
        let mut update = Update {
            labels,
            read_at,
            ..Update::default()
        };
        let outcomes: Vec<Result<(), ResultError>> = results
            .iter()
            .zip(calls)
            .map(|(r, server)| self.one_result(&server?, r, &mut update))
            .collect();
        if update.results == 0 && update.labels.is_empty() {
            return Ok(ResultsSeen {
                applied: None,
                outcomes,
            });
        }
        let applied = self.record(key, &update).await?;
        Ok(ResultsSeen {
            applied: Some(applied),
            outcomes,
        })
    }

    /// Adds one result, of a call that ran and was recorded with `server`,
    /// to `update`.
    fn one_result(
        &self,
        server: &str,
        r: &ResultSeen<'_>,
        update: &mut Update,
    ) -> Result<(), ResultError> {
        let result: serde_json::Value =
            serde_json::from_str(r.result_json).map_err(|e| ResultError::NotJson(e.to_string()))?;
        let (seen, cut) = self.seen(server, &result);
        if cut {
            tracing::info!(
                server,
                limit = self.limits.max_values_per_result,
                "session memory: a result held more values than are kept of one result"
            );
        }
        update.seen.extend(seen);
        update.labels.extend_from_slice(r.labels);
        update.results += 1;
        Ok(())
    }

    /// The server a call's tool belongs to: the batch's metadata `server`
    /// when given (the MCP gateway knows its upstream), else the tool
    /// name's part before its first `.` (`fs.read_file`: `fs`), else
    /// empty.
    pub fn server_of<'a>(tool: &'a str, metadata_server: Option<&'a str>) -> &'a str {
        match metadata_server {
            Some(server) if !server.is_empty() => server,
            _ => tool.split_once('.').map_or("", |(server, _)| server),
        }
    }
}
