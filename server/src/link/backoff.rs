//! Bounded exponential backoff with jitter, for a guard link's reconnects.
//!
//! Each [`ExpBackoff::next`] gives the pause before the next attempt: the
//! current step scaled by a random factor in `[1 - jitter, 1]`, after which
//! the step doubles, up to `max`. [`ExpBackoff::reset`] returns to `initial`
//! (a link does so once a stream was answered on). The jitter keeps a fleet
//! of meshes from redialing a restarted guard in lockstep.
//!
//! The type only computes delays; the caller sleeps (`tokio::time::sleep`),
//! so the schedule is tested without a clock.

use rand::Rng;
use std::time::Duration;

/// A bounded exponential backoff with jitter.
#[derive(Debug, Clone)]
pub(crate) struct ExpBackoff {
    initial: Duration,
    max: Duration,
    jitter: f64,
    /// The step the next delay is drawn from.
    current: Duration,
}

impl ExpBackoff {
    /// The jitter of a guard link's reconnects: each pause is between half
    /// of the current step and all of it.
    pub(crate) const LINK_JITTER: f64 = 0.5;

    /// A backoff whose first step is `initial` and whose steps double up to
    /// `max`. `jitter` is the fraction of a step that may be taken off at
    /// random, clamped to `[0, 1]` (not a number counts as 0): 0 gives the
    /// steps exactly, 1 any pause up to the step. A first step above `max`
    /// is taken once as is; the next ones are `max`.
    pub(crate) fn new(initial: Duration, max: Duration, jitter: f64) -> Self {
        let jitter = if jitter.is_nan() {
            0.0
        } else {
            jitter.clamp(0.0, 1.0)
        };
        Self {
            initial,
            max,
            jitter,
            current: initial,
        }
    }

    /// The pause before the next attempt; moves to the next step.
    pub(crate) fn next(&mut self) -> Duration {
        self.next_with(&mut rand::rng())
    }

    /// As [`next`](Self::next), drawing the jitter from `rng`.
    pub(crate) fn next_with<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        let factor = rng.random_range((1.0 - self.jitter)..=1.0);
        // As `Duration::mul_f64`, without its panic past `Duration::MAX`;
        // never above the step for a rounding error.
        let pause = Duration::try_from_secs_f64(self.current.as_secs_f64() * factor)
            .unwrap_or(self.current)
            .min(self.current);
        self.current = self.current.saturating_mul(2).min(self.max);
        pause
    }

    /// Back to the first step, after an attempt that worked.
    pub(crate) fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn without_jitter_steps_double_from_initial() {
        let mut backoff = ExpBackoff::new(50 * MS, 10_000 * MS, 0.0);
        let steps: Vec<Duration> = (0..5).map(|_| backoff.next()).collect();
        assert_eq!(steps, [50 * MS, 100 * MS, 200 * MS, 400 * MS, 800 * MS]);
    }

    #[test]
    fn steps_are_capped_at_max() {
        let mut backoff = ExpBackoff::new(50 * MS, 2_000 * MS, 0.0);
        let steps: Vec<Duration> = (0..10).map(|_| backoff.next()).collect();
        assert_eq!(steps[5], 1_600 * MS);
        assert!(steps[6..].iter().all(|&s| s == 2_000 * MS), "{steps:?}");
    }

    #[test]
    fn a_first_step_above_max_is_taken_once_then_max() {
        let mut backoff = ExpBackoff::new(3_000 * MS, 2_000 * MS, 0.0);
        assert_eq!(backoff.next(), 3_000 * MS);
        assert_eq!(backoff.next(), 2_000 * MS);
        assert_eq!(backoff.next(), 2_000 * MS);
    }

    #[test]
    fn jittered_pauses_stay_within_the_step() {
        let mut backoff = ExpBackoff::new(50 * MS, 2_000 * MS, ExpBackoff::LINK_JITTER);
        let mut step = 50 * MS;
        for _ in 0..2_000 {
            let pause = backoff.next();
            assert!(
                pause >= step / 2 && pause <= step,
                "pause {pause:?} outside [{:?}, {step:?}]",
                step / 2
            );
            step = (step * 2).min(2_000 * MS);
        }
    }

    #[test]
    fn jitter_spreads_pauses() {
        // Not a lockstep: 100 draws of one step are not all equal.
        let draws: std::collections::HashSet<Duration> = (0..100)
            .map(|_| ExpBackoff::new(1_000 * MS, 1_000 * MS, 0.5).next())
            .collect();
        assert!(draws.len() > 1);
    }

    #[test]
    fn jitter_is_clamped() {
        let mut full = ExpBackoff::new(100 * MS, 100 * MS, 7.0);
        let mut none = ExpBackoff::new(100 * MS, 100 * MS, -1.0);
        let mut nan = ExpBackoff::new(100 * MS, 100 * MS, f64::NAN);
        for _ in 0..100 {
            assert!(full.next() <= 100 * MS);
            assert_eq!(none.next(), 100 * MS);
            assert_eq!(nan.next(), 100 * MS);
        }
    }

    #[test]
    fn reset_returns_to_initial() {
        let mut backoff = ExpBackoff::new(50 * MS, 2_000 * MS, 0.0);
        for _ in 0..8 {
            backoff.next();
        }
        assert_eq!(backoff.next(), 2_000 * MS);
        backoff.reset();
        assert_eq!(backoff.next(), 50 * MS);
        assert_eq!(backoff.next(), 100 * MS);
    }

    #[test]
    fn huge_steps_saturate_instead_of_overflowing() {
        let mut backoff = ExpBackoff::new(Duration::MAX / 2 + MS, Duration::MAX, 0.0);
        backoff.next();
        assert_eq!(backoff.next(), Duration::MAX);
        assert_eq!(backoff.next(), Duration::MAX);
    }
}
