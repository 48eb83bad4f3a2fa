//! Policy guards in the benchmark (R27): the mesh with one policy guard of
//! 20 rules against the same mesh with no guard, on the standard batch, in
//! one interleaved group, and the cost of evaluating the rules in process.
//!
//! | scenario | mesh |
//! |---|---|
//! | `no_guard` | no guard at all (every call proceeds, R28's default) |
//! | `policy20` | one policy guard of [`RULES`]: no rule matches the batch, so every rule that applies to a call's tool is evaluated |
//! | `policy20_match` | the same rules, the last one replaced by one that steers every call: every call is steered after the 19 others were evaluated |
//! | `policy1` | one policy guard of one rule, `policy20`'s 20th (read from the context, once per batch): what a policy guard costs beyond its rules |
//!
//! The rules are a policy team's (SQL, payments with a threshold, shell by
//! tenant, HTTP and file hosts, a batch-wide count, the model's text); 13 of
//! them are scoped to one tool family and 2 to tools the batch does not
//! have, so per batch of 4 calls `evaluations` rules are evaluated out of
//! 20 x 4 pairs. The in-process figure times what the mesh does per batch:
//! the calls' JSON text converted to CEL values once, then the rules.

use super::report::Latency;
use super::{Error, Work};
use guardmesh_server::policy::{Args, BatchValues, CallRef, ContextRef, Outcome, Policy, Recorded};
use std::path::{Path, PathBuf};

/// The scenarios' names.
pub(super) const NO_GUARD: &str = "no_guard";
/// A second mesh process with no guard, the same config: the ratio of the
/// two is what a ratio of this group moves for nothing but being another
/// process measured in other moments (an A/A comparison).
pub(super) const NO_GUARD_AGAIN: &str = "no_guard_again";
pub(super) const POLICY20: &str = "policy20";
pub(super) const POLICY20_MATCH: &str = "policy20_match";
pub(super) const POLICY1: &str = "policy1";

/// The benchmark's policy of 20 rules (`policy20`): its 20th rule,
/// [`LAST_NO_MATCH`], matches no call of the batch. The same file is what
/// `scripts/instructions-per-batch.py --policy` counts instructions with.
const RULES: &str = include_str!("policy20.toml");

/// The 20th rule of `policy20`: matches no call of the batch.
const LAST_NO_MATCH: &str = r#"
[[rule]]
name = "blocked-users"
when = "has(context.metadata.user) && context.metadata.user in ['u-0666', 'u-0999']"
action = "cancel"
message = '"user " + context.metadata.user + " is blocked"'
"#;

/// The 20th rule of `policy20_match`: steers every call of the batch.
const LAST_MATCH: &str = r#"
[[rule]]
name = "tenant-in-review"
when = "has(context.metadata.tenant) && context.metadata.tenant == 'acme'"
action = "steer"
message = '"tenant " + context.metadata.tenant + " is in review: ask an operator"'
"#;

/// The policy of `policy20`.
pub(super) fn rules() -> String {
    RULES.to_owned()
}

/// The policy of `policy20_match`: the same, its 20th rule replaced.
pub(super) fn rules_matching_last() -> String {
    RULES.replace(LAST_NO_MATCH, LAST_MATCH)
}

/// The policy of `policy1`: `policy20`'s 20th rule alone.
pub(super) fn one_rule() -> String {
    format!("# guardmesh bench: a policy guard of one rule (R27).\n{LAST_NO_MATCH}")
}

/// Writes the policies into `dir`: (`policy20`, `policy20_match`,
/// `policy1`).
pub(super) fn write(dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf), Error> {
    let write = |name: &str, text: String| -> Result<PathBuf, Error> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(path)
    };
    Ok((
        write("rules_policy20.toml", rules())?,
        write("rules_policy20_match.toml", rules_matching_last())?,
        write("rules_policy1.toml", one_rule())?,
    ))
}

/// A `[[guard]]` section of a policy guard.
pub(super) fn guard_section(name: &str, file: &Path) -> String {
    format!(
        "\n[[guard]]\nname = \"{name}\"\npolicy = {:?}\n",
        file.display().to_string()
    )
}

/// The in-process cost of `policy20` on the standard batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct Evaluation {
    pub rules: usize,
    pub calls: usize,
    /// Rules evaluated per batch (those whose tools match a call's tool).
    pub evaluations: usize,
    pub iterations: u32,
    /// Mean time per batch, conversion included.
    pub us_per_batch: f64,
}

impl Evaluation {
    pub(super) fn us_per_rule_per_call(&self) -> f64 {
        self.us_per_batch / (self.rules * self.calls).max(1) as f64
    }

    pub(super) fn us_per_evaluation(&self) -> f64 {
        self.us_per_batch / self.evaluations.max(1) as f64
    }
}

/// The values of the standard batch, as the mesh builds them: from the
/// argument members its I-JSON check recorded (R20), `recorded`.
fn values<'a>(work: &'a Work, recorded: &'a Recorded) -> BatchValues<'a> {
    let batch = &work.batch;
    BatchValues::new(
        ContextRef {
            session_id: "bench",
            turn_index: batch.turn_index,
            model_text: &batch.model_text,
        },
        batch.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        batch.calls.iter().enumerate().map(|(i, call)| CallRef {
            call_id: &call.call_id,
            tool: &call.tool,
            args: match recorded.call(i) {
                Some(members) => Args::Recorded {
                    text: &call.arguments,
                    members,
                },
                None => Args::Checked(&call.arguments),
            },
        }),
    )
}

/// Times `policy20` on the standard batch in this process, and checks that
/// no rule matches it (and that every call is steered by `policy20_match`).
pub(super) fn evaluate(work: &Work, iterations: u32) -> Result<Evaluation, Error> {
    let policy = Policy::compile(&rules()).map_err(|e| format!("policy20: {e}"))?;
    let matching =
        Policy::compile(&rules_matching_last()).map_err(|e| format!("policy20_match: {e}"))?;
    let one = Policy::compile(&one_rule()).map_err(|e| format!("policy1: {e}"))?;
    // The check is the mesh's for every batch (R20), guard or none: done
    // once here, outside the timing.
    let recorded = Recorded::of_arguments(work.batch.calls.iter().map(|c| c.arguments.as_str()))
        .ok_or("the standard batch's arguments are not I-JSON objects")?;
    let outcomes = policy.evaluate_values(&values(work, &recorded), None);
    if let Some(other) = outcomes.iter().find(|o| **o != Outcome::Proceed) {
        return Err(format!("policy20 does not let the standard batch through: {other:?}").into());
    }
    let outcomes = matching.evaluate_values(&values(work, &recorded), None);
    if !outcomes
        .iter()
        .all(|o| matches!(o, Outcome::Matched(v) if v.rule == "tenant-in-review"))
    {
        return Err(format!("policy20_match does not steer every call: {outcomes:?}").into());
    }
    let outcomes = one.evaluate_values(&values(work, &recorded), None);
    if one.rules().len() != 1 || outcomes.iter().any(|o| *o != Outcome::Proceed) {
        return Err(
            format!("policy1 is not one rule letting the batch through: {outcomes:?}").into(),
        );
    }
    let calls = work.calls();
    let evaluations = calls
        .iter()
        .map(|call| {
            policy
                .rules()
                .iter()
                .filter(|r| r.applies_to(&call.tool))
                .count()
        })
        .sum();
    let started = std::time::Instant::now();
    for _ in 0..iterations {
        let values = values(work, &recorded);
        std::hint::black_box(policy.evaluate_values(&values, None));
    }
    let elapsed = started.elapsed();
    Ok(Evaluation {
        rules: policy.rules().len(),
        calls: calls.len(),
        evaluations,
        iterations,
        us_per_batch: elapsed.as_secs_f64() * 1e6 / f64::from(iterations.max(1)),
    })
}

/// The figures of the policy group: ratios against `no_guard`, and the
/// in-process cost.
pub(super) fn figures(latency: &[Latency], eval: &Evaluation) -> Result<Vec<(String, f64)>, Error> {
    let find = |name: &str| -> Result<&Latency, Error> {
        latency
            .iter()
            .find(|l| l.name == name)
            .ok_or_else(|| format!("no figures for scenario {name}").into())
    };
    let none = find(NO_GUARD)?;
    let again = find(NO_GUARD_AGAIN)?;
    let policy = find(POLICY20)?;
    let matching = find(POLICY20_MATCH)?;
    let one = find(POLICY1)?;
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Ok(vec![
        (
            "policy20_vs_no_guard_p50".into(),
            ratio(policy.p50, none.p50),
        ),
        (
            "policy20_vs_no_guard_p99".into(),
            ratio(policy.p99, none.p99),
        ),
        (
            "policy20_match_vs_no_guard_p50".into(),
            ratio(matching.p50, none.p50),
        ),
        ("policy20_overhead_us_p50".into(), policy.p50 - none.p50),
        // The noise floor of the ratios above: two identical meshes.
        (
            "no_guard_again_vs_no_guard_p50".into(),
            ratio(again.p50, none.p50),
        ),
        ("policy1_vs_no_guard_p50".into(), ratio(one.p50, none.p50)),
        // What a policy guard costs beyond its rules, and what `policy20`'s
        // 19 other rules add to it.
        ("policy1_overhead_us_p50".into(), one.p50 - none.p50),
        ("policy20_over_policy1_us_p50".into(), policy.p50 - one.p50),
        (
            "policy20_mesh_cpu_us_over_no_guard".into(),
            policy.cpu.mesh.unwrap_or(f64::NAN) - none.cpu.mesh.unwrap_or(f64::NAN),
        ),
        ("policy20_eval_us_per_batch".into(), eval.us_per_batch),
        (
            "policy_us_per_rule_per_call".into(),
            eval.us_per_rule_per_call(),
        ),
        (
            "policy_us_per_rule_evaluated".into(),
            eval.us_per_evaluation(),
        ),
    ])
}

/// Not a timing: the policies compile, and keep to what the scenarios say.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_policies_compile_and_judge_the_standard_batch_as_described() {
        let work = Work::new();
        let eval = evaluate(&work, 1).expect("policy20 proceeds, policy20_match steers");
        assert_eq!(eval.rules, 20);
        assert_eq!(eval.calls, 4);
        // sql.query 4 + 6, http.get 2 + 6, fs.read 3 + 6, shell.exec 3 + 6.
        assert_eq!(eval.evaluations, 36);
    }
}
