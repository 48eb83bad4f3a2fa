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
//!
//! * this file: a [`Plan`], the nodes it is made of, and what a plan
//!   answers;
//! * `planner`: a syntax tree compiled into nodes;
//! * `eval`: a plan evaluated over one call, giving up wherever the
//!   interpreter must decide;
//! * `value`: what a plan reads ([`Input`]) and the values it computes
//!   with: fields, items, CEL's equality, ordering and arithmetic;
//! * `text`: the string functions (case, `trim`, `startsWith`, `endsWith`,
//!   `contains`) and `matches`, with its check of a few words without the
//!   regex engine;
//! * `tests`: the fast path against the interpreter.

mod eval;
mod planner;
mod text;
mod value;

#[cfg(test)]
mod tests;

use std::cmp::Ordering;

use cel::common::ast::IdedExpr;

use super::json::Unparsed;
use planner::Planner;
use text::{Matcher, Pattern, TextTest, Transform};
use value::V;

pub(crate) use value::{FastCall, FastContext, Input};

/// The fast path gave up: the interpreter decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unsure;

type Run<T> = Result<T, Unsure>;

/// A member of the arguments that did not parse: the interpreter judges.
impl From<Unparsed> for Unsure {
    fn from(Unparsed: Unparsed) -> Self {
        Unsure
    }
}

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
    /// `shell.has_flags(x, 'program', ['flag', ...])`, program and flags
    /// written in the policy.
    HasFlags(Box<Node>, Box<(String, Vec<String>)>),
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

impl Plan {
    /// Plans `expr`, or `None` when it uses something the fast path does
    /// not cover (the interpreter alone evaluates it then).
    pub(crate) fn new(expr: &IdedExpr) -> Option<Plan> {
        let mut planner = Planner::new();
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
        self.run(input, eval::test)
    }

    /// Evaluates to a string; `Unsure` for anything else.
    pub(crate) fn string(&self, input: &Input<'_, '_>) -> Run<String> {
        match self.run(input, eval::eval)? {
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
        | Node::HasFlags(a, _)
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

/// Whether `node` is a literal (its value cannot fail).
fn is_literal(node: &Node) -> bool {
    matches!(
        node,
        Node::Null | Node::Bool(_) | Node::Int(_) | Node::Uint(_) | Node::Double(_) | Node::Str(_)
    )
}
