//! The string functions of the fast path: `lowerAscii`, `upperAscii` and
//! `trim`, `startsWith`, `endsWith` and `contains`, and the patterns of
//! `matches`, a pattern of a few words checked without the regex engine.

use std::sync::Arc;

use regex::Regex;

use super::Node;

/// A string function whose result is no longer than its receiver.
#[derive(Debug, Clone, Copy)]
pub(super) enum Transform {
    Lower,
    Upper,
    Trim,
}

impl Transform {
    /// As the interpreter's (`strings`): ASCII letters only for the case,
    /// Unicode white space for `trim`.
    pub(super) fn apply(self, text: &str) -> String {
        match self {
            Transform::Lower => text.to_ascii_lowercase(),
            Transform::Upper => text.to_ascii_uppercase(),
            Transform::Trim => text.trim().to_owned(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum TextTest {
    StartsWith,
    EndsWith,
    Contains,
}

#[derive(Debug)]
pub(super) enum Pattern {
    Fixed(Matcher),
    Computed(Box<Node>),
}

/// A pattern written in the policy. One that accepts only a few words
/// (`^(word|word)$`, optionally `(?i)`) is checked without the regex engine
/// wherever that gives the regex's answer.
#[derive(Debug)]
pub(super) struct Matcher {
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
    pub(super) fn new(regex: Arc<Regex>) -> Matcher {
        let words = Words::parse(regex.as_str());
        Matcher { regex, words }
    }

    pub(super) fn is_match(&self, text: &str) -> bool {
        match self.words.as_ref().and_then(|w| w.is_match(text)) {
            Some(found) => found,
            None => self.regex.is_match(text),
        }
    }
}

/// Whether `pattern`'s word check answers `text`, and its answer.
#[cfg(test)]
pub(super) fn word_match(pattern: &str, text: &str) -> Option<bool> {
    Words::parse(pattern)?.is_match(text)
}
