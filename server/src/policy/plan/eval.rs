//! Evaluation: a plan's nodes over one call's [`Input`], giving up
//! ([`Unsure`]) on any step the interpreter must take.

use crate::policy::json::{Json, Object};

use super::value::{
    arith, compare, contains, equals, field_of, from_json, index_of, item_of, size,
};
use super::{
    Compare, FastCall, Input, Node, Pattern, Run, TextTest, Transform, Unsure, V, is_literal,
};

/// The value of `node`; `Unsure` wherever the interpreter must decide.
pub(super) fn eval<'r>(node: &'r Node, input: &Input<'r, 'r>, slots: &mut [V<'r>]) -> Run<V<'r>> {
    input.charge(1)?;
    Ok(match node {
        Node::Null => V::Null,
        Node::Bool(b) => V::Bool(*b),
        Node::Int(i) => V::Int(*i),
        Node::Uint(u) => V::Uint(*u),
        Node::Double(d) => V::Double(*d),
        Node::Str(s) => V::Str(s),
        Node::Call => V::CallMap(input.call),
        Node::Calls => V::Calls,
        Node::Context => V::Context,
        Node::Args => from_json(this_call(input)?.args.as_ref().ok_or(Unsure)?),
        Node::Arg(field) => from_json(args(input)?.get(field)?.ok_or(Unsure)?),
        Node::Tool => V::Str(this_call(input)?.tool),
        Node::CallId => V::Str(this_call(input)?.call_id),
        Node::Metadata => V::Metadata,
        Node::ModelText => V::Str(input.context.model_text),
        Node::Slot(s) => slots.get(*s).cloned().ok_or(Unsure)?,
        Node::ToolOf(s) => V::Str(call_in(slots, *s, input)?.tool),
        Node::CallIdOf(s) => V::Str(call_in(slots, *s, input)?.call_id),
        Node::ArgsOf(s) => from_json(call_in(slots, *s, input)?.args.as_ref().ok_or(Unsure)?),
        Node::Select {
            operand,
            fields,
            test: false,
        } => select(operand, fields, input, slots)?.ok_or(Unsure)?,
        Node::Select { test: true, .. }
        | Node::ArgHas(_)
        | Node::ArgMatches(..)
        | Node::Not(_)
        | Node::And(..)
        | Node::Or(..)
        | Node::NotStrictlyFalse(_)
        | Node::Eq(..)
        | Node::Ne(..)
        | Node::Compare(..)
        | Node::In(..)
        | Node::Matches(..)
        | Node::Text(..)
        | Node::Quantifier { .. } => V::Bool(test(node, input, slots)?),
        Node::Negate(a) => match eval(a, input, slots)? {
            V::Int(i) => V::Int(i.checked_neg().ok_or(Unsure)?),
            V::Double(d) => V::Double(-d),
            _ => return Err(Unsure),
        },
        Node::Cond(abc) => {
            let [c, a, b] = &**abc;
            if test(c, input, slots)? {
                eval(a, input, slots)?
            } else {
                eval(b, input, slots)?
            }
        }
        Node::Arith(op, a, b) => {
            let (a, b) = (eval(a, input, slots)?, eval(b, input, slots)?);
            // A string or list built by `+` is charged its size before it
            // is built.
            match (&a, &b) {
                (V::List(x), V::List(y)) => input.charge(x.len() + y.len())?,
                _ => {
                    if let (Some(x), Some(y)) = (a.as_str(), b.as_str()) {
                        input.charge(x.len() + y.len())?;
                    }
                }
            }
            arith(*op, a, b)?
        }
        Node::Index(a, b) => {
            let container = eval(a, input, slots)?;
            let index = eval(b, input, slots)?;
            index_of(&container, &index, input)?
        }
        Node::Size(a) => {
            let value = eval(a, input, slots)?;
            V::Int(i64::try_from(size(&value, input)?).map_err(|_| Unsure)?)
        }
        Node::ToString(a) => match eval(a, input, slots)? {
            s @ (V::Str(_) | V::Owned(_)) => s,
            V::Int(i) => V::Owned(Box::new(i.to_string())),
            V::Uint(u) => V::Owned(Box::new(u.to_string())),
            _ => return Err(Unsure),
        },
        Node::Transform(f, a) => match (f, eval(a, input, slots)?) {
            (Transform::Trim, V::Str(s)) => V::Str(s.trim()),
            (f, V::Str(s)) => {
                input.charge(s.len())?;
                V::Owned(Box::new(f.apply(s)))
            }
            (f, V::Owned(s)) => {
                input.charge(s.len())?;
                V::Owned(Box::new(f.apply(&s)))
            }
            _ => return Err(Unsure),
        },
        Node::HasFlags(a, asked) => {
            let value = eval(a, input, slots)?;
            let text = value.as_str().ok_or(Unsure)?;
            input.charge(text.len())?;
            let flags: Vec<&str> = asked.1.iter().map(String::as_str).collect();
            // An error is the interpreter's to report.
            V::Bool(crate::policy::shell::has_flags(text, &asked.0, &flags).map_err(|_| Unsure)?)
        }
        Node::List(items) => V::List(Box::new(
            items
                .iter()
                .map(|item| eval(item, input, slots))
                .collect::<Run<_>>()?,
        )),
        Node::Fold(fold) => {
            let init = eval(&fold.init, input, slots)?;
            let range = eval(&fold.range, input, slots)?;
            let is_map = match range {
                V::Json(Json::Map(_)) | V::CallMap(_) | V::Context | V::Metadata => true,
                V::Json(Json::List(_)) | V::List(_) | V::Calls => false,
                _ => return Err(Unsure),
            };
            // A map's keys come in no defined order: a list built from
            // them (`map`, `filter`) is left to the interpreter.
            if is_map && matches!(init, V::List(_)) {
                return Err(Unsure);
            }
            set(slots, fold.accu, init)?;
            let count = size(&range, input)?;
            for i in 0..count {
                if !test(&fold.cond, input, slots)? {
                    break;
                }
                let item = item_of(&range, i, input)?;
                set(slots, fold.iter, item)?;
                let accu = eval(&fold.step, input, slots)?;
                set(slots, fold.accu, accu)?;
            }
            eval(&fold.result, input, slots)?
        }
        Node::Append { accu, element } => {
            let element = eval(element, input, slots)?;
            let slot = slots.get_mut(*accu).ok_or(Unsure)?;
            let V::List(mut list) = std::mem::replace(slot, V::Null) else {
                return Err(Unsure);
            };
            list.push(element);
            V::List(list)
        }
        Node::Take(accu) => std::mem::replace(slots.get_mut(*accu).ok_or(Unsure)?, V::Null),
    })
}

/// [`eval`], with the common leaves (literal strings and ints, resolved
/// fields, field paths, slots) answered here rather than through every
/// case of `eval`.
#[inline]
fn fetch<'r>(node: &'r Node, input: &Input<'r, 'r>, slots: &mut [V<'r>]) -> Run<V<'r>> {
    match node {
        Node::Str(s) => Ok(V::Str(s)),
        Node::Int(i) => Ok(V::Int(*i)),
        Node::Arg(field) => Ok(from_json(args(input)?.get(field)?.ok_or(Unsure)?)),
        Node::Args => Ok(from_json(this_call(input)?.args.as_ref().ok_or(Unsure)?)),
        Node::Tool => Ok(V::Str(this_call(input)?.tool)),
        Node::Metadata => Ok(V::Metadata),
        Node::Slot(s) => slots.get(*s).cloned().ok_or(Unsure),
        Node::ToolOf(s) => Ok(V::Str(call_in(slots, *s, input)?.tool)),
        Node::ArgsOf(s) => Ok(from_json(
            call_in(slots, *s, input)?.args.as_ref().ok_or(Unsure)?,
        )),
        Node::Select {
            operand,
            fields,
            test: false,
        } => select(operand, fields, input, slots)?.ok_or(Unsure),
        _ => eval(node, input, slots),
    }
}

/// [`eval`] of a node that must be a bool, without building values where
/// it can: the logical operators, tests and comparisons answer here.
pub(super) fn test<'r>(node: &'r Node, input: &Input<'r, 'r>, slots: &mut [V<'r>]) -> Run<bool> {
    input.charge(1)?;
    match node {
        Node::Bool(b) => Ok(*b),
        Node::Select {
            operand,
            fields,
            test: true,
        } => has(operand, fields, input, slots),
        Node::ArgHas(field) => Ok(args(input)?.has(field)),
        Node::ArgMatches(field, matcher) => match args(input)?.get(field)? {
            Some(Json::Str(text)) => {
                input.charge(text.len())?;
                Ok(matcher.is_match(text))
            }
            _ => Err(Unsure),
        },
        Node::Not(a) => Ok(!test(a, input, slots)?),
        Node::And(a, b) => Ok(test(a, input, slots)? && test(b, input, slots)?),
        Node::Or(a, b) => Ok(test(a, input, slots)? || test(b, input, slots)?),
        Node::Cond(abc) => {
            let [c, a, b] = &**abc;
            if test(c, input, slots)? {
                test(a, input, slots)
            } else {
                test(b, input, slots)
            }
        }
        Node::NotStrictlyFalse(a) => test(a, input, slots),
        Node::Eq(a, b) => equals(&fetch(a, input, slots)?, &fetch(b, input, slots)?),
        Node::Ne(a, b) => Ok(!equals(&fetch(a, input, slots)?, &fetch(b, input, slots)?)?),
        Node::Compare(op, a, b) => {
            if let (Node::Size(a), Node::Int(k)) = (&**a, &**b) {
                return size_compare(*op, fetch(a, input, slots)?, *k, input);
            }
            let ordering = compare(&fetch(a, input, slots)?, &fetch(b, input, slots)?)?;
            Ok(op.holds(ordering))
        }
        Node::In(a, b) => {
            let needle = fetch(a, input, slots)?;
            if let Node::List(items) = &**b
                && items.iter().all(is_literal)
            {
                // A list of literals written in the rule (`x in ['a', 'b']`):
                // compared item by item, not built as a list first (no item
                // can fail, so stopping at the first equal one is safe).
                for item in items {
                    if equals(&fetch(item, input, slots)?, &needle)? {
                        return Ok(true);
                    }
                }
                return Ok(false);
            }
            let haystack = fetch(b, input, slots)?;
            contains(&haystack, &needle, input)
        }
        Node::Matches(text, pattern) => {
            let text = fetch(text, input, slots)?;
            let text = text.as_str().ok_or(Unsure)?;
            input.charge(text.len())?;
            match pattern {
                Pattern::Fixed(matcher) => Ok(matcher.is_match(text)),
                Pattern::Computed(p) => {
                    let p = fetch(p, input, slots)?;
                    let regex = crate::policy::patterns::lookup(p.as_str().ok_or(Unsure)?)
                        .map_err(|_| Unsure)?;
                    Ok(regex.is_match(text))
                }
            }
        }
        Node::Text(how, a, b) => {
            let (a, b) = (fetch(a, input, slots)?, fetch(b, input, slots)?);
            let (Some(a), Some(b)) = (a.as_str(), b.as_str()) else {
                return Err(Unsure);
            };
            input.charge(a.len())?;
            Ok(match how {
                TextTest::StartsWith => a.starts_with(b),
                TextTest::EndsWith => a.ends_with(b),
                TextTest::Contains => a.contains(b),
            })
        }
        Node::Quantifier {
            any,
            range,
            iter,
            pred,
        } => {
            let range = fetch(range, input, slots)?;
            if let (V::Json(Json::Map(object)), Node::Matches(text, Pattern::Fixed(matcher))) =
                (&range, &**pred)
                && matches!(**text, Node::Slot(s) if s == *iter)
            {
                // `object.exists(k, k.matches(r'...'))`: the keys as they
                // are, no slot set.
                for i in 0..object.len() {
                    let key = object.key(i).ok_or(Unsure)?;
                    input.charge(1 + key.len())?;
                    if matcher.is_match(key) == *any {
                        return Ok(*any);
                    }
                }
                return Ok(!*any);
            }
            if !matches!(
                range,
                V::Json(Json::Map(_) | Json::List(_))
                    | V::CallMap(_)
                    | V::Context
                    | V::Metadata
                    | V::List(_)
                    | V::Calls
            ) {
                return Err(Unsure);
            }
            for i in 0..size(&range, input)? {
                set(slots, *iter, item_of(&range, i, input)?)?;
                if test(pred, input, slots)? == *any {
                    return Ok(*any);
                }
            }
            Ok(!*any)
        }
        _ => match eval(node, input, slots)? {
            V::Bool(b) => Ok(b),
            _ => Err(Unsure),
        },
    }
}

/// `size(value) op k`. A string's size, its characters, is between a
/// quarter of its bytes and its bytes: when those bounds decide, the
/// characters are not counted.
fn size_compare(op: Compare, value: V<'_>, k: i64, input: &Input<'_, '_>) -> Run<bool> {
    let count = |n: usize| i64::try_from(n).map_err(|_| Unsure);
    if let Some(s) = value.as_str() {
        let (low, high) = (count(s.len().div_ceil(4))?, count(s.len())?);
        let (low, high) = (op.holds(low.cmp(&k)), op.holds(high.cmp(&k)));
        if low == high {
            // Every comparison holds on an interval of sizes: at both
            // ends, in between.
            return Ok(low);
        }
        return Ok(op.holds(count(s.chars().count())?.cmp(&k)));
    }
    Ok(op.holds(count(size(&value, input)?)?.cmp(&k)))
}

fn this_call<'r>(input: &Input<'r, 'r>) -> Run<&'r FastCall<'r>> {
    input.calls.get(input.call).ok_or(Unsure)
}

/// The call macro variable `slot` holds (it ranges over `calls`).
fn call_in<'r>(slots: &[V<'r>], slot: usize, input: &Input<'r, 'r>) -> Run<&'r FastCall<'r>> {
    match slots.get(slot) {
        Some(V::CallMap(i)) => input.calls.get(*i).ok_or(Unsure),
        _ => Err(Unsure),
    }
}

/// This call's arguments as an object: `Unsure` when they are only for the
/// interpreter, or not an object (a member of them is then an error).
fn args<'r>(input: &Input<'r, 'r>) -> Run<&'r Object<'r>> {
    match this_call(input)?.args.as_ref() {
        Some(Json::Map(object)) => Ok(object),
        _ => Err(Unsure),
    }
}

/// `operand.f1.f2...`: `None` when the last field is missing; `Unsure`
/// when another is, or a value is not a map.
fn select<'r>(
    operand: &'r Node,
    fields: &'r [String],
    input: &Input<'r, 'r>,
    slots: &mut [V<'r>],
) -> Run<Option<V<'r>>> {
    let (last, path) = fields.split_last().ok_or(Unsure)?;
    let mut value = fetch(operand, input, slots)?;
    if let V::Json(json) = value {
        return Ok(member(json, path, last)?.map(from_json));
    }
    for field in path {
        value = field_of(&value, field, input)?.ok_or(Unsure)?;
    }
    field_of(&value, last, input)
}

/// `has(operand.f1.f2...)`: [`select`] without the value.
fn has<'r>(
    operand: &'r Node,
    fields: &'r [String],
    input: &Input<'r, 'r>,
    slots: &mut [V<'r>],
) -> Run<bool> {
    let (last, path) = fields.split_last().ok_or(Unsure)?;
    let mut value = fetch(operand, input, slots)?;
    if let V::Json(json) = value {
        return Ok(parent(json, path)?.has(last));
    }
    for field in path {
        value = field_of(&value, field, input)?.ok_or(Unsure)?;
    }
    Ok(field_of(&value, last, input)?.is_some())
}

/// Member `path...last` of arguments, from JSON to JSON with no value in
/// between: `None` when the last is missing, `Unsure` when another is or a
/// value is not an object.
fn member<'r>(json: &'r Json<'r>, path: &[String], last: &str) -> Run<Option<&'r Json<'r>>> {
    Ok(parent(json, path)?.get(last)?)
}

/// The object at `path` of arguments: `Unsure` when a member on the way is
/// missing or a value is not an object.
fn parent<'r>(json: &'r Json<'r>, path: &[String]) -> Run<&'r Object<'r>> {
    let mut json = json;
    for field in path {
        let Json::Map(object) = json else {
            return Err(Unsure);
        };
        json = object.get(field)?.ok_or(Unsure)?;
    }
    let Json::Map(object) = json else {
        return Err(Unsure);
    };
    Ok(object)
}

fn set<'r>(slots: &mut [V<'r>], slot: usize, value: V<'r>) -> Run<()> {
    *slots.get_mut(slot).ok_or(Unsure)? = value;
    Ok(())
}
