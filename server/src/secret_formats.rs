//! Common secret formats, recognised by their shape wherever they appear in
//! a string: the redaction guard replaces them in calls and results (R33,
//! R34), and the decision log masks them in every record before it is
//! written (R29, `decision_log.mask_formats`), so a secret that a
//! coordinator sent, or that a guard redacted from what runs, leaves no
//! copy in the log, its free text or the mesh's log lines and spans.
//!
//! | kind | matches |
//! |---|---|
//! | `aws-access-key` | `AKIA` or `ASIA` and 16 upper-case letters or digits |
//! | `github-token` | `ghp_`, `gho_`, `ghu_`, `ghs_`, `ghr_` and 36 or more letters or digits; `github_pat_` and 22 or more |
//! | `stripe-live-key` | `sk_live_` or `rk_live_` and 16 or more letters or digits |
//! | `private-key` | a PEM `-----BEGIN ... PRIVATE KEY-----` block to its `END` line (or to the end of the string) |

use regex::{Regex, RegexSet};
use serde_json::Value;
use std::sync::LazyLock;

/// The kinds, in the order they are applied.
pub const KINDS: [&str; 4] = [
    "private-key",
    "aws-access-key",
    "github-token",
    "stripe-live-key",
];

const PATTERNS: [&str; 4] = [
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----(?s:.*?)(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|\z)",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b",
    r"\b[sr]k_live_[0-9A-Za-z]{16,}\b",
];

static REGEXES: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    PATTERNS
        .iter()
        .zip(KINDS)
        .map(|(pattern, kind)| {
            Regex::new(pattern).unwrap_or_else(|e| panic!("secret format {kind}: {e}"))
        })
        .collect()
});

/// All patterns at once: one pass tells whether a string holds any.
static ANY: LazyLock<RegexSet> =
    LazyLock::new(|| RegexSet::new(PATTERNS).unwrap_or_else(|e| panic!("secret formats: {e}")));

/// A choice of formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Formats {
    /// Bit `i` set: [`KINDS`]`[i]` is in.
    bits: u8,
}

/// A format name that is not one of [`KINDS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown secret format {0:?} (known: aws-access-key, github-token, stripe-live-key, private-key)"
)]
pub struct UnknownFormat(pub String);

impl Formats {
    /// Every format.
    pub fn all() -> Self {
        Formats {
            bits: (1 << KINDS.len()) - 1,
        }
    }

    /// No format.
    pub fn none() -> Self {
        Formats::default()
    }

    /// The formats named; an unknown name is an error naming it.
    pub fn named<I, S>(names: I) -> Result<Self, UnknownFormat>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut bits = 0u8;
        for name in names {
            let name = name.as_ref();
            let index = KINDS
                .iter()
                .position(|kind| *kind == name)
                .ok_or_else(|| UnknownFormat(name.to_owned()))?;
            bits |= 1 << index;
        }
        Ok(Formats { bits })
    }

    pub fn is_empty(&self) -> bool {
        self.bits == 0
    }

    fn chosen(&self) -> impl Iterator<Item = (&'static str, &'static Regex)> + '_ {
        KINDS
            .iter()
            .zip(REGEXES.iter())
            .enumerate()
            .filter(|(i, _)| self.bits & (1 << i) != 0)
            .map(|(_, (kind, regex))| (*kind, regex))
    }

    /// Whether `text` may hold one of these formats (one pass over it).
    fn may_hold(&self, text: &str) -> bool {
        !self.is_empty()
            && ANY
                .matches(text)
                .iter()
                .any(|index| self.bits & (1 << index) != 0)
    }

    /// `text` with every secret of these formats replaced by
    /// `replacement(kind)`; `None` when it holds none.
    pub fn replace(&self, text: &str, replacement: impl Fn(&str) -> String) -> Option<String> {
        if !self.may_hold(text) {
            return None;
        }
        let mut out: Option<String> = None;
        for (kind, regex) in self.chosen() {
            let current = out.as_deref().unwrap_or(text);
            if regex.is_match(current) {
                out = Some(
                    regex
                        .replace_all(current, replacement(kind).as_str())
                        .into_owned(),
                );
            }
        }
        out
    }

    /// The secrets of these formats in `text`, as they appear.
    pub fn found<'t>(&self, text: &'t str) -> Vec<&'t str> {
        if !self.may_hold(text) {
            return Vec::new();
        }
        self.chosen()
            .flat_map(|(_, regex)| regex.find_iter(text).map(|m| m.as_str()))
            .collect()
    }

    /// Replaces, in place, every secret of these formats in every string of
    /// `value` (member names included) by `replacement(kind)`; how many
    /// strings changed.
    pub fn replace_in(&self, value: &mut Value, replacement: &dyn Fn(&str) -> String) -> u32 {
        if self.is_empty() {
            return 0;
        }
        match value {
            Value::String(text) => match self.replace(text, replacement) {
                Some(replaced) => {
                    *text = replaced;
                    1
                }
                None => 0,
            },
            Value::Array(items) => items
                .iter_mut()
                .map(|item| self.replace_in(item, replacement))
                .sum(),
            Value::Object(map) => {
                let mut count = 0;
                let renamed: Vec<String> = map
                    .keys()
                    .filter(|key| self.may_hold(key))
                    .cloned()
                    .collect();
                for key in renamed {
                    if let (Some(replaced), Some(member)) =
                        (self.replace(&key, replacement), map.remove(&key))
                    {
                        count += 1;
                        map.insert(replaced, member);
                    }
                }
                for member in map.values_mut() {
                    count += self.replace_in(member, replacement);
                }
                count
            }
            _ => 0,
        }
    }
}

/// The redaction guard's replacement: `[REDACTED:<kind>]`.
pub fn redacted(kind: &str) -> String {
    format!("[REDACTED:{kind}]")
}

/// `text` with every secret of a known format replaced by
/// `[REDACTED:<kind>]`; `None` when it holds none.
pub fn redact_text(text: &str) -> Option<String> {
    Formats::all().replace(text, redacted)
}

/// Redacts every string of `value` (member names included) in place;
/// whether anything changed.
pub fn redact_value(value: &mut Value) -> bool {
    Formats::all().replace_in(value, &redacted) > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r29_each_format_is_redacted_and_nothing_else() {
        let aws = "AKIAIOSFODNN7EXAMPLE";
        let ghp = format!("ghp_{}", "a1B2".repeat(9));
        let pat = format!("github_pat_{}", "11ABCDEFG_".repeat(4));
        let stripe = format!("sk_live_{}", "4eC39HqLyjWDarjtT1zdp7dc");
        let pem =
            "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----";
        let text = format!("a={aws} b={ghp} c={pat} d={stripe}\n{pem}\nend");
        let out = redact_text(&text).unwrap();
        for secret in [
            aws,
            ghp.as_str(),
            pat.as_str(),
            stripe.as_str(),
            "MIIEpAIBAAKCAQEA",
        ] {
            assert!(!out.contains(secret), "{secret} left in {out}");
        }
        assert_eq!(
            out,
            "a=[REDACTED:aws-access-key] b=[REDACTED:github-token] c=[REDACTED:github-token] \
             d=[REDACTED:stripe-live-key]\n[REDACTED:private-key]\nend"
        );
        assert_eq!(redact_text("AKIA123 ghp_short sk_test_abc plain"), None);
        // A block without its END line is redacted to the end.
        assert_eq!(
            redact_text("x -----BEGIN PRIVATE KEY-----\nMIIB...").as_deref(),
            Some("x [REDACTED:private-key]")
        );
    }

    #[test]
    fn r29_nested_values_and_member_names_are_redacted() {
        let mut v = serde_json::json!({
            "a": [{"k": "token AKIAIOSFODNN7EXAMPLE"}],
            "AKIAIOSFODNN7EXAMPLE": 1,
            "n": 5
        });
        assert!(redact_value(&mut v));
        assert!(!v.to_string().contains("AKIAIOSFODNN7EXAMPLE"), "{v}");
        assert!(!redact_value(&mut v));
    }

    #[test]
    fn r29_a_choice_of_formats_reaches_only_those_and_unknown_names_are_refused() {
        let only_aws = Formats::named(["aws-access-key"]).unwrap();
        let stripe = format!("sk_live_{}", "4eC39HqLyjWDarjtT1zdp7dc");
        let text = format!("AKIAIOSFODNN7EXAMPLE {stripe}");
        assert_eq!(
            only_aws.replace(&text, redacted).unwrap(),
            format!("[REDACTED:aws-access-key] {stripe}")
        );
        assert_eq!(only_aws.found(&text), vec!["AKIAIOSFODNN7EXAMPLE"]);
        assert!(Formats::none().replace(&text, redacted).is_none());
        let error = Formats::named(["aws-access-key", "aws"]).unwrap_err();
        assert!(error.to_string().contains("\"aws\""), "{error}");
    }
}
