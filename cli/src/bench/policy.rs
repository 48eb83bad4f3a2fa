//! Policy guards in the benchmark (R27): the mesh with one policy guard of
//! 20 rules against the same mesh with no guard, on the standard batch, in
//! one interleaved group, and the cost of evaluating the rules in process.
//!
//! | scenario | mesh |
//! |---|---|
//! | `no_guard` | no guard at all (every call proceeds, R28's default) |
//! | `policy20` | one policy guard of [`RULES`]: no rule matches the batch, so every rule that applies to a call's tool is evaluated |
//! | `policy20_match` | the same rules, the last one replaced by one that steers every call: every call is steered after the 19 others were evaluated |
//!
//! The rules are a policy team's (SQL, payments with a threshold, shell by
//! tenant, HTTP and file hosts, a batch-wide count, the model's text); 13 of
//! them are scoped to one tool family and 2 to tools the batch does not
//! have, so per batch of 4 calls `evaluations` rules are evaluated out of
//! 20 x 4 pairs. The in-process figure times what the mesh does per batch:
//! the calls' JSON text converted to CEL values once, then the rules.

use super::report::Latency;
use super::{Error, Work};
use guardmesh_server::policy::{Args, BatchValues, CallRef, ContextRef, Outcome, Policy};
use std::path::{Path, PathBuf};

/// The scenarios' names.
pub(super) const NO_GUARD: &str = "no_guard";
pub(super) const POLICY20: &str = "policy20";
pub(super) const POLICY20_MATCH: &str = "policy20_match";

/// The first 19 rules of the benchmark's policy.
const RULES_19: &str = r#"# guardmesh bench: a policy guard of 20 rules (R27).

[[rule]]
name = "sql-delete-needs-where"
tools = ["sql.*"]
when = '''
  has(call.args.query) &&
  call.args.query.matches(r'(?i)^\s*delete\s') &&
  !call.args.query.matches(r'(?i)\swhere\s')
'''
action = "cancel"
message = '"DELETE without WHERE refused: " + call.args.query'

[[rule]]
name = "sql-no-drop-or-truncate"
tools = ["sql.*"]
when = '''has(call.args.query) && call.args.query.matches(r'(?i)\b(drop|truncate)\s+(table|database|schema)\b')'''
action = "cancel"
message = '"schema changes are not for agents: " + call.args.query'

[[rule]]
name = "sql-no-permission-changes"
tools = ["sql.*"]
when = '''has(call.args.query) && call.args.query.matches(r'(?i)^\s*(grant|revoke|alter\s+user)\b')'''
action = "cancel"
message = '"permission changes are refused"'

[[rule]]
name = "sql-big-tables-need-a-limit"
tools = ["sql.*"]
when = '''
  has(call.args.query) &&
  call.args.query.matches(r'(?i)\bfrom\s+(events|audit_log)\b') &&
  !call.args.query.matches(r'(?i)\slimit\s+\d+')
'''
action = "steer"
message = '"add a LIMIT to queries on events and audit_log"'

[[rule]]
name = "payment-over-10000-needs-a-human"
tools = ["payments.send", "payments.transfer"]
when = "call.args.amount > 10000"
action = "steer"
message = '"a payment of " + string(call.args.amount) + " is over 10,000: ask the user to approve it"'

[[rule]]
name = "at-most-3-emails-per-round"
tools = ["email.send"]
when = "calls.filter(c, c.tool == 'email.send').size() > 3"
action = "steer"
message = '"send at most 3 emails per round"'

[[rule]]
name = "no-shell-in-production"
tools = ["shell.*", "bash"]
when = "has(context.metadata.env) && context.metadata.env == 'production'"
action = "cancel"
message = '"no shell in production tenant " + context.metadata.tenant'

[[rule]]
name = "shell-no-recursive-delete-of-root"
tools = ["shell.*", "bash"]
when = '''has(call.args.cmd) && call.args.cmd.matches(r'\brm\s+-[a-zA-Z]*r[a-zA-Z]*\s+/(\s|$)')'''
action = "cancel"
message = '"refused: " + call.args.cmd'

[[rule]]
name = "shell-no-download-piped-to-a-shell"
tools = ["shell.*", "bash"]
when = '''has(call.args.cmd) && call.args.cmd.matches(r'(curl|wget)[^|]*\|\s*(ba|z)?sh')'''
action = "cancel"
message = '"refused: downloads piped to a shell"'

[[rule]]
name = "http-only-https"
tools = ["http.*"]
when = "has(call.args.url) && !call.args.url.startsWith('https://')"
action = "steer"
message = '"use https: " + call.args.url'

[[rule]]
name = "http-no-cloud-metadata"
tools = ["http.*"]
when = '''has(call.args.url) && call.args.url.matches(r'169\.254\.169\.254|metadata\.google\.internal')'''
action = "cancel"
message = '"the cloud metadata endpoint is off limits"'

[[rule]]
name = "fs-no-credentials"
tools = ["fs.*"]
when = '''has(call.args.path) && call.args.path.matches(r'(^|/)(\.ssh|\.aws|\.gnupg)(/|$)|^/etc/shadow$')'''
action = "cancel"
message = '"credentials are off limits: " + call.args.path'

[[rule]]
name = "fs-writes-only-in-the-workspace"
tools = ["fs.*"]
when = "call.tool != 'fs.read' && has(call.args.path) && !call.args.path.startsWith('/workspace/')"
action = "steer"
message = '"write under /workspace/ only"'

[[rule]]
name = "fs-no-deletes-in-production"
tools = ["fs.*"]
when = "call.tool == 'fs.delete' && has(context.metadata.env) && context.metadata.env == 'production'"
action = "cancel"
message = '"no deletes in production"'

[[rule]]
name = "no-secrets-in-arguments"
when = "call.args.exists(k, k.matches(r'(?i)^(password|secret|api_key|token)$'))"
action = "steer"
message = '"pass a secret reference, not the secret"'

[[rule]]
name = "at-most-8-calls-per-round"
when = "size(calls) > 8"
action = "steer"
message = '"a round has " + string(size(calls)) + " calls; send at most 8"'

[[rule]]
name = "no-fetch-after-reading-home"
when = '''
  call.tool.startsWith('http.') &&
  calls.exists(c, c.tool == 'fs.read' && has(c.args.path) && c.args.path.startsWith('/home/'))
'''
action = "cancel"
message = '"no network call in a round that reads home folders"'

[[rule]]
name = "model-text-injection"
when = "context.model_text.matches(r'(?i)ignore (all|any|previous) (instructions|rules)')"
action = "cancel"
message = '"the round looks prompt-injected"'

[[rule]]
name = "notes-too-long"
when = "has(call.args.note) && size(call.args.note) > 4096"
action = "steer"
message = '"keep notes under 4 KiB"'
"#;

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
    format!("{RULES_19}{LAST_NO_MATCH}")
}

/// The policy of `policy20_match`.
pub(super) fn rules_matching_last() -> String {
    format!("{RULES_19}{LAST_MATCH}")
}

/// Writes both policies into `dir`: (`policy20`, `policy20_match`).
pub(super) fn write(dir: &Path) -> Result<(PathBuf, PathBuf), Error> {
    let write = |name: &str, text: String| -> Result<PathBuf, Error> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(path)
    };
    Ok((
        write("rules_policy20.toml", rules())?,
        write("rules_policy20_match.toml", rules_matching_last())?,
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

/// The values of the standard batch, as the mesh builds them.
fn values(work: &Work) -> BatchValues<'_> {
    let batch = &work.batch;
    BatchValues::new(
        ContextRef {
            session_id: "bench",
            turn_index: batch.turn_index,
            model_text: &batch.model_text,
        },
        batch.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        batch.calls.iter().map(|call| CallRef {
            call_id: &call.call_id,
            tool: &call.tool,
            args: Args::Text(&call.arguments),
        }),
    )
}

/// Times `policy20` on the standard batch in this process, and checks that
/// no rule matches it (and that every call is steered by `policy20_match`).
pub(super) fn evaluate(work: &Work, iterations: u32) -> Result<Evaluation, Error> {
    let policy = Policy::compile(&rules()).map_err(|e| format!("policy20: {e}"))?;
    let matching =
        Policy::compile(&rules_matching_last()).map_err(|e| format!("policy20_match: {e}"))?;
    let outcomes = policy.evaluate_values(&values(work), None);
    if let Some(other) = outcomes.iter().find(|o| **o != Outcome::Proceed) {
        return Err(format!("policy20 does not let the standard batch through: {other:?}").into());
    }
    let outcomes = matching.evaluate_values(&values(work), None);
    if !outcomes
        .iter()
        .all(|o| matches!(o, Outcome::Matched(v) if v.rule == "tenant-in-review"))
    {
        return Err(format!("policy20_match does not steer every call: {outcomes:?}").into());
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
        let values = values(work);
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
    let policy = find(POLICY20)?;
    let matching = find(POLICY20_MATCH)?;
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
