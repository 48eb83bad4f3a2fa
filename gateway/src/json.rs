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
        ambiguity: None,
        place: Vec::new(),
    };
    let value = reader.value(0)?;
    let ambiguity = reader.ambiguity.map(|mut ambiguity| {
        for segment in reader.place.iter().rev() {
            ambiguity.pointer.push('/');
            ambiguity.pointer.push_str(segment);
        }
        ambiguity
    });
    Ok(Read { value, ambiguity })
}

struct Reader<'a> {
    bytes: &'a [u8],
    text: &'a str,
    pos: usize,
    /// The first ambiguity found, its pointer still empty.
    ambiguity: Option<Ambiguity>,
    /// The place of the first ambiguity, innermost segment first: each
    /// array and object whose member held it adds its segment as the
    /// reading returns from it (no pointer is kept while reading).
    place: Vec<String>,
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
        let mut escaped = false;
        loop {
            match self.peek() {
                Some(b'"') => break,
                Some(b'\\') => {
                    escaped = true;
                    self.pos += 2;
                }
                Some(_) => self.pos += 1,
                None => return Err(invalid("unterminated string")),
            }
        }
        self.pos += 1;
        let quoted = self
            .text
            .get(start..self.pos)
            .ok_or_else(|| invalid("a string ends inside a character"))?;
        if !escaped {
            // serde_json has checked the text (no control characters in a
            // string): without escapes, a string is its characters.
            return Ok(quoted[1..quoted.len() - 1].to_owned());
        }
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
            let clear = self.ambiguity.is_none();
            items.push(self.value(depth)?);
            if clear && self.ambiguity.is_some() {
                self.place.push((items.len() - 1).to_string());
            }
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
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(invalid("expected a member name"));
            }
            let key = self.string()?;
            self.expect(b':')?;
            let clear = self.ambiguity.is_none();
            let value = self.value(depth)?;
            if clear && self.ambiguity.is_some() {
                self.place.push(key.replace('~', "~0").replace('/', "~1"));
            }
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
        // The object's own names, after its members (which come first in
        // document order).
        if self.ambiguity.is_none()
            && let Some((first, second)) = find_collision(&members)
        {
            self.ambiguity = Some(Ambiguity {
                pointer: String::new(),
                first: first.to_owned(),
                second: second.to_owned(),
            });
        }
        Ok(Json::Object(members))
    }
}

/// Objects with at most this many members are checked for colliding
/// names pair by pair, without allocating; larger ones through
/// [`casefold::find_collision`]'s table.
const PAIRWISE_MAX: usize = 16;

/// [`casefold::find_collision`] over the names of `members`: the first
/// name equal under Go's case folding to an earlier one, and that earlier
/// one.
fn find_collision(members: &[(String, Json)]) -> Option<(&str, &str)> {
    if members.len() > PAIRWISE_MAX {
        return casefold::find_collision(members.iter().map(|(k, _)| k.as_str()));
    }
    for (j, (second, _)) in members.iter().enumerate() {
        for (first, _) in &members[..j] {
            let equal = if first.is_ascii() && second.is_ascii() {
                first.eq_ignore_ascii_case(second)
            } else {
                casefold::equal_fold(first, second)
            };
            if equal {
                return Some((first, second));
            }
        }
    }
    None
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

/// A JSON string: serde_json's escaping (`\"`, `\\`, the short escapes of
/// `\b \f \n \r \t`, `\u00XX` for the other control characters), and the
/// line breaks outside ASCII that some readers split lines on (NEL, LS, PS)
/// escaped as well; written straight into `out`, in one pass.
pub(crate) fn write_string(s: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(s.len() + 2);
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let (escape, len): (&str, usize) = match b {
            b'"' => ("\\\"", 1),
            b'\\' => ("\\\\", 1),
            b'\n' => ("\\n", 1),
            b'\r' => ("\\r", 1),
            b'\t' => ("\\t", 1),
            0x08 => ("\\b", 1),
            0x0c => ("\\f", 1),
            0x00..=0x1f => ("", 1),
            // NEL (U+0085) is C2 85 in UTF-8; LS and PS (U+2028, U+2029)
            // are E2 80 A8 and E2 80 A9.
            0xc2 if bytes.get(i + 1) == Some(&0x85) => ("\\u0085", 2),
            0xe2 if bytes.get(i + 1) == Some(&0x80) && bytes.get(i + 2) == Some(&0xa8) => {
                ("\\u2028", 3)
            }
            0xe2 if bytes.get(i + 1) == Some(&0x80) && bytes.get(i + 2) == Some(&0xa9) => {
                ("\\u2029", 3)
            }
            _ => {
                i += 1;
                continue;
            }
        };
        // `i` is at the start of a character (ASCII, or a lead byte): the
        // run before it is whole characters.
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push_str(escape);
        }
        i += len;
        start = i;
    }
    out.push_str(&s[start..]);
    out.push('"');
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

    /// The escaping as it was written before it was done in one pass:
    /// serde_json's, then NEL, LS and PS.
    fn reference(s: &str) -> String {
        serde_json::to_string(s)
            .unwrap()
            .replace('\u{85}', "\\u0085")
            .replace('\u{2028}', "\\u2028")
            .replace('\u{2029}', "\\u2029")
    }

    #[test]
    fn r31_strings_are_written_as_serde_json_escapes_them_plus_line_breaks() {
        let mut samples: Vec<String> = (0u32..0x3000)
            .chain([0xfeff, 0xfffd, 0x1f600, 0x10ffff])
            .filter_map(char::from_u32)
            .map(|c| format!("a{c}b{c}"))
            .collect();
        samples.extend(
            [
                "",
                "plain",
                "\"\\/",
                "\u{85}\u{2028}\u{2029}\r\n\u{7f}\u{0}",
                "é\u{2028}é\u{85}\u{2029}\u{2027}\u{202a}\u{84}\u{86}",
                "\u{e2}\u{80}",
            ]
            .map(str::to_owned),
        );
        for sample in samples {
            let mut out = String::new();
            write_string(&sample, &mut out);
            assert_eq!(out, reference(&sample), "{sample:?}");
            assert!(!out.contains(['\r', '\n', '\u{85}', '\u{2028}', '\u{2029}']));
        }
    }

    #[test]
    fn r31_names_are_compared_pairwise_as_the_fold_table_compares_them() {
        let names = [
            "a", "A", "b", "path", "PATH", "paTh", "s", "ſ", "k", "K", "K", "ı", "I", "é", "É", "x",
        ];
        // Every pair and triple of the names, in every order.
        for a in names {
            for b in names {
                for c in names {
                    let members: Vec<(String, Json)> = [a, b, c]
                        .iter()
                        .map(|n| ((*n).to_owned(), Json::Null))
                        .collect();
                    assert_eq!(
                        find_collision(&members),
                        casefold::find_collision([a, b, c]),
                        "{a} {b} {c}"
                    );
                }
            }
        }
        // Larger objects go through the table.
        let mut members: Vec<(String, Json)> =
            (0..40).map(|i| (format!("m{i}"), Json::Null)).collect();
        assert_eq!(find_collision(&members), None);
        members.push(("M7".into(), Json::Null));
        assert_eq!(find_collision(&members), Some(("m7", "M7")));
    }
}
