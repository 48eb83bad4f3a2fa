//! Pauses between failed accepts, shared by the mesh's listeners (the gRPC
//! listener in [`crate::security::tls`] and the metrics endpoint): a leaf
//! that both import.

use std::time::Duration;

/// Pauses between failed accepts. A failure such as "too many open files"
/// leaves the connection queued, so an immediate retry fails again at once:
/// without a pause the accept loop spins. The pause doubles up to a cap and
/// resets on success; failures are logged at most every few seconds.
#[derive(Debug)]
pub struct AcceptBackoff {
    listener: &'static str,
    next: Duration,
    failures: u64,
    logged: Option<std::time::Instant>,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_millis(250);
    const LOG_EVERY: Duration = Duration::from_secs(5);

    pub fn new(listener: &'static str) -> Self {
        Self {
            listener,
            next: Self::FIRST,
            failures: 0,
            logged: None,
        }
    }

    pub fn succeeded(&mut self) {
        self.next = Self::FIRST;
    }

    /// Logs (throttled) and sleeps before the next accept.
    pub async fn failed(&mut self, error: &std::io::Error) {
        self.failures += 1;
        if self.logged.is_none_or(|at| at.elapsed() >= Self::LOG_EVERY) {
            tracing::warn!(
                listener = self.listener,
                %error,
                failures = self.failures,
                "accept failed; backing off"
            );
            self.logged = Some(std::time::Instant::now());
            self.failures = 0;
        }
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(Self::MAX);
    }
}
