//! The decision log end to end (R29): records written by the writer match
//! the JSON Schema, masked values never reach the file, the chain holds
//! across rotation and restarts, verification names the first bad record,
//! and a record that cannot be written is an error.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::*;

fn caller() -> Caller {
    Caller {
        id: Some("coordinator-a".to_owned()),
        roles: vec!["evaluate".to_owned()],
        peer: Some("127.0.0.1:50000".to_owned()),
    }
}

fn batch(batch_id: &str, calls: Vec<CallRecord>) -> BatchRecord {
    BatchRecord {
        batch_id: batch_id.to_owned(),
        session_id: "session-1".to_owned(),
        turn_index: 3,
        model_text: Some("let me look that up".to_owned()),
        metadata: BTreeMap::from([
            ("tenant".to_owned(), "acme".to_owned()),
            ("api_key".to_owned(), "meta-secret-1".to_owned()),
        ]),
        timeout_ms: Some(2000),
        calls,
    }
}

fn trace(guard: &str, status: TraceStatus) -> GuardTraceRecord {
    GuardTraceRecord {
        latency_us: 412,
        sent_call_ids: vec!["c1".to_owned()],
        ..bare_trace(guard, status)
    }
}

/// Validate guard `guard`'s trace with `status` (1 µs), nothing else said.
pub(super) fn bare_trace(guard: &str, status: TraceStatus) -> GuardTraceRecord {
    GuardTraceRecord {
        guard: guard.to_owned(),
        role: GuardRole::Validate,
        status,
        latency_us: 1,
        sent_call_ids: Vec::new(),
        skipped_call_ids: Vec::new(),
        rewritten_call_ids: Vec::new(),
        error: None,
        dry_run_status: None,
        replica: None,
        labels: Vec::new(),
        refused_labels: 0,
    }
}

/// A decision on `call_id` of `action`, nothing else said.
pub(super) fn call_decision(call_id: &str, action: Action) -> CallDecisionRecord {
    CallDecisionRecord {
        call_id: call_id.to_owned(),
        action,
        call: None,
        content: None,
        decided_by: None,
        rule: None,
        failure: false,
        rewritten_by: Vec::new(),
        bypassed: Vec::new(),
        approval: None,
        approval_refused: None,
        approved_by_request: None,
    }
}

/// A decided batch: one call rewritten and proceeding, one steered; every
/// secret in it is one the masking below must remove.
fn decided(batch_id: &str) -> Entry {
    let calls = vec![
        CallRecord::from_text(
            "c1",
            "http.get",
            r#"{"url":"https://x","headers":{"Authorization":"Bearer secret-token-2"},"password":"secret-pw-3"}"#,
        ),
        CallRecord::from_text(
            "c2",
            "db.query",
            r#"{"sql":"select 1","svc":{"api_key":"secret-key-4"}}"#,
        ),
    ];
    let mut rewritten = calls[0].clone();
    rewritten.arguments["url"] = json!("https://y");
    Entry::Decision(DecisionRecord {
        caller: caller(),
        batch: batch(batch_id, calls),
        chain_revision: Some(7),
        decisions: vec![
            CallDecisionRecord {
                call: Some(rewritten),
                rewritten_by: vec!["rewriter".to_owned()],
                bypassed: vec!["flaky".to_owned()],
                ..call_decision("c1", Action::Proceed)
            },
            CallDecisionRecord {
                content: Some("no raw SQL".to_owned()),
                decided_by: Some("sql-guard".to_owned()),
                rule: Some("no_raw_sql".to_owned()),
                ..call_decision("c2", Action::Steer)
            },
        ],
        trace: vec![
            GuardTraceRecord {
                role: GuardRole::Mutate,
                rewritten_call_ids: vec!["c1".to_owned()],
                ..trace("rewriter", TraceStatus::Rewrote)
            },
            GuardTraceRecord {
                skipped_call_ids: vec!["c2".to_owned()],
                ..trace("sql-guard", TraceStatus::Skipped)
            },
            GuardTraceRecord {
                error: Some("connection refused".to_owned()),
                ..trace("flaky", TraceStatus::Failed)
            },
            GuardTraceRecord {
                dry_run_status: Some(TraceStatus::Skipped),
                ..trace("candidate", TraceStatus::DryRun)
            },
        ],
        trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".to_owned()),
        outcome: Outcome::decided(),
    })
}

fn refused(batch_id: &str) -> Entry {
    Entry::Decision(DecisionRecord {
        caller: Caller::default(),
        batch: batch(
            batch_id,
            vec![CallRecord::from_text(
                "c1",
                "t",
                r#"{"password": "secret-unparsed-5""#,
            )],
        ),
        chain_revision: None,
        decisions: Vec::new(),
        trace: Vec::new(),
        trace_id: None,
        outcome: Outcome::refused(3, "call c1: arguments are not a JSON object"),
    })
}

fn aborted(batch_id: &str) -> Entry {
    Entry::Decision(DecisionRecord {
        caller: caller(),
        batch: batch(batch_id, vec![CallRecord::from_text("c1", "t", "{}")]),
        chain_revision: Some(7),
        decisions: Vec::new(),
        trace: vec![GuardTraceRecord {
            error: Some("deadline exceeded".to_owned()),
            ..trace("strict", TraceStatus::TimedOut)
        }],
        trace_id: None,
        outcome: Outcome::aborted(10, "guard strict failed (abort): deadline exceeded"),
    })
}

fn zero_calls(batch_id: &str) -> Entry {
    Entry::Decision(DecisionRecord {
        caller: caller(),
        batch: batch(batch_id, Vec::new()),
        chain_revision: Some(7),
        decisions: Vec::new(),
        trace: Vec::new(),
        trace_id: None,
        outcome: Outcome::decided(),
    })
}

fn change(kind: ChangeKind) -> Entry {
    Entry::ChainChange(ChainChangeRecord {
        caller: Caller {
            id: Some("ops".to_owned()),
            roles: vec!["admin".to_owned()],
            peer: None,
        },
        change: kind,
        guard: Some("sql-guard".to_owned()),
        spec: (kind != ChangeKind::Deregister).then(|| {
            json!({"name": "sql-guard", "endpoint": "http://127.0.0.1:7000", "priority": 0,
                   "tls": {"token": "secret-spec-6"}})
        }),
        old_revision: Some(7),
        new_revision: (kind != ChangeKind::Deregister).then_some(8),
        outcome: if kind == ChangeKind::Deregister {
            ChangeOutcome::refused(7, "caller may not manage sql-guard")
        } else {
            ChangeOutcome::applied()
        },
    })
}

const SECRETS: [&str; 6] = [
    "meta-secret-1",
    "secret-token-2",
    "secret-pw-3",
    "secret-key-4",
    "secret-unparsed-5",
    "secret-spec-6",
];

fn mask_rules() -> MaskRules {
    MaskRules::new([
        "password",
        "*.api_key",
        "api_key",
        "$.headers.authorization",
        "token",
    ])
    .unwrap()
}

fn config(dir: &Path) -> LogConfig {
    LogConfig {
        mask: mask_rules(),
        ..LogConfig::new(dir, "mesh-test-1")
    }
}

/// A log opened in a new directory with [`config`] as `change` leaves it.
async fn fresh_log(change: impl FnOnce(&mut LogConfig)) -> (tempfile::TempDir, DecisionLog) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    change(&mut config);
    let log = DecisionLog::open(config).await.unwrap();
    (dir, log)
}

/// Every kind of entry, once.
fn every_kind() -> Vec<Entry> {
    vec![
        decided("b1"),
        refused("b2"),
        aborted("b3"),
        zero_calls("b4"),
        change(ChangeKind::Register),
        change(ChangeKind::Deregister),
        change(ChangeKind::ConfigReload),
    ]
}

/// The decision log's JSON Schema (`docs/decision-log.schema.json`), its
/// formats checked.
pub(super) fn schema() -> jsonschema::Validator {
    let schema: Value =
        serde_json::from_str(include_str!("../../../docs/decision-log.schema.json")).unwrap();
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .unwrap()
}

/// Asserts that `line` is a record the schema accepts, and one the record
/// type reads back and writes as the same bytes.
pub(super) fn assert_valid_record(schema: &jsonschema::Validator, line: &str) {
    let value: Value = serde_json::from_str(line).unwrap();
    let errors: Vec<String> = schema.iter_errors(&value).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{line}\n{errors:#?}");
    let record: LogRecord = serde_json::from_str(line).unwrap();
    assert_eq!(&serde_json::to_string(&record).unwrap(), line);
}

/// [`lines`] of `dir`, each asserted to match the schema.
fn valid_lines(schema: &jsonschema::Validator, dir: &Path) -> Vec<(PathBuf, String)> {
    let lines = lines(dir);
    for (_, line) in &lines {
        assert_valid_record(schema, line);
    }
    lines
}

/// The lines of every log file of `dir`, in order, with their files.
fn lines(dir: &Path) -> Vec<(PathBuf, String)> {
    segment::list(dir)
        .unwrap()
        .into_iter()
        .flat_map(|(_, path)| {
            let text = fs::read_to_string(&path).unwrap();
            text.lines()
                .map(|line| (path.clone(), line.to_owned()))
                .collect::<Vec<_>>()
        })
        .collect()
}

async fn write_all(log: &DecisionLog, entries: Vec<Entry>) -> Vec<Appended> {
    let mut out = Vec::new();
    for entry in entries {
        out.push(log.append(entry).await.unwrap());
    }
    out
}

#[tokio::test]
async fn r29_records_match_the_json_schema() {
    let dir = tempfile::tempdir().unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    write_all(&log, every_kind()).await;
    log.close().await.unwrap();

    let validator = schema();
    let lines = valid_lines(&validator, dir.path());
    assert_eq!(lines.len(), 7);
    // A record the schema must refuse: a field the format does not have.
    let mut extra: Value = serde_json::from_str(&lines[0].1).unwrap();
    extra["unknown"] = json!(1);
    assert!(!validator.is_valid(&extra));
    let mut extra: Value = serde_json::from_str(&lines[0].1).unwrap();
    extra["batch"]["calls"][0]["arguments"] = json!("raw text");
    assert!(!validator.is_valid(&extra));
}

#[tokio::test]
async fn r29_masked_values_never_reach_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    let appended = write_all(&log, every_kind()).await;
    log.close().await.unwrap();

    let mut bytes = Vec::new();
    for (_, path) in segment::list(dir.path()).unwrap() {
        bytes.extend(fs::read(path).unwrap());
    }
    let text = String::from_utf8(bytes).unwrap();
    for secret in SECRETS {
        assert!(!text.contains(secret), "{secret} was written");
    }
    // decided: metadata api_key, Authorization, password (twice: as sent
    // and as rewritten), svc.api_key; refused: metadata api_key and the
    // unparseable arguments; register and reload: the spec's token.
    let counts: Vec<u32> = appended.iter().map(|a| a.masked).collect();
    assert_eq!(counts, [6, 2, 1, 1, 1, 0, 1]);
    let report = verify(dir.path()).unwrap();
    assert_eq!(report.masked_records, 6);
    assert!(text.contains(MASKED) && text.contains(OMITTED));
    // What is not sensitive is kept.
    assert!(text.contains("select 1") && text.contains("https://y") && text.contains("acme"));
}

/// Writes `n` decided records to a fresh log with files of at most
/// `max_file_bytes`.
async fn log_of(n: usize, max_file_bytes: u64) -> (tempfile::TempDir, Vec<Appended>) {
    let (dir, log) = fresh_log(|c| c.max_file_bytes = max_file_bytes).await;
    let appended = write_all(&log, (0..n).map(|i| decided(&format!("b{i}"))).collect()).await;
    log.close().await.unwrap();
    (dir, appended)
}

#[tokio::test]
async fn r29_the_chain_holds_across_rotation() {
    let (dir, appended) = log_of(12, 5000).await;
    let files = segment::list(dir.path()).unwrap();
    assert!(files.len() >= 3, "{files:?}");
    let lines = lines(dir.path());
    assert_eq!(lines.len(), 12);
    for (i, (path, line)) in lines.iter().enumerate() {
        let record: LogRecord = serde_json::from_str(line).unwrap();
        assert_eq!(record.seq, i as u64);
        assert_eq!(record.id, appended[i].id);
        let expected = if i == 0 {
            GENESIS.to_owned()
        } else {
            chain::sha256_hex(lines[i - 1].1.as_bytes())
        };
        assert_eq!(record.prev, expected, "record {i}");
        assert!(fs::metadata(path).unwrap().len() <= 5000);
    }
    // Each file is named for its first record.
    for (seq, path) in &files {
        let first = fs::read_to_string(path).unwrap();
        let record: LogRecord = serde_json::from_str(first.lines().next().unwrap()).unwrap();
        assert_eq!(record.seq, *seq);
    }
    // Ids sort as the records were written.
    let mut ids: Vec<&String> = appended.iter().map(|a| &a.id).collect();
    ids.sort();
    assert_eq!(ids, appended.iter().map(|a| &a.id).collect::<Vec<_>>());

    let report = verify(dir.path()).unwrap();
    assert_eq!(report.records, 12);
    assert_eq!(report.files.len(), files.len());
    assert_eq!(report.last.as_ref().unwrap().seq, 11);
    assert_eq!(report.last.unwrap().id, appended[11].id);
}

/// Rewrites the file holding log line `index` (0-based over the whole log)
/// with `edit` applied to its lines.
fn edit_file(dir: &Path, index: usize, edit: impl FnOnce(&mut Vec<String>, usize)) -> PathBuf {
    let all = lines(dir);
    let path = all[index].0.clone();
    let offset = all.iter().position(|(p, _)| *p == path).unwrap();
    let mut file_lines: Vec<String> = all
        .iter()
        .filter(|(p, _)| *p == path)
        .map(|(_, l)| l.clone())
        .collect();
    edit(&mut file_lines, index - offset);
    let mut text = file_lines.join("\n");
    if !file_lines.is_empty() {
        text.push('\n');
    }
    fs::write(&path, text).unwrap();
    path
}

fn first_bad(dir: &Path) -> BadRecord {
    match verify(dir) {
        Err(VerifyError::Bad(bad)) => bad,
        other => panic!("expected a bad record, got {other:?}"),
    }
}

fn line_in_file(dir: &Path, index: usize) -> u64 {
    let all = lines(dir);
    let path = &all[index].0;
    (all[..=index].iter().filter(|(p, _)| p == path).count()) as u64
}

#[tokio::test]
async fn r29_verify_names_an_edited_record() {
    for index in [0, 5, 11] {
        let (dir, appended) = log_of(12, 5000).await;
        let line = line_in_file(dir.path(), index);
        let path = edit_file(dir.path(), index, |lines, at| {
            lines[at] = lines[at].replacen("select 1", "select 2", 1);
        });
        let bad = first_bad(dir.path());
        assert_eq!((bad.file.clone(), bad.line), (path, line), "{bad}");
        assert_eq!(bad.id.as_deref(), Some(appended[index].id.as_str()));
        assert!(bad.reason.contains("edited"), "{bad}");
    }
}

#[tokio::test]
async fn r29_verify_names_the_record_after_a_removed_one() {
    let (dir, appended) = log_of(12, 5000).await;
    let line = line_in_file(dir.path(), 4);
    let path = edit_file(dir.path(), 4, |lines, at| {
        lines.remove(at);
    });
    let bad = first_bad(dir.path());
    // The record that now stands where the removed one was (or the first
    // of the next file, if it was a file's last).
    let expected_line = if fs::read_to_string(&path).unwrap().lines().count() >= line as usize {
        (path, line)
    } else {
        (
            segment::list(dir.path())
                .unwrap()
                .into_iter()
                .find(|(_, p)| *p > path)
                .unwrap()
                .1,
            1,
        )
    };
    assert_eq!((bad.file.clone(), bad.line), expected_line, "{bad}");
    assert_eq!(bad.id.as_deref(), Some(appended[5].id.as_str()), "{bad}");
    assert!(bad.reason.contains("removed"), "{bad}");
}

#[tokio::test]
async fn r29_verify_names_the_first_of_two_swapped_records() {
    // One file, so that the two lines are in the same file.
    let (dir, appended) = log_of(6, 1 << 20).await;
    let path = edit_file(dir.path(), 2, |lines, at| lines.swap(at, at + 1));
    let bad = first_bad(dir.path());
    assert_eq!((bad.file, bad.line), (path, 3));
    assert_eq!(bad.id.as_deref(), Some(appended[3].id.as_str()));
    assert!(bad.reason.contains("order"), "{}", bad.reason);
}

#[tokio::test]
async fn r29_verify_names_a_truncated_last_record() {
    let (dir, appended) = log_of(3, 1 << 20).await;
    let (_, path) = segment::list(dir.path()).unwrap().pop().unwrap();
    let len = fs::metadata(&path).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 40)
        .unwrap();
    let bad = first_bad(dir.path());
    assert_eq!((bad.file, bad.line), (path, 3));
    assert_eq!(
        bad.id.as_deref(),
        None,
        "the id cannot be read from a cut line"
    );
    assert!(bad.reason.contains("incomplete"), "{}", bad.reason);
    let _ = appended;
}

#[tokio::test]
async fn r29_verify_notices_removed_files() {
    let (dir, _) = log_of(12, 5000).await;
    let files = segment::list(dir.path()).unwrap();
    assert!(files.len() >= 3);
    // A file from the middle: the next one's first record is named.
    fs::remove_file(&files[1].1).unwrap();
    let bad = first_bad(dir.path());
    assert_eq!((bad.file, bad.line), (files[2].1.clone(), 1));
    assert!(bad.reason.contains("removed"), "{}", bad.reason);
    // The first file: the log no longer starts at the genesis record.
    let (dir, _) = log_of(12, 5000).await;
    let files = segment::list(dir.path()).unwrap();
    fs::remove_file(&files[0].1).unwrap();
    let bad = first_bad(dir.path());
    assert_eq!((bad.file, bad.line), (files[1].1.clone(), 1));
    // One file of a rotated log verifies on its own.
    let report = verify(&files[1].1).unwrap();
    assert_eq!(
        report.records as usize,
        lines(dir.path())
            .iter()
            .filter(|(p, _)| *p == files[1].1)
            .count()
    );
}

#[tokio::test]
async fn r29_a_restarted_log_continues_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LogConfig {
        max_file_bytes: 5000,
        ..config(dir.path())
    };
    let mut ids = Vec::new();
    for round in 0..3 {
        let log = DecisionLog::open(cfg.clone()).await.unwrap();
        for i in 0..4 {
            let appended = log.append(decided(&format!("r{round}-{i}"))).await.unwrap();
            assert_eq!(appended.seq, ids.len() as u64);
            ids.push(appended.id);
        }
        log.close().await.unwrap();
    }
    let report = verify(dir.path()).unwrap();
    assert_eq!(report.records, 12);
    assert_eq!(report.last.unwrap().id, ids[11]);
}

#[tokio::test]
async fn r29_one_writer_per_directory() {
    let dir = tempfile::tempdir().unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    let err = DecisionLog::open(config(dir.path())).await.unwrap_err();
    assert!(err.to_string().contains("already written"), "{err}");
    log.append(zero_calls("b")).await.unwrap();
    // Dropping the last handle syncs, stops the writer and frees the
    // directory.
    drop(log);
    let deadline = Instant::now() + Duration::from_secs(5);
    let log = loop {
        match DecisionLog::open(config(dir.path())).await {
            Ok(log) => break log,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(err) => panic!("{err}"),
        }
    };
    assert_eq!(log.append(zero_calls("b")).await.unwrap().seq, 1);
}

#[tokio::test]
async fn r29_a_damaged_tail_is_not_resumed() {
    let (dir, _) = log_of(3, 1 << 20).await;
    let (_, path) = segment::list(dir.path()).unwrap().pop().unwrap();
    let intact = fs::read_to_string(&path).unwrap();
    let end_of_second = intact.match_indices('\n').nth(1).unwrap().0 as u64 + 1;
    // A write cut short: the last line has no newline.
    fs::write(&path, &intact[..intact.len() - 10]).unwrap();
    match DecisionLog::open(config(dir.path())).await {
        Err(LogError::CorruptTail {
            path: p,
            line,
            offset,
            ..
        }) => {
            assert_eq!((p, line, offset), (path.clone(), 3, end_of_second));
        }
        other => panic!("expected CorruptTail, got {other:?}"),
    }
    // An edited last record.
    fs::write(
        &path,
        intact.replacen(r#""batch_id":"b2""#, r#""batch_id":"b9""#, 1),
    )
    .unwrap();
    assert!(matches!(
        DecisionLog::open(config(dir.path())).await,
        Err(LogError::CorruptTail { line: 3, .. })
    ));
    // Cut at the offset the error gives, the log resumes and verifies.
    fs::write(&path, &intact[..end_of_second as usize]).unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    assert_eq!(log.append(zero_calls("b2-again")).await.unwrap().seq, 2);
    log.close().await.unwrap();
    assert_eq!(verify(dir.path()).unwrap().records, 3);
}

#[tokio::test]
async fn r29_a_crash_right_after_rotation_resumes_in_the_empty_file() {
    let (dir, _) = log_of(2, 1 << 20).await;
    fs::write(dir.path().join(segment::file_name(2)), "").unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    assert_eq!(log.append(zero_calls("b")).await.unwrap().seq, 2);
    log.close().await.unwrap();
    let report = verify(dir.path()).unwrap();
    assert_eq!((report.records, report.files.len()), (3, 2));
    // An empty file named for another record is refused.
    fs::write(dir.path().join(segment::file_name(9)), "").unwrap();
    assert!(matches!(
        DecisionLog::open(config(dir.path())).await,
        Err(LogError::CorruptTail { .. })
    ));
}

/// Appends `n` records from `n` concurrent tasks; all succeed, each once.
async fn concurrent(log: &DecisionLog, n: usize) -> Vec<Appended> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let log = log.clone();
            tokio::spawn(async move { log.append(decided(&format!("c{i}"))).await })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap().unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r29_both_durability_modes_write_every_record_once() {
    for durability in [
        Durability::EveryRecord,
        Durability::Interval(Duration::from_millis(5)),
    ] {
        let (dir, log) = fresh_log(|c| {
            c.durability = durability;
            c.max_file_bytes = 64 * 1024;
        })
        .await;
        let mut appended = concurrent(&log, 200).await;
        appended.sort_by_key(|a| a.seq);
        assert_eq!(
            appended.iter().map(|a| a.seq).collect::<Vec<_>>(),
            (0..200).collect::<Vec<_>>(),
            "{durability:?}"
        );
        // With an interval, the timer syncs without being asked.
        tokio::time::sleep(Duration::from_millis(20)).await;
        log.sync().await.unwrap();
        let report = verify(dir.path()).unwrap();
        assert_eq!(report.records, 200, "{durability:?}");
        log.close().await.unwrap();
        assert!(matches!(
            log.append(zero_calls("late")).await,
            Err(LogError::Closed)
        ));
    }
}

#[tokio::test]
async fn r29_a_log_path_that_is_a_file_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    fs::write(&file, "x").unwrap();
    let err = DecisionLog::open(config(&file)).await.unwrap_err();
    assert!(matches!(err, LogError::Config(_)), "{err}");
    assert!(err.to_string().contains("not a directory"), "{err}");
}

/// A log in `dir` that starts a new file for each record, its first
/// record (`b0`) written.
async fn one_record_per_file(dir: &Path) -> DecisionLog {
    let log = DecisionLog::open(LogConfig {
        max_file_bytes: 1,
        ..config(dir)
    })
    .await
    .unwrap();
    log.append(zero_calls("b0")).await.unwrap();
    log
}

#[tokio::test]
async fn r29_a_rotation_that_cannot_create_its_file_fails_the_record_then_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let log = one_record_per_file(dir.path()).await;
    // The next file's name is taken by a directory.
    let blocker = dir.path().join(segment::file_name(1));
    fs::create_dir(&blocker).unwrap();
    let err = log.append(zero_calls("b1")).await.unwrap_err();
    assert!(matches!(err, LogError::Io { op: "create", .. }), "{err}");
    // Once the way is clear, the chain goes on where it stopped.
    fs::remove_dir(&blocker).unwrap();
    assert_eq!(log.append(zero_calls("b1")).await.unwrap().seq, 1);
    log.close().await.unwrap();
    assert_eq!(verify(dir.path()).unwrap().records, 2);
}

#[tokio::test]
async fn r29_a_directory_that_goes_away_fails_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("log");
    let log = one_record_per_file(&logdir).await;
    fs::remove_dir_all(&logdir).unwrap();
    assert!(log.append(zero_calls("b1")).await.is_err());
}

#[cfg(unix)]
#[tokio::test]
async fn r29_a_read_only_directory_fails_the_record() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        eprintln!("skipped: root writes to read-only directories");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = one_record_per_file(dir.path()).await;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o555)).unwrap();
    let result = log.append(zero_calls("b1")).await;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    assert!(matches!(result, Err(LogError::Io { .. })), "{result:?}");
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn r29_a_failed_write_is_an_error_and_stops_the_log() {
    // The log's file is /dev/full: every write fails with ENOSPC, and it
    // cannot be cut back, so the log is poisoned.
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("/dev/full", dir.path().join(segment::file_name(0))).unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    let err = log.append(zero_calls("b0")).await.unwrap_err();
    assert!(matches!(err, LogError::Io { op: "write", .. }), "{err}");
    let err = log.append(zero_calls("b1")).await.unwrap_err();
    assert!(matches!(err, LogError::Poisoned { .. }), "{err}");
}

/// Not a check: the cost of an append with each durability, sequential
/// (one batch at a time) and concurrent (group commit). Run with
/// `cargo test -p guardmesh-server --lib decision_log::tests::measure -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn measure_append_cost() {
    let n = 500;
    for durability in [
        Durability::EveryRecord,
        Durability::Interval(Duration::from_millis(10)),
        Durability::Interval(Duration::from_millis(100)),
    ] {
        let (_dir, log) = fresh_log(|c| c.durability = durability).await;
        let bytes = serde_json::to_vec(&decided("b")).unwrap().len();
        let start = Instant::now();
        for i in 0..n {
            log.append(decided(&format!("s{i}"))).await.unwrap();
        }
        let sequential = start.elapsed() / n as u32;
        let start = Instant::now();
        concurrent(&log, n).await;
        let parallel = start.elapsed() / n as u32;
        log.close().await.unwrap();
        println!(
            "{durability:?}: ~{bytes} B records: sequential {sequential:?}/record, {n} concurrent {parallel:?}/record"
        );
    }
}

/// The summary of refusals left out and a policy guard's registration
/// (its digest and text) match the schema too.
#[tokio::test]
async fn r29_summaries_and_policy_registrations_match_the_json_schema() {
    use super::record::{PeerCount, RefusalSummaryRecord};
    let dir = tempfile::tempdir().unwrap();
    let log = DecisionLog::open(config(dir.path())).await.unwrap();
    let policy = guardmesh_proto::v1::GuardSpec {
        name: "p".into(),
        policy: "[[rule]]\nname = \"r\"\nwhen = \"true\"\naction = \"cancel\"\n".into(),
        ..Default::default()
    };
    let entries = vec![
        Entry::RefusalSummary(RefusalSummaryRecord {
            from: "2026-01-01T00:00:00Z".into(),
            to: "2026-01-01T00:00:10Z".into(),
            left_out: 3,
            left_out_bytes: 2000,
            peers: vec![PeerCount {
                peer: "127.0.0.1".into(),
                left_out: 3,
            }],
            other_peers_left_out: 0,
        }),
        Entry::ChainChange(ChainChangeRecord {
            caller: Caller::default(),
            change: ChangeKind::Register,
            guard: Some("p".into()),
            spec: Some(super::from_mesh::spec(&policy)),
            old_revision: Some(1),
            new_revision: Some(2),
            outcome: ChangeOutcome::applied(),
        }),
    ];
    write_all(&log, entries).await;
    log.close().await.unwrap();
    let validator = schema();
    let lines = valid_lines(&validator, dir.path());
    assert_eq!(lines.len(), 2);
    let change: Value = serde_json::from_str(&lines[1].1).unwrap();
    assert_eq!(
        change["spec"]["policy"]["sha256"],
        super::chain::sha256_hex(policy.policy.as_bytes())
    );
    // `"policy": true` is not the format any more.
    let mut old = change.clone();
    old["spec"]["policy"] = json!(true);
    assert!(!validator.is_valid(&old));
}
