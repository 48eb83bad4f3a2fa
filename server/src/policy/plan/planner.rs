//! Planning: a CEL syntax tree compiled once into a [`Plan`]'s nodes, or
//! refused when it uses something the fast path does not cover.

use cel::common::ast::{Expr, IdedExpr, LiteralValue, operators};

use super::{Arith, Compare, Fold, Matcher, Node, Pattern, TextTest, Transform, reads};

/// Compiles syntax trees into nodes.
pub(super) struct Planner {
    /// The names macros bind around the node being planned, and their slots.
    scope: Vec<(String, usize)>,
    /// The slots of macro variables that range over `calls`.
    call_slots: Vec<usize>,
    pub(super) slots: usize,
    pub(super) reads_call: bool,
}

impl Planner {
    pub(super) fn new() -> Planner {
        Planner {
            scope: Vec::new(),
            slots: 0,
            reads_call: false,
            call_slots: Vec::new(),
        }
    }

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

    /// The node `make` builds of the one operand in `args`.
    fn unary(&mut self, args: &[IdedExpr], make: fn(Box<Node>) -> Node) -> Option<Node> {
        let [a] = self.nodes(args)?;
        Some(make(a))
    }

    /// The node `make` builds of the two operands in `args`.
    fn binary(
        &mut self,
        args: &[IdedExpr],
        make: fn(Box<Node>, Box<Node>) -> Node,
    ) -> Option<Node> {
        let [a, b] = self.nodes(args)?;
        Some(make(a, b))
    }

    pub(super) fn node(&mut self, expr: &IdedExpr) -> Option<Node> {
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

    /// `shell.has_flags(x, 'program', ['flag', ...])` with the program and
    /// flags written as literals (the interpreter judges the other forms,
    /// and reports their errors).
    fn shell(&mut self, name: &str, args: &[IdedExpr]) -> Option<Node> {
        let ("has_flags", [text, program, flags]) = (name, args) else {
            return None;
        };
        let literal = |e: &IdedExpr| match &e.expr {
            Expr::Literal(LiteralValue::String(s))
                if !s.inner().trim_start_matches('-').is_empty() =>
            {
                Some(s.inner().to_owned())
            }
            _ => None,
        };
        let program = literal(program)?;
        let Expr::List(list) = &flags.expr else {
            return None;
        };
        if !list.optional_indices.is_empty() {
            return None;
        }
        let flags = list
            .elements
            .iter()
            .map(literal)
            .collect::<Option<Vec<_>>>()?;
        let text = self.node(text)?;
        Some(Node::HasFlags(Box::new(text), Box::new((program, flags))))
    }

    fn call(&mut self, name: &str, target: Option<&IdedExpr>, args: &[IdedExpr]) -> Option<Node> {
        use operators as op;
        if let Some(IdedExpr {
            expr: Expr::Ident(ns),
            ..
        }) = target
            && ns == "shell"
            && self.scope.iter().all(|(n, _)| n != ns)
        {
            return self.shell(name, args);
        }
        if let Some(target) = target {
            let target = Box::new(self.node(target)?);
            return match (name, args) {
                ("size", []) => Some(Node::Size(target)),
                ("lowerAscii", []) => Some(Node::Transform(Transform::Lower, target)),
                ("upperAscii", []) => Some(Node::Transform(Transform::Upper, target)),
                ("trim", []) => Some(Node::Transform(Transform::Trim, target)),
                ("matches", [pattern]) => Some(text_matches(*target, self.pattern(pattern)?)),
                ("startsWith" | "endsWith" | "contains", [arg]) => {
                    let how = match name {
                        "startsWith" => TextTest::StartsWith,
                        "endsWith" => TextTest::EndsWith,
                        _ => TextTest::Contains,
                    };
                    Some(Node::Text(how, target, Box::new(self.node(arg)?)))
                }
                _ => None,
            };
        }
        Some(match name {
            op::LOGICAL_AND => self.binary(args, Node::And)?,
            op::LOGICAL_OR => self.binary(args, Node::Or)?,
            op::LOGICAL_NOT => self.unary(args, Node::Not)?,
            op::NEGATE => self.unary(args, Node::Negate)?,
            op::NOT_STRICTLY_FALSE => self.unary(args, Node::NotStrictlyFalse)?,
            op::CONDITIONAL => {
                let [c, a, b] = self.nodes(args)?;
                Node::Cond(Box::new([*c, *a, *b]))
            }
            op::EQUALS => self.binary(args, Node::Eq)?,
            op::NOT_EQUALS => self.binary(args, Node::Ne)?,
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
            op::IN => self.binary(args, Node::In)?,
            op::INDEX => self.binary(args, Node::Index)?,
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
            let regex = match crate::policy::patterns::cached(text) {
                Some(regex) => regex,
                None => crate::policy::patterns::lookup(text).ok()?,
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
