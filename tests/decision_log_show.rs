//! `guardmesh log show` and `guardmesh log tail` (R29): the decisions of a
//! rotated, signed log written by a real `guardmesh serve`, one line each,
//! filtered, as JSON, verified as they are read, and followed as the log
//! grows and rotates. And the rule that decided, in `evaluate --json` and
//! in the SDK's `CallDecision` (R27).

use crate::harness::*;
use guardmesh_server::decision_log::segment;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A mesh config with a signed decision log in `dir/log`, in small files,
/// and [`LOG_POLICY`] (cancels `danger`, rule `no-danger`).
fn config(dir: &Path) -> String {
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, LOG_POLICY).unwrap();
    format!(
        "[decision_log]\ndir = {:?}\nmax_file_bytes = 5000\nsigning_key = {:?}\n\
         checkpoint_every = 4\n\n[[guard]]\nname = \"policy\"\npolicy = {:?}\n",
        path(&dir.join("log")),
        path(&dir.join("log.key")),
        path(&policy),
    )
}

/// A mesh writing a signed log in a fresh folder `name`, after `n`
/// batches of [`log_batches`] (`b0`, `b1`, ...): the folder and the mesh.
async fn signed_mesh(name: &str, n: usize) -> (PathBuf, MeshProcess) {
    let dir = folder(name);
    log_keygen(&dir);
    let mesh = MeshProcess::start(name, &config(&dir), None).await;
    log_batches(&mesh.url, "b", n, None).await;
    (dir, mesh)
}

/// `guardmesh ARGS` left running (killed when dropped), and the lines it
/// prints, as they come.
fn running(args: &[&str]) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    let mut child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

fn show(args: &[&str]) -> std::process::Output {
    let mut all = vec!["log", "show"];
    all.extend_from_slice(args);
    guardmesh(&all)
}

/// The `batch=` of each text line.
fn batches(out: &std::process::Output) -> Vec<String> {
    text(&out.stdout)
        .lines()
        .map(|line| {
            line.split(' ')
                .find_map(|w| w.strip_prefix("batch="))
                .unwrap_or_else(|| panic!("no batch in {line:?}"))
                .to_owned()
        })
        .collect()
}

fn jsonl(out: &std::process::Output) -> Vec<Value> {
    text(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}")))
        .collect()
}

fn names(prefix: &str, range: impl Iterator<Item = usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r29_log_show_reads_a_rotated_signed_log_with_filters() {
    let (dir, mut mesh) = signed_mesh("show-filters", 12).await;

    // R27: the rule that decided, in `evaluate --json` and in the SDK.
    let batch = dir.join("batch.json");
    std::fs::write(
        &batch,
        r#"{"session_id":"e","calls":[{"call_id":"c1","tool":"danger","arguments":{}}]}"#,
    )
    .unwrap();
    let out = guardmesh_off_thread(["evaluate", "--json", "--mesh", &mesh.url, path(&batch)]).await;
    let decision: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(decision["decisions"][0]["rule"], "no-danger", "{decision}");
    assert_eq!(decision["decisions"][0]["decided_by"], "policy");
    let session = mesh.coordinator().await.session("sdk").await.unwrap();
    let answer = session
        .evaluate(guardmesh_client::Batch::new(0).call("c1", "danger", "{}"))
        .await
        .unwrap();
    assert_eq!(answer.calls[0].rule.as_deref(), Some("no-danger"));
    let answer = session
        .evaluate(guardmesh_client::Batch::new(1).call("c1", "read", "{}"))
        .await
        .unwrap();
    assert_eq!(answer.calls[0].rule, None);

    mesh.signal("TERM");
    assert!(mesh.exit_status().await.success(), "{}", mesh.log());
    let log = dir.join("log");
    let files = segment::list(&log).unwrap();
    assert!(files.len() >= 3, "the log should have rotated: {files:?}");
    let log = path(&log);
    let key = dir.join("log.key.pub");
    let key = path(&key);

    // Every decision, in order, across the rotated files, verified with
    // the key. (`log_batches` sends its batches without a context: their
    // session id is empty.)
    let all = show(&[log, "--key", key, "--session", ""]);
    assert_succeeded(&all);
    assert_eq!(batches(&all), names("b", 0..12));
    for line in text(&all.stdout).lines() {
        if line.contains(" cancel ") {
            assert!(line.contains(" danger ") && line.contains("by=policy rule=no-danger"));
            assert!(line.contains(r#"content="no danger""#), "{line}");
        } else {
            assert!(
                line.contains(" proceed ") && line.contains(" read "),
                "{line}"
            );
        }
    }
    let everything = show(&[log]);
    assert_succeeded(&everything);
    assert_eq!(text(&everything.stdout).lines().count(), 15);

    // Filters.
    let cancelled = show(&[log, "--action", "cancel", "--session", ""]);
    assert_eq!(batches(&cancelled), names("b", (0..12).step_by(2)));
    // Tool globs match in either ASCII case, as guards' patterns do.
    let tool = show(&[log, "--tool", "DANG*", "--session", ""]);
    assert_eq!(batches(&tool), names("b", (0..12).step_by(2)));
    let by_rule = show(&[log, "--rule", "no-danger", "--guard", "policy", "--jsonl"]);
    let by_rule = jsonl(&by_rule);
    assert_eq!(by_rule.len(), 8, "six of log_batches, one of e, one of sdk");
    for d in &by_rule {
        assert_eq!(d["action"], "cancel");
        assert_eq!(d["rule"], "no-danger");
        assert_eq!(d["decided_by"], "policy");
        assert_eq!(d["tool"], "danger");
        assert_eq!(d["failure"], false);
    }
    assert_eq!(batches(&show(&[log, "--batch", "b3"])), ["b3"]);
    assert_eq!(text(&show(&[log, "--session", "nobody"]).stdout), "");
    assert_eq!(text(&show(&[log, "--failure"]).stdout), "");
    assert_eq!(text(&show(&[log, "--caller", "someone"]).stdout), "");
    assert_eq!(
        text(&show(&[log, "--since", "2999-01-01T00:00:00Z"]).stdout),
        ""
    );
    assert_eq!(
        text(&show(&[log, "--until", "2000-01-01T00:00:00Z"]).stdout),
        ""
    );
    assert_eq!(
        batches(&show(&[log, "--since", "1h", "--session", ""])).len(),
        12
    );
    let array: Value =
        serde_json::from_slice(&show(&[log, "--json", "--session", ""]).stdout).unwrap();
    let array = array.as_array().unwrap();
    assert_eq!(array.len(), 12);
    assert_eq!(array[11]["batch_id"], "b11");
    assert_eq!(array[0]["session_id"], "");

    // tail: the last decisions.
    let tail = guardmesh(&["log", "tail", "-n", "3", log, "--session", ""]);
    assert_succeeded(&tail);
    assert_eq!(batches(&tail), names("b", 9..12));

    // Bad filters say what was wrong.
    for (args, says) in [
        (vec![log, "--since", "yesterday"], "RFC 3339"),
        (vec![log, "--tool", "a["], "not a glob"),
        (vec![log, "--action", "maybe"], "maybe"),
    ] {
        let out = show(&args);
        assert_exit_code(&out, 2);
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
}

/// A copy of the log in `from` into `to`, with `edit` applied to the
/// line holding `batch`.
fn tampered_copy(from: &Path, to: &Path, batch: &str, edit: impl Fn(&str) -> String) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for (_, file) in segment::list(from).unwrap() {
        let text = std::fs::read_to_string(&file).unwrap();
        let edited: String = text
            .lines()
            .map(|line| {
                let line = if line.contains(&format!("\"batch_id\":\"{batch}\"")) {
                    edit(line)
                } else {
                    line.to_owned()
                };
                format!("{line}\n")
            })
            .collect();
        std::fs::write(to.join(file.file_name().unwrap()), edited).unwrap();
    }
    to.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r29_log_show_prints_only_what_verified_and_names_the_record_that_breaks() {
    let (dir, mut mesh) = signed_mesh("show-tamper", 10).await;
    mesh.signal("TERM");
    assert!(mesh.exit_status().await.success(), "{}", mesh.log());

    // An attacker turns a cancel into a proceed in the middle of the log.
    let edited = tampered_copy(&dir.join("log"), &dir.join("edited"), "b6", |line| {
        line.replace("\"action\":\"cancel\"", "\"action\":\"proceed\"")
    });
    let out = show(&[path(&edited)]);
    assert_exit_code(&out, 1);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("does not match its bytes"), "{stderr}");
    assert!(stderr.contains("decisions-"), "the file is named: {stderr}");
    // What came before the edited record is shown, nothing from it on.
    assert_eq!(batches(&out), names("b", 0..6));
    // tail reads (and verifies) the whole log before it prints.
    let out = guardmesh(&["log", "tail", path(&edited)]);
    assert_exit_code(&out, 1);
    assert_eq!(text(&out.stdout), "");
    // Without verification it is shown, with a warning.
    let out = show(&[path(&edited), "--no-verify", "--batch", "b6"]);
    assert_succeeded(&out);
    assert!(text(&out.stdout).contains(" proceed "));
    assert!(text(&out.stderr).contains("not checked"));

    // A log cut at its end: with the key, the missing closing checkpoint
    // is not noticed without an anchor, but a line cut in half is.
    let cut = tampered_copy(&dir.join("log"), &dir.join("cut"), "none", str::to_owned);
    let (_, last) = segment::list(&cut).unwrap().pop().unwrap();
    let bytes = std::fs::read(&last).unwrap();
    std::fs::write(&last, &bytes[..bytes.len() - 10]).unwrap();
    let out = show(&[path(&cut)]);
    assert_exit_code(&out, 1);
    assert!(
        text(&out.stderr).contains("incomplete"),
        "{}",
        text(&out.stderr)
    );

    // A record signed by another key is refused with --key.
    let other = folder("show-tamper-other");
    log_keygen(&other);
    let out = show(&[
        path(&dir.join("log")),
        "--key",
        path(&other.join("log.key.pub")),
    ]);
    assert_exit_code(&out, 1);
    assert_eq!(
        text(&out.stdout),
        "",
        "nothing before the first checkpoint fails"
    );

    // Not a log.
    let out = show(&[path(&other)]);
    assert_exit_code(&out, 2);
    assert!(text(&out.stderr).contains("no decision log files"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r29_log_show_follow_reads_on_across_growth_and_rotation() {
    let (dir, mesh) = signed_mesh("show-follow", 2).await;
    let log = dir.join("log");
    let files_before = segment::list(&log).unwrap().len();

    let (mut child, received) = running(&[
        "log",
        "show",
        path(&log),
        "--follow",
        "--jsonl",
        "--poll-ms",
        "20",
        "--session",
        "",
    ]);
    let mut seen = Vec::new();
    let take = |n: usize, seen: &mut Vec<String>| {
        for _ in 0..n {
            let line = received
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("follow printed only {seen:?}"));
            let d: Value = serde_json::from_str(&line).unwrap();
            seen.push(d["batch_id"].as_str().unwrap().to_owned());
        }
    };
    take(2, &mut seen);
    // The log grows past several rotations while it is followed.
    log_batches(&mesh.url, "c", 20, None).await;
    take(20, &mut seen);
    let mut expected = names("b", 0..2);
    expected.extend(names("c", 0..20));
    assert_eq!(seen, expected);
    let files_after = segment::list(&log).unwrap().len();
    assert!(
        files_after >= files_before + 2,
        "the log should have rotated while followed: {files_before} -> {files_after}"
    );
    // And nothing more than what was written.
    assert!(received.recv_timeout(Duration::from_millis(300)).is_err());
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "follow keeps running"
    );
}

/// The `guardmesh log` lines of the code blocks marked `log-reader` in
/// `file`, split into arguments (single quotes as a shell reads them).
fn documented_commands(file: &str) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(repo_root().join(file)).unwrap();
    let mut commands = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if !line.starts_with("<!-- log-reader") {
            continue;
        }
        assert!(lines.next().unwrap().starts_with("```"));
        for line in lines.by_ref().take_while(|l| !l.starts_with("```")) {
            let mut words = Vec::new();
            for (i, part) in line.split('\'').enumerate() {
                if i % 2 == 1 {
                    words.push(part.to_owned());
                } else {
                    words.extend(part.split_whitespace().map(str::to_owned));
                }
            }
            assert_eq!(words.remove(0), "guardmesh", "{line}");
            commands.push(words);
        }
    }
    assert!(!commands.is_empty(), "{file} shows no log-reader block");
    commands
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r29_the_log_reader_in_the_readme_and_docs_runs_as_written() {
    let (dir, mut mesh) = signed_mesh("show-docs", 6).await;
    let log = dir.join("log");
    let key = dir.join("log.key.pub");
    let mut ran = 0;
    for file in ["README.md", "docs/decision-log.md"] {
        for words in documented_commands(file) {
            let args: Vec<String> = words
                .iter()
                .map(|w| match w.as_str() {
                    "/var/lib/guardmesh/decisions" => path(&log).to_owned(),
                    "/etc/guardmesh/log.key.pub" => path(&key).to_owned(),
                    _ => w.clone(),
                })
                .collect();
            let shown = words.join(" ");
            if args.iter().any(|a| a == "--follow") {
                // Runs until stopped: it prints what is there, then a
                // record written after it started.
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let (mut child, rx) = running(&args);
                let first = rx.recv_timeout(Duration::from_secs(20)).expect(&shown);
                assert!(first.contains(" cancel "), "{shown}: {first}");
                log_batches(&mesh.url, "late", 1, None).await;
                let late = std::iter::from_fn(|| rx.recv_timeout(Duration::from_secs(20)).ok())
                    .find(|line| line.contains("batch=late0"));
                assert!(late.is_some(), "{shown}: the new record was not followed");
                assert!(child.0.try_wait().unwrap().is_none(), "{shown} stopped");
            } else {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let out = guardmesh_off_thread(args).await;
                assert_succeeded(&out);
                if shown.contains("--action cancel") {
                    assert!(text(&out.stdout).contains(" cancel "), "{shown}");
                    assert!(!text(&out.stdout).contains(" proceed "), "{shown}");
                }
            }
            ran += 1;
        }
    }
    assert!(ran >= 8, "{ran}");
    mesh.signal("TERM");
    assert!(mesh.exit_status().await.success());
}
