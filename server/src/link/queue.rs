//! What a guard link holds for a guard: the requests written to its stream
//! once the stream can take them, bounded in bytes in all and per client
//! (R25), as a pure admission rule that takes the time as an argument.
//!
//! * A request is always admitted to an empty queue, whatever its size.
//! * Otherwise the queue holds at most `limit` bytes in all, and one client
//!   (a coordinator connection) at most `share` bytes of it, unless it holds
//!   nothing yet: a client always gets one request in, so one client
//!   cannot take the whole queue from the others.
//! * A request that does not fit is refused. Whether that is load or a
//!   failure of the guard depends on whether the guard is making progress:
//!   when the stream has taken nothing for `stall` (since the last request
//!   it took, or since the queue last became non-empty), the guard is not
//!   reading ([`Refusal::Stalled`], a failure under its policy, R13);
//!   otherwise it is busy ([`Refusal::Busy`]), and the batch is shed with
//!   `RESOURCE_EXHAUSTED` to its own client without a word to the guard's
//!   circuit.
//!
//! The rule is [`Load`]; [`Queue`] is the queue itself, one per stream: the
//! channel the stream takes requests from, with the `Load` it keeps as they
//! are queued and taken.

use super::wire::Encoded;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Who queued a request: a key per coordinator connection; [`CONTROL`]
/// for the mesh's own messages (cancels), which have no share.
pub(crate) type Client = u64;

/// The key of the mesh's own messages to a guard.
pub(crate) const CONTROL: Client = u64::MAX;

/// The bounds a request is admitted under.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Bytes the queue holds in all.
    pub(crate) limit: usize,
    /// Bytes one client may hold once it holds any.
    pub(crate) share: usize,
    /// How long the stream may take nothing, while requests wait, before
    /// the guard counts as not reading.
    pub(crate) stall: Duration,
}

impl Bounds {
    /// The mesh's own messages: the queue's bound only, and never a
    /// failure of the guard.
    pub(crate) fn control(limit: usize) -> Self {
        Self {
            limit,
            share: usize::MAX,
            stall: Duration::MAX,
        }
    }
}

/// Why a request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Full for this request while the guard is making progress.
    Busy {
        /// Bytes queued in all.
        queued: usize,
        /// Bytes this client holds.
        held: usize,
    },
    /// Full for this request, and the stream has taken nothing for
    /// `stalled`, at least the bound's `stall`.
    Stalled { queued: usize, stalled: Duration },
}

/// The bytes queued, in all and per client, and since when the stream has
/// taken nothing.
#[derive(Debug)]
pub(crate) struct Load {
    bytes: usize,
    by_client: super::IdMap<Client, usize>,
    /// The last time the stream took a request, or the queue became
    /// non-empty: the stall is measured from here.
    mark: Instant,
}

impl Load {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            bytes: 0,
            by_client: super::IdMap::default(),
            mark: now,
        }
    }

    /// Bytes queued in all.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether `len` bytes from `client` may be queued at `now`.
    pub(crate) fn check(
        &self,
        len: usize,
        client: Client,
        bounds: Bounds,
        now: Instant,
    ) -> Result<(), Refusal> {
        if self.bytes == 0 {
            return Ok(());
        }
        let held = self.by_client.get(&client).copied().unwrap_or(0);
        let over_limit = self.bytes.saturating_add(len) > bounds.limit;
        let over_share = held > 0 && held.saturating_add(len) > bounds.share;
        if !over_limit && !over_share {
            return Ok(());
        }
        let stalled = now.saturating_duration_since(self.mark);
        if stalled >= bounds.stall {
            return Err(Refusal::Stalled {
                queued: self.bytes,
                stalled,
            });
        }
        Err(Refusal::Busy {
            queued: self.bytes,
            held,
        })
    }

    /// Counts `len` bytes queued by `client` at `now` (after
    /// [`Self::check`]).
    pub(crate) fn add(&mut self, len: usize, client: Client, now: Instant) {
        if self.bytes == 0 {
            self.mark = now;
        }
        self.bytes = self.bytes.saturating_add(len);
        let held = self.by_client.entry(client).or_insert(0);
        *held = held.saturating_add(len);
    }

    /// The stream took a request of `len` bytes from `client`: progress,
    /// at `now`. The clock is read only when requests are still queued (an
    /// empty queue's mark is set again by the next [`Self::add`]): most
    /// requests are taken as soon as queued.
    pub(crate) fn taken(&mut self, len: usize, client: Client, now: impl FnOnce() -> Instant) {
        self.remove(len, client);
        if self.bytes > 0 {
            self.mark = now();
        }
    }

    /// Takes `len` bytes of `client` off the count, with no progress: a
    /// request never sent (see [`Self::taken`] for one the stream took).
    pub(crate) fn remove(&mut self, len: usize, client: Client) {
        self.bytes = self.bytes.saturating_sub(len);
        if let Some(held) = self.by_client.get_mut(&client) {
            *held = held.saturating_sub(len);
            if *held == 0 {
                self.by_client.remove(&client);
            }
        }
    }
}

/// The requests waiting to be written to one stream, encoded, with the
/// client that queued each, and their bytes ([`Load`]).
pub(crate) struct Queue {
    tx: mpsc::UnboundedSender<(Encoded, Client)>,
    load: Arc<Mutex<Load>>,
}

impl Queue {
    pub(crate) fn new() -> (
        Self,
        impl tokio_stream::Stream<Item = Encoded> + Send + 'static,
    ) {
        let (tx, rx) = mpsc::unbounded_channel::<(Encoded, Client)>();
        let load = Arc::new(Mutex::new(Load::new(tokio::time::Instant::now())));
        let taken = load.clone();
        let stream = UnboundedReceiverStream::new(rx).map(move |(request, client)| {
            taken.lock().unwrap_or_else(PoisonError::into_inner).taken(
                request.len(),
                client,
                Instant::now,
            );
            request
        });
        (Self { tx, load }, stream)
    }

    fn load(&self) -> std::sync::MutexGuard<'_, Load> {
        self.load.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `len` bytes from `client` would be queued at `now`.
    pub(crate) fn check(
        &self,
        len: usize,
        client: Client,
        bounds: Bounds,
        now: tokio::time::Instant,
    ) -> Result<(), Refusal> {
        self.load().check(len, client, bounds, now)
    }

    /// Queues `request` from `client` within `bounds` at `now` (see
    /// [`Load`]).
    pub(crate) fn push(
        &self,
        request: Encoded,
        client: Client,
        bounds: Bounds,
        now: tokio::time::Instant,
    ) -> Result<(), QueueError> {
        let len = request.len();
        {
            let mut load = self.load();
            load.check(len, client, bounds, now)
                .map_err(QueueError::Refused)?;
            load.add(len, client, now);
        }
        self.tx.send((request, client)).map_err(|_| {
            self.load().remove(len, client);
            QueueError::Closed
        })
    }
}

/// Why [`Queue::push`] queued nothing.
pub(crate) enum QueueError {
    Refused(Refusal),
    Closed,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    fn bounds() -> Bounds {
        Bounds {
            limit: 16 * MB,
            share: 4 * MB,
            stall: Duration::from_secs(5),
        }
    }

    /// An empty queue, and the moment it was made.
    fn empty() -> (Load, Instant) {
        let t0 = Instant::now();
        (Load::new(t0), t0)
    }

    /// Asserts that one more MB from `client` at `at` is refused as `want`
    /// ("busy" or "stalled"; the kind of refusal only).
    fn assert_refused(load: &Load, client: Client, at: Instant, want: &str) {
        let got = match load.check(MB, client, bounds(), at) {
            Ok(()) => "admitted",
            Err(Refusal::Busy { .. }) => "busy",
            Err(Refusal::Stalled { .. }) => "stalled",
        };
        assert_eq!(got, want);
    }

    #[test]
    fn r25_an_empty_queue_takes_any_request() {
        let (load, t0) = empty();
        assert_eq!(load.check(100 * MB, 1, bounds(), t0), Ok(()));
    }

    #[test]
    fn r25_one_client_gets_its_share_and_one_request_more_never_the_queue() {
        let (mut load, t0) = empty();
        // Its first request is admitted whatever the share.
        assert_eq!(load.check(5 * MB, 1, bounds(), t0), Ok(()));
        load.add(5 * MB, 1, t0);
        // The next one would put it over its share: busy, not a failure.
        assert_eq!(
            load.check(MB, 1, bounds(), t0),
            Err(Refusal::Busy {
                queued: 5 * MB,
                held: 5 * MB
            })
        );
        // Another client still gets in, up to its own share.
        assert_eq!(load.check(4 * MB, 2, bounds(), t0), Ok(()));
        load.add(4 * MB, 2, t0);
        assert!(load.check(MB, 2, bounds(), t0).is_err());
        assert_eq!(load.check(4 * MB, 3, bounds(), t0), Ok(()));
    }

    #[test]
    fn r25_the_queue_bound_holds_for_all_clients_together() {
        let (mut load, t0) = empty();
        for client in 0..4 {
            load.add(4 * MB, client, t0);
        }
        assert_eq!(
            load.check(1, 9, bounds(), t0),
            Err(Refusal::Busy {
                queued: 16 * MB,
                held: 0
            })
        );
    }

    #[test]
    fn r25_a_guard_that_takes_nothing_for_its_stall_bound_is_not_reading() {
        let (mut load, t0) = empty();
        load.add(16 * MB, 1, t0);
        let busy = t0 + Duration::from_secs(4);
        assert_refused(&load, 2, busy, "busy");
        let stuck = t0 + Duration::from_secs(5);
        assert_eq!(
            load.check(MB, 2, bounds(), stuck),
            Err(Refusal::Stalled {
                queued: 16 * MB,
                stalled: Duration::from_secs(5)
            })
        );
        // A request taken is progress: the clock starts again.
        load.taken(4 * MB, 1, || stuck);
        load.add(4 * MB, 1, stuck);
        assert_refused(&load, 2, stuck + Duration::from_secs(4), "busy");
    }

    #[test]
    fn r25_a_queue_emptied_needs_no_clock_and_its_next_fill_starts_the_stall() {
        let (mut load, t0) = empty();
        load.add(16 * MB, 1, t0);
        load.taken(16 * MB, 1, || panic!("an emptied queue reads no clock"));
        // Filled again ten seconds on: the stall runs from the fill, not
        // from the last request taken.
        let filled = t0 + Duration::from_secs(10);
        load.add(16 * MB, 1, filled);
        assert_refused(&load, 2, filled + Duration::from_secs(4), "busy");
        assert_refused(&load, 2, filled + Duration::from_secs(5), "stalled");
        // Taken with more still queued: progress, the clock read.
        load.add(MB, 3, filled);
        let took = filled + Duration::from_secs(6);
        load.taken(16 * MB, 1, || took);
        load.add(15 * MB, 1, took);
        assert_refused(&load, 2, took + Duration::from_secs(4), "busy");
    }

    #[test]
    fn r25_the_stall_is_measured_from_when_the_queue_last_filled_not_from_an_idle_past() {
        let (mut load, t0) = empty();
        let later = t0 + Duration::from_secs(3600);
        load.add(16 * MB, 1, later);
        assert_refused(&load, 2, later + Duration::from_secs(1), "busy");
    }

    #[test]
    fn r25_a_withdrawn_request_frees_its_client_share_but_is_no_progress() {
        let (mut load, t0) = empty();
        load.add(2 * MB, 1, t0);
        load.add(3 * MB, 1, t0);
        load.remove(3 * MB, 1);
        assert_eq!(load.bytes(), 2 * MB);
        assert_eq!(load.check(2 * MB, 1, bounds(), t0), Ok(()));
        // Not progress: the stall clock still runs from t0.
        load.add(14 * MB, 2, t0);
        assert_refused(&load, 3, t0 + Duration::from_secs(9), "stalled");
    }

    #[test]
    fn r25_control_messages_have_no_share_and_never_stall() {
        let (mut load, t0) = empty();
        load.add(8 * MB, CONTROL, t0);
        assert_eq!(
            load.check(
                MB,
                CONTROL,
                Bounds::control(16 * MB),
                t0 + Duration::from_secs(99)
            ),
            Ok(())
        );
        load.add(8 * MB, 1, t0);
        assert!(matches!(
            load.check(
                MB,
                CONTROL,
                Bounds::control(16 * MB),
                t0 + Duration::from_secs(99)
            ),
            Err(Refusal::Busy { .. })
        ));
    }
}
