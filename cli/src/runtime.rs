//! How many runtime threads `guardmesh` uses by default.
//!
//! Measured with `guardmesh bench` on a 2-core VM (see docs/performance.md):
//! there, one thread (a current-thread runtime) gives the mesh more batches
//! per second and less CPU per batch than two workers, because the mesh
//! waits on the network and shares the cores with its guards and
//! coordinators, and cross-thread wakeups cost more than a second worker
//! gains. With more cores than that, one worker thread per core: a single
//! thread caps a mesh at one core however busy it is.

/// Cores up to which one thread is the default.
pub(crate) const SINGLE_THREAD_MAX_CORES: usize = 2;

/// Worker threads for a machine with `cores` cores: 1 (a current-thread
/// runtime) up to [`SINGLE_THREAD_MAX_CORES`], one per core above.
pub(crate) fn worker_threads_for(cores: usize) -> usize {
    if cores <= SINGLE_THREAD_MAX_CORES {
        1
    } else {
        cores
    }
}

/// Worker threads for this machine (see [`worker_threads_for`]).
pub(crate) fn default_worker_threads() -> usize {
    worker_threads_for(std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_thread_on_small_machines_one_per_core_above() {
        assert_eq!(worker_threads_for(1), 1);
        assert_eq!(worker_threads_for(2), 1);
        assert_eq!(worker_threads_for(3), 3);
        assert_eq!(worker_threads_for(16), 16);
        assert!(default_worker_threads() >= 1);
    }
}
