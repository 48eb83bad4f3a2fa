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
//!
//! The values of a batch ([`BatchValues`]) are built once, straight from the
//! arguments' JSON text (or from parsed JSON), borrowing every string that
//! needs no unescaping, and shared by every rule, every call and every policy
//! guard that judges the batch: `call` is an element of `calls`, not a copy.
//! The fast path's (`plan`) are built at once; the interpreter's CEL values
//! only when a rule needs the interpreter.

use std::cell::OnceCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelNull, CelString, CelUInt,
};
use cel::common::value::{CowVal, Val};
use cel::context::VariableResolver;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::json::Json;
use super::meter::Meter;
use super::plan::{FastCall, FastContext, Input};
pub use crate::validate::ijson::{Members, Recorded};

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

/// A call's arguments, as given to [`BatchValues::new`].
#[derive(Debug, Clone, Copy)]
pub enum Args<'a> {
    /// JSON text as sent (the mesh checked it as an I-JSON object, R20).
    /// Blank text is `{}`; text that does not parse is `null`, so that a
    /// rule reading it errors (a guard failure, R13) rather than proceeds.
    Text(&'a str),
    /// JSON text the caller checked as an I-JSON object (the mesh, R20):
    /// read as [`Args::Text`] is, faster; text that was not checked may be
    /// read differently (a raw control character in a string, say).
    Checked(&'a str),
    /// [`Args::Checked`] with the top-level members the check recorded
    /// (`members` must be this text's): the text is not scanned again.
    Recorded {
        /// The arguments' text.
        text: &'a str,
        /// Its members, as the mesh's check found them.
        members: Members<'a>,
    },
    /// Parsed JSON.
    Json(&'a serde_json::Value),
    /// Checked text ([`Args::Checked`]) of which the check counted only the
    /// largest collection (the cost bounds' `n`), for policies that read no
    /// arguments: not read for the fast path (a rule reading them anyway is
    /// left to the interpreter, which reads the text).
    Counted {
        /// The arguments' text.
        text: &'a str,
        /// The items of its largest array or object, its top level included.
        largest: usize,
    },
}

impl<'a> Args<'a> {
    /// The arguments' text, or the parsed JSON they were given as.
    fn text_or_json(&self) -> Result<&'a str, &'a serde_json::Value> {
        match *self {
            Args::Text(text)
            | Args::Checked(text)
            | Args::Recorded { text, .. }
            | Args::Counted { text, .. } => Ok(text),
            Args::Json(json) => Err(json),
        }
    }
}

/// One call, as given to [`BatchValues::new`].
#[derive(Debug, Clone, Copy)]
pub struct CallRef<'a> {
    /// The call's id.
    pub call_id: &'a str,
    /// The tool's name.
    pub tool: &'a str,
    /// Its arguments.
    pub args: Args<'a>,
}

/// A batch's context, as given to [`BatchValues::new`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ContextRef<'a> {
    /// The agent session.
    pub session_id: &'a str,
    /// The model turn.
    pub turn_index: u32,
    /// The model's text.
    pub model_text: &'a str,
}

/// The values of one batch, built once and shared by every rule, call and
/// policy that judges it. They borrow from the batch they were built from.
///
/// The fast path's values (`plan`) are built at once: the calls' arguments
/// parsed into borrowed JSON. The CEL interpreter's values are built only
/// when a rule needs the interpreter.
pub struct BatchValues<'a> {
    context: ContextRef<'a>,
    /// The calls as given, to build the interpreter's values from.
    sources: Vec<CallRef<'a>>,
    fast_calls: Vec<FastCall<'a>>,
    fast_context: FastContext<'a>,
    /// The interpreter's values, built on first use.
    cel: OnceCell<CelValues<'a>>,
    /// The number of items of the largest list or map of the input: the
    /// calls, the metadata, and every array and object inside any call's
    /// arguments. The `n` of the cost bounds (see `cost`) of rules that
    /// read `calls`.
    largest: usize,
    /// Per call, the bytes of its arguments (what reading `call` may
    /// touch), and those of every call's arguments together: counted when
    /// the interpreter first reads a variable (the fast path does not).
    call_bytes: OnceCell<(Vec<usize>, usize)>,
    /// The bytes of the context's strings.
    context_bytes: usize,
    /// `session`, when the batch's policies read it (R34), with the tools
    /// of the batch's calls in order: call `i`'s rules see the calls before
    /// it ([`super::session_cel::SessionAt`]).
    session: Option<(super::session_cel::SessionVal, Arc<[String]>)>,
    /// `identity`, when the batch's policies read it (R34): the memory of
    /// the caller's identity across its sessions, read as `session` is.
    identity: Option<super::session_cel::SessionVal>,
}

/// The CEL interpreter's values of a batch.
struct CelValues<'a> {
    /// `calls`: one map `{call_id, tool, args}` per call, in batch order.
    calls: CelList<'a>,
    /// `context`.
    context: CelMap<'a>,
}

impl fmt::Debug for BatchValues<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchValues")
            .field("calls", &self.sources.len())
            .field("largest", &self.largest)
            .finish_non_exhaustive()
    }
}

impl<'a> BatchValues<'a> {
    /// Builds the values of a batch: its context, its metadata and its
    /// calls.
    pub fn new(
        context: ContextRef<'a>,
        metadata: impl IntoIterator<Item = (&'a str, &'a str)>,
        calls: impl IntoIterator<Item = CallRef<'a>>,
    ) -> Self {
        Self::reading_args(true, context, metadata, calls)
    }

    /// [`Self::new`] for policies that read no call's arguments (none does
    /// when [`Policy::reads_args`](super::Policy::reads_args) is false for
    /// each) when `args` is false: arguments the mesh's check recorded
    /// ([`Args::Recorded`]) are then not read for the fast path at all (the
    /// check's count of their largest collection still goes into the cost
    /// bounds). The interpreter still reads them should a rule need it.
    pub fn reading_args(
        args: bool,
        context: ContextRef<'a>,
        metadata: impl IntoIterator<Item = (&'a str, &'a str)>,
        calls: impl IntoIterator<Item = CallRef<'a>>,
    ) -> Self {
        let metadata: Vec<(&'a str, &'a str)> = metadata.into_iter().collect();
        let mut largest = metadata.len();
        let sources: Vec<CallRef<'a>> = calls.into_iter().collect();
        let fast_calls = sources
            .iter()
            .map(|call| {
                let mut mine = 0;
                let args = match call.args {
                    Args::Text(text) => Json::from_text(text, &mut mine),
                    Args::Checked(text) => Json::from_checked(text, &mut mine),
                    Args::Recorded { members, .. } if !args => {
                        mine = members.largest;
                        None
                    }
                    Args::Counted { largest: n, .. } => {
                        mine = n;
                        None
                    }
                    Args::Recorded { text, members } => {
                        Json::from_members(text, members, &mut mine)
                    }
                    Args::Json(json) => Some(Json::from_value(json, &mut mine)),
                };
                largest = largest.max(mine);
                FastCall {
                    call_id: call.call_id,
                    tool: call.tool,
                    args,
                    largest: mine,
                }
            })
            .collect();
        largest = largest.max(sources.len());
        let context_bytes = context.session_id.len()
            + context.model_text.len()
            + metadata
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
        Self {
            context,
            sources,
            fast_calls,
            fast_context: FastContext {
                session_id: context.session_id,
                turn_index: context.turn_index,
                model_text: context.model_text,
                metadata,
            },
            cel: OnceCell::new(),
            largest,
            call_bytes: OnceCell::new(),
            context_bytes,
            session: None,
            identity: None,
        }
    }

    /// Sets `session`: the session's memory, or why it cannot be read (R34).
    /// Without it a rule naming `session` fails (R13).
    pub fn set_session(&mut self, session: super::session_cel::SessionVal) {
        let tools = self.sources.iter().map(|c| c.tool.to_owned()).collect();
        self.session = Some((session, tools));
    }

    /// Sets `identity`: the memory of the caller's identity across its
    /// sessions, or why it cannot be read (R34). Without it a rule naming
    /// `identity` fails (R13).
    pub fn set_identity(&mut self, identity: super::session_cel::SessionVal) {
        self.identity = Some(identity);
    }

    /// `identity` as call `i`'s rules read it: the calls before it in its
    /// batch are the identity's too.
    fn identity_at(&self, i: usize) -> Option<super::session_cel::SessionAt> {
        let identity = self.identity.as_ref()?;
        let tools = match &self.session {
            Some((_, tools)) => Arc::clone(tools),
            None => self.sources.iter().map(|c| c.tool.to_owned()).collect(),
        };
        Some(super::session_cel::SessionAt::new(
            identity.clone(),
            tools,
            i,
        ))
    }

    /// `session` as call `i`'s rules read it.
    fn session_at(&self, i: usize) -> Option<super::session_cel::SessionAt> {
        let (session, tools) = self.session.as_ref()?;
        Some(super::session_cel::SessionAt::new(
            session.clone(),
            Arc::clone(tools),
            i,
        ))
    }

    /// The interpreter's values, built on first use.
    fn cel(&self) -> &CelValues<'a> {
        self.cel.get_or_init(|| {
            let metadata: HashMap<CelMapKey<'a>, Box<dyn Val + 'a>> = self
                .fast_context
                .metadata
                .iter()
                .map(|(k, v)| (CelMapKey::from(*k), string(v)))
                .collect();
            let context = CelMap::from(HashMap::from([
                (
                    CelMapKey::from("session_id"),
                    string(self.context.session_id),
                ),
                (
                    CelMapKey::from("turn_index"),
                    Box::new(CelInt::from(i64::from(self.context.turn_index))) as Box<dyn Val + 'a>,
                ),
                (
                    CelMapKey::from("model_text"),
                    string(self.context.model_text),
                ),
                (
                    CelMapKey::from("metadata"),
                    Box::new(CelMap::from(metadata)) as Box<dyn Val + 'a>,
                ),
            ]));
            let mut ignored = 0;
            let calls: Vec<Box<dyn Val + 'a>> = self
                .sources
                .iter()
                .map(|call| {
                    let args = match call.args.text_or_json() {
                        Ok(text) => from_text(text, &mut ignored),
                        Err(json) => from_json(json, &mut ignored),
                    };
                    Box::new(CelMap::from(HashMap::from([
                        (CelMapKey::from("call_id"), string(call.call_id)),
                        (CelMapKey::from("tool"), string(call.tool)),
                        (CelMapKey::from("args"), args),
                    ]))) as Box<dyn Val + 'a>
                })
                .collect();
            CelValues {
                calls: CelList::from(calls),
                context,
            }
        })
    }

    /// The values of a [`BatchInput`].
    pub fn from_input(batch: &'a BatchInput) -> Self {
        Self::new(
            ContextRef {
                session_id: &batch.session_id,
                turn_index: batch.turn_index,
                model_text: &batch.model_text,
            },
            batch.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            batch.calls.iter().map(|call| CallRef {
                call_id: &call.call_id,
                tool: &call.tool,
                args: Args::Json(&call.args),
            }),
        )
    }

    /// The number of calls.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    /// Whether the batch has no call.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// The tool of call `i`.
    pub(crate) fn tool(&self, i: usize) -> &'a str {
        self.sources[i].tool
    }

    /// The `n` of the cost bounds of a rule reading `calls`: the items of
    /// the largest list or map of the batch, or its number of calls.
    pub(crate) fn largest_collection(&self) -> usize {
        self.largest
    }

    /// The `n` of the cost bounds of a rule reading call `i` alone: the
    /// items of the largest list or map of its arguments, or the metadata.
    pub(crate) fn call_largest(&self, i: usize) -> usize {
        self.fast_calls
            .get(i)
            .map_or(0, |call| call.largest)
            .max(self.fast_context.metadata.len())
    }

    /// What the fast path reads for call `i`.
    #[cfg(test)]
    pub(crate) fn fast(&self, i: usize) -> Input<'_, 'a> {
        Input {
            calls: &self.fast_calls,
            call: i,
            context: &self.fast_context,
            meter: None,
        }
    }

    /// What the fast path reads for call `i`, charging `meter`.
    pub(crate) fn fast_metered<'m>(&'m self, i: usize, meter: &'m Meter) -> Input<'m, 'a> {
        Input {
            calls: &self.fast_calls,
            call: i,
            context: &self.fast_context,
            meter: Some(meter),
        }
    }

    /// The variables of call `i`'s evaluation by the interpreter: `call`,
    /// `calls`, `context`, all borrowed from these values.
    #[cfg(test)]
    pub(crate) fn scope(&self, i: usize) -> Scope<'_, 'a> {
        self.scope_of(i, None, [0; 4])
    }

    /// [`Self::scope`], each read of a variable charged to `meter`: one
    /// unit and the bytes it holds (see `meter`).
    pub(crate) fn scope_metered<'m>(&'m self, i: usize, meter: &'m Meter) -> Scope<'m, 'a> {
        let (call_bytes, batch_bytes) = self.call_bytes.get_or_init(|| {
            let call_bytes: Vec<usize> = self
                .sources
                .iter()
                .map(|call| {
                    let args = match call.args.text_or_json() {
                        Ok(text) => text.len(),
                        Err(json) => json.to_string().len(),
                    };
                    args + call.call_id.len() + call.tool.len()
                })
                .collect();
            let batch_bytes = call_bytes.iter().sum();
            (call_bytes, batch_bytes)
        });
        let bytes = [
            call_bytes.get(i).copied().unwrap_or(0),
            *batch_bytes,
            self.context_bytes,
            0,
        ]
        .map(|b| u64::try_from(b).unwrap_or(u64::MAX));
        self.scope_of(i, Some(meter), bytes)
    }

    /// The scope of call `i`, its reads charged to `meter` (if any) at
    /// `bytes` for `call`, `calls` and `context`.
    fn scope_of<'m>(
        &'m self,
        i: usize,
        meter: Option<&'m Meter>,
        bytes: [u64; 4],
    ) -> Scope<'m, 'a> {
        let cel = self.cel();
        Scope {
            call: cel.calls.inner()[i].as_ref(),
            calls: &cel.calls,
            context: &cel.context,
            session: self.session_at(i),
            identity: self.identity_at(i),
            meter,
            bytes,
        }
    }
}

/// The variables of one call's evaluation, resolved by name without
/// copying anything.
pub(crate) struct Scope<'s, 'a> {
    call: &'s (dyn Val + 'a),
    calls: &'s CelList<'a>,
    context: &'s CelMap<'a>,
    session: Option<super::session_cel::SessionAt>,
    identity: Option<super::session_cel::SessionAt>,
    meter: Option<&'s Meter>,
    /// The bytes of `call`, `calls` and `context` (`session`'s are its own).
    bytes: [u64; 4],
}

impl VariableResolver for Scope<'_, '_> {
    fn resolve<'b>(&'b self, variable: &str) -> Option<CowVal<'b, 'b>> {
        let (value, bytes): (&dyn Val, u64) = match variable {
            "call" => (self.call, self.bytes[0]),
            "calls" => (self.calls, self.bytes[1]),
            "context" => (self.context, self.bytes[2]),
            "session" => {
                let session = self.session.as_ref()?;
                (session as &dyn Val, session.bytes())
            }
            "identity" => {
                let identity = self.identity.as_ref()?;
                (identity as &dyn Val, identity.bytes())
            }
            _ => return None,
        };
        // Spent or out of time: the variable is undefined, so the
        // interpreter stops here (the engine reads the meter, not the error).
        if let Some(meter) = self.meter
            && !meter.charge(1 + bytes)
        {
            return None;
        }
        Some(CowVal::Borrowed(value))
    }
}

fn string(text: &str) -> Box<dyn Val + '_> {
    Box::new(CelString::from(text))
}

fn int(i: i64) -> Box<dyn Val + 'static> {
    Box::new(CelInt::from(i))
}

fn uint_or_int(u: u64) -> Box<dyn Val + 'static> {
    match i64::try_from(u) {
        Ok(i) => int(i),
        Err(_) => Box::new(CelUInt::from(u)),
    }
}

/// Parsed JSON to CEL (see the module's documentation).
fn from_json<'a>(value: &'a serde_json::Value, largest: &mut usize) -> Box<dyn Val + 'a> {
    match value {
        serde_json::Value::Null => Box::new(CelNull),
        serde_json::Value::Bool(b) => Box::new(CelBool::from(*b)),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                int(i)
            } else if let Some(u) = n.as_u64() {
                uint_or_int(u)
            } else {
                Box::new(CelDouble::from(n.as_f64().unwrap_or(f64::NAN)))
            }
        }
        serde_json::Value::String(s) => string(s),
        serde_json::Value::Array(items) => {
            *largest = (*largest).max(items.len());
            let items: Vec<Box<dyn Val + 'a>> =
                items.iter().map(|item| from_json(item, largest)).collect();
            Box::new(CelList::from(items))
        }
        serde_json::Value::Object(fields) => {
            *largest = (*largest).max(fields.len());
            let map: HashMap<CelMapKey<'a>, Box<dyn Val + 'a>> = fields
                .iter()
                .map(|(k, v)| (CelMapKey::from(k.as_str()), from_json(v, largest)))
                .collect();
            Box::new(CelMap::from(map))
        }
    }
}

/// JSON text to CEL in one pass, with no parsed JSON in between (see
/// [`Args::Text`]).
fn from_text<'a>(text: &'a str, largest: &mut usize) -> Box<dyn Val + 'a> {
    if text.trim().is_empty() {
        return Box::new(CelMap::from(HashMap::new()));
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let mut seen = 0;
    let value = JsonSeed { largest: &mut seen }
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
    match value {
        Ok(value) => {
            *largest = (*largest).max(seen);
            value
        }
        Err(_) => Box::new(CelNull),
    }
}

/// Deserializes one JSON value into a CEL value, borrowing strings without
/// escapes from the text, and records the largest list or map seen.
struct JsonSeed<'s> {
    largest: &'s mut usize,
}

impl<'de> DeserializeSeed<'de> for JsonSeed<'_> {
    type Value = Box<dyn Val + 'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonSeed<'_> {
    type Value = Box<dyn Val + 'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Box::new(CelNull))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Box::new(CelBool::from(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(int(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(uint_or_int(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Box::new(CelDouble::from(v)))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Box::new(CelString::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Box::new(CelString::from(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Box::new(CelString::from(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items: Vec<Box<dyn Val + 'de>> = Vec::new();
        while let Some(item) = seq.next_element_seed(JsonSeed {
            largest: &mut *self.largest,
        })? {
            items.push(item);
        }
        *self.largest = (*self.largest).max(items.len());
        Ok(Box::new(CelList::from(items)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields: HashMap<CelMapKey<'de>, Box<dyn Val + 'de>> =
            HashMap::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(key) = map.next_key_seed(super::json::KeySeed)? {
            let value = map.next_value_seed(JsonSeed {
                largest: &mut *self.largest,
            })?;
            fields.insert(CelMapKey::String(CelString::from(key)), value);
        }
        *self.largest = (*self.largest).max(fields.len());
        Ok(Box::new(CelMap::from(fields)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `call.args` of the only call of a batch whose arguments are `args`.
    fn type_of_arg(args: Args<'_>, field: &str) -> String {
        let values = BatchValues::new(
            ContextRef::default(),
            [],
            [CallRef {
                call_id: "c",
                tool: "t",
                args,
            }],
        );
        let env = std::sync::Arc::new(cel::Env::stdlib());
        let program = env
            .compile(&format!("type(call.args.{field})"))
            .expect("compiles");
        let scope = values.scope(0);
        let mut context = cel::Context::with_env(env);
        context.set_variable_resolver(&scope);
        format!("{:?}", program.execute(&context).expect("evaluates"))
    }

    #[test]
    fn numbers_keep_their_kind_from_text_and_from_parsed_json() {
        let text = format!(r#"{{"i": 3, "u": {}, "d": 2.5, "n": -1}}"#, u64::MAX);
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        for args in [Args::Text(&text), Args::Json(&parsed)] {
            assert!(type_of_arg(args, "i").contains("int"), "{args:?}");
            assert!(type_of_arg(args, "n").contains("int"), "{args:?}");
            assert!(type_of_arg(args, "u").contains("uint"), "{args:?}");
            assert!(type_of_arg(args, "d").contains("double"), "{args:?}");
        }
    }

    #[test]
    fn largest_collection_looks_inside_arguments() {
        let args = json!({"to": {"list": [1, 2, 3, 4, 5]}});
        let text = args.to_string();
        for args in [Args::Json(&args), Args::Text(&text)] {
            let values = BatchValues::new(
                ContextRef::default(),
                [("a", "b")],
                [CallRef {
                    call_id: "c1",
                    tool: "t",
                    args,
                }],
            );
            assert_eq!(values.largest_collection(), 5);
        }
    }

    #[test]
    fn text_that_does_not_parse_is_null_and_blank_text_is_an_empty_object() {
        let values = BatchValues::new(
            ContextRef::default(),
            [],
            [
                CallRef {
                    call_id: "bad",
                    tool: "t",
                    args: Args::Text("{\"a\": 1"),
                },
                CallRef {
                    call_id: "blank",
                    tool: "t",
                    args: Args::Text("  "),
                },
            ],
        );
        let env = std::sync::Arc::new(cel::Env::stdlib());
        let program = env.compile("type(call.args)").unwrap();
        let mut got = Vec::new();
        for i in 0..values.len() {
            let scope = values.scope(i);
            let mut context = cel::Context::with_env(env.clone());
            context.set_variable_resolver(&scope);
            got.push(format!("{:?}", program.execute(&context).unwrap()));
        }
        assert!(got[0].contains("null"), "{got:?}");
        assert!(got[1].contains("map"), "{got:?}");
    }
}
