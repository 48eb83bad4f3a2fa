//! A call's arguments as the fast evaluator (`plan`) reads them: JSON parsed
//! once per batch into a small borrowed tree, strings without escapes
//! borrowed from the text, objects as key/value lists in the order written.
//!
//! Numbers become what they become in CEL (see `input`): an integer is an
//! `int` (a `uint` above `int`'s range), any other number a `double`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

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
    fields: Vec<(Cow<'a, str>, Json<'a>)>,
    /// Positions in `fields`, sorted by key; empty for small objects.
    by_key: Vec<u32>,
}

impl<'a> Object<'a> {
    /// The object of `fields`, and whether two of them have the same key.
    fn new(fields: Vec<(Cow<'a, str>, Json<'a>)>) -> (Self, bool) {
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

    /// Member `i`, in the order written.
    pub(crate) fn entry(&self, i: usize) -> Option<&(Cow<'a, str>, Json<'a>)> {
        self.fields.get(i)
    }

    /// The members in the order written.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &(Cow<'a, str>, Json<'a>)> {
        self.fields.iter()
    }

    /// The value of member `key`.
    pub(crate) fn get(&self, key: &str) -> Option<&Json<'a>> {
        if self.by_key.is_empty() {
            return self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        }
        self.by_key
            .binary_search_by(|&i| self.fields[i as usize].0.as_ref().cmp(key))
            .ok()
            .map(|at| &self.fields[self.by_key[at] as usize].1)
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
        let mut fields: Vec<(Cow<'de, str>, Json<'de>)> = Vec::with_capacity(room);
        while let Some(key) = map.next_key_seed(KeySeed)? {
            let value = map.next_value_seed(Seed {
                stats: &mut *self.stats,
                top: false,
            })?;
            fields.push((key, value));
        }
        self.stats.largest = self.stats.largest.max(fields.len());
        let (object, repeated) = Object::new(fields);
        self.stats.repeated_key |= repeated;
        Ok(Json::Map(object))
    }
}

struct KeySeed;

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
        let Json::List(items) = &top.fields[0].1 else {
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
                        let mut out = format!("[{}", ws(&mut seed));
                        for (i, item) in items.iter().enumerate() {
                            if i > 0 {
                                out.push(',');
                                out.push_str(ws(&mut seed));
                            }
                            out.push_str(item);
                            out.push_str(ws(&mut seed));
                        }
                        out.push(']');
                        out
                    }
                ),
                (prop::collection::vec((key(), inner), 0..8), any::<u64>()).prop_map(
                    |(fields, mut seed)| {
                        let mut out = format!("{{{}", ws(&mut seed));
                        for (i, (k, v)) in fields.iter().enumerate() {
                            if i > 0 {
                                out.push(',');
                                out.push_str(ws(&mut seed));
                            }
                            out.push_str(k);
                            out.push_str(ws(&mut seed));
                            out.push(':');
                            out.push_str(ws(&mut seed));
                            out.push_str(v);
                            out.push_str(ws(&mut seed));
                        }
                        out.push('}');
                        out
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

    /// The checks above can fail: a value that differs is seen.
    #[test]
    fn the_comparison_sees_a_difference() {
        let mut largest = 0;
        let a = format!("{:?}", Json::from_text("[-0.0]", &mut largest));
        let b = format!("{:?}", Json::from_text("[0.0]", &mut largest));
        assert_ne!(a, b);
    }
}
