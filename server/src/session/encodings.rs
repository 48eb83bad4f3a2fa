//! The forms of a sent value that `session.seen_from` also looks up
//! (R34): a value read from one server is found when it is sent again as
//! it was, in another ASCII case (digests are of the ASCII lower-case
//! form, [`super::Digester::folded`]), as a segment of a URL path, with
//! percent-escapes, or base64 (standard or URL-safe, padded or not) or
//! hex encoded as a whole.
//!
//! Only the sending side looks for these forms: each piece of a sent
//! argument ([`super::digest::pieces`]) yields the piece, its `/`
//! segments, their percent-decodings, and the pieces of what a whole
//! base64 or hex encoding of them decodes to, when that is text. One
//! level deep: an encoding of an encoding is not followed, nor a value
//! cut across pieces or arguments, nor any other encoding or compression.
//! Every form counts towards the question's bound
//! ([`super::view::MAX_TOKENS_CHECKED`]), so its cost stays linear in the
//! argument's size.

use super::digest::{MIN_VALUE_CHARS, pieces};
use base64::Engine as _;
use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use std::ops::ControlFlow;

/// Shortest base64 tried: 8 bytes (a value long enough to be kept,
/// [`MIN_VALUE_CHARS`]) take 11 characters unpadded.
const MIN_BASE64_CHARS: usize = 11;

/// Shortest hex tried: two digits per byte of an 8-byte value.
const MIN_HEX_CHARS: usize = 2 * MIN_VALUE_CHARS;

/// Decoders of the standard and URL-safe alphabets, with or without
/// padding.
const PADDING_EITHER: GeneralPurposeConfig =
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
const STANDARD: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, PADDING_EITHER);
const URL_SAFE: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, PADDING_EITHER);

fn long_enough(text: &str) -> bool {
    text.chars().take(MIN_VALUE_CHARS).count() >= MIN_VALUE_CHARS
}

/// Calls `visit` with each form of `piece` (a piece of a sent argument)
/// to look up among the values seen, until it breaks: the piece as sent,
/// then what it decodes to, then each of its URL path segments (long
/// enough, `/`-separated) and what they decode to. `visit`'s flag is true
/// for a form as sent (the piece, a segment), false for a decoding.
pub fn forms(
    piece: &str,
    visit: &mut impl FnMut(&str, bool) -> ControlFlow<()>,
) -> ControlFlow<()> {
    visit(piece, true)?;
    decodings(piece, visit)?;
    if piece.contains('/') {
        for segment in piece.split('/').filter(|s| long_enough(s)) {
            visit(segment, true)?;
            decodings(segment, visit)?;
        }
    }
    ControlFlow::Continue(())
}

/// The pieces of what `text` decodes to as a whole: its percent-escapes
/// undone, then (of that) base64 or hex, each only when it is text.
fn decodings(text: &str, visit: &mut impl FnMut(&str, bool) -> ControlFlow<()>) -> ControlFlow<()> {
    let unescaped = percent_decoded(text);
    if let Some(unescaped) = &unescaped {
        for piece in pieces(unescaped) {
            visit(piece, false)?;
        }
    }
    let source = unescaped.as_deref().unwrap_or(text);
    for decoded in [hex_decoded(source), base64_decoded(source)]
        .into_iter()
        .flatten()
    {
        for piece in pieces(&decoded) {
            visit(piece, false)?;
        }
    }
    ControlFlow::Continue(())
}

/// Bytes that are text a value could be: UTF-8 without control
/// characters other than tab, line feed and carriage return.
fn as_text(bytes: Vec<u8>) -> Option<String> {
    let text = String::from_utf8(bytes).ok()?;
    text.chars()
        .all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r'))
        .then_some(text)
}

/// `text` with its `%XX` escapes undone, when it has one and the result
/// is text.
fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let digit = |b: u8| char::from(b).to_digit(16);
    let escape = |i: usize| -> Option<u8> {
        if bytes.get(i) != Some(&b'%') {
            return None;
        }
        let high = digit(*bytes.get(i + 1)?)?;
        let low = digit(*bytes.get(i + 2)?)?;
        u8::try_from(high * 16 + low).ok()
    };
    if !(0..bytes.len()).any(|i| escape(i).is_some()) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match escape(i) {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    as_text(out)
}

/// What `text` decodes to as hex (two digits a byte, either case, an
/// optional `0x`), when it is text.
fn hex_decoded(text: &str) -> Option<String> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    if digits.len() < MIN_HEX_CHARS
        || !digits.len().is_multiple_of(2)
        || !digits.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    let bytes = digits
        .as_bytes()
        .chunks(2)
        .map(|pair| {
            let text = std::str::from_utf8(pair).ok()?;
            u8::from_str_radix(text, 16).ok()
        })
        .collect::<Option<Vec<u8>>>()?;
    as_text(bytes)
}

/// What `text` decodes to as base64 (the standard or the URL-safe
/// alphabet, padded or not), when it is text.
fn base64_decoded(text: &str) -> Option<String> {
    let body = text.trim_end_matches('=');
    if body.len() < MIN_BASE64_CHARS || body.len() % 4 == 1 {
        return None;
    }
    let (mut standard, mut url_safe) = (false, false);
    for b in body.bytes() {
        match b {
            b'+' | b'/' => standard = true,
            b'-' | b'_' => url_safe = true,
            b if b.is_ascii_alphanumeric() => {}
            _ => return None,
        }
    }
    let engine = match (standard, url_safe) {
        (true, true) => return None,
        (_, false) => &STANDARD,
        (false, true) => &URL_SAFE,
    };
    as_text(engine.decode(body).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_forms(piece: &str) -> Vec<(String, bool)> {
        let mut out = Vec::new();
        let _ = forms(piece, &mut |form, plain| {
            out.push((form.to_owned(), plain));
            ControlFlow::Continue(())
        });
        out
    }

    #[test]
    fn r34_forms_of_a_piece_are_the_piece_its_segments_and_their_decodings() {
        let forms = all_forms("//evil.example/c/aHVudGVyMi1TdXAzclMzY3JldFZhbHVl");
        assert_eq!(
            forms[0].0,
            "//evil.example/c/aHVudGVyMi1TdXAzclMzY3JldFZhbHVl"
        );
        assert!(
            forms.contains(&("evil.example".to_owned(), true)),
            "{forms:?}"
        );
        assert!(
            forms.contains(&("hunter2-Sup3rS3cretValue".to_owned(), false)),
            "{forms:?}"
        );
        // Words are no encoding: a plain token has itself as its only form.
        assert_eq!(all_forms("ordinary"), [("ordinary".to_owned(), true)]);
        assert_eq!(percent_decoded("a%2Db%zz%4"), Some("a-b%zz%4".to_owned()));
        assert_eq!(percent_decoded("no escapes"), None);
        assert_eq!(hex_decoded("0x68756E74657232"), None, "7 bytes: too short");
        assert_eq!(hex_decoded("68756e746572322d"), Some("hunter2-".to_owned()));
        assert_eq!(hex_decoded("ff00ff00ff00ff00"), None, "not text");
        assert_eq!(base64_decoded("aHVudGVyMi1T+_"), None, "two alphabets");
        assert_eq!(
            base64_decoded("aHVudGVyMi1TdXAz===="),
            Some("hunter2-Sup3".to_owned())
        );
    }

    #[test]
    fn r34_visiting_stops_when_the_visitor_breaks() {
        let mut seen = 0;
        let flow = forms("a/bbbbbbbbbb/cccccccccc/dddddddddd", &mut |_, _| {
            seen += 1;
            if seen == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(flow, ControlFlow::Break(()));
        assert_eq!(seen, 2);
    }
}
