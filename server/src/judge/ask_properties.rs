//! R35 with R3 and R4: asks among the verdicts of concurrently consulted
//! guards, answering in any order, decide as the sequential chain would
//! (an ask orders as a skip: the first enforced skip or ask decides), and
//! no path turns an ask into a proceed. The real judging over scripted
//! guards in paused time; arrival orders come from each guard's delay.

use super::TraceContext;
use super::paused_tests::World;
use crate::link::scripted::{Step, cancel, steer};
use guardmesh_proto::v1::{
    Action, EvaluateRequest, GuardMode, GuardSpec, ToolCall, Verdict, verdict,
};
use proptest::prelude::*;
use std::time::Duration;
use tokio::time::Instant;

/// What one guard says of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Says {
    Proceed,
    Steer,
    Cancel,
    Ask,
}

#[derive(Debug, Clone)]
struct GuardCase {
    enforced: bool,
    delay_ms: u64,
    says: Vec<Says>,
}

const CALLS: usize = 3;

fn guard_case() -> impl Strategy<Value = GuardCase> {
    let says = prop_oneof![
        Just(Says::Proceed),
        Just(Says::Steer),
        Just(Says::Cancel),
        Just(Says::Ask),
    ];
    (
        prop::bool::weighted(0.8),
        0u64..40,
        prop::collection::vec(says, CALLS),
    )
        .prop_map(|(enforced, delay_ms, says)| GuardCase {
            enforced,
            delay_ms,
            says,
        })
}

fn ask(call_id: &str, reason: &str) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(verdict::Outcome::Ask(guardmesh_proto::v1::Ask {
            reason: reason.into(),
            content: String::new(),
        })),
    }
}

/// The sequential chain's decision for call `c`: the first enforced guard
/// that skips or asks, and what it says.
fn sequential(guards: &[GuardCase], c: usize) -> Option<(usize, Says)> {
    guards
        .iter()
        .enumerate()
        .find(|(_, g)| g.enforced && g.says[c] != Says::Proceed)
        .map(|(k, g)| (k, g.says[c]))
}

fn run(guards: Vec<GuardCase>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let world = World::new();
        for (k, case) in guards.iter().enumerate() {
            let case = case.clone();
            let (url, _) = world.guard(move |batch| {
                let verdicts = batch
                    .calls
                    .iter()
                    .filter_map(|call| {
                        let c: usize = call.call_id[1..].parse().ok()?;
                        let id = call.call_id.as_str();
                        match case.says[c] {
                            Says::Proceed => None,
                            Says::Steer => Some(steer(id, &format!("steer by {k}"))),
                            Says::Cancel => Some(cancel(id, &format!("cancel by {k}"))),
                            Says::Ask => Some(ask(id, &format!("ask by {k}"))),
                        }
                    })
                    .collect();
                match Step::answer(batch, verdicts) {
                    Step::Answer { response, .. } => vec![Step::Answer {
                        after: Duration::from_millis(case.delay_ms),
                        response,
                    }],
                    other => vec![other],
                }
            });
            world
                .register(GuardSpec {
                    name: format!("g{k}"),
                    endpoint: url,
                    mode: if guards[k].enforced {
                        GuardMode::Enforce
                    } else {
                        GuardMode::DryRun
                    } as i32,
                    ..Default::default()
                })
                .await;
        }
        let request = EvaluateRequest {
            batch_id: "b".into(),
            calls: (0..CALLS)
                .map(|c| ToolCall {
                    call_id: format!("c{c}"),
                    tool: "t".into(),
                    arguments: format!("{{\"n\":{c}}}"),
                })
                .collect(),
            ..Default::default()
        };
        let decision = world
            .mesh
            .evaluate_unrecorded(
                request,
                Instant::now() + Duration::from_secs(5),
                TraceContext::default(),
            )
            .await
            .expect("decided");
        for (c, d) in decision.decisions.iter().enumerate() {
            let action = Action::try_from(d.action).expect("an action");
            match sequential(&guards, c) {
                None => assert_eq!(action, Action::Proceed, "c{c}: {d:?} ({guards:?})"),
                Some((k, says)) => {
                    let want = match says {
                        Says::Steer => Action::Steer,
                        Says::Cancel => Action::Cancel,
                        Says::Ask => Action::Ask,
                        Says::Proceed => unreachable!("found a skip or an ask"),
                    };
                    assert_eq!(action, want, "c{c}: {d:?} ({guards:?})");
                    assert_eq!(d.decided_by, format!("g{k}"), "c{c}: {d:?}");
                    if want == Action::Ask {
                        let approval = d.approval.as_ref().expect("an ask carries its request");
                        assert_eq!(approval.guard, format!("g{k}"));
                        assert_eq!(approval.reason, format!("ask by {k}"));
                        assert_eq!(approval.id.len(), 64, "the request was made: {d:?}");
                    }
                }
            }
            // Never a proceed past an enforced ask that nothing before it
            // skipped.
            if guards.iter().any(|g| g.enforced && g.says[c] == Says::Ask) {
                assert_ne!(action, Action::Proceed, "c{c}: {d:?} ({guards:?})");
            }
            let runs = decision.execute.iter().any(|e| e.call_id == d.call_id);
            assert_eq!(runs, action == Action::Proceed, "c{c}");
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(96),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// R35, R3, R4: asks fold as skips, in chain order, whatever the
    /// arrival order; an ask is never a proceed.
    #[test]
    fn r35_r4_asks_among_verdicts_decide_as_the_sequential_chain(
        guards in prop::collection::vec(guard_case(), 1..5)
    ) {
        run(guards);
    }
}
