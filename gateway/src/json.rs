//! JSON as the gateway reads and writes it: parsed once into a tree that
//! keeps what a relay must not change (members in their order, each number
//! as its text, unknown members), with everything peers could read
//! differently found on the way, and written out again in one canonical
//! form.
//!
//! Reading ([`read`]): the text is first checked by `serde_json` (strict
//! RFC 8259: no trailing commas, comments, control characters in strings,
//! invalid UTF-8; nesting at most [`MAX_DEPTH`]), then split into the
//! tree, string by string decoded by `serde_json` (so an unpaired surrogate
//! escape is refused). Every object's member names are compared as Go's
//! `encoding/json` compares them ([`guardmesh_client::casefold`]): two
//! names equal, or equal under case folding (`path` and `PATH`, `params`
//! and `paramſ`), are reported as the [`Ambiguity`] of the message, with
//! the object's place.
//!
//! Writing ([`Json::write`]): no whitespace, members in their order,
//! numbers as read, strings as `serde_json` escapes them plus U+0085,
//! U+2028 and U+2029 as `\u` escapes. What the gateway writes therefore
//! holds no byte any peer frames on but the final newline: no CR, no NEL,
//! no line or paragraph separator, whatever line breaks the client sent
//! inside its strings.
//!
//! Why not `serde_json::Value`: without `arbitrary_precision` it turns
//! every number into an `f64` or a 64-bit integer (`1.50` becomes `1.5`,
//! `12345678901234567890123` loses digits), and it keeps one member of two
//! of a name, silently. `arbitrary_precision` would change how every crate
//! of the build reads numbers through `serde_json` (features are unified),
//! so the gateway keeps numbers as text in its own small tree instead.

use guardmesh_client::casefold;
use std::fmt::Write as _;

/// Deepest nesting of arrays and objects read in one message (serde_json's
/// own recursion limit): deeper is refused as not readable.
pub const MAX_DEPTH: usize = 128;

/// A JSON value as read: members in order (repeats kept, to be refused),
/// numbers as their text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Json {
    Null,
    Bool(bool),
    /// A number, exactly as written (valid JSON number syntax).
    Number(String),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

/// Why a text is not JSON the gateway can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyntaxError {
    #[error("{0}")]
    Invalid(String),
    #[error("nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
}

/// Two member names of one object that peers read differently: equal, or
/// equal under Go's case folding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ambiguity {
    /// The object's place, a JSON Pointer (`""`: the message itself).
    pub pointer: String,
    pub first: String,
    pub second: String,
}

impl std::fmt::Display for Ambiguity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.pointer.is_empty() {
            "in the message".to_owned()
        } else {
            format!("in the object at {:?}", self.pointer)
        };
        if self.first == self.second {
            write!(
                f,
                "member name {:?} appears twice {at} (peers disagree on which counts)",
                self.first
            )
        } else {
            write!(
                f,
                "member names {:?} and {:?} {at} are one name to a case-insensitive reader \
                 (Go's encoding/json reads them as one member)",
                self.first, self.second
            )
        }
    }
}

/// A text read: the tree, and the first ambiguity found in it (in document
/// order), if any.
#[derive(Debug)]
pub struct Read {
    pub value: Json,
    pub ambiguity: Option<Ambiguity>,
}

/// Reads one JSON text.
pub fn read(text: &str) -> Result<Read, SyntaxError> {
    // Strict validation first, by serde_json; the splitter below then only
    // meets valid JSON.
    serde_json::from_str::<serde::de::IgnoredAny>(text)
        .map_err(|e| SyntaxError::Invalid(e.to_string()))?;
    let mut reader = Reader {
        bytes: text.as_bytes(),
        text,
        pos: 0,
        pointer: String::new(),
        ambiguity: None,
    };
    let value = reader.value(0)?;
    Ok(Read {
        value,
        ambiguity: reader.ambiguity,
    })
}

struct Reader<'a> {
    bytes: &'a [u8],
    text: &'a str,
    pos: usize,
    pointer: String,
    ambiguity: Option<Ambiguity>,
}

fn invalid(what: &str) -> SyntaxError {
    SyntaxError::Invalid(what.to_owned())
}

impl Reader<'_> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn expect(&mut self, byte: u8) -> Result<(), SyntaxError> {
        self.skip_ws();
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(invalid("unexpected character"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, SyntaxError> {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Json::String),
            Some(b't') => self.literal("true", Json::Bool(true)),
            Some(b'f') => self.literal("false", Json::Bool(false)),
            Some(b'n') => self.literal("null", Json::Null),
            Some(b'-' | b'0'..=b'9') => {
                let start = self.pos;
                while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = self.peek() {
                    self.pos += 1;
                }
                Ok(Json::Number(self.text[start..self.pos].to_owned()))
            }
            _ => Err(invalid("expected a value")),
        }
    }

    fn literal(&mut self, word: &str, value: Json) -> Result<Json, SyntaxError> {
        if self.text[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(invalid("expected a literal"))
        }
    }

    fn string(&mut self) -> Result<String, SyntaxError> {
        let start = self.pos;
        self.pos += 1;
        loop {
            match self.peek() {
                Some(b'"') => break,
                Some(b'\\') => self.pos += 2,
                Some(_) => self.pos += 1,
                None => return Err(invalid("unterminated string")),
            }
        }
        self.pos += 1;
        let quoted = self
            .text
            .get(start..self.pos)
            .ok_or_else(|| invalid("a string ends inside a character"))?;
        serde_json::from_str::<String>(quoted).map_err(|e| SyntaxError::Invalid(e.to_string()))
    }

    fn array(&mut self, depth: usize) -> Result<Json, SyntaxError> {
        if depth > MAX_DEPTH {
            return Err(SyntaxError::TooDeep);
        }
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Json::Array(items));
        }
        loop {
            let len = self.pointer.len();
            let _ = write!(self.pointer, "/{}", items.len());
            items.push(self.value(depth)?);
            self.pointer.truncate(len);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Json::Array(items));
                }
                _ => return Err(invalid("expected , or ]")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Json, SyntaxError> {
        if depth > MAX_DEPTH {
            return Err(SyntaxError::TooDeep);
        }
        self.pos += 1;
        let mut members: Vec<(String, Json)> = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Json::Object(members));
        }
        // The object's place, for an ambiguity in its own names (found
        // after its members, which come first in document order).
        let here = self.pointer.clone();
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(invalid("expected a member name"));
            }
            let key = self.string()?;
            self.expect(b':')?;
            let len = self.pointer.len();
            self.pointer.push('/');
            self.pointer
                .push_str(&key.replace('~', "~0").replace('/', "~1"));
            let value = self.value(depth)?;
            self.pointer.truncate(len);
            members.push((key, value));
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(invalid("expected , or }")),
            }
        }
        if self.ambiguity.is_none()
            && let Some((first, second)) =
                casefold::find_collision(members.iter().map(|(k, _)| k.as_str()))
        {
            self.ambiguity = Some(Ambiguity {
                pointer: here,
                first: first.to_owned(),
                second: second.to_owned(),
            });
        }
        Ok(Json::Object(members))
    }
}

impl Json {
    /// The canonical text: see the module's documentation.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    /// Appends the canonical text to `out`.
    pub fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(true) => out.push_str("true"),
            Json::Bool(false) => out.push_str("false"),
            Json::Number(text) => out.push_str(text),
            Json::String(s) => write_string(s, out),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Json::Object(members) => {
                out.push('{');
                for (i, (key, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_string(key, out);
                    out.push(':');
                    value.write(out);
                }
                out.push('}');
            }
        }
    }

    /// The member `key` of an object (the first one of that name).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Replaces (or appends) member `key` of an object.
    pub fn set(&mut self, key: &str, value: Json) {
        if let Json::Object(members) = self {
            match members.iter_mut().find(|(k, _)| k == key) {
                Some((_, v)) => *v = value,
                None => members.push((key.to_owned(), value)),
            }
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }
}

/// A JSON string: serde_json's escaping, and the line breaks outside ASCII
/// that some readers split lines on (NEL, LS, PS) escaped as well.
fn write_string(s: &str, out: &mut String) {
    // A String always serializes.
    let quoted = serde_json::to_string(s).unwrap_or_default();
    if quoted.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
        for c in quoted.chars() {
            match c {
                '\u{85}' => out.push_str("\\u0085"),
                '\u{2028}' => out.push_str("\\u2028"),
                '\u{2029}' => out.push_str("\\u2029"),
                c => out.push(c),
            }
        }
    } else {
        out.push_str(&quoted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_order_and_unknown_members_are_kept() {
        let text = r#"{ "b" : 1.50, "a":[12345678901234567890123, -0, 1E+2, 1e-400],"z":{"y":null,"x":true}}"#;
        let read = read(text).unwrap();
        assert_eq!(read.ambiguity, None);
        assert_eq!(
            read.value.to_text(),
            r#"{"b":1.50,"a":[12345678901234567890123,-0,1E+2,1e-400],"z":{"y":null,"x":true}}"#
        );
    }

    #[test]
    fn line_breaks_never_leave_raw() {
        let text = "{\"a\":\r\n\t\"x\u{2028}y\u{2029}z\u{85}\\r\\n\"}";
        let out = read(text).unwrap().value.to_text();
        assert_eq!(out, r#"{"a":"x\u2028y\u2029z\u0085\r\n"}"#);
        assert!(!out.contains(['\r', '\n', '\u{85}', '\u{2028}', '\u{2029}']));
        let back: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(back["a"], "x\u{2028}y\u{2029}z\u{85}\r\n");
    }

    #[test]
    fn repeated_and_folded_names_are_found_with_their_place() {
        let a = read(r#"{"a":{"b":[0,{"x":1,"x":2}]}}"#).unwrap();
        let found = a.ambiguity.unwrap();
        assert_eq!(found.pointer, "/a/b/1");
        assert!(found.to_string().contains("appears twice"), "{found}");
        let b = read(r#"{"params":{},"paramſ":{}}"#)
            .unwrap()
            .ambiguity
            .unwrap();
        assert_eq!((b.pointer.as_str(), b.second.as_str()), ("", "paramſ"));
        let c = read(r#"{"a/b~":{"mask":1,"MAS\u212a":2}}"#)
            .unwrap()
            .ambiguity
            .unwrap();
        assert_eq!(c.pointer, "/a~1b~0");
        assert!(read(r#"{"a":1,"b":{"a":1}}"#).unwrap().ambiguity.is_none());
    }

    #[test]
    fn not_json_is_refused() {
        for text in [
            "",
            "{",
            "{\"a\":1,}",
            "[1 2]",
            "{\"a\":\"\\ud800\"}",
            "{\"a\":\"\t\"}",
            "// x\n{}",
            "{} {}",
            "NaN",
        ] {
            assert!(read(text).is_err(), "{text:?}");
        }
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(read(&deep).is_err());
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(read(&ok).is_ok());
    }

    #[test]
    fn escapes_are_decoded_once() {
        let read = read(r#"{"p\u0061th":"a\"b\\c\/d\u00e9\ud83d\ude00"}"#).unwrap();
        assert_eq!(
            read.value.get("path").and_then(Json::as_str),
            Some("a\"b\\c/d\u{e9}\u{1f600}")
        );
    }
}
