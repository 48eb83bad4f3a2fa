//! The `redact-formats` example guard's redaction (R33, R34): common secret
//! formats in any string of a call's arguments or of a result are replaced
//! by `[REDACTED:<kind>]`, so the secret never reaches the tool, the model,
//! the decision record or a log. The formats:
//!
//! | kind | matches |
//! |---|---|
//! | `aws-access-key` | `AKIA` or `ASIA` and 16 upper-case letters or digits |
//! | `github-token` | `ghp_`, `gho_`, `ghu_`, `ghs_`, `ghr_` and 36 or more letters or digits; `github_pat_` and 22 or more |
//! | `stripe-live-key` | `sk_live_` or `rk_live_` and 16 or more letters or digits |
//! | `private-key` | a PEM `-----BEGIN ... PRIVATE KEY-----` block to its `END` line (or to the end of the string) |

use regex::Regex;
use serde_json::Value;
use std::sync::LazyLock;

/// The formats, in the order they are applied.
static FORMATS: LazyLock<Vec<(&'static str, Regex)>> = LazyLock::new(|| {
    [
        (
            "private-key",
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----(?s:.*?)(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|\z)",
        ),
        ("aws-access-key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
        (
            "github-token",
            r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b",
        ),
        ("stripe-live-key", r"\b[sr]k_live_[0-9A-Za-z]{16,}\b"),
    ]
    .into_iter()
    .map(|(kind, pattern)| {
        (
            kind,
            Regex::new(pattern).unwrap_or_else(|e| panic!("redaction pattern {kind}: {e}")),
        )
    })
    .collect()
});

/// `text` with every secret of a known format replaced; `None` when it
/// holds none.
pub fn redact_text(text: &str) -> Option<String> {
    let mut out: Option<String> = None;
    for (kind, pattern) in FORMATS.iter() {
        let current = out.as_deref().unwrap_or(text);
        if pattern.is_match(current) {
            let replaced = pattern
                .replace_all(current, format!("[REDACTED:{kind}]").as_str())
                .into_owned();
            out = Some(replaced);
        }
    }
    out
}

/// Redacts every string of `value` (object keys included) in place;
/// whether anything changed.
pub fn redact_value(value: &mut Value) -> bool {
    match value {
        Value::String(text) => match redact_text(text) {
            Some(redacted) => {
                *text = redacted;
                true
            }
            None => false,
        },
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| redact_value(item) | changed),
        Value::Object(map) => {
            let mut changed = false;
            let keys: Vec<String> = map.keys().cloned().collect();
            for key in keys {
                if let Some(mut v) = map.remove(&key) {
                    changed |= redact_value(&mut v);
                    let key = match redact_text(&key) {
                        Some(redacted) => {
                            changed = true;
                            redacted
                        }
                        None => key,
                    };
                    map.insert(key, v);
                }
            }
            changed
        }
        _ => false,
    }
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
    fn r29_nested_values_and_keys_are_redacted() {
        let mut v = serde_json::json!({
            "a": [{"k": "token AKIAIOSFODNN7EXAMPLE"}],
            "AKIAIOSFODNN7EXAMPLE": 1,
            "n": 5
        });
        assert!(redact_value(&mut v));
        assert!(!v.to_string().contains("AKIAIOSFODNN7EXAMPLE"), "{v}");
        assert!(!redact_value(&mut v));
    }
}
