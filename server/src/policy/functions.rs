//! Which functions a rule may call.
//!
//! The CEL parser accepts a call to any name: `call.tool.startswith('x')`
//! parses, and fails only when evaluated, on every call, as a failure of
//! the guard (R13). Under a failure policy that lets calls through, a typo
//! would then let everything through unjudged; so a call the environment
//! does not declare is refused when the policy compiles, with the line,
//! like an unknown variable (R27).
//!
//! The environment is asked rather than listed here: each name is looked
//! up by evaluating an argument-less call of the same form (`f()`,
//! `0.f()`, or `ns.f()` for a namespace) in an empty activation, where the
//! interpreter reports an undeclared function (or namespace) as an
//! undeclared reference, and a declared one as having no overload for
//! those arguments. So the check follows whatever
//! the `cel` crate and the mesh (`matches`) declare.

use std::sync::Arc;

use cel::{Context, Env, ExecutionError};

/// Standard names offered when a call differs from one only by case. The
/// macros are expanded by the parser, so they are not looked up.
const STANDARD: [&str; 13] = [
    "size",
    "contains",
    "startsWith",
    "endsWith",
    "matches",
    "lowerAscii",
    "upperAscii",
    "trim",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
];
pub(crate) const MACROS: [&str; 6] = ["has", "all", "exists", "exists_one", "map", "filter"];

/// How many arguments the standard functions take, by name and form (the
/// receiver of a member call not counted). The interpreter fails a call
/// with any other count on every evaluation, as it fails an undeclared one,
/// so the count is checked when the policy compiles too. A test evaluates
/// every entry with its count and with one more, against the environment.
/// Names not listed are not counted.
const ARITIES: [(&str, Form<'static>, &[usize]); 27] = [
    ("size", Form::Global, &[1]),
    ("int", Form::Global, &[1]),
    ("uint", Form::Global, &[1]),
    ("double", Form::Global, &[1]),
    ("string", Form::Global, &[1]),
    ("bytes", Form::Global, &[1]),
    ("bool", Form::Global, &[1]),
    ("type", Form::Global, &[1]),
    ("dyn", Form::Global, &[1]),
    ("matches", Form::Global, &[2]),
    ("size", Form::Member, &[0]),
    ("contains", Form::Member, &[1]),
    ("startsWith", Form::Member, &[1]),
    ("endsWith", Form::Member, &[1]),
    ("matches", Form::Member, &[1]),
    ("lowerAscii", Form::Member, &[0]),
    ("upperAscii", Form::Member, &[0]),
    ("trim", Form::Member, &[0]),
    ("hasValue", Form::Member, &[0]),
    ("value", Form::Member, &[0]),
    ("orValue", Form::Member, &[1]),
    ("or", Form::Member, &[1]),
    ("of", Form::Namespaced("optional"), &[1]),
    ("none", Form::Namespaced("optional"), &[0]),
    ("ofNonZeroValue", Form::Namespaced("optional"), &[1]),
    ("commands", Form::Namespaced("shell"), &[1]),
    ("has_flags", Form::Namespaced("shell"), &[3]),
];

/// The argument counts a standard function takes in `form`, if listed.
pub(crate) fn arity(name: &str, form: Form<'_>) -> Option<&'static [usize]> {
    let name = name.strip_prefix('.').unwrap_or(name);
    ARITIES
        .iter()
        .find(|(n, f, _)| *n == name && *f == form)
        .map(|(_, _, counts)| *counts)
}

/// How a function is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form<'a> {
    /// `f(x)`.
    Global,
    /// `x.f(y)`.
    Member,
    /// `ns.f(x)`, with `ns` a namespace such as `optional`.
    Namespaced(&'a str),
}

/// The functions of one environment, each looked up once.
pub(crate) struct Functions {
    env: Arc<Env>,
    seen: Vec<(String, Option<String>, bool)>,
}

impl Functions {
    pub(crate) fn new(env: Arc<Env>) -> Self {
        Self {
            env,
            seen: Vec::new(),
        }
    }

    /// Whether a call of `name` in `form` names a declared function (or is
    /// an operator, which the parser names with symbols).
    pub(crate) fn declares(&mut self, name: &str, form: Form<'_>) -> bool {
        // `.f(x)` names `f` from the root (the parser keeps the dot; the
        // interpreter resolves it without): looked up as written.
        if !is_identifier(name.strip_prefix('.').unwrap_or(name)) {
            return true;
        }
        let shape = match form {
            Form::Global => None,
            Form::Member => Some(String::new()),
            Form::Namespaced(ns) => Some(ns.to_owned()),
        };
        if let Some((_, _, known)) = self.seen.iter().find(|(n, s, _)| n == name && *s == shape) {
            return *known;
        }
        let known = self.look_up(name, form);
        self.seen.push((name.to_owned(), shape, known));
        known
    }

    fn look_up(&self, name: &str, form: Form<'_>) -> bool {
        let source = match form {
            Form::Global => format!("{name}()"),
            Form::Member => format!("0.{name}()"),
            Form::Namespaced(ns) => format!("{ns}.{name}()"),
        };
        // A probe that does not parse (none is known to) does not vouch
        // for the call: refused rather than left to fail at run time.
        let Ok(program) = self.env.compile(&source) else {
            return false;
        };
        // The probe names nothing but the function (and its namespace):
        // whatever it finds undeclared, the rule's call would too.
        let activation = Context::with_env(Arc::clone(&self.env));
        !matches!(
            program.execute(&activation),
            Err(ExecutionError::UndeclaredReference(_))
        )
    }

    /// A declared name `name` may have been meant as: a standard function
    /// or macro spelt with other case (`startswith`, `exist`...).
    pub(crate) fn suggestion(&mut self, name: &str, form: Form<'_>) -> Option<&'static str> {
        let name = name.strip_prefix('.').unwrap_or(name);
        let close = |candidate: &str| {
            candidate.eq_ignore_ascii_case(name)
                || (name.len() + 1 == candidate.len()
                    && candidate
                        .to_ascii_lowercase()
                        .starts_with(&name.to_ascii_lowercase()))
        };
        if let Some(found) = MACROS.into_iter().find(|m| close(m) && *m != name) {
            return Some(found);
        }
        STANDARD
            .into_iter()
            .find(|candidate| close(candidate) && self.declares(candidate, form))
    }
}

/// A CEL identifier: what a function written in source is named.
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::engine::environment;

    fn functions() -> Functions {
        Functions::new(environment())
    }

    #[test]
    fn r27_the_standard_functions_and_matches_are_declared() {
        let mut f = functions();
        for name in ["startsWith", "endsWith", "contains", "matches", "size"] {
            assert!(f.declares(name, Form::Member), "{name}");
        }
        for name in [
            "size", "int", "uint", "double", "string", "bytes", "matches",
        ] {
            assert!(f.declares(name, Form::Global), "{name}");
        }
        // Operators are named with symbols by the parser.
        for name in ["_&&_", "@in", "_[_]", "!_", "_?_:_"] {
            assert!(f.declares(name, Form::Global), "{name}");
        }
    }

    #[test]
    fn r27_a_misspelt_function_is_not_declared_and_has_a_suggestion() {
        let mut f = functions();
        assert!(!f.declares("startswith", Form::Member));
        assert!(f.declares("lowerAscii", Form::Member));
        assert!(
            !f.declares("replace", Form::Member),
            "results may outgrow the input"
        );
        assert!(!f.declares("format", Form::Member));
        assert!(!f.declares("now", Form::Global));
        assert_eq!(f.suggestion("startswith", Form::Member), Some("startsWith"));
        assert_eq!(f.suggestion("exist", Form::Member), Some("exists"));
        assert_eq!(f.suggestion("Size", Form::Global), Some("size"));
        assert_eq!(f.suggestion("frobnicate", Form::Member), None);
    }

    #[test]
    fn every_standard_suggestion_is_declared_as_a_member_or_a_function() {
        let mut f = functions();
        for name in STANDARD {
            assert!(
                f.declares(name, Form::Member) || f.declares(name, Form::Global),
                "{name} would be suggested but is not declared"
            );
        }
    }

    #[test]
    fn r27_a_call_from_the_root_is_looked_up_as_written() {
        let mut f = functions();
        assert!(f.declares(".size", Form::Global));
        assert!(!f.declares(".startswith", Form::Global));
        assert!(!f.declares(".now", Form::Global));
        assert_eq!(
            f.suggestion(".startswith", Form::Member),
            Some("startsWith")
        );
    }

    #[test]
    fn a_namespace_function_is_looked_up_in_its_namespace() {
        let mut f = functions();
        assert!(f.declares("of", Form::Namespaced("optional")));
        assert!(!f.declares("off", Form::Namespaced("optional")));
        assert!(f.declares("has_flags", Form::Namespaced("shell")));
        assert!(f.declares("commands", Form::Namespaced("shell")));
        assert!(!f.declares("hasFlags", Form::Namespaced("shell")));
        assert!(!f.declares("has_flags", Form::Namespaced("optional")));
    }

    /// The table of argument counts is the environment's: each entry
    /// evaluates with its count and fails with one more.
    #[test]
    fn r27_every_listed_argument_count_is_the_interpreters() {
        let env = environment();
        // A receiver and arguments of the types each function takes.
        let sample = |name: &str, form: Form<'_>, count: usize| -> String {
            let receiver = match name {
                "hasValue" | "value" | "orValue" | "or" => "optional.of(1)",
                _ => "'abc'",
            };
            let arg = match name {
                "int" | "uint" | "double" | "string" | "type" | "dyn" | "of" => "1",
                "ofNonZeroValue" | "orValue" => "2",
                "bool" => "'true'",
                "or" => "optional.of(2)",
                _ => "'a'",
            };
            let args = match name {
                "has_flags" => ["'rm -rf'", "'rm'", "['r']"][..count].join(", "),
                _ => vec![arg; count].join(", "),
            };
            match form {
                Form::Global => format!("{name}({args})"),
                Form::Member => format!("{receiver}.{name}({args})"),
                Form::Namespaced(ns) => format!("{ns}.{name}({args})"),
            }
        };
        for (name, form, counts) in ARITIES {
            for count in 0..=3 {
                let source = sample(name, form, count);
                let program = env.compile(&source).expect(&source);
                let result = program.execute(&Context::with_env(Arc::clone(&env)));
                assert_eq!(
                    result.is_ok(),
                    counts.contains(&count),
                    "{source}: {result:?}"
                );
            }
        }
        assert_eq!(arity("startsWith", Form::Member), Some(&[1][..]));
        assert_eq!(arity("startsWith", Form::Global), None);
        assert_eq!(arity("replace", Form::Member), None);
    }

    #[test]
    fn identifiers_are_told_from_operators() {
        assert!(is_identifier("startsWith"));
        assert!(is_identifier("_private"));
        assert!(!is_identifier("_+_"));
        assert!(!is_identifier("@in"));
        assert!(!is_identifier(""));
    }
}
