//! One CEL expression of a rule, compiled and checked: its size, how deeply
//! its macros nest, the variables it uses, and its estimated [`Cost`].

use cel::common::ast::{EntryExpr, Expr, IdedExpr, LiteralValue};
use cel::{Env, Program};

use super::cost::{Cost, Limits};
use super::error::{CompileErrorKind, Field};
use super::functions::{Form, Functions};

/// The variables every expression may use (see `input`).
pub(crate) const VARIABLES: [&str; 5] = ["call", "calls", "context", "session", "identity"];

/// Identifiers that name CEL types or namespaces, not variables.
const TYPE_NAMES: [&str; 13] = [
    "bool",
    "bytes",
    "double",
    "dyn",
    "int",
    "list",
    "map",
    "null_type",
    "optional",
    "shell",
    "string",
    "type",
    "uint",
];

/// Operators that may walk a whole list or map each time they run.
const LINEAR_OPERATORS: [&str; 4] = ["_==_", "_!=_", "@in", "_+_"];

/// A compiled expression.
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) program: Program,
    pub(crate) cost: Cost,
    /// Whether it reads `calls`, the whole batch: its cost is then
    /// estimated at the batch's `n`, not the call's.
    pub(crate) reads_calls: bool,
    /// Whether it names `session` (R34): its batches read session memory.
    pub(crate) reads_session: bool,
    /// Whether it names `identity` (R34): its batches read the memory of
    /// the caller's identity too.
    pub(crate) reads_identity: bool,
}

/// A refused expression: why, and on which line of the expression (from 1).
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) line: usize,
    pub(crate) kind: CompileErrorKind,
}

/// Compiles `source`, the `field` of a rule, within `limits`.
/// For a `message` that does not compile and reads as plain text (it
/// starts with no quote): how to write text in a CEL expression.
fn plain_text_hint(field: Field, source: &str) -> String {
    let text = source.trim();
    if field != Field::Message || text.starts_with(['"', '\'']) {
        return String::new();
    }
    let quoted = text.replace('\\', "\\\\").replace('"', "\\\"");
    format!(
        "; `message` is a CEL expression: plain text must be a CEL string, quoted inside \
         the TOML one: message = '\"{quoted}\"'"
    )
}

pub(crate) fn compile(
    env: &Env,
    functions: &mut Functions,
    field: Field,
    source: &str,
    limits: &Limits,
) -> Result<Compiled, Refused> {
    if source.len() > limits.max_expression_bytes {
        return Err(Refused {
            line: 1,
            kind: CompileErrorKind::TooLong {
                field,
                bytes: source.len(),
                limit: limits.max_expression_bytes,
            },
        });
    }
    let program = env.compile(source).map_err(|errors| {
        let first = errors.errors.first();
        Refused {
            line: first.map_or(1, |e| usize::try_from(e.pos.0).unwrap_or(1).max(1)),
            kind: CompileErrorKind::Syntax {
                field,
                reason: format!(
                    "{}{}",
                    first.map_or_else(|| errors.to_string(), |e| e.msg.clone()),
                    plain_text_hint(field, source)
                ),
            },
        }
    })?;
    let mut walk = Walk {
        field,
        limits,
        scope: Vec::new(),
        nodes: 0,
        deepest: 0,
        cost: Cost::default(),
        unknown: None,
        functions,
        unknown_function: None,
        wrong_count: None,
        bad_regex: None,
        reads_calls: false,
        reads_session: false,
        reads_identity: false,
    };
    walk.expr(program.expression(), 0);
    let line_of = |id: u64| {
        program
            .source_info()
            .offset_for(id)
            .map_or(1, |(start, _)| {
                source
                    .chars()
                    .take(start as usize)
                    .filter(|c| *c == '\n')
                    .count()
                    + 1
            })
    };
    let too_large = if walk.nodes > limits.max_expression_nodes {
        Some(CompileErrorKind::TooBig {
            field,
            nodes: walk.nodes,
            limit: limits.max_expression_nodes,
        })
    } else if walk.deepest > limits.max_nesting {
        Some(CompileErrorKind::TooDeep {
            field,
            depth: walk.deepest,
            limit: limits.max_nesting,
        })
    } else {
        None
    };
    if let Some(kind) = too_large {
        return Err(Refused { line: 1, kind });
    }
    if let Some((id, kind)) = walk.bad_regex {
        return Err(Refused {
            line: line_of(id),
            kind,
        });
    }
    if let Some((id, name, got, takes, member)) = walk.wrong_count {
        return Err(Refused {
            line: line_of(id),
            kind: CompileErrorKind::ArgumentCount {
                field,
                name,
                got,
                takes: takes
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" or "),
                member,
            },
        });
    }
    if let Some((id, name)) = walk.unknown {
        return Err(Refused {
            line: line_of(id),
            kind: CompileErrorKind::UnknownVariable { field, name },
        });
    }
    if let Some((id, name, suggestion)) = walk.unknown_function {
        let kind = if super::functions::MACROS.contains(&name.as_str()) {
            CompileErrorKind::MacroArguments { field, name }
        } else {
            CompileErrorKind::UnknownFunction {
                field,
                name,
                suggestion: suggestion.map(str::to_owned),
            }
        };
        return Err(Refused {
            line: line_of(id),
            kind,
        });
    }
    Ok(Compiled {
        cost: walk.cost,
        reads_calls: walk.reads_calls,
        reads_session: walk.reads_session,
        reads_identity: walk.reads_identity,
        program,
    })
}

/// A walk over an expression's syntax tree, macros expanded.
struct Walk<'a, 'f> {
    field: Field,
    limits: &'a Limits,
    /// The variables macros bind around the node being walked.
    scope: Vec<String>,
    nodes: usize,
    /// The deepest macro nesting seen.
    deepest: usize,
    cost: Cost,
    /// The first unknown identifier, and its node.
    unknown: Option<(u64, String)>,
    /// The environment's functions, looked up as calls are met.
    functions: &'f mut Functions,
    /// The first call of an undeclared function, its node, and a standard
    /// name it may have been meant as.
    unknown_function: Option<(u64, String, Option<&'static str>)>,
    /// The first call of a standard function with an argument count it
    /// does not take: its node, name, count, and the counts it takes.
    wrong_count: Option<(u64, String, usize, &'static [usize], bool)>,
    /// The first `matches` pattern that does not compile, and its node.
    bad_regex: Option<(u64, CompileErrorKind)>,
    /// Whether it names `calls`.
    reads_calls: bool,
    /// Whether it names `session`.
    reads_session: bool,
    /// Whether it names `identity`.
    reads_identity: bool,
}

impl Walk<'_, '_> {
    /// Walks `node`, nested in `depth` macros.
    fn expr(&mut self, node: &IdedExpr, depth: usize) {
        self.nodes += 1;
        if self.nodes > self.limits.max_expression_nodes {
            return;
        }
        self.cost.add(depth, 1);
        match &node.expr {
            Expr::Ident(name) => self.ident(node.id, name),
            Expr::Call(call) => {
                if LINEAR_OPERATORS.contains(&call.func_name.as_str()) {
                    self.cost.add(depth + 1, 1);
                }
                // The pattern is `matches`' last argument in the forms that
                // take one (a wrong count is reported as such, below).
                if call.func_name == "matches"
                    && call.args.len() == if call.target.is_some() { 1 } else { 2 }
                {
                    self.pattern(node.id, call.args.last());
                }
                self.function(
                    node.id,
                    &call.func_name,
                    call.target.as_deref(),
                    call.args.len(),
                );
                if let Some(target) = &call.target {
                    self.expr(target, depth);
                }
                for arg in &call.args {
                    self.expr(arg, depth);
                }
            }
            Expr::Select(select) => self.expr(&select.operand, depth),
            Expr::List(list) => {
                for element in &list.elements {
                    self.expr(element, depth);
                }
            }
            Expr::Map(map) => {
                for entry in &map.entries {
                    if let EntryExpr::MapEntry(entry) = &entry.expr {
                        self.expr(&entry.key, depth);
                        self.expr(&entry.value, depth);
                    }
                }
            }
            Expr::Struct(strct) => {
                for entry in &strct.entries {
                    if let EntryExpr::StructField(field) = &entry.expr {
                        self.expr(&field.value, depth);
                    }
                }
            }
            Expr::Comprehension(c) => {
                self.expr(&c.iter_range, depth);
                self.expr(&c.accu_init, depth);
                let bound = self.scope.len();
                self.scope.push(c.accu_var.clone());
                self.scope.push(c.iter_var.clone());
                if let Some(var) = &c.iter_var2 {
                    self.scope.push(var.clone());
                }
                self.deepest = self.deepest.max(depth + 1);
                self.expr(&c.loop_cond, depth + 1);
                self.expr(&c.loop_step, depth + 1);
                self.scope.truncate(bound + 1);
                self.expr(&c.result, depth);
                self.scope.truncate(bound);
            }
            Expr::Literal(_) | Expr::Unspecified => {}
        }
    }

    /// Compiles a `matches` pattern written as a string literal.
    fn pattern(&mut self, id: u64, pattern: Option<&IdedExpr>) {
        let Some(IdedExpr {
            expr: Expr::Literal(LiteralValue::String(pattern)),
            ..
        }) = pattern
        else {
            return;
        };
        if let Err(reason) = super::patterns::precompile(pattern.inner()) {
            self.bad_regex.get_or_insert((
                id,
                CompileErrorKind::BadRegex {
                    field: self.field,
                    pattern: pattern.inner().to_owned(),
                    reason: reason.to_string(),
                },
            ));
        }
    }

    /// Checks that a call of `name` on `target` (none: a global call)
    /// names a declared function.
    fn function(&mut self, id: u64, name: &str, target: Option<&IdedExpr>, args: usize) {
        if self.unknown_function.is_some() {
            return;
        }
        let form = match target.map(|t| &t.expr) {
            None => Form::Global,
            // `optional.of(x)`: a namespace, not a value, unless a macro
            // bound the name.
            Some(Expr::Ident(ns))
                if TYPE_NAMES.contains(&ns.as_str()) && !self.scope.iter().any(|b| b == ns) =>
            {
                Form::Namespaced(ns)
            }
            Some(_) => Form::Member,
        };
        if !self.functions.declares(name, form) {
            let suggestion = self.functions.suggestion(name, form);
            self.unknown_function = Some((id, name.to_owned(), suggestion));
        } else if let Some(counts) = super::functions::arity(name, form)
            && !counts.contains(&args)
        {
            let member = !matches!(form, Form::Global);
            self.wrong_count
                .get_or_insert((id, name.to_owned(), args, counts, member));
        }
    }

    fn ident(&mut self, id: u64, name: &str) {
        if self.scope.iter().any(|bound| bound == name) {
            return;
        }
        if name == "calls" {
            self.reads_calls = true;
        }
        if name == "session" {
            self.reads_session = true;
        }
        if name == "identity" {
            self.reads_identity = true;
        }
        if !VARIABLES.contains(&name) && !TYPE_NAMES.contains(&name) && self.unknown.is_none() {
            self.unknown = Some((id, name.to_owned()));
        }
    }
}
