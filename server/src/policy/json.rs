//! A call's arguments as the fast evaluator (`plan`) reads them: JSON parsed
//! once per batch into a small borrowed tree, strings without escapes
//! borrowed from the text, objects as key/value lists in the order written.
//!
//! Arguments the mesh has checked as an I-JSON object (R20) are read from
//! what the check recorded of their top-level members
//! ([`Json::from_members`]): strings without escapes borrowed as they are,
//! plain integers read at once, and a nested array or object (whose items
//! the check counted for the cost bounds) parsed when a rule first reads
//! it. Rules that never look into `call.args.options` do not pay for it.
//!
//! Numbers become what they become in CEL (see `input`): an integer is an
//! `int` (a `uint` above `int`'s range), any other number a `double`.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::validate::ijson::{self, Member, Members, Recorded};

/// One JSON value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(Cow<'a, str>),
    List(Vec<Json<'a>>),
    /// An object: keys are unique (R20's I-JSON check refuses duplicates;
    /// parsed JSON cannot hold them).
    Map(Object<'a>),
}

/// The members the arguments' top-level object has room for before it grows
/// (the parser does not know their number beforehand). Only the top level:
/// there is one per call, while nested objects are as many as the text
/// makes them, and room given to each of a million `{}` would be memory a
/// peer could make the mesh hold for nothing.
const MEMBERS: usize = 8;

/// Objects with more members than this are looked up through their keys
/// sorted (a binary search); smaller ones by a scan.
const SCANNED: usize = 16;

/// An object's members in the order written, and for a large object their
/// positions sorted by key, so that no lookup is a scan of thousands of
/// members (a rule looking up every member of a huge object would be
/// quadratic).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Object<'a> {
    fields: Vec<(Cow<'a, str>, Slot<'a>)>,
    /// Positions in `fields`, sorted by key; empty for small objects.
    by_key: Vec<u32>,
}

/// A member's value: parsed, or (a nested array or object of checked
/// arguments, see [`Json::from_checked`]) its text, parsed when first read.
#[derive(Debug, Clone, PartialEq)]
enum Slot<'a> {
    Ready(Json<'a>),
    Later {
        /// The value's JSON text, from its first byte to its last.
        text: &'a str,
        /// The value once read, owning its strings (a value borrowing from
        /// `text` here would make every `Json` invariant in its lifetime);
        /// `None` if the text did not parse, or an object in it repeats a
        /// key (neither happens to checked arguments).
        value: OnceCell<Option<Json<'static>>>,
    },
}

/// A member whose text did not parse when read (see [`Slot`]): the fast
/// path is then unsure, and the interpreter judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unparsed;

impl<'a> Slot<'a> {
    fn value(&self) -> Result<&Json<'a>, Unparsed> {
        match self {
            Slot::Ready(json) => Ok(json),
            Slot::Later { text, value } => value
                .get_or_init(|| {
                    let mut stats = Stats::default();
                    let json = parse_value(text, &mut stats)?;
                    if stats.repeated_key {
                        return None;
                    }
                    json.into_owned()
                })
                .as_ref()
                .ok_or(Unparsed),
        }
    }
}

impl<'a> Object<'a> {
    /// The object of `fields`, and whether two of them have the same key.
    fn new(fields: Vec<(Cow<'a, str>, Json<'a>)>) -> (Self, bool) {
        Self::of_slots(
            fields
                .into_iter()
                .map(|(key, value)| (key, Slot::Ready(value)))
                .collect(),
        )
    }

    /// The object of `fields` whose keys are known to differ.
    fn unique(fields: Vec<(Cow<'a, str>, Slot<'a>)>) -> Self {
        if fields.len() <= SCANNED {
            debug_assert!(!Self::of_slots(fields.clone()).1, "repeated keys");
            return Object {
                fields,
                by_key: Vec::new(),
            };
        }
        Self::of_slots(fields).0
    }

    /// The object of `fields`, and whether two of them have the same key.
    /// (The vector is kept as it is: the top level's room stays.)
    fn of_slots(fields: Vec<(Cow<'a, str>, Slot<'a>)>) -> (Self, bool) {
        if fields.len() <= SCANNED {
            let repeated = fields
                .iter()
                .enumerate()
                .any(|(i, (key, _))| fields[..i].iter().any(|(k, _)| k == key));
            return (
                Object {
                    fields,
                    by_key: Vec::new(),
                },
                repeated,
            );
        }
        let mut by_key: Vec<u32> = (0..fields.len())
            .map(|i| u32::try_from(i).unwrap_or(u32::MAX))
            .collect();
        by_key.sort_unstable_by(|&a, &b| fields[a as usize].0.cmp(&fields[b as usize].0));
        let repeated = by_key
            .windows(2)
            .any(|w| fields[w[0] as usize].0 == fields[w[1] as usize].0);
        (Object { fields, by_key }, repeated)
    }

    /// The number of members.
    pub(crate) fn len(&self) -> usize {
        self.fields.len()
    }

    /// The name of member `i`, in the order written.
    pub(crate) fn key(&self, i: usize) -> Option<&Cow<'a, str>> {
        self.fields.get(i).map(|(key, _)| key)
    }

    /// The members in the order written, their values read.
    #[cfg(test)]
    pub(crate) fn iter(
        &self,
    ) -> impl Iterator<Item = (&Cow<'a, str>, Result<&Json<'a>, Unparsed>)> {
        self.fields.iter().map(|(key, slot)| (key, slot.value()))
    }

    fn slot(&self, key: &str) -> Option<&Slot<'a>> {
        if self.by_key.is_empty() {
            return self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        }
        self.by_key
            .binary_search_by(|&i| self.fields[i as usize].0.as_ref().cmp(key))
            .ok()
            .map(|at| &self.fields[self.by_key[at] as usize].1)
    }

    /// Whether the object has member `key` (its value is not read).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.slot(key).is_some()
    }

    /// The value of member `key`, read if not yet.
    pub(crate) fn get(&self, key: &str) -> Result<Option<&Json<'a>>, Unparsed> {
        self.slot(key).map(Slot::value).transpose()
    }
}

impl<'a> Json<'a> {
    /// Parses a call's argument text: blank text is `{}`, text that does not
    /// parse is `null` (as for the CEL values, see `input::Args::Text`).
    /// `largest` grows to the items of the largest array or object. `None`
    /// when an object repeats a key (the mesh refuses such calls, R20):
    /// such arguments are left to the CEL interpreter, whose maps keep the
    /// last value.
    pub(crate) fn from_text(text: &'a str, largest: &mut usize) -> Option<Self> {
        if text.trim().is_empty() {
            return Some(Json::Map(Object::new(Vec::new()).0));
        }
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let mut stats = Stats::default();
        let value = Seed {
            stats: &mut stats,
            top: true,
        }
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
        match value {
            Ok(value) => {
                *largest = (*largest).max(stats.largest);
                (!stats.repeated_key).then_some(value)
            }
            Err(_) => Some(Json::Null),
        }
    }

    /// Reads arguments as [`Json::from_text`] does, to the same values (the
    /// same `largest` too), through [`Json::from_members`] when the text
    /// passes the mesh's I-JSON check (R20), as a rewrite the mesh checked
    /// does; other text through [`Json::from_text`].
    pub(crate) fn from_checked(text: &'a str, largest: &mut usize) -> Option<Self> {
        let mut recorded = Recorded::default();
        let checked = ijson::check_recording(text, ijson::MAX_DEPTH_LIMIT, &mut recorded);
        match checked.ok().and_then(|()| recorded.call(0)) {
            Some(members) => Json::from_members(text, members, largest),
            None => Json::from_text(text, largest),
        }
    }

    /// Reads checked arguments from the top-level members the I-JSON check
    /// recorded (R20), without scanning the text again: to the values
    /// [`Json::from_text`] gives. Members that do not fit the text (never,
    /// for the check's own) send it to [`Json::from_text`].
    pub(crate) fn from_members(
        text: &'a str,
        members: Members<'_>,
        largest: &mut usize,
    ) -> Option<Self> {
        let member = |member: &Member| {
            let (start, end) = member.name;
            let name = if member.name_escaped {
                let quoted = text.get(start.checked_sub(1)?..end.checked_add(1)?)?;
                Cow::Owned(serde_json::from_str::<String>(quoted).ok()?)
            } else {
                Cow::Borrowed(text.get(start..end)?)
            };
            let value = text.get(member.value.0..member.value.1)?;
            Some((name, slot_of(value, member.value_escaped)?))
        };
        let mut fields = Vec::with_capacity(members.list.len());
        for m in members.list {
            let Some(field) = member(m) else {
                return Json::from_text(text, largest);
            };
            fields.push(field);
        }
        *largest = (*largest).max(members.largest);
        // R20's check refused names repeated (compared decoded): members it
        // recorded are unique, and are not compared again here.
        Some(Json::Map(Object::unique(fields)))
    }

    /// Borrows parsed JSON.
    pub(crate) fn from_value(value: &'a serde_json::Value, largest: &mut usize) -> Self {
        match value {
            serde_json::Value::Null => Json::Null,
            serde_json::Value::Bool(b) => Json::Bool(*b),
            serde_json::Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Json::Int(i)
                } else if let Some(u) = n.as_u64() {
                    uint_or_int(u)
                } else {
                    Json::Double(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            serde_json::Value::String(s) => Json::Str(Cow::Borrowed(s)),
            serde_json::Value::Array(items) => {
                *largest = (*largest).max(items.len());
                Json::List(
                    items
                        .iter()
                        .map(|item| Json::from_value(item, largest))
                        .collect(),
                )
            }
            serde_json::Value::Object(fields) => {
                *largest = (*largest).max(fields.len());
                Json::Map(
                    Object::new(
                        fields
                            .iter()
                            .map(|(k, v)| (Cow::Borrowed(k.as_str()), Json::from_value(v, largest)))
                            .collect(),
                    )
                    .0,
                )
            }
        }
    }
}

/// A member's value from its text (found by the check, which also saw
/// whether it has `escaped` strings): a string without escapes borrowed, an
/// array or object left for later, a scalar read.
fn slot_of(text: &str, escaped: bool) -> Option<Slot<'_>> {
    match *text.as_bytes().first()? {
        b'"' => {
            if !escaped {
                let inner = text.get(1..text.len().checked_sub(1)?)?;
                return Some(Slot::Ready(Json::Str(Cow::Borrowed(inner))));
            }
            let mut stats = Stats::default();
            parse_value(text, &mut stats).map(Slot::Ready)
        }
        b'{' | b'[' => Some(Slot::Later {
            text,
            value: OnceCell::new(),
        }),
        _ => scalar_slot(text),
    }
}

/// A number, `true`, `false` or `null` from its text: plain integers and
/// the literals read here, other numbers by serde_json.
fn scalar_slot(token: &str) -> Option<Slot<'_>> {
    let bytes = token.as_bytes();
    Some(Slot::Ready(match bytes {
        b"true" => Json::Bool(true),
        b"false" => Json::Bool(false),
        b"null" => Json::Null,
        b"0" => Json::Int(0),
        // Up to 18 digits always fit an `int`; serde_json reads them as
        // this does (a leading zero is refused there, and here).
        [b'1'..=b'9', rest @ ..] if rest.len() < 18 && rest.iter().all(u8::is_ascii_digit) => {
            Json::Int(bytes.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')))
        }
        _ => return parse_value(token, &mut Stats::default()).map(Slot::Ready),
    }))
}

impl Json<'_> {
    /// The same value, owning its strings; `None` if it holds a value not
    /// yet parsed (parsed values never do).
    fn into_owned(self) -> Option<Json<'static>> {
        Some(match self {
            Json::Null => Json::Null,
            Json::Bool(b) => Json::Bool(b),
            Json::Int(i) => Json::Int(i),
            Json::Uint(u) => Json::Uint(u),
            Json::Double(d) => Json::Double(d),
            Json::Str(s) => Json::Str(Cow::Owned(s.into_owned())),
            Json::List(items) => Json::List(
                items
                    .into_iter()
                    .map(Json::into_owned)
                    .collect::<Option<_>>()?,
            ),
            Json::Map(object) => Json::Map(Object {
                fields: object
                    .fields
                    .into_iter()
                    .map(|(key, slot)| match slot {
                        Slot::Ready(json) => Some((
                            Cow::Owned(key.into_owned()),
                            Slot::Ready(json.into_owned()?),
                        )),
                        Slot::Later { .. } => None,
                    })
                    .collect::<Option<_>>()?,
                by_key: object.by_key,
            }),
        })
    }
}

/// One JSON value's text parsed (serde_json); `stats` counts its largest
/// collection and whether an object in it repeats a key.
fn parse_value<'a>(text: &'a str, stats: &mut Stats) -> Option<Json<'a>> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    Seed { stats, top: false }
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value))
        .ok()
}

fn uint_or_int(u: u64) -> Json<'static> {
    match i64::try_from(u) {
        Ok(i) => Json::Int(i),
        Err(_) => Json::Uint(u),
    }
}

#[derive(Default)]
struct Stats {
    largest: usize,
    repeated_key: bool,
}

struct Seed<'s> {
    stats: &'s mut Stats,
    /// The arguments' top-level value, not a nested one.
    top: bool,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = Json<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Json::Int(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(uint_or_int(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Json::Double(v))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Json::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Json::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Json::Str(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(Seed {
            stats: &mut *self.stats,
            top: false,
        })? {
            items.push(item);
        }
        self.stats.largest = self.stats.largest.max(items.len());
        Ok(Json::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let room = map
            .size_hint()
            .unwrap_or(if self.top { MEMBERS } else { 0 });
        let mut fields: Vec<(Cow<'de, str>, Slot<'de>)> = Vec::with_capacity(room);
        while let Some(key) = map.next_key_seed(KeySeed)? {
            let value = map.next_value_seed(Seed {
                stats: &mut *self.stats,
                top: false,
            })?;
            fields.push((key, Slot::Ready(value)));
        }
        self.stats.largest = self.stats.largest.max(fields.len());
        let (object, repeated) = Object::of_slots(fields);
        self.stats.repeated_key |= repeated;
        Ok(Json::Map(object))
    }
}

/// An object's key, borrowed from the text when it has no escapes (also
/// the keys of the interpreter's input).
pub(super) struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

#[cfg(test)]
mod tests {
    //! The parser against the one it had before, kept here as the oracle
    //! for any faster one (R27's fast path reads what the mesh checked under
    //! R20): every text gives the same value, the same
    //! largest collection, the same refusal of repeated keys, and texts that
    //! do not parse are `null` for both.

    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    /// R20/R27: only the top-level object of a call's arguments is given room
    /// in advance; nested objects, as many as a peer's text makes, hold
    /// only what they need (a million `{}` allocate nothing).
    #[test]
    fn r27_nested_objects_get_no_room_in_advance() {
        let text = format!("{{\"a\":[{}{{\"b\":1}}]}}", "{},".repeat(1000));
        let mut largest = 0;
        let Some(Json::Map(top)) = Json::from_text(&text, &mut largest) else {
            panic!("not an object");
        };
        assert!(top.fields.capacity() >= MEMBERS);
        let Slot::Ready(Json::List(items)) = &top.fields[0].1 else {
            panic!("not a list");
        };
        assert_eq!(items.len(), 1001);
        for item in &items[..1000] {
            let Json::Map(empty) = item else {
                panic!("not an object")
            };
            assert_eq!(empty.fields.capacity(), 0);
        }
        let Json::Map(last) = &items[1000] else {
            panic!("not an object")
        };
        assert!(
            last.fields.capacity() < MEMBERS,
            "{}",
            last.fields.capacity()
        );
    }

    /// The serde_json parser this module used before, kept as the oracle.
    mod before {
        use std::borrow::Cow;
        use std::fmt;

        use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

        use super::super::{Json, Object, uint_or_int};

        pub(super) fn from_text<'a>(text: &'a str, largest: &mut usize) -> Option<Json<'a>> {
            if text.trim().is_empty() {
                return Some(Json::Map(Object::new(Vec::new()).0));
            }
            let mut deserializer = serde_json::Deserializer::from_str(text);
            let mut stats = (0, false);
            let value = Seed { stats: &mut stats }
                .deserialize(&mut deserializer)
                .and_then(|value| deserializer.end().map(|()| value));
            match value {
                Ok(value) => {
                    *largest = (*largest).max(stats.0);
                    (!stats.1).then_some(value)
                }
                Err(_) => Some(Json::Null),
            }
        }

        struct Seed<'s> {
            stats: &'s mut (usize, bool),
        }

        impl<'de> DeserializeSeed<'de> for Seed<'_> {
            type Value = Json<'de>;
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Json<'de>, D::Error> {
                d.deserialize_any(self)
            }
        }

        impl<'de> Visitor<'de> for Seed<'_> {
            type Value = Json<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<Json<'de>, E> {
                Ok(Json::Null)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Json<'de>, E> {
                Ok(Json::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Json<'de>, E> {
                Ok(Json::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Json<'de>, E> {
                Ok(uint_or_int(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Json<'de>, E> {
                Ok(Json::Double(v))
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Json<'de>, E> {
                Ok(Json::Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Json<'de>, E> {
                Ok(Json::Str(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element_seed(Seed {
                    stats: &mut *self.stats,
                })? {
                    items.push(item);
                }
                self.stats.0 = self.stats.0.max(items.len());
                Ok(Json::List(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
                let mut fields = Vec::new();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let value = map.next_value_seed(Seed {
                        stats: &mut *self.stats,
                    })?;
                    fields.push((key, value));
                }
                self.stats.0 = self.stats.0.max(fields.len());
                let (object, repeated) = Object::new(fields);
                self.stats.1 |= repeated;
                Ok(Json::Map(object))
            }
        }
    }

    /// Both parsers' answers, comparable bit for bit (`{:?}` tells -0.0 from
    /// 0.0 and prints every double exactly).
    fn both(text: &str) -> (String, String) {
        let mut largest_before = 0;
        let before = before::from_text(text, &mut largest_before);
        let mut largest_now = 0;
        let now = Json::from_text(text, &mut largest_now);
        (
            format!("{before:?} {largest_before}"),
            format!("{now:?} {largest_now}"),
        )
    }

    fn same(text: &str) -> Result<(), TestCaseError> {
        let (before, now) = both(text);
        prop_assert_eq!(before, now, "text {:?}", text);
        Ok(())
    }

    /// Whitespace between tokens, chosen by `seed`.
    fn ws(seed: &mut u64) -> &'static str {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        match *seed >> 60 {
            0 => " ",
            1 => "\n\t",
            2 => "\r\n  ",
            _ => "",
        }
    }

    /// Number texts: integers of every size (beyond `u64` and below `i64`
    /// too), fractions and exponents, zeros of both signs, and malformed
    /// ones (leading zeros, a bare dot or exponent, out of range).
    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|i| i.to_string()),
            any::<u64>().prop_map(|u| u.to_string()),
            (any::<u64>(), 0..=i64::MAX as u64).prop_map(|(a, b)| format!("{a}{b}")),
            (any::<u64>(), 0..=i64::MAX as u64).prop_map(|(a, b)| format!("-{a}{b}")),
            any::<f64>().prop_map(|f| format!("{f:?}")),
            any::<f64>().prop_map(|f| format!("{f:e}")),
            any::<f32>().prop_map(|f| format!("{f}")),
            (
                "-?",
                "(0|[1-9][0-9]{0,24})",
                proptest::option::of("\\.[0-9]{1,24}"),
                proptest::option::of("[eE][+-]?[0-9]{1,3}"),
            )
                .prop_map(|(s, i, f, e)| format!(
                    "{s}{i}{}{}",
                    f.unwrap_or_default(),
                    e.unwrap_or_default()
                )),
            prop::sample::select(vec![
                "0",
                "-0",
                "0.0",
                "-0.0",
                "-0e0",
                "0e-5",
                "-0.0E+3",
                "1e-400",
                "-1e-400",
                "1e308",
                "1e309",
                "-1e309",
                "2.2250738585072011e-308",
                "4.9e-324",
                "9007199254740993",
                "9223372036854775807",
                "9223372036854775808",
                "-9223372036854775808",
                "-9223372036854775809",
                "18446744073709551615",
                "18446744073709551616",
                "01",
                "-01",
                "1.",
                ".5",
                "1e",
                "1e+",
                "-",
                "+1",
                "0x10",
                "1_0",
                "NaN",
                "Infinity",
                "-Infinity",
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// String texts: plain and non-ASCII characters, every escape (`\u` in
    /// both cases, surrogate pairs, lone surrogates), raw control
    /// characters and malformed escapes now and then.
    fn string() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            6 => "[a-zA-Z0-9 .,;:!?'()/_-]{0,40}",
            2 => any::<char>().prop_map(|c| match c {
                '"' => "\\\"".to_owned(),
                '\\' => "\\\\".to_owned(),
                c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32),
                c => c.to_string(),
            }),
            2 => prop::sample::select(vec![
                "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\u0000",
                "\\u001F", "\\u00e9", "\\u00E9", "\\u20AC", "\\uFFFF", "\\ud83d\\ude00",
                "\\uD83D\\uDE00", "\\uDBFF\\uDFFF", "é", "€", "😀", "\u{10FFFF}",
            ])
            .prop_map(str::to_owned),
            2 => any::<char>().prop_map(|c| {
                let mut units = [0u16; 2];
                c.encode_utf16(&mut units)
                    .iter()
                    .map(|u| format!("\\u{u:04x}"))
                    .collect::<String>()
            }),
            1 => any::<u16>().prop_map(|u| format!("\\u{u:04X}")),
            1 => prop::sample::select(vec![
                "\\ud800", "\\udc00", "\\ud800\\u0041", "\\ud800\\", "\\x", "\\u12",
                "\\u12G4", "\u{1}", "\t", "\n", "\u{1f}", "\\", "\\U0041",
            ])
            .prop_map(str::to_owned),
        ];
        prop::collection::vec(piece, 0..6).prop_map(|pieces| format!("\"{}\"", pieces.concat()))
    }

    /// Keys: a few that repeat (also written differently: `a` and
    /// `\u0061`), and any string.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            2 => prop::sample::select(vec!["\"a\"", "\"b\"", "\"\\u0061\"", "\"\"", "\"tool\""])
                .prop_map(str::to_owned),
            3 => string(),
        ]
    }

    /// `members` between `open` and `close`, separated by commas, each written
    /// by `write`, with whitespace drawn from `seed` around every token.
    fn enclosed<T>(
        [open, close]: [char; 2],
        members: &[T],
        seed: &mut u64,
        write: impl Fn(&mut String, &T, &mut u64),
    ) -> String {
        let mut out = format!("{open}{}", ws(seed));
        for (i, member) in members.iter().enumerate() {
            if i > 0 {
                out.push(',');
                out.push_str(ws(seed));
            }
            write(&mut out, member, seed);
            out.push_str(ws(seed));
        }
        out.push(close);
        out
    }

    /// JSON texts, nested, with whitespace between tokens.
    fn text() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            number(),
            string(),
        ];
        leaf.prop_recursive(5, 64, 8, |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 0..8), any::<u64>()).prop_map(
                    |(items, mut seed)| {
                        enclosed(['[', ']'], &items, &mut seed, |out, item, _| {
                            out.push_str(item);
                        })
                    }
                ),
                (prop::collection::vec((key(), inner), 0..8), any::<u64>()).prop_map(
                    |(fields, mut seed)| {
                        enclosed(['{', '}'], &fields, &mut seed, |out, (k, v), seed| {
                            out.push_str(k);
                            out.push_str(ws(seed));
                            out.push(':');
                            out.push_str(ws(seed));
                            out.push_str(v);
                        })
                    }
                ),
            ]
        })
    }

    /// Damages a text: a character removed, one of JSON's inserted, or the
    /// text cut short.
    fn damaged() -> impl Strategy<Value = String> {
        (
            text(),
            any::<usize>(),
            0..3u8,
            prop::sample::select(vec![
                '{', '}', '[', ']', '"', ',', ':', '\\', '-', '0', 'e', '.', ' ', '\u{0}', 'x',
            ]),
        )
            .prop_map(|(text, at, how, c)| {
                let bounds: Vec<usize> = text
                    .char_indices()
                    .map(|(i, _)| i)
                    .chain([text.len()])
                    .collect();
                let at = bounds[at % bounds.len()];
                let mut out = text.clone();
                match how {
                    0 if at < text.len() => {
                        out.remove(at);
                    }
                    1 => out.insert(at, c),
                    _ => out.truncate(at),
                }
                out
            })
    }

    fn runner(cases: u32) -> TestRunner {
        TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        })
    }

    /// R20/R27: random JSON texts (escapes, unicode, big integers, floats,
    /// nesting, repeated keys, whitespace) give the same value as before.
    #[test]
    fn r27_arguments_parse_to_the_same_values_as_before() {
        runner(3000).run(&text(), |text| same(&text)).unwrap();
        runner(3000)
            .run(
                &(text(), "[ \t\r\n]{0,2}", "[ \t\r\n]{0,2}"),
                |(text, a, b)| same(&format!("{a}{text}{b}")),
            )
            .unwrap();
    }

    /// R20/R27: texts that did not parse (damaged ones, trailing data) are
    /// still refused (`null`), and the damaged ones that did parse give the
    /// same value.
    #[test]
    fn r27_texts_refused_before_are_refused() {
        runner(3000).run(&damaged(), |text| same(&text)).unwrap();
        runner(500)
            .run(&(text(), text()), |(a, b)| same(&format!("{a} {b}")))
            .unwrap();
    }

    /// R20/R27: numbers and strings alone, many of them: each kind of
    /// number (`int`, `uint`, `double`) and every escape as before.
    #[test]
    fn r27_numbers_and_strings_parse_as_before() {
        runner(8000)
            .run(&number(), |n| {
                same(&n)?;
                same(&format!("{{\"n\":{n}}}"))?;
                same(&format!("[{n},{n}]"))
            })
            .unwrap();
        runner(4000)
            .run(&string(), |s| {
                same(&s)?;
                same(&format!("{{{s}:{s}}}"))
            })
            .unwrap();
    }

    /// R20/R27: nesting near and past the depth the old parser refused.
    #[test]
    fn r27_deep_nesting_parses_as_before() {
        for depth in (1..=300).step_by(1) {
            for (open, close) in [("[", "]"), ("{\"a\":", "}"), ("[{\"a\":", "}]")] {
                let text = format!("{}1{}", open.repeat(depth), close.repeat(depth));
                let (before, now) = both(&text);
                assert_eq!(before, now, "depth {depth} {open}");
            }
        }
    }

    /// Top-level objects of [`text`]'s values (keys repeat now and then).
    fn object() -> impl Strategy<Value = String> {
        (
            prop::collection::vec((key(), text()), 0..8),
            any::<u64>(),
            "[ \t\r\n]{0,2}",
        )
            .prop_map(|(fields, mut seed, pad)| {
                let mut out = format!("{pad}{{{}", ws(&mut seed));
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                        out.push_str(ws(&mut seed));
                    }
                    out.push_str(&format!(
                        "{k}{}:{}{v}{}",
                        ws(&mut seed),
                        ws(&mut seed),
                        ws(&mut seed)
                    ));
                }
                out.push('}');
                out.push_str(&pad);
                out
            })
    }

    /// A value with every member read, comparable bit for bit (`{:?}` of
    /// scalars tells -0.0 from 0.0 and prints every double exactly); a
    /// member that does not parse shows as `UNPARSED`.
    fn read(json: &Json<'_>) -> String {
        match json {
            Json::List(items) => {
                let items: Vec<String> = items.iter().map(read).collect();
                format!("[{}]", items.join(","))
            }
            Json::Map(object) => {
                let members: Vec<String> = object
                    .iter()
                    .map(|(k, v)| format!("{k:?}:{}", v.map_or("UNPARSED".to_owned(), read)))
                    .collect();
                format!("{{{}}}", members.join(","))
            }
            scalar => format!("{scalar:?}"),
        }
    }

    /// `from_checked` on `text`: the same value and largest collection as
    /// `from_text`, and, whenever the mesh would have let the text through
    /// (R20), read from the members the check recorded (which fit the
    /// text), not by falling back to serde_json. Returns whether the text
    /// was checked.
    fn same_when_checked(text: &str) -> Result<bool, TestCaseError> {
        let mut largest_text = 0;
        let parsed = Json::from_text(text, &mut largest_text).map(|json| read(&json));
        let mut largest_checked = 0;
        let checked = Json::from_checked(text, &mut largest_checked).map(|json| read(&json));
        prop_assert_eq!(
            format!("{parsed:?} {largest_text}"),
            format!("{checked:?} {largest_checked}"),
            "text {:?}",
            text
        );
        let depth = crate::validate::ijson::MAX_DEPTH_LIMIT;
        let mut recorded = crate::validate::ijson::Recorded::default();
        if crate::validate::ijson::check_recording(text, depth, &mut recorded).is_err() {
            return Ok(false);
        }
        let Some(members) = recorded.call(0) else {
            prop_assert!(false, "nothing recorded for {:?}", text);
            return Ok(false);
        };
        // Counting only the largest collection (for policies that read no
        // arguments): the same count, no members.
        let mut counted = crate::validate::ijson::Recorded::largest_only(1);
        crate::validate::ijson::check_recording(text, depth, &mut counted)
            .map_err(|e| TestCaseError::fail(format!("{text:?} refused when counting: {e}")))?;
        prop_assert_eq!(counted.largest(0), Some(members.largest), "text {:?}", text);
        prop_assert_eq!(counted.call(0), None);
        // From the members the check recorded: the same, and from them
        // (not by scanning again).
        let mut largest_recorded = 0;
        let recorded =
            Json::from_members(text, members, &mut largest_recorded).map(|json| read(&json));
        prop_assert_eq!(
            format!("{parsed:?} {largest_text}"),
            format!("{recorded:?} {largest_recorded}"),
            "text {:?} members {:?}",
            text,
            members
        );
        let fits = members.list.iter().all(|m| {
            text.get(m.name.0..m.name.1).is_some()
                && slot_of(&text[m.value.0..m.value.1], m.value_escaped).is_some()
        });
        prop_assert!(
            fits,
            "the recorded members do not fit {:?}: {:?}",
            text,
            members
        );
        Ok(true)
    }

    /// R20/R27: arguments the mesh checked read from the members its check
    /// recorded to the same values as by serde_json (values, kinds of
    /// numbers, escapes, largest collection); any other text (damaged ones
    /// too) reads as serde_json reads it.
    #[test]
    fn r27_checked_arguments_read_to_the_same_values() {
        let checked = std::cell::Cell::new(0u32);
        runner(6000)
            .run(&object(), |text| {
                checked.set(checked.get() + u32::from(same_when_checked(&text)?));
                Ok(())
            })
            .unwrap();
        // About a fifth pass the check (the strings and keys are made to
        // fail it now and then): the comparison is not vacuous.
        assert!(checked.get() > 600, "{} of 6000 checked", checked.get());
        runner(3000)
            .run(&damaged(), |text| same_when_checked(&text).map(|_| ()))
            .unwrap();
        for text in [
            "",
            " \n",
            "{}",
            "{\"a\":\"\\\\\"}",
            "{\"a\\u0062\":[{\"c\":\"\\\"]\"}],\"d\":-0}",
            "{\"a\":1,\"a\":2}",
            "{\"a\":{\"b\":1,\"b\":2}}",
            "{\"a\":\"x\"",
            "{\"a\":\"\\",
            "{\"a\":[}",
            "{\"a\" 1}",
            "[1,2]",
            "{\"é\":\"ü\\u00fc\"}",
        ] {
            same_when_checked(text).unwrap();
        }
    }

    /// R27: a nested array or object of checked arguments is counted by
    /// the check and parsed only when read; strings and numbers are there at
    /// once; a nested value that turns out not to parse is `Unparsed`.
    #[test]
    fn r27_nested_values_of_checked_arguments_are_parsed_when_read() {
        let text = r#"{"query":"SELECT 1","n":42,"options":{"a":[1,2,3,4,5],"b":{}}}"#;
        let mut largest = 0;
        let Some(Json::Map(top)) = Json::from_checked(text, &mut largest) else {
            panic!("not an object");
        };
        assert_eq!(largest, 5, "the nested array's items are counted");
        let later = |key: &str| match top.slot(key) {
            Some(Slot::Later { value, .. }) => Some(value.get().is_some()),
            _ => None,
        };
        assert_eq!(
            later("options"),
            Some(false),
            "not parsed before it is read"
        );
        assert!(matches!(
            top.slot("query"),
            Some(Slot::Ready(Json::Str(Cow::Borrowed("SELECT 1"))))
        ));
        assert!(matches!(top.slot("n"), Some(Slot::Ready(Json::Int(42)))));
        let Ok(Some(Json::Map(options))) = top.get("options") else {
            panic!("options is an object");
        };
        assert!(matches!(options.get("a"), Ok(Some(Json::List(items))) if items.len() == 5));
        assert_eq!(later("options"), Some(true), "parsed once read");
        let bad = Slot::Later {
            text: "[01]",
            value: OnceCell::new(),
        };
        assert_eq!(bad.value(), Err(Unparsed));
    }

    /// The checks above can fail: a value that differs is seen.
    #[test]
    fn the_comparison_sees_a_difference() {
        let mut largest = 0;
        let a = format!("{:?}", Json::from_text("[-0.0]", &mut largest));
        let b = format!("{:?}", Json::from_text("[0.0]", &mut largest));
        assert_ne!(a, b);
    }
}
