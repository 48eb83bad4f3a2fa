//! Policy files (R27): `guardmesh policy check` and `guardmesh policy test`
//! as users run them, on the example policy of `examples/policy/` and on
//! broken ones.

use crate::harness::*;
use std::path::PathBuf;
use std::process::{Command, Output};

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

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn r27_policy_check_accepts_the_example_and_lists_its_rules() {
    let out = guardmesh(&["policy", "check", &example("policy.toml")]);
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("ok: 4 rules"), "{stdout}");
    for rule in [
        "sql-delete-needs-where",
        "payment-over-10000-needs-a-human",
        "no-shell-in-production",
        "at-most-3-emails-per-round",
    ] {
        assert!(stdout.contains(rule), "{rule} listed: {stdout}");
    }
}

#[test]
fn r27_policy_test_passes_the_example_cases() {
    let out = guardmesh(&[
        "policy",
        "test",
        &example("policy.toml"),
        &example("cases.toml"),
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains("PASS"), "{out:?}");
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
    let out = guardmesh(&[
        "policy",
        "test",
        &broken.display().to_string(),
        &example("cases.toml"),
    ]);
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
    let out = guardmesh(&[
        "policy",
        "test",
        &example("policy.toml"),
        &cases.display().to_string(),
    ]);
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
