//! The lanes policy guards are judged in: at once on the thread that read
//! the batch when its work is known to be small, else off the runtime's
//! I/O threads, on a bounded number of threads shared fairly by clients.
//!
//! **Inline.** A batch whose policies' evaluation stays within [`INLINE`]
//! (each call's cost estimate, and the work of all its calls together as
//! the meter counts it) and whose text is at most [`INLINE_BYTES`] (what
//! building its values reads) is judged where it is, with no hand-off:
//! the usual batch of a few small calls judged by compiled plans. The
//! bound is on work done, not a guess: a batch that reaches it stops there
//! (`OverInline`) and is judged again on the pool, so an I/O thread spends
//! at most the bound on any batch. At most [`INLINE_SLOTS`] threads judge
//! inline at once (what the patterns' caches are charged for).
//!
//! **The pool.** Other batches run on tokio's blocking threads
//! (`spawn_blocking`), at most [`threads`] at once: the CPU and memory
//! policy evaluation may take there are [`threads`] times one call's
//! budget, whatever the number of batches. A batch waits for a thread
//! within its deadline, in its client's queue (a coordinator connection,
//! as for a guard link's queue); a freed thread goes to the clients in
//! turn, the first batch of each, so one client's costly batches delay
//! another client's by at most one batch per thread. A client holds at
//! most [`QUEUED_PER_CLIENT`] batches waiting; past it, its batch is shed
//! ([`Wait::Shed`], `RESOURCE_EXHAUSTED` to that client, R25). The permit
//! travels with the work, so a batch whose caller goes away still holds its
//! thread until its evaluation (bounded by the same deadline) ends, and
//! never lets more run at once.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use tokio::sync::oneshot;

use super::cost::Inline;

/// Threads set before the first evaluation (0: the default).
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// Most threads judging policies at once, by default: one per core, at
/// least 2 and at most 4.
pub const DEFAULT_THREADS: usize = 2;

/// The inline bound of a batch (see the module's text): a call estimated
/// at most 4,096 units, and 32 Ki units of work for the whole batch (about
/// 10 to 40 µs; the bench's standard batch of 4 calls under 20 rules takes
/// about 2,500).
pub const INLINE: Inline = Inline {
    work: 32 << 10,
    cost: 4 << 10,
};

/// Most bytes of a batch (its calls' ids, tools and arguments, its
/// context) judged inline: building its values reads them all.
pub const INLINE_BYTES: usize = 16 << 10;

/// Most threads judging inline at once.
pub const INLINE_SLOTS: usize = 2;

/// Most batches one client may have waiting for a thread of the pool.
pub const QUEUED_PER_CLIENT: usize = 4;

/// Sets the number of evaluation threads; only before the first batch.
pub fn set_threads(threads: usize) {
    THREADS.store(threads.max(1), Ordering::Relaxed);
}

/// The number of evaluation threads.
pub fn threads() -> usize {
    match THREADS.load(Ordering::Relaxed) {
        0 => std::thread::available_parallelism()
            .map_or(DEFAULT_THREADS, std::num::NonZero::get)
            .clamp(DEFAULT_THREADS, 4),
        n => n,
    }
}

/// Who is waiting: a key per coordinator connection (the link queue's).
pub type Client = u64;

/// Why a batch got no thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Wait {
    /// Every evaluation thread stayed busy until the deadline.
    #[error("no policy evaluation thread was free before the deadline")]
    Busy,
    /// The client already has as many batches waiting as it may.
    #[error(
        "policy evaluation is busy: {queued} batches of this client are already waiting \
         (at most {limit}); retry with backoff"
    )]
    Shed {
        /// Batches of this client waiting.
        queued: usize,
        /// [`QUEUED_PER_CLIENT`].
        limit: usize,
    },
}

/// The work ended without an answer (the runtime is shutting down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("policy evaluation was interrupted")]
pub struct Interrupted;

/// The threads in use and the clients waiting for one.
#[derive(Debug)]
struct Lanes {
    free: usize,
    /// Per client, its waiting batches in order: a ticket and where to
    /// send its thread.
    queues: HashMap<Client, VecDeque<(u64, oneshot::Sender<Lane>)>>,
    /// The clients with a batch waiting, in turn.
    turn: VecDeque<Client>,
    next_ticket: u64,
}

fn lanes() -> &'static Mutex<Lanes> {
    static LANES: OnceLock<Mutex<Lanes>> = OnceLock::new();
    LANES.get_or_init(|| {
        Mutex::new(Lanes {
            free: threads(),
            queues: HashMap::new(),
            turn: VecDeque::new(),
            next_ticket: 0,
        })
    })
}

fn lock() -> std::sync::MutexGuard<'static, Lanes> {
    lanes().lock().unwrap_or_else(PoisonError::into_inner)
}

/// A thread of the pool, held until [`Lane::run`] is done with it (or the
/// lane is dropped): then it goes to the next client in turn.
#[derive(Debug)]
pub struct Lane {
    /// False for a lane that was never handed over (its thread is passed
    /// on by whoever holds the lock).
    held: bool,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.held {
            release(&mut lock());
        }
    }
}

/// Gives a freed thread to the first waiting batch of the next client in
/// turn, or counts it free.
fn release(lanes: &mut Lanes) {
    while let Some(client) = lanes.turn.pop_front() {
        let Some(queue) = lanes.queues.get_mut(&client) else {
            continue;
        };
        let waiter = queue.pop_front();
        if queue.is_empty() {
            lanes.queues.remove(&client);
        } else {
            lanes.turn.push_back(client);
        }
        let Some((_, to)) = waiter else { continue };
        match to.send(Lane { held: true }) {
            Ok(()) => return,
            // Its waiter is gone: the next one gets the thread.
            Err(mut lane) => lane.held = false,
        }
    }
    lanes.free += 1;
}

/// Takes a ticket's batch out of its client's queue, if it is still there.
fn withdraw(lanes: &mut Lanes, client: Client, ticket: u64) {
    if let Some(queue) = lanes.queues.get_mut(&client) {
        queue.retain(|(t, _)| *t != ticket);
        if queue.is_empty() {
            lanes.queues.remove(&client);
            lanes.turn.retain(|c| *c != client);
        }
    }
}

/// A batch in its client's queue; leaves it when dropped.
struct Waiting {
    client: Client,
    ticket: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        withdraw(&mut lock(), self.client, self.ticket);
    }
}

/// Waits for an evaluation thread, in `client`'s queue, until `deadline`.
pub async fn lane(client: Client, deadline: tokio::time::Instant) -> Result<Lane, Wait> {
    let (receiver, waiting) = {
        let mut lanes = lock();
        if lanes.free > 0 && lanes.turn.is_empty() {
            lanes.free -= 1;
            return Ok(Lane { held: true });
        }
        let queued = lanes.queues.get(&client).map_or(0, VecDeque::len);
        if queued >= QUEUED_PER_CLIENT {
            return Err(Wait::Shed {
                queued,
                limit: QUEUED_PER_CLIENT,
            });
        }
        let ticket = lanes.next_ticket;
        lanes.next_ticket += 1;
        let (sender, receiver) = oneshot::channel();
        if queued == 0 {
            lanes.turn.push_back(client);
        }
        lanes
            .queues
            .entry(client)
            .or_default()
            .push_back((ticket, sender));
        (receiver, Waiting { client, ticket })
    };
    // Past the deadline the receiver goes first: a thread sent to it in the
    // meantime is passed on as it drops; then the batch leaves its queue.
    let got = tokio::time::timeout_at(deadline, receiver).await;
    drop(waiting);
    match got {
        Ok(Ok(lane)) => Ok(lane),
        _ => Err(Wait::Busy),
    }
}

impl Lane {
    /// Runs `work` on the thread: the thread stays taken until `work` ends,
    /// even if the caller stops waiting.
    pub async fn run<T: Send + 'static>(
        self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Interrupted> {
        tokio::task::spawn_blocking(move || {
            let _lane = self;
            work()
        })
        .await
        .map_err(|_| Interrupted)
    }
}

/// Judging inline, on the thread that read the batch; a slot of
/// [`INLINE_SLOTS`], freed when dropped.
#[derive(Debug)]
pub struct InlineSlot(());

static INLINE_RUNNING: AtomicUsize = AtomicUsize::new(0);

impl Drop for InlineSlot {
    fn drop(&mut self) {
        INLINE_RUNNING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A slot to judge inline, if one of [`INLINE_SLOTS`] is free.
pub fn inline_slot() -> Option<InlineSlot> {
    INLINE_RUNNING
        .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
            (n < INLINE_SLOTS).then_some(n + 1)
        })
        .ok()
        .map(|_| InlineSlot(()))
}
