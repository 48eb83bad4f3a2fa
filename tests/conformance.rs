//! The conformance kit (`guardmesh conformance`, issue 5), run as the real
//! binary against real guard processes: it passes the Rust, Python and Node
//! example guards, and fails the deliberately broken Python guard naming the
//! check each breach breaks. The Python and Node guards need
//! `scripts/setup-polyglot`.

use crate::harness::*;

/// Every check the kit runs, in its output order.
const CHECKS: [&str; 10] = [
    "connect",
    "health",
    "answers-once",
    "known-call-ids",
    "concurrent-batches",
    "cancel",
    "within-deadline",
    "skip-content",
    "rewrites",
    "no-error-answers",
];

/// A generous timeout for guards that conform: the machine may be busy.
const PASSING_TIMEOUT_MS: &str = "5000";

fn check_names(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|line| {
            let rest = line
                .strip_prefix("PASS ")
                .or_else(|| line.strip_prefix("FAIL "))
                .or_else(|| line.strip_prefix("SKIP "))?;
            Some(rest.split([' ', ':']).next().unwrap_or_default().to_owned())
        })
        .collect()
}

/// Asserts that every check ran and passed (health included: every example
/// serves grpc.health.v1) and the exit status is 0.
fn assert_conforms(addr: &str, args: &[&str]) -> String {
    let mut all = vec!["--timeout-ms", PASSING_TIMEOUT_MS];
    all.extend_from_slice(args);
    let (status, stdout) = run_conformance(addr, &all);
    assert_eq!(
        check_names(&stdout),
        CHECKS,
        "one line per check:\n{stdout}"
    );
    for line in stdout.lines() {
        assert!(
            line.starts_with("PASS "),
            "expected a pass: {line}\n{stdout}"
        );
    }
    assert!(status.success(), "exit status {status}:\n{stdout}");
    stdout
}

/// Asserts that `check` failed, that each of `still_pass` passed, and that
/// the exit status is non-zero.
fn assert_fails(addr: &str, args: &[&str], check: &str, still_pass: &[&str]) -> String {
    let (status, stdout) = run_conformance(addr, args);
    assert!(
        stdout
            .lines()
            .any(|line| line.starts_with(&format!("FAIL {check}: "))),
        "expected `FAIL {check}: ...`:\n{stdout}"
    );
    for other in still_pass {
        assert!(
            stdout.lines().any(|line| line == format!("PASS {other}")
                || line.starts_with(&format!("PASS {other} ("))),
            "expected `PASS {other}`:\n{stdout}"
        );
    }
    assert!(!status.success(), "a failing check must fail the command");
    assert_eq!(status.code(), Some(1), "{stdout}");
    stdout
}

fn line_of<'a>(stdout: &'a str, check: &str) -> &'a str {
    stdout
        .lines()
        .find(|line| line[5..].starts_with(check))
        .unwrap_or_else(|| panic!("no line for {check}:\n{stdout}"))
}

#[test]
fn conformance_passes_the_rust_deny_list_example_guard() {
    let guard = GuardProcess::start("deny-list", 0, &[]);
    let stdout = assert_conforms(&guard.url, &[]);
    // The crafted batches hold denied tools: skips were seen and checked.
    assert!(
        line_of(&stdout, "skip-content").contains("cancel"),
        "{stdout}"
    );
}

#[test]
fn conformance_passes_the_rust_redact_secrets_example_guard_as_mutate() {
    let guard = GuardProcess::start("redact-secrets", 0, &[]);
    let stdout = assert_conforms(&format!("127.0.0.1:{}", guard.port), &["--role", "mutate"]);
    assert!(
        line_of(&stdout, "rewrites").contains("rewrites"),
        "the crafted batches hold secrets, so rewrites were checked:\n{stdout}"
    );
}

#[test]
fn conformance_passes_the_python_injection_guard() {
    let guard = KitGuard::python("injection_guard.py", &[]);
    let stdout = assert_conforms(&guard.addr, &[]);
    let skips = line_of(&stdout, "skip-content");
    assert!(
        skips.contains("steer") && !skips.contains("no skip"),
        "{stdout}"
    );
}

#[test]
fn conformance_passes_the_python_pii_redactor_as_mutate() {
    let guard = KitGuard::python("pii_redactor.py", &["--role", "mutate"]);
    let stdout = assert_conforms(&guard.addr, &["--role", "mutate"]);
    assert!(
        !line_of(&stdout, "rewrites").contains("no rewrite"),
        "{stdout}"
    );
}

#[test]
fn conformance_fails_rewrites_from_a_guard_declared_validate() {
    // The same redactor, but the user says it is a validate guard.
    let guard = KitGuard::python("pii_redactor.py", &[]);
    let stdout = assert_fails(
        &guard.addr,
        &["--timeout-ms", PASSING_TIMEOUT_MS],
        "rewrites",
        &["answers-once", "known-call-ids", "within-deadline"],
    );
    assert!(stdout.contains("validate guard"), "{stdout}");
}

#[test]
fn conformance_passes_the_node_deny_list_guard_with_a_json_report() {
    let guard = KitGuard::node("deny_list_guard.js", &[]);
    assert_conforms(&guard.url, &[]);
    let (status, stdout) =
        run_conformance(&guard.addr, &["--json", "--timeout-ms", PASSING_TIMEOUT_MS]);
    assert!(status.success(), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON report");
    assert_eq!(report["passed"], true, "{report:#}");
    let checks = report["checks"].as_array().expect("checks");
    let names: Vec<&str> = checks
        .iter()
        .map(|c| c["name"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(names, CHECKS);
    assert!(checks.iter().all(|c| c["status"] == "pass"), "{report:#}");
}

#[test]
fn conformance_fails_a_guard_that_answers_twice() {
    let guard = KitGuard::python("broken_guard.py", &["--mode", "answer-twice"]);
    let stdout = assert_fails(
        &guard.addr,
        &[],
        "answers-once",
        &["known-call-ids", "skip-content", "within-deadline"],
    );
    assert!(stdout.contains("2 final answers"), "{stdout}");
}

#[test]
fn conformance_fails_a_guard_that_names_unknown_call_ids() {
    let guard = KitGuard::python("broken_guard.py", &["--mode", "unknown-call-id"]);
    let stdout = assert_fails(
        &guard.addr,
        &[],
        "known-call-ids",
        &["answers-once", "concurrent-batches", "skip-content"],
    );
    assert!(
        stdout.contains("-unknown\", which was not sent"),
        "{stdout}"
    );
}

#[test]
fn conformance_fails_a_guard_that_skips_with_blank_content() {
    let guard = KitGuard::python("broken_guard.py", &["--mode", "blank-skip"]);
    let stdout = assert_fails(
        &guard.addr,
        &[],
        "skip-content",
        &["answers-once", "known-call-ids", "concurrent-batches"],
    );
    assert!(stdout.contains("blank content"), "{stdout}");
}

#[test]
fn conformance_fails_a_guard_that_never_answers() {
    let guard = KitGuard::python("broken_guard.py", &["--mode", "never-answer"]);
    // A short timeout keeps the run short: each exchange waits for it.
    let stdout = assert_fails(
        &guard.addr,
        &["--timeout-ms", "800", "--grace-ms", "200"],
        "within-deadline",
        &["health", "known-call-ids", "skip-content"],
    );
    assert!(
        line_of(&stdout, "within-deadline").contains("no answer within its deadline_ms 800"),
        "{stdout}"
    );
    assert!(stdout.contains("FAIL answers-once: "), "{stdout}");
}

#[test]
fn conformance_fails_a_mutate_guard_whose_rewrite_is_not_a_json_object() {
    let guard = KitGuard::python("broken_guard.py", &["--mode", "bad-rewrite"]);
    let stdout = assert_fails(
        &guard.addr,
        &["--role", "mutate"],
        "rewrites",
        &["answers-once", "known-call-ids"],
    );
    assert!(stdout.contains("not a JSON object"), "{stdout}");
}

#[test]
fn conformance_fails_when_nothing_listens() {
    let port = free_port();
    let (status, stdout) = run_conformance(&format!("127.0.0.1:{port}"), &[]);
    assert!(stdout.starts_with("FAIL connect: "), "{stdout}");
    assert_eq!(status.code(), Some(1));
}

#[tokio::test]
async fn conformance_skips_health_on_a_guard_without_grpc_health_and_still_passes() {
    // A hand-written guard on the raw stubs: answers each batch once,
    // proceeding on everything, ignores cancels, serves no health service.
    let guard = raw_script_guard(|batch| vec![RawSend::now(final_answer(batch, Vec::new()))]).await;
    let url = guard.url.clone();
    let (status, stdout) = tokio::task::spawn_blocking(move || {
        run_conformance(&url, &["--timeout-ms", PASSING_TIMEOUT_MS])
    })
    .await
    .unwrap();
    assert_eq!(check_names(&stdout), CHECKS, "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|line| line.starts_with("SKIP health (") && line.contains("not implemented")),
        "{stdout}"
    );
    for line in stdout.lines().filter(|l| !l.starts_with("SKIP health")) {
        assert!(line.starts_with("PASS "), "{line}\n{stdout}");
    }
    assert!(
        status.success(),
        "a skipped check is not a failure:\n{stdout}"
    );
    assert!(
        guard
            .guard
            .streams
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 3
    );
}

/// A mutate guard that rewrote nothing has had its rewrites checked on
/// nothing: `rewrites` says so (SKIP) and names `--batch`; with a file of
/// its author's calls, the batches are sent, answered, and the rewrites of
/// them checked.
#[test]
fn conformance_feeds_a_guard_its_authors_batches_and_says_when_no_rewrite_was_checked() {
    // The deny-list guard rewrites nothing: as a mutate guard, nothing of
    // its rewrites could be checked.
    let deny = GuardProcess::start("deny-list", 0, &[]);
    let (status, stdout) = run_conformance(
        &deny.url,
        &["--timeout-ms", PASSING_TIMEOUT_MS, "--role", "mutate"],
    );
    assert!(
        line_of(&stdout, "rewrites")
            .starts_with("SKIP rewrites (no rewrite seen: give --batch FILE"),
        "{stdout}"
    );
    assert!(status.success(), "a skip is no failure:\n{stdout}");

    let dir = std::env::temp_dir().join(format!("guardmesh-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("mine.jsonl");
    std::fs::write(
        &file,
        concat!(
            r#"{"calls": [{"call_id": "a", "tool": "vault.put", "arguments": {"name": "db", "api_key": "k-1"}}]}"#,
            "\n",
            r#"{"calls": [{"call_id": "b", "tool": "vault.list"}, {"call_id": "c", "tool": "vault.put", "arguments": {"token": "t"}}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let redact = GuardProcess::start("redact-secrets", 0, &[]);
    let stdout = {
        let (status, stdout) = run_conformance(
            &redact.url,
            &[
                "--timeout-ms",
                PASSING_TIMEOUT_MS,
                "--role",
                "mutate",
                "--batch",
                file.to_str().unwrap(),
            ],
        );
        assert!(status.success(), "{stdout}");
        stdout
    };
    let own = line_of(&stdout, "batch-files");
    assert!(
        own.starts_with("PASS batch-files (3 calls:") && own.contains("2 rewrite"),
        "{stdout}"
    );
    assert!(
        line_of(&stdout, "rewrites").starts_with("PASS rewrites"),
        "{stdout}"
    );

    // A file the mesh would refuse is refused before anything is sent,
    // naming where.
    std::fs::write(
        &file,
        r#"{"calls": [{"call_id": "a", "tool": "t", "arguments": [1, 2]}]}"#,
    )
    .unwrap();
    let (status, stdout) = run_conformance(&redact.url, &["--batch", file.to_str().unwrap()]);
    assert_eq!(status.code(), Some(1), "{stdout}");
    let refused = line_of(&stdout, "batch-files");
    assert!(
        refused.starts_with("FAIL batch-files: ")
            && refused.contains("batch 1: call \"a\": arguments must be a JSON object"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
