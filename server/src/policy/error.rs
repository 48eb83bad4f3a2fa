//! The errors of a policy: refusing a file ([`CompileError`]), failing to
//! judge a call ([`EvalError`]), and refusing a cases file ([`CasesError`]).

use thiserror::Error;

/// Why a policy file is refused. The whole file is refused: no rule of a file
/// that does not compile is ever applied (R27).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("line {line}: {}{kind}", rule_prefix(.rule))]
pub struct CompileError {
    /// The line of the file (from 1) where the problem is.
    pub line: usize,
    /// The rule it is in, when known.
    pub rule: Option<String>,
    /// What is wrong.
    pub kind: CompileErrorKind,
}

fn did_you_mean(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map_or_else(String::new, |s| format!("; did you mean {s:?}?"))
}

fn rule_prefix(rule: &Option<String>) -> String {
    match rule {
        Some(rule) => format!("rule {rule:?}: "),
        None => String::new(),
    }
}

/// What is wrong with a policy file.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CompileErrorKind {
    /// Not TOML, or not the policy format (unknown or missing keys, wrong
    /// types, an unknown action).
    #[error("{0}")]
    Format(String),
    /// A file without rules.
    #[error("the policy has no rules ([[rule]] tables)")]
    NoRules,
    /// More rules than [`Limits::max_rules`](super::Limits::max_rules).
    #[error("{count} rules, more than the limit of {limit}")]
    TooManyRules { count: usize, limit: usize },
    /// A rule without a name.
    #[error("a rule needs a non-empty name")]
    EmptyName,
    /// Two rules with one name.
    #[error("the name is already used by the rule on line {first_line}")]
    DuplicateName { first_line: usize },
    /// A tool glob that does not compile.
    #[error("tool pattern {pattern:?}: {reason}")]
    BadGlob { pattern: String, reason: String },
    /// An expression that is not CEL.
    #[error("`{field}` does not compile: {reason}")]
    Syntax { field: Field, reason: String },
    /// An expression naming a variable that does not exist.
    #[error(
        "`{field}` uses the unknown variable {name:?} (known: call, calls, context, session, identity, and the variables of its macros)"
    )]
    UnknownVariable { field: Field, name: String },
    /// An expression calling a function the environment does not declare
    /// (a misspelt name, or one of the extensions left out): it would fail
    /// on every call.
    #[error(
        "`{field}` calls the unknown function {name:?}{} (CEL names are case-sensitive; the functions rules may call are listed in docs/policies.md)",
        did_you_mean(.suggestion)
    )]
    UnknownFunction {
        field: Field,
        name: String,
        suggestion: Option<String>,
    },
    /// A macro called with arguments it does not take (`has(a, b)`,
    /// `l.all(true)`): the parser leaves it a call to an undeclared
    /// function, which would fail on every call.
    #[error(
        "`{field}` calls the macro {name:?} with arguments it does not take (has(a.b), l.all(x, p), l.exists(x, p), l.exists_one(x, p), l.map(x, e), l.map(x, p, e), l.filter(x, p))"
    )]
    MacroArguments { field: Field, name: String },
    /// A standard function called with an argument count it does not take
    /// (`x.startsWith()`): it would fail on every call.
    #[error("`{field}` calls {name:?} with {got} argument(s){}; it takes {takes}", if *.member { " besides its receiver" } else { "" })]
    ArgumentCount {
        field: Field,
        name: String,
        got: usize,
        takes: String,
        /// Called on a receiver (`x.f()`), which is not counted.
        member: bool,
    },
    /// A `matches` pattern that is not a valid regex.
    #[error("`{field}`: the pattern {pattern:?} is not a valid regex: {reason}")]
    BadRegex {
        field: Field,
        pattern: String,
        reason: String,
    },
    /// An expression longer than the limit.
    #[error("`{field}` has {bytes} bytes, more than the limit of {limit}")]
    TooLong {
        field: Field,
        bytes: usize,
        limit: usize,
    },
    /// An expression with too many nodes.
    #[error("`{field}` has {nodes} syntax nodes, more than the limit of {limit}")]
    TooBig {
        field: Field,
        nodes: usize,
        limit: usize,
    },
    /// A policy file larger than [`Limits::max_policy_bytes`](super::Limits).
    #[error("the policy has {bytes} bytes, more than the limit of {limit}")]
    TooLarge { bytes: usize, limit: usize },
    /// A policy that took longer to compile than
    /// [`Limits::max_compile_millis`](super::Limits).
    #[error("the policy took more than {limit_ms} ms to compile")]
    TooSlow { limit_ms: u64 },
    /// Macros nested too deeply.
    #[error(
        "`{field}` nests macros (all, exists, map, filter...) {depth} deep, more than the limit of {limit}"
    )]
    TooDeep {
        field: Field,
        depth: usize,
        limit: usize,
    },
}

/// Which expression of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    When,
    Message,
}

impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Field::When => "when",
            Field::Message => "message",
        })
    }
}

/// Why a call could not be judged. For the mesh this is a failure of the
/// policy guard (R13), never a proceed (R27).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EvalError {
    /// An expression failed while evaluated: a missing field, a wrong type,
    /// a division by zero...
    #[error("rule {rule:?}: `{field}` failed: {reason}")]
    Failed {
        rule: String,
        field: Field,
        reason: String,
    },
    /// `when` did not give a bool.
    #[error("rule {rule:?}: `when` gave a {got}, not a bool")]
    NotBool { rule: String, got: String },
    /// `message` did not give a string.
    #[error("rule {rule:?}: `message` gave a {got}, not a string")]
    NotString { rule: String, got: String },
    /// The estimated cost is over a bound (see `cost`); nothing was
    /// evaluated.
    #[error(
        "the policy's estimated cost {estimate} for this {scope} is over the limit of {limit} (largest list or map in the input: {n} items; costliest rule: {rule:?})"
    )]
    TooCostly {
        scope: Scope,
        estimate: u64,
        limit: u64,
        n: usize,
        rule: String,
    },
}

impl EvalError {
    /// The rule the error is about.
    pub fn rule(&self) -> &str {
        match self {
            EvalError::Failed { rule, .. }
            | EvalError::NotBool { rule, .. }
            | EvalError::NotString { rule, .. }
            | EvalError::TooCostly { rule, .. } => rule,
        }
    }
}

/// What a cost bound was about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Call,
    Batch,
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scope::Call => "call",
            Scope::Batch => "batch",
        })
    }
}

/// Why a cases file is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("line {line}: {reason}")]
pub struct CasesError {
    /// The line of the cases file (from 1).
    pub line: usize,
    /// What is wrong.
    pub reason: String,
}

/// What went wrong in a CEL evaluation, without the values involved: an
/// error's text is traced, logged and recorded, and argument values may be
/// masked fields (R29). Names written in the rule (functions, operators, keys,
/// types) stay.
#[allow(deprecated)]
pub(crate) fn describe(error: &cel::ExecutionError, written: impl Fn(&str) -> bool) -> String {
    use cel::ExecutionError as E;
    match error {
        E::InvalidArgumentCount { expected, actual } => {
            format!("a function got {actual} arguments, not {expected}")
        }
        E::UnsupportedTargetType { .. } => {
            "a function was called on a value of the wrong type".into()
        }
        E::NotSupportedAsMethod { method, .. } => {
            format!("{method} is not a method of the value it was called on")
        }
        E::UnsupportedKeyType(_) => "a map key of an unsupported type".into(),
        E::UnexpectedType { got, want } => format!("expected a {want}, got a {got}"),
        E::NoSuchKey(key) if written(key) => format!("no such key: {key}"),
        E::NoSuchKey(_) => "no such key".into(),
        E::NoSuchOverload(_) => "no matching overload for the types of its arguments".into(),
        E::UndeclaredReference(name) => format!("undeclared reference to {name}"),
        E::MissingArgumentOrTarget => "a missing argument or target".into(),
        E::ValuesNotComparable(..) => "values that cannot be compared".into(),
        E::UnsupportedUnaryOperator(op, _) => format!("unsupported operand of {op}"),
        E::UnsupportedBinaryOperator(op, ..) => format!("unsupported operands of {op}"),
        E::UnsupportedMapIndex(_) | E::UnsupportedListIndex(_) | E::UnsupportedIndex(..) => {
            "an unsupported index".into()
        }
        // `matches` is the mesh's own, and its messages quote no value.
        // So are the session functions' (R34: they name the memory's state
        // and the bound, never an argument) and the shell helpers' (sizes
        // and types, never the command).
        E::FunctionError { function, message }
            if matches!(
                function.as_str(),
                "matches"
                    | "count"
                    | "seen_from"
                    | "seen_from_other"
                    | "labels"
                    | "evicted"
                    | "values_lost"
                    | "calls_total"
                    | "shell.commands"
                    | "shell.has_flags"
            ) =>
        {
            format!("function {function} failed: {message}")
        }
        E::FunctionError { function, .. } => format!("function {function} failed"),
        E::DivisionByZero(_) => "division by zero".into(),
        E::RemainderByZero(_) => "remainder by zero".into(),
        E::Overflow(op, ..) => format!("integer overflow in {op}"),
        E::IndexOutOfBounds(_) => "index out of bounds".into(),
        E::DuplicateKey(_) => "a map literal repeats a key".into(),
        _ => "evaluation error".into(),
    }
}
