//! The lane policy guards are judged in: off the runtime's I/O threads, on
//! a bounded number of threads.
//!
//! Evaluation runs on tokio's blocking threads (`spawn_blocking`), at most
//! [`threads`] at once (a semaphore). The blocking pool is already there and
//! reuses its threads, so nothing is written here that tokio does; the
//! semaphore is what bounds it: the CPU and memory policy evaluation may take
//! are [`threads`] times one call's budget, whatever the number of batches,
//! and the runtime's own threads only read, decode and answer. A batch waits
//! for a thread within its deadline; the permit travels with the work, so a
//! batch whose caller goes away still holds its thread until its evaluation
//! (bounded by the same deadline) ends, and never lets more run at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::Semaphore;

/// Threads set before the first evaluation (0: the default).
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// Most threads judging policies at once, by default: one per core, at
/// least 2 and at most 4.
pub const DEFAULT_THREADS: usize = 2;

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

fn permits() -> &'static Arc<Semaphore> {
    static PERMITS: OnceLock<Arc<Semaphore>> = OnceLock::new();
    PERMITS.get_or_init(|| Arc::new(Semaphore::new(threads())))
}

/// Every evaluation thread stayed busy until the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no policy evaluation thread was free before the deadline")]
pub struct Busy;

/// The work ended without an answer (the runtime is shutting down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("policy evaluation was interrupted")]
pub struct Interrupted;

/// A thread of the pool, held until [`Lane::run`] is done with it.
#[derive(Debug)]
pub struct Lane(tokio::sync::OwnedSemaphorePermit);

/// Waits for an evaluation thread to be free, until `deadline`.
pub async fn lane(deadline: tokio::time::Instant) -> Result<Lane, Busy> {
    tokio::time::timeout_at(deadline, Arc::clone(permits()).acquire_owned())
        .await
        .map_err(|_| Busy)?
        .map(Lane)
        .map_err(|_| Busy)
}

impl Lane {
    /// Runs `work` on the thread: the thread stays taken until `work` ends,
    /// even if the caller stops waiting.
    pub async fn run<T: Send + 'static>(
        self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Interrupted> {
        let permit = self.0;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .map_err(|_| Interrupted)
    }
}
