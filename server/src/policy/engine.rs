//! A compiled policy and how it judges calls: rules in file order, the first
//! whose tools and `when` match decides, none matching is a proceed, and an
//! expression that fails is an error, never a proceed (R27).

use std::collections::HashMap;
use std::sync::Arc;

use cel::{Context, Env, Value};
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::cost::{Cost, Limits};
use super::error::{CompileError, CompileErrorKind, EvalError, Field, Scope};
use super::expr::{self, Compiled};
use super::file::{self, RuleEntry};
use super::input::{BatchInput, BatchValues};
use super::verdict::{Action, Outcome, Verdict};

/// A policy file, compiled whole.
pub struct Policy {
    rules: Vec<Rule>,
    limits: Limits,
    env: Arc<Env>,
    /// Whether any rule reads `calls` / `context`.
    uses_calls: bool,
    uses_context: bool,
}

/// One compiled rule.
#[derive(Debug)]
pub struct Rule {
    name: String,
    description: Option<String>,
    line: usize,
    patterns: Vec<String>,
    tools: Option<GlobSet>,
    when: Compiled,
    action: Action,
    message: Compiled,
    cost: Cost,
}

impl Rule {
    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its description, if it has one.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// The line of the file where its name is written.
    pub fn line(&self) -> usize {
        self.line
    }

    /// Its tool globs; empty when it applies to every tool.
    pub fn tools(&self) -> &[String] {
        &self.patterns
    }

    /// Its action.
    pub fn action(&self) -> Action {
        self.action
    }

    /// The estimated cost of its `when` and `message` (see `cost`).
    pub fn cost(&self) -> &Cost {
        &self.cost
    }

    /// Whether the rule applies to `tool`.
    pub fn applies_to(&self, tool: &str) -> bool {
        self.tools.as_ref().is_none_or(|set| set.is_match(tool))
    }
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("rules", &self.rules)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Policy {
    /// Compiles a policy file with the default [`Limits`].
    pub fn compile(source: &str) -> Result<Policy, CompileError> {
        Self::compile_with(source, Limits::default())
    }

    /// Compiles a policy file: all of it, or an error naming the first line
    /// that does not compile.
    pub fn compile_with(source: &str, limits: Limits) -> Result<Policy, CompileError> {
        let parsed = file::parse(source)?;
        if parsed.rule.is_empty() {
            return Err(CompileError {
                line: 1,
                rule: None,
                kind: CompileErrorKind::NoRules,
            });
        }
        if parsed.rule.len() > limits.max_rules {
            let extra = &parsed.rule[limits.max_rules];
            return Err(CompileError {
                line: file::line_at(source, extra.name.span().start),
                rule: None,
                kind: CompileErrorKind::TooManyRules {
                    count: parsed.rule.len(),
                    limit: limits.max_rules,
                },
            });
        }
        let mut env = Env::stdlib();
        super::patterns::declare(&mut env);
        let mut lines: HashMap<String, usize> = HashMap::new();
        let mut rules = Vec::with_capacity(parsed.rule.len());
        for entry in parsed.rule {
            let rule = compile_rule(&env, source, entry, &limits)?;
            if let Some(first_line) = lines.insert(rule.name.clone(), rule.line) {
                return Err(CompileError {
                    line: rule.line,
                    rule: Some(rule.name),
                    kind: CompileErrorKind::DuplicateName { first_line },
                });
            }
            rules.push(rule);
        }
        let uses = |i: usize| rules.iter().any(|r| r.when.uses[i] || r.message.uses[i]);
        Ok(Policy {
            uses_calls: uses(1),
            uses_context: uses(2),
            rules,
            limits,
            env: Arc::new(env),
        })
    }

    /// The rules, in file order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The bounds it was compiled with, and is evaluated with.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Judges every call of `batch`: one outcome per call, in batch order.
    pub fn evaluate(&self, batch: &BatchInput) -> Vec<Outcome> {
        let n = batch.largest_collection();
        let costs: Vec<(u64, Option<&Rule>)> = batch
            .calls
            .iter()
            .map(|call| self.cost_for(&call.tool, n))
            .collect();
        let total = costs
            .iter()
            .fold(0u64, |sum, (c, _)| sum.saturating_add(*c));
        if total > self.limits.max_cost_per_batch {
            let costliest = self
                .rules
                .iter()
                .max_by_key(|r| r.cost.at(n))
                .map_or_else(String::new, |r| r.name.clone());
            let error = EvalError::TooCostly {
                scope: Scope::Batch,
                estimate: total,
                limit: self.limits.max_cost_per_batch,
                n,
                rule: costliest,
            };
            return vec![Outcome::Error(error); batch.calls.len()];
        }
        if costs.iter().all(|(_, costliest)| costliest.is_none()) {
            // No rule applies to any call: nothing to convert.
            return vec![Outcome::Proceed; batch.calls.len()];
        }
        let values = BatchValues::new(batch);
        let mut root = Context::with_env(Arc::clone(&self.env));
        if self.uses_calls {
            root.add_variable_from_value("calls", values.all_calls.clone());
        }
        if self.uses_context {
            root.add_variable_from_value("context", values.context.clone());
        }
        batch
            .calls
            .iter()
            .zip(costs)
            .enumerate()
            .map(|(i, (call, (cost, costliest)))| {
                let Some(costliest) = costliest else {
                    return Outcome::Proceed;
                };
                if cost > self.limits.max_cost_per_call {
                    return Outcome::Error(EvalError::TooCostly {
                        scope: Scope::Call,
                        estimate: cost,
                        limit: self.limits.max_cost_per_call,
                        n,
                        rule: costliest.name.clone(),
                    });
                }
                let mut scope = root.new_inner_scope();
                scope.add_variable_from_value("call", values.calls[i].clone());
                self.judge(&scope, &call.tool)
            })
            .collect()
    }

    /// The estimated cost of judging a call of `tool` at `n`, and the
    /// costliest rule that applies to it (none when no rule does).
    fn cost_for(&self, tool: &str, n: usize) -> (u64, Option<&Rule>) {
        let mut total = 0u64;
        let mut costliest: Option<(&Rule, u64)> = None;
        for rule in self.rules.iter().filter(|r| r.applies_to(tool)) {
            let cost = rule.cost.at(n);
            total = total.saturating_add(cost);
            if costliest.is_none_or(|(_, c)| cost > c) {
                costliest = Some((rule, cost));
            }
        }
        (total, costliest.map(|(r, _)| r))
    }

    /// The rules in order, on one call's scope.
    fn judge(&self, scope: &Context, tool: &str) -> Outcome {
        for rule in self.rules.iter().filter(|r| r.applies_to(tool)) {
            match rule.when.program.execute(scope) {
                Ok(Value::Bool(false)) => continue,
                Ok(Value::Bool(true)) => {}
                Ok(other) => {
                    return Outcome::Error(EvalError::NotBool {
                        rule: rule.name.clone(),
                        got: other.type_of().to_string(),
                    });
                }
                Err(error) => {
                    return Outcome::Error(EvalError::Failed {
                        rule: rule.name.clone(),
                        field: Field::When,
                        reason: error.to_string(),
                    });
                }
            }
            return match rule.message.program.execute(scope) {
                Ok(Value::String(message)) => Outcome::Matched(Verdict {
                    rule: rule.name.clone(),
                    action: rule.action,
                    message: message.to_string(),
                }),
                Ok(other) => Outcome::Error(EvalError::NotString {
                    rule: rule.name.clone(),
                    got: other.type_of().to_string(),
                }),
                Err(error) => Outcome::Error(EvalError::Failed {
                    rule: rule.name.clone(),
                    field: Field::Message,
                    reason: error.to_string(),
                }),
            };
        }
        Outcome::Proceed
    }
}

fn compile_rule(
    env: &Env,
    source: &str,
    entry: RuleEntry,
    limits: &Limits,
) -> Result<Rule, CompileError> {
    let line = file::line_at(source, entry.name.span().start);
    let name = entry.name.into_inner();
    let fail = |line: usize, kind: CompileErrorKind| CompileError {
        line,
        rule: (!name.trim().is_empty()).then(|| name.clone()),
        kind,
    };
    if name.trim().is_empty() {
        return Err(fail(line, CompileErrorKind::EmptyName));
    }
    let (patterns, tools) = match entry.tools {
        None => (Vec::new(), None),
        Some(tools) => {
            let tools_line = file::line_at(source, tools.span().start);
            let patterns = tools.into_inner();
            let mut builder = GlobSetBuilder::new();
            for pattern in &patterns {
                let glob = Glob::new(pattern).map_err(|error| {
                    fail(
                        tools_line,
                        CompileErrorKind::BadGlob {
                            pattern: pattern.clone(),
                            reason: error.kind().to_string(),
                        },
                    )
                })?;
                builder.add(glob);
            }
            let set = builder.build().map_err(|error| {
                fail(
                    tools_line,
                    CompileErrorKind::BadGlob {
                        pattern: patterns.join(", "),
                        reason: error.to_string(),
                    },
                )
            })?;
            (patterns, Some(set))
        }
    };
    let compile = |field: Field, text: toml::Spanned<String>| {
        let first_line = file::content_line(source, text.span());
        expr::compile(env, field, text.get_ref(), limits)
            .map_err(|refused| fail(first_line + refused.line - 1, refused.kind))
    };
    let when = compile(Field::When, entry.when)?;
    let message = compile(Field::Message, entry.message)?;
    let mut cost = when.cost.clone();
    cost.add_cost(&message.cost);
    Ok(Rule {
        name,
        description: entry.description,
        line,
        patterns,
        tools,
        when,
        action: entry.action,
        message,
        cost,
    })
}
