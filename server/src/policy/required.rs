//! What a written pattern requires of ASCII text before the regex engine is
//! asked: literals one of which every match contains.
//!
//! Most `matches` in a policy are deny patterns (`drop table`, `rm -rf /`,
//! the cloud metadata host) that most calls do not match. The regex engine
//! answers those in a few hundred instructions, but it touches its own
//! code, prefilter tables and per-pattern caches, which are cold when a
//! batch arrives at one batch in flight: in the bench, the five searches of
//! the 20-rule policy were about 5 µs of the mesh's latency per batch. So
//! each pattern written in a policy is read once more, from its syntax
//! (`regex-syntax`, the parser the regex crate uses), into [`Required`]: sets
//! of literals such that every match contains one literal of each set. Text
//! that is ASCII and lacks every literal of some set cannot match, and the
//! regex is not run; otherwise it is.
//!
//! Sound, not complete: a set is derived only from the parts of a pattern
//! every match must go through (a literal, a character that is one ASCII
//! letter in either case, a group or a repetition of at least one, an
//! alternation whose every branch requires something); anything else
//! requires nothing. Literals are compared ASCII case-insensitively, which
//! can only find more. Text that is not ASCII always goes to the regex: under
//! `(?i)` a non-ASCII character can match an ASCII letter (`ſ` is an `s`).
//! A property test checks that the regex never matches text this excludes.

use regex_syntax::hir::{Class, Hir, HirKind};

/// Literals per set at most: beyond that the set is dropped.
const MAX_LITERALS: usize = 16;

/// Sets kept per pattern at most (the ones with the longest literals).
const MAX_SETS: usize = 3;

/// Longest text checked here; longer text goes to the regex, whose
/// prefilters are faster on long haystacks.
const MAX_TEXT: usize = 4096;

/// Sets of literals (lowercase ASCII), one of each of which every match of
/// the pattern contains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Required {
    sets: Vec<Vec<Box<[u8]>>>,
}

impl Required {
    /// What `pattern` requires, as the regex crate parses it by default;
    /// `None` when it requires nothing this can tell.
    pub(crate) fn of(pattern: &str) -> Option<Required> {
        let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
        let mut sets = requirements(&hir);
        sets.retain(|set| !set.is_empty() && set.len() <= MAX_LITERALS);
        // Longer literals are rarer: they exclude more text.
        sets.sort_by_key(|set| std::cmp::Reverse(set.iter().map(|l| l.len()).min()));
        sets.truncate(MAX_SETS);
        (!sets.is_empty()).then_some(Required { sets })
    }

    /// Whether `text` cannot match: it is ASCII (and not too long to check
    /// here) and contains no literal of some set.
    pub(crate) fn excludes(&self, text: &str) -> bool {
        let bytes = text.as_bytes();
        if bytes.len() > MAX_TEXT || !text.is_ascii() {
            return false;
        }
        self.sets
            .iter()
            .any(|set| !set.iter().any(|literal| contains_folded(bytes, literal)))
    }
}

/// What every match of `hir` contains: each set has a literal in it.
fn requirements(hir: &Hir) -> Vec<Vec<Box<[u8]>>> {
    match hir.kind() {
        HirKind::Empty | HirKind::Look(_) | HirKind::Class(_) => Vec::new(),
        HirKind::Literal(literal) => folded(&literal.0)
            .map(|l| vec![vec![l.into_boxed_slice()]])
            .unwrap_or_default(),
        HirKind::Capture(capture) => requirements(&capture.sub),
        HirKind::Repetition(repetition) if repetition.min >= 1 => requirements(&repetition.sub),
        HirKind::Repetition(_) => Vec::new(),
        HirKind::Concat(subs) => {
            let mut sets = Vec::new();
            // A run of literal characters in a row is one literal.
            let mut run: Vec<u8> = Vec::new();
            for sub in subs {
                match one_char(sub) {
                    Some(bytes) => run.extend_from_slice(&bytes),
                    None => {
                        if !run.is_empty() {
                            sets.push(vec![std::mem::take(&mut run).into_boxed_slice()]);
                        }
                        sets.extend(requirements(sub));
                    }
                }
            }
            if !run.is_empty() {
                sets.push(vec![run.into_boxed_slice()]);
            }
            sets
        }
        HirKind::Alternation(branches) => {
            // Each match goes through one branch: the union of one set of
            // each branch, if every branch has one.
            let mut union = Vec::new();
            for branch in branches {
                let sets = requirements(branch);
                let Some(best) = sets
                    .into_iter()
                    .filter(|set| !set.is_empty())
                    .max_by_key(|set| set.iter().map(|l| l.len()).min())
                else {
                    return Vec::new();
                };
                union.extend(best);
            }
            vec![union]
        }
    }
}

/// The lowercase ASCII bytes `hir` matches if it is a literal of ASCII
/// characters or a class of one ASCII character (in either case, with any
/// non-ASCII characters besides): what it contributes to a run.
fn one_char(hir: &Hir) -> Option<Vec<u8>> {
    match hir.kind() {
        HirKind::Literal(literal) => folded(&literal.0),
        HirKind::Class(Class::Unicode(class)) => {
            let mut ascii = class
                .ranges()
                .iter()
                .filter(|r| r.start().is_ascii())
                .flat_map(|r| r.start()..=r.end().min('\u{7f}'));
            let first = ascii.next()?;
            let (second, more) = (ascii.next(), ascii.next());
            let lower = first.to_ascii_lowercase();
            match (second, more) {
                (None, None) => Some(vec![lower as u8]),
                (Some(second), None) if second.to_ascii_lowercase() == lower => {
                    Some(vec![lower as u8])
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// `bytes` lowercased, if they are ASCII (a non-ASCII literal cannot occur in
/// ASCII text; it requires nothing here).
fn folded(bytes: &[u8]) -> Option<Vec<u8>> {
    (!bytes.is_empty() && bytes.is_ascii()).then(|| bytes.to_ascii_lowercase())
}

/// Whether `text` contains `literal` (lowercase) ASCII case-insensitively.
fn contains_folded(text: &[u8], literal: &[u8]) -> bool {
    let Some((&first, rest)) = literal.split_first() else {
        return true;
    };
    if text.len() < literal.len() {
        return false;
    }
    let last_start = text.len() - literal.len();
    let upper = first.to_ascii_uppercase();
    let mut at = 0;
    while at <= last_start {
        let found = if upper == first {
            memchr::memchr(first, &text[at..=last_start])
        } else {
            memchr::memchr2(first, upper, &text[at..=last_start])
        };
        let Some(offset) = found else {
            return false;
        };
        let start = at + offset;
        if text[start + 1..start + literal.len()].eq_ignore_ascii_case(rest) {
            return true;
        }
        at = start + 1;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sets(pattern: &str) -> Vec<Vec<String>> {
        Required::of(pattern).map_or_else(Vec::new, |r| {
            r.sets
                .iter()
                .map(|set| {
                    set.iter()
                        .map(|l| String::from_utf8_lossy(l).into_owned())
                        .collect()
                })
                .collect()
        })
    }

    #[test]
    fn r27_the_literals_every_match_contains() {
        assert_eq!(sets(r"(?i)^\s*delete\s"), vec![vec!["delete"]]);
        assert_eq!(
            sets(r"169\.254\.169\.254|metadata\.google\.internal"),
            vec![vec!["169.254.169.254", "metadata.google.internal"]]
        );
        assert!(
            sets(r"(?i)\b(drop|truncate)\s+(table|database|schema)\b").contains(&vec![
                "table".to_owned(),
                "database".to_owned(),
                "schema".to_owned()
            ])
        );
        // Optional parts and branches that require nothing require nothing.
        assert_eq!(sets(r"(abc)?"), Vec::<Vec<String>>::new());
        assert_eq!(sets(r"abc|\d+"), Vec::<Vec<String>>::new());
        assert_eq!(sets(r"[a-z]+"), Vec::<Vec<String>>::new());
        assert!(
            Required::of(r"(?i)^\s*delete\s")
                .unwrap()
                .excludes("SELECT * FROM t")
        );
        assert!(
            !Required::of(r"(?i)^\s*delete\s")
                .unwrap()
                .excludes("  DeLeTe FROM t")
        );
        // Not ASCII: the regex decides (`ſ` is an `s` under `(?i)`).
        assert!(!Required::of(r"(?i)secret").unwrap().excludes("ſecret"));
    }

    /// The property the mesh relies on: text this excludes is text the regex
    /// does not match (else a deny rule would let a call proceed). Texts
    /// are made of the patterns' own words in any case, separators, and
    /// characters a case-insensitive regex folds to ASCII letters.
    #[test]
    fn r27_excluded_text_never_matches() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        let patterns = [
            r"(?i)^\s*delete\s",
            r"(?i)\swhere\s",
            r"(?i)\b(drop|truncate)\s+(table|database|schema)\b",
            r"(?i)^\s*(grant|revoke|alter\s+user)\b",
            r"(?i)\bfrom\s+(events|audit_log)\b",
            r"(?i)\slimit\s+\d+",
            r"\brm\s+-[a-zA-Z]*r[a-zA-Z]*\s+/(\s|$)",
            r"(curl|wget)[^|]*\|\s*(ba|z)?sh",
            r"169\.254\.169\.254|metadata\.google\.internal",
            r"(^|/)(\.ssh|\.aws|\.gnupg)(/|$)|^/etc/shadow$",
            r"(?i)ignore (all|any|previous) (instructions|rules)",
            r"(?i)kelvin|sk",
            r"ab+c",
            r"a(b|c)d",
            r"(ab){2,}x",
            r"x(?:y|)z",
            r"(?i)straße",
            r"café|cafe",
            r"(?x) d r o p",
            r"(?i)a(?-i)B",
            r"[Kk]ey",
            r"\x41BC",
            r"(?s)a.b",
            r"(?m)^drop$",
            r"a{0}b",
            r"(?i)[a-c]x",
            r"[ſs]ecret",
            r"(?i:AB)cd",
            r"(ab)*cd",
            r"(?U)a+?b",
            r"(?i)\Bop",
            r"(drop)?table",
        ];
        let compiled: Vec<(regex::Regex, Option<Required>)> = patterns
            .iter()
            .map(|p| (regex::Regex::new(p).expect(p), Required::of(p)))
            .collect();
        let words = prop::sample::select(vec![
            "delete",
            "where",
            "drop",
            "truncate",
            "table",
            "database",
            "schema",
            "grant",
            "revoke",
            "alter",
            "user",
            "from",
            "events",
            "audit_log",
            "limit",
            "rm",
            "-rf",
            "-r",
            "/",
            "curl",
            "wget",
            "|",
            "sh",
            "bash",
            "zsh",
            "169.254.169.254",
            "metadata.google.internal",
            ".ssh",
            ".aws",
            ".gnupg",
            "/etc/shadow",
            "ignore",
            "all",
            "instructions",
            "rules",
            "kelvin",
            "sk",
            "ab",
            "b",
            "c",
            "d",
            "x",
            "y",
            "z",
            "key",
            "straße",
            "strasse",
            "café",
            "cafe",
            "a",
            "ecret",
            "secret",
            "op",
            "10",
            "",
        ]);
        let separators = prop::sample::select(vec![
            " ", "\t", "\n", "", "-", "1", "ſ", "\u{212A}", "é", ".", "_", "K",
        ]);
        let piece = (words, any::<u8>(), separators).prop_map(|(word, case, separator)| {
            let word: String = word
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    if case & (1 << (i % 8)) != 0 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect();
            format!("{word}{separator}")
        });
        let texts = prop::collection::vec(piece, 0..7).prop_map(|pieces| pieces.concat());
        let mut runner = TestRunner::new(Config {
            cases: 8192,
            failure_persistence: None,
            ..Config::default()
        });
        let excluded = std::cell::Cell::new(0u32);
        let matched = std::cell::Cell::new(0u32);
        let result = runner.run(&texts, |text| {
            for ((regex, required), pattern) in compiled.iter().zip(&patterns) {
                let found = regex.is_match(&text);
                matched.set(matched.get() + u32::from(found));
                if let Some(required) = required
                    && required.excludes(&text)
                {
                    excluded.set(excluded.get() + 1);
                    prop_assert!(!found, "{} matches {:?}, which was excluded", pattern, text);
                }
            }
            Ok(())
        });
        if let Err(error) = result {
            panic!("{error}");
        }
        // The test means something: texts were excluded, and others matched.
        assert!(excluded.get() > 10_000, "{} excluded", excluded.get());
        assert!(matched.get() > 1_000, "{} matched", matched.get());
    }

    #[test]
    fn contains_folded_finds_literals_anywhere() {
        assert!(contains_folded(b"xxDROP", b"drop"));
        assert!(contains_folded(b"drop", b"drop"));
        assert!(!contains_folded(b"dro", b"drop"));
        assert!(contains_folded(b"ddrop", b"drop"));
        assert!(!contains_folded(b"d-r-o-p", b"drop"));
        assert!(contains_folded(b"a|b", b"|"));
        assert!(contains_folded(b"", b""));
    }
}
