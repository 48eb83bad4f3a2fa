//! Policy guards (R27) and unguarded calls (R28): `guardmesh policy check`
//! and `guardmesh policy test` as users run them, on the example policy of
//! `examples/policy/` and on broken ones.

use crate::harness::*;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

fn guardmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(args)
        .output()
        .expect("run guardmesh")
}

fn example(name: &str) -> String {
    repo_root()
        .join("examples/policy")
        .join(name)
        .display()
        .to_string()
}

/// A file of `text` in a folder of this test process.
fn file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("guardmesh-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write file");
    path
}

/// `guardmesh policy test POLICY CASES`: its output.
fn policy_test(
    policy: impl AsRef<std::path::Path>,
    cases: impl AsRef<std::path::Path>,
) -> std::process::Output {
    let (policy, cases) = (policy.as_ref().display(), cases.as_ref().display());
    guardmesh(&["policy", "test", &policy.to_string(), &cases.to_string()])
}

#[test]
fn r27_policy_check_accepts_the_example_and_lists_its_rules() {
    let out = guardmesh(&["policy", "check", &example("policy.toml")]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("ok: 5 rules"), "{stdout}");
    for rule in [
        "sql-one-statement-no-comments",
        "sql-delete-needs-where",
        "payment-over-10000-needs-a-human",
        "no-rm-rf-in-production",
        "at-most-3-emails-per-round",
    ] {
        assert!(stdout.contains(rule), "{rule} listed: {stdout}");
    }
}

/// `guardmesh policy check FILE | head -1`: a reader that stops early is
/// not an error (it was a panic on the broken pipe).
#[test]
fn r27_policy_check_into_a_closed_pipe_exits_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["policy", "check", &example("policy.toml")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run guardmesh");
    // Closed before the report is written: the write fails with EPIPE.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for guardmesh");
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn r27_policy_test_passes_the_example_cases() {
    let out = policy_test(example("policy.toml"), example("cases.toml"));
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains("PASS"), "{out:?}");
}

/// Issue 53: the example's cases for the shell rule can fail. The same
/// rule written as the obvious text match on `rm -rf` lets the other
/// spellings through (`rm -fr /`, `rm -r -f /`, `sudo rm -Rf /`, quoted
/// words...) and cancels `echo rm -rf /`, which runs no rm; `policy test`
/// names each of those calls.
#[test]
fn r27_policy_test_the_shell_cases_fail_a_text_match_on_rm_rf() {
    let example_policy = std::fs::read_to_string(example("policy.toml")).unwrap();
    let helper = r#"shell.has_flags(call.args.cmd, "rm", ["r", "f"])"#;
    assert!(
        example_policy.contains(helper),
        "the example uses the helper"
    );
    let text_match = file(
        "text-match.toml",
        &example_policy.replace(helper, "call.args.cmd.matches(r'rm -rf')"),
    );
    let out = policy_test(&text_match, example("cases.toml"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    for spelt in [
        "rm -fr /",
        "rm -r -f /",
        "rm -R -f /",
        "rm --recursive --force /",
        "sudo rm -Rf /",
        "'rm' '-rf' /",
        "command rm -r -f /",
    ] {
        let line = shell_case_line(spelt);
        assert!(
            stderr.contains(&format!("FAIL line {line}:")),
            "{spelt:?} (line {line}) gets past a text match: {stderr}"
        );
    }
    let line = shell_case_line("echo rm -rf /");
    assert!(
        stderr.contains(&format!("FAIL line {line}:")),
        "a text match cancels echo: {stderr}"
    );
}

/// The line `policy test` names for the example's call whose `cmd` is
/// `cmd`: that of its first key, `tool`.
fn shell_case_line(cmd: &str) -> usize {
    let cases = std::fs::read_to_string(example("cases.toml")).unwrap();
    let quoted = format!("{cmd:?}");
    let lines: Vec<&str> = cases.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains(&format!("cmd = {quoted} }}")))
        .unwrap_or_else(|| panic!("no case runs {quoted}"));
    let tool = lines[..at]
        .iter()
        .rposition(|l| l.starts_with("tool = "))
        .expect("a call names its tool first");
    tool + 1
}

#[test]
fn r27_policy_check_refuses_a_broken_file_naming_the_line() {
    let broken = file(
        "broken.toml",
        "[[rule]]\nname = \"ok\"\nwhen = \"true\"\naction = \"cancel\"\nmessage = '\"no\"'\n\n\
         [[rule]]\nname = \"bad\"\nwhen = \"call.args.x >\"\naction = \"cancel\"\nmessage = '\"no\"'\n",
    );
    let out = guardmesh(&["policy", "check", &broken.display().to_string()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("line 9"), "names the line: {stderr}");
    assert!(stderr.contains("\"bad\""), "names the rule: {stderr}");
    assert!(stderr.contains("does not compile"), "says why: {stderr}");
    // `test` refuses the same file before any case runs.
    let out = policy_test(&broken, example("cases.toml"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("line 9"), "{out:?}");
}

#[test]
fn r27_policy_test_fails_on_a_wrong_case_naming_it() {
    let cases = file(
        "wrong-cases.toml",
        "[[case]]\nname = \"a SELECT proceeds\"\n[[case.calls]]\ntool = \"sql.query\"\n\
         args = { query = \"SELECT 1\" }\nexpect = \"proceed\"\n\n\
         [[case]]\nname = \"a DELETE proceeds (wrong)\"\n[[case.calls]]\ntool = \"sql.query\"\n\
         args = { query = \"DELETE FROM users\" }\nexpect = \"proceed\"\n",
    );
    let out = policy_test(example("policy.toml"), &cases);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("a DELETE proceeds (wrong)"),
        "names the case: {stderr}"
    );
    assert!(
        stderr.contains("sql-delete-needs-where"),
        "names what the policy gave: {stderr}"
    );
    assert!(
        !stderr.contains("a SELECT proceeds\""),
        "only failing cases: {stderr}"
    );
}

// ---------------------------------------------------------------------------
// Policy guards in a real mesh (R27) and unguarded calls (R28).
// ---------------------------------------------------------------------------

use guardmesh_client::proto::{FailurePolicy, TraceStatus};
use guardmesh_client::verdict::cancel;
use guardmesh_client::{Batch, BatchDecision, Outcome, Registration};

/// The policy the mesh tests register: SQL, payments (an error when the
/// amount is missing), a batch-wide rule, and a rule shadowed by the first.
const POLICY: &str = concat!(
    policy_rule!(name: "sql-delete-needs-where", tools: ["sql.*"], action: "cancel",
        when: r#"'''
  has(call.args.query) &&
  call.args.query.matches(r'(?i)^\s*delete\s') &&
  !call.args.query.matches(r'(?i)\swhere\s')
'''"#,
        message: r#"'"DELETE without WHERE refused: " + call.args.query'"#),
    policy_rule!(name: "sql-no-drop", tools: ["sql.*"], action: "steer",
        when: r#""call.args.query.contains('DROP')""#,
        message: r#"'"no DROP: " + call.args.query'"#),
    policy_rule!(name: "payment-over-10000", tools: ["payments.send"], action: "steer",
        when: r#""call.args.amount > 10000""#,
        message: r#"'"payment of " + string(call.args.amount) + " needs a human"'"#),
    policy_rule!(name: "at-most-3-emails-per-round", tools: ["email.send"], action: "steer",
        when: r#""calls.filter(c, c.tool == 'email.send').size() > 3""#,
        message: r#"'"send at most 3 emails per round"'"#),
);

fn skip_content(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Steer { content } | Outcome::Cancel { content } | Outcome::Ask { content, .. } => {
            content
        }
        Outcome::Proceed => "",
    }
}

fn trace_of<'a>(d: &'a BatchDecision, guard: &str) -> &'a guardmesh_client::proto::GuardTrace {
    d.trace
        .iter()
        .find(|t| t.guard == guard)
        .unwrap_or_else(|| panic!("no trace entry for {guard}: {:?}", d.trace))
}

async fn policy_mesh(registration: Registration) -> TestMesh {
    let mesh = TestMesh::start().await;
    mesh.register(registration).await;
    mesh
}

/// A mesh with [`POLICY`] registered under `failure_policy`.
async fn failing_policy_mesh(failure_policy: FailurePolicy) -> TestMesh {
    policy_mesh(Registration::policy("policy", POLICY).failure_policy(failure_policy)).await
}

#[tokio::test]
async fn r27_policy_guard_steers_and_cancels_with_the_rules_message_and_trace_names_the_rule() {
    let mesh = policy_mesh(Registration::policy("policy", POLICY)).await;
    let coordinator = mesh.coordinator().await;
    let d = coordinator
        .evaluate_once(
            "s",
            Batch::new(0)
                .call("del", "sql.query", r#"{"query": "DELETE FROM users"}"#)
                .call("sel", "sql.query", r#"{"query": "SELECT 1"}"#)
                .call("pay", "payments.send", r#"{"amount": 12500}"#),
        )
        .await
        .unwrap();
    let del = d.call("del").unwrap();
    assert!(matches!(del.outcome, Outcome::Cancel { .. }), "{del:?}");
    assert_eq!(
        skip_content(&del.outcome),
        "DELETE without WHERE refused: DELETE FROM users"
    );
    assert_eq!(del.decided_by.as_deref(), Some("policy"));
    assert!(!del.failure);
    assert!(d.call("sel").unwrap().proceeds());
    let pay = d.call("pay").unwrap();
    assert!(matches!(pay.outcome, Outcome::Steer { .. }), "{pay:?}");
    assert_eq!(skip_content(&pay.outcome), "payment of 12500 needs a human");
    let entry = trace_of(&d, "policy");
    assert_eq!(entry.status, TraceStatus::Skipped as i32);
    assert_eq!(
        entry.rules.get("del").map(String::as_str),
        Some("sql-delete-needs-where")
    );
    assert_eq!(
        entry.rules.get("pay").map(String::as_str),
        Some("payment-over-10000")
    );
    assert!(!entry.rules.contains_key("sel"), "{:?}", entry.rules);
    assert_eq!(entry.skipped_call_ids, vec!["del", "pay"]);
    // Metrics like any guard's.
    assert!(
        metric(
            &mesh,
            "guardmesh_guard_outcomes_total{guard=\"policy\",status=\"skipped\"}"
        ) >= 1.0
    );
}

/// R27: a policy guard whose rules read only the batch's context (no call's
/// arguments, so the mesh neither records nor reads them for it) judges as
/// any other; once a guard that reads arguments joins the chain after it,
/// both judge, in chain order (R3).
#[tokio::test]
async fn r27_policy_of_context_rules_judges_without_reading_arguments() {
    const CONTEXT: &str = concat!(
        policy_rule!(name: "blocked-users", action: "cancel",
            when: r#""has(context.metadata.user) && context.metadata.user in ['u-0666']""#,
            message: r#"'"user " + context.metadata.user + " is blocked"'"#),
        policy_rule!(name: "no-shell-in-production", tools: ["shell.*"], action: "cancel",
            when: r#""context.metadata.env == 'production'""#,
            message: r#"'"no shell in " + context.metadata.env'"#),
    );
    let mesh = policy_mesh(Registration::policy("context", CONTEXT)).await;
    let coordinator = mesh.coordinator().await;
    let batch = |user: &str| {
        Batch::new(0)
            .meta("user", user)
            .meta("env", "production")
            .call("sh", "shell.exec", r#"{"cmd": "ls", "list": [1, 2, 3]}"#)
            .call("del", "sql.query", r#"{"query": "DELETE FROM users"}"#)
    };
    let cancel = |content: &str| Outcome::Cancel {
        content: content.into(),
    };
    let d = coordinator
        .evaluate_once("s", batch("u-0666"))
        .await
        .unwrap();
    for id in ["sh", "del"] {
        assert_eq!(
            d.call(id).unwrap().outcome,
            cancel("user u-0666 is blocked"),
            "{id}"
        );
    }
    let d = coordinator.evaluate_once("s", batch("u-1")).await.unwrap();
    assert_eq!(
        d.call("sh").unwrap().outcome,
        cancel("no shell in production")
    );
    assert!(d.call("del").unwrap().proceeds(), "no rule reads the query");
    assert_eq!(
        trace_of(&d, "context").rules.get("sh").map(String::as_str),
        Some("no-shell-in-production")
    );
    // A guard whose rules read arguments, after it in the chain.
    mesh.register(Registration::policy("policy", POLICY)).await;
    let d = coordinator.evaluate_once("s", batch("u-1")).await.unwrap();
    let sh = d.call("sh").unwrap();
    assert_eq!(sh.outcome, cancel("no shell in production"));
    assert_eq!(sh.decided_by.as_deref(), Some("context"));
    let del = d.call("del").unwrap();
    assert_eq!(
        del.outcome,
        cancel("DELETE without WHERE refused: DELETE FROM users")
    );
    assert_eq!(del.decided_by.as_deref(), Some("policy"));
}

#[tokio::test]
async fn r27_first_matching_rule_wins_in_file_order() {
    let mesh = policy_mesh(Registration::policy("policy", POLICY)).await;
    let d = mesh
        .decides(
            // Both sql rules match; the first in the file decides.
            Batch::new(0).call("q", "sql.query", r#"{"query": "DELETE FROM t; DROP x"}"#),
        )
        .await;
    let q = d.call("q").unwrap();
    assert!(matches!(q.outcome, Outcome::Cancel { .. }), "{q:?}");
    assert_eq!(
        trace_of(&d, "policy").rules.get("q").map(String::as_str),
        Some("sql-delete-needs-where")
    );
}

#[tokio::test]
async fn r27_policy_guard_tools_globs_limit_what_it_is_sent() {
    let mesh = policy_mesh(Registration::policy("policy", POLICY).tools(["payments.*"])).await;
    let d = mesh
        .decides(
            Batch::new(0)
                .call("del", "sql.query", r#"{"query": "DELETE FROM users"}"#)
                .call("pay", "payments.send", r#"{"amount": 20000}"#),
        )
        .await;
    assert!(
        d.call("del").unwrap().proceeds(),
        "sql is outside the guard's tools"
    );
    assert!(matches!(
        d.call("pay").unwrap().outcome,
        Outcome::Steer { .. }
    ));
    assert_eq!(trace_of(&d, "policy").sent_call_ids, vec!["pay"]);
}

#[tokio::test]
async fn r27_calls_rule_at_most_3_emails_per_round() {
    let mesh = policy_mesh(Registration::policy("policy", POLICY)).await;
    let coordinator = mesh.coordinator().await;
    let emails = |n: usize| {
        (0..n).fold(Batch::new(0), |b, i| {
            b.call(format!("e{i}"), "email.send", r#"{"to": "a@b.c"}"#)
        })
    };
    let d = coordinator.evaluate_once("s", emails(3)).await.unwrap();
    assert!(d.calls.iter().all(|c| c.proceeds()), "3 emails pass: {d:?}");
    let d = coordinator
        .evaluate_once(
            "s",
            emails(4).call("other", "sql.query", r#"{"query": "SELECT 1"}"#),
        )
        .await
        .unwrap();
    for i in 0..4 {
        let c = d.call(&format!("e{i}")).unwrap();
        assert_eq!(c.outcome, steered("send at most 3 emails per round"));
    }
    assert!(d.call("other").unwrap().proceeds());
}

#[tokio::test]
async fn r27_evaluation_error_fails_the_guard_per_its_policy_never_a_proceed() {
    // `payment-over-10000` reads `call.args.amount`: absent, it errors.
    let bad = r#"{"to": "x"}"#;
    // fail_closed (the default): cancelled as a failure; the trace names
    // the rule and the error.
    let mesh = policy_mesh(Registration::policy("policy", POLICY)).await;
    let d = mesh
        .decides(Batch::new(0).call("bad", "payments.send", bad).call(
            "ok",
            "sql.query",
            r#"{"query": "SELECT 1"}"#,
        ))
        .await;
    let call = d.call("bad").unwrap();
    assert!(matches!(call.outcome, Outcome::Cancel { .. }), "{call:?}");
    assert!(call.failure);
    assert!(
        d.call("ok").unwrap().proceeds(),
        "the calls the policy judged keep their verdicts"
    );
    let entry = trace_of(&d, "policy");
    assert_eq!(entry.status, TraceStatus::Failed as i32);
    assert!(
        entry.error.contains("payment-over-10000"),
        "{}",
        entry.error
    );
    assert!(
        entry.error.contains("policy evaluation failed"),
        "{}",
        entry.error
    );
    assert_eq!(
        entry.rules.get("bad").map(String::as_str),
        Some("payment-over-10000")
    );
    assert!(
        metric(
            &mesh,
            "guardmesh_guard_outcomes_total{guard=\"policy\",status=\"failed\"}"
        ) >= 1.0
    );

    // fail_open: bypassed, and recorded as such.
    let mesh = failing_policy_mesh(FailurePolicy::FailOpen).await;
    let d = mesh
        .decides(Batch::new(0).call("bad", "payments.send", bad))
        .await;
    let call = d.call("bad").unwrap();
    assert!(call.proceeds());
    assert_eq!(call.bypassed, vec!["policy"]);
    assert_eq!(trace_of(&d, "policy").status, TraceStatus::Failed as i32);

    // abort: the batch fails, naming the guard.
    let mesh = failing_policy_mesh(FailurePolicy::Abort).await;
    let error = mesh
        .refuses(Batch::new(0).call("bad", "payments.send", bad))
        .await;
    assert!(error.to_string().contains("\"policy\""), "{error}");
}

#[tokio::test]
async fn r27_r18_dry_run_policy_guard_decides_nothing() {
    let mesh = policy_mesh(Registration::policy("policy", POLICY).dry_run()).await;
    let d = mesh
        .decides(
            Batch::new(0)
                .call("del", "sql.query", r#"{"query": "DELETE FROM users"}"#)
                .call("bad", "payments.send", "{}"),
        )
        .await;
    assert!(d.calls.iter().all(|c| c.proceeds()), "{d:?}");
    assert!(d.calls.iter().all(|c| c.bypassed.is_empty()));
    let entry = trace_of(&d, "policy");
    assert_eq!(entry.status, TraceStatus::DryRun as i32);
    assert_eq!(entry.dry_run_status, TraceStatus::Failed as i32);
    assert_eq!(
        entry.rules.get("del").map(String::as_str),
        Some("sql-delete-needs-where"),
        "what it would have done"
    );
}

#[tokio::test]
async fn r27_r3_policy_and_remote_guards_keep_registration_order_vetoes() {
    // A remote guard that cancels every call, before or after the policy.
    for remote_first in [true, false] {
        let mesh = TestMesh::start().await;
        let remote = call_guard(Duration::from_millis(50), |c| {
            Some(cancel(&c.call_id, "remote says no"))
        })
        .await;
        let policy = Registration::policy("policy", POLICY);
        let remote_reg = Registration::validate("remote", &remote.url);
        if remote_first {
            mesh.register(remote_reg).await;
            mesh.register(policy).await;
        } else {
            mesh.register(policy).await;
            mesh.register(remote_reg).await;
        }
        let d = mesh
            .decides(
                Batch::new(0)
                    .call("del", "sql.query", r#"{"query": "DELETE FROM users"}"#)
                    .call("sel", "sql.query", r#"{"query": "SELECT 1"}"#),
            )
            .await;
        let del = d.call("del").unwrap();
        let sel = d.call("sel").unwrap();
        // `sel` only the remote guard skips.
        assert_eq!(sel.decided_by.as_deref(), Some("remote"));
        if remote_first {
            // The earlier guard's skip wins, although the policy answered
            // first (R3, R4).
            assert_eq!(del.decided_by.as_deref(), Some("remote"), "{del:?}");
            assert_eq!(skip_content(&del.outcome), "remote says no");
        } else {
            assert_eq!(del.decided_by.as_deref(), Some("policy"), "{del:?}");
            assert!(skip_content(&del.outcome).starts_with("DELETE without WHERE"));
        }
    }
}

/// Registers `registration`, which must be refused `INVALID_ARGUMENT` with
/// nothing registered; returns the refusal's message.
async fn refused_at_registration(registration: Registration) -> String {
    let mesh = TestMesh::start().await;
    let error = mesh
        .registrar()
        .await
        .register(registration)
        .await
        .unwrap_err();
    let guardmesh_client::ClientError::Status(status) = error else {
        panic!("a status, not {error}");
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let guards = mesh.registrar().await.list().await.unwrap().guards;
    assert!(guards.is_empty(), "{guards:?}");
    status.message().to_owned()
}

#[tokio::test]
async fn r27_policy_that_does_not_compile_is_refused_at_registration() {
    let text = refused_at_registration(Registration::policy(
        "policy",
        "[[rule]]\nname = \"x\"\nwhen = \"call.args.(\"\naction = \"cancel\"\nmessage = '\"m\"'\n",
    ))
    .await;
    assert!(text.contains("line 3"), "{text}");
    assert!(text.contains("does not compile"), "{text}");
}

/// R27, R13: a misspelt function would fail every call, and under
/// `fail_open` let every call through unjudged: it is refused at
/// registration, with the line and the name meant, and nothing is applied.
#[tokio::test]
async fn r27_a_misspelt_function_is_refused_at_registration_not_failed_open_at_run_time() {
    let text = refused_at_registration(
        Registration::policy(
            "policy",
            "[[rule]]\nname = \"no-shell\"\ntools = [\"shell.*\"]\n\
             when = \"call.args.cmd.startswith('rm ')\"\naction = \"cancel\"\nmessage = '\"m\"'\n",
        )
        .failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    assert!(text.contains("line 4"), "{text}");
    assert!(text.contains("unknown function \"startswith\""), "{text}");
    assert!(text.contains("did you mean \"startsWith\""), "{text}");
}

#[tokio::test]
async fn r28_unguarded_cancel_cancels_an_unguarded_tool_and_not_a_guarded_one() {
    let mut config = fast_config();
    config.unguarded = guardmesh_server::mesh::Unguarded::Cancel;
    let mesh = TestMesh::with_config(config).await;
    mesh.register(Registration::policy("policy", POLICY).tools(["sql.*"]))
        .await;
    let d = mesh
        .decides(
            Batch::new(0)
                .call("sel", "sql.query", r#"{"query": "SELECT 1"}"#)
                .call("sh", "shell.exec", r#"{"cmd": "ls"}"#),
        )
        .await;
    assert!(d.call("sel").unwrap().proceeds(), "a guarded tool proceeds");
    let sh = d.call("sh").unwrap();
    assert!(matches!(sh.outcome, Outcome::Cancel { .. }), "{sh:?}");
    assert!(
        skip_content(&sh.outcome).contains("\"shell.exec\""),
        "{sh:?}"
    );
    assert_eq!(
        metric(
            &mesh,
            "guardmesh_unguarded_calls_total{decision=\"cancel\"}"
        ),
        1.0
    );
    // A dry-run guard does not guard (R18): the call is still unguarded.
    mesh.register(Registration::policy("watch", POLICY).dry_run())
        .await;
    let d = mesh
        .decides(Batch::new(0).call("sh", "shell.exec", "{}"))
        .await;
    assert!(matches!(
        d.call("sh").unwrap().outcome,
        Outcome::Cancel { .. }
    ));
}

#[tokio::test]
async fn r28_unguarded_calls_proceed_by_default_and_are_counted() {
    let mesh = TestMesh::start().await;
    let d = mesh
        .decides(Batch::new(0).call("sh", "shell.exec", "{}"))
        .await;
    assert!(d.call("sh").unwrap().proceeds());
    assert_eq!(
        metric(
            &mesh,
            "guardmesh_unguarded_calls_total{decision=\"proceed\"}"
        ),
        1.0
    );
}

#[tokio::test]
async fn r27_r28_policy_guard_and_unguarded_from_the_config_file() {
    let dir = std::env::temp_dir().join(format!("guardmesh-policy-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("rules.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let config = format!(
        "unguarded = \"cancel\"\n\n[[guard]]\nname = \"policy\"\npolicy = {:?}\ntools = [\"sql.*\"]\n",
        policy.display().to_string()
    );
    let mesh = MeshProcess::start("policy-config", &config, None).await;
    let d = mesh
        .coordinator()
        .await
        .evaluate_once(
            "s",
            Batch::new(0)
                .call("del", "sql.query", r#"{"query": "DELETE FROM users"}"#)
                .call("sh", "shell.exec", "{}"),
        )
        .await
        .unwrap();
    assert!(matches!(
        d.call("del").unwrap().outcome,
        Outcome::Cancel { .. }
    ));
    assert_eq!(
        trace_of(&d, "policy").rules.get("del").map(String::as_str),
        Some("sql-delete-needs-where")
    );
    assert!(skip_content(&d.call("sh").unwrap().outcome).contains("shell.exec"));
}

#[test]
fn r27_config_guard_needs_exactly_one_of_endpoint_and_policy() {
    for (entry, needle) in [
        ("name = \"g\"\n", "needs `endpoint`"),
        (
            "name = \"g\"\nendpoint = \"127.0.0.1:9\"\npolicy = \"p.toml\"\n",
            "both `endpoint` and `policy`",
        ),
    ] {
        let error = guardmesh_server::config::Config::parse(&format!("[[guard]]\n{entry}"), "t")
            .unwrap_err()
            .to_string();
        assert!(error.contains(needle), "{error}");
    }
    // A policy file that does not compile is refused at start, with its line.
    let broken = file(
        "broken-config-policy.toml",
        "[[rule]]\nname = \"x\"\nwhen = \"(\"\naction = \"cancel\"\nmessage = '\"m\"'\n",
    );
    let config = file(
        "config-with-broken-policy.toml",
        &format!(
            "[[guard]]\nname = \"p\"\npolicy = {:?}\n",
            broken.display().to_string()
        ),
    );
    let error = guardmesh_server::config::Config::load(&config)
        .unwrap_err()
        .to_string();
    assert!(error.contains("line 3"), "{error}");
}

#[tokio::test]
async fn r27_sighup_reloads_the_policy_and_keeps_the_running_one_when_broken() {
    let dir = std::env::temp_dir().join(format!("guardmesh-policy-hup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("rules.toml");
    let rule = |message: &str| {
        format!(
            "[[rule]]\nname = \"no-shell\"\ntools = [\"shell.*\"]\nwhen = \"true\"\n\
             action = \"cancel\"\nmessage = '\"{message}\"'\n"
        )
    };
    std::fs::write(&policy, rule("first")).unwrap();
    // No file watch: what reloads here is the signal alone.
    let config = format!(
        "watch_policies = false\n\n[[guard]]\nname = \"policy\"\npolicy = {:?}\n",
        policy.display().to_string()
    );
    let mesh = MeshProcess::start("policy-hup", &config, Some("info")).await;
    let coordinator = mesh.coordinator().await;
    let content = |d: BatchDecision| skip_content(&d.calls[0].outcome).to_owned();
    let shell = || Batch::new(0).call("sh", "shell.exec", "{}");
    let d = coordinator.evaluate_once("s", shell()).await.unwrap();
    let first_revision = d.chain_revision;
    assert_eq!(content(d), "first");

    std::fs::write(&policy, rule("second")).unwrap();
    // Without the signal the change is not applied (a watch would have
    // reloaded within its 200 ms debounce).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let d = coordinator.evaluate_once("s", shell()).await.unwrap();
    assert_eq!(content(d), "first", "no reload before SIGHUP");
    mesh.signal("HUP");
    let mut reloaded = None;
    for _ in 0..200 {
        let d = coordinator.evaluate_once("s", shell()).await.unwrap();
        if content(d.clone()) == "second" {
            reloaded = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let reloaded = reloaded.expect("the new policy is applied after SIGHUP");
    assert!(
        reloaded.chain_revision > first_revision,
        "the revision covers the rules"
    );

    std::fs::write(&policy, "[[rule]]\nname = \"x\"\nwhen = \"(\"\n").unwrap();
    mesh.signal("HUP");
    let mut logged = false;
    for _ in 0..200 {
        if mesh.log().contains("policy reload refused") {
            logged = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(logged, "a broken file is logged:\n{}", mesh.log());
    let d = coordinator.evaluate_once("s", shell()).await.unwrap();
    assert_eq!(content(d), "second", "the running policy is kept");
}
