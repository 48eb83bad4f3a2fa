//! The fold: turns the verdicts of concurrently consulted guards into one
//! decision per call, *as if* the guards had been consulted one by one in
//! chain order (R3, R4).
//!
//! It is a pure state machine with no I/O and no clock, so the rule that
//! matters most (the concurrent fold equals the sequential one, whatever the
//! arrival order) is tested exhaustively by property tests below.
//!
//! The fold keeps a grid of cells, one per (guard, call). A call is *fixed*
//! when scanning its cells in chain order reaches a decisive cell (an enforced
//! skip, or a failure under `fail_closed`/`abort`) with every earlier cell
//! already answered, or reaches the end with every cell answered (R5). Dry-run
//! guards (R18) never decide, but a call waits for them as it would if they
//! enforced, so that a rollout measures the latency it will really cost.

// Its items are `pub` for the `cargo fuzz` targets, which reach them through
// the crate's `fuzzing` module (feature `fuzzing`); the crate itself keeps them
// private by not exporting this module.
#![allow(unreachable_pub)]

use guardmesh_proto::v1::{FailurePolicy, Skip};

/// What one guard said (or failed to say) about one call.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// The call was not sent to this guard (R9).
    NotSent,
    /// Sent; no answer yet.
    Pending,
    /// The guard proceeds (or deferred, or its verdict was malformed: R8).
    Proceed,
    /// The guard skips the call.
    Skip(Skip),
    /// The guard failed before answering for this call (R13).
    Failed,
}

/// How a guard's cells count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FoldGuard {
    /// False for dry-run guards: consulted, never decisive (R18).
    pub enforced: bool,
    pub policy: FailurePolicy,
}

/// What a guard's failure does to a call it applies to that is not fixed
/// yet (R13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// A dry-run guard (R18): the failure is traced and counted, and
    /// decides nothing.
    Ignore,
    /// `fail_open`: the guard counts as deferring (proceed), and the
    /// decision records that it was bypassed.
    Bypass,
    /// `fail_closed`: the call is skipped as cancel, marked as a failure.
    Cancel,
    /// `abort`: the whole batch fails.
    Abort,
}

impl FoldGuard {
    /// The failure policy (R13), in the one place it is read: the fold's
    /// scan and its bypass records both ask here, for validate guards and
    /// (through a one-guard fold each) mutate guards alike.
    pub fn on_failure(self) -> OnFailure {
        if !self.enforced {
            return OnFailure::Ignore;
        }
        match self.policy {
            FailurePolicy::FailClosed => OnFailure::Cancel,
            FailurePolicy::FailOpen => OnFailure::Bypass,
            FailurePolicy::Abort => OnFailure::Abort,
        }
    }
}

/// The state of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Some guard that could still decide has not answered.
    Open,
    /// Every applicable guard proceeded (or was bypassed under `fail_open`).
    Proceed,
    /// The guard at this index skipped it first.
    Skip(usize),
    /// The guard at this index failed first, under `fail_closed`.
    FailClosed(usize),
    /// The guard at this index failed first, under `abort`: the batch fails.
    Abort(usize),
}

/// What fixed a call.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    /// The guard at this index skipped it first.
    Skip { guard: usize, skip: Skip },
    /// The guard at this index failed first under `fail_closed` (R13): the
    /// call is cancelled because that guard is unavailable.
    Unavailable { guard: usize },
}

/// What the fold decided for one call.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The `fail_open` guards passed over before the decision (R13).
    pub bypassed: Vec<usize>,
    /// What fixed the call; `None` when it proceeds.
    pub decided: Option<Decided>,
}

/// The grid of (guard, call) cells and each call's resolution.
#[derive(Debug, Clone)]
pub struct Fold {
    guards: Vec<FoldGuard>,
    calls: usize,
    cells: Vec<Cell>,
    resolutions: Vec<Resolution>,
    open: usize,
    abort: Option<usize>,
}

impl Fold {
    /// A fold for `calls` calls over `guards` in chain order. `sent(g, c)`
    /// tells whether call `c` is sent to guard `g`.
    pub fn new(guards: Vec<FoldGuard>, calls: usize, sent: impl Fn(usize, usize) -> bool) -> Self {
        let mut cells = Vec::with_capacity(guards.len() * calls);
        for g in 0..guards.len() {
            for c in 0..calls {
                cells.push(if sent(g, c) {
                    Cell::Pending
                } else {
                    Cell::NotSent
                });
            }
        }
        let mut fold = Self {
            guards,
            calls,
            cells,
            resolutions: vec![Resolution::Open; calls],
            open: calls,
            abort: None,
        };
        for c in 0..calls {
            fold.resolve(c);
        }
        fold
    }

    /// The cell of guard `g` for call `c`.
    pub fn cell(&self, g: usize, c: usize) -> &Cell {
        &self.cells[g * self.calls + c]
    }

    /// Whether guard `g` still has an unanswered call.
    pub fn pending(&self, g: usize) -> bool {
        self.cells[g * self.calls..(g + 1) * self.calls].contains(&Cell::Pending)
    }

    /// Records guard `g`'s verdict for call `c`. A verdict for a call that is
    /// not pending at that guard (never sent, already answered) is refused
    /// and returns false: the caller traces it as malformed (R8).
    pub fn answer(&mut self, g: usize, c: usize, verdict: Option<Skip>) -> bool {
        let idx = g * self.calls + c;
        if self.cells[idx] != Cell::Pending {
            return false;
        }
        self.cells[idx] = match verdict {
            Some(skip) => Cell::Skip(skip),
            None => Cell::Proceed,
        };
        self.resolve(c);
        true
    }

    /// Guard `g` answered finally: its unanswered calls defer (proceed).
    pub fn complete(&mut self, g: usize) {
        self.settle(g, Cell::Proceed);
    }

    /// Guard `g` failed: its unanswered calls fail per its policy (R13).
    pub fn fail(&mut self, g: usize) {
        self.settle(g, Cell::Failed);
    }

    fn settle(&mut self, g: usize, to: Cell) {
        for c in 0..self.calls {
            let idx = g * self.calls + c;
            if self.cells[idx] == Cell::Pending {
                self.cells[idx] = to.clone();
                self.resolve(c);
            }
        }
    }

    fn resolve(&mut self, c: usize) {
        if self.resolutions[c] != Resolution::Open {
            return;
        }
        let resolution = self.scan(c);
        if resolution != Resolution::Open {
            self.resolutions[c] = resolution;
            self.open -= 1;
            if let Resolution::Abort(g) = resolution {
                self.abort.get_or_insert(g);
            }
        }
    }

    fn scan(&self, c: usize) -> Resolution {
        for (g, guard) in self.guards.iter().enumerate() {
            match self.cell(g, c) {
                Cell::NotSent | Cell::Proceed => {}
                Cell::Pending => return Resolution::Open,
                Cell::Skip(_) if guard.enforced => return Resolution::Skip(g),
                Cell::Skip(_) => {}
                Cell::Failed => match guard.on_failure() {
                    OnFailure::Cancel => return Resolution::FailClosed(g),
                    OnFailure::Abort => return Resolution::Abort(g),
                    OnFailure::Bypass | OnFailure::Ignore => {}
                },
            }
        }
        Resolution::Proceed
    }

    /// True once every call is fixed, or the batch must abort.
    pub fn done(&self) -> bool {
        self.open == 0 || self.abort.is_some()
    }

    /// The first guard whose `abort` failure was reached, if any.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn aborted_by(&self) -> Option<usize> {
        self.abort
    }

    /// Call `c`'s resolution.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn resolution(&self, c: usize) -> Resolution {
        self.resolutions[c]
    }

    /// The `fail_open` guards that failed for call `c` and were passed over
    /// before its decision.
    pub fn bypassed(&self, c: usize) -> impl Iterator<Item = usize> + '_ {
        let until = match self.resolutions[c] {
            Resolution::Skip(g) | Resolution::FailClosed(g) | Resolution::Abort(g) => g,
            Resolution::Proceed | Resolution::Open => self.guards.len(),
        };
        (0..until).filter(move |&g| {
            self.guards[g].on_failure() == OnFailure::Bypass && *self.cell(g, c) == Cell::Failed
        })
    }

    /// What was decided for each call, once the fold is [`done`](Self::done):
    /// `Err(g)` when guard `g`'s `abort` failure fails the batch (R13),
    /// else one [`Outcome`] per call, in call order. The skips are moved out.
    pub fn outcomes(&mut self) -> Result<Vec<Outcome>, usize> {
        if let Some(g) = self.abort {
            return Err(g);
        }
        Ok((0..self.calls)
            .map(|c| {
                let bypassed = self.bypassed(c).collect();
                let decided = match self.resolutions[c] {
                    // Open only before the fold is done; Abort is handled
                    // above.
                    Resolution::Proceed | Resolution::Open | Resolution::Abort(_) => None,
                    Resolution::Skip(g) => Some(Decided::Skip {
                        guard: g,
                        skip: self.take_skip(g, c).unwrap_or_default(),
                    }),
                    Resolution::FailClosed(g) => Some(Decided::Unavailable { guard: g }),
                };
                Outcome { bypassed, decided }
            })
            .collect())
    }

    /// Takes the skip guard `g` sent for call `c`, if it sent one.
    pub fn take_skip(&mut self, g: usize, c: usize) -> Option<Skip> {
        match &mut self.cells[g * self.calls + c] {
            Cell::Skip(skip) => Some(std::mem::take(skip)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn skip(content: &str) -> Option<Skip> {
        Some(Skip {
            content: content.into(),
            kind: 0,
        })
    }

    fn enforce(policy: FailurePolicy) -> FoldGuard {
        FoldGuard {
            enforced: true,
            policy,
        }
    }

    #[test]
    fn r3_earlier_skip_wins_even_when_it_answers_last() {
        let guards = vec![enforce(FailurePolicy::FailClosed); 2];
        let mut f = Fold::new(guards, 1, |_, _| true);
        assert!(f.answer(1, 0, skip("late guard")));
        assert!(!f.done(), "guard 0 has not answered: the call is not fixed");
        assert!(f.answer(0, 0, skip("early guard")));
        assert!(f.done());
        assert_eq!(f.resolution(0), Resolution::Skip(0));
    }

    #[test]
    fn r5_fixed_when_first_guard_skips_without_waiting_for_later() {
        let guards = vec![enforce(FailurePolicy::FailClosed); 3];
        let mut f = Fold::new(guards, 1, |_, _| true);
        f.answer(0, 0, skip("no"));
        assert!(f.done());
        assert!(f.pending(2), "the later guard is still out: superseded");
    }

    #[test]
    fn r8_second_verdict_and_unsent_call_are_refused() {
        let guards = vec![enforce(FailurePolicy::FailClosed); 1];
        let mut f = Fold::new(guards, 2, |_, c| c == 0);
        assert!(f.answer(0, 0, None));
        assert!(!f.answer(0, 0, skip("again")), "duplicate verdict");
        assert!(!f.answer(0, 1, skip("never sent")));
        assert_eq!(f.resolution(0), Resolution::Proceed);
        assert_eq!(f.resolution(1), Resolution::Proceed);
    }

    #[test]
    fn r13_fail_open_is_bypassed_and_recorded() {
        let guards = vec![
            enforce(FailurePolicy::FailOpen),
            enforce(FailurePolicy::FailClosed),
        ];
        let mut f = Fold::new(guards, 1, |_, _| true);
        f.fail(0);
        f.complete(1);
        assert_eq!(f.resolution(0), Resolution::Proceed);
        assert_eq!(f.bypassed(0).collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn r18_dry_run_skip_never_decides() {
        let guards = vec![
            FoldGuard {
                enforced: false,
                policy: FailurePolicy::Abort,
            },
            enforce(FailurePolicy::FailClosed),
        ];
        let mut f = Fold::new(guards, 1, |_, _| true);
        f.answer(0, 0, skip("would skip"));
        assert!(!f.done());
        f.complete(1);
        assert_eq!(f.resolution(0), Resolution::Proceed);
        let mut f = Fold::new(guards_dry_fail(), 1, |_, _| true);
        f.fail(0);
        f.complete(1);
        assert_eq!(
            f.resolution(0),
            Resolution::Proceed,
            "a failing dry-run guard aborts nothing"
        );
    }

    #[test]
    fn r13_failure_policy_under_each_policy() {
        let cases = [
            (true, FailurePolicy::FailClosed, OnFailure::Cancel),
            (true, FailurePolicy::FailOpen, OnFailure::Bypass),
            (true, FailurePolicy::Abort, OnFailure::Abort),
            (false, FailurePolicy::FailClosed, OnFailure::Ignore),
            (false, FailurePolicy::FailOpen, OnFailure::Ignore),
            (false, FailurePolicy::Abort, OnFailure::Ignore),
        ];
        for (enforced, policy, want) in cases {
            let guard = FoldGuard { enforced, policy };
            assert_eq!(guard.on_failure(), want, "{guard:?}");
        }
    }

    /// A guard that skipped call 0, answered nothing for call 1 and was not
    /// sent call 2, then failed: what its policy makes of the batch.
    fn one_guard_fails(guard: FoldGuard) -> Result<Vec<Outcome>, usize> {
        let mut f = Fold::new(vec![guard], 3, |_, c| c < 2);
        f.answer(0, 0, skip("no"));
        f.fail(0);
        assert!(f.done());
        f.outcomes()
    }

    #[test]
    fn r13_fail_closed_cancels_the_unanswered_calls_only() {
        let outcomes = one_guard_fails(enforce(FailurePolicy::FailClosed)).unwrap();
        assert_eq!(
            outcomes,
            vec![
                Outcome {
                    bypassed: vec![],
                    decided: Some(Decided::Skip {
                        guard: 0,
                        skip: skip("no").unwrap()
                    }),
                },
                Outcome {
                    bypassed: vec![],
                    decided: Some(Decided::Unavailable { guard: 0 }),
                },
                Outcome {
                    bypassed: vec![],
                    decided: None,
                },
            ]
        );
    }

    #[test]
    fn r13_fail_open_bypasses_the_unanswered_calls_only() {
        let outcomes = one_guard_fails(enforce(FailurePolicy::FailOpen)).unwrap();
        assert!(matches!(
            outcomes[0].decided,
            Some(Decided::Skip { guard: 0, .. })
        ));
        assert!(outcomes[0].bypassed.is_empty(), "its skip stands");
        assert_eq!(
            outcomes[1],
            Outcome {
                bypassed: vec![0],
                decided: None,
            }
        );
        assert!(outcomes[2].bypassed.is_empty(), "not sent: not bypassed");
    }

    #[test]
    fn r13_abort_fails_the_batch() {
        assert_eq!(one_guard_fails(enforce(FailurePolicy::Abort)), Err(0));
    }

    #[test]
    fn r18_failing_dry_run_guard_decides_nothing() {
        for policy in [
            FailurePolicy::FailClosed,
            FailurePolicy::FailOpen,
            FailurePolicy::Abort,
        ] {
            let outcomes = one_guard_fails(FoldGuard {
                enforced: false,
                policy,
            })
            .unwrap();
            let none = Outcome {
                bypassed: vec![],
                decided: None,
            };
            assert_eq!(outcomes, vec![none; 3], "{policy:?}");
        }
    }

    #[test]
    fn r13_bypass_is_recorded_only_before_the_deciding_guard() {
        let guards = vec![
            enforce(FailurePolicy::FailOpen),
            enforce(FailurePolicy::FailClosed),
            enforce(FailurePolicy::FailOpen),
        ];
        let mut f = Fold::new(guards, 2, |_, _| true);
        f.fail(0);
        f.answer(1, 0, skip("no"));
        f.answer(1, 1, None);
        f.complete(1);
        f.fail(2);
        let outcomes = f.outcomes().unwrap();
        assert_eq!(outcomes[0].bypassed, vec![0]);
        assert!(matches!(
            outcomes[0].decided,
            Some(Decided::Skip { guard: 1, .. })
        ));
        assert_eq!(outcomes[1].bypassed, vec![0, 2]);
        assert_eq!(outcomes[1].decided, None);
    }

    fn guards_dry_fail() -> Vec<FoldGuard> {
        vec![
            FoldGuard {
                enforced: false,
                policy: FailurePolicy::Abort,
            },
            enforce(FailurePolicy::FailClosed),
        ]
    }

    /// What a guard will do for the whole batch in a generated scenario.
    #[derive(Debug, Clone)]
    enum Behaviour {
        /// Per call: skip (true) or proceed (false); answered call by call.
        Answer(Vec<bool>),
        /// Fails after answering the first `n` calls it was sent.
        FailAfter(usize, Vec<bool>),
    }

    fn policy() -> impl Strategy<Value = FailurePolicy> {
        prop_oneof![
            Just(FailurePolicy::FailClosed),
            Just(FailurePolicy::FailOpen),
            Just(FailurePolicy::Abort)
        ]
    }

    #[derive(Debug, Clone)]
    struct Scenario {
        calls: usize,
        guards: Vec<FoldGuard>,
        sent: Vec<Vec<bool>>,
        behaviour: Vec<Behaviour>,
        order: Vec<usize>,
    }

    fn scenario() -> impl Strategy<Value = Scenario> {
        (1usize..6, 1usize..6).prop_flat_map(|(calls, guards)| {
            let guard = (
                any::<bool>(),
                policy(),
                prop::collection::vec(any::<bool>(), calls),
            );
            let behaviour = prop_oneof![
                prop::collection::vec(any::<bool>(), calls).prop_map(Behaviour::Answer),
                (0usize..6, prop::collection::vec(any::<bool>(), calls))
                    .prop_map(|(n, v)| Behaviour::FailAfter(n, v)),
            ];
            (
                prop::collection::vec(guard, guards),
                prop::collection::vec(behaviour, guards),
                // Each event is (guard, step); order is a shuffle of indices.
                Just(()).prop_perturb(move |_, mut rng| {
                    let mut order: Vec<usize> = (0..guards * (calls + 1)).collect();
                    for i in (1..order.len()).rev() {
                        let j = (rng.next_u64() as usize) % (i + 1);
                        order.swap(i, j);
                    }
                    order
                }),
            )
                .prop_map(move |(gs, behaviour, order)| Scenario {
                    calls,
                    guards: gs
                        .iter()
                        .map(|(enforced, policy, _)| FoldGuard {
                            enforced: *enforced,
                            policy: *policy,
                        })
                        .collect(),
                    sent: gs.iter().map(|(_, _, sent)| sent.clone()).collect(),
                    behaviour,
                    order,
                })
        })
    }

    /// The events guard `g` produces in its own order: `Some(c, skip)` answers
    /// a call, `None` ends the guard (complete, or fail).
    fn events_of(s: &Scenario, g: usize) -> Vec<Option<(usize, bool)>> {
        let sent: Vec<usize> = (0..s.calls).filter(|&c| s.sent[g][c]).collect();
        match &s.behaviour[g] {
            Behaviour::Answer(v) => sent
                .iter()
                .map(|&c| Some((c, v[c])))
                .chain(std::iter::once(None))
                .collect(),
            Behaviour::FailAfter(n, v) => sent
                .iter()
                .take(*n)
                .map(|&c| Some((c, v[c])))
                .chain(std::iter::once(None))
                .collect(),
        }
    }

    /// The sequential reference: each call judged by the guards one by one.
    fn sequential(s: &Scenario) -> (Vec<Resolution>, bool) {
        let mut out = Vec::new();
        let mut abort = false;
        for c in 0..s.calls {
            let mut res = Resolution::Proceed;
            for g in 0..s.guards.len() {
                if !s.sent[g][c] {
                    continue;
                }
                let answered = events_of(s, g)
                    .into_iter()
                    .flatten()
                    .find(|(call, _)| *call == c);
                let guard = s.guards[g];
                match answered {
                    Some((_, true)) if guard.enforced => {
                        res = Resolution::Skip(g);
                        break;
                    }
                    Some(_) => {}
                    None => {
                        let failed = matches!(s.behaviour[g], Behaviour::FailAfter(..));
                        if failed && guard.enforced {
                            match guard.policy {
                                FailurePolicy::FailClosed => {
                                    res = Resolution::FailClosed(g);
                                    break;
                                }
                                FailurePolicy::Abort => {
                                    res = Resolution::Abort(g);
                                    abort = true;
                                    break;
                                }
                                FailurePolicy::FailOpen => {}
                            }
                        }
                    }
                }
            }
            out.push(res);
        }
        (out, abort)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// R4: whatever order the guards' answers arrive in, the concurrent
        /// fold gives the sequential fold's decisions, and every call gets
        /// exactly one (R2).
        #[test]
        fn r4_concurrent_fold_equals_sequential(s in scenario()) {
            let sent = s.sent.clone();
            let mut fold = Fold::new(s.guards.clone(), s.calls, |g, c| sent[g][c]);
            let mut queues: Vec<std::collections::VecDeque<_>> =
                (0..s.guards.len()).map(|g| events_of(&s, g).into()).collect();
            for &pick in &s.order {
                if fold.done() { break; }
                let g = pick % s.guards.len();
                let Some(event) = queues[g].pop_front() else { continue };
                match event {
                    Some((c, true)) => { fold.answer(g, c, skip("no")); }
                    Some((c, false)) => { fold.answer(g, c, None); }
                    None if matches!(s.behaviour[g], Behaviour::FailAfter(..)) => fold.fail(g),
                    None => fold.complete(g),
                }
            }
            // Drain what the shuffle left, in guard order.
            for (g, queue) in queues.iter_mut().enumerate() {
                while let Some(event) = queue.pop_front() {
                    if fold.done() { break; }
                    match event {
                        Some((c, true)) => { fold.answer(g, c, skip("no")); }
                        Some((c, false)) => { fold.answer(g, c, None); }
                        None if matches!(s.behaviour[g], Behaviour::FailAfter(..)) => fold.fail(g),
                        None => fold.complete(g),
                    }
                }
            }
            prop_assert!(fold.done());
            let (expected, abort) = sequential(&s);
            prop_assert_eq!(fold.aborted_by().is_some(), abort);
            if !abort {
                for (c, want) in expected.iter().enumerate() {
                    prop_assert_eq!(fold.resolution(c), *want, "call {}", c);
                }
            }
        }
    }
}
