//! Policy guards fail closed and every client stays in its lane (R13, R14,
//! R25, R27): one call's content never decides another call, a rule error
//! never skips the rules after it, a costly batch never stalls other
//! clients, and registrations cannot exhaust the mesh's memory. Against a
//! real `guardmesh serve` on loopback, with its default runtime, the
//! canary on a connection of its own.

use crate::harness::*;
use guardmesh_client::proto::{FailurePolicy, TraceStatus};
use guardmesh_client::{
    Batch, BatchDecision, CallDecision, Coordinator, Outcome, Registrar, Registration,
};
use std::time::{Duration, Instant};

/// A mesh process with nothing in its chain.
async fn mesh(name: &str) -> MeshProcess {
    MeshProcess::start(name, "", Some("warn")).await
}

async fn register(mesh: &MeshProcess, spec: Registration) {
    let registrar = Registrar::connect(&mesh.url).await.unwrap();
    registrar.register(spec).await.unwrap();
}

fn guard_trace(
    d: &guardmesh_client::BatchDecision,
    name: &str,
) -> guardmesh_client::proto::GuardTrace {
    d.trace.iter().find(|t| t.guard == name).unwrap().clone()
}

/// A JSON array of `n` zeros: `[0,0,...]`, about `2n` bytes.
fn zeros(n: usize) -> String {
    let mut text = String::with_capacity(2 * n + 2);
    text.push('[');
    for i in 0..n {
        if i > 0 {
            text.push(',');
        }
        text.push('0');
    }
    text.push(']');
    text
}

const NO_RM: &str = policy_rule!(name: "no-rm", tools: ["shell.*"], action: "cancel",
    when: r#"'["rm", "dd", "mkfs"].exists(p, call.args.cmd.startsWith(p))'"#,
    message: r#"'"rm is not allowed"'"#);

/// The decision on call `rm`, which [`NO_RM`] cancelled (`context` says
/// why that matters).
#[track_caller]
fn rm_cancelled<'a>(d: &'a BatchDecision, context: &str) -> &'a CallDecision {
    let rm = d.call("rm").unwrap();
    assert_eq!(
        rm.outcome,
        cancelled("rm is not allowed"),
        "{context}: {rm:?}"
    );
    rm
}

/// Finding 1: one unrelated call carrying a 1 MiB array made every rule
/// exceed its cost bound; under `fail_open` the forbidden call then ran,
/// under `fail_closed` the legitimate one was cancelled.
#[tokio::test]
async fn r13_an_unrelated_large_call_is_no_lever_on_another_calls_decision() {
    let _heavy = HEAVY.lock().await;
    let mesh = mesh("lever").await;
    let coordinator = Coordinator::connect(&mesh.url).await.unwrap();
    let session = coordinator.session("lever").await.unwrap();
    let big = format!(r#"{{"data":{}}}"#, zeros(500_000));
    for (turn, policy) in [FailurePolicy::FailOpen, FailurePolicy::FailClosed]
        .into_iter()
        .enumerate()
    {
        register(
            &mesh,
            Registration::policy("rules", NO_RM)
                .failure_policy(policy)
                .timeout(Duration::from_secs(3)),
        )
        .await;
        let d = session
            .evaluate(
                Batch::new(turn as u32)
                    .call("rm", "shell.exec", r#"{"cmd":"rm -rf /"}"#)
                    .call("ls", "shell.exec", r#"{"cmd":"ls"}"#)
                    .call("upload", "blob.put", &big)
                    .timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap();
        let rm = rm_cancelled(
            &d,
            &format!("{policy:?}: the forbidden call is judged by its own content"),
        );
        assert!(!rm.failure, "{policy:?}: {rm:?}");
        let ls = d.call("ls").unwrap();
        assert!(
            ls.proceeds(),
            "{policy:?}: the legitimate call runs: {ls:?}"
        );
        assert!(ls.bypassed.is_empty(), "{policy:?}: {ls:?}");
        assert!(d.call("upload").unwrap().proceeds());
        assert_eq!(
            guard_trace(&d, "rules").status,
            TraceStatus::Skipped as i32,
            "{policy:?}"
        );
    }
}

/// Finding 1, second half: under `fail_open`, an error in an earlier rule
/// skipped every later one, so `rm` ran when `amount` was a string. And a
/// rule error's text names the rule and the kind of error, never the value.
#[tokio::test]
async fn r27_a_rule_error_fails_its_rule_and_never_skips_the_later_rules() {
    let mesh = mesh("rule-error").await;
    register(
        &mesh,
        Registration::policy(
            "rules",
            concat!(
                policy_rule!(name: "big-payments", action: "cancel",
                    when: "'has(call.args.amount) && call.args.amount + 1 > 10000'",
                    message: r#"'"too much"'"#),
                policy_rule!(name: "no-rm", action: "cancel",
                    when: r#"'has(call.args.cmd) && call.args.cmd.startsWith("rm")'"#,
                    message: r#"'"rm is not allowed"'"#),
            ),
        )
        .failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let coordinator = Coordinator::connect(&mesh.url).await.unwrap();
    let session = coordinator.session("s").await.unwrap();
    let d = session
        .evaluate(
            Batch::new(0)
                .call("rm", "shell", r#"{"cmd":"rm -rf /","amount":"lots"}"#)
                .call("overflow", "pay", r#"{"amount":9223372036854775807}"#),
        )
        .await
        .unwrap();
    rm_cancelled(&d, "the later rule still judges the call");
    // The overflowing call: fail_open lets it through, recorded.
    let overflow = d.call("overflow").unwrap();
    assert_eq!(overflow.bypassed, vec!["rules".to_owned()], "{overflow:?}");
    let entry = guard_trace(&d, "rules");
    assert_eq!(entry.status, TraceStatus::Failed as i32, "{entry:?}");
    assert!(entry.error.contains("big-payments"), "{entry:?}");
    assert!(
        !entry.error.contains("9223372036854775807") && !entry.error.contains("lots"),
        "a rule error quotes no argument value: {}",
        entry.error
    );
}

/// Canary latencies: `count` one-call batches judged by `guard`'s policy,
/// one after another on a connection of their own.
async fn canary(url: &str, count: usize) -> Vec<Duration> {
    let coordinator = Coordinator::connect(url).await.unwrap();
    let session = coordinator.session("canary").await.unwrap();
    let mut took = Vec::with_capacity(count);
    for turn in 0..count {
        let started = Instant::now();
        let d = session
            .evaluate(
                Batch::new(turn as u32)
                    .call("c", "probe", r#"{"s":"hello","l":[1,2,3]}"#)
                    .timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap();
        took.push(started.elapsed());
        assert!(d.call("c").unwrap().proceeds(), "{d:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    took.sort();
    took
}

/// Watches the mesh's resident memory while `work` runs; fails (and stops
/// the mesh) past `limit_mib`, so a test on unbounded code cannot take the
/// machine down.
async fn within_memory<T>(
    mesh: &mut MeshProcess,
    limit_mib: u64,
    work: impl std::future::Future<Output = T>,
) -> (T, u64) {
    let pid = mesh.child.id().to_string();
    let watch = async {
        let mut peak = 0;
        loop {
            let (rss, _) = rss_and_peak_kib(&pid);
            peak = peak.max(rss / 1024);
            if peak > limit_mib {
                return peak;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };
    tokio::select! {
        out = work => {
            let (_, peak) = mesh.memory_mib();
            (out, peak)
        }
        peak = watch => {
            let _ = mesh.child.kill();
            panic!("the mesh grew past {limit_mib} MiB (at {peak} MiB)");
        }
    }
}

const STALL: &str = concat!(
    policy_rule!(name: "stall", action: "steer",
        when: "'call.args.l.exists(a, call.args.l.exists(b, call.args.s.lowerAscii().size() < 0))'",
        message: r#"'"never"'"#),
    policy_rule!(name: "grow", action: "steer",
        when: "'call.args.l.map(a, call.args.l.map(b, call.args.s.lowerAscii())).size() < 0'",
        message: r#"'"never"'"#),
);

/// Finding 2: a batch whose rules do quadratic work on megabyte strings
/// held the mesh's one runtime thread for seconds (every client waited),
/// ran past the batch's deadline, and grew the mesh past 2 GiB. Now its
/// calls are steered naming the bound, within the deadline, while a
/// canary on another connection is answered as usual.
#[tokio::test]
async fn r25_a_costly_batch_stalls_no_other_client_and_keeps_its_deadline() {
    let _heavy = HEAVY.lock().await;
    let mut mesh = mesh("stall").await;
    register(
        &mesh,
        Registration::policy("rules", STALL)
            .failure_policy(FailurePolicy::FailOpen)
            .timeout(Duration::from_secs(30)),
    )
    .await;
    // Warm the canary's connection and the policy.
    canary(&mesh.url, 2).await;
    let s = "A".repeat(900_000);
    let args = format!(r#"{{"l":{},"s":"{s}"}}"#, zeros(60));
    let url = mesh.url.clone();
    let attack_url = url.clone();
    let attack = async move {
        let coordinator = Coordinator::connect(&attack_url).await.unwrap();
        let session = coordinator.session("attacker").await.unwrap();
        let mut batch = Batch::new(0).timeout(Duration::from_secs(5));
        for i in 0..4 {
            batch = batch.call(format!("heavy-{i}"), "probe", &args);
        }
        let started = Instant::now();
        let d = session.evaluate(batch).await;
        (d, started.elapsed())
    };
    let watched = async {
        let attack = tokio::spawn(attack);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let canary = canary(&url, 20).await;
        (attack.await.unwrap(), canary)
    };
    let (((d, took), canary), peak) = within_memory(&mut mesh, 1024, watched).await;
    let p50 = canary[canary.len() / 2];
    let max = canary[canary.len() - 1];
    eprintln!("canary p50 {p50:?} max {max:?}; attack answered in {took:?}; peak {peak} MiB");
    assert!(max < Duration::from_secs(1), "canary max {max:?}");
    assert!(p50 < Duration::from_millis(25), "canary p50 {p50:?}");
    assert!(
        took < Duration::from_secs(7),
        "the batch deadline holds: {took:?}"
    );
    let d = d.unwrap();
    for i in 0..4 {
        let call = d.call(&format!("heavy-{i}")).unwrap();
        match &call.outcome {
            Outcome::Steer { content } => {
                assert!(content.contains("bound"), "names the bound: {content}")
            }
            other => panic!("a call over its bound is steered, never bypassed: {other:?}"),
        }
        assert!(call.bypassed.is_empty(), "{call:?}");
    }
    assert!(peak < 768, "the mesh stays under 768 MiB: {peak} MiB");
}

/// Finding 3: a registration of thousands of patterns near the regex size
/// limit took the mesh past 2 GiB; patterns of deregistered policies were
/// never freed. Now a policy's patterns are bounded in compiled size and
/// freed with it, and registrations are refused past the bound.
#[tokio::test]
async fn r25_policy_registrations_are_bounded_in_memory_and_freed() {
    let _heavy = HEAVY.lock().await;
    let mut mesh = mesh("patterns").await;
    let registrar = Registrar::connect(&mesh.url).await.unwrap();
    // One policy of many large patterns: refused, or compiled within bound.
    let mut policy = String::new();
    for r in 0..60 {
        let patterns: Vec<String> = (0..64)
            .map(|p| format!(r"call.args.s.matches(r'\\w{{{}}}x{r}y{p}')", 12 + p % 8))
            .collect();
        policy.push_str(&format!(
            "[[rule]]\nname = \"r{r}\"\nwhen = \"{}\"\naction = \"cancel\"\nmessage = '\"no\"'\n\n",
            patterns.join(" || ").replace('"', "\\\"")
        ));
    }
    let (result, peak) = within_memory(
        &mut mesh,
        1024,
        registrar.register(Registration::policy("big", policy)),
    )
    .await;
    eprintln!(
        "large pattern policy: {:?}; peak {peak} MiB",
        result.as_ref().err()
    );
    assert!(peak < 512, "peak {peak} MiB");
    // Registered and deregistered again and again: memory comes back.
    let (before, _) = mesh.memory_mib();
    let churn = async {
        for round in 0..40 {
            let patterns: Vec<String> = (0..8)
                .map(|p| format!(r"call.args.s.matches(r'\\w{{{}}}q{round}z{p}')", 12 + p))
                .collect();
            let policy = format!(
                "[[rule]]\nname = \"r\"\nwhen = \"{}\"\naction = \"cancel\"\nmessage = '\"no\"'\n",
                patterns.join(" || ")
            );
            let _ = registrar
                .register(Registration::policy("churn", policy))
                .await;
            registrar.deregister("churn").await.unwrap();
        }
    };
    let ((), _) = within_memory(&mut mesh, 1024, churn).await;
    let (after, _) = mesh.memory_mib();
    eprintln!("churn: {before} MiB before, {after} MiB after");
    assert!(
        after < before.max(64) + 96,
        "released with the guard: {before} MiB before, {after} MiB after"
    );
}
