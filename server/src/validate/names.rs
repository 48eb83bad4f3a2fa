//! The names a batch carries that the mesh reads as names (R20): tool names
//! within the mesh's grammar, and batch ids outside the prefix the mesh
//! reserves for its replays.
//!
//! A tool name is shown to guards, matched against their patterns (R9) and
//! run by the host. A blank, invisible (U+200B), control or look-alike
//! (fullwidth `ｓｈｅｌｌ`) variant of a name would reach a guard as a tool it
//! does not know while the host may run the tool it resembles, so only
//! names within a small grammar get in: by default 1 to 128 of the
//! characters MCP names for tool names (ASCII letters, digits, `_`, `-` and
//! `.`). A deployment may allow more printable ASCII characters (such as
//! `/` or `:`) and a different length; never a character outside ASCII.

/// The prefix of the batch ids the mesh gives the batches it replays
/// (`guardmesh replay`, R30); refused from clients that may not replay.
pub const RESERVED_BATCH_PREFIX: &str = "replay:";

/// The tool-name grammar: 1 to `max_chars` characters, each an ASCII
/// letter or digit, `_`, `-`, `.`, or one of `extra`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolNameGrammar {
    /// Longest name, in characters (all ASCII, so also bytes).
    pub max_chars: usize,
    /// More characters allowed, as a set of ASCII codes (bit `c` for the
    /// character `c`); only printable ASCII other than space can be set.
    extra: u128,
}

/// The default longest tool name (MCP's limit).
pub const DEFAULT_MAX_TOOL_NAME_CHARS: usize = 128;

impl Default for ToolNameGrammar {
    fn default() -> Self {
        Self {
            max_chars: DEFAULT_MAX_TOOL_NAME_CHARS,
            extra: 0,
        }
    }
}

/// Why a configured grammar cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    #[error("limits.max_tool_name_chars must be between 1 and {most}; it is {got}")]
    Length { got: usize, most: usize },
    #[error(
        "limits.tool_name_extra_chars may only hold printable ASCII characters other than \
         space; {0:?} is not one"
    )]
    NotPrintableAscii(char),
}

/// Longest tool name that can be configured.
pub const MAX_TOOL_NAME_CHARS_LIMIT: usize = 1024;

/// Why a tool name is outside the grammar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadName {
    Empty,
    TooLong { chars: usize, max: usize },
    Character { ch: char, at: usize },
}

impl std::fmt::Display for BadName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Empty => write!(f, "it is empty"),
            Self::TooLong { chars, max } => {
                write!(f, "it is {chars} characters long; the limit is {max}")
            }
            Self::Character { ch, at } => write!(
                f,
                "character {} ({:?}) at character {at} is not allowed",
                code_point(*ch),
                ch
            ),
        }
    }
}

fn code_point(ch: char) -> String {
    format!("U+{:04X}", u32::from(ch))
}

impl ToolNameGrammar {
    /// A grammar of names up to `max_chars` long that may also hold the
    /// characters of `extra`.
    pub fn new(max_chars: usize, extra: &str) -> Result<Self, GrammarError> {
        if max_chars == 0 || max_chars > MAX_TOOL_NAME_CHARS_LIMIT {
            return Err(GrammarError::Length {
                got: max_chars,
                most: MAX_TOOL_NAME_CHARS_LIMIT,
            });
        }
        let mut set = 0u128;
        for ch in extra.chars() {
            if !ch.is_ascii_graphic() {
                return Err(GrammarError::NotPrintableAscii(ch));
            }
            set |= 1u128 << u32::from(ch);
        }
        Ok(Self {
            max_chars,
            extra: set,
        })
    }

    /// Whether `b` may appear in a name.
    fn allows(&self, b: u8) -> bool {
        b.is_ascii_alphanumeric()
            || matches!(b, b'_' | b'-' | b'.')
            || (b.is_ascii() && self.extra & (1u128 << b) != 0)
    }

    /// The grammar described for messages.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "1 to {} of ASCII letters, digits, '_', '-', '.'",
            self.max_chars
        );
        let extra: String = (0u8..128)
            .filter(|&b| self.extra & (1u128 << b) != 0)
            .map(char::from)
            .collect();
        if !extra.is_empty() {
            text.push_str(&format!(" and {extra:?}"));
        }
        text
    }

    /// Checks `name` against the grammar.
    pub fn check(&self, name: &str) -> Result<(), BadName> {
        if name.is_empty() {
            return Err(BadName::Empty);
        }
        if let Some(at) = name.bytes().position(|b| !self.allows(b)) {
            // Every byte before `at` is ASCII: `at` is a character index
            // and a boundary.
            let ch = name[at..].chars().next().unwrap_or('\u{fffd}');
            return Err(BadName::Character { ch, at });
        }
        if name.len() > self.max_chars {
            return Err(BadName::TooLong {
                chars: name.len(),
                max: self.max_chars,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r20_tool_name_grammar_default() {
        let g = ToolNameGrammar::default();
        for ok in [
            "shell.exec",
            "Shell.exec",
            "mcp__files__read_file",
            "a",
            "A-Z_0.9",
            &"x".repeat(128),
        ] {
            assert_eq!(g.check(ok), Ok(()), "{ok}");
        }
        let bad = |name: &str| g.check(name).unwrap_err();
        assert_eq!(bad(""), BadName::Empty);
        assert_eq!(bad(" shell.exec"), BadName::Character { ch: ' ', at: 0 });
        assert_eq!(bad("shell.exec "), BadName::Character { ch: ' ', at: 10 });
        assert_eq!(
            bad("shell\u{200b}.exec"),
            BadName::Character {
                ch: '\u{200b}',
                at: 5
            }
        );
        // Fullwidth look-alikes, a Cyrillic 'е', a combining mark.
        assert_eq!(
            bad("\u{ff53}hell.exec"),
            BadName::Character {
                ch: '\u{ff53}',
                at: 0
            }
        );
        assert_eq!(
            bad("sh\u{435}ll"),
            BadName::Character {
                ch: '\u{435}',
                at: 2
            }
        );
        assert_eq!(
            bad("shell\u{301}"),
            BadName::Character {
                ch: '\u{301}',
                at: 5
            }
        );
        for control in ['\0', '\t', '\n', '\r', '\u{1b}', '\u{7f}', '\u{85}'] {
            let name = format!("shell{control}exec");
            assert_eq!(
                bad(&name),
                BadName::Character { ch: control, at: 5 },
                "{name:?}"
            );
        }
        for other in ["a/b", "a:b", "a b", "a@b", "a\"b", "a\\b"] {
            assert!(g.check(other).is_err(), "{other}");
        }
        assert_eq!(
            bad(&"x".repeat(129)),
            BadName::TooLong {
                chars: 129,
                max: 128
            }
        );
        let shown = bad("shell\u{200b}.exec").to_string();
        assert!(shown.contains("U+200B"), "{shown}");
        assert!(g.describe().starts_with("1 to 128 of ASCII"));
    }

    #[test]
    fn r20_tool_name_grammar_is_configurable_within_ascii() {
        let g = ToolNameGrammar::new(8, "/:").unwrap();
        assert_eq!(g.check("fs/read"), Ok(()));
        assert_eq!(g.check("a:b"), Ok(()));
        assert!(g.check("fs/read1x").is_err());
        assert!(g.check("a b").is_err());
        assert!(g.describe().contains("\"/:\""), "{}", g.describe());
        assert_eq!(
            ToolNameGrammar::new(8, " "),
            Err(GrammarError::NotPrintableAscii(' '))
        );
        assert_eq!(
            ToolNameGrammar::new(8, "\u{200b}"),
            Err(GrammarError::NotPrintableAscii('\u{200b}'))
        );
        assert_eq!(
            ToolNameGrammar::new(8, "\u{ff0f}"),
            Err(GrammarError::NotPrintableAscii('\u{ff0f}'))
        );
        assert!(matches!(
            ToolNameGrammar::new(0, ""),
            Err(GrammarError::Length { .. })
        ));
        assert!(ToolNameGrammar::new(MAX_TOOL_NAME_CHARS_LIMIT + 1, "").is_err());
    }
}
