//! R3/R4 across policy and remote guards (R27): a chain mixing one policy
//! guard, at a random position, with remote guards (Rust guards of the
//! harness, and in one case a real Python `grpcio` guard) gets batches with
//! random verdicts, and every call is decided by the earliest guard in
//! registration order that skips it, whichever guard is the policy and
//! whichever answers first.
//!
//! What each guard does with a call is written in the call's arguments:
//! `{"skip": {"g1": "steer", "policy": "cancel"}}`. The Rust guards and the
//! policy's rules read it; the Python guard (`no_delete.py`) cancels every
//! `fs.delete` call, so a call's tool is its verdict. The remote guards
//! answer after a random delay, so the policy (answered in the mesh at
//! once) is often first to answer and must still not win over an earlier
//! guard. Seeded: a failure prints the seed (`GUARDMESH_SEED` replays it).

use crate::harness::*;
use guardmesh_client::verdict::{cancel, steer};
use guardmesh_client::{Batch, BatchDecision, Outcome, Registration};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

/// The policy guard's rules: the verdict its call's arguments ask of it.
const POLICY: &str = concat!(
    policy_rule!(name: "asked-to-steer", action: "steer",
        when: r#""has(call.args.skip.policy) && call.args.skip.policy == 'steer'""#,
        message: r#"'"policy steer"'"#),
    policy_rule!(name: "asked-to-cancel", action: "cancel",
        when: r#""has(call.args.skip.policy) && call.args.skip.policy == 'cancel'""#,
        message: r#"'"policy cancel"'"#),
);

/// What the Python guard says of an `fs.delete` call.
const PYTHON_CANCEL: &str = "Deleting files is not allowed.";

/// A skip, as the test expects it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expected {
    Proceed,
    Steer(String, String),
    Cancel(String, String),
}

/// A Rust guard named `name` that skips what each call's arguments ask of
/// it, after a random delay of up to `max_delay_ms`.
async fn asked_guard(name: &'static str, max_delay_ms: u64) -> TestGuard {
    script_guard(move |batch| {
        let verdicts = batch
            .calls
            .iter()
            .filter_map(|call| {
                let args: serde_json::Value = serde_json::from_str(&call.arguments).ok()?;
                match args["skip"][name].as_str()? {
                    "steer" => Some(steer(&call.call_id, format!("{name} steer"))),
                    "cancel" => Some(cancel(&call.call_id, format!("{name} cancel"))),
                    _ => None,
                }
            })
            .collect();
        Script {
            delay: Duration::from_millis(rand::rng().random_range(0..=max_delay_ms)),
            verdicts,
            error: None,
        }
    })
    .await
}

/// The decision each call must get: the skip of the earliest guard of
/// `chain` that skips it (R3, R4), or proceed.
fn expected(chain: &[&str], skips: &BTreeMap<&str, &str>, tool: &str) -> Expected {
    for guard in chain {
        if *guard == "py" {
            if tool == "fs.delete" {
                return Expected::Cancel("py".into(), PYTHON_CANCEL.into());
            }
            continue;
        }
        match skips.get(guard) {
            Some(&"steer") => return Expected::Steer((*guard).into(), format!("{guard} steer")),
            Some(&"cancel") => {
                return Expected::Cancel((*guard).into(), format!("{guard} cancel"));
            }
            _ => {}
        }
    }
    Expected::Proceed
}

fn got(decision: &BatchDecision, call_id: &str) -> Expected {
    let call = decision
        .call(call_id)
        .unwrap_or_else(|| panic!("no decision for {call_id}"));
    let by = call.decided_by.clone().unwrap_or_default();
    match &call.outcome {
        Outcome::Proceed => Expected::Proceed,
        Outcome::Steer { content } => Expected::Steer(by, content.clone()),
        Outcome::Cancel { content } => Expected::Cancel(by, content.clone()),
        Outcome::Ask { .. } => panic!("{call_id}: no policy guard here asks"),
    }
}

/// One chain: `remotes` Rust guards and the policy at `policy_at`, plus the
/// Python guard at `python_at` when given; `batches` random batches.
async fn check_chain(
    rng: &mut StdRng,
    seed: u64,
    remotes: usize,
    policy_at: usize,
    python: Option<(&KitGuard, usize)>,
    batches: usize,
) {
    const NAMES: [&str; 3] = ["g0", "g1", "g2"];
    let mesh = TestMesh::start().await;
    let mut guards = Vec::new();
    let mut chain: Vec<&str> = Vec::new();
    for name in &NAMES[..remotes] {
        guards.push(asked_guard(name, 15).await);
        chain.push(name);
    }
    chain.insert(policy_at.min(chain.len()), "policy");
    if let Some((_, at)) = python {
        chain.insert(at.min(chain.len()), "py");
    }
    for name in &chain {
        let registration = match *name {
            "policy" => Registration::policy("policy", POLICY),
            "py" => Registration::validate("py", &python.expect("the Python guard").0.url),
            other => {
                let i = NAMES.iter().position(|n| n == &other).unwrap();
                Registration::validate(other, &guards[i].url)
            }
        };
        mesh.register(registration).await;
    }
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("order").await.unwrap();
    for b in 0..batches {
        let mut batch = Batch::new(b as u32);
        let mut want = Vec::new();
        for c in 0..rng.random_range(1..=6) {
            let mut skips = BTreeMap::new();
            for guard in chain.iter().filter(|g| **g != "py") {
                match rng.random_range(0..4) {
                    0 => {
                        skips.insert(*guard, "steer");
                    }
                    1 => {
                        skips.insert(*guard, "cancel");
                    }
                    _ => {}
                }
            }
            let tool = if python.is_some() && rng.random_bool(0.4) {
                "fs.delete"
            } else {
                "fs.read"
            };
            let call_id = format!("c{c}");
            want.push((call_id.clone(), expected(&chain, &skips, tool)));
            batch = batch.call(call_id, tool, json!({ "skip": skips }).to_string());
        }
        let decision = session.evaluate(batch).await.unwrap();
        for (call_id, expected) in want {
            assert_eq!(
                got(&decision, &call_id),
                expected,
                "seed {seed}, chain {chain:?}, batch {b}, call {call_id}: {decision:?}"
            );
        }
    }
}

fn seed() -> u64 {
    let seed = std::env::var("GUARDMESH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("policy_order: seed {seed} (GUARDMESH_SEED={seed} replays it)");
    seed
}

#[tokio::test]
async fn r3_r4_r27_policy_at_random_positions_among_rust_guards_keeps_chain_order() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // 10 chains of 1 to 3 Rust guards, the policy anywhere among them, 6
    // batches of up to 6 calls each; every position is tried at least once.
    for case in 0..10usize {
        let remotes = 1 + case % 3;
        let policy_at = if case < 4 {
            case.min(remotes)
        } else {
            rng.random_range(0..=remotes)
        };
        check_chain(&mut rng, seed, remotes, policy_at, None, 6).await;
    }
}

#[tokio::test]
async fn r3_r4_r27_policy_rust_and_python_guards_keep_chain_order() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let python = KitGuard::python("no_delete.py", &[]);
    // The Python guard first, in the middle and last, the policy at a
    // random position around it.
    for python_at in [0, 1, 2] {
        let policy_at = rng.random_range(0..=2);
        check_chain(&mut rng, seed, 2, policy_at, Some((&python, python_at)), 5).await;
    }
}

/// R10/R27: a policy guard judges the calls as the mutate guards left
/// them, not as the coordinator sent them: a rewrite that makes a payment
/// large is steered by the policy, one that makes it small proceeds, and
/// calls not rewritten are judged on their own arguments (the mesh reads
/// those from what its check recorded, the rewritten ones afresh).
#[tokio::test]
async fn r10_r27_policy_judges_the_arguments_as_rewritten() {
    use guardmesh_client::verdict::rewrite_arguments;
    const RULES: &str = policy_rule!(name: "big-payment", action: "steer",
        when: r#""call.args.amount > 10000""#,
        message: r#"'"a payment of " + string(call.args.amount) + " needs a human"'"#);
    // Rewrites each call's amount to what its `to` member says.
    let mutate = script_guard(|batch| Script {
        delay: Duration::ZERO,
        verdicts: batch
            .calls
            .iter()
            .filter_map(|call| {
                let args: serde_json::Value = serde_json::from_str(&call.arguments).ok()?;
                let to = args.get("to")?.as_i64()?;
                Some(rewrite_arguments(&call.call_id, &json!({ "amount": to })))
            })
            .collect(),
        error: None,
    })
    .await;
    let mesh = TestMesh::start().await;
    mesh.register(Registration::mutate("m", &mutate.url, ["pay"]))
        .await;
    mesh.register(Registration::policy("policy", RULES)).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("rewrites").await.unwrap();
    let batch = Batch::new(0)
        .call("up", "pay", json!({ "amount": 5, "to": 50000 }).to_string())
        .call(
            "down",
            "pay",
            json!({ "amount": 50000, "to": 5 }).to_string(),
        )
        .call("big", "pay", json!({ "amount": 20000 }).to_string())
        .call(
            "small",
            "pay",
            json!({ "note": "x", "amount": 20 }).to_string(),
        );
    let decision = session.evaluate(batch).await.unwrap();
    let outcome = |id: &str| decision.call(id).map(|c| c.outcome.clone());
    assert_eq!(
        outcome("up"),
        Some(steered("a payment of 50000 needs a human")),
        "{decision:?}"
    );
    assert_eq!(outcome("down"), Some(Outcome::Proceed), "{decision:?}");
    assert_eq!(
        outcome("big"),
        Some(steered("a payment of 20000 needs a human")),
        "{decision:?}"
    );
    assert_eq!(outcome("small"), Some(Outcome::Proceed), "{decision:?}");
}
