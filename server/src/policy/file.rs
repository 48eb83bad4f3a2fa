//! The policy file format (TOML, like the mesh's config):
//!
//! ```toml
//! [[rule]]
//! name = "sql-delete-needs-where"          # unique in the file
//! description = "..."                      # optional, for people
//! tools = ["sql.*"]                        # optional globs; absent: every tool
//! when = '''
//!   call.args.query.matches("(?i)^\\s*delete\\s") &&
//!   !call.args.query.matches("(?i)\\swhere\\s")
//! '''
//! action = "cancel"                        # or "steer", or "ask" (R35)
//! message = '"DELETE without WHERE refused: " + call.args.query'
//! labels = ["sql:unbounded-delete"]        # optional: session labels (R34)
//! ```
//!
//! `when` is a CEL expression that must give a bool, `message` one that must
//! give a string (so it can quote the call); both see `call`, `calls` and
//! `context` (see `input`). Rules are checked in file order and the first
//! whose tools and `when` match decides the call.
//!
//! This module reads the TOML and keeps where each value was written, so
//! that an error names the line of the file.

use serde::Deserialize;
use toml::Spanned;

use super::error::{CompileError, CompileErrorKind};
use super::verdict::Action;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PolicyFile {
    #[serde(default)]
    pub(crate) rule: Vec<RuleEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RuleEntry {
    pub(crate) name: Spanned<String>,
    #[serde(default)]
    pub(crate) description: Option<String>,
    #[serde(default)]
    pub(crate) tools: Option<Spanned<Vec<String>>>,
    pub(crate) when: Spanned<String>,
    pub(crate) action: Action,
    pub(crate) message: Spanned<String>,
    /// R34: labels the rule adds to the session when it decides a call.
    #[serde(default)]
    pub(crate) labels: Option<Spanned<Vec<String>>>,
}

/// Reads a policy file's TOML.
pub(crate) fn parse(text: &str) -> Result<PolicyFile, CompileError> {
    toml::from_str(text).map_err(|error| CompileError {
        line: error.span().map_or(1, |span| line_at(text, span.start)),
        rule: None,
        kind: CompileErrorKind::Format(error.message().trim_end().to_owned()),
    })
}

/// The line (from 1) of byte `offset` of `text`.
pub(crate) fn line_at(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    text.as_bytes()[..offset]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// The line of the file where the contents of the string written at `span`
/// start: a multi-line string (`"""` or `'''`) drops a newline right after
/// its opening quotes.
pub(crate) fn content_line(text: &str, span: std::ops::Range<usize>) -> usize {
    let line = line_at(text, span.start);
    let raw = text.get(span).unwrap_or("");
    let body = raw
        .strip_prefix("\"\"\"")
        .or_else(|| raw.strip_prefix("'''"));
    match body {
        Some(body) if body.starts_with('\n') || body.starts_with("\r\n") => line + 1,
        _ => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_single_and_multi_line_strings() {
        let text = "a = 'x'\nb = '''\nfirst\nsecond'''\nc = \"\"\"y\"\"\"\n";
        let file: toml::Table = toml::from_str(text).unwrap();
        assert_eq!(file.len(), 3);
        let start = text.find("'x'").unwrap();
        assert_eq!(content_line(text, start..start + 3), 1);
        let start = text.find("'''").unwrap();
        assert_eq!(content_line(text, start..start + 20), 3);
        let start = text.find("\"\"\"").unwrap();
        assert_eq!(content_line(text, start..start + 7), 5);
    }
}
