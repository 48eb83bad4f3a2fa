//! Hardening of a listener that accepts TCP connections, shared by the
//! mesh's listeners (its gRPC listener and its metrics endpoint) and the
//! MCP gateway's (`guardmesh mcp http`): the pause between failed accepts,
//! and the process's open-file limit that bounds how many connections it
//! may hold.
//!
//! Each listener logs its own line for a failed accept (see
//! [`AcceptBackoff::failed`]): the line stays in the crate, and under the
//! log target, of the listener that writes it.

use std::time::{Duration, Instant};

/// Pauses between failed accepts. A failure such as "too many open files"
/// leaves the connection queued, so an immediate retry fails again at once:
/// without a pause the accept loop spins. The pause doubles from 5 ms up to
/// 250 ms and resets on success; failures are logged at most every 5 s.
#[derive(Debug)]
pub struct AcceptBackoff {
    next: Duration,
    failures: u64,
    logged: Option<Instant>,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_millis(250);
    const LOG_EVERY: Duration = Duration::from_secs(5);

    /// No failure yet: the first pause is the shortest.
    pub fn new() -> Self {
        Self {
            next: Self::FIRST,
            failures: 0,
            logged: None,
        }
    }

    /// An accept succeeded: the next failure pauses the shortest again.
    pub fn succeeded(&mut self) {
        self.next = Self::FIRST;
    }

    /// An accept failed: calls `log` with the failures counted since the
    /// last line logged (the first failure at once, then at most every
    /// 5 s), then sleeps before the next accept.
    pub async fn failed(&mut self, log: impl FnOnce(u64)) {
        self.failures += 1;
        if self.logged.is_none_or(|at| at.elapsed() >= Self::LOG_EVERY) {
            log(self.failures);
            self.logged = Some(Instant::now());
            self.failures = 0;
        }
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(Self::MAX);
    }
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether an accept failed for want of file descriptors (EMFILE, ENFILE).
pub fn out_of_descriptors(error: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
    }
    #[cfg(not(unix))]
    {
        let _ = error;
        false
    }
}

/// The process's open-file limit (soft), if it has one.
pub fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
            || limit.rlim_cur == libc::RLIM_INFINITY
        {
            return None;
        }
        Some(limit.rlim_cur)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Raises the soft open-file limit to the hard one (as servers commonly do
/// at start); returns the limit in force (`None`: unlimited or unknown).
pub fn raise_open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit only read and write the struct.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0
                && limit.rlim_cur < limit.rlim_max
            {
                limit.rlim_cur = limit.rlim_max;
                let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            }
        }
    }
    open_file_limit()
}

/// The descriptors of an open-file `limit` left for client connections
/// once a reserve is kept for everything else the process opens: an
/// eighth of the limit, at least 64.
pub fn descriptors_for_connections(limit: usize) -> usize {
    let reserve = (limit / 8).max(64);
    limit.saturating_sub(reserve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn r25_failed_accepts_are_logged_once_per_interval_and_pause_longer_each_time() {
        let mut backoff = AcceptBackoff::new();
        let mut logged = Vec::new();
        backoff.failed(|failures| logged.push(failures)).await;
        backoff.failed(|failures| logged.push(failures)).await;
        assert_eq!(logged, [1], "the second failure, within 5 s, is not logged");
        assert_eq!(backoff.next, Duration::from_millis(20));
        backoff.succeeded();
        assert_eq!(backoff.next, AcceptBackoff::FIRST);
        backoff.next = Duration::from_millis(200);
        backoff.failed(|failures| logged.push(failures)).await;
        assert_eq!(backoff.next, AcceptBackoff::MAX);
    }

    #[test]
    fn r25_the_reserve_is_an_eighth_of_the_limit_and_at_least_64() {
        assert_eq!(descriptors_for_connections(1024), 896);
        assert_eq!(descriptors_for_connections(256), 192);
        assert_eq!(descriptors_for_connections(32), 0);
    }
}
