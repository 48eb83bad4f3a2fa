//! A compiled policy and how it judges calls: rules in file order, the first
//! whose tools and `when` match decides, none matching is a proceed, and an
//! expression that fails is an error, never a proceed (R27).

use std::cell::OnceCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use cel::common::ast::{Expr, LiteralValue};
use cel::common::types::{CelBool, CelString};
use cel::{Context, Env, Value};
use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};

use super::cost::{Cost, Inline, Limits, OverInline};
use super::error::{CompileError, CompileErrorKind, EvalError, Field};
use super::expr::{self, Compiled};
use super::file::{self, RuleEntry};
use super::functions::Functions;
use super::input::{BatchInput, BatchValues};
use super::meter::{Meter, Stop};
use super::patterns::PatternSet;
use super::plan::{Plan, Unsure};
use super::verdict::{Action, Outcome, Verdict};

/// A tool glob as rules match it: without regard to ASCII case (R9), as
/// guards' own tool patterns are.
fn glob(pattern: &str) -> Result<Glob, globset::Error> {
    GlobBuilder::new(pattern).case_insensitive(true).build()
}

/// A policy file, compiled whole.
pub struct Policy {
    rules: Vec<Rule>,
    limits: Limits,
    env: Arc<Env>,
    /// Which rules apply to which tools.
    tools: ToolIndex,
    /// Evaluations of `when` the interpreter did (the fast path did not
    /// cover the rule, or gave up on the call).
    interpreted: AtomicU64,
    /// Whether a rule's fast path may read a call's arguments.
    reads_args: bool,
    /// Its `matches` patterns, compiled; freed with the policy.
    patterns: Arc<PatternSet>,
    /// Whether a rule names `session` (R34).
    reads_session: bool,
    /// Whether a rule names `identity` (R34).
    reads_identity: bool,
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
    /// R34: labels it adds to the session when it decides a call.
    labels: std::sync::Arc<[String]>,
    cost: Cost,
    /// `when` and `message` on the fast path, when it covers them.
    when_plan: Option<Plan>,
    message_plan: Option<Plan>,
    /// Whether `when` or `message` reads `calls` (the whole batch).
    reads_calls: bool,
    /// The text of `when` and `message`: an error names a key only if the
    /// rule writes it (never one that came from the input).
    text: String,
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

    /// Whether the fast path covers its `when` (see `plan`); when it does
    /// not, or gives up on a call, the CEL interpreter evaluates it.
    pub fn planned(&self) -> bool {
        self.when_plan.is_some()
    }

    /// Whether the rule applies to `tool` (its globs match without regard
    /// to ASCII case, R9).
    pub fn applies_to(&self, tool: &str) -> bool {
        self.tools.as_ref().is_none_or(|set| set.is_match(tool))
    }

    /// Whether its `when` is the constant `true`: written as the literal,
    /// so that no call, context or session can make it false or fail.
    pub fn always_holds(&self) -> bool {
        matches!(
            &self.when.program.expression().expr,
            Expr::Literal(LiteralValue::Boolean(held)) if *held.inner()
        )
    }

    /// Whether its `message` is a constant string (a literal), which
    /// cannot fail whatever the call.
    pub fn constant_message(&self) -> bool {
        matches!(
            &self.message.program.expression().expr,
            Expr::Literal(LiteralValue::String(_))
        )
    }

    /// Its estimated cost for a call whose own `n` is `n`, in a batch whose
    /// `n` is `batch_n` (used only when it reads `calls`).
    fn cost_at(&self, n: usize, batch_n: usize) -> u64 {
        self.cost.at(if self.reads_calls { batch_n } else { n })
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

/// The CEL environment every rule compiles and runs in: the standard
/// library and the mesh's functions (patterns, strings, shell words, session
/// and identity memory).
pub(crate) fn environment() -> Arc<Env> {
    let mut env = Env::stdlib();
    super::patterns::declare(&mut env);
    super::strings::declare(&mut env);
    super::shell::declare(&mut env);
    super::session_cel::declare(&mut env);
    Arc::new(env)
}

impl Policy {
    /// Compiles a policy file with the default [`Limits`].
    pub fn compile(source: &str) -> Result<Policy, CompileError> {
        Self::compile_with(source, Limits::default())
    }

    /// Compiles a policy file: all of it, or an error naming the first line
    /// that does not compile.
    pub fn compile_with(source: &str, limits: Limits) -> Result<Policy, CompileError> {
        if source.len() > limits.max_policy_bytes {
            return Err(CompileError {
                line: 1,
                rule: None,
                kind: CompileErrorKind::TooLarge {
                    bytes: source.len(),
                    limit: limits.max_policy_bytes,
                },
            });
        }
        let patterns = Arc::new(PatternSet::new(
            limits.max_pattern_bytes,
            limits.max_patterns,
        ));
        let compiled = super::patterns::with(&patterns, || {
            Self::compile_in(source, limits, Arc::clone(&patterns))
        });
        if compiled.is_err() {
            // Released now, not when the error is dropped.
            drop(patterns);
        }
        compiled
    }

    fn compile_in(
        source: &str,
        limits: Limits,
        patterns: Arc<PatternSet>,
    ) -> Result<Policy, CompileError> {
        let started = std::time::Instant::now();
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
        let env = environment();
        let mut functions = Functions::new(Arc::clone(&env));
        let mut lines: HashMap<String, usize> = HashMap::new();
        let mut rules = Vec::with_capacity(parsed.rule.len());
        for entry in parsed.rule {
            if started.elapsed().as_millis() > u128::from(limits.max_compile_millis) {
                return Err(CompileError {
                    line: file::line_at(source, entry.name.span().start),
                    rule: None,
                    kind: CompileErrorKind::TooSlow {
                        limit_ms: limits.max_compile_millis,
                    },
                });
            }
            let rule = compile_rule(&env, &mut functions, source, entry, &limits)?;
            if let Some(first_line) = lines.insert(rule.name.clone(), rule.line) {
                return Err(CompileError {
                    line: rule.line,
                    rule: Some(rule.name),
                    kind: CompileErrorKind::DuplicateName { first_line },
                });
            }
            rules.push(rule);
        }
        let tools = ToolIndex::new(&rules).map_err(|error| CompileError {
            line: 1,
            rule: None,
            kind: CompileErrorKind::BadGlob {
                pattern: String::new(),
                reason: error.to_string(),
            },
        })?;
        let reads_args = rules.iter().any(|rule| {
            [&rule.when_plan, &rule.message_plan]
                .into_iter()
                .flatten()
                .any(Plan::reads_args)
        });
        let reads_identity = rules
            .iter()
            .any(|rule| rule.when.reads_identity || rule.message.reads_identity);
        // R34: the identity's memory is kept with the session's (the calls
        // of the batch are recorded in both), so a policy that reads the
        // identity uses the session's memory too.
        let reads_session = reads_identity
            || rules
                .iter()
                .any(|rule| rule.when.reads_session || rule.message.reads_session);
        Ok(Policy {
            reads_session,
            reads_identity,
            patterns,
            interpreted: AtomicU64::new(0),
            reads_args,
            tools,
            rules,
            limits,
            env,
        })
    }

    /// The rules, in file order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Tool visibility: the rule that decides every call of `tool` this
    /// policy judges to a skip, when that is certain from the rules alone:
    /// every rule that applies to `tool` (R9), up to and including the
    /// first whose `when` is the constant `true`, steers or cancels (an
    /// earlier one may decide first, or fail and leave the decision to
    /// that one, R27: a skip either way; an ask is not a skip, an approval
    /// lets the call run), and that rule's `message` cannot fail. `None`
    /// when no such rule exists: the policy may let a call of `tool` run,
    /// or only its guard's failure policy would skip it.
    pub fn always_skips(&self, tool: &str) -> Option<&Rule> {
        for rule in self.rules.iter().filter(|rule| rule.applies_to(tool)) {
            if rule.action == Action::Ask {
                return None;
            }
            if rule.always_holds() {
                return rule.constant_message().then_some(rule);
            }
        }
        None
    }

    /// How many evaluations of a rule's `when` the CEL interpreter did
    /// rather than the fast path, since the policy was compiled.
    pub fn interpreted_evaluations(&self) -> u64 {
        self.interpreted.load(Ordering::Relaxed)
    }

    /// How many tools' applicable rules it remembers.
    #[cfg(test)]
    pub(super) fn tools_remembered(&self) -> usize {
        self.tools.len()
    }

    /// Whether its rules' fast path may read a call's arguments: when not,
    /// a batch's values need not hold them (see
    /// [`BatchValues::reading_args`]). A policy of rules on the context
    /// alone (`context.metadata.user in [...]`) does not.
    pub fn reads_args(&self) -> bool {
        self.reads_args
    }

    /// Whether a rule names `session`: only then do its batches read the
    /// session's memory (R34); a policy that does not pays nothing.
    pub fn reads_session(&self) -> bool {
        self.reads_session
    }

    /// Whether a rule names `identity`: only then do its batches read (and
    /// write) the memory of the caller's identity across its sessions
    /// (R34). Such a policy also [`reads_session`](Self::reads_session).
    pub fn reads_identity(&self) -> bool {
        self.reads_identity
    }

    /// Bytes its compiled `matches` patterns are charged (see `patterns`).
    pub fn pattern_bytes(&self) -> usize {
        self.patterns.charged()
    }

    /// The bounds it was compiled with, and is evaluated with.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Judges every call of `batch`: one outcome per call, in batch order.
    pub fn evaluate(&self, batch: &BatchInput) -> Vec<Outcome> {
        self.evaluate_values(&BatchValues::from_input(batch), None)
    }

    /// [`Self::evaluate_within`] without a deadline.
    pub fn evaluate_values(
        &self,
        values: &BatchValues<'_>,
        judged: Option<&[bool]>,
    ) -> Vec<Outcome> {
        self.evaluate_within(values, judged, None)
    }

    /// Judges the calls of a batch already converted to CEL values (once
    /// per batch, whatever the number of policies): one outcome per call, in
    /// batch order. With `judged`, only the calls it marks are judged; the
    /// others are given [`Outcome::Proceed`]. Each call is judged within its
    /// own bounds (its cost estimate, its work budget), which depend on that
    /// call alone unless a rule reads `calls`; a call over one is
    /// [`Outcome::Bounded`]. Calls not judged when `deadline` passes are
    /// [`Outcome::TimedOut`].
    pub fn evaluate_within(
        &self,
        values: &BatchValues<'_>,
        judged: Option<&[bool]>,
        deadline: Option<std::time::Instant>,
    ) -> Vec<Outcome> {
        super::patterns::with(&self.patterns, || {
            self.evaluate_in(values, judged, deadline, None)
        })
        // Without an inline bound nothing stops at it.
        .unwrap_or_else(|OverInline| vec![Outcome::TimedOut; values.len()])
    }

    /// [`Self::evaluate_within`] under an inline bound (see `pool`): the
    /// estimate of each call, and the work of all the calls judged under
    /// `inline` (shared by every policy of the batch, spent as work is
    /// done), must stay within it. Past it, judging stops at once and
    /// [`OverInline`] says that nothing judged here stands: the batch is
    /// to be judged again, off the thread, without the bound.
    pub fn evaluate_inline(
        &self,
        values: &BatchValues<'_>,
        judged: Option<&[bool]>,
        deadline: Option<std::time::Instant>,
        inline: &mut Inline,
    ) -> Result<Vec<Outcome>, OverInline> {
        super::patterns::with(&self.patterns, || {
            self.evaluate_in(values, judged, deadline, Some(inline))
        })
    }

    fn evaluate_in(
        &self,
        values: &BatchValues<'_>,
        judged: Option<&[bool]>,
        deadline: Option<std::time::Instant>,
        mut inline: Option<&mut Inline>,
    ) -> Result<Vec<Outcome>, OverInline> {
        let calls = values.len();
        let is_judged = |i: usize| judged.is_none_or(|j| j.get(i).copied().unwrap_or(false));
        let batch_n = values.largest_collection();
        // The `when` of rules that do not read `call` (the same for every
        // call of the batch, evaluated once): a set of those evaluated, and
        // a set of those true.
        let words = self.rules.len().div_ceil(64);
        // The three sets on the stack up to `STACK_WORDS` words (that many
        // times 64 rules), else in one allocation.
        let mut on_stack = [0u64; 3 * STACK_WORDS];
        let mut on_heap = Vec::new();
        let sets = if words <= STACK_WORDS {
            &mut on_stack[..3 * words]
        } else {
            on_heap.resize(3 * words, 0u64);
            &mut on_heap[..]
        };
        let (bits, batch_wide) = sets.split_at_mut(words);
        let (evaluated, held) = batch_wide.split_at_mut(words);
        let mut batch_wide = BatchWide { evaluated, held };
        let mut matched = Vec::new();
        let mut timed_out = false;
        let mut outcomes = Vec::with_capacity(calls);
        for i in 0..calls {
            if !is_judged(i) {
                outcomes.push(Outcome::Proceed);
                continue;
            }
            if timed_out || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                timed_out = true;
                outcomes.push(Outcome::TimedOut);
                continue;
            }
            let n = values.call_largest(i);
            let cost = self.tools.applicable(
                values.tool(i),
                bits,
                &mut matched,
                &self.rules,
                (n, batch_n),
            );
            if bits.iter().all(|w| *w == 0) {
                outcomes.push(Outcome::Proceed);
                continue;
            }
            if cost > self.limits.max_cost_per_call {
                let rule = self.costliest(bits, (n, batch_n));
                outcomes.push(Outcome::Bounded(self.bounded(
                    rule,
                    format!(
                        "its estimated cost {cost} is over the limit of {} (max_cost_per_call; \
                         largest list or map in its input: {n} items)",
                        self.limits.max_cost_per_call
                    ),
                )));
                continue;
            }
            // Under an inline bound, the call's budget is what is left of
            // it, when that is less than the call's own.
            let mut units = self.limits.max_work_per_call;
            if let Some(inline) = inline.as_deref() {
                if cost > inline.cost {
                    return Err(OverInline);
                }
                units = units.min(inline.work);
            }
            let meter = Meter::new(units, deadline);
            let outcome = self.judge(values, i, bits, &mut batch_wide, &meter);
            if let Some(inline) = inline.as_deref_mut() {
                if units < self.limits.max_work_per_call && meter.stopped() == Some(Stop::Work) {
                    return Err(OverInline);
                }
                inline.work -= units - meter.left();
            }
            if matches!(outcome, Outcome::TimedOut) {
                timed_out = true;
            }
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    /// The verdict for a call over a bound: a steer naming the rule and the
    /// bound (R13).
    fn bounded(&self, rule: String, why: String) -> Verdict {
        Verdict {
            message: format!(
                "Tool call blocked: policy rule {rule:?} cannot judge this call within its \
                 bounds: {why}. Send a smaller call."
            ),
            rule,
            action: Action::Steer,
            labels: std::sync::Arc::from(Vec::new()),
        }
    }

    /// The name of the costliest rule of `bits` at `n`.
    fn costliest(&self, bits: &[u64], (n, batch_n): (usize, usize)) -> String {
        set_bits(bits)
            .max_by_key(|&r| self.rules[r].cost_at(n, batch_n))
            .map_or_else(String::new, |r| self.rules[r].name.clone())
    }

    /// What a stopped meter makes of rule `r` on a call: over the work
    /// budget, a steer naming the bound; out of time, the guard timed out.
    fn stopped(&self, stop: Stop, r: usize, error: Option<EvalError>) -> Outcome {
        match stop {
            Stop::Deadline => Outcome::TimedOut,
            Stop::Work => {
                let verdict = self.bounded(
                    self.rules[r].name.clone(),
                    format!(
                        "it takes more than {} units of work (max_work_per_call)",
                        self.limits.max_work_per_call
                    ),
                );
                match error {
                    Some(error) => Outcome::FailedThen(error, verdict),
                    None => Outcome::Bounded(verdict),
                }
            }
        }
    }

    /// The rules of `bits` in file order, on call `i`: each on the fast path
    /// where it answers, else by the interpreter, whose values and
    /// activation are built on first need. A rule that fails is remembered
    /// and the later rules still judge the call (R27): the first that
    /// matches decides with the failure beside it.
    fn judge(
        &self,
        values: &BatchValues<'_>,
        i: usize,
        bits: &[u64],
        batch_wide: &mut BatchWide<'_>,
        meter: &Meter,
    ) -> Outcome {
        let fast = values.fast_metered(i, meter);
        let variables = OnceCell::new();
        let activation = OnceCell::new();
        let interpreter = || {
            activation.get_or_init(|| {
                let mut activation = Context::with_env(Arc::clone(&self.env));
                activation.set_variable_resolver(
                    variables.get_or_init(|| values.scope_metered(i, meter)),
                );
                activation
            })
        };
        let mut failed: Option<EvalError> = None;
        for r in set_bits(bits) {
            let rule = &self.rules[r];
            let planned = match (batch_wide.get(r), &rule.when_plan) {
                (Some(held), _) => Some(Ok(held)),
                (None, Some(plan)) => {
                    let value = plan.bool(&fast);
                    if let (false, Ok(held)) = (plan.reads_call(), value) {
                        batch_wide.set(r, held);
                    }
                    Some(value)
                }
                (None, None) => None,
            };
            if let Some(stop) = meter.stopped() {
                return self.stopped(stop, r, failed);
            }
            match planned {
                Some(Ok(false)) => continue,
                Some(Ok(true)) => {}
                Some(Err(Unsure)) | None => {
                    self.interpreted.fetch_add(1, Ordering::Relaxed);
                    let value = Value::resolve_val(rule.when.program.expression(), interpreter());
                    if let Some(stop) = meter.stopped() {
                        return self.stopped(stop, r, failed);
                    }
                    match value {
                        Ok(value) => match value.downcast_ref::<CelBool>() {
                            Some(b) if !*b.inner() => continue,
                            Some(_) => {}
                            None => {
                                failed.get_or_insert(EvalError::NotBool {
                                    rule: rule.name.clone(),
                                    got: value.get_type().name().to_owned(),
                                });
                                continue;
                            }
                        },
                        Err(error) => {
                            failed.get_or_insert(EvalError::Failed {
                                rule: rule.name.clone(),
                                field: Field::When,
                                reason: super::error::describe(&error, |key| {
                                    rule.text.contains(key)
                                }),
                            });
                            continue;
                        }
                    }
                }
            }
            let message = match rule.message_plan.as_ref().map(|plan| plan.string(&fast)) {
                Some(Ok(message)) => Ok(message),
                _ => {
                    if let Some(stop) = meter.stopped() {
                        return self.stopped(stop, r, failed);
                    }
                    let value =
                        Value::resolve_val(rule.message.program.expression(), interpreter());
                    if let Some(stop) = meter.stopped() {
                        return self.stopped(stop, r, failed);
                    }
                    match value {
                        Ok(value) => match value.downcast_ref::<CelString>() {
                            Some(message) => Ok(message.inner().to_owned()),
                            None => Err(EvalError::NotString {
                                rule: rule.name.clone(),
                                got: value.get_type().name().to_owned(),
                            }),
                        },
                        Err(error) => Err(EvalError::Failed {
                            rule: rule.name.clone(),
                            field: Field::Message,
                            reason: super::error::describe(&error, |key| rule.text.contains(key)),
                        }),
                    }
                }
            };
            return match (message, failed) {
                (Ok(message), None) => Outcome::Matched(Verdict {
                    rule: rule.name.clone(),
                    action: rule.action,
                    message,
                    labels: rule.labels.clone(),
                }),
                (Ok(message), Some(error)) => Outcome::FailedThen(
                    error,
                    Verdict {
                        rule: rule.name.clone(),
                        action: rule.action,
                        message,
                        labels: rule.labels.clone(),
                    },
                ),
                // The rule matched but its message failed: an error of that
                // rule, which decides (its `when` held).
                (Err(error), None) => Outcome::Error(error),
                (Err(_), Some(first)) => Outcome::Error(first),
            };
        }
        match failed {
            Some(error) => Outcome::Error(error),
            None => Outcome::Proceed,
        }
    }
}

/// The value of the `when` of each rule that does not read `call`, once
/// evaluated for a batch: bit sets, one bit per rule.
struct BatchWide<'b> {
    evaluated: &'b mut [u64],
    held: &'b mut [u64],
}

impl BatchWide<'_> {
    /// Rule `r`'s `when`, if evaluated.
    fn get(&self, r: usize) -> Option<bool> {
        let bit = 1u64 << (r % 64);
        (self.evaluated[r / 64] & bit != 0).then(|| self.held[r / 64] & bit != 0)
    }

    fn set(&mut self, r: usize, held: bool) {
        let bit = 1u64 << (r % 64);
        self.evaluated[r / 64] |= bit;
        if held {
            self.held[r / 64] |= bit;
        }
    }
}

/// Words of rule sets kept on the stack while a batch is judged (64 rules
/// a word): a policy of up to 128 rules allocates none.
const STACK_WORDS: usize = 2;

/// The indices of the bits set in `bits`, lowest first.
fn set_bits(bits: &[u64]) -> impl Iterator<Item = usize> + '_ {
    bits.iter().enumerate().flat_map(|(w, &word)| {
        let mut word = word;
        std::iter::from_fn(move || {
            if word == 0 {
                return None;
            }
            let bit = word.trailing_zeros() as usize;
            word &= word - 1;
            Some(w * 64 + bit)
        })
    })
}

/// Which rules apply to a tool, by all the rules' globs in one set: one
/// match per call rather than one per rule.
struct ToolIndex {
    /// Every rule's globs.
    set: GlobSet,
    /// The rule of each glob of `set`.
    owner: Vec<usize>,
    /// The rules without globs (they apply to every tool), as bits.
    every_tool: Vec<u64>,
    /// The bits of the tools seen lately: matching a tool against every
    /// rule's globs took about 1,100 instructions per call, a lookup here a
    /// small part of that. At most [`TOOLS_KEPT`] tools; emptied when full,
    /// so a peer sending endless new tool names costs itself misses and
    /// nobody memory. Hashed by foldhash, seeded per process (the names
    /// come from peers): about a third of SipHash's instructions.
    seen: RwLock<HashMap<Box<str>, Applicable, foldhash::fast::RandomState>>,
    /// The cost of the rules without globs together.
    every_tool_cost: Costs,
}

/// The rules that apply to a tool, and the sum of their costs (one
/// polynomial: evaluated once per call, not once per rule).
struct Applicable {
    bits: Box<[u64]>,
    cost: Costs,
}

/// The costs of a set of rules: of those reading the call alone (at the
/// call's `n`) and of those reading `calls` (at the batch's).
#[derive(Default)]
struct Costs {
    own: Cost,
    batch: Cost,
}

impl Costs {
    fn at(&self, (n, batch_n): (usize, usize)) -> u64 {
        self.own.at(n).saturating_add(self.batch.at(batch_n))
    }
}

/// The sum of the costs of the rules of `bits`.
fn cost_of(rules: &[Rule], bits: &[u64]) -> Costs {
    let mut cost = Costs::default();
    for r in set_bits(bits) {
        let rule = &rules[r];
        if rule.reads_calls {
            cost.batch.add_cost(&rule.cost);
        } else {
            cost.own.add_cost(&rule.cost);
        }
    }
    cost
}

/// Most tools whose applicable rules a policy remembers.
pub(super) const TOOLS_KEPT: usize = 1024;

/// Longest tool name remembered (longer ones are matched every time).
pub(super) const TOOL_NAME_KEPT: usize = 256;

impl ToolIndex {
    fn new(rules: &[Rule]) -> Result<Self, globset::Error> {
        let mut builder = GlobSetBuilder::new();
        let mut owner = Vec::new();
        let mut every_tool = vec![0u64; rules.len().div_ceil(64)];
        for (r, rule) in rules.iter().enumerate() {
            if rule.tools.is_none() {
                every_tool[r / 64] |= 1 << (r % 64);
                continue;
            }
            for pattern in &rule.patterns {
                builder.add(glob(pattern)?);
                owner.push(r);
            }
        }
        Ok(Self {
            set: builder.build()?,
            owner,
            every_tool_cost: cost_of(rules, &every_tool),
            every_tool,
            seen: RwLock::new(HashMap::default()),
        })
    }

    /// How many tools' rules are remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.seen
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Sets in `bits` the rules (of `rules`) that apply to `tool`, and
    /// returns their cost at `n` (the call's and the batch's); `matched` is
    /// scratch.
    fn applicable(
        &self,
        tool: &str,
        bits: &mut [u64],
        matched: &mut Vec<usize>,
        rules: &[Rule],
        n: (usize, usize),
    ) -> u64 {
        if self.owner.is_empty() {
            bits.copy_from_slice(&self.every_tool);
            return self.every_tool_cost.at(n);
        }
        let seen = self.seen.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = seen.get(tool) {
            bits.copy_from_slice(&known.bits);
            return known.cost.at(n);
        }
        drop(seen);
        self.matched(tool, bits, matched);
        let cost = cost_of(rules, bits);
        let at = cost.at(n);
        if tool.len() <= TOOL_NAME_KEPT {
            let known = Applicable {
                bits: bits.into(),
                cost,
            };
            let mut seen = self.seen.write().unwrap_or_else(PoisonError::into_inner);
            // Freed after the lock is let go, not while others wait.
            let forgotten = (seen.len() >= TOOLS_KEPT).then(|| std::mem::take(&mut *seen));
            seen.insert(tool.into(), known);
            drop(seen);
            drop(forgotten);
        }
        at
    }

    /// [`Self::applicable`] by the glob set.
    fn matched(&self, tool: &str, bits: &mut [u64], matched: &mut Vec<usize>) {
        bits.copy_from_slice(&self.every_tool);
        self.set.matches_into(tool, matched);
        for &glob in matched.iter() {
            let r = self.owner[glob];
            bits[r / 64] |= 1 << (r % 64);
        }
    }
}

fn compile_rule(
    env: &Env,
    functions: &mut Functions,
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
                let glob = glob(pattern).map_err(|error| {
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
    let mut compile = |field: Field, text: toml::Spanned<String>| {
        let first_line = file::content_line(source, text.span());
        expr::compile(env, functions, field, text.get_ref(), limits)
            .map_err(|refused| fail(first_line + refused.line - 1, refused.kind))
    };
    let labels: std::sync::Arc<[String]> = match entry.labels {
        None => std::sync::Arc::from(Vec::new()),
        Some(labels) => {
            let at = file::line_at(source, labels.span().start);
            let labels = labels.into_inner();
            if labels.len() > crate::session::limits::MAX_LABELS_PER_VERDICT {
                return Err(fail(
                    at,
                    CompileErrorKind::Format(format!(
                        "`labels`: {} labels, more than the limit of {}",
                        labels.len(),
                        crate::session::limits::MAX_LABELS_PER_VERDICT
                    )),
                ));
            }
            if let Some(bad) = labels.iter().find(|l| {
                !crate::session::memory::label_ok(l, crate::session::limits::MAX_LABEL_BYTES)
            }) {
                return Err(fail(
                    at,
                    CompileErrorKind::Format(format!(
                        "`labels`: {:?} is not a label (1 to {} bytes of ASCII letters, digits and _ - . : /)",
                        bad.chars().take(64).collect::<String>(),
                        crate::session::limits::MAX_LABEL_BYTES
                    )),
                ));
            }
            std::sync::Arc::from(labels)
        }
    };
    let text = format!("{}\n{}", entry.when.get_ref(), entry.message.get_ref());
    let when = compile(Field::When, entry.when)?;
    let message = compile(Field::Message, entry.message)?;
    let mut cost = when.cost.clone();
    cost.add_cost(&message.cost);
    let when_plan = Plan::new(when.program.expression());
    let message_plan = Plan::new(message.program.expression());
    Ok(Rule {
        reads_calls: when.reads_calls || message.reads_calls,
        text,
        when_plan,
        message_plan,
        name,
        description: entry.description,
        line,
        patterns,
        tools,
        when,
        action: entry.action,
        message,
        labels,
        cost,
    })
}
