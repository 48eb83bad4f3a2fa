//! Testing a policy before it is applied (R27): [`check`] a file, and
//! [`test`] it against a cases file, like `opa test`.
//!
//! A cases file (TOML) holds cases; each case is one batch, and each of its
//! calls may say what the policy must decide for it:
//!
//! ```toml
//! [[case]]
//! name = "a DELETE without WHERE is cancelled"
//! metadata = { tenant = "acme" }           # optional: session_id,
//!                                           # turn_index, model_text, metadata
//! [[case.calls]]
//! call_id = "q1"                            # optional: c1, c2... by position
//! tool = "sql.query"
//! args = { query = "DELETE FROM users" }    # or args_json = '{"query": null}'
//! expect = "cancel"                         # proceed | steer | cancel | ask | error
//! expect_rule = "sql-delete-needs-where"    # optional: the rule that decides
//! expect_message = "DELETE"                 # optional: a part of the message
//! ```
//!
//! A call without `expect` is only context for the others (for rules over
//! `calls`). `expect = "error"` means that judging the call must fail
//! (`expect_rule` then names the rule that fails). TOML has no `null`:
//! `args_json` gives the arguments as JSON text instead.

use std::fmt;

use serde::Deserialize;
use toml::Spanned;

use super::engine::Policy;
use super::error::{CasesError, CompileError};
use super::file::line_at;
use super::input::{BatchInput, CallInput};
use super::verdict::{Action, Outcome};

/// What [`check`] found in a policy that compiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// One line per rule: name, line, tools, action, cost.
    pub rules: Vec<RuleSummary>,
}

/// A rule as [`check`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSummary {
    pub name: String,
    pub line: usize,
    pub tools: Vec<String>,
    pub action: Action,
    /// The estimated cost (see `cost`), e.g. `14 + 2n`.
    pub cost: String,
    /// Whether its `when` runs on the fast path (`plan`); `false`: the CEL
    /// interpreter evaluates it every time, several times slower.
    pub planned: bool,
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "ok: {} rules", self.rules.len())?;
        for rule in &self.rules {
            let tools = if rule.tools.is_empty() {
                "*".to_owned()
            } else {
                rule.tools.join(",")
            };
            writeln!(
                f,
                "  line {:<4} {:<32} {:<6} tools {:<20} cost {}{}",
                rule.line,
                rule.name,
                rule.action,
                tools,
                rule.cost,
                if rule.planned { "" } else { " (interpreted)" }
            )?;
        }
        if self.rules.iter().any(|r| !r.planned) {
            writeln!(
                f,
                "(interpreted: the rule uses something the fast path does not cover, \
                 so the CEL interpreter evaluates it, several times slower)"
            )?;
        }
        Ok(())
    }
}

/// Compiles a policy file and summarises its rules; a file that does not
/// compile is an error naming its line (what `guardmesh policy check`
/// prints).
pub fn check(source: &str) -> Result<CheckReport, CompileError> {
    let policy = Policy::compile(source)?;
    Ok(CheckReport {
        rules: policy
            .rules()
            .iter()
            .map(|rule| RuleSummary {
                name: rule.name().to_owned(),
                line: rule.line(),
                tools: rule.tools().to_vec(),
                action: rule.action(),
                cost: rule.cost().to_string(),
                planned: rule.planned(),
            })
            .collect(),
    })
}

/// What a call is expected to get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Expected {
    Proceed,
    Steer,
    Cancel,
    /// R35: the rule asks a person first.
    Ask,
    Error,
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Expected::Proceed => "proceed",
            Expected::Steer => "steer",
            Expected::Cancel => "cancel",
            Expected::Ask => "ask",
            Expected::Error => "error",
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CasesFile {
    #[serde(default)]
    case: Vec<CaseEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseEntry {
    name: Spanned<String>,
    #[serde(default)]
    session_id: String,
    #[serde(default)]
    turn_index: u32,
    #[serde(default)]
    model_text: String,
    #[serde(default)]
    metadata: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    calls: Vec<CaseCall>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseCall {
    #[serde(default)]
    call_id: String,
    tool: Spanned<String>,
    #[serde(default)]
    args: Option<serde_json::Value>,
    #[serde(default)]
    args_json: Option<String>,
    #[serde(default)]
    expect: Option<Expected>,
    #[serde(default)]
    expect_rule: Option<String>,
    #[serde(default)]
    expect_message: Option<String>,
}

/// The result of [`test`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestReport {
    /// How many cases ran.
    pub cases: usize,
    /// How many calls had an expectation.
    pub checks: usize,
    /// Every expectation that did not hold.
    pub failures: Vec<Failure>,
}

impl TestReport {
    /// Whether every expectation held.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// One expectation that did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The case's name.
    pub case: String,
    /// The line of the call in the cases file.
    pub line: usize,
    /// The call's id.
    pub call_id: String,
    /// What was expected, e.g. `cancel by "sql-delete-needs-where"`.
    pub expected: String,
    /// What the policy gave, e.g. `proceed`.
    pub got: String,
}

impl fmt::Display for TestReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for failure in &self.failures {
            writeln!(
                f,
                "FAIL line {}: case {:?}, call {}: expected {}, got {}",
                failure.line, failure.case, failure.call_id, failure.expected, failure.got
            )?;
        }
        let failed = self
            .failures
            .iter()
            .map(|failure| &failure.case)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        writeln!(
            f,
            "{}: {}/{} cases passed ({} checks, {} failed)",
            if self.passed() { "PASS" } else { "FAIL" },
            self.cases - failed,
            self.cases,
            self.checks,
            self.failures.len()
        )
    }
}

/// Runs the cases of `cases` (a cases file's text) against `policy`. A
/// cases file that cannot be read, or that names a rule the policy does not
/// have, is an error; a case whose expectation does not hold is a
/// [`Failure`] of the report.
pub fn test(policy: &Policy, cases: &str) -> Result<TestReport, CasesError> {
    let file: CasesFile = toml::from_str(cases).map_err(|error| CasesError {
        line: error.span().map_or(1, |span| line_at(cases, span.start)),
        reason: error.message().trim_end().to_owned(),
    })?;
    if file.case.is_empty() {
        return Err(CasesError {
            line: 1,
            reason: "no cases ([[case]] tables)".to_owned(),
        });
    }
    let mut report = TestReport {
        cases: file.case.len(),
        checks: 0,
        failures: Vec::new(),
    };
    for case in file.case {
        let case_line = line_at(cases, case.name.span().start);
        let name = case.name.into_inner();
        let mut batch = BatchInput {
            session_id: case.session_id,
            turn_index: case.turn_index,
            model_text: case.model_text,
            metadata: case.metadata,
            calls: Vec::with_capacity(case.calls.len()),
        };
        let mut expectations = Vec::new();
        for (i, call) in case.calls.into_iter().enumerate() {
            let line = line_at(cases, call.tool.span().start);
            let refuse = |reason: String| CasesError {
                line,
                reason: format!("case {name:?}: {reason}"),
            };
            let args = match (call.args, call.args_json) {
                (Some(_), Some(_)) => {
                    return Err(refuse("give args or args_json, not both".to_owned()));
                }
                (Some(args), None) => args,
                (None, Some(json)) => serde_json::from_str(&json)
                    .map_err(|error| refuse(format!("args_json is not JSON: {error}")))?,
                (None, None) => serde_json::Value::Object(Default::default()),
            };
            if let Some(rule) = &call.expect_rule {
                if !policy.rules().iter().any(|r| r.name() == rule) {
                    return Err(refuse(format!("expect_rule names no rule: {rule:?}")));
                }
                if matches!(call.expect, None | Some(Expected::Proceed)) {
                    return Err(refuse(
                        "expect_rule needs expect = steer, cancel or error".to_owned(),
                    ));
                }
            }
            let call_id = if call.call_id.is_empty() {
                format!("c{}", i + 1)
            } else {
                call.call_id
            };
            if let Some(expected) = call.expect {
                expectations.push((i, line, expected, call.expect_rule, call.expect_message));
            } else if call.expect_rule.is_some() || call.expect_message.is_some() {
                return Err(refuse(
                    "expect_rule or expect_message without expect".to_owned(),
                ));
            }
            batch.calls.push(CallInput {
                call_id,
                tool: call.tool.into_inner(),
                args,
            });
        }
        if expectations.is_empty() {
            return Err(CasesError {
                line: case_line,
                reason: format!("case {name:?} expects nothing (no call has `expect`)"),
            });
        }
        let outcomes = policy.evaluate(&batch);
        for (i, line, expected, rule, message) in expectations {
            report.checks += 1;
            if !holds(&outcomes[i], expected, rule.as_deref(), message.as_deref()) {
                report.failures.push(Failure {
                    case: name.clone(),
                    line,
                    call_id: batch.calls[i].call_id.clone(),
                    expected: describe_expected(expected, rule.as_deref(), message.as_deref()),
                    got: describe(&outcomes[i]),
                });
            }
        }
    }
    Ok(report)
}

fn holds(outcome: &Outcome, expected: Expected, rule: Option<&str>, message: Option<&str>) -> bool {
    match (outcome, expected) {
        (Outcome::Proceed, Expected::Proceed) => true,
        (
            Outcome::Matched(verdict) | Outcome::Bounded(verdict),
            Expected::Steer | Expected::Cancel | Expected::Ask,
        ) => {
            let action = match verdict.action {
                Action::Steer => Expected::Steer,
                Action::Cancel => Expected::Cancel,
                Action::Ask => Expected::Ask,
            };
            action == expected
                && rule.is_none_or(|rule| rule == verdict.rule)
                && message.is_none_or(|part| verdict.message.contains(part))
        }
        (Outcome::Error(error) | Outcome::FailedThen(error, _), Expected::Error) => {
            rule.is_none_or(|rule| rule == error.rule())
                && message.is_none_or(|part| error.to_string().contains(part))
        }
        _ => false,
    }
}

fn describe_expected(expected: Expected, rule: Option<&str>, message: Option<&str>) -> String {
    let mut text = expected.to_string();
    if let Some(rule) = rule {
        text.push_str(&format!(" by {rule:?}"));
    }
    if let Some(message) = message {
        text.push_str(&format!(" with a message containing {message:?}"));
    }
    text
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Proceed => "proceed".to_owned(),
        Outcome::Matched(verdict) => format!(
            "{} by {:?} with message {:?}",
            verdict.action, verdict.rule, verdict.message
        ),
        Outcome::Error(error) => format!("error: {error}"),
        Outcome::FailedThen(error, verdict) => format!(
            "error: {error}; then {} by {:?} with message {:?}",
            verdict.action, verdict.rule, verdict.message
        ),
        Outcome::Bounded(verdict) => format!("steer over a bound: {}", verdict.message),
        Outcome::TimedOut => "timed out".to_owned(),
    }
}

/// A rule that names a tool its guard is never sent (R27, R9): in its own
/// `tools`, or in its `when` (`call.tool == 'bash'`). Such a rule never
/// decides that tool: the calls it was written for proceed unjudged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeverSent {
    pub rule: String,
    pub line: usize,
    /// The pattern or name the rule names.
    pub tool: String,
    /// Whether it is named in `when` (else in `tools`).
    pub in_when: bool,
}

impl fmt::Display for NeverSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}: rule {:?} names tool {:?} in its {}, but the guard's tools never send it that tool: \
             the rule never decides it (add it to the guard's tools, or remove it from the rule)",
            self.line,
            self.rule,
            self.tool,
            if self.in_when { "when" } else { "tools" }
        )
    }
}

/// The rules of the policy `source` that name a tool the guard's `tools`
/// (its registered patterns; empty: every tool) never send it, in file
/// order. A file that does not compile is an error, as in [`check`].
pub fn never_sent(source: &str, tools: &[String]) -> Result<Vec<NeverSent>, CompileError> {
    Policy::compile(source)?;
    never_sent_compiled(source, tools)
}

/// [`never_sent`] for a `source` its caller has just compiled (config load,
/// a policy reload): the file is only read for its rules' tool names, not
/// compiled a second time.
pub fn never_sent_compiled(source: &str, tools: &[String]) -> Result<Vec<NeverSent>, CompileError> {
    if tools.is_empty() {
        return Ok(Vec::new());
    }
    let parsed = super::file::parse(source)?;
    let sent = |name: &str| tools.iter().any(|t| super::reach::overlap(t, name));
    let mut found = Vec::new();
    for rule in &parsed.rule {
        let line = line_at(source, rule.name.span().start);
        let named = rule
            .tools
            .iter()
            .flat_map(|t| t.get_ref().iter().map(|tool| (tool.clone(), false)))
            .chain(
                super::reach::compared_tools(rule.when.get_ref())
                    .into_iter()
                    .map(|tool| (tool, true)),
            );
        for (tool, in_when) in named {
            if !sent(&tool) {
                found.push(NeverSent {
                    rule: rule.name.get_ref().clone(),
                    line,
                    tool,
                    in_when,
                });
            }
        }
    }
    Ok(found)
}
