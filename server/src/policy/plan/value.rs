//! What a plan reads, and the values it computes with: [`Input`], the
//! batch and the call being judged; `V`, a value during evaluation; and the
//! operations on values as CEL defines them (fields, items, sizes,
//! membership, equality, ordering, arithmetic).

use std::cmp::Ordering;

use crate::policy::json::Json;

use super::{Arith, Run, Unsure};

/// What an expression reads: the batch and the call being judged.
pub(crate) struct Input<'r, 'a> {
    pub(crate) calls: &'r [FastCall<'a>],
    pub(crate) call: usize,
    pub(crate) context: &'r FastContext<'a>,
    /// The call's budget (see `meter`): a step per node, a unit per byte of
    /// text read or built. Spent, the fast path gives up, and the engine
    /// reads the meter rather than asking the interpreter.
    pub(crate) meter: Option<&'r crate::policy::meter::Meter>,
}

impl Input<'_, '_> {
    /// Charges `units` of work; `Unsure` once the budget is spent.
    #[inline]
    pub(super) fn charge(&self, units: usize) -> Run<()> {
        match self.meter {
            Some(meter) if !meter.charge(units as u64) => Err(Unsure),
            _ => Ok(()),
        }
    }
}

/// One call, for the fast path.
#[derive(Debug)]
pub(crate) struct FastCall<'a> {
    pub(crate) call_id: &'a str,
    pub(crate) tool: &'a str,
    /// `None` when the arguments are only for the interpreter (see
    /// `Json::from_text`).
    pub(crate) args: Option<Json<'a>>,
    /// The items of the largest array or object of its arguments.
    pub(crate) largest: usize,
}

/// The batch's context, for the fast path.
#[derive(Debug)]
pub(crate) struct FastContext<'a> {
    pub(crate) session_id: &'a str,
    pub(crate) turn_index: u32,
    pub(crate) model_text: &'a str,
    pub(crate) metadata: Vec<(&'a str, &'a str)>,
}

/// A value during evaluation.
// Strings and lists are boxed on purpose (see `Owned`).
#[allow(clippy::box_collection)]
#[derive(Debug, Clone)]
pub(super) enum V<'r> {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    /// A string of the plan or of the input.
    Str(&'r str),
    /// A string built during evaluation. Boxed, as lists are: dropping a
    /// value of another kind is then a test, not a call.
    Owned(Box<String>),
    /// A list or an object of some call's arguments.
    Json(&'r Json<'r>),
    /// `calls[i]`, a map `{call_id, tool, args}`.
    CallMap(usize),
    Calls,
    Context,
    Metadata,
    List(Box<Vec<V<'r>>>),
}

impl V<'_> {
    pub(super) fn as_str(&self) -> Option<&str> {
        match self {
            V::Str(s) => Some(s),
            V::Owned(s) => Some(s.as_str()),
            _ => None,
        }
    }
}

/// A scalar from JSON, or the JSON list or object itself.
pub(super) fn from_json<'r>(json: &'r Json<'r>) -> V<'r> {
    match json {
        Json::Null => V::Null,
        Json::Bool(b) => V::Bool(*b),
        Json::Int(i) => V::Int(*i),
        Json::Uint(u) => V::Uint(*u),
        Json::Double(d) => V::Double(*d),
        Json::Str(s) => V::Str(s),
        Json::List(_) | Json::Map(_) => V::Json(json),
    }
}

const CALL_FIELDS: [&str; 3] = ["call_id", "tool", "args"];
const CONTEXT_FIELDS: [&str; 4] = ["session_id", "turn_index", "model_text", "metadata"];

/// `value.field`: `Some` if the map has it, `None` if it does not,
/// `Unsure` when `value` is not a map.
pub(super) fn field_of<'r>(
    value: &V<'r>,
    field: &str,
    input: &Input<'r, 'r>,
) -> Run<Option<V<'r>>> {
    Ok(match value {
        V::Json(Json::Map(object)) => object.get(field)?.map(from_json),
        V::CallMap(i) => {
            let call = input.calls.get(*i).ok_or(Unsure)?;
            match field {
                "call_id" => Some(V::Str(call.call_id)),
                "tool" => Some(V::Str(call.tool)),
                "args" => Some(from_json(call.args.as_ref().ok_or(Unsure)?)),
                _ => None,
            }
        }
        V::Context => {
            let context = input.context;
            match field {
                "session_id" => Some(V::Str(context.session_id)),
                "turn_index" => Some(V::Int(i64::from(context.turn_index))),
                "model_text" => Some(V::Str(context.model_text)),
                "metadata" => Some(V::Metadata),
                _ => None,
            }
        }
        V::Metadata => input
            .context
            .metadata
            .iter()
            .find(|(k, _)| *k == field)
            .map(|(_, v)| V::Str(v)),
        _ => return Err(Unsure),
    })
}

/// The items of a list, or the keys of a map.
pub(super) fn size(value: &V<'_>, input: &Input<'_, '_>) -> Run<usize> {
    Ok(match value {
        V::Str(s) => s.chars().count(),
        V::Owned(s) => s.chars().count(),
        V::Json(Json::List(items)) => items.len(),
        V::Json(Json::Map(object)) => object.len(),
        V::List(items) => items.len(),
        V::Calls => input.calls.len(),
        V::CallMap(_) => CALL_FIELDS.len(),
        V::Context => CONTEXT_FIELDS.len(),
        V::Metadata => input.context.metadata.len(),
        _ => return Err(Unsure),
    })
}

/// Item `i` of a list, or key `i` of a map, as a macro iterates them.
pub(super) fn item_of<'r>(value: &V<'r>, i: usize, input: &Input<'r, 'r>) -> Run<V<'r>> {
    let key = |k: &'r str| V::Str(k);
    Ok(match value {
        V::Json(Json::List(items)) => from_json(items.get(i).ok_or(Unsure)?),
        V::Json(Json::Map(object)) => V::Str(object.key(i).ok_or(Unsure)?),
        V::List(items) => items.get(i).cloned().ok_or(Unsure)?,
        V::Calls if i < input.calls.len() => V::CallMap(i),
        V::CallMap(_) => key(CALL_FIELDS.get(i).ok_or(Unsure)?),
        V::Context => key(CONTEXT_FIELDS.get(i).ok_or(Unsure)?),
        V::Metadata => key(input.context.metadata.get(i).ok_or(Unsure)?.0),
        _ => return Err(Unsure),
    })
}

pub(super) fn index_of<'r>(container: &V<'r>, index: &V<'r>, input: &Input<'r, 'r>) -> Run<V<'r>> {
    match (container, index) {
        (V::Json(Json::List(_)) | V::List(_) | V::Calls, V::Int(i)) => {
            let i = usize::try_from(*i).map_err(|_| Unsure)?;
            if i >= size(container, input)? {
                return Err(Unsure);
            }
            item_of(container, i, input)
        }
        (V::Json(Json::Map(_)) | V::CallMap(_) | V::Context | V::Metadata, key) => {
            field_of(container, key.as_str().ok_or(Unsure)?, input)?.ok_or(Unsure)
        }
        _ => Err(Unsure),
    }
}

/// `needle in haystack`: a list holding an equal scalar, or a map with
/// that string key.
pub(super) fn contains(haystack: &V<'_>, needle: &V<'_>, input: &Input<'_, '_>) -> Run<bool> {
    match haystack {
        V::Json(Json::List(items)) => {
            input.charge(items.len())?;
            for item in items {
                if equals(&from_json(item), needle)? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        V::List(items) => {
            input.charge(items.len())?;
            for item in items.iter() {
                if equals(item, needle)? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        V::Json(Json::Map(_)) | V::CallMap(_) | V::Context | V::Metadata => {
            let key = needle.as_str().ok_or(Unsure)?;
            Ok(match haystack {
                V::Json(Json::Map(object)) => object.has(key),
                V::CallMap(_) => CALL_FIELDS.contains(&key),
                V::Context => CONTEXT_FIELDS.contains(&key),
                _ => input.context.metadata.iter().any(|(k, _)| *k == key),
            })
        }
        _ => Err(Unsure),
    }
}

/// CEL's `==` between scalars (the interpreter's: numbers compare across
/// `int`, `uint` and `double`; other kinds differ from each other).
/// `Unsure` for lists and maps, and NaN.
pub(super) fn equals(a: &V<'_>, b: &V<'_>) -> Run<bool> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        return Ok(x == y);
    }
    if !is_scalar(a) || !is_scalar(b) {
        return Err(Unsure);
    }
    Ok(match (a, b) {
        (V::Null, V::Null) => true,
        (V::Bool(x), V::Bool(y)) => x == y,
        (V::Int(_) | V::Uint(_) | V::Double(_), V::Int(_) | V::Uint(_) | V::Double(_)) => {
            match compare(a, b) {
                Ok(ordering) => ordering == Ordering::Equal,
                Err(Unsure) => return Err(Unsure),
            }
        }
        _ => false,
    })
}

fn is_scalar(v: &V<'_>) -> bool {
    matches!(
        v,
        V::Null | V::Bool(_) | V::Int(_) | V::Uint(_) | V::Double(_) | V::Str(_) | V::Owned(_)
    )
}

/// CEL's ordering of numbers and of strings; `Unsure` otherwise (and for
/// NaN).
pub(super) fn compare(a: &V<'_>, b: &V<'_>) -> Run<Ordering> {
    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
        return Ok(x.cmp(y));
    }
    let float = |x: f64, y: f64| x.partial_cmp(&y).ok_or(Unsure);
    #[allow(clippy::cast_precision_loss)]
    match (a, b) {
        (V::Int(x), V::Int(y)) => Ok(x.cmp(y)),
        (V::Uint(x), V::Uint(y)) => Ok(x.cmp(y)),
        (V::Double(x), V::Double(y)) => float(*x, *y),
        (V::Int(x), V::Double(y)) => float(*x as f64, *y),
        (V::Double(x), V::Int(y)) => float(*x, *y as f64),
        (V::Uint(x), V::Double(y)) => float(*x as f64, *y),
        (V::Double(x), V::Uint(y)) => float(*x, *y as f64),
        (V::Int(x), V::Uint(y)) => Ok(u64::try_from(*x).map_or(Ordering::Less, |x| x.cmp(y))),
        (V::Uint(x), V::Int(y)) => Ok(u64::try_from(*y).map_or(Ordering::Greater, |y| x.cmp(&y))),
        _ => Err(Unsure),
    }
}

pub(super) fn arith<'r>(op: Arith, a: V<'r>, b: V<'r>) -> Run<V<'r>> {
    Ok(match (op, a, b) {
        (Arith::Add, V::Int(x), V::Int(y)) => V::Int(x.checked_add(y).ok_or(Unsure)?),
        (Arith::Sub, V::Int(x), V::Int(y)) => V::Int(x.checked_sub(y).ok_or(Unsure)?),
        (Arith::Mul, V::Int(x), V::Int(y)) => V::Int(x.checked_mul(y).ok_or(Unsure)?),
        (Arith::Add, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_add(y).ok_or(Unsure)?),
        (Arith::Sub, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_sub(y).ok_or(Unsure)?),
        (Arith::Mul, V::Uint(x), V::Uint(y)) => V::Uint(x.checked_mul(y).ok_or(Unsure)?),
        (Arith::Add, V::Double(x), V::Double(y)) => V::Double(x + y),
        (Arith::Sub, V::Double(x), V::Double(y)) => V::Double(x - y),
        (Arith::Mul, V::Double(x), V::Double(y)) => V::Double(x * y),
        (Arith::Add, V::List(mut x), V::List(y)) => {
            x.extend(*y);
            V::List(x)
        }
        (Arith::Add, x, y) => {
            let (Some(_), Some(tail)) = (x.as_str(), y.as_str()) else {
                return Err(Unsure);
            };
            let mut s = match x {
                V::Owned(s) => *s,
                x => x.as_str().ok_or(Unsure)?.to_owned(),
            };
            s.push_str(tail);
            V::Owned(Box::new(s))
        }
        _ => return Err(Unsure),
    })
}
