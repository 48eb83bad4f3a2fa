//! A fast path for the expressions policies are made of, beside the CEL
//! interpreter.
//!
//! The interpreter resolves every name, function and operator by string at
//! each evaluation and builds a value per step; on a typical rule that is
//! most of the time a policy guard costs. Here an expression's syntax tree is
//! compiled once into a [`Plan`]: variables are slots, functions and
//! operators are resolved, `matches` patterns are compiled regexes, and the
//! call's arguments are read from borrowed JSON (`json`) without building
//! CEL values.
//!
//! The fast path answers only what it is sure of. It covers literals, the
//! variables, field selection and `has`, the logical, comparison,
//! arithmetic and membership operators, `size`, `matches`, `startsWith`,
//! `endsWith`, `contains`, `string` of strings and integers, list literals,
//! and the macros (`exists`, `all`, `exists_one`, `filter`, `map`). Anything
//! else is not planned, and any step that would be an error or that it does
//! not handle (a missing field, a type it does not compare, an overflow)
//! gives up ([`Unsure`]) and the interpreter evaluates the expression from
//! the start: errors, their messages and every case outside the fast path are
//! the interpreter's. The property test in `tests` checks that wherever the
//! fast path answers, the interpreter answers the same.

use std::cmp::Ordering;
use std::sync::Arc;

use cel::common::ast::{Expr, IdedExpr, LiteralValue, operators};
use regex::Regex;

use super::json::{Json, Object, Unparsed};

/// The fast path gave up: the interpreter decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unsure;

type Run<T> = Result<T, Unsure>;

/// A compiled expression.
#[derive(Debug)]
pub(crate) struct Plan {
    root: Node,
    /// Slots for the variables macros bind.
    slots: usize,
    /// Whether it reads `call`: if not, its value is the same for every
    /// call of a batch.
    reads_call: bool,
    /// Whether it may read a call's arguments (see [`Plan::reads_args`]).
    reads_args: bool,
}

#[derive(Debug)]
enum Node {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(String),
    Call,
    Calls,
    Context,
    /// `call.args`, `call.tool`, `call.call_id`, `context.metadata`,
    /// `context.model_text`: resolved when planned, not by name.
    Args,
    Tool,
    CallId,
    Metadata,
    ModelText,
    /// `call.args.f` and `has(call.args.f)`: a member of this call's
    /// arguments, looked up without a value for the arguments in between.
    Arg(Box<str>),
    ArgHas(Box<str>),
    /// `call.args.f.matches(r'...')` with the pattern written in the policy.
    ArgMatches(Box<str>, Matcher),
    Slot(usize),
    /// `c.tool`, `c.call_id`, `c.args` of a macro variable `c` ranging over
    /// `calls`: resolved when planned, not by name.
    ToolOf(usize),
    CallIdOf(usize),
    ArgsOf(usize),
    /// `operand.f1.f2...`: selections in a row, one node; with `test`, the
    /// last is `has()`'s.
    Select {
        operand: Box<Node>,
        fields: Box<[String]>,
        test: bool,
    },
    Not(Box<Node>),
    Negate(Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Cond(Box<[Node; 3]>),
    NotStrictlyFalse(Box<Node>),
    Eq(Box<Node>, Box<Node>),
    Ne(Box<Node>, Box<Node>),
    Compare(Compare, Box<Node>, Box<Node>),
    Arith(Arith, Box<Node>, Box<Node>),
    In(Box<Node>, Box<Node>),
    Index(Box<Node>, Box<Node>),
    Size(Box<Node>),
    Matches(Box<Node>, Pattern),
    Text(TextTest, Box<Node>, Box<Node>),
    ToString(Box<Node>),
    /// `x.lowerAscii()`, `x.upperAscii()`, `x.trim()`.
    Transform(Transform, Box<Node>),
    List(Vec<Node>),
    Fold(Box<Fold>),
    /// `range.exists(iter, pred)` (`any: true`) or `range.all(iter, pred)`:
    /// the fold those macros expand to, without the accumulator.
    Quantifier {
        any: bool,
        range: Box<Node>,
        iter: usize,
        pred: Box<Node>,
    },
    /// `accu + [element]` in a macro's step: appends in place.
    Append {
        accu: usize,
        element: Box<Node>,
    },
    /// The accumulator itself as a macro's step value: moved, not copied.
    Take(usize),
}

#[derive(Debug, Clone, Copy)]
enum Compare {
    Less,
    LessEquals,
    Greater,
    GreaterEquals,
}

#[derive(Debug, Clone, Copy)]
enum Arith {
    Add,
    Sub,
    Mul,
}

/// A string function whose result is no longer than its receiver.
#[derive(Debug, Clone, Copy)]
enum Transform {
    Lower,
    Upper,
    Trim,
}

impl Transform {
    /// As the interpreter's (`strings`): ASCII letters only for the case,
    /// Unicode white space for `trim`.
    fn apply(self, text: &str) -> String {
        match self {
            Transform::Lower => text.to_ascii_lowercase(),
            Transform::Upper => text.to_ascii_uppercase(),
            Transform::Trim => text.trim().to_owned(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum TextTest {
    StartsWith,
    EndsWith,
    Contains,
}

#[derive(Debug)]
enum Pattern {
    Fixed(Matcher),
    Computed(Box<Node>),
}

/// A pattern written in the policy. One that accepts only a few words
/// (`^(word|word)$`, optionally `(?i)`) is checked without the regex engine
/// wherever that gives the regex's answer.
#[derive(Debug)]
struct Matcher {
    regex: Arc<Regex>,
    words: Option<Words>,
}

/// The words of a pattern `^(w1|w2|...)$` or `^w$`, optionally preceded by
/// `(?i)`, each word of ASCII letters, digits and `_`.
#[derive(Debug, PartialEq)]
struct Words {
    /// `(?i)`: case-insensitive.
    fold: bool,
    words: Box<[Box<str>]>,
    /// Bit `n` for each word of `n` < 64 bytes: other lengths of ASCII
    /// text below 64 match no word.
    lengths: u64,
    /// Bit `b` for each ASCII byte `b` a word starts with (both cases under
    /// `(?i)`): text starting with another ASCII byte matches no word,
    /// whatever follows.
    firsts: u128,
}

impl Words {
    fn parse(pattern: &str) -> Option<Words> {
        let (fold, rest) = match pattern.strip_prefix("(?i)") {
            Some(rest) => (true, rest),
            None => (false, pattern),
        };
        let body = rest.strip_prefix('^')?.strip_suffix('$')?;
        // An alternation must be a group: `^a|b$` is `(^a)|(b$)`.
        let (body, grouped) = match body
            .strip_prefix("(?:")
            .or_else(|| body.strip_prefix('('))
            .and_then(|b| b.strip_suffix(')'))
        {
            Some(inner) => (inner, true),
            None => (body, false),
        };
        let words: Box<[Box<str>]> = body.split('|').map(Box::from).collect();
        let word =
            |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if (words.len() > 1 && !grouped) || !words.iter().all(|w| word(w)) {
            return None;
        }
        let lengths = words
            .iter()
            .filter(|w| w.len() < 64)
            .fold(0, |bits, w| bits | (1 << w.len()));
        let mut firsts = 0u128;
        for w in &words {
            let b = w.as_bytes()[0];
            firsts |= 1 << b;
            if fold {
                firsts |= (1 << b.to_ascii_lowercase()) | (1 << b.to_ascii_uppercase());
            }
        }
        Some(Words {
            fold,
            words,
            lengths,
            firsts,
        })
    }

    /// Whether `text` is one of the words; `None` when only the regex
    /// knows. Case-insensitively, an ASCII letter of the pattern matches
    /// its two ASCII cases and non-ASCII characters too (`ſ` is an `s`
    /// for the regex): text that is not ASCII is left to the regex.
    fn is_match(&self, text: &str) -> Option<bool> {
        // An ASCII character matches only its ASCII cases, so text whose
        // first byte is ASCII and starts no word is none of them.
        if let Some(&b) = text.as_bytes().first()
            && b < 128
            && self.firsts & (1 << b) == 0
        {
            return Some(false);
        }
        if !self.fold {
            Some(self.words.iter().any(|w| **w == *text))
        } else if text.is_ascii() {
            // ASCII text of a length no word has matches none.
            let n = text.len();
            Some(
                (n >= 64 || self.lengths & (1 << n) != 0)
                    && self.words.iter().any(|w| w.eq_ignore_ascii_case(text)),
            )
        } else {
            None
        }
    }
}

impl Matcher {
    fn new(regex: Arc<Regex>) -> Matcher {
        let words = Words::parse(regex.as_str());
        Matcher { regex, words }
    }

    fn is_match(&self, text: &str) -> bool {
        match self.words.as_ref().and_then(|w| w.is_match(text)) {
            Some(found) => found,
            None => self.regex.is_match(text),
        }
    }
}

/// Whether `pattern`'s word check answers `text`, and its answer.
#[cfg(test)]
pub(crate) fn word_match(pattern: &str, text: &str) -> Option<bool> {
    Words::parse(pattern)?.is_match(text)
}

#[derive(Debug)]
struct Fold {
    range: Node,
    iter: usize,
    accu: usize,
    init: Node,
    cond: Node,
    step: Node,
    result: Node,
}

impl Fold {
    /// The fold of `exists` or `all` as a [`Node::Quantifier`]; any other
    /// as it is.
    fn shortcut(self) -> Node {
        let accu = self.accu;
        let is_accu = |node: &Node| matches!(node, Node::Slot(s) if *s == accu);
        let any = match (&self.init, &self.cond, &self.step) {
            (Node::Bool(false), Node::NotStrictlyFalse(c), Node::Or(a, pred))
                if matches!(&**c, Node::Not(n) if is_accu(n))
                    && is_accu(a)
                    && !reads(pred, accu) =>
            {
                true
            }
            (Node::Bool(true), Node::NotStrictlyFalse(c), Node::And(a, pred))
                if is_accu(c) && is_accu(a) && !reads(pred, accu) =>
            {
                false
            }
            _ => return Node::Fold(Box::new(self)),
        };
        if !is_accu(&self.result) {
            return Node::Fold(Box::new(self));
        }
        let (Node::Or(_, pred) | Node::And(_, pred)) = self.step else {
            return Node::Fold(Box::new(self));
        };
        Node::Quantifier {
            any,
            range: Box::new(self.range),
            iter: self.iter,
            pred,
        }
    }
}

/// What an expression reads: the batch and the call being judged.
pub(crate) struct Input<'r, 'a> {
    pub(crate) calls: &'r [FastCall<'a>],
    pub(crate) call: usize,
    pub(crate) context: &'r FastContext<'a>,
    /// The call's budget (see `meter`): a step per node, a unit per byte of
    /// text read or built. Spent, the fast path gives up, and the engine
    /// reads the meter rather than asking the interpreter.
    pub(crate) meter: Option<&'r super::meter::Meter>,
}

impl Input<'_, '_> {
    /// Charges `units` of work; `Unsure` once the budget is spent.
    #[inline]
    fn charge(&self, units: usize) -> Run<()> {
        match self.meter {
            Some(meter) if !meter.charge(units as u64) => Err(Unsure),
            _ => Ok(()),
        }
    }
}

/// One call, for the fast path.
#[derive(Debug)]
pub(crate) struct FastCall<'a> {
    pub(crate) call_id: &'a str,
    pub(crate) tool: &'a str,
    /// `None` when the arguments are only for the interpreter (see
    /// `Json::from_text`).
    pub(crate) args: Option<Json<'a>>,
}

/// The batch's context, for the fast path.
#[derive(Debug)]
pub(crate) struct FastContext<'a> {
    pub(crate) session_id: &'a str,
    pub(crate) turn_index: u32,
    pub(crate) model_text: &'a str,
    pub(crate) metadata: Vec<(&'a str, &'a str)>,
}

/// A value during evaluation.
// Strings and lists are boxed on purpose (see `Owned`).
#[allow(clippy::box_collection)]
#[derive(Debug, Clone)]
enum V<'r> {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    /// A string of the plan or of the input.
    Str(&'r str),
    /// A string built during evaluation. Boxed, as lists are: dropping a
    /// value of another kind is then a test, not a call.
    Owned(Box<String>),
    /// A list or an object of some call's arguments.
    Json(&'r Json<'r>),
    /// `calls[i]`, a map `{call_id, tool, args}`.
    CallMap(usize),
    Calls,
    Context,
    Metadata,
    List(Box<Vec<V<'r>>>),
}

impl Plan {
    /// Plans `expr`, or `None` when it uses something the fast path does
    /// not cover (the interpreter alone evaluates it then).
    pub(crate) fn new(expr: &IdedExpr) -> Option<Plan> {
        let mut planner = Planner {
            scope: Vec::new(),
            slots: 0,
            reads_call: false,
            call_slots: Vec::new(),
        };
        let root = planner.node(expr)?;
        Some(Plan {
            reads_args: any_node(&root, &|node| {
                matches!(
                    node,
                    Node::Args
                        | Node::Arg(_)
                        | Node::ArgHas(_)
                        | Node::ArgMatches(..)
                        | Node::ArgsOf(_)
                        | Node::Call
                        | Node::Calls
                )
            }),
            root,
            slots: planner.slots,
            reads_call: planner.reads_call,
        })
    }

    /// Whether it may read a call's arguments: it names them, or `call` or
    /// `calls` whole (a map whose `args` it could select). When no plan of
    /// a batch's policies does, the arguments are not read for the fast
    /// path at all ([`super::BatchValues::new`]); a plan that read them
    /// anyway would find them absent and leave the call to the interpreter.
    pub(crate) fn reads_args(&self) -> bool {
        self.reads_args
    }

    /// Whether its value may differ from one call of a batch to another.
    pub(crate) fn reads_call(&self) -> bool {
        self.reads_call
    }

    /// Evaluates to a bool; `Unsure` for anything else.
    pub(crate) fn bool(&self, input: &Input<'_, '_>) -> Run<bool> {
        self.run(input, test)
    }

    /// Evaluates to a string; `Unsure` for anything else.
    pub(crate) fn string(&self, input: &Input<'_, '_>) -> Run<String> {
        match self.run(input, eval)? {
            V::Str(s) => Ok(s.to_owned()),
            V::Owned(s) => Ok(*s),
            _ => Err(Unsure),
        }
    }

    /// `how` on the root, with the slots macros need (on the stack when
    /// few).
    fn run<'r, T>(
        &'r self,
        input: &Input<'r, '_>,
        how: fn(&'r Node, &Input<'r, 'r>, &mut [V<'r>]) -> Run<T>,
    ) -> Run<T> {
        // Variance: the input's JSON outlives this evaluation.
        let input: &Input<'r, 'r> = input;
        match self.slots {
            0 => how(&self.root, input, &mut []),
            n @ 1..=4 => {
                let mut slots = [V::Null, V::Null, V::Null, V::Null];
                how(&self.root, input, &mut slots[..n])
            }
            n => how(&self.root, input, &mut vec![V::Null; n]),
        }
    }
}

/// Why [`Plan::plain`] has no value.
#[cfg(test)]
#[derive(Debug)]
pub(crate) enum Seen {
    Unsure,
    /// A value with no plain form (a bug of the fast path).
    Unplain,
}

#[cfg(test)]
impl Plan {
    /// Evaluates to a value comparable with the interpreter's.
    pub(crate) fn plain(&self, input: &Input<'_, '_>) -> Result<super::plan_tests::Plain, Seen> {
        let value = self.run(input, eval).map_err(|Unsure| Seen::Unsure)?;
        plain(&value, input).ok_or(Seen::Unplain)
    }
}

#[cfg(test)]
fn plain(value: &V<'_>, input: &Input<'_, '_>) -> Option<super::plan_tests::Plain> {
    use super::plan_tests::Plain;
    use std::collections::BTreeMap;
    fn json(value: &Json<'_>) -> Plain {
        match value {
            Json::Null => Plain::Null,
            Json::Bool(b) => Plain::Bool(*b),
            Json::Int(i) => Plain::Int(*i),
            Json::Uint(u) => Plain::Uint(*u),
            Json::Double(d) => Plain::Double(d.to_bits()),
            Json::Str(s) => Plain::Str(s.to_string()),
            Json::List(items) => Plain::List(items.iter().map(json).collect()),
            Json::Map(object) => Plain::Map(
                object
                    .iter()
                    .map(|(k, v)| (k.to_string(), json(v.expect("a member that parses"))))
                    .collect(),
            ),
        }
    }
    let input: &Input<'_, '_> = input;
    Some(match value {
        V::Null => Plain::Null,
        V::Bool(b) => Plain::Bool(*b),
        V::Int(i) => Plain::Int(*i),
        V::Uint(u) => Plain::Uint(*u),
        V::Double(d) => Plain::Double(d.to_bits()),
        V::Str(s) => Plain::Str((*s).to_owned()),
        V::Owned(s) => Plain::Str(s.to_string()),
        V::Json(j) => json(j),
        V::List(items) => Plain::List(
            items
                .iter()
                .map(|v| plain(v, input))
                .collect::<Option<_>>()?,
        ),
        V::CallMap(i) => {
            let call = input.calls.get(*i)?;
            Plain::Map(BTreeMap::from([
                ("call_id".to_owned(), Plain::Str(call.call_id.to_owned())),
                ("tool".to_owned(), Plain::Str(call.tool.to_owned())),
                ("args".to_owned(), json(call.args.as_ref()?)),
            ]))
        }
        V::Calls => Plain::List(
            (0..input.calls.len())
                .map(|i| plain(&V::CallMap(i), input))
                .collect::<Option<_>>()?,
        ),
        V::Metadata => Plain::Map(
            input
                .context
                .metadata
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Plain::Str((*v).to_owned())))
                .collect(),
        ),
        V::Context => Plain::Map(BTreeMap::from([
            (
                "session_id".to_owned(),
                Plain::Str(input.context.session_id.to_owned()),
            ),
            (
                "turn_index".to_owned(),
                Plain::Int(i64::from(input.context.turn_index)),
            ),
            (
                "model_text".to_owned(),
                Plain::Str(input.context.model_text.to_owned()),
            ),
            ("metadata".to_owned(), plain(&V::Metadata, input)?),
        ])),
    })
}

/// Compiles syntax trees into nodes.
struct Planner {
    /// The names macros bind around the node being planned, and their slots.
    scope: Vec<(String, usize)>,
    /// The slots of macro variables that range over `calls`.
    call_slots: Vec<usize>,
    slots: usize,
    reads_call: bool,
}

impl Planner {
    fn nodes<const N: usize>(&mut self, args: &[IdedExpr]) -> Option<[Box<Node>; N]> {
        if args.len() != N {
            return None;
        }
        let mut out = Vec::with_capacity(N);
        for arg in args {
            out.push(Box::new(self.node(arg)?));
        }
        out.try_into().ok()
    }

    fn node(&mut self, expr: &IdedExpr) -> Option<Node> {
        Some(match &expr.expr {
            Expr::Literal(literal) => match literal {
                LiteralValue::Null => Node::Null,
                LiteralValue::Boolean(b) => Node::Bool(*b.inner()),
                LiteralValue::Int(i) => Node::Int(*i.inner()),
                LiteralValue::UInt(u) => Node::Uint(*u.inner()),
                LiteralValue::Double(d) => Node::Double(*d.inner()),
                LiteralValue::String(s) => Node::Str(s.inner().to_owned()),
                LiteralValue::Bytes(_) => return None,
            },
            Expr::Ident(name) => {
                let node = self.ident(name)?;
                self.reads_call |= matches!(node, Node::Call);
                node
            }
            Expr::Select(select) => {
                let operand = self.node(&select.operand)?;
                self.select(operand, &select.field, select.test)
            }
            Expr::List(list) => {
                if !list.optional_indices.is_empty() {
                    return None;
                }
                Node::List(
                    list.elements
                        .iter()
                        .map(|e| self.node(e))
                        .collect::<Option<_>>()?,
                )
            }
            Expr::Call(call) => self.call(&call.func_name, call.target.as_deref(), &call.args)?,
            Expr::Comprehension(c) => {
                if c.iter_var2.is_some() {
                    return None;
                }
                let range = self.node(&c.iter_range)?;
                let init = self.node(&c.accu_init)?;
                let mark = self.scope.len();
                let accu = self.bind(&c.accu_var);
                let iter = self.bind(&c.iter_var);
                if matches!(range, Node::Calls) {
                    self.call_slots.push(iter);
                }
                let cond = self.node(&c.loop_cond)?;
                let step = self.step(&c.loop_step, accu)?;
                self.scope.truncate(mark + 1);
                let result = self.node(&c.result)?;
                self.scope.truncate(mark);
                Fold {
                    range,
                    iter,
                    accu,
                    init,
                    cond,
                    step,
                    result,
                }
                .shortcut()
            }
            Expr::Map(_) | Expr::Struct(_) | Expr::Unspecified => return None,
        })
    }

    /// `operand.field`, or `has(operand.field)` with `test`.
    fn select(&self, operand: Node, field: &str, test: bool) -> Node {
        if let (Node::Slot(slot), false) = (&operand, test)
            && self.call_slots.contains(slot)
        {
            match field {
                "tool" => return Node::ToolOf(*slot),
                "call_id" => return Node::CallIdOf(*slot),
                "args" => return Node::ArgsOf(*slot),
                _ => {}
            }
        }
        match (operand, field, test) {
            (Node::Call, "args", false) => Node::Args,
            (Node::Call, "tool", false) => Node::Tool,
            (Node::Call, "call_id", false) => Node::CallId,
            (Node::Context, "metadata", false) => Node::Metadata,
            (Node::Context, "model_text", false) => Node::ModelText,
            (Node::Args, field, false) => Node::Arg(field.into()),
            (Node::Args, field, true) => Node::ArgHas(field.into()),
            (
                Node::Select {
                    operand,
                    fields,
                    test: false,
                },
                field,
                test,
            ) => {
                let mut fields = fields.into_vec();
                fields.push(field.to_owned());
                Node::Select {
                    operand,
                    fields: fields.into_boxed_slice(),
                    test,
                }
            }
            (operand, field, test) => Node::Select {
                operand: Box::new(operand),
                fields: Box::new([field.to_owned()]),
                test,
            },
        }
    }

    fn bind(&mut self, name: &str) -> usize {
        let slot = self.slots;
        self.slots += 1;
        self.scope.push((name.to_owned(), slot));
        slot
    }

    fn ident(&self, name: &str) -> Option<Node> {
        if let Some((_, slot)) = self.scope.iter().rev().find(|(n, _)| n == name) {
            return Some(Node::Slot(*slot));
        }
        match name {
            "call" => Some(Node::Call),
            "calls" => Some(Node::Calls),
            "context" => Some(Node::Context),
            _ => None,
        }
    }

    /// A macro's step: `accu + [e]` (possibly under a condition) appends in
    /// place when `e` does not read the accumulator.
    fn step(&mut self, expr: &IdedExpr, accu: usize) -> Option<Node> {
        let is_accu = |planner: &Self, name: &str| matches!(planner.ident(name), Some(Node::Slot(slot)) if slot == accu);
        match &expr.expr {
            Expr::Ident(name) if is_accu(self, name) => Some(Node::Take(accu)),
            Expr::Call(call) if call.target.is_none() => {
                match (call.func_name.as_str(), &call.args[..]) {
                    (operators::ADD, [left, right]) => {
                        if let (Expr::Ident(name), Expr::List(list)) = (&left.expr, &right.expr)
                            && is_accu(self, name)
                            && list.elements.len() == 1
                            && list.optional_indices.is_empty()
                        {
                            let element = self.node(&list.elements[0])?;
                            if !reads(&element, accu) {
                                return Some(Node::Append {
                                    accu,
                                    element: Box::new(element),
                                });
                            }
                        }
                        self.node(expr)
                    }
                    (operators::CONDITIONAL, [cond, then, otherwise]) => {
                        let cond = self.node(cond)?;
                        let then = self.step(then, accu)?;
                        let otherwise = self.step(otherwise, accu)?;
                        Some(Node::Cond(Box::new([cond, then, otherwise])))
                    }
                    _ => self.node(expr),
                }
            }
            _ => self.node(expr),
        }
    }

    fn call(&mut self, name: &str, target: Option<&IdedExpr>, args: &[IdedExpr]) -> Option<Node> {
        use operators as op;
        if let Some(target) = target {
            let target = Box::new(self.node(target)?);
            return match (name, args) {
                ("size", []) => Some(Node::Size(target)),
                ("lowerAscii", []) => Some(Node::Transform(Transform::Lower, target)),
                ("upperAscii", []) => Some(Node::Transform(Transform::Upper, target)),
                ("trim", []) => Some(Node::Transform(Transform::Trim, target)),
                ("matches", [pattern]) => Some(text_matches(*target, self.pattern(pattern)?)),
                ("startsWith", [arg]) => Some(Node::Text(
                    TextTest::StartsWith,
                    target,
                    Box::new(self.node(arg)?),
                )),
                ("endsWith", [arg]) => Some(Node::Text(
                    TextTest::EndsWith,
                    target,
                    Box::new(self.node(arg)?),
                )),
                ("contains", [arg]) => Some(Node::Text(
                    TextTest::Contains,
                    target,
                    Box::new(self.node(arg)?),
                )),
                _ => None,
            };
        }
        Some(match name {
            op::LOGICAL_AND => {
                let [a, b] = self.nodes(args)?;
                Node::And(a, b)
            }
            op::LOGICAL_OR => {
                let [a, b] = self.nodes(args)?;
                Node::Or(a, b)
            }
            op::LOGICAL_NOT => {
                let [a] = self.nodes(args)?;
                Node::Not(a)
            }
            op::NEGATE => {
                let [a] = self.nodes(args)?;
                Node::Negate(a)
            }
            op::NOT_STRICTLY_FALSE => {
                let [a] = self.nodes(args)?;
                Node::NotStrictlyFalse(a)
            }
            op::CONDITIONAL => {
                let [c, a, b] = self.nodes(args)?;
                Node::Cond(Box::new([*c, *a, *b]))
            }
            op::EQUALS => {
                let [a, b] = self.nodes(args)?;
                Node::Eq(a, b)
            }
            op::NOT_EQUALS => {
                let [a, b] = self.nodes(args)?;
                Node::Ne(a, b)
            }
            op::LESS | op::LESS_EQUALS | op::GREATER | op::GREATER_EQUALS => {
                let [a, b] = self.nodes(args)?;
                let compare = match name {
                    op::LESS => Compare::Less,
                    op::LESS_EQUALS => Compare::LessEquals,
                    op::GREATER => Compare::Greater,
                    _ => Compare::GreaterEquals,
                };
                Node::Compare(compare, a, b)
            }
            op::ADD | op::SUBSTRACT | op::MULTIPLY => {
                let [a, b] = self.nodes(args)?;
                let arith = match name {
                    op::ADD => Arith::Add,
                    op::SUBSTRACT => Arith::Sub,
                    _ => Arith::Mul,
                };
                Node::Arith(arith, a, b)
            }
            op::IN => {
                let [a, b] = self.nodes(args)?;
                Node::In(a, b)
            }
            op::INDEX => {
                let [a, b] = self.nodes(args)?;
                Node::Index(a, b)
            }
            "size" => {
                let [a] = self.nodes(args)?;
                Node::Size(a)
            }
            "string" => {
                let [a] = self.nodes(args)?;
                Node::ToString(a)
            }
            "matches" => {
                let [text, pattern] = args else {
                    return None;
                };
                text_matches(self.node(text)?, self.pattern(pattern)?)
            }
            _ => return None,
        })
    }

    fn pattern(&mut self, pattern: &IdedExpr) -> Option<Pattern> {
        if let Expr::Literal(LiteralValue::String(text)) = &pattern.expr {
            // Written patterns were compiled with the policy (`expr`); the
            // cache may be full, or the expression compiled elsewhere.
            let text = text.inner();
            let regex = match super::patterns::cached(text) {
                Some(regex) => regex,
                None => super::patterns::lookup(text).ok()?,
            };
            return Some(Pattern::Fixed(Matcher::new(regex)));
        }
        Some(Pattern::Computed(Box::new(self.node(pattern)?)))
    }
}

/// `text.matches(pattern)`.
fn text_matches(text: Node, pattern: Pattern) -> Node {
    match (text, pattern) {
        (Node::Arg(field), Pattern::Fixed(matcher)) => Node::ArgMatches(field, matcher),
        (text, pattern) => Node::Matches(Box::new(text), pattern),
    }
}

/// Whether `test` holds for `node` or any node under it.
fn any_node(node: &Node, test: &dyn Fn(&Node) -> bool) -> bool {
    if test(node) {
        return true;
    }
    let any = |nodes: &[&Node]| nodes.iter().any(|n| any_node(n, test));
    match node {
        Node::Null
        | Node::Bool(_)
        | Node::Int(_)
        | Node::Uint(_)
        | Node::Double(_)
        | Node::Str(_)
        | Node::Call
        | Node::Calls
        | Node::Context
        | Node::Args
        | Node::Tool
        | Node::CallId
        | Node::Metadata
        | Node::ModelText
        | Node::Arg(_)
        | Node::ArgHas(_)
        | Node::ArgMatches(..)
        | Node::Slot(_)
        | Node::ToolOf(_)
        | Node::CallIdOf(_)
        | Node::ArgsOf(_)
        | Node::Take(_) => false,
        Node::Select { operand, .. } => any(&[operand]),
        Node::Not(a)
        | Node::Negate(a)
        | Node::NotStrictlyFalse(a)
        | Node::Size(a)
        | Node::ToString(a)
        | Node::Transform(_, a)
        | Node::Append { element: a, .. } => any(&[a]),
        Node::And(a, b)
        | Node::Or(a, b)
        | Node::Eq(a, b)
        | Node::Ne(a, b)
        | Node::Compare(_, a, b)
        | Node::Arith(_, a, b)
        | Node::In(a, b)
        | Node::Index(a, b)
        | Node::Text(_, a, b) => any(&[a, b]),
        Node::Cond(abc) => any(&[&abc[0], &abc[1], &abc[2]]),
        Node::Matches(a, pattern) => match pattern {
            Pattern::Computed(p) => any(&[a, p]),
            Pattern::Fixed(_) => any(&[a]),
        },
        Node::List(items) => items.iter().any(|n| any_node(n, test)),
        Node::Fold(f) => any(&[&f.range, &f.init, &f.cond, &f.step, &f.result]),
        Node::Quantifier { range, pred, .. } => any(&[range, pred]),
    }
}

/// Whether `node` reads slot `slot`.
fn reads(node: &Node, slot: usize) -> bool {
    any_node(node, &|n| match n {
        Node::Slot(s)
        | Node::ToolOf(s)
        | Node::CallIdOf(s)
        | Node::ArgsOf(s)
        | Node::Append { accu: s, .. }
        | Node::Take(s) => *s == slot,
        _ => false,
    })
}

fn eval<'r>(node: &'r Node, input: &Input<'r, 'r>, slots: &mut [V<'r>]) -> Run<V<'r>> {
    input.charge(1)?;
    Ok(match node {
        Node::Null => V::Null,
        Node::Bool(b) => V::Bool(*b),
        Node::Int(i) => V::Int(*i),
        Node::Uint(u) => V::Uint(*u),
        Node::Double(d) => V::Double(*d),
        Node::Str(s) => V::Str(s),
        Node::Call => V::CallMap(input.call),
        Node::Calls => V::Calls,
        Node::Context => V::Context,
        Node::Args => from_json(this_call(input)?.args.as_ref().ok_or(Unsure)?),
        Node::Arg(field) => from_json(args(input)?.get(field)?.ok_or(Unsure)?),
        Node::Tool => V::Str(this_call(input)?.tool),
        Node::CallId => V::Str(this_call(input)?.call_id),
        Node::Metadata => V::Metadata,
        Node::ModelText => V::Str(input.context.model_text),
        Node::Slot(s) => slots.get(*s).cloned().ok_or(Unsure)?,
        Node::ToolOf(s) => V::Str(call_in(slots, *s, input)?.tool),
        Node::CallIdOf(s) => V::Str(call_in(slots, *s, input)?.call_id),
        Node::ArgsOf(s) => from_json(call_in(slots, *s, input)?.args.as_ref().ok_or(Unsure)?),
        Node::Select {
            operand,
            fields,
            test: false,
        } => select(operand, fields, input, slots)?.ok_or(Unsure)?,
        Node::Select { test: true, .. }
        | Node::ArgHas(_)
        | Node::ArgMatches(..)
        | Node::Not(_)
        | Node::And(..)
        | Node::Or(..)
        | Node::NotStrictlyFalse(_)
        | Node::Eq(..)
        | Node::Ne(..)
        | Node::Compare(..)
        | Node::In(..)
        | Node::Matches(..)
        | Node::Text(..)
        | Node::Quantifier { .. } => V::Bool(test(node, input, slots)?),
        Node::Negate(a) => match eval(a, input, slots)? {
            V::Int(i) => V::Int(i.checked_neg().ok_or(Unsure)?),
            V::Double(d) => V::Double(-d),
            _ => return Err(Unsure),
        },
        Node::Cond(abc) => {
            let [c, a, b] = &**abc;
            if test(c, input, slots)? {
                eval(a, input, slots)?
            } else {
                eval(b, input, slots)?
            }
        }
        Node::Arith(op, a, b) => {
            let (a, b) = (eval(a, input, slots)?, eval(b, input, slots)?);
            // A string or list built by `+` is charged its size before it
            // is built.
            match (&a, &b) {
                (V::List(x), V::List(y)) => input.charge(x.len() + y.len())?,
                _ => {
                    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
                        input.charge(x.len() + y.len())?;
                    }
                }
            }
            arith(*op, a, b)?
        }
        Node::Index(a, b) => {
            let container = eval(a, input, slots)?;
            let index = eval(b, input, slots)?;
            index_of(&container, &index, input)?
        }
        Node::Size(a) => {
            let value = eval(a, input, slots)?;
            V::Int(i64::try_from(size(&value, input)?).map_err(|_| Unsure)?)
        }
        Node::ToString(a) => match eval(a, input, slots)? {
            s @ (V::Str(_) | V::Owned(_)) => s,
            V::Int(i) => V::Owned(Box::new(i.to_string())),
            V::Uint(u) => V::Owned(Box::new(u.to_string())),
            _ => return Err(Unsure),
        },
        Node::Transform(f, a) => match (f, eval(a, input, slots)?) {
            (Transform::Trim, V::Str(s)) => V::Str(s.trim()),
            (f, V::Str(s)) => {
                input.charge(s.len())?;
                V::Owned(Box::new(f.apply(s)))
            }
            (f, V::Owned(s)) => {
                input.charge(s.len())?;
                V::Owned(Box::new(f.apply(&s)))
            }
            _ => return Err(Unsure),
        },
        Node::List(items) => V::List(Box::new(
            items
                .iter()
                .map(|item| eval(item, input, slots))
                .collect::<Run<_>>()?,
        )),
        Node::Fold(fold) => {
            let init = eval(&fold.init, input, slots)?;
            let range = eval(&fold.range, input, slots)?;
            let is_map = match range {
                V::Json(Json::Map(_)) | V::CallMap(_) | V::Context | V::Metadata => true,
                V::Json(Json::List(_)) | V::List(_) | V::Calls => false,
                _ => return Err(Unsure),
            };
            // A map's keys come in no defined order: a list built from
            // them (`map`, `filter`) is left to the interpreter.
            if is_map && matches!(init, V::List(_)) {
                return Err(Unsure);
            }
            set(slots, fold.accu, init)?;
            let count = size(&range, input)?;
            for i in 0..count {
                if !test(&fold.cond, input, slots)? {
                    break;
                }
                let item = item_of(&range, i, input)?;
                set(slots, fold.iter, item)?;
                let accu = eval(&fold.step, input, slots)?;
                set(slots, fold.accu, accu)?;
            }
            eval(&fold.result, input, slots)?
        }
        Node::Append { accu, element } => {
            let element = eval(element, input, slots)?;
            let slot = slots.get_mut(*accu).ok_or(Unsure)?;
            let V::List(mut list) = std::mem::replace(slot, V::Null) else {
                return Err(Unsure);
            };
            list.push(element);
            V::List(list)
        }
        Node::Take(accu) => std::mem::replace(slots.get_mut(*accu).ok_or(Unsure)?, V::Null),
    })
}

/// [`eval`], with the common leaves (literal strings and ints, resolved
/// fields, field paths, slots) answered here rather than through every
/// case of `eval`.
#[inline]
fn fetch<'r>(node: &'r Node, input: &Input<'r, 'r>, slots: &mut [V<'r>]) -> Run<V<'r>> {
    match node {
        Node::Str(s) => Ok(V::Str(s)),
        Node::Int(i) => Ok(V::Int(*i)),
        Node::Arg(field) => Ok(from_json(args(input)?.get(field)?.ok_or(Unsure)?)),
        Node::Args => Ok(from_json(this_call(input)?.args.as_ref().ok_or(Unsure)?)),
        Node::Tool => Ok(V::Str(this_call(input)?.tool)),
        Node::Metadata => Ok(V::Metadata),
        Node::Slot(s) => slots.get(*s).cloned().ok_or(Unsure),
        Node::ToolOf(s) => Ok(V::Str(call_in(slots, *s, input)?.tool)),
        Node::ArgsOf(s) => Ok(from_json(
            call_in(slots, *s, input)?.args.as_ref().ok_or(Unsure)?,
        )),
        Node::Select {
            operand,
            fields,
            test: false,
        } => select(operand, fields, input, slots)?.ok_or(Unsure),
        _ => eval(node, input, slots),
    }
}

/// [`eval`] of a node that must be a bool, without building values where
/// it can: the logical operators, tests and comparisons answer here.
fn test<'r>(node: &'r Node, input: &Input<'r, 'r>, slots: &mut [V<'r>]) -> Run<bool> {
    input.charge(1)?;
    match node {
        Node::Bool(b) => Ok(*b),
        Node::Select {
            operand,
            fields,
            test: true,
        } => has(operand, fields, input, slots),
        Node::ArgHas(field) => Ok(args(input)?.has(field)),
        Node::ArgMatches(field, matcher) => match args(input)?.get(field)? {
            Some(Json::Str(text)) => {
                input.charge(text.len())?;
                Ok(matcher.is_match(text))
            }
            _ => Err(Unsure),
        },
        Node::Not(a) => Ok(!test(a, input, slots)?),
        Node::And(a, b) => Ok(test(a, input, slots)? && test(b, input, slots)?),
        Node::Or(a, b) => Ok(test(a, input, slots)? || test(b, input, slots)?),
        Node::Cond(abc) => {
            let [c, a, b] = &**abc;
            if test(c, input, slots)? {
                test(a, input, slots)
            } else {
                test(b, input, slots)
            }
        }
        Node::NotStrictlyFalse(a) => test(a, input, slots),
        Node::Eq(a, b) => equals(&fetch(a, input, slots)?, &fetch(b, input, slots)?),
        Node::Ne(a, b) => Ok(!equals(&fetch(a, input, slots)?, &fetch(b, input, slots)?)?),
        Node::Compare(op, a, b) => {
            if let (Node::Size(a), Node::Int(k)) = (&**a, &**b) {
                return size_compare(*op, fetch(a, input, slots)?, *k, input);
            }
            let ordering = compare(&fetch(a, input, slots)?, &fetch(b, input, slots)?)?;
            Ok(op.holds(ordering))
        }
        Node::In(a, b) => {
            let needle = fetch(a, input, slots)?;
            if let Node::List(items) = &**b
                && items.iter().all(is_literal)
            {
                // A list of literals written in the rule (`x in ['a', 'b']`):
                // compared item by item, not built as a list first (no item
                // can fail, so stopping at the first equal one is safe).
                for item in items {
                    if equals(&fetch(item, input, slots)?, &needle)? {
                        return Ok(true);
                    }
                }
                return Ok(false);
            }
            let haystack = fetch(b, input, slots)?;
            contains(&haystack, &needle, input)
        }
        Node::Matches(text, pattern) => {
            let text = fetch(text, input, slots)?;
            let text = text.as_str().ok_or(Unsure)?;
            input.charge(text.len())?;
            match pattern {
                Pattern::Fixed(matcher) => Ok(matcher.is_match(text)),
                Pattern::Computed(p) => {
                    let p = fetch(p, input, slots)?;
                    let regex =
                        super::patterns::lookup(p.as_str().ok_or(Unsure)?).map_err(|_| Unsure)?;
                    Ok(regex.is_match(text))
                }
            }
        }
        Node::Text(how, a, b) => {
            let (a, b) = (fetch(a, input, slots)?, fetch(b, input, slots)?);
            let (Some(a), Some(b)) = (a.as_str(), b.as_str()) else {
                return Err(Unsure);
            };
            input.charge(a.len())?;
            Ok(match how {
                TextTest::StartsWith => a.starts_with(b),
                TextTest::EndsWith => a.ends_with(b),
                TextTest::Contains => a.contains(b),
            })
        }
        Node::Quantifier {
            any,
            range,
            iter,
            pred,
        } => {
            let range = fetch(range, input, slots)?;
            if let (V::Json(Json::Map(object)), Node::Matches(text, Pattern::Fixed(matcher))) =
                (&range, &**pred)
                && matches!(**text, Node::Slot(s) if s == *iter)
            {
                // `object.exists(k, k.matches(r'...'))`: the keys as they
                // are, no slot set.
                for i in 0..object.len() {
                    let key = object.key(i).ok_or(Unsure)?;
                    input.charge(1 + key.len())?;
                    if matcher.is_match(key) == *any {
                        return Ok(*any);
                    }
                }
                return Ok(!*any);
            }
            if !matches!(
                range,
                V::Json(Json::Map(_) | Json::List(_))
                    | V::CallMap(_)
                    | V::Context
                    | V::Metadata
                    | V::List(_)
                    | V::Calls
            ) {
                return Err(Unsure);
            }
            for i in 0..size(&range, input)? {
                set(slots, *iter, item_of(&range, i, input)?)?;
                if test(pred, input, slots)? == *any {
                    return Ok(*any);
                }
            }
            Ok(!*any)
        }
        _ => match eval(node, input, slots)? {
            V::Bool(b) => Ok(b),
            _ => Err(Unsure),
        },
    }
}

impl Compare {
    fn holds(self, ordering: Ordering) -> bool {
        match self {
            Compare::Less => ordering == Ordering::Less,
            Compare::LessEquals => ordering != Ordering::Greater,
            Compare::Greater => ordering == Ordering::Greater,
            Compare::GreaterEquals => ordering != Ordering::Less,
        }
    }
}

/// `size(value) op k`. A string's size, its characters, is between a
/// quarter of its bytes and its bytes: when those bounds decide, the
/// characters are not counted.
fn size_compare(op: Compare, value: V<'_>, k: i64, input: &Input<'_, '_>) -> Run<bool> {
    let count = |n: usize| i64::try_from(n).map_err(|_| Unsure);
    if let Some(s) = value.as_str() {
        let (low, high) = (count(s.len().div_ceil(4))?, count(s.len())?);
        let (low, high) = (op.holds(low.cmp(&k)), op.holds(high.cmp(&k)));
        if low == high {
            // Every comparison holds on an interval of sizes: at both
            // ends, in between.
            return Ok(low);
        }
        return Ok(op.holds(count(s.chars().count())?.cmp(&k)));
    }
    Ok(op.holds(count(size(&value, input)?)?.cmp(&k)))
}

fn this_call<'r>(input: &Input<'r, 'r>) -> Run<&'r FastCall<'r>> {
    input.calls.get(input.call).ok_or(Unsure)
}

/// The call macro variable `slot` holds (it ranges over `calls`).
fn call_in<'r>(slots: &[V<'r>], slot: usize, input: &Input<'r, 'r>) -> Run<&'r FastCall<'r>> {
    match slots.get(slot) {
        Some(V::CallMap(i)) => input.calls.get(*i).ok_or(Unsure),
        _ => Err(Unsure),
    }
}

/// This call's arguments as an object: `Unsure` when they are only for the
/// interpreter, or not an object (a member of them is then an error).
fn args<'r>(input: &Input<'r, 'r>) -> Run<&'r Object<'r>> {
    match this_call(input)?.args.as_ref() {
        Some(Json::Map(object)) => Ok(object),
        _ => Err(Unsure),
    }
}

/// `operand.f1.f2...`: `None` when the last field is missing; `Unsure`
/// when another is, or a value is not a map.
fn select<'r>(
    operand: &'r Node,
    fields: &'r [String],
    input: &Input<'r, 'r>,
    slots: &mut [V<'r>],
) -> Run<Option<V<'r>>> {
    let (last, path) = fields.split_last().ok_or(Unsure)?;
    let mut value = fetch(operand, input, slots)?;
    if let V::Json(json) = value {
        return Ok(member(json, path, last)?.map(from_json));
    }
    for field in path {
        value = field_of(&value, field, input)?.ok_or(Unsure)?;
    }
    field_of(&value, last, input)
}

/// `has(operand.f1.f2...)`: [`select`] without the value.
fn has<'r>(
    operand: &'r Node,
    fields: &'r [String],
    input: &Input<'r, 'r>,
    slots: &mut [V<'r>],
) -> Run<bool> {
    let (last, path) = fields.split_last().ok_or(Unsure)?;
    let mut value = fetch(operand, input, slots)?;
    if let V::Json(json) = value {
        return Ok(parent(json, path)?.has(last));
    }
    for field in path {
        value = field_of(&value, field, input)?.ok_or(Unsure)?;
    }
    Ok(field_of(&value, last, input)?.is_some())
}

/// Member `path...last` of arguments, from JSON to JSON with no value in
/// between: `None` when the last is missing, `Unsure` when another is or a
/// value is not an object.
fn member<'r>(json: &'r Json<'r>, path: &[String], last: &str) -> Run<Option<&'r Json<'r>>> {
    Ok(parent(json, path)?.get(last)?)
}

/// The object at `path` of arguments: `Unsure` when a member on the way is
/// missing or a value is not an object.
fn parent<'r>(json: &'r Json<'r>, path: &[String]) -> Run<&'r Object<'r>> {
    let mut json = json;
    for field in path {
        let Json::Map(object) = json else {
            return Err(Unsure);
        };
        json = object.get(field)?.ok_or(Unsure)?;
    }
    let Json::Map(object) = json else {
        return Err(Unsure);
    };
    Ok(object)
}

/// A member of the arguments that did not parse: the interpreter judges.
impl From<Unparsed> for Unsure {
    fn from(Unparsed: Unparsed) -> Self {
        Unsure
    }
}

fn set<'r>(slots: &mut [V<'r>], slot: usize, value: V<'r>) -> Run<()> {
    *slots.get_mut(slot).ok_or(Unsure)? = value;
    Ok(())
}

impl V<'_> {
    fn as_str(&self) -> Option<&str> {
        match self {
            V::Str(s) => Some(s),
            V::Owned(s) => Some(s.as_str()),
            _ => None,
        }
    }
}

/// A scalar from JSON, or the JSON list or object itself.
fn from_json<'r>(json: &'r Json<'r>) -> V<'r> {
    match json {
        Json::Null => V::Null,
        Json::Bool(b) => V::Bool(*b),
        Json::Int(i) => V::Int(*i),
        Json::Uint(u) => V::Uint(*u),
        Json::Double(d) => V::Double(*d),
        Json::Str(s) => V::Str(s),
        Json::List(_) | Json::Map(_) => V::Json(json),
    }
}

const CALL_FIELDS: [&str; 3] = ["call_id", "tool", "args"];
const CONTEXT_FIELDS: [&str; 4] = ["session_id", "turn_index", "model_text", "metadata"];

/// `value.field`: `Some` if the map has it, `None` if it does not,
/// `Unsure` when `value` is not a map.
fn field_of<'r>(value: &V<'r>, field: &str, input: &Input<'r, 'r>) -> Run<Option<V<'r>>> {
    Ok(match value {
        V::Json(Json::Map(object)) => object.get(field)?.map(from_json),
        V::CallMap(i) => {
            let call = input.calls.get(*i).ok_or(Unsure)?;
            match field {
                "call_id" => Some(V::Str(call.call_id)),
                "tool" => Some(V::Str(call.tool)),
                "args" => Some(from_json(call.args.as_ref().ok_or(Unsure)?)),
                _ => None,
            }
        }
        V::Context => {
            let context = input.context;
            match field {
                "session_id" => Some(V::Str(context.session_id)),
                "turn_index" => Some(V::Int(i64::from(context.turn_index))),
                "model_text" => Some(V::Str(context.model_text)),
                "metadata" => Some(V::Metadata),
                _ => None,
            }
        }
        V::Metadata => input
            .context
            .metadata
            .iter()
            .find(|(k, _)| *k == field)
            .map(|(_, v)| V::Str(v)),
        _ => return Err(Unsure),
    })
}

/// The items of a list, or the keys of a map.
fn size(value: &V<'_>, input: &Input<'_, '_>) -> Run<usize> {
    Ok(match value {
        V::Str(s) => s.chars().count(),
        V::Owned(s) => s.chars().count(),
        V::Json(Json::List(items)) => items.len(),
        V::Json(Json::Map(object)) => object.len(),
        V::List(items) => items.len(),
        V::Calls => input.calls.len(),
        V::CallMap(_) => CALL_FIELDS.len(),
        V::Context => CONTEXT_FIELDS.len(),
        V::Metadata => input.context.metadata.len(),
        _ => return Err(Unsure),
    })
}

/// Item `i` of a list, or key `i` of a map, as a macro iterates them.
fn item_of<'r>(value: &V<'r>, i: usize, input: &Input<'r, 'r>) -> Run<V<'r>> {
    let key = |k: &'r str| V::Str(k);
    Ok(match value {
        V::Json(Json::List(items)) => from_json(items.get(i).ok_or(Unsure)?),
        V::Json(Json::Map(object)) => V::Str(object.key(i).ok_or(Unsure)?),
        V::List(items) => items.get(i).cloned().ok_or(Unsure)?,
        V::Calls if i < input.calls.len() => V::CallMap(i),
        V::CallMap(_) => key(CALL_FIELDS.get(i).ok_or(Unsure)?),
        V::Context => key(CONTEXT_FIELDS.get(i).ok_or(Unsure)?),
        V::Metadata => key(input.context.metadata.get(i).ok_or(Unsure)?.0),
        _ => return Err(Unsure),
    })
}

fn index_of<'r>(container: &V<'r>, index: &V<'r>, input: &Input<'r, 'r>) -> Run<V<'r>> {
    match (container, index) {
        (V::Json(Json::List(_)) | V::List(_) | V::Calls, V::Int(i)) => {
            let i = usize::try_from(*i).map_err(|_| Unsure)?;
            if i >= size(container, input)? {
                return Err(Unsure);
            }
            item_of(container, i, input)
        }
        (V::Json(Json::Map(_)) | V::CallMap(_) | V::Context | V::Metadata, key) => {
            field_of(container, key.as_str().ok_or(Unsure)?, input)?.ok_or(Unsure)
        }
        _ => Err(Unsure),
    }
}

/// `needle in haystack`: a list holding an equal scalar, or a map with
/// that string key.
/// Whether `node` is a literal (its value cannot fail).
fn is_literal(node: &Node) -> bool {
    matches!(
        node,
        Node::Null | Node::Bool(_) | Node::Int(_) | Node::Uint(_) | Node::Double(_) | Node::Str(_)
    )
}

fn contains(haystack: &V<'_>, needle: &V<'_>, input: &Input<'_, '_>) -> Run<bool> {
    match haystack {
        V::Json(Json::List(items)) => {
            input.charge(items.len())?;
            for item in items {
                if equals(&from_json(item), needle)? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        V::List(items) => {
            input.charge(items.len())?;
            for item in items.iter() {
                if equals(item, needle)? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        V::Json(Json::Map(_)) | V::CallMap(_) | V::Context | V::Metadata => {
            let key = needle.as_str().ok_or(Unsure)?;
            Ok(match haystack {
                V::Json(Json::Map(object)) => object.has(key),
                V::CallMap(_) => CALL_FIELDS.contains(&key),
                V::Context => CONTEXT_FIELDS.contains(&key),
                _ => input.context.metadata.iter().any(|(k, _)| *k == key),
            })
        }
        _ => Err(Unsure),
    }
}

/// CEL's `==` between scalars (the interpreter's: numbers compare across
/// `int`, `uint` and `double`; other kinds differ from each other).
/// `Unsure` for lists and maps, and NaN.
fn equals(a: &V<'_>, b: &V<'_>) -> Run<bool> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        return Ok(x == y);
    }
    if !is_scalar(a) || !is_scalar(b) {
        return Err(Unsure);
    }
    Ok(match (a, b) {
        (V::Null, V::Null) => true,
        (V::Bool(x), V::Bool(y)) => x == y,
        (V::Int(_) | V::Uint(_) | V::Double(_), V::Int(_) | V::Uint(_) | V::Double(_)) => {
            match compare(a, b) {
                Ok(ordering) => ordering == Ordering::Equal,
                Err(Unsure) => return Err(Unsure),
            }
        }
        _ => false,
    })
}

fn is_scalar(v: &V<'_>) -> bool {
    matches!(
        v,
        V::Null | V::Bool(_) | V::Int(_) | V::Uint(_) | V::Double(_) | V::Str(_) | V::Owned(_)
    )
}

/// CEL's ordering of numbers and of strings; `Unsure` otherwise (and for
/// NaN).
fn compare(a: &V<'_>, b: &V<'_>) -> Run<Ordering> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        return Ok(x.cmp(y));
    }
    let float = |x: f64, y: f64| x.partial_cmp(&y).ok_or(Unsure);
    #[allow(clippy::cast_precision_loss)]
    match (a, b) {
        (V::Int(x), V::Int(y)) => Ok(x.cmp(y)),
        (V::Uint(x), V::Uint(y)) => Ok(x.cmp(y)),
        (V::Double(x), V::Double(y)) => float(*x, *y),
        (V::Int(x), V::Double(y)) => float(*x as f64, *y),
        (V::Double(x), V::Int(y)) => float(*x, *y as f64),
        (V::Uint(x), V::Double(y)) => float(*x as f64, *y),
        (V::Double(x), V::Uint(y)) => float(*x, *y as f64),
        (V::Int(x), V::Uint(y)) => Ok(u64::try_from(*x).map_or(Ordering::Less, |x| x.cmp(y))),
        (V::Uint(x), V::Int(y)) => Ok(u64::try_from(*y).map_or(Ordering::Greater, |y| x.cmp(&y))),
        _ => Err(Unsure),
    }
}

fn arith<'r>(op: Arith, a: V<'r>, b: V<'r>) -> Run<V<'r>> {
    Ok(match (op, a, b) {
        (Arith::Add, V::Int(x), V::Int(y)) => V::Int(x.checked_add(y).ok_or(Unsure)?),
        (Arith::Sub, V::Int(x), V::Int(y)) => V::Int(x.checked_sub(y).ok_or(Unsure)?),
        (Arith::Mul, V::Int(x), V::Int(y)) => V::Int(x.checked_mul(y).ok_or(Unsure)?),
        (Arith::Add, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_add(y).ok_or(Unsure)?),
        (Arith::Sub, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_sub(y).ok_or(Unsure)?),
        (Arith::Mul, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_mul(y).ok_or(Unsure)?),
        (Arith::Add, V::Double(x), V::Double(y)) => V::Double(x + y),
        (Arith::Sub, V::Double(x), V::Double(y)) => V::Double(x - y),
        (Arith::Mul, V::Double(x), V::Double(y)) => V::Double(x * y),
        (Arith::Add, V::List(mut x), V::List(y)) => {
            x.extend(*y);
            V::List(x)
        }
        (Arith::Add, x, y) => {
            let (Some(_), Some(tail)) = (x.as_str(), y.as_str()) else {
                return Err(Unsure);
            };
            let mut s = match x {
                V::Owned(s) => *s,
                x => x.as_str().ok_or(Unsure)?.to_owned(),
            };
            s.push_str(tail);
            V::Owned(Box::new(s))
        }
        _ => return Err(Unsure),
    })
}
