//! Values seen in results, kept only as keyed digests (R34).
//!
//! A string value of a result, and each token within it, is kept as
//! HMAC-SHA256 under the mesh's session secret, cut to 128 bits: the store
//! never holds the value, and a reader of the store without the secret
//! cannot test a guess against a digest at all (a plain or salted hash
//! would let them try every 6-digit PIN in a second). Values and tokens
//! shorter than [`MIN_VALUE_CHARS`] are not kept in any form: a PIN, a
//! short word or a small number is never in the store, so nothing in the
//! store can be brute-forced into it, at the price that a rule cannot
//! follow such a short value from one server to another.
//!
//! A token is a run of characters between separators (white space,
//! quotes, and `,;:=()[]{}<>|&?#` and the backtick): the separators of
//! `KEY=value` lines, JSON, SQL and URLs. A call's argument "contains" a
//! value seen when the argument's whole text or one of its tokens has the
//! digest of a value or token seen: so `INSERT INTO t VALUES ('s3cr3tV4lue')`
//! contains the `s3cr3tV4lue` of a `.env` line `API_KEY=s3cr3tV4lue`.
//! Values are digested in ASCII lower case ([`Digester::folded`]), so
//! `S3CR3TV4LUE` contains it too; the other forms a sent value is looked
//! for in (URL path segments, percent-escapes, base64, hex) are in
//! [`super::encodings`].

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Values and tokens shorter than this (in characters) are never kept.
pub const MIN_VALUE_CHARS: usize = 8;

/// Longest text digested whole; a longer value is kept by its tokens only.
pub const MAX_WHOLE_VALUE_BYTES: usize = 4096;

/// What a session's name in a store is a keyed digest of, before the
/// session's key: no value seen (digested without it) has the digest of a
/// session's name.
const SESSION_NAME_DOMAIN: &str = "guardmesh session name v1\n";

/// The digest of one value: HMAC-SHA256 cut to 128 bits.
pub type Digest = [u8; 16];

/// The mesh's session secret and the digests made with it.
#[derive(Clone)]
pub struct Digester {
    key: Hmac<Sha256>,
}

impl std::fmt::Debug for Digester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Digester(..)")
    }
}

/// A secret too short to key the digests.
#[derive(Debug, thiserror::Error)]
#[error("the session secret has {0} bytes; at least 32 are needed")]
pub struct ShortSecret(pub usize);

impl Digester {
    /// Keyed with `secret` (at least 32 bytes): replicas that share a store
    /// must share the secret.
    pub fn new(secret: &[u8]) -> Result<Self, ShortSecret> {
        if secret.len() < 32 {
            return Err(ShortSecret(secret.len()));
        }
        let key = <Hmac<Sha256> as KeyInit>::new_from_slice(secret)
            .map_err(|_| ShortSecret(secret.len()))?;
        Ok(Self { key })
    }

    /// Keyed with a random secret of this process: for a single mesh that
    /// keeps its sessions in memory.
    pub fn random() -> Self {
        let secret: [u8; 32] = rand::random();
        Self::new(&secret).unwrap_or_else(|_| unreachable!("32 bytes"))
    }

    /// The digest of `text`.
    pub fn digest(&self, text: &str) -> Digest {
        let mut mac = self.key.clone();
        mac.update(text.as_bytes());
        Self::cut(mac)
    }

    /// The digest of `text` in ASCII lower case: how values seen are
    /// kept, so that a value is found again in another ASCII case (R34).
    /// Equal to [`Digester::digest`] for a text without ASCII capitals.
    pub fn folded(&self, text: &str) -> Digest {
        let mut mac = self.key.clone();
        let mut buf = [0u8; 256];
        for chunk in text.as_bytes().chunks(buf.len()) {
            let lower = &mut buf[..chunk.len()];
            lower.copy_from_slice(chunk);
            lower.make_ascii_lowercase();
            mac.update(lower);
        }
        Self::cut(mac)
    }

    fn cut(mac: Hmac<Sha256>) -> Digest {
        let full = mac.finalize().into_bytes();
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        out
    }

    /// The name of a session in a shared store (hex, 64 digits): the
    /// HMAC-SHA256 of `store_key` under the secret, apart from the digests
    /// of values by a prefix of its own. Without the secret, a reader of
    /// the store cannot test a guess of who has a session.
    pub fn session_name(&self, store_key: &str) -> String {
        let mut mac = self.key.clone();
        mac.update(SESSION_NAME_DOMAIN.as_bytes());
        mac.update(store_key.as_bytes());
        hex(&mac.finalize().into_bytes())
    }

    /// The digests of `text` as a value seen: the whole text (when not too
    /// long) and each of its tokens, those long enough, at most `max`,
    /// each in ASCII lower case ([`Digester::folded`]). Returns them and
    /// whether some were left out by `max`.
    pub fn of_value(&self, text: &str, max: usize, out: &mut Vec<Digest>) -> bool {
        for piece in pieces(text) {
            if out.len() >= max {
                return true;
            }
            let d = self.folded(piece);
            if !out.contains(&d) {
                out.push(d);
            }
        }
        false
    }
}

/// Whether `c` separates tokens.
fn separator(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            '"' | '\''
                | '`'
                | ','
                | ';'
                | ':'
                | '='
                | '('
                | ')'
                | '['
                | ']'
                | '{'
                | '}'
                | '<'
                | '>'
                | '|'
                | '&'
                | '?'
                | '#'
        )
}

fn long_enough(text: &str) -> bool {
    text.chars().take(MIN_VALUE_CHARS).count() >= MIN_VALUE_CHARS
}

/// What is digested of `text`: the trimmed whole (if long enough and not
/// too long), then each long-enough token (the whole again only once).
pub fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let whole = text.trim();
    let whole = (long_enough(whole) && whole.len() <= MAX_WHOLE_VALUE_BYTES).then_some(whole);
    let tokens = text
        .split(separator)
        .filter(|t| long_enough(t))
        .filter(move |t| Some(*t) != whole);
    whole.into_iter().chain(tokens)
}

/// A digest as text (the stores' form).
pub fn to_hex(d: &Digest) -> String {
    hex(d)
}

/// `bytes` as lowercase hex digits, two per byte: one allocation.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// A digest from its text form.
pub fn from_hex(text: &str) -> Option<Digest> {
    if text.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digester(byte: u8) -> Digester {
        Digester::new(&[byte; 32]).unwrap()
    }

    #[test]
    fn r34_short_values_are_never_digested() {
        let d = digester(1);
        let mut out = Vec::new();
        d.of_value("1234", 100, &mut out);
        d.of_value("pin=4821 code 123456 ab-cd", 100, &mut out);
        // Only the whole line is long enough; none of its short tokens is
        // kept, so no 4 or 6 digit PIN has a digest in the store.
        assert_eq!(out.len(), 1);
        for pin in ["4821", "123456", "1234"] {
            assert!(!out.contains(&d.digest(pin)), "{pin} kept");
        }
    }

    #[test]
    fn r34_digests_are_keyed_not_plain_hashes() {
        use sha2::Digest as _;
        let value = "wJalrXUtnFEMIK7MDENGbPxRfiCY";
        let a = digester(1).digest(value);
        let b = digester(2).digest(value);
        assert_ne!(a, b, "another secret, another digest");
        let plain = sha2::Sha256::digest(value.as_bytes());
        assert_ne!(&a[..], &plain[..16], "not a plain hash");
        assert_eq!(from_hex(&to_hex(&a)), Some(a));
        assert!(
            Digester::new(&[0; 16]).is_err(),
            "a short secret is refused"
        );
    }

    #[test]
    fn r34_hex_is_two_lowercase_digits_per_byte_as_stores_hold_it() {
        let all: Vec<u8> = (0..=255).collect();
        let expected: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex(&all), expected);
        let d: Digest = [
            0, 1, 0x0f, 0x10, 0x7f, 0x80, 0xab, 0xff, 9, 10, 11, 12, 13, 14, 15, 16,
        ];
        assert_eq!(to_hex(&d), "00010f107f80abff090a0b0c0d0e0f10");
        assert_eq!(from_hex(&to_hex(&d)), Some(d));
        let name = digester(5).session_name("alice\0s-1");
        assert_eq!(name.len(), 64);
        assert!(
            name.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
    }

    #[test]
    fn r34_tokens_of_env_lines_sql_and_json_meet() {
        let d = digester(3);
        let mut seen = Vec::new();
        d.of_value("API_KEY=s3cr3tV4lue\nUSER=bob\n", 100, &mut seen);
        let mut arg = Vec::new();
        d.of_value("INSERT INTO t VALUES ('s3cr3tV4lue')", 100, &mut arg);
        assert!(arg.iter().any(|a| seen.contains(a)));
        let mut other = Vec::new();
        d.of_value("INSERT INTO t VALUES ('nothing-here')", 100, &mut other);
        assert!(!other.iter().any(|a| seen.contains(a)));
    }

    #[test]
    fn r34_values_are_digested_in_ascii_lower_case() {
        let d = digester(6);
        assert_eq!(d.folded("S3CR3T-Välue"), d.folded("s3cr3t-välue"));
        assert_eq!(d.folded("s3cr3t-välue"), d.digest("s3cr3t-välue"));
        assert_ne!(
            d.folded("S3CR3T-VÄLUE"),
            d.folded("s3cr3t-välue"),
            "ASCII only"
        );
        let long = "AbC".repeat(400);
        assert_eq!(d.folded(&long), d.digest(&long.to_ascii_lowercase()));
    }

    #[test]
    fn r25_digests_per_value_are_bounded() {
        let d = digester(4);
        let text: String = (0..1000).map(|i| format!("token{i:05} ")).collect();
        let mut out = Vec::new();
        assert!(d.of_value(&text, 10, &mut out), "says it left some out");
        assert_eq!(out.len(), 10);
    }
}
