//! The fast path against the CEL interpreter (R27: a rule's verdict must not
//! depend on which of them evaluated it). Random expressions over random
//! calls: wherever the fast path answers, the interpreter must give the same
//! value, never an error. And the fast path must answer often enough for
//! this to test something.

use std::collections::BTreeMap;
use std::sync::Arc;

use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelNull, CelString, CelUInt,
};
use cel::common::value::Val;
use cel::{Context, Env, Value};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::json;

use super::value::V;
use super::{Input, Plan, Unsure};
use crate::policy::engine::environment;
use crate::policy::input::{Args, BatchInput, BatchValues, CallInput, CallRef, ContextRef};
use crate::policy::json::Json;

/// A value, comparable across both evaluators.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plain {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    /// Bits, so that NaN equals NaN and 0.0 differs from -0.0.
    Double(u64),
    Str(String),
    List(Vec<Plain>),
    Map(BTreeMap<String, Plain>),
}

/// Why [`Plan::plain`] has no value.
#[derive(Debug)]
pub(crate) enum Seen {
    Unsure,
    /// A value with no plain form (a bug of the fast path).
    Unplain,
}

impl Plan {
    /// Evaluates to a value comparable with the interpreter's.
    pub(crate) fn plain(&self, input: &Input<'_, '_>) -> Result<Plain, Seen> {
        let value = self
            .run(input, super::eval::eval)
            .map_err(|Unsure| Seen::Unsure)?;
        plain(&value, input).ok_or(Seen::Unplain)
    }
}

fn plain(value: &V<'_>, input: &Input<'_, '_>) -> Option<Plain> {
    fn json(value: &Json<'_>) -> Plain {
        match value {
            Json::Null => Plain::Null,
            Json::Bool(b) => Plain::Bool(*b),
            Json::Int(i) => Plain::Int(*i),
            Json::Uint(u) => Plain::Uint(*u),
            Json::Double(d) => Plain::Double(d.to_bits()),
            Json::Str(s) => Plain::Str(s.to_string()),
            Json::List(items) => Plain::List(items.iter().map(json).collect()),
            Json::Map(object) => Plain::Map(
                object
                    .iter()
                    .map(|(k, v)| (k.to_string(), json(v.expect("a member that parses"))))
                    .collect(),
            ),
        }
    }
    let input: &Input<'_, '_> = input;
    Some(match value {
        V::Null => Plain::Null,
        V::Bool(b) => Plain::Bool(*b),
        V::Int(i) => Plain::Int(*i),
        V::Uint(u) => Plain::Uint(*u),
        V::Double(d) => Plain::Double(d.to_bits()),
        V::Str(s) => Plain::Str((*s).to_owned()),
        V::Owned(s) => Plain::Str(s.to_string()),
        V::Json(j) => json(j),
        V::List(items) => Plain::List(
            items
                .iter()
                .map(|v| plain(v, input))
                .collect::<Option<_>>()?,
        ),
        V::CallMap(i) => {
            let call = input.calls.get(*i)?;
            Plain::Map(BTreeMap::from([
                ("call_id".to_owned(), Plain::Str(call.call_id.to_owned())),
                ("tool".to_owned(), Plain::Str(call.tool.to_owned())),
                ("args".to_owned(), json(call.args.as_ref()?)),
            ]))
        }
        V::Calls => Plain::List(
            (0..input.calls.len())
                .map(|i| plain(&V::CallMap(i), input))
                .collect::<Option<_>>()?,
        ),
        V::Metadata => Plain::Map(
            input
                .context
                .metadata
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Plain::Str((*v).to_owned())))
                .collect(),
        ),
        V::Context => Plain::Map(BTreeMap::from([
            (
                "session_id".to_owned(),
                Plain::Str(input.context.session_id.to_owned()),
            ),
            (
                "turn_index".to_owned(),
                Plain::Int(i64::from(input.context.turn_index)),
            ),
            (
                "model_text".to_owned(),
                Plain::Str(input.context.model_text.to_owned()),
            ),
            ("metadata".to_owned(), plain(&V::Metadata, input)?),
        ])),
    })
}

fn from_cel(value: &dyn Val) -> Option<Plain> {
    Some(if value.downcast_ref::<CelNull>().is_some() {
        Plain::Null
    } else if let Some(b) = value.downcast_ref::<CelBool>() {
        Plain::Bool(*b.inner())
    } else if let Some(i) = value.downcast_ref::<CelInt>() {
        Plain::Int(*i.inner())
    } else if let Some(u) = value.downcast_ref::<CelUInt>() {
        Plain::Uint(*u.inner())
    } else if let Some(d) = value.downcast_ref::<CelDouble>() {
        Plain::Double(d.inner().to_bits())
    } else if let Some(s) = value.downcast_ref::<CelString>() {
        Plain::Str(s.inner().to_owned())
    } else if let Some(list) = value.downcast_ref::<CelList>() {
        Plain::List(
            list.inner()
                .iter()
                .map(|v| from_cel(v.as_ref()))
                .collect::<Option<_>>()?,
        )
    } else if let Some(map) = value.downcast_ref::<CelMap>() {
        let mut out = BTreeMap::new();
        for (k, v) in map.inner() {
            let key = k.inner().downcast_ref::<CelString>()?;
            out.insert(key.inner().to_owned(), from_cel(v.as_ref())?);
        }
        Plain::Map(out)
    } else {
        return None;
    })
}

/// Expressions: atoms, and operators, functions and macros over them.
fn expression() -> impl Strategy<Value = String> {
    let atom = prop_oneof![
        Just("0".to_owned()),
        Just("1".to_owned()),
        Just("-3".to_owned()),
        Just("10000".to_owned()),
        Just("9223372036854775807".to_owned()),
        Just("1u".to_owned()),
        Just("18446744073709551615u".to_owned()),
        Just("1.0".to_owned()),
        Just("2.5".to_owned()),
        Just("-0.0".to_owned()),
        Just("'a'".to_owned()),
        Just("''".to_owned()),
        Just("'sql.query'".to_owned()),
        Just("'é'".to_owned()),
        Just("' Sql.QUERY\\t\u{2003}'".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("null".to_owned()),
        Just("call".to_owned()),
        Just("call.tool".to_owned()),
        Just("call.call_id".to_owned()),
        Just("call.args".to_owned()),
        Just("call.args.s".to_owned()),
        Just("call.args.n".to_owned()),
        Just("call.args.d".to_owned()),
        Just("call.args.b".to_owned()),
        Just("call.args.l".to_owned()),
        Just("call.args.o".to_owned()),
        Just("call.args.o.k".to_owned()),
        Just("call.args.missing".to_owned()),
        Just("context".to_owned()),
        Just("context.metadata".to_owned()),
        Just("context.metadata.tenant".to_owned()),
        Just("context.model_text".to_owned()),
        Just("context.turn_index".to_owned()),
        Just("calls".to_owned()),
        Just("calls[0]".to_owned()),
        Just("calls[1].args.n".to_owned()),
        Just("x".to_owned()),
        Just("y".to_owned()),
        Just("has(call.args.s)".to_owned()),
        Just("has(call.args.o.k)".to_owned()),
        Just("has(context.metadata.env)".to_owned()),
        Just("has(x.args)".to_owned()),
        Just("x.tool".to_owned()),
        Just("x.args".to_owned()),
        Just("x.args.n".to_owned()),
        Just("y.call_id".to_owned()),
        Just("has(y.args.s)".to_owned()),
    ];
    atom.prop_recursive(4, 48, 3, |inner| {
        let binary = [
            "==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "&&", "||", "in",
        ];
        let macros = ["exists", "all", "exists_one", "filter", "map"];
        let methods = ["startsWith", "endsWith", "contains", "matches"];
        prop_oneof![
            (inner.clone(), 0..binary.len(), inner.clone())
                .prop_map(move |(a, op, b)| format!("({a} {} {b})", binary[op])),
            inner.clone().prop_map(|a| format!("!{a}")),
            inner.clone().prop_map(|a| format!("-{a}")),
            inner.clone().prop_map(|a| format!("size({a})")),
            inner.clone().prop_map(|a| format!("{a}.size()")),
            inner.clone().prop_map(|a| format!("string({a})")),
            (inner.clone(), 0..3usize)
                .prop_map(|(a, f)| format!("{a}.{}()", ["lowerAscii", "upperAscii", "trim"][f])),
            (inner.clone(), inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("({c} ? {a} : {b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a}[{b}]")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("[{a}, {b}]")),
            (inner.clone(), 0..methods.len(), inner.clone())
                .prop_map(move |(a, m, b)| format!("{a}.{}({b})", methods[m])),
            inner.clone().prop_map(|a| format!("{a}.matches('^(?i)s')")),
            (
                inner.clone(),
                0..macros.len(),
                prop::bool::ANY,
                inner.clone()
            )
                .prop_map(move |(range, m, y, body)| {
                    let var = if y { "y" } else { "x" };
                    format!("{range}.{}({var}, {body})", macros[m])
                }),
        ]
    })
}

fn pick(items: &[&'static str]) -> BoxedStrategy<String> {
    prop::sample::select(items.to_vec())
        .prop_map(str::to_owned)
        .boxed()
}

/// Expressions that mostly type-check: strings, numbers and booleans built
/// from each other, so that the fast path has something to answer.
fn typed() -> impl Strategy<Value = String> {
    let strings = pick(&[
        "'a'",
        "''",
        "'sql.query'",
        "'é'",
        "'Select'",
        "call.tool",
        "call.call_id",
        "call.args.s",
        "context.metadata.tenant",
        "context.model_text",
        "x",
        "x.tool",
        "calls[0].tool",
        "call.args.o.k",
        "call.args.l[0]",
    ]);
    let numbers = pick(&[
        "0",
        "1",
        "-3",
        "10000",
        "9223372036854775807",
        "1u",
        "18446744073709551615u",
        "1.0",
        "2.5",
        "-0.0",
        "call.args.n",
        "call.args.d",
        "context.turn_index",
        "size(calls)",
        "x",
        "x.args.n",
        "call.args.l[1]",
        "size(call.args)",
    ]);
    let lists = pick(&[
        "calls",
        "call.args.l",
        "call.args.o",
        "context.metadata",
        "call",
        "context",
        "['a', 'b']",
        "[1, 2.0, 3u]",
        "['s', call.tool]",
        "calls.map(x, x.tool)",
        "calls.filter(x, has(x.args.n))",
        "call.args.l.map(x, x)",
    ]);
    let strings = strings.prop_recursive(2, 8, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} + {b})")),
            inner.clone().prop_map(|a| format!("string({a})")),
            (inner.clone(), 0..3usize)
                .prop_map(|(a, f)| format!("{a}.{}()", ["lowerAscii", "upperAscii", "trim"][f])),
        ]
    });
    let numbers = numbers.prop_recursive(2, 8, 2, move |inner| {
        let ops = ["+", "-", "*"];
        prop_oneof![
            (inner.clone(), 0..ops.len(), inner.clone())
                .prop_map(move |(a, op, b)| format!("({a} {} {b})", ops[op])),
            inner.clone().prop_map(|a| format!("-{a}")),
        ]
    });
    let leaf = {
        let strings = strings.clone();
        let numbers = numbers.clone();
        let cmp = ["==", "!=", "<", "<=", ">", ">="];
        let tests = ["startsWith", "endsWith", "contains"];
        prop_oneof![
            pick(&[
                "true",
                "false",
                "has(call.args.s)",
                "has(call.args.o.k)",
                "has(context.metadata.env)",
                "has(x.args)",
                "call.args.b",
                "x",
            ]),
            (strings.clone(), 0..cmp.len(), strings.clone())
                .prop_map(move |(a, op, b)| format!("{a} {} {b}", cmp[op])),
            (numbers.clone(), 0..cmp.len(), numbers.clone())
                .prop_map(move |(a, op, b)| format!("{a} {} {b}", cmp[op])),
            (strings.clone(), 0..tests.len(), strings.clone())
                .prop_map(move |(a, t, b)| format!("{a}.{}({b})", tests[t])),
            strings
                .clone()
                .prop_map(|a| format!("{a}.matches('(?i)^s|a$')")),
            strings.clone().prop_map(|a| format!("size({a}) > 1")),
            (strings.clone(), lists.clone()).prop_map(|(a, l)| format!("{a} in {l}")),
            (numbers, lists.clone()).prop_map(|(a, l)| format!("{a} in {l}")),
            lists.clone().prop_map(|l| format!("size({l}) >= 2")),
        ]
    };
    leaf.prop_recursive(3, 24, 2, move |inner| {
        let macros = ["exists", "all", "exists_one"];
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} && {b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} || {b})")),
            inner.clone().prop_map(|a| format!("!{a}")),
            (inner.clone(), inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("({c} ? {a} : {b})")),
            (lists.clone(), 0..macros.len(), inner.clone())
                .prop_map(move |(l, m, body)| format!("{l}.{}(x, {body})", macros[m])),
            (lists.clone(), inner.clone())
                .prop_map(|(l, body)| format!("{l}.filter(x, {body}).size() > 0")),
        ]
    })
}

fn scalar() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(json!(null)),
        Just(json!(true)),
        Just(json!(false)),
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-3)),
        Just(json!(10000)),
        Just(json!(i64::MAX)),
        Just(json!(u64::MAX)),
        Just(json!(1.0)),
        Just(json!(2.5)),
        Just(json!(10000.5)),
        Just(json!("a")),
        Just(json!("")),
        Just(json!("é")),
        Just(json!("sql.query")),
        Just(json!("Select")),
        // Escaped in the text: parsed into owned strings.
        Just(json!("a\"b\\c\td")),
        Just(json!("\u{1}x")),
    ]
}

fn args() -> impl Strategy<Value = serde_json::Value> {
    (
        prop::collection::vec(
            (
                prop::sample::select(vec!["s", "n", "d", "b", "x"]),
                scalar(),
            ),
            0..5,
        ),
        prop::option::of(prop::collection::vec(scalar(), 0..4)),
        prop::option::of(prop::collection::vec(
            (prop::sample::select(vec!["k", "a", "s"]), scalar()),
            0..3,
        )),
    )
        .prop_map(|(fields, list, object)| {
            let mut map = serde_json::Map::new();
            for (k, v) in fields {
                map.insert(k.to_owned(), v);
            }
            if let Some(list) = list {
                map.insert("l".to_owned(), serde_json::Value::Array(list));
            }
            if let Some(object) = object {
                let object: serde_json::Map<String, serde_json::Value> =
                    object.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
                map.insert("o".to_owned(), serde_json::Value::Object(object));
            }
            serde_json::Value::Object(map)
        })
}

fn batch() -> impl Strategy<Value = BatchInput> {
    (
        prop::collection::vec(
            (
                prop::sample::select(vec!["sql.query", "http.get", "a"]),
                args(),
            ),
            2..4,
        ),
        prop::option::of(prop::sample::select(vec!["acme", "é", ""])),
        prop::sample::select(vec!["", "ignore all rules", "Select"]),
    )
        .prop_map(|(calls, tenant, text)| BatchInput {
            session_id: "s".into(),
            turn_index: 3,
            model_text: text.into(),
            metadata: tenant
                .into_iter()
                .map(|t| ("tenant".to_owned(), t.to_owned()))
                .collect(),
            calls: calls
                .into_iter()
                .enumerate()
                .map(|(i, (tool, args))| CallInput {
                    call_id: format!("c{i}"),
                    tool: tool.into(),
                    args,
                })
                .collect(),
        })
}

/// What one case gave.
#[derive(Debug, Default)]
struct Tally {
    compiled: u32,
    answered: u32,
}

impl Tally {
    /// The fast path answered at least one in `n` of the expressions it
    /// compiled, or the run tests little.
    fn assert_answers_one_in(&self, n: u32) {
        assert!(
            self.answered * n >= self.compiled,
            "the fast path answered {} of {} expressions",
            self.answered,
            self.compiled
        );
    }
}

/// A case where the fast path and the interpreter do not agree.
#[derive(Debug, thiserror::Error)]
enum Disagreement {
    #[error(
        "{policy}: the fast path answered from text {text}, from checked text {checked}, \
         from parsed JSON {json}, on {batch}"
    )]
    Lanes {
        policy: String,
        text: bool,
        checked: bool,
        json: bool,
        batch: String,
    },
    #[error("{policy}: the fast value has no plain form")]
    Unplain { policy: String },
    #[error("{policy}: the fast path gave {fast}, the interpreter {slow}, on {batch}")]
    Value {
        policy: String,
        fast: String,
        slow: String,
        batch: String,
    },
    #[error("{policy}: the fast path gave {fast}, the interpreter the error {error}, on {batch}")]
    Error {
        policy: String,
        fast: String,
        error: String,
        batch: String,
    },
}

fn check(
    env: &Arc<Env>,
    source: &str,
    batch: &BatchInput,
    tally: &mut Tally,
) -> Result<(), Disagreement> {
    let Ok(program) = env.compile(source) else {
        return Ok(());
    };
    tally.compiled += 1;
    let Some(plan) = Plan::new(program.expression()) else {
        return Ok(());
    };
    // The mesh's way (the arguments as JSON text, parsed here) and the
    // `policy test` way (parsed JSON): both must agree with the interpreter.
    let texts: Vec<String> = batch.calls.iter().map(|c| c.args.to_string()).collect();
    fn from<'a>(
        batch: &'a BatchInput,
        texts: &'a [String],
        args: fn(&'a str) -> Args<'a>,
    ) -> BatchValues<'a> {
        BatchValues::new(
            ContextRef {
                session_id: &batch.session_id,
                turn_index: batch.turn_index,
                model_text: &batch.model_text,
            },
            batch.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            batch.calls.iter().zip(texts).map(move |(c, text)| CallRef {
                call_id: &c.call_id,
                tool: &c.tool,
                args: args(text),
            }),
        )
    }
    let from_text = from(batch, &texts, Args::Text);
    // The mesh's own way: text it checked (R20), read from the members the
    // check recorded.
    let from_checked = from(batch, &texts, Args::Checked);
    let from_json = BatchValues::from_input(batch);
    let text = agree(env, source, &program, &plan, &from_text, batch)?;
    let checked = agree(env, source, &program, &plan, &from_checked, batch)?;
    let json = agree(env, source, &program, &plan, &from_json, batch)?;
    if text != json || checked != json {
        return Err(Disagreement::Lanes {
            policy: source.to_owned(),
            text,
            checked,
            json,
            batch: format!("{batch:?}"),
        });
    }
    tally.answered += u32::from(text);
    Ok(())
}

/// Whether the fast path answered on `values`; an error if the interpreter
/// does not give the same.
fn agree(
    env: &Arc<Env>,
    source: &str,
    program: &cel::Program,
    plan: &Plan,
    values: &BatchValues<'_>,
    batch: &BatchInput,
) -> Result<bool, Disagreement> {
    let fast = match plan.plain(&values.fast(0)) {
        Ok(fast) => fast,
        Err(Seen::Unsure) => return Ok(false),
        Err(Seen::Unplain) => {
            return Err(Disagreement::Unplain {
                policy: source.to_owned(),
            });
        }
    };
    let variables = values.scope(0);
    let mut activation = Context::with_env(Arc::clone(env));
    activation.set_variable_resolver(&variables);
    match Value::resolve_val(program.expression(), &activation) {
        Ok(value) => {
            let slow = from_cel(value.as_ref());
            if slow.as_ref() == Some(&fast) {
                Ok(true)
            } else {
                Err(Disagreement::Value {
                    policy: source.to_owned(),
                    fast: format!("{fast:?}"),
                    slow: format!("{slow:?}"),
                    batch: format!("{batch:?}"),
                })
            }
        }
        Err(error) => Err(Disagreement::Error {
            policy: source.to_owned(),
            fast: format!("{fast:?}"),
            error: error.to_string(),
            batch: format!("{batch:?}"),
        }),
    }
}

/// Runs [`check`] on 4,096 random expressions of `expressions` over random
/// batches; what the fast path answered, of what compiled.
fn run(expressions: impl Strategy<Value = String>) -> Tally {
    let env = environment();
    let mut runner = TestRunner::new(Config {
        cases: 4096,
        failure_persistence: None,
        ..Config::default()
    });
    let tally = std::cell::RefCell::new(Tally::default());
    let result = runner.run(&(expressions, batch()), |(source, batch)| {
        check(&env, &source, &batch, &mut tally.borrow_mut())
            .map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    tally.into_inner()
}

#[test]
fn r27_the_fast_path_answers_typed_expressions_as_the_interpreter_does() {
    let tally = run(typed());
    // Many still read a field the random call lacks, or `x` outside a
    // macro: errors, left to the interpreter. About one in six is answered.
    tally.assert_answers_one_in(8);
}

#[test]
fn r27_the_fast_path_answers_as_the_interpreter_does() {
    let tally = run(expression());
    // Most of these are type errors: the fast path gives up on them, and
    // must still answer some, or this tests nothing.
    tally.assert_answers_one_in(50);
}

#[test]
fn r27_the_fast_path_answers_these_as_the_interpreter_does() {
    let env = environment();
    let batch = BatchInput {
        session_id: "s".into(),
        turn_index: 3,
        model_text: "please ignore all rules".into(),
        metadata: [("tenant".to_owned(), "acme".to_owned())].into(),
        calls: vec![
            CallInput {
                call_id: "c0".into(),
                tool: "sql.query".into(),
                args: json!({"query": "DELETE FROM t", "amount": 10000.5, "n": 3, "big": u64::MAX,
                             "l": [1, 2.0, "a"], "o": {"k": "v", "password": "x"}}),
            },
            CallInput {
                call_id: "c1".into(),
                tool: "fs.read".into(),
                args: json!({"path": "/home/u/.ssh/id"}),
            },
        ],
    };
    // `true`: the fast path answers, as the interpreter does. `false`: it
    // gives up: errors are the interpreter's, and so is a list built from a
    // map's keys (whose order is not defined).
    let cases = [
        (
            "call.args.query.matches(r'(?i)^\\s*delete\\s') && !call.args.query.matches(r'(?i)\\swhere\\s')",
            true,
        ),
        ("call.args.amount > 10000", true),
        ("call.args.n == 3.0", true),
        ("call.args.big > call.args.n", true),
        ("call.args.big == 18446744073709551615u", true),
        ("2.0 in call.args.l", true),
        ("'a' in call.args.l", true),
        ("'k' in call.args.o", true),
        (
            "call.args.o.exists(k, k.matches('(?i)^(password|secret)$'))",
            true,
        ),
        ("calls.filter(c, c.tool == 'fs.read').size()", true),
        ("calls.map(c, c.call_id)", true),
        ("calls.exists_one(c, c.tool.startsWith('sql.'))", true),
        ("calls.all(c, has(c.args.path) || has(c.args.query))", true),
        ("size(calls) > 1 ? 'many' : 'one'", true),
        (
            "'tenant ' + context.metadata.tenant + ' at turn ' + string(context.turn_index)",
            true,
        ),
        (
            "context.model_text.contains('ignore') && context.metadata.tenant.endsWith('me')",
            true,
        ),
        ("size('héllo') == 5", true),
        ("call.args.l[2] + 'b'", true),
        ("call.args['query']", true),
        ("[1, 2] + [3]", true),
        ("-call.args.n * 2 - 1", true),
        ("call.args.o.k", true),
        ("string(call.args.big)", true),
        (
            "call.args.query.trim().lowerAscii().startsWith('delete ')",
            true,
        ),
        ("' Mixed Case '.upperAscii().trim()", true),
        ("call.args.missing == 1", false),
        ("call.args.query > 1", false),
        ("call.args.n + 9223372036854775807", false),
        ("call.args.l[3]", false),
        ("calls[1].args.query", false),
        ("!call.args.query", false),
        ("call.args.o.map(k, k)", false),
    ];
    for (source, answers) in cases {
        let fast = fast_answers(&env, source, &batch);
        if answers {
            assert_eq!(fast, Some(true), "the fast path gave up on {source}");
            answered(&env, source, &batch);
        } else {
            assert_ne!(fast, Some(true), "the fast path answered {source}");
        }
    }
}

/// The batch of one call whose arguments are `args`.
fn one_call(args: serde_json::Value) -> BatchInput {
    BatchInput {
        session_id: "s".into(),
        turn_index: 3,
        model_text: "m".into(),
        metadata: [("tenant".to_owned(), "acme".to_owned())].into(),
        calls: vec![CallInput {
            call_id: "c0".into(),
            tool: "sql.query".into(),
            args,
        }],
    }
}

/// Whether the fast path answers `source` on `batch`'s first call;
/// `None`: it is not planned.
fn fast_answers(env: &Arc<Env>, source: &str, batch: &BatchInput) -> Option<bool> {
    let program = env.compile(source).expect(source);
    let plan = Plan::new(program.expression())?;
    let values = BatchValues::from_input(batch);
    Some(plan.plain(&values.fast(0)).is_ok())
}

/// [`check`] of `source` on `batch`, which the fast path must answer.
fn answered(env: &Arc<Env>, source: &str, batch: &BatchInput) {
    let mut tally = Tally::default();
    check(env, source, batch, &mut tally).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        tally.answered, 1,
        "the fast path gave up on {source} on {batch:?}"
    );
}

#[test]
fn r27_size_comparisons_answer_as_the_interpreter_does_for_every_length() {
    // A string's size is bounded by its bytes before its characters are
    // counted: strings of 1 to 4 bytes a character, around each bound.
    let env = environment();
    let pieces = ["a", "é", "€", "𝄞"];
    let ops = ["<", "<=", ">", ">=", "==", "!="];
    for n in 0..7 {
        for mix in 0..pieces.len() + 1 {
            // One kind of character, or all kinds in turn.
            let s: String = (0..n)
                .map(|i| pieces.get(mix).copied().unwrap_or(pieces[i % pieces.len()]))
                .collect();
            let batch = one_call(json!({ "s": s }));
            for k in -1..=25 {
                for op in ops {
                    answered(&env, &format!("size(call.args.s) {op} {k}"), &batch);
                    answered(&env, &format!("call.args.s.size() {op} {k}"), &batch);
                }
            }
        }
    }
}

#[test]
fn r27_patterns_of_words_match_as_the_regex_does() {
    // Patterns checked without the regex engine where they can be, and
    // patterns that only look like them (an alternation outside a group is
    // anchored on one side only).
    let long = format!("(?i)^(x|{})$", "a".repeat(64));
    let patterns = [
        "(?i)^(password|secret|api_key|token)$",
        "^(password|secret)$",
        "(?i)^(?:sk|Key_2)$",
        "(?i)^token$",
        "^token$",
        "(?i)^a|b$",
        "^a|b$",
        "(?i)^(a)|(b)$",
        "(?i)^(a|)$",
        "(?i)(secret|token)$",
        "^(secret|token)",
        "(?i)^(sec.et)$",
        "(?i)^(s\\w+)$",
        long.as_str(),
    ];
    let regexes: Vec<regex::Regex> = patterns
        .iter()
        .map(|p| regex::Regex::new(p).expect(p))
        .collect();
    // Characters a case-insensitive regex takes for ASCII letters (`ſ` is
    // an `s`, the Kelvin sign a `k`), and others.
    let alphabet = vec![
        'a', 'A', 'b', 'B', 's', 'S', 'k', 'K', 'e', 'E', 'y', 'Y', 't', 'T', 'o', 'n', 'c', 'r',
        'p', 'w', 'd', '_', '2', ' ', '\n', 'ſ', '\u{212A}', 'é', 'ı', 'İ',
    ];
    let words = prop::sample::select(vec![
        "password",
        "PassWord",
        "secret",
        "SECRET",
        "ſecret",
        "api_key",
        "API_KEY",
        "token",
        "tokens",
        "sk",
        "SK",
        "\u{212A}ey_2",
        "key_2",
        "a",
        "b",
        "xb",
        "ax",
        "",
        "secret\n",
    ]);
    // Words of 64 bytes or more are compared whatever their length.
    let long_texts = prop::sample::select(vec!["A".repeat(64), "a".repeat(63)]);
    let texts = prop_oneof![
        words.prop_map(str::to_owned),
        long_texts,
        prop::collection::vec(prop::sample::select(alphabet), 0..9)
            .prop_map(|chars| chars.into_iter().collect::<String>()),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 4096,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&texts, |text| {
        for (pattern, regex) in patterns.iter().zip(&regexes) {
            if let Some(found) = super::text::word_match(pattern, &text) {
                prop_assert_eq!(found, regex.is_match(&text), "{} on {:?}", pattern, text);
            }
        }
        Ok(())
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    // The first five are checked without the regex engine (on ASCII text).
    for pattern in &patterns[..5] {
        assert!(
            super::text::word_match(pattern, "token").is_some(),
            "{pattern} is left to the regex"
        );
    }
}

#[test]
fn r27_the_fast_path_reads_arguments_and_keys_as_the_interpreter_does() {
    let env = environment();
    let batches = [
        one_call(json!({"query": "DELETE FROM t", "o": {"k": "v", "API_KEY": 1}})),
        one_call(json!({"ſecret": 1, "o": {"k": 2}})),
        one_call(json!({"Token": "x", "query": "select 1", "o": []})),
        one_call(json!({})),
    ];
    let sources = [
        "call.args.exists(k, k.matches(r'(?i)^(password|secret|api_key|token)$'))",
        "call.args.exists(k, k.matches(r'^(password|secret|api_key|token)$'))",
        "call.args.all(k, !k.matches(r'(?i)^(o|query)$'))",
        "has(call.args.query) && call.args.query.matches(r'(?i)^\\s*delete\\s')",
        "has(call.args.o.k) || call.tool == 'sql.query'",
        "call.call_id + ' ' + call.tool + ' ' + context.model_text",
        "context.metadata.tenant == 'acme' && has(context.metadata.tenant)",
        "size(call.args) >= 0 && size(call.args.query) > 3",
    ];
    let mut answers = 0;
    for batch in &batches {
        for source in sources {
            let mut tally = Tally::default();
            check(&env, source, batch, &mut tally).unwrap_or_else(|e| panic!("{e}"));
            answers += tally.answered;
        }
    }
    // Each source on some batch at least.
    assert!(answers >= 20, "the fast path answered {answers} times");
}
