//! How many requests one replica of a guard is sent at once (R25, R32): a
//! limit the mesh adapts from the replica's latency, in the manner of
//! Netflix's concurrency-limits `Gradient` and Envoy's adaptive
//! concurrency filter, as a pure state machine that takes the time and the
//! round trips as arguments.
//!
//! * The replica's *unloaded* latency is the least round trip seen in the
//!   last one or two windows of [`MIN_RTT_WINDOW`] (a windowed minimum, so
//!   a replica whose own pace changes for good is measured again). A
//!   window in which the replica was never lightly loaded (holding at most
//!   half its limit) can lower the figure but not raise it: under a long
//!   overload every round trip includes the guard's own queue, and taking
//!   that for the unloaded latency would let the limit creep up.
//! * Each answer moves the limit towards `limit * gradient + sqrt(limit)`,
//!   where `gradient = (TOLERANCE * unloaded + SLACK) / round trip`, held
//!   to `[0.5, 1]`: while answers come back within [`TOLERANCE`] times the
//!   unloaded latency (plus [`SLACK`], so that a guard answering in
//!   microseconds is not held back by a scheduler's jitter) the limit grows (by about its square root, the room
//!   left for requests that queue at the guard); once they take longer,
//!   requests are queuing inside the guard, and the limit shrinks towards
//!   what the guard judges at once. The `sqrt` term keeps it from falling
//!   below about 4 by the gradient alone.
//! * The limit grows only while the replica is given about as many
//!   requests as it allows: an idle replica's limit does not drift up.
//! * It starts at [`INITIAL`] (a slow start: a cold burst does not put
//!   twenty requests in front of the next client's at a guard that judges
//!   two at a time) and stays within `[min, max]`
//!   (`guard_links.min_in_flight`, `max_in_flight`; equal, they make a
//!   fixed limit).
//!
//! A guard that judges 2 batches at a time at 50 ms settles near 4 to 5 in
//! flight (round trips of 100-150 ms, not the seconds a queue of hundreds
//! inside the guard would take); one whose latency does not grow with
//! load grows to `max`.

use std::time::Duration;
use tokio::time::Instant;

/// Round trips within this factor of the unloaded latency (plus
/// [`SLACK`]) do not shrink the limit.
pub(crate) const TOLERANCE: f64 = 1.0;

/// Queueing this short at a guard never shrinks the limit.
pub(crate) const SLACK: Duration = Duration::from_millis(2);

/// The least round trip is the least of this window and the one before.
pub(crate) const MIN_RTT_WINDOW: Duration = Duration::from_secs(10);

/// The limit a replica starts with, within `max`.
pub(crate) const INITIAL: f64 = 4.0;

/// How far one answer moves the limit towards its new value.
const SMOOTHING: f64 = 0.2;

/// A replica's adaptive concurrency limit.
#[derive(Debug, Clone)]
pub(crate) struct Limit {
    limit: f64,
    min: f64,
    max: f64,
    /// The least round trip of the current window, in nanoseconds.
    current: Option<f64>,
    /// ... and of the window before.
    previous: Option<f64>,
    /// Whether the current window saw an answer while the replica held at
    /// most half its limit.
    light: bool,
    window_start: Instant,
}

impl Limit {
    /// A limit within `[min, max]` (at least 1), starting at [`INITIAL`]
    /// held to them; `min` = `max` is a fixed limit.
    pub(crate) fn new(min: usize, max: usize, now: Instant) -> Self {
        let max = (max.max(1)) as f64;
        let min = (min.max(1) as f64).min(max);
        Self {
            limit: INITIAL.clamp(min, max),
            min,
            max,
            current: None,
            previous: None,
            light: false,
            window_start: now,
        }
    }

    /// Requests the replica may hold now: at least 1.
    pub(crate) fn get(&self) -> usize {
        // The limit is at least 1, so truncation is its floor (without a
        // call to the maths library per request).
        (self.limit as usize).max(1)
    }

    /// The unloaded latency as measured, if any answer came yet.
    pub(crate) fn unloaded(&self) -> Option<Duration> {
        let least = match (self.current, self.previous) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(Duration::from_nanos(least as u64))
    }

    /// An answer came after `rtt` at `now`, while the replica held
    /// `in_flight` requests (this one included).
    pub(crate) fn answered(&mut self, rtt: Duration, in_flight: usize, now: Instant) {
        if now.saturating_duration_since(self.window_start) >= MIN_RTT_WINDOW {
            let ended = self.current.take();
            self.previous = match (self.light, self.previous, ended) {
                (false, Some(previous), Some(ended)) => Some(previous.min(ended)),
                (false, Some(previous), None) => Some(previous),
                (_, _, ended) => ended,
            };
            self.light = false;
            self.window_start = now;
        }
        if (in_flight as f64) * 2.0 <= self.limit {
            self.light = true;
        }
        let rtt = nanos(rtt).max(1.0);
        self.current = Some(self.current.map_or(rtt, |least| least.min(rtt)));
        let Some(unloaded) = self.unloaded() else {
            return;
        };
        let unloaded = nanos(unloaded).max(1.0);
        let slack = nanos(SLACK);
        let gradient = ((TOLERANCE * unloaded + slack) / rtt).clamp(0.5, 1.0);
        let mut next = self.limit * gradient + self.limit.sqrt();
        // An idle replica proves nothing about a larger limit.
        if (in_flight as f64) * 2.0 < self.limit {
            next = next.min(self.limit);
        }
        self.limit = (self.limit + (next - self.limit) * SMOOTHING).clamp(self.min, self.max);
    }
}

/// `d` in nanoseconds, as a float: from its seconds and nanoseconds, not
/// from the 128-bit `as_nanos` (whose conversion to a float is a software
/// routine), and equal to it for any duration under 104 days.
pub(crate) fn nanos(d: Duration) -> f64 {
    d.as_secs() as f64 * 1e9 + f64::from(d.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// R25: the limit's and the replica prices' arithmetic reads a round
    /// trip as its 128-bit nanoseconds did, to the nanosecond, for any
    /// round trip up to 104 days (a change of the conversion changes no
    /// choice of replica and no limit).
    #[test]
    fn r25_round_trips_read_in_nanoseconds_exactly() {
        let day = 86_400;
        for d in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_nanos(999_999_999),
            Duration::from_micros(1_500),
            Duration::new(1, 1),
            Duration::new(59, 999_999_999),
            Duration::new(104 * day, 123_456_789),
        ] {
            assert_eq!(nanos(d), d.as_nanos() as f64, "{d:?}");
            assert_eq!(nanos(d) as u128, d.as_nanos(), "{d:?}");
        }
    }

    /// A guard that judges `workers` requests at a time, each in `each`,
    /// first in first out, kept as full as the limit allows: the limit
    /// after each answer.
    fn run(limit: &mut Limit, workers: usize, each: Duration, answers: usize) -> Vec<usize> {
        let mut now = Instant::now();
        let mut waiting: std::collections::VecDeque<Instant> = Default::default();
        let mut judging: Vec<(Instant, Instant)> = Vec::new();
        let mut seen = Vec::new();
        for _ in 0..answers {
            while waiting.len() + judging.len() < limit.get() {
                waiting.push_back(now);
            }
            while judging.len() < workers {
                let Some(sent) = waiting.pop_front() else {
                    break;
                };
                judging.push((now + each, sent));
            }
            let in_flight = waiting.len() + judging.len();
            let first = (0..judging.len())
                .min_by_key(|&i| judging[i].0)
                .unwrap_or(0);
            let (done, sent) = judging.swap_remove(first);
            now = done;
            limit.answered(done - sent, in_flight, now);
            seen.push(limit.get());
        }
        seen
    }

    #[tokio::test(start_paused = true)]
    async fn r25_a_guard_judging_two_at_a_time_is_held_near_what_it_judges_at_once() {
        let mut limit = Limit::new(1, 128, Instant::now());
        assert_eq!(limit.get(), 4);
        let seen = run(&mut limit, 2, ms(50), 400);
        let settled = &seen[200..];
        let (lo, hi) = (
            settled.iter().min().copied().unwrap_or(0),
            settled.iter().max().copied().unwrap_or(0),
        );
        assert!((3..=6).contains(&lo) && hi <= 6, "settled in {lo}..={hi}");
    }

    #[tokio::test(start_paused = true)]
    async fn r25_a_guard_whose_latency_does_not_grow_with_load_gets_its_max() {
        let mut limit = Limit::new(1, 64, Instant::now());
        let seen = run(&mut limit, 1000, ms(5), 200);
        assert_eq!(seen.last().copied(), Some(64));
    }

    #[tokio::test(start_paused = true)]
    async fn r25_an_idle_replica_s_limit_does_not_drift_up() {
        let t0 = Instant::now();
        let mut limit = Limit::new(1, 128, t0);
        for i in 1..=200u32 {
            limit.answered(ms(5), 1, t0 + ms(10) * i);
        }
        assert_eq!(limit.get(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn r25_the_limit_never_leaves_one_to_max() {
        let t0 = Instant::now();
        let mut limit = Limit::new(1, 0, t0);
        assert_eq!(limit.get(), 1);
        limit.answered(ms(1), 1, t0);
        limit.answered(Duration::from_secs(60), 1, t0);
        assert_eq!(limit.get(), 1);
        let mut limit = Limit::new(1, 3, t0);
        assert_eq!(limit.get(), 3);
        let fixed = Limit::new(50, 50, t0);
        assert_eq!(fixed.get(), 50, "min = max: a fixed limit");
        for _ in 0..50 {
            limit.answered(ms(1), 3, t0);
        }
        assert_eq!(limit.get(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn r25_the_unloaded_latency_is_measured_again_after_two_windows() {
        let t0 = Instant::now();
        let mut limit = Limit::new(1, 128, t0);
        limit.answered(ms(10), 1, t0);
        limit.answered(ms(100), 1, t0 + MIN_RTT_WINDOW);
        assert_eq!(
            limit.unloaded(),
            Some(ms(10)),
            "the window before still counts"
        );
        limit.answered(ms(100), 1, t0 + MIN_RTT_WINDOW * 2);
        assert_eq!(limit.unloaded(), Some(ms(100)));
    }

    #[tokio::test(start_paused = true)]
    async fn r25_a_window_only_ever_loaded_does_not_raise_the_unloaded_latency() {
        let t0 = Instant::now();
        let mut limit = Limit::new(1, 128, t0);
        limit.answered(ms(10), 20, t0);
        for w in 1..=4u32 {
            limit.answered(ms(100), 20, t0 + MIN_RTT_WINDOW * w);
        }
        assert_eq!(limit.unloaded(), Some(ms(10)));
    }
}
