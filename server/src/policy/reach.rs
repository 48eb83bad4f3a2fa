//! Which tool names a policy rule can ever be sent (R27, R9): whether two
//! tool patterns (globs) have a name in common, without regard to ASCII
//! case, and the tool names a rule's `when` compares `call.tool` to.
//!
//! Both answers err on the side of "reachable": a glob feature this module
//! does not model exactly (a `[...]` class) is read as any one character,
//! so a rule is reported as never sent only when no name can reach it.

use std::collections::HashSet;

/// One element of a glob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    /// This character (ASCII-lowercased).
    Lit(char),
    /// Any one character (`?`, or a `[...]` class).
    One,
    /// Any run of characters (`*`, `**`).
    Star,
}

/// At most this many alternatives of a pattern's `{a,b}` groups are
/// expanded; past it, the pattern is read as `*` (matches everything).
const MAX_ALTERNATIVES: usize = 64;

/// `pattern` as one token list per alternative of its `{a,b}` groups.
fn alternatives(pattern: &str) -> Vec<Vec<Tok>> {
    let mut out: Vec<Vec<Tok>> = vec![Vec::new()];
    let chars: Vec<char> = pattern.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if i + 1 < chars.len() => {
                let c = chars[i + 1].to_ascii_lowercase();
                out.iter_mut().for_each(|alt| alt.push(Tok::Lit(c)));
                i += 2;
            }
            '*' => {
                out.iter_mut().for_each(|alt| {
                    if alt.last() != Some(&Tok::Star) {
                        alt.push(Tok::Star);
                    }
                });
                i += 1;
            }
            '?' => {
                out.iter_mut().for_each(|alt| alt.push(Tok::One));
                i += 1;
            }
            '[' => {
                // A class: one character of some set; read as any one.
                let end = chars[i + 1..]
                    .iter()
                    .skip(1)
                    .position(|&c| c == ']')
                    .map(|p| i + 2 + p);
                match end {
                    Some(end) => {
                        out.iter_mut().for_each(|alt| alt.push(Tok::One));
                        i = end + 1;
                    }
                    None => {
                        out.iter_mut().for_each(|alt| alt.push(Tok::Lit('[')));
                        i += 1;
                    }
                }
            }
            '{' => {
                let Some(close) = chars[i..].iter().position(|&c| c == '}').map(|p| i + p) else {
                    out.iter_mut().for_each(|alt| alt.push(Tok::Lit('{')));
                    i += 1;
                    continue;
                };
                let inner: String = chars[i + 1..close].iter().collect();
                let options: Vec<Vec<Tok>> = inner.split(',').flat_map(alternatives).collect();
                if out.len().saturating_mul(options.len()) > MAX_ALTERNATIVES {
                    return vec![vec![Tok::Star]];
                }
                out = out
                    .iter()
                    .flat_map(|alt| {
                        options.iter().map(move |option| {
                            let mut joined = alt.clone();
                            joined.extend_from_slice(option);
                            joined
                        })
                    })
                    .collect();
                i = close + 1;
            }
            c => {
                out.iter_mut()
                    .for_each(|alt| alt.push(Tok::Lit(c.to_ascii_lowercase())));
                i += 1;
            }
        }
    }
    out
}

/// Whether two token lists match some name in common.
fn meet(a: &[Tok], b: &[Tok]) -> bool {
    // Reachable states (i, j): `a[..i]` and `b[..j]` matched one prefix.
    let mut seen = HashSet::new();
    let mut stack = vec![(0usize, 0usize)];
    while let Some((i, j)) = stack.pop() {
        if !seen.insert((i, j)) {
            continue;
        }
        if i == a.len() && j == b.len() {
            return true;
        }
        let x = a.get(i).copied();
        let y = b.get(j).copied();
        // A star may match nothing.
        if x == Some(Tok::Star) {
            stack.push((i + 1, j));
        }
        if y == Some(Tok::Star) {
            stack.push((i, j + 1));
        }
        // One character both sides accept.
        match (x, y) {
            (Some(Tok::Lit(p)), Some(Tok::Lit(q))) if p == q => stack.push((i + 1, j + 1)),
            (Some(Tok::Lit(_) | Tok::One), Some(Tok::One))
            | (Some(Tok::One), Some(Tok::Lit(_))) => {
                stack.push((i + 1, j + 1));
            }
            (Some(Tok::Star), Some(Tok::Lit(_) | Tok::One)) => stack.push((i, j + 1)),
            (Some(Tok::Lit(_) | Tok::One), Some(Tok::Star)) => stack.push((i + 1, j)),
            _ => {}
        }
    }
    false
}

/// Whether some tool name matches both `a` and `b` (ASCII case ignored).
pub(crate) fn overlap(a: &str, b: &str) -> bool {
    let a = alternatives(a);
    let b = alternatives(b);
    a.iter().any(|x| b.iter().any(|y| meet(x, y)))
}

/// The string literals a `when` expression compares `call.tool` to with
/// `==` (either side) or `in [...]`.
pub(crate) fn compared_tools(when: &str) -> Vec<String> {
    let literals = literals(when);
    let mut out = Vec::new();
    let is_tool_ref = |text: &str| {
        text.strip_suffix("call.tool").is_some_and(|before| {
            !before
                .chars()
                .last()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
        })
    };
    for (start, end, value) in &literals {
        let (start, end) = (*start, *end);
        let before = when[..start].trim_end();
        let after = when[end..].trim_start();
        // `call.tool == 'x'`
        if let Some(left) = before.strip_suffix("==")
            && is_tool_ref(left.trim_end())
        {
            out.push(value.clone());
            continue;
        }
        // `'x' == call.tool`
        if let Some(right) = after.strip_prefix("==") {
            let right = right.trim_start();
            if let Some(rest) = right.strip_prefix("call.tool")
                && !rest
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.' || c == '(')
            {
                out.push(value.clone());
                continue;
            }
        }
        // `call.tool in ['x', 'y']`: every literal of that list.
        if let Some(open) = when[..start].rfind('[')
            && !when[open..start].contains(']')
            && let Some(left) = when[..open].trim_end().strip_suffix("in")
            && is_tool_ref(left.trim_end())
        {
            out.push(value.clone());
        }
    }
    out
}

/// The string literals of a CEL expression: (start, end, value), for
/// single- or double-quoted literals without escapes or raw prefixes (a
/// literal with an escape is skipped: it is not read as a tool name).
fn literals(text: &str) -> Vec<(usize, usize, String)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let quote = bytes[i];
        if quote != b'\'' && quote != b'"' {
            i += 1;
            continue;
        }
        // Triple quotes and raw strings are not tool names here.
        let raw = i > 0 && matches!(bytes[i - 1], b'r' | b'R' | b'b' | b'B');
        let Some(len) = text[i + 1..].find(quote as char) else {
            break;
        };
        let end = i + 1 + len + 1;
        let value = &text[i + 1..i + 1 + len];
        if !raw && !value.contains('\\') && !value.is_empty() {
            out.push((i, end, value.to_owned()));
        }
        i = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r27_patterns_overlap_when_some_name_matches_both() {
        for (a, b) in [
            ("bash", "bash"),
            ("bash", "BASH"),
            ("shell.*", "shell.exec"),
            ("shell.*", "*.exec"),
            ("sh*", "*ll"),
            ("*", "bash"),
            ("sql.{query,exec}", "sql.exec"),
            ("tool.[ab]", "tool.?"),
            ("a?c", "abc"),
        ] {
            assert!(overlap(a, b), "{a} and {b}");
            assert!(overlap(b, a), "{b} and {a}");
        }
    }

    #[test]
    fn r27_patterns_that_no_name_matches_both_do_not_overlap() {
        for (a, b) in [
            ("bash", "shell.*"),
            ("bash", "sql.*"),
            ("shell.*", "payments.*"),
            ("email.send", "email.sendx"),
            ("a?c", "ac"),
            ("sql.{query,exec}", "sql.drop"),
        ] {
            assert!(!overlap(a, b), "{a} and {b}");
            assert!(!overlap(b, a), "{b} and {a}");
        }
    }

    #[test]
    fn r27_tools_a_condition_compares_call_tool_to() {
        assert_eq!(compared_tools("call.tool == 'bash'"), ["bash"]);
        assert_eq!(compared_tools("\"bash\" == call.tool && true"), ["bash"]);
        assert_eq!(
            compared_tools("call.tool in ['bash', \"zsh\"] || x"),
            ["bash", "zsh"]
        );
        assert!(compared_tools("calls.filter(c, c.tool == 'email.send').size() > 3").is_empty());
        assert!(compared_tools("call.tool != 'bash'").is_empty());
        assert!(compared_tools("call.args.q == 'bash'").is_empty());
        assert!(compared_tools("mycall.tool == 'bash'").is_empty());
    }
}

#[cfg(test)]
mod never_sent_tests {
    use crate::policy::never_sent;

    const HOUSE_RULES: &str = r#"
[[rule]]
name = "no-shell-in-production"
tools = ["shell.*", "bash"]
when = "true"
action = "cancel"
message = '"no"'

[[rule]]
name = "no-zsh"
when = "call.tool == 'zsh' || call.tool in ['sql.query', 'fish']"
action = "cancel"
message = '"no"'
"#;

    #[test]
    fn r27_a_rule_naming_a_tool_its_guard_never_sends_is_reported() {
        let tools = ["sql.*", "payments.*", "email.send", "shell.*"].map(String::from);
        let found = never_sent(HOUSE_RULES, &tools).unwrap();
        let named: Vec<(&str, &str, bool)> = found
            .iter()
            .map(|f| (f.rule.as_str(), f.tool.as_str(), f.in_when))
            .collect();
        assert_eq!(
            named,
            [
                ("no-shell-in-production", "bash", false),
                ("no-zsh", "zsh", true),
                ("no-zsh", "fish", true),
            ]
        );
        assert!(found[0].to_string().contains("\"bash\""), "{}", found[0]);
        assert_eq!(found[0].line, 3);
    }

    #[test]
    fn r27_a_guard_sent_every_tool_or_every_named_tool_reports_nothing() {
        assert!(never_sent(HOUSE_RULES, &[]).unwrap().is_empty());
        let tools = ["SQL.*", "shell.*", "bash", "zsh", "fish"].map(String::from);
        assert!(never_sent(HOUSE_RULES, &tools).unwrap().is_empty());
    }
}
