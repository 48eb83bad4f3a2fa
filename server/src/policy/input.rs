//! What a policy is evaluated against: one batch of calls and its context,
//! in plain strings and JSON (not the mesh's wire or batch types, so that any
//! caller can build it), and its conversion into CEL values.
//!
//! The CEL variables a rule sees:
//!
//! * `call`: the call being judged, a map `{call_id, tool, args}`, where
//!   `args` is the call's arguments as parsed JSON;
//! * `calls`: every call of the batch, in batch order, each like `call`
//!   (the judged call included);
//! * `context`: the batch's context, a map `{session_id, turn_index,
//!   model_text, metadata}`, `metadata` a map of strings.
//!
//! JSON becomes CEL as follows: objects are maps with string keys, arrays are
//! lists, strings, booleans and `null` are themselves, an integer is an
//! `int` (a `uint` above `int`'s range), any other number a `double`. CEL
//! compares `int`, `uint` and `double` with each other, so `args.amount >
//! 10000` holds for 10000.5 as for 10001.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cel::Value;
use cel::objects::{Key, Map};
use serde::{Deserialize, Serialize};

/// One tool call, as a rule sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallInput {
    /// The call's id, unique within its batch.
    #[serde(default)]
    pub call_id: String,
    /// The tool's name.
    pub tool: String,
    /// The tool's arguments, parsed (an object for any call the mesh
    /// accepts; absent arguments are `{}`).
    #[serde(default = "empty_object")]
    pub args: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

/// A batch: its context and all its calls.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchInput {
    /// The agent session the batch belongs to.
    #[serde(default)]
    pub session_id: String,
    /// The model turn within the session, from 0.
    #[serde(default)]
    pub turn_index: u32,
    /// The text the model produced with the calls.
    #[serde(default)]
    pub model_text: String,
    /// Free metadata (tenant, user, agent, ...).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The calls, in batch order.
    #[serde(default)]
    pub calls: Vec<CallInput>,
}

impl BatchInput {
    /// The number of items of the largest list or map in the input: the
    /// calls, the metadata, and every array and object inside any call's
    /// arguments. The `n` of the cost bounds (see `cost`).
    pub(crate) fn largest_collection(&self) -> usize {
        let mut largest = self.calls.len().max(self.metadata.len());
        for call in &self.calls {
            largest = largest.max(largest_in(&call.args));
        }
        largest
    }
}

fn largest_in(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::Array(items) => {
            items.iter().map(largest_in).fold(items.len(), usize::max)
        }
        serde_json::Value::Object(fields) => fields
            .values()
            .map(largest_in)
            .fold(fields.len(), usize::max),
        _ => 0,
    }
}

/// The CEL values of one batch, built once and shared by every call's
/// evaluation.
pub(crate) struct BatchValues {
    /// `call` for each call, in batch order.
    pub(crate) calls: Vec<Value>,
    /// `calls`.
    pub(crate) all_calls: Value,
    /// `context`.
    pub(crate) context: Value,
}

impl BatchValues {
    pub(crate) fn new(batch: &BatchInput) -> Self {
        let calls: Vec<Value> = batch.calls.iter().map(call_value).collect();
        let metadata: HashMap<Key, Value> = batch
            .metadata
            .iter()
            .map(|(k, v)| (Key::from(k.as_str()), Value::from(v.as_str())))
            .collect();
        let context = map([
            ("session_id", Value::from(batch.session_id.as_str())),
            ("turn_index", Value::Int(i64::from(batch.turn_index))),
            ("model_text", Value::from(batch.model_text.as_str())),
            (
                "metadata",
                Value::Map(Map {
                    map: Arc::new(metadata),
                }),
            ),
        ]);
        Self {
            all_calls: Value::List(Arc::new(calls.clone())),
            calls,
            context,
        }
    }
}

fn call_value(call: &CallInput) -> Value {
    map([
        ("call_id", Value::from(call.call_id.as_str())),
        ("tool", Value::from(call.tool.as_str())),
        ("args", json_value(&call.args)),
    ])
}

fn map<const N: usize>(fields: [(&str, Value); N]) -> Value {
    let map: HashMap<Key, Value> = fields.into_iter().map(|(k, v)| (Key::from(k), v)).collect();
    Value::Map(Map { map: Arc::new(map) })
}

/// JSON to CEL (see the module's documentation).
pub(crate) fn json_value(value: &serde_json::Value) -> Value {
    match value {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::Int(i)
            } else if let Some(u) = n.as_u64() {
                Value::UInt(u)
            } else {
                Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => {
            Value::List(Arc::new(items.iter().map(json_value).collect()))
        }
        serde_json::Value::Object(fields) => {
            let map: HashMap<Key, Value> = fields
                .iter()
                .map(|(k, v)| (Key::from(k.as_str()), json_value(v)))
                .collect();
            Value::Map(Map { map: Arc::new(map) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_keep_their_kind() {
        assert_eq!(json_value(&json!(3)), Value::Int(3));
        assert_eq!(json_value(&json!(u64::MAX)), Value::UInt(u64::MAX));
        assert_eq!(json_value(&json!(2.5)), Value::Float(2.5));
    }

    #[test]
    fn largest_collection_looks_inside_arguments() {
        let batch = BatchInput {
            calls: vec![CallInput {
                call_id: "c1".into(),
                tool: "t".into(),
                args: json!({"to": {"list": [1, 2, 3, 4, 5]}}),
            }],
            ..BatchInput::default()
        };
        assert_eq!(batch.largest_collection(), 5);
    }
}
