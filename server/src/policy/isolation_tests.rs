//! Each call in its lane (R13, R14, R25, R27): a call's decision depends on
//! that call alone, a rule error never skips the later rules, the work of
//! one call is metered and bounded, and error texts quote no value.

use proptest::prelude::*;
use serde_json::json;

use super::tests::{batch, call};
use super::*;

fn rule(name: &str, tools: Option<&str>, when: &str, message: &str) -> String {
    let tools = tools.map_or_else(String::new, |t| format!("tools = [{t:?}]\n"));
    format!(
        "[[rule]]\nname = {name:?}\n{tools}when = {when:?}\naction = \"cancel\"\nmessage = {message:?}\n\n"
    )
}

/// Finding 1: a call no rule judges, carrying a huge array, pushed every
/// rule's estimate over its bound. Now the estimate is the call's own.
#[test]
fn r13_an_unrelated_large_call_changes_no_other_calls_outcome() {
    let policy = Policy::compile(&rule(
        "no-rm",
        Some("shell.*"),
        r#"["rm", "dd"].exists(p, call.args.cmd.startsWith(p))"#,
        "'no'",
    ))
    .unwrap();
    let rm = call("rm", "shell.exec", json!({"cmd": "rm -rf /"}));
    let alone = policy.evaluate(&batch(vec![rm.clone()]));
    assert!(
        matches!(&alone[0], Outcome::Matched(v) if v.rule == "no-rm"),
        "{alone:?}"
    );
    let big = call("big", "blob.put", json!({ "data": vec![0; 500_000] }));
    let with = policy.evaluate(&batch(vec![rm, big]));
    assert_eq!(with[0], alone[0]);
    assert_eq!(with[1], Outcome::Proceed);
}

/// Finding 1: an error in an earlier rule skipped every later rule.
#[test]
fn r27_a_rule_error_never_skips_the_later_rules_and_quotes_no_value() {
    let source = rule(
        "limit",
        None,
        "has(call.args.amount) && call.args.amount + 1 > 10000",
        "'too much'",
    ) + &rule(
        "no-rm",
        None,
        "has(call.args.cmd) && call.args.cmd.startsWith('rm')",
        "'no rm'",
    );
    let policy = Policy::compile(&source).unwrap();
    let outcomes = policy.evaluate(&batch(vec![
        call("a", "t", json!({"cmd": "rm -rf /", "amount": "lots"})),
        call("b", "t", json!({"amount": i64::MAX})),
    ]));
    match &outcomes[0] {
        Outcome::FailedThen(error, verdict) => {
            assert_eq!(error.rule(), "limit");
            assert_eq!(verdict.rule, "no-rm");
        }
        other => panic!("{other:?}"),
    }
    let Outcome::Error(error) = &outcomes[1] else {
        panic!("{outcomes:?}");
    };
    let text = error.to_string();
    assert!(
        text.contains("limit") && text.contains("overflow"),
        "{text}"
    );
    assert!(!text.contains("9223372036854775807"), "{text}");
    let Outcome::FailedThen(error, _) = &outcomes[0] else {
        unreachable!()
    };
    assert!(!error.to_string().contains("lots"), "{error}");
}

/// Finding 2: quadratic work on a megabyte string was within the item
/// estimate; the meter counts the bytes and stops it.
#[test]
fn r25_the_work_of_one_call_is_metered_in_steps_and_bytes() {
    let l: Vec<i32> = (0..60).collect();
    let s = "A".repeat(900_000);
    for when in [
        "call.args.l.exists(a, call.args.l.exists(b, call.args.s.lowerAscii().size() < 0))",
        "call.args.l.map(a, call.args.l.map(b, call.args.s.lowerAscii())).size() < 0",
        "call.args.l.exists(a, call.args.l.exists(b, (call.args.s + call.args.s).size() < 0))",
        "call.args.l.map(a, call.args.l.map(b, call.args.s + 'x')).size() < 0",
    ] {
        let policy = Policy::compile(&rule("heavy", None, when, "'m'")).unwrap();
        let started = std::time::Instant::now();
        let outcomes = policy.evaluate(&batch(vec![
            call("1", "t", json!({"l": l, "s": s})),
            call("2", "t", json!({"l": [1], "s": "x"})),
        ]));
        let verdict = match &outcomes[0] {
            Outcome::Bounded(verdict) => verdict,
            other => panic!("{when}: {other:?}"),
        };
        assert_eq!(verdict.action, Action::Steer);
        assert!(verdict.message.contains("max_work_per_call"), "{verdict:?}");
        assert_eq!(outcomes[1], Outcome::Proceed, "{when}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{when}"
        );
    }
}

/// R14: calls not judged when the time is up are timed out.
#[test]
fn r14_a_call_not_judged_in_time_is_timed_out() {
    let policy =
        Policy::compile(&rule("r", None, "call.args.s.lowerAscii() == 'x'", "'m'")).unwrap();
    let input = batch(vec![call("1", "t", json!({"s": "X"})); 3]);
    let values = BatchValues::from_input(&input);
    let past = std::time::Instant::now();
    let outcomes = policy.evaluate_within(&values, None, Some(past));
    assert!(
        outcomes.iter().all(|o| *o == Outcome::TimedOut),
        "{outcomes:?}"
    );
}

/// R9: a rule's tool globs match without regard to ASCII case.
#[test]
fn r9_rule_tools_match_without_regard_to_ascii_case() {
    let policy = Policy::compile(&rule("r", Some("Shell.*"), "true", "'m'")).unwrap();
    for tool in ["shell.exec", "SHELL.EXEC", "Shell.Exec"] {
        let outcomes = policy.evaluate(&batch(vec![call("1", tool, json!({}))]));
        assert!(
            matches!(outcomes[0], Outcome::Matched(_)),
            "{tool}: {outcomes:?}"
        );
    }
}

/// Finding 3: the patterns of a policy are bounded and freed with it.
#[test]
fn r25_policy_size_and_patterns_are_bounded() {
    let big = "#".repeat(Limits::default().max_policy_bytes + 1);
    let error = Policy::compile(&big).unwrap_err();
    assert!(
        matches!(error.kind, CompileErrorKind::TooLarge { .. }),
        "{error}"
    );
    let source: String = (0..5)
        .map(|r| {
            let when: Vec<String> = (0..60)
                .map(|i| format!("call.args.s.matches('^x{r}y{i}$')"))
                .collect();
            rule(&format!("many{r}"), None, &when.join(" || "), "'m'")
        })
        .collect();
    let error = Policy::compile(&source).unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("distinct patterns") || text.contains("the policy's patterns would take"),
        "{error}"
    );
    let policy = Policy::compile(&rule("one", None, "call.args.s.matches('^a+$')", "'m'")).unwrap();
    assert!(policy.pattern_bytes() > 0);
    // The process-wide charge holds this policy's patterns while it lives
    // (other tests compile and drop policies concurrently, so no
    // difference of two readings is asserted).
    assert!(pattern_bytes() >= policy.pattern_bytes());
}

/// One `when` of the property test, reading the call alone.
fn whens() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "call.args.s.startsWith('rm')",
        "call.args.s.lowerAscii().contains('drop')",
        "call.args.l.exists(x, x > 3)",
        "call.args.l.exists(a, call.args.l.exists(b, a + b == 7))",
        "call.args.l.map(a, call.args.s.upperAscii()).size() > 2",
        "call.args.n + 1 > 10",
        "call.args.s.matches('^[a-z]+$')",
        "size(call.args.l) > 2 && call.args.s == 'x'",
        "call.args.missing == 1",
        "call.tool.endsWith('.b')",
    ])
    .prop_map(str::to_owned)
}

fn args() -> impl Strategy<Value = serde_json::Value> {
    (
        prop::collection::vec(0i64..10, 0..40),
        "[a-zA-Z ]{0,12}",
        prop::sample::select(vec![json!(1), json!(i64::MAX), json!("s"), json!(null)]),
        0usize..3,
    )
        .prop_map(|(l, s, n, big)| {
            // Sometimes a large string or list: the bounds must hold per call.
            let s = if big == 2 { s.repeat(40_000) } else { s };
            json!({"l": l, "s": s, "n": n})
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// For random policies within the bounds and random batches, adding a
    /// call never changes another call's outcome (so, per call, its
    /// decision under fail_open and fail_closed); a call no rule applies to
    /// (the only kind an `abort` guard could not fail on) is proceeded.
    #[test]
    fn r13_adding_a_call_never_changes_another_calls_outcome(
        rules in prop::collection::vec(
            (whens(), prop::sample::select(vec![None, Some("t.*"), Some("*.b")])),
            1..5,
        ),
        calls in prop::collection::vec(
            (prop::sample::select(vec!["t.a", "t.b", "u.b"]), args()),
            1..5,
        ),
        extra in (prop::sample::select(vec!["t.a", "x.y"]), args()),
        at in 0usize..6,
        work in prop::sample::select(vec![64u64 << 20, 200_000]),
    ) {
        let source: String = rules
            .iter()
            .enumerate()
            .map(|(i, (when, tools))| rule(&format!("r{i}"), *tools, when, "'m'"))
            .collect();
        let limits = Limits { max_work_per_call: work, max_cost_per_call: 20_000, ..Limits::default() };
        let policy = Policy::compile_with(&source, limits).unwrap();
        let calls: Vec<CallInput> = calls
            .into_iter()
            .enumerate()
            .map(|(i, (tool, args))| call(&i.to_string(), tool, args))
            .collect();
        let before = policy.evaluate(&batch(calls.clone()));
        // Judged inline, when it fits, a batch gets what the pool gives it.
        let input = batch(calls.clone());
        let values = BatchValues::from_input(&input);
        let mut inline = pool::INLINE;
        if let Ok(inline) = policy.evaluate_inline(&values, None, None, &mut inline) {
            prop_assert_eq!(&inline, &before);
        }
        let at = at.min(calls.len());
        let mut more = calls.clone();
        more.insert(at, call("extra", extra.0, extra.1));
        let mut after = policy.evaluate(&batch(more));
        let added = after.remove(at);
        prop_assert_eq!(&before, &after);
        if extra.0 == "x.y" && rules.iter().all(|(_, tools)| tools.is_some()) {
            prop_assert_eq!(added, Outcome::Proceed);
        }
    }
}

/// The bench's policy of 20 rules (R27), read from the bench's own file.
const BENCH_POLICY: &str = include_str!("../../../bench/src/bench/policy20.toml");

/// A batch like the bench's standard one: 4 calls of about 500 bytes.
fn standard_batch() -> BatchInput {
    let tools = ["sql.query", "http.get", "fs.read", "shell.exec"];
    let calls = (0..4)
        .map(|i| {
            call(
                &format!("call-{i}"),
                tools[i],
                json!({
                    "request": i,
                    "tool": tools[i],
                    "query": "SELECT id, name, email, created_at FROM customers WHERE region = 'emea' ORDER BY created_at DESC",
                    "options": { "timeout_s": 30, "retries": 2, "dry_run": false },
                    "note": "The agent asked for this call while working through the user's request; ".repeat(4),
                }),
            )
        })
        .collect();
    BatchInput {
        calls,
        model_text: "Looking up the customer records and the related files before answering."
            .into(),
        metadata: [
            ("tenant", "acme"),
            ("user", "u-1042"),
            ("agent", "support-bot"),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect(),
        ..BatchInput::default()
    }
}

/// R25: the usual batch (a few small calls, compiled plans) is judged
/// inline, with no hand-off to the pool, and gets what the pool would
/// give it; what it spent is well within the inline bound.
#[test]
fn r25_the_usual_batch_is_judged_inline_as_on_the_pool() {
    let policy = Policy::compile(BENCH_POLICY).unwrap();
    let input = standard_batch();
    // As the mesh builds them: from the members its check recorded.
    let texts: Vec<String> = input.calls.iter().map(|c| c.args.to_string()).collect();
    let recorded = Recorded::of_arguments(texts.iter().map(String::as_str)).unwrap();
    let values = BatchValues::new(
        ContextRef {
            session_id: "bench",
            turn_index: 7,
            model_text: &input.model_text,
        },
        input.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        input.calls.iter().enumerate().map(|(i, call)| CallRef {
            call_id: &call.call_id,
            tool: &call.tool,
            args: Args::Recorded {
                text: &texts[i],
                members: recorded.call(i).unwrap(),
            },
        }),
    );
    let bytes: usize = texts.iter().map(String::len).sum();
    assert!(bytes < pool::INLINE_BYTES, "{bytes}");
    let mut inline = pool::INLINE;
    let outcomes = policy
        .evaluate_inline(&values, None, None, &mut inline)
        .expect("the standard batch fits the inline bound");
    assert_eq!(outcomes, policy.evaluate_values(&values, None));
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Proceed),
        "{outcomes:?}"
    );
    let spent = pool::INLINE.work - inline.work;
    eprintln!("the standard batch spent {spent} units of work inline");
    assert!(spent > 0 && spent * 4 < pool::INLINE.work, "{spent}");
}

/// R25: a batch whose work is over the inline bound stops at it (by the
/// meter, not by a guess), and is judged whole off the thread; a call
/// whose estimate is over it does not start inline at all.
#[test]
fn r25_a_costly_batch_stops_at_the_inline_bound() {
    let l: Vec<i32> = (0..60).collect();
    let s = "A".repeat(10_000);
    let policy = Policy::compile(&rule(
        "heavy",
        None,
        "call.args.l.exists(a, call.args.l.exists(b, call.args.s.lowerAscii().size() < 0))",
        "'m'",
    ))
    .unwrap();
    let input = batch(vec![
        call("small", "t", json!({"l": [1], "s": "x"})),
        call("big", "t", json!({"l": l, "s": s})),
    ]);
    let values = BatchValues::from_input(&input);
    let started = std::time::Instant::now();
    let mut inline = pool::INLINE;
    let stopped = policy.evaluate_inline(&values, None, None, &mut inline);
    let inline_took = started.elapsed();
    assert_eq!(stopped, Err(OverInline));
    let started = std::time::Instant::now();
    let whole = policy.evaluate_values(&values, None);
    let whole_took = started.elapsed();
    assert_eq!(whole, vec![Outcome::Proceed, Outcome::Proceed]);
    eprintln!("inline {inline_took:?} before stopping, whole {whole_took:?}");
    assert!(
        inline_took * 20 < whole_took,
        "stopped at the bound: {inline_took:?} against {whole_took:?}"
    );
    // An estimate over the inline bound (within the call's own): nothing
    // runs inline.
    let wide: Vec<i32> = (0..200).collect();
    let input = batch(vec![call("wide", "t", json!({"l": wide, "s": "x"}))]);
    let values = BatchValues::from_input(&input);
    let mut inline = pool::INLINE;
    assert_eq!(
        policy.evaluate_inline(&values, None, None, &mut inline),
        Err(OverInline)
    );
    assert_eq!(inline, pool::INLINE, "no work was done");
}
