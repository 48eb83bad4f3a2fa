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
    Map(Vec<(Cow<'a, str>, Json<'a>)>),
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
            return Some(Json::Map(Vec::new()));
        }
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let mut stats = Stats::default();
        let value = Seed { stats: &mut stats }
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
                    fields
                        .iter()
                        .map(|(k, v)| (Cow::Borrowed(k.as_str()), Json::from_value(v, largest)))
                        .collect(),
                )
            }
        }
    }

    /// The value of `key`, for an object.
    pub(crate) fn field<'f>(
        fields: &'f [(Cow<'a, str>, Json<'a>)],
        key: &str,
    ) -> Option<&'f Json<'a>> {
        fields.iter().find(|(k, _)| k == key).map(|(_, v)| v)
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
        })? {
            items.push(item);
        }
        self.stats.largest = self.stats.largest.max(items.len());
        Ok(Json::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields: Vec<(Cow<'de, str>, Json<'de>)> =
            Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(key) = map.next_key_seed(KeySeed)? {
            let value = map.next_value_seed(Seed {
                stats: &mut *self.stats,
            })?;
            fields.push((key, value));
        }
        if repeats_a_key(&fields) {
            self.stats.repeated_key = true;
        }
        self.stats.largest = self.stats.largest.max(fields.len());
        Ok(Json::Map(fields))
    }
}

/// Whether two fields have the same key: pairwise for small objects, with a
/// set for large ones (no quadratic work on hostile input).
fn repeats_a_key(fields: &[(Cow<'_, str>, Json<'_>)]) -> bool {
    if fields.len() <= 16 {
        return fields
            .iter()
            .enumerate()
            .any(|(i, (key, _))| fields[..i].iter().any(|(k, _)| k == key));
    }
    let mut seen = std::collections::HashSet::with_capacity(fields.len());
    !fields.iter().all(|(key, _)| seen.insert(key.as_ref()))
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
