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
