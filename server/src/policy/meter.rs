//! The metered budget of one call's evaluation: the work actually done,
//! counted as it is done, and the time it may take.
//!
//! The estimate of `cost` is checked before a call is judged; the meter
//! counts while it is judged, so that what the estimate cannot see (the
//! bytes of strings, a macro over a list built at evaluation) is bounded
//! too. The fast path (`plan`) charges one unit per step and one per byte
//! of text it reads or builds (`lowerAscii`, `matches`, `contains`...). The
//! CEL interpreter has no hook to count its steps; what it reads of the
//! input it reads through the variables `call`, `calls` and `context`, so
//! each read of one of them is charged one unit plus the bytes it holds
//! (every operation on what was read is at most linear in those bytes).
//! Once the budget is spent or the deadline passed, every further charge
//! fails: the fast path gives up, and the interpreter finds the variable
//! undefined and stops with an error, which the engine reads as the bound
//! (never as a rule error).

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// Why a meter stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The call's work budget is spent.
    Work,
    /// The guard's time (its timeout within the batch's deadline) is up.
    Deadline,
}

/// Charges above this many units check the clock at once.
const LARGE: u64 = 1 << 16;

/// How many charges pass between two looks at the clock.
const CLOCK_EVERY: u32 = 256;

/// The budget of one call's evaluation. Atomics only because the
/// interpreter's variable resolver must be `Sync`; one thread uses it.
#[derive(Debug)]
pub(crate) struct Meter {
    left: AtomicU64,
    deadline: Option<Instant>,
    ticks: AtomicU32,
    /// 0: running; 1: [`Stop::Work`]; 2: [`Stop::Deadline`].
    stop: AtomicU8,
}

impl Meter {
    /// A meter of `units`, until `deadline` if given.
    pub(crate) fn new(units: u64, deadline: Option<Instant>) -> Self {
        Self {
            left: AtomicU64::new(units),
            deadline,
            ticks: AtomicU32::new(0),
            stop: AtomicU8::new(0),
        }
    }

    /// Charges `units`: false once the budget is spent or the time is up.
    #[inline]
    pub(crate) fn charge(&self, units: u64) -> bool {
        if self.stop.load(Ordering::Relaxed) != 0 {
            return false;
        }
        let left = self.left.load(Ordering::Relaxed);
        if units > left {
            self.left.store(0, Ordering::Relaxed);
            self.stop.store(1, Ordering::Relaxed);
            return false;
        }
        self.left.store(left - units, Ordering::Relaxed);
        if let Some(deadline) = self.deadline {
            let ticks = self.ticks.load(Ordering::Relaxed).wrapping_add(1);
            self.ticks.store(ticks, Ordering::Relaxed);
            if (units >= LARGE || ticks.is_multiple_of(CLOCK_EVERY)) && Instant::now() >= deadline {
                self.stop.store(2, Ordering::Relaxed);
                return false;
            }
        }
        true
    }

    /// The units not spent.
    pub(crate) fn left(&self) -> u64 {
        self.left.load(Ordering::Relaxed)
    }

    /// Why it stopped, if it did.
    pub(crate) fn stopped(&self) -> Option<Stop> {
        match self.stop.load(Ordering::Relaxed) {
            0 => None,
            1 => Some(Stop::Work),
            _ => Some(Stop::Deadline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_stays_spent() {
        let meter = Meter::new(10, None);
        assert!(meter.charge(4));
        assert!(meter.charge(6));
        assert!(!meter.charge(1));
        assert_eq!(meter.stopped(), Some(Stop::Work));
        assert!(!meter.charge(0), "nothing passes once stopped");
    }

    #[test]
    fn the_deadline_stops_it() {
        let meter = Meter::new(u64::MAX, Some(Instant::now()));
        assert!(!meter.charge(LARGE));
        assert_eq!(meter.stopped(), Some(Stop::Deadline));
    }
}
