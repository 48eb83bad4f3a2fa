//! I-JSON (RFC 7493) checking of call arguments, in one pass (R20).
//!
//! The mesh shows guards the arguments as text and the tool runs that same
//! text, so every mainstream parser must read it the same way, or a guard
//! judges one call while the tool runs another (a parser differential).
//! What this accepts is an I-JSON object:
//!
//! * JSON's grammar exactly (RFC 8259): no comments, no trailing commas, no
//!   `NaN`/`Infinity`, no raw control characters in strings, only JSON
//!   whitespace (a byte order mark or U+2028 before the object is refused);
//! * strings free of surrogates, escaped or not (a lone `\ud800` is
//!   refused, a correct pair is fine) and of Unicode noncharacters
//!   (U+FFFE, U+FFFF, U+FDD0..U+FDEF and the last two code points of each
//!   plane), as RFC 7493 section 2.1 requires;
//! * no object with two members of the same name, compared after
//!   unescaping (`"a"` and `"\u0061"` are the same name): parsers disagree
//!   on which one wins;
//! * nor with two names equal under case folding as Go's `encoding/json`
//!   matches them (`path` and `PATH`, `s` and `ſ`, `k` and the Kelvin
//!   sign, see `guardmesh_client::casefold`): that reader takes them for
//!   one member (R20). Not an I-JSON rule, but refused alike and with its
//!   own metrics label;
//! * numbers that an IEEE 754 double holds: a number whose magnitude
//!   overflows a double (`1e400`, a 401-digit integer) is refused, as is a
//!   number written with more than [`MAX_NUMBER_CHARS`] characters. Within
//!   that, integers beyond 2^53 and long fractions are accepted: every
//!   mainstream parser reads them, some with a double's precision only, and
//!   RFC 7493 asks receivers not to expect more (section 2.2);
//! * nesting of at most the configured number of arrays and objects (the
//!   top-level object counts as one);
//! * an object at the top level. The empty text (or only JSON whitespace)
//!   stands for `{}`, as the protocol says.
//!
//! The text of a protobuf `string` field is already valid UTF-8, so raw
//! surrogates cannot occur. On the happy path nothing is allocated except
//! the member-name list (one `Vec` per call, grown only by objects with many
//! members); names are decoded into a `String` only when they contain
//! escapes. Duplicate names are found per object by sorting its names when
//! it closes, so an object with many members costs `n log n`, not `n²`.

use guardmesh_client::casefold;
use std::borrow::Cow;
use std::fmt;

/// The longest number accepted, in characters. A double needs at most 17
/// significant digits; this leaves room for integers of any common width
/// (a 128-bit integer has 39 digits) and refuses absurd digit strings,
/// which some parsers refuse (Python's integer conversion above 4,300
/// digits, Jackson above 1,000 characters) and others read differently.
pub(crate) const MAX_NUMBER_CHARS: usize = 100;

/// The deepest nesting the mesh can be configured to accept: serde_json's
/// default recursion limit reads at most 127 nested arrays and objects, and
/// the Rust guards of this project parse with serde_json.
pub(crate) const MAX_DEPTH_LIMIT: usize = 127;

/// What makes a text not an I-JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Problem {
    /// Not JSON at all: `expected` says what the grammar wanted.
    Syntax {
        offset: usize,
        expected: &'static str,
    },
    /// Valid JSON, but the top level is not an object.
    NotObject,
    /// Two members of one object have this name.
    DuplicateName(String),
    /// Two member names of one object are one under case folding (the
    /// earlier first).
    CaseCollision(String, String),
    /// A number a double cannot hold.
    NumberOutOfRange,
    /// A number longer than [`MAX_NUMBER_CHARS`].
    NumberTooLong,
    /// A `\uXXXX` escape of a surrogate that is not half of a pair.
    LoneSurrogate(u16),
    /// A noncharacter code point in a string.
    Noncharacter(u32),
    /// More nested arrays and objects than the limit.
    TooDeep(usize),
}

/// Why a text is not an I-JSON object, and where: a JSONPath-like location
/// (`$`, `$.a[3]`, `$["odd key"]`) of the value at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JsonError {
    pub problem: Problem,
    /// Path segments, innermost first (filled in while unwinding).
    path: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// The member names a scan has room for before its list grows.
const NAMES_ROOM: usize = 8;

/// Objects with at most this many members are checked for duplicate names
/// pair by pair; larger ones are sorted.
const SMALL_OBJECT: usize = 12;

/// Longest member name shown in a message, in characters.
const SHOWN_NAME_CHARS: usize = 40;
/// Most path segments shown in a message (the innermost are kept).
const SHOWN_SEGMENTS: usize = 8;

/// `text` cut to `max` characters, with `...` when cut.
pub(crate) fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

impl JsonError {
    fn new(problem: Problem) -> Self {
        Self {
            problem,
            path: Vec::new(),
        }
    }

    /// The location of the fault, as `$.a[3]`, shortened when deep or long.
    pub(crate) fn path(&self) -> String {
        let mut out = String::from("$");
        let shown = self.path.len().min(SHOWN_SEGMENTS);
        if shown < self.path.len() {
            out.push_str("...");
        }
        for segment in self.path[..shown].iter().rev() {
            match segment {
                Segment::Index(i) => out.push_str(&format!("[{i}]")),
                Segment::Key(k)
                    if !k.is_empty()
                        && k.len() <= SHOWN_NAME_CHARS
                        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') =>
                {
                    out.push('.');
                    out.push_str(k);
                }
                Segment::Key(k) => out.push_str(&format!("[{:?}]", clip(k, SHOWN_NAME_CHARS))),
            }
        }
        out
    }

    /// Metrics label for the refusal.
    pub(crate) fn reason(&self) -> &'static str {
        match self.problem {
            Problem::Syntax { .. } | Problem::NotObject => "arguments_not_object",
            Problem::CaseCollision(..) => "arguments_case_collision",
            _ => "arguments_not_i_json",
        }
    }
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.problem {
            Problem::Syntax { offset, expected } => {
                return write!(f, "not valid JSON at byte {offset}: expected {expected}");
            }
            Problem::NotObject => return write!(f, "not a JSON object"),
            Problem::DuplicateName(name) => write!(
                f,
                "duplicate member name {:?}",
                clip(name, SHOWN_NAME_CHARS)
            )?,
            Problem::CaseCollision(first, second) => write!(
                f,
                "member names {:?} and {:?} are one name under case folding \
                 (Go's encoding/json reads them as one)",
                clip(first, SHOWN_NAME_CHARS),
                clip(second, SHOWN_NAME_CHARS)
            )?,
            Problem::NumberOutOfRange => write!(f, "number out of range of a double")?,
            Problem::NumberTooLong => {
                write!(f, "number longer than {MAX_NUMBER_CHARS} characters")?
            }
            Problem::LoneSurrogate(unit) => write!(f, "lone surrogate \\u{unit:04x}")?,
            Problem::Noncharacter(cp) => write!(f, "noncharacter U+{cp:04X} in a string")?,
            Problem::TooDeep(limit) => write!(f, "nesting deeper than {limit}")?,
        }
        write!(f, " at {}", self.path())
    }
}

impl std::error::Error for JsonError {}

/// The top-level members of the arguments of a batch's calls, as
/// [`check_recording`] found them: where each name and value are in the
/// text, and the items of the largest array or object, so that a policy
/// guard (R27) reads the checked text without scanning it again. One vector
/// for the whole batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    list: Vec<Member>,
    /// Per call, in the order recorded: its members in `list`, and its
    /// largest collection.
    calls: Vec<(usize, usize, usize)>,
    /// Only the largest collections are recorded, not the members (see
    /// [`Recorded::largest_only`]).
    largest_only: bool,
}

impl Recorded {
    /// Room for `calls` calls of a few members each.
    pub(crate) fn with_calls(calls: usize) -> Self {
        Self {
            list: Vec::with_capacity(calls.saturating_mul(8)),
            calls: Vec::with_capacity(calls),
            largest_only: false,
        }
    }

    /// Records of `calls` calls their largest collection only (for policies
    /// that read no arguments, R27): [`Recorded::call`] is then `None`.
    pub(crate) fn largest_only(calls: usize) -> Self {
        Self {
            list: Vec::new(),
            calls: Vec::with_capacity(calls),
            largest_only: true,
        }
    }

    /// The items of the largest array or object of the `i`th call recorded,
    /// its top level included.
    pub fn largest(&self, i: usize) -> Option<usize> {
        self.calls.get(i).map(|&(_, _, largest)| largest)
    }

    /// Checks each of `texts` as the mesh checks call arguments (R20, at
    /// the deepest nesting it can be configured to accept) and records
    /// their members, in order; `None` if one is not an I-JSON object.
    pub fn of_arguments<'t>(texts: impl IntoIterator<Item = &'t str>) -> Option<Self> {
        let mut recorded = Self::default();
        for text in texts {
            check_recording(text, MAX_DEPTH_LIMIT, &mut recorded).ok()?;
        }
        Some(recorded)
    }

    /// The members of the `i`th call recorded; `None` when only the largest
    /// collections were.
    pub fn call(&self, i: usize) -> Option<Members<'_>> {
        if self.largest_only {
            return None;
        }
        let &(start, end, largest) = self.calls.get(i)?;
        Some(Members {
            list: self.list.get(start..end)?,
            largest,
        })
    }
}

/// One call's top-level argument members (see [`Recorded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Members<'a> {
    pub(crate) list: &'a [Member],
    /// The items of the largest array or object, the top level included.
    pub(crate) largest: usize,
}

/// One top-level member (see [`Recorded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Member {
    /// The name's text between its quotes, as byte offsets.
    pub(crate) name: (usize, usize),
    /// Whether the name has escapes (its text is not the name itself).
    pub(crate) name_escaped: bool,
    /// The value's text, from its first byte to its last.
    pub(crate) value: (usize, usize),
    /// Whether a string in the value has escapes (a string value without
    /// them is its text between the quotes).
    pub(crate) value_escaped: bool,
}

/// Whether `text` is an I-JSON object nested at most `max_depth` deep; the
/// empty text (or only whitespace) counts as `{}`.
pub(crate) fn check(text: &str, max_depth: usize) -> Result<(), JsonError> {
    scan(text, max_depth, None).map(|_| ())
}

/// [`check`], recording the object's top-level members in `recorded` on
/// the way (nothing, if the text is refused).
pub(crate) fn check_recording(
    text: &str,
    max_depth: usize,
    recorded: &mut Recorded,
) -> Result<(), JsonError> {
    let start = recorded.list.len();
    let members = (!recorded.largest_only).then_some(&mut recorded.list);
    match scan(text, max_depth, members) {
        Ok(largest) => {
            recorded.calls.push((start, recorded.list.len(), largest));
            Ok(())
        }
        Err(error) => {
            recorded.list.truncate(start);
            Err(error)
        }
    }
}

/// The check; the items of the largest array or object.
fn scan(
    text: &str,
    max_depth: usize,
    members: Option<&mut Vec<Member>>,
) -> Result<usize, JsonError> {
    let mut scanner = Scanner {
        text,
        bytes: text.as_bytes(),
        pos: 0,
        // The scanner recurses once per level: never deeper than this.
        max_depth: max_depth.min(MAX_DEPTH_LIMIT),
        // Room for the names of a typical call's arguments: one allocation
        // per call rather than a first one and its regrowth.
        names: Vec::with_capacity(NAMES_ROOM),
        members,
        largest: 0,
        escapes: 0,
    };
    scanner.skip_ws();
    if scanner.pos == scanner.bytes.len() {
        return Ok(0);
    }
    if scanner.bytes[scanner.pos] != b'{' {
        // Tell "valid JSON, but not an object" from "not JSON" when cheap.
        return Err(match scanner.value(1) {
            Ok(()) => {
                scanner.skip_ws();
                if scanner.pos == scanner.bytes.len() {
                    JsonError::new(Problem::NotObject)
                } else {
                    scanner.syntax("end of text")
                }
            }
            Err(error) if matches!(error.problem, Problem::Syntax { .. }) => error,
            Err(_) => JsonError::new(Problem::NotObject),
        });
    }
    scanner.value(1)?;
    scanner.skip_ws();
    if scanner.pos != scanner.bytes.len() {
        return Err(scanner.syntax("end of text"));
    }
    Ok(scanner.largest)
}

struct Scanner<'a, 'm> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    max_depth: usize,
    /// Member names of the objects open on the current path, outermost
    /// first; each object knows where its own start.
    names: Vec<Cow<'a, str>>,
    /// Where the top-level members are recorded, if asked.
    members: Option<&'m mut Vec<Member>>,
    /// The items of the largest array or object so far.
    largest: usize,
    /// Escapes seen in strings so far.
    escapes: usize,
}

/// Bytes that end the fast run inside a string: the quote, the backslash,
/// control characters, and lead bytes of code points that may be
/// noncharacters (U+FDD0.. and U+FFFE.. start with 0xEF; the planes above
/// the first start with 0xF0..0xF4).
static STRING_STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = true;
        b += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table[0xEF] = true;
    let mut b = 0xF0;
    while b <= 0xF4 {
        table[b] = true;
        b += 1;
    }
    table
};

/// Whether Go's `encoding/json` reads `a` and `b` as one member name.
fn same_fold(a: &str, b: &str) -> bool {
    if a.is_ascii() && b.is_ascii() {
        a.eq_ignore_ascii_case(b)
    } else {
        casefold::equal_fold(a, b)
    }
}

/// Two of one object's member names (all distinct) that are one under
/// case folding; for a small object the earlier one first.
fn case_collision(names: &[Cow<'_, str>]) -> Option<(String, String)> {
    if names.len() <= SMALL_OBJECT {
        return (1..names.len()).find_map(|j| {
            names[..j]
                .iter()
                .find(|n| same_fold(n, &names[j]))
                .map(|n| (n.to_string(), names[j].to_string()))
        });
    }
    // Many members: sort their folds (a name that folds to itself is
    // borrowed) and compare neighbours.
    let mut folded: Vec<(Cow<'_, str>, usize)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let fold = if name.chars().all(|c| casefold::fold_char(c) == c) {
                Cow::Borrowed(name.as_ref())
            } else {
                Cow::Owned(casefold::fold(name))
            };
            (fold, i)
        })
        .collect();
    folded.sort_unstable();
    folded
        .windows(2)
        .find(|w| w[0].0 == w[1].0)
        .map(|w| (names[w[0].1].to_string(), names[w[1].1].to_string()))
}

fn is_noncharacter(cp: u32) -> bool {
    (0xFDD0..=0xFDEF).contains(&cp) || (cp & 0xFFFE) == 0xFFFE
}

fn hex(b: u8) -> Option<u16> {
    match b {
        b'0'..=b'9' => Some(u16::from(b - b'0')),
        b'a'..=b'f' => Some(u16::from(b - b'a' + 10)),
        b'A'..=b'F' => Some(u16::from(b - b'A' + 10)),
        _ => None,
    }
}

impl<'a> Scanner<'a, '_> {
    fn syntax(&self, expected: &'static str) -> JsonError {
        JsonError::new(Problem::Syntax {
            offset: self.pos,
            expected,
        })
    }

    fn skip_ws(&mut self) {
        let rest = &self.bytes[self.pos..];
        self.pos += rest
            .iter()
            .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .unwrap_or(rest.len());
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    /// One value at nesting `depth` (the depth a container here would have).
    fn value(&mut self, depth: usize) -> Result<(), JsonError> {
        match self.peek() {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.string(false).map(|_| ()),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            _ => Err(self.syntax("a value")),
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), JsonError> {
        if self.bytes[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.syntax("a value"))
        }
    }

    fn enter(&self, depth: usize) -> Result<(), JsonError> {
        if depth > self.max_depth {
            Err(JsonError::new(Problem::TooDeep(self.max_depth)))
        } else {
            Ok(())
        }
    }

    fn object(&mut self, depth: usize) -> Result<(), JsonError> {
        self.enter(depth)?;
        self.pos += 1; // '{'
        let start = self.names.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(self.syntax("a member name"));
            }
            let name_start = self.pos + 1;
            let name = self.string(true)?;
            let name_end = self.pos - 1;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.syntax("':'"));
            }
            self.pos += 1;
            self.skip_ws();
            let value_start = self.pos;
            let escapes_before = self.escapes;
            if let Err(mut error) = self.value(depth + 1) {
                error.path.push(Segment::Key(name.into_owned()));
                return Err(error);
            }
            if depth == 1
                && let Some(members) = self.members.as_deref_mut()
            {
                members.push(Member {
                    name: (name_start, name_end),
                    name_escaped: matches!(name, Cow::Owned(_)),
                    value: (value_start, self.pos),
                    value_escaped: self.escapes != escapes_before,
                });
            }
            self.names.push(name);
            if !self.another(b'}', "',' or '}'")? {
                break;
            }
        }
        let names = &mut self.names[start..];
        self.largest = self.largest.max(names.len());
        // The usual object: a few ASCII names, no two alike under ASCII
        // case folding, so none equal either: one pass over the pairs
        // (most differ in length) clears it of both faults. Otherwise the
        // checks below tell which fault it is.
        if names.len() <= SMALL_OBJECT
            && names.iter().all(|n| n.is_ascii())
            && !(1..names.len())
                .any(|j| names[..j].iter().any(|n| n.eq_ignore_ascii_case(&names[j])))
        {
            self.names.truncate(start);
            return Ok(());
        }
        let duplicate = if names.len() <= SMALL_OBJECT {
            // Few members: compare each pair, in order.
            (1..names.len()).find_map(|j| names[..j].iter().find(|n| **n == names[j]))
        } else {
            names.sort_unstable();
            names.windows(2).find(|w| w[0] == w[1]).map(|w| &w[0])
        };
        if let Some(name) = duplicate {
            return Err(JsonError::new(Problem::DuplicateName(
                name.clone().into_owned(),
            )));
        }
        if let Some((first, second)) = case_collision(names) {
            return Err(JsonError::new(Problem::CaseCollision(first, second)));
        }
        self.names.truncate(start);
        Ok(())
    }

    fn array(&mut self, depth: usize) -> Result<(), JsonError> {
        self.enter(depth)?;
        self.pos += 1; // '['
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(());
        }
        let mut index = 0;
        loop {
            if let Err(mut error) = self.value(depth + 1) {
                error.path.push(Segment::Index(index));
                return Err(error);
            }
            index += 1;
            if !self.another(b']', "',' or ']'")? {
                self.largest = self.largest.max(index);
                return Ok(());
            }
        }
    }

    /// After a member or an element: `true` past a `,` (another follows),
    /// `false` past `close` (the last one); anything else is a syntax
    /// error, `expected` naming what was not found.
    fn another(&mut self, close: u8, expected: &'static str) -> Result<bool, JsonError> {
        self.skip_ws();
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                self.skip_ws();
                Ok(true)
            }
            Some(byte) if byte == close => {
                self.pos += 1;
                Ok(false)
            }
            _ => Err(self.syntax(expected)),
        }
    }

    fn number(&mut self) -> Result<(), JsonError> {
        let start = self.pos;
        let mut exponent = false;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.syntax("a digit")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.syntax("a digit"));
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            exponent = true;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.syntax("a digit"));
            }
            self.digits();
        }
        let token = &self.text[start..self.pos];
        if token.len() > MAX_NUMBER_CHARS {
            return Err(JsonError::new(Problem::NumberTooLong));
        }
        // Without an exponent, at most MAX_NUMBER_CHARS digits stay far
        // below a double's largest value (about 1.8e308): only numbers with
        // an exponent can overflow.
        if exponent && !token.parse::<f64>().is_ok_and(f64::is_finite) {
            return Err(JsonError::new(Problem::NumberOutOfRange));
        }
        Ok(())
    }

    fn digits(&mut self) {
        let rest = &self.bytes[self.pos..];
        self.pos += rest
            .iter()
            .position(|b| !b.is_ascii_digit())
            .unwrap_or(rest.len());
    }

    fn hex4(&mut self) -> Result<u16, JsonError> {
        let mut unit = 0u16;
        for _ in 0..4 {
            let digit = self
                .peek()
                .and_then(hex)
                .ok_or_else(|| self.syntax("a hex digit"))?;
            unit = unit << 4 | digit;
            self.pos += 1;
        }
        Ok(unit)
    }

    /// One string. With `keep`, returns its text (decoded, allocating, only
    /// when it has escapes); otherwise only checks it and returns "".
    fn string(&mut self, keep: bool) -> Result<Cow<'a, str>, JsonError> {
        self.pos += 1; // '"'
        let start = self.pos;
        let mut decoded: Option<String> = None;
        let mut run = start; // start of the raw text not yet copied
        loop {
            self.skip_plain_ascii();
            // The word that stopped the fast scan, byte by byte.
            let rest = &self.bytes[self.pos..];
            let window = &rest[..rest.len().min(8)];
            match window.iter().position(|&b| STRING_STOP[b as usize]) {
                Some(at) => self.pos += at,
                None => {
                    self.pos += window.len();
                    if !window.is_empty() {
                        continue; // back to the word-at-a-time scan
                    }
                }
            }
            let Some(b) = self.peek() else {
                return Err(self.syntax("'\"'"));
            };
            match b {
                b'"' => {
                    let end = self.pos;
                    self.pos += 1;
                    if !keep {
                        return Ok(Cow::Borrowed(""));
                    }
                    return Ok(match decoded {
                        None => Cow::Borrowed(&self.text[start..end]),
                        Some(mut s) => {
                            s.push_str(&self.text[run..end]);
                            Cow::Owned(s)
                        }
                    });
                }
                b'\\' => {
                    self.escapes += 1;
                    let raw_end = self.pos;
                    self.pos += 1;
                    let simple = match self.peek() {
                        Some(b'"') => Some('"'),
                        Some(b'\\') => Some('\\'),
                        Some(b'/') => Some('/'),
                        Some(b'b') => Some('\u{8}'),
                        Some(b'f') => Some('\u{c}'),
                        Some(b'n') => Some('\n'),
                        Some(b'r') => Some('\r'),
                        Some(b't') => Some('\t'),
                        Some(b'u') => None,
                        _ => return Err(self.syntax("an escape character")),
                    };
                    self.pos += 1;
                    let ch = match simple {
                        Some(ch) => ch,
                        None => self.unicode_escape()?,
                    };
                    if keep {
                        let out = decoded.get_or_insert_with(String::new);
                        out.push_str(&self.text[run..raw_end]);
                        out.push(ch);
                        run = self.pos;
                    }
                }
                0..0x20 => return Err(self.syntax("no control character in a string")),
                _ => {
                    // A lead byte of a code point at U+F000 or above: the
                    // text is valid UTF-8, so decode that one character.
                    let ch = self
                        .text
                        .get(self.pos..)
                        .and_then(|rest| rest.chars().next())
                        .ok_or_else(|| self.syntax("'\"'"))?;
                    if is_noncharacter(u32::from(ch)) {
                        return Err(JsonError::new(Problem::Noncharacter(u32::from(ch))));
                    }
                    self.pos += ch.len_utf8();
                }
            }
        }
    }

    /// Skips, eight bytes at a time, string content that is plain ASCII: no
    /// quote, backslash, control character or non-ASCII byte.
    fn skip_plain_ascii(&mut self) {
        const ONES: u64 = u64::from_le_bytes([0x01; 8]);
        const HIGH: u64 = u64::from_le_bytes([0x80; 8]);
        const QUOTES: u64 = u64::from_le_bytes([b'"'; 8]);
        const BACKSLASHES: u64 = u64::from_le_bytes([b'\\'; 8]);
        const SPACES: u64 = u64::from_le_bytes([0x20; 8]);
        let has_zero_byte = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
        for chunk in self.bytes[self.pos..].chunks_exact(8) {
            let Ok(word) = <[u8; 8]>::try_from(chunk) else {
                break;
            };
            let w = u64::from_le_bytes(word);
            // Bytes below 0x20 (w - 0x20 borrows), non-ASCII bytes (high
            // bit), quotes and backslashes.
            let special = (w.wrapping_sub(SPACES) & !w & HIGH)
                | (w & HIGH)
                | has_zero_byte(w ^ QUOTES)
                | has_zero_byte(w ^ BACKSLASHES);
            if special != 0 {
                break;
            }
            self.pos += 8;
        }
    }

    /// After `\u`: four hex digits, and a second escape when they are a
    /// high surrogate.
    fn unicode_escape(&mut self) -> Result<char, JsonError> {
        let unit = self.hex4()?;
        let cp = match unit {
            0xD800..=0xDBFF => {
                if !self.bytes[self.pos..].starts_with(b"\\u") {
                    return Err(JsonError::new(Problem::LoneSurrogate(unit)));
                }
                self.pos += 2;
                let low = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(JsonError::new(Problem::LoneSurrogate(unit)));
                }
                0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(JsonError::new(Problem::LoneSurrogate(unit))),
            _ => u32::from(unit),
        };
        if is_noncharacter(cp) {
            return Err(JsonError::new(Problem::Noncharacter(cp)));
        }
        char::from_u32(cp).ok_or(JsonError::new(Problem::LoneSurrogate(unit)))
    }
}
