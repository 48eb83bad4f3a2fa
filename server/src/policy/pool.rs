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
//! within the first of its policy guards' time (waiting is load, not
//! evaluation: past it, the batch is shed, [`Wait::Busy`], R25), in its
//! client's queue (a coordinator connection, as for a guard link's
//! queue); a freed thread goes to the clients in
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
/// 10 to 40 µs; the bench's standard batch of 4 calls under 20 rules spends
/// about 700).
pub const INLINE: Inline = Inline {
    work: 32 << 10,
    cost: 4 << 10,
};

/// Most bytes of a batch (its calls' ids, tools and arguments, its
/// context) judged inline: building its values reads them all.
pub const INLINE_BYTES: usize = 16 << 10;

/// Most threads judging inline at once (each may hold a cache of every
/// pattern, see `patterns`); the others hand their batch to the pool.
pub const INLINE_SLOTS: usize = 1;

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
    #[error(
        "policy evaluation is busy: no evaluation thread was free within the guard's time; \
         retry with backoff"
    )]
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

/// A set of threads and its clients' queues; the process has one
/// ([`lane`]).
#[derive(Debug)]
pub(crate) struct Pool {
    lanes: Mutex<Lanes>,
    /// Most batches one client may have waiting.
    queued_per_client: usize,
}

impl Pool {
    pub(crate) fn new(threads: usize, queued_per_client: usize) -> Self {
        Self {
            lanes: Mutex::new(Lanes {
                free: threads,
                queues: HashMap::new(),
                turn: VecDeque::new(),
                next_ticket: 0,
            }),
            queued_per_client,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lanes> {
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives a freed thread to the first waiting batch of the next client
    /// in turn, or counts it free.
    fn release(&'static self) {
        let mut lanes = self.lock();
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
            match to.send(Lane {
                pool: self,
                held: true,
            }) {
                Ok(()) => return,
                // Its waiter is gone: the next one gets the thread.
                Err(mut lane) => lane.held = false,
            }
        }
        lanes.free += 1;
    }

    /// Takes a ticket's batch out of its client's queue, if it is still
    /// there.
    fn withdraw(&self, client: Client, ticket: u64) {
        let mut lanes = self.lock();
        if let Some(queue) = lanes.queues.get_mut(&client) {
            queue.retain(|(t, _)| *t != ticket);
            if queue.is_empty() {
                lanes.queues.remove(&client);
                lanes.turn.retain(|c| *c != client);
            }
        }
    }

    /// Waits for a thread, in `client`'s queue, until `deadline`.
    pub(crate) async fn lane(
        &'static self,
        client: Client,
        deadline: tokio::time::Instant,
    ) -> Result<Lane, Wait> {
        let (receiver, waiting) = {
            let mut lanes = self.lock();
            if lanes.free > 0 && lanes.turn.is_empty() {
                lanes.free -= 1;
                return Ok(Lane {
                    pool: self,
                    held: true,
                });
            }
            let queued = lanes.queues.get(&client).map_or(0, VecDeque::len);
            if queued >= self.queued_per_client {
                return Err(Wait::Shed {
                    queued,
                    limit: self.queued_per_client,
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
            (
                receiver,
                Waiting {
                    pool: self,
                    client,
                    ticket,
                },
            )
        };
        // Past the deadline the receiver goes first: a thread sent to it in
        // the meantime is passed on as it drops; then the batch leaves its
        // queue (as it does if this wait is dropped).
        let got = tokio::time::timeout_at(deadline, receiver).await;
        drop(waiting);
        match got {
            Ok(Ok(lane)) => Ok(lane),
            _ => Err(Wait::Busy),
        }
    }
}

/// The process's pool: [`threads`] threads, [`QUEUED_PER_CLIENT`].
fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(threads(), QUEUED_PER_CLIENT))
}

/// A thread of the pool, held until [`Lane::run`] is done with it (or the
/// lane is dropped): then it goes to the next client in turn.
#[derive(Debug)]
pub struct Lane {
    pool: &'static Pool,
    /// False for a lane that was never handed over (its thread is passed
    /// on by whoever holds the lock).
    held: bool,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if self.held {
            self.pool.release();
        }
    }
}

/// A batch in its client's queue; leaves it when dropped.
struct Waiting {
    pool: &'static Pool,
    client: Client,
    ticket: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.pool.withdraw(self.client, self.ticket);
    }
}

/// Waits for an evaluation thread of the process's pool, in `client`'s
/// queue, until `deadline`.
pub async fn lane(client: Client, deadline: tokio::time::Instant) -> Result<Lane, Wait> {
    pool().lane(client, deadline).await
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::time::Instant;

    fn pool(threads: usize, queued: usize) -> &'static Pool {
        Box::leak(Box::new(Pool::new(threads, queued)))
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    type Asked = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Lane, Wait>>>>;

    /// A thread asked for in `client`'s queue, still waiting for one.
    async fn waiting(pool: &'static Pool, client: Client) -> Asked {
        let mut asked: Asked = Box::pin(pool.lane(client, later()));
        assert!(got(&mut asked).await.is_none(), "client {client} waits");
        asked
    }

    /// Whether a wait has got its thread, without waiting.
    async fn got<F: std::future::Future<Output = Result<Lane, Wait>> + Unpin>(
        wait: &mut F,
    ) -> Option<Result<Lane, Wait>> {
        tokio::time::timeout(Duration::from_millis(20), wait)
            .await
            .ok()
    }

    /// R25: a freed thread goes to the clients in turn, not to the batch
    /// that waited longest: one client's queue delays another client by at
    /// most one batch per thread.
    #[tokio::test]
    async fn r25_threads_go_to_the_clients_in_turn() {
        let pool = pool(1, 8);
        let running = pool.lane(1, later()).await.unwrap();
        let mut a1 = waiting(pool, 1).await;
        let mut a2 = waiting(pool, 1).await;
        let mut a3 = waiting(pool, 1).await;
        let mut b1 = waiting(pool, 2).await;
        drop(running);
        let a1 = got(&mut a1).await.unwrap().unwrap();
        assert!(got(&mut b1).await.is_none(), "one thread, taken by a1");
        drop(a1);
        let b1 = got(&mut b1)
            .await
            .expect("B's turn comes before A's second batch");
        assert!(got(&mut a2).await.is_none());
        drop(b1);
        drop(got(&mut a2).await.unwrap().unwrap());
        drop(got(&mut a3).await.unwrap().unwrap());
        assert_eq!(pool.lock().free, 1);
    }

    /// R25: past its share of waiting batches, a client's batch is shed at
    /// once; another client still queues.
    #[tokio::test]
    async fn r25_a_client_past_its_share_is_shed_others_queue() {
        let pool = pool(1, 2);
        let _running = pool.lane(1, later()).await.unwrap();
        let _a1 = waiting(pool, 1).await;
        let _a2 = waiting(pool, 1).await;
        assert_eq!(
            pool.lane(1, later()).await.unwrap_err(),
            Wait::Shed {
                queued: 2,
                limit: 2
            }
        );
        // B waits, not shed.
        let _b1 = waiting(pool, 2).await;
    }

    /// A wait that times out, or is dropped, leaves its queue and never
    /// keeps a thread: the pool ends with all its threads free.
    #[tokio::test]
    async fn r25_a_wait_timed_out_or_dropped_keeps_no_thread() {
        let pool = pool(1, 8);
        let running = pool.lane(1, later()).await.unwrap();
        let soon = Instant::now() + Duration::from_millis(30);
        assert_eq!(pool.lane(2, soon).await.unwrap_err(), Wait::Busy);
        drop(waiting(pool, 3).await);
        let mut queued = waiting(pool, 4).await;
        drop(running);
        drop(got(&mut queued).await.unwrap().unwrap());
        let lanes = pool.lock();
        assert_eq!(lanes.free, 1);
        assert!(lanes.turn.is_empty() && lanes.queues.is_empty());
    }
}
