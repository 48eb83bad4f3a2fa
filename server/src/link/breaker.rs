//! A guard's circuit breaker on consecutive failures, as a pure state
//! machine: the caller passes the time, so every transition is tested with
//! explicit instants.
//!
//! ```text
//! Closed   ── threshold consecutive failures ──▶ Open     (refuses at once)
//! Open     ── open_for elapsed ─────────────────▶ HalfOpen (admits one probe)
//! HalfOpen ── the probe fails ──────────────────▶ Open
//! any      ── a success ────────────────────────▶ Closed   (count restarts)
//! ```
//!
//! * **Closed**: every request is admitted; each failure adds to the count
//!   and each success resets it. At `threshold` consecutive failures the
//!   circuit opens for `open_for`.
//! * **Open**: requests are refused at once ([`Refused`]), saying how many
//!   failures opened it, the last one, and when the next probe may go. A
//!   failure of a request admitted earlier keeps it open for another
//!   `open_for` from then.
//! * **HalfOpen**: once `open_for` has elapsed, the next request is admitted
//!   as the probe and the others are refused while it is out. A success
//!   (of the probe or of any request) closes the circuit; a failure
//!   re-opens it for `open_for`. A probe that has neither succeeded nor
//!   failed after `open_for` is given up on, and the next request is a new
//!   probe, so a lost outcome cannot hold the circuit open for ever.
//!
//! A threshold of 0 disables the breaker: it admits everything and ignores
//! outcomes. Which failures count (a guard's availability, not its policy)
//! is the caller's choice: it records only those.
//!
//! The breaker decides admission only; what a refusal means is the guard's
//! failure policy (R13): under `fail_closed` an open circuit blocks.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A circuit breaker that opens after `threshold` consecutive failures.
#[derive(Debug)]
pub(crate) struct ConsecutiveFailures {
    threshold: u32,
    open_for: Duration,
    /// Consecutive failures since the last success.
    failures: u32,
    /// The last of them.
    last: Option<Arc<str>>,
    /// Set while open: when the next probe may go.
    open_until: Option<Instant>,
    /// Set while a half-open probe is out: when it was admitted.
    probe_since: Option<Instant>,
}

/// How a request was let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// The circuit is closed.
    Closed,
    /// The circuit is half-open and this request is its probe.
    Probe,
}

/// Why a request was refused: the circuit is open (or its probe is out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused {
    /// Consecutive failures so far.
    pub(crate) failures: u32,
    /// The last of them.
    pub(crate) last: Arc<str>,
    /// How long until a probe may go (zero while a probe is out).
    pub(crate) retry_in: Duration,
}

/// A change of the circuit's state that a recorded outcome caused, to be
/// logged and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// Closed to open after `failures` consecutive failures.
    Opened { failures: u32 },
    /// The half-open probe failed: open again.
    Reopened { failures: u32 },
    /// A success closed an open or half-open circuit.
    Closed,
}

impl ConsecutiveFailures {
    /// A closed breaker that opens after `threshold` consecutive failures
    /// (0 disables it) and stays open for `open_for` before a probe.
    pub(crate) fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            threshold,
            open_for,
            failures: 0,
            last: None,
            open_until: None,
            probe_since: None,
        }
    }

    /// Lets a request through at `now`, or refuses it at once.
    pub(crate) fn admit(&mut self, now: Instant) -> Result<Admitted, Refused> {
        let Some(until) = self.open_until else {
            return Ok(Admitted::Closed);
        };
        let probe_stale = self
            .probe_since
            .is_none_or(|since| now.duration_since(since) >= self.open_for);
        if now >= until && probe_stale {
            self.probe_since = Some(now);
            return Ok(Admitted::Probe);
        }
        Err(Refused {
            failures: self.failures,
            last: self.last.clone().unwrap_or_else(|| "unknown".into()),
            retry_in: until.saturating_duration_since(now),
        })
    }

    /// Records a request that succeeded: the count restarts and an open or
    /// half-open circuit closes.
    pub(crate) fn record_success(&mut self) -> Option<Transition> {
        if self.threshold == 0 {
            return None;
        }
        let was_open = self.open_until.is_some();
        *self = Self::new(self.threshold, self.open_for);
        was_open.then_some(Transition::Closed)
    }

    /// Records a request that failed at `now` for `reason`, a failure that
    /// says the guard may be unavailable.
    pub(crate) fn record_failure(
        &mut self,
        now: Instant,
        reason: &dyn std::fmt::Display,
    ) -> Option<Transition> {
        if self.threshold == 0 {
            return None;
        }
        self.failures = self.failures.saturating_add(1);
        self.last = Some(reason.to_string().into());
        let probing = self.probe_since.take().is_some();
        if self.failures < self.threshold && !probing {
            return None;
        }
        let was_open = self.open_until.is_some();
        self.open_until = Some(now + self.open_for);
        let failures = self.failures;
        if probing {
            Some(Transition::Reopened { failures })
        } else if !was_open {
            Some(Transition::Opened { failures })
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN_FOR: Duration = Duration::from_millis(300);
    const MS: Duration = Duration::from_millis(1);

    /// A breaker opened by 3 failures at `t0`.
    fn opened(t0: Instant) -> ConsecutiveFailures {
        let mut breaker = ConsecutiveFailures::new(3, OPEN_FOR);
        breaker.record_failure(t0, &"a");
        breaker.record_failure(t0, &"b");
        assert_eq!(
            breaker.record_failure(t0, &"c"),
            Some(Transition::Opened { failures: 3 })
        );
        breaker
    }

    /// A breaker opened by 3 failures, its probe admitted as the open
    /// period ends; with that moment.
    fn probing() -> (ConsecutiveFailures, Instant) {
        let t0 = Instant::now();
        let mut breaker = opened(t0);
        let t1 = t0 + OPEN_FOR;
        assert_eq!(breaker.admit(t1), Ok(Admitted::Probe));
        (breaker, t1)
    }

    /// Two failures, below the threshold of 3, leave `breaker` closed.
    fn assert_closed_after_two_failures(breaker: &mut ConsecutiveFailures, at: Instant) {
        assert_eq!(breaker.admit(at), Ok(Admitted::Closed));
        assert_eq!(breaker.record_failure(at, &"a"), None);
        assert_eq!(breaker.record_failure(at, &"b"), None);
        assert_eq!(breaker.admit(at), Ok(Admitted::Closed));
    }

    /// What an open circuit answers after `failures`, the last `last`.
    fn refused(failures: u32, last: &str, retry_in: Duration) -> Refused {
        Refused {
            failures,
            last: last.into(),
            retry_in,
        }
    }

    #[test]
    fn closed_admits_and_stays_closed_below_the_threshold() {
        let mut breaker = ConsecutiveFailures::new(3, OPEN_FOR);
        assert_closed_after_two_failures(&mut breaker, Instant::now());
    }

    #[test]
    fn closed_opens_after_n_consecutive_failures() {
        let t0 = Instant::now();
        let mut breaker = opened(t0);
        assert_eq!(breaker.admit(t0 + MS), Err(refused(3, "c", OPEN_FOR - MS)));
    }

    #[test]
    fn a_success_resets_the_count_of_consecutive_failures() {
        let t0 = Instant::now();
        let mut breaker = ConsecutiveFailures::new(3, OPEN_FOR);
        breaker.record_failure(t0, &"a");
        breaker.record_failure(t0, &"b");
        assert_eq!(breaker.record_success(), None, "closed stays closed");
        assert_eq!(breaker.record_failure(t0, &"c"), None);
        assert_eq!(breaker.record_failure(t0, &"d"), None);
        assert_eq!(breaker.admit(t0), Ok(Admitted::Closed));
        assert_eq!(
            breaker.record_failure(t0, &"e"),
            Some(Transition::Opened { failures: 3 })
        );
    }

    #[test]
    fn open_refuses_until_open_for_has_elapsed() {
        let t0 = Instant::now();
        let mut breaker = opened(t0);
        for at in [t0, t0 + 100 * MS, t0 + OPEN_FOR - MS] {
            let refused = breaker.admit(at).unwrap_err();
            assert_eq!(refused.retry_in, (t0 + OPEN_FOR) - at);
        }
        assert_eq!(breaker.admit(t0 + OPEN_FOR), Ok(Admitted::Probe));
    }

    #[test]
    fn failures_while_open_keep_it_open_without_a_new_transition() {
        let t0 = Instant::now();
        let mut breaker = opened(t0);
        // A request admitted before the circuit opened fails later.
        let t1 = t0 + 200 * MS;
        assert_eq!(breaker.record_failure(t1, &"late"), None);
        let refused = breaker.admit(t0 + OPEN_FOR).unwrap_err();
        assert_eq!(refused.failures, 4);
        assert_eq!(&*refused.last, "late");
        assert_eq!(refused.retry_in, 200 * MS);
        assert_eq!(breaker.admit(t1 + OPEN_FOR), Ok(Admitted::Probe));
    }

    #[test]
    fn half_open_admits_exactly_one_probe() {
        let (mut breaker, t1) = probing();
        for at in [t1, t1 + MS, t1 + OPEN_FOR - MS] {
            let refused = breaker.admit(at).unwrap_err();
            assert_eq!(refused.retry_in, Duration::ZERO, "the probe is out");
            assert_eq!(refused.failures, 3);
        }
    }

    #[test]
    fn a_successful_probe_closes_the_circuit() {
        let (mut breaker, t1) = probing();
        assert_eq!(breaker.record_success(), Some(Transition::Closed));
        // The count starts again from zero.
        assert_closed_after_two_failures(&mut breaker, t1);
    }

    #[test]
    fn a_success_while_open_closes_the_circuit() {
        let t0 = Instant::now();
        let mut breaker = opened(t0);
        // A request admitted before the circuit opened succeeds late.
        assert_eq!(breaker.record_success(), Some(Transition::Closed));
        assert_eq!(breaker.admit(t0 + MS), Ok(Admitted::Closed));
    }

    #[test]
    fn a_failed_probe_reopens_the_circuit() {
        let (mut breaker, t1) = probing();
        let t2 = t1 + 50 * MS;
        assert_eq!(
            breaker.record_failure(t2, &"probe failed"),
            Some(Transition::Reopened { failures: 4 })
        );
        assert_eq!(
            breaker.admit(t2 + MS),
            Err(refused(4, "probe failed", OPEN_FOR - MS))
        );
        assert_eq!(breaker.admit(t2 + OPEN_FOR), Ok(Admitted::Probe));
    }

    #[test]
    fn a_probe_without_an_outcome_is_replaced_after_open_for() {
        let (mut breaker, t1) = probing();
        assert!(breaker.admit(t1 + OPEN_FOR - MS).is_err());
        assert_eq!(breaker.admit(t1 + OPEN_FOR), Ok(Admitted::Probe));
        assert!(breaker.admit(t1 + OPEN_FOR).is_err());
    }

    #[test]
    fn a_threshold_of_one_opens_on_the_first_failure() {
        let t0 = Instant::now();
        let mut breaker = ConsecutiveFailures::new(1, OPEN_FOR);
        assert_eq!(
            breaker.record_failure(t0, &"down"),
            Some(Transition::Opened { failures: 1 })
        );
        assert!(breaker.admit(t0).is_err());
    }

    #[test]
    fn a_threshold_of_zero_disables_the_breaker() {
        let t0 = Instant::now();
        let mut breaker = ConsecutiveFailures::new(0, OPEN_FOR);
        for i in 0..100 {
            assert_eq!(breaker.record_failure(t0, &"down"), None);
            assert_eq!(breaker.admit(t0 + i * MS), Ok(Admitted::Closed));
        }
        assert_eq!(breaker.record_success(), None);
        assert_eq!(breaker.admit(t0), Ok(Admitted::Closed));
    }

    #[test]
    fn the_failure_count_saturates() {
        let t0 = Instant::now();
        let mut breaker = ConsecutiveFailures::new(u32::MAX, OPEN_FOR);
        breaker.failures = u32::MAX - 1;
        assert_eq!(
            breaker.record_failure(t0, &"down"),
            Some(Transition::Opened { failures: u32::MAX })
        );
        assert_eq!(breaker.record_failure(t0, &"down"), None);
        assert_eq!(breaker.admit(t0).unwrap_err().failures, u32::MAX);
    }
}
