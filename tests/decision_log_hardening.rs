//! The decision log keeps its promise (R29, R30, R20):
//!
//! * a value masked by config appears nowhere: not in any record field
//!   (guard and policy errors, skip contents, refusal messages), not in the
//!   mesh's log lines, not in exported spans or log records;
//! * the records that unauthenticated peers cause are bounded per peer and
//!   mesh-wide, and summary records count what was left out; the log
//!   directory has a budget; a full disk is survived under both
//!   `on_log_failure` settings;
//! * replay compares the call that would run, and refuses a log that does
//!   not verify;
//! * chain-change records name the policy enforced (its digest and text)
//!   and the address the mesh is bound to.

use crate::harness::*;
use guardmesh_client::verdict::rewrite_arguments;
use guardmesh_client::{Batch, Coordinator, Registration};
use guardmesh_server::decision_log::{
    DecisionLog, LogConfig, LogLimits, MeshLog, OnLogFailure, RefusalLimits, segment,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Item: masked means masked everywhere.
// ---------------------------------------------------------------------------

/// A masked number that makes CEL overflow (its error quotes the operand).
const PIN_NUMBER: &str = "9223372036854775807";
/// A masked string a policy rule echoes into its skip content.
const PIN_TEXT: &str = "7731-secret-pin";
/// A member name inside a masked value, quoted by a refusal (R20).
const PIN_KEY: &str = "SecretKeyName991";

/// The policy of the masking test: one rule fails on the masked pin (CEL
/// integer overflow), one echoes it into the content the model reads.
const PIN_POLICY: &str = concat!(
    policy_rule!(name: "pin-overflow", tools: ["unlock"], action: "cancel",
        when: r#""call.args.pin + 1 > 0""#,
        message: r#"'"no"'"#),
    policy_rule!(name: "pin-echo", tools: ["echo"], action: "steer",
        when: r#""true""#,
        message: r#"'"your pin " + call.args.pin + " is wrong"'"#),
);

/// Every text an OTLP value holds.
fn any_texts(value: &Option<AnyValue>, out: &mut Vec<String>) {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => out.push(s.clone()),
        Some(any_value::Value::ArrayValue(array)) => {
            for v in &array.values {
                any_texts(&Some(v.clone()), out);
            }
        }
        Some(any_value::Value::KvlistValue(list)) => attribute_texts(&list.values, out),
        Some(any_value::Value::IntValue(i)) => out.push(i.to_string()),
        Some(any_value::Value::BytesValue(b)) => out.push(String::from_utf8_lossy(b).into()),
        _ => {}
    }
}

fn attribute_texts(attributes: &[KeyValue], out: &mut Vec<String>) {
    for a in attributes {
        out.push(a.key.clone());
        any_texts(&a.value, out);
    }
}

/// R29: a value masked by config reaches neither the records (guard and
/// policy error texts, skip contents, refusal messages), nor the mesh's
/// log lines on stderr, nor the spans and log records it exports, whichever
/// free-text path it takes: a CEL error quoting the masked operand, a rule
/// echoing it into its content, a refusal quoting a member name inside it.
#[tokio::test]
async fn r29_a_masked_value_reaches_no_record_log_line_span_or_exported_log() {
    let (collector, endpoint) = Collector::serve().await;

    let dir = folder("hardening-mask");
    let log = dir.join("log");
    std::fs::write(dir.join("pins.toml"), PIN_POLICY).unwrap();
    let config = log_config_file(
        &dir,
        &log,
        "mask = [\"pin\"]\notlp = true\n\n[[guard]]\nname = \"pins\"\npolicy = \"pins.toml\"\n",
    );
    let stderr_path = dir.join("stderr.log");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let _serve = KillOnDrop(
        serve_command(&config, port)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env("OTEL_BLRP_SCHEDULE_DELAY", "100")
            .env("RUST_LOG", "debug")
            .env_remove("OTEL_TRACES_EXPORTER")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap(),
    );
    let coordinator = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(c) = Coordinator::connect(url.clone()).await {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the mesh starts");

    // CEL error (the guard fails on the masked operand) and skip content
    // (a rule echoes it).
    let decision = coordinator
        .evaluate_once(
            "s",
            Batch::new(0)
                .call("c1", "unlock", format!(r#"{{"pin": {PIN_NUMBER}}}"#))
                .call("c2", "echo", format!(r#"{{"pin": "{PIN_TEXT}"}}"#)),
        )
        .await
        .unwrap();
    assert!(!decision.call("c1").unwrap().proceeds(), "{decision:?}");
    assert!(!decision.call("c2").unwrap().proceeds(), "{decision:?}");
    // Refusal message (R20: a duplicate member name inside the masked pin).
    let err = coordinator
        .evaluate_once(
            "r",
            Batch::new(0).call(
                "c1",
                "unlock",
                format!(r#"{{"pin": {{"{PIN_KEY}": 1, "{PIN_KEY}": 2}}}}"#),
            ),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    assert!(
        err.to_string().contains(PIN_KEY),
        "the caller is told: {err}"
    );

    // Bounded wait: the guard's failure span and three records exported.
    let exported = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let failed = collector
                .spans
                .lock()
                .unwrap()
                .iter()
                .any(|span| span.name.starts_with("apply_guardrail"));
            let logs = collector.logs.lock().unwrap().len();
            if failed && logs >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        exported.is_ok(),
        "spans and log records are exported: {} spans, {} logs",
        collector.spans.lock().unwrap().len(),
        collector.logs.lock().unwrap().len()
    );
    drop(_serve);

    let records_text = records(&log)
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    let mut span_texts = Vec::new();
    for span in collector.spans.lock().unwrap().iter() {
        span_texts.push(span.name.clone());
        attribute_texts(&span.attributes, &mut span_texts);
        for event in &span.events {
            span_texts.push(event.name.clone());
            attribute_texts(&event.attributes, &mut span_texts);
        }
        if let Some(status) = &span.status {
            span_texts.push(status.message.clone());
        }
    }
    let span_texts = span_texts.join("\n");
    let mut log_texts = Vec::new();
    for record in collector.logs.lock().unwrap().iter() {
        any_texts(&record.body, &mut log_texts);
        attribute_texts(&record.attributes, &mut log_texts);
    }
    let log_texts = log_texts.join("\n");

    // Each path was taken: the texts are there, the values are not.
    assert!(
        records_text.contains("verflow"),
        "the policy error is recorded: {records_text}"
    );
    assert!(records_text.contains("your pin"), "{records_text}");
    assert!(
        records_text.contains("duplicate member name"),
        "{records_text}"
    );
    assert!(stderr.contains("guard failed"), "{stderr}");
    assert!(stderr.contains("batch refused"), "{stderr}");
    assert!(
        span_texts.contains("verflow"),
        "the policy error is on the guardrail span: {span_texts}"
    );
    for secret in [PIN_NUMBER, PIN_TEXT, PIN_KEY] {
        assert!(
            !records_text.contains(secret),
            "{secret} in the records:\n{records_text}"
        );
        assert!(!stderr.contains(secret), "{secret} on stderr:\n{stderr}");
        assert!(
            !span_texts.contains(secret),
            "{secret} in the spans:\n{span_texts}"
        );
        assert!(
            !log_texts.contains(secret),
            "{secret} in the exported logs:\n{log_texts}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------
// Item: the records of unauthenticated peers are bounded.
// ---------------------------------------------------------------------------

/// A mesh on TLS with token principals `agent` (evaluate) and `ops`
/// (admin), its log in `dir` with `limits`.
async fn secured(
    pki: &TestPki,
    dir: &Path,
    on_failure: OnLogFailure,
    limits: LogLimits,
) -> (TestMesh, String) {
    let (mesh, url) = TestMesh::with_tokens(pki, &[AGENT, OPS], "").await;
    let log = DecisionLog::open(LogConfig::new(dir, "test"))
        .await
        .unwrap();
    mesh.mesh
        .attach_decision_log(
            MeshLog::new(log, on_failure, mesh.mesh.metrics.clone()).with_limits(limits),
        )
        .unwrap();
    (mesh, url)
}

/// Sends batches without credentials from `clients` concurrent clients for
/// `length`; returns how many were refused UNAUTHENTICATED.
async fn flood(pki: &TestPki, url: &str, clients: usize, length: Duration) -> u64 {
    let until = Instant::now() + length;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let connection = pki.connection(None, None);
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let coordinator = Coordinator::connect_with(url, &connection).await.unwrap();
            let mut refused = 0u64;
            while Instant::now() < until {
                let err = coordinator
                    .evaluate_once("s", Batch::new(0).call("c1", "t", "{}"))
                    .await
                    .unwrap_err();
                assert_eq!(err.code(), Some(tonic::Code::Unauthenticated), "{err}");
                refused += 1;
            }
            refused
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    total
}

fn dir_bytes(dir: &Path) -> u64 {
    segment::list(dir)
        .unwrap()
        .iter()
        .map(|(_, f)| std::fs::metadata(f).unwrap().len())
        .sum()
}

/// Refusal records in `all`, and what the summaries say was left out.
fn refusals_and_left_out(all: &[Value]) -> (u64, u64) {
    let refusals = all
        .iter()
        .filter(|r| r["kind"] != "refusal_summary" && r["outcome"]["status"] == "refused")
        .count() as u64;
    let left_out = all
        .iter()
        .filter(|r| r["kind"] == "refusal_summary")
        .map(|r| r["left_out"].as_u64().unwrap())
        .sum();
    (refusals, left_out)
}

/// R29: one client without credentials, flooding for 2 s, grows the log
/// by at most `records_per_peer` records per interval (plus one summary
/// record per interval), not by one fsynced record per request; the
/// summary records count every refusal left out, so that records and
/// summaries together account for every refused request.
#[tokio::test]
async fn r29_an_unauthenticated_flood_grows_the_log_by_a_bounded_amount_with_summaries() {
    let dir = folder("hardening-flood");
    let log = dir.join("log");
    let pki = TestPki::new();
    let interval = Duration::from_millis(500);
    let limits = LogLimits {
        refusals: RefusalLimits {
            interval,
            records_per_peer: 10,
            bytes_per_peer: 1 << 20,
            records: 100,
            bytes: 1 << 20,
        },
        max_dir_bytes: None,
    };
    let (mesh, url) = secured(&pki, &log, OnLogFailure::Refuse, limits).await;
    let length = Duration::from_secs(2);
    let started = Instant::now();
    let refused = flood(&pki, &url, 1, length).await;
    let elapsed = started.elapsed();
    assert!(refused > 50, "the flood ran: {refused} requests");

    // The last interval's summary is written once it ends (bounded wait).
    let counted = eventually_within(250, || {
        let (refusals, left_out) = refusals_and_left_out(&records(&log));
        refusals + left_out == refused
    })
    .await;
    let all = records(&log);
    let (refusals, left_out) = refusals_and_left_out(&all);
    assert!(
        counted,
        "records ({refusals}) and summaries ({left_out}) count every refusal ({refused})"
    );
    // Stated bound: 10 records per started interval, one summary each.
    let intervals = (elapsed.as_millis() / interval.as_millis()) as u64 + 2;
    assert!(
        refusals <= 10 * intervals,
        "{refusals} refusal records in {intervals} intervals"
    );
    let summaries: Vec<_> = all
        .iter()
        .filter(|r| r["kind"] == "refusal_summary")
        .collect();
    assert!(!summaries.is_empty());
    assert!(summaries.len() as u64 <= intervals, "{summaries:?}");
    let bytes = dir_bytes(&log);
    assert!(bytes < 64 * 1024, "the log grew by {bytes} bytes");
    for summary in &summaries {
        let peers = summary["peers"].as_array().unwrap();
        assert_eq!(peers.len(), 1, "{summary}");
        assert!(
            peers[0]["peer"].as_str().unwrap().starts_with("127.0.0.1"),
            "{summary}"
        );
        assert!(summary["left_out_bytes"].as_u64().unwrap() > 0);
    }
    guardmesh_server::decision_log::verify(&log).unwrap();
    eprintln!(
        "flood: {refused} refused in {elapsed:?}; {refusals} records, {} summaries, {bytes} bytes",
        summaries.len()
    );
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tmpfs of `size` mounted on `dir` by the test, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!(
                "skipped: cannot mount a tmpfs here ({}); run as root to test a full disk",
                text(&out.stderr).trim()
            );
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

async fn agent_batch(pki: &TestPki, url: &str, id: &str) -> Result<(), tonic::Status> {
    let coordinator = pki.coordinator(url, "agent-token").await;
    coordinator
        .evaluate_once(id, Batch::new(0).call("c1", "t", "{}"))
        .await
        .map(|_| ())
        .map_err(|e| match e {
            guardmesh_client::ClientError::Status(status) => status,
            other => tonic::Status::unknown(other.to_string()),
        })
}

/// R29: on a small disk (a 64 KiB tmpfs), a flood without credentials
/// does not fill it, so the batches of authenticated callers are still
/// recorded; once the disk is full, `refuse` answers UNAVAILABLE naming the
/// log and `answer` answers and counts the loss; when space is freed the
/// log goes on, and it verifies throughout.
#[tokio::test]
async fn r29_a_full_disk_under_refuse_and_answer() {
    for on_failure in [OnLogFailure::Refuse, OnLogFailure::Answer] {
        let dir = folder(&format!("hardening-full-{on_failure:?}"));
        let Some(tmpfs) = Tmpfs::mount(&dir.join("disk"), "64k") else {
            return;
        };
        let log = dir.join("disk").join("log");
        let pki = TestPki::new();
        let (mesh, url) = secured(&pki, &log, on_failure, LogLimits::default()).await;

        let refused = flood(&pki, &url, 2, Duration::from_millis(1500)).await;
        assert!(refused > 50, "the flood ran: {refused}");
        agent_batch(&pki, &url, "after-flood")
            .await
            .expect("an authenticated batch is answered after the flood");
        let found = records(&log)
            .into_iter()
            .filter(|r| r["batch"]["batch_id"] == "after-flood/0")
            .count();
        assert_eq!(found, 1, "{on_failure:?}: recorded after the flood");

        // Fill the disk.
        let filler = dir.join("disk").join("filler");
        let _ = std::process::Command::new("dd")
            .args(["if=/dev/zero", "bs=4k", "count=1000"])
            .arg(format!("of={}", filler.display()))
            .output()
            .unwrap();
        // (A write within the file's last page may still fit: a few
        // batches, until one needs a new page.)
        let failures = || {
            metric(
                &mesh,
                "guardmesh_decision_log_failures_total{kind=\"decision\"}",
            )
        };
        let mut result = Ok(());
        for i in 0..40 {
            result = agent_batch(&pki, &url, &format!("disk-full-{i}")).await;
            if result.is_err() || failures() >= 1.0 {
                break;
            }
        }
        match on_failure {
            OnLogFailure::Refuse => {
                let status = result.unwrap_err();
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert!(status.message().contains("recorded"), "{status:?}");
            }
            OnLogFailure::Answer => {
                result.expect("answered");
                assert!(failures() >= 1.0, "the loss is counted");
            }
        }
        // Space again: the log goes on, and verifies.
        std::fs::remove_file(&filler).unwrap();
        agent_batch(&pki, &url, "space-again").await.unwrap();
        assert!(
            records(&log)
                .iter()
                .any(|r| r["batch"]["batch_id"] == "space-again/0"),
            "{on_failure:?}"
        );
        guardmesh_server::decision_log::verify(&log).unwrap();
        drop(mesh);
        drop(tmpfs);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// R29: with `max_dir_bytes`, refusal records stop when the log is nine
/// tenths of its budget (counted in summaries), and when the budget is
/// reached `refuse` answers UNAVAILABLE naming the budget and `answer`
/// answers and counts the loss; the log stays within its budget.
#[tokio::test]
async fn r29_the_log_directory_budget_stops_refusals_first_then_follows_on_log_failure() {
    for on_failure in [OnLogFailure::Refuse, OnLogFailure::Answer] {
        let dir = folder(&format!("hardening-budget-{on_failure:?}"));
        let log = dir.join("log");
        let pki = TestPki::new();
        let budget = 24 * 1024;
        let limits = LogLimits {
            max_dir_bytes: Some(budget),
            ..LogLimits::default()
        };
        let (mesh, url) = secured(&pki, &log, on_failure, limits).await;
        let big = json!({ "text": "x".repeat(1500) }).to_string();
        let coordinator = pki.coordinator(&url, "agent-token").await;
        let mut stopped = None;
        for i in 0..40 {
            let result = coordinator
                .evaluate_once(&format!("b{i}"), Batch::new(0).call("c1", "t", big.clone()))
                .await;
            if let Err(err) = result {
                stopped = Some(err);
                break;
            }
            if on_failure == OnLogFailure::Answer
                && metric(
                    &mesh,
                    "guardmesh_decision_log_failures_total{kind=\"decision\"}",
                ) >= 1.0
            {
                break;
            }
        }
        match on_failure {
            OnLogFailure::Refuse => {
                let err = stopped.expect("refused at the budget");
                assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
                assert!(err.to_string().contains("max_dir_bytes"), "{err}");
            }
            OnLogFailure::Answer => {
                assert!(stopped.is_none(), "{stopped:?}");
                assert!(
                    metric(
                        &mesh,
                        "guardmesh_decision_log_failures_total{kind=\"decision\"}"
                    ) >= 1.0
                );
            }
        }
        assert!(dir_bytes(&log) <= budget, "{} > {budget}", dir_bytes(&log));
        // Past nine tenths, a refusal is no longer written: it is counted.
        let before = records(&log).len();
        let refused = flood(&pki, &url, 1, Duration::from_millis(200)).await;
        assert!(refused > 0);
        assert_eq!(records(&log).len(), before, "no refusal record written");
        assert!(dir_bytes(&log) <= budget);
        drop(mesh);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

// ---------------------------------------------------------------------------
// Item: replay compares the call that would run, and verifies first.
// ---------------------------------------------------------------------------

/// A mesh without guards, its log in `log`, that answered `n` SELECTs.
async fn recorded_selects(log: &Path, n: usize) -> TestMesh {
    let mesh = TestMesh::start().await;
    mesh.attach_log(LogConfig::new(log, "test"), OnLogFailure::Refuse)
        .await;
    let coordinator = mesh.coordinator().await;
    for i in 0..n {
        coordinator
            .evaluate_once(
                &format!("q{i}"),
                Batch::new(0).call("c1", "sql", sql(&format!("SELECT * FROM t{i}"))),
            )
            .await
            .unwrap();
    }
    mesh
}

/// R30: a candidate mutate guard that rewrites every recorded SELECT
/// changes no action and no deciding guard, but it changes the call that
/// would run: each of the 30 calls is reported, with the recorded and the
/// new final call.
#[tokio::test]
async fn r30_replay_reports_every_call_a_candidate_mutate_guard_would_rewrite() {
    let dir = folder("hardening-replay-rewrite");
    let log = dir.join("log");
    let mesh = recorded_selects(&log, 30).await;
    let limit = call_guard(Duration::ZERO, |c| {
        let mut a: Value = serde_json::from_str(&c.arguments).unwrap();
        let sql = format!("{} LIMIT 10", a["sql"].as_str().unwrap());
        a["sql"] = json!(sql);
        Some(rewrite_arguments(&c.call_id, &a))
    })
    .await;
    let candidate = dir.join("candidate.toml");
    std::fs::write(
        &candidate,
        format!(
            "[[guard]]\nname = \"limit\"\nendpoint = {:?}\nrole = \"mutate\"\ntools = [\"sql\"]\n\
             grant = {{ tools = [\"sql\"] }}\n",
            limit.url
        ),
    )
    .unwrap();
    let out =
        guardmesh_off_thread(["replay", path(&log), "--config", path(&candidate), "--json"]).await;
    assert_exit_code(&out, 1);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let differences = report["differences"].as_array().unwrap();
    assert_eq!(differences.len(), 30, "{report}");
    for (i, d) in differences.iter().enumerate() {
        assert_eq!(d["recorded"]["action"], "proceed", "{d}");
        assert_eq!(d["new"]["action"], "proceed", "{d}");
        assert_eq!(
            d["recorded"]["call"]["arguments"]["sql"],
            format!("SELECT * FROM t{i}"),
            "{d}"
        );
        assert_eq!(
            d["new"]["call"]["arguments"]["sql"],
            format!("SELECT * FROM t{i} LIMIT 10"),
            "{d}"
        );
        assert_eq!(d["new"]["call"]["tool"], "sql");
    }
    // The table says what changed.
    let out = guardmesh_off_thread(["replay", path(&log), "--config", path(&candidate)]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains("30 calls differ"),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stdout).contains("LIMIT 10"),
        "{}",
        text(&out.stdout)
    );
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

/// R30: replay replays only a log that verifies: an edited record stops
/// it before anything is judged (exit 2), naming the record.
#[tokio::test]
async fn r30_replay_refuses_a_log_that_does_not_verify() {
    let dir = folder("hardening-replay-broken");
    let log = dir.join("log");
    let mesh = recorded_selects(&log, 3).await;
    mesh.mesh
        .decision_log()
        .unwrap()
        .log()
        .close()
        .await
        .unwrap();
    let (_, file) = segment::list(&log).unwrap().remove(0);
    let content = std::fs::read_to_string(&file).unwrap();
    let edited = content.replacen("SELECT * FROM t1", "SELECT * FROM t9", 1);
    assert_ne!(edited, content);
    std::fs::write(&file, edited).unwrap();
    let candidate = dir.join("empty.toml");
    std::fs::write(&candidate, "").unwrap();
    let out = guardmesh_off_thread(["replay", path(&log), "--config", path(&candidate)]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("does not verify"), "{stderr}");
    assert!(stderr.contains(":2:"), "names the record's line: {stderr}");
    assert!(text(&out.stdout).is_empty(), "{}", text(&out.stdout));
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------
// Item: chain-change records name what was enforced.
// ---------------------------------------------------------------------------

/// R29: the record of a policy guard's registration carries the policy's
/// SHA-256 and its text, so that the log says which rules were enforced.
#[tokio::test]
async fn r29_a_policy_registration_record_names_its_digest_and_text() {
    let dir = folder("hardening-policy-digest");
    let log = dir.join("log");
    let mesh = TestMesh::start().await;
    mesh.attach_log(LogConfig::new(&log, "test"), OnLogFailure::Answer)
        .await;
    mesh.register(Registration::policy("policy", LOG_POLICY))
        .await;
    let all = records(&log);
    assert_eq!(all.len(), 1, "{all:?}");
    let policy = &all[0]["spec"]["policy"];
    assert_eq!(
        policy["sha256"],
        guardmesh_server::decision_log::chain::sha256_hex(LOG_POLICY.as_bytes()),
        "{policy}"
    );
    assert_eq!(policy["source"], LOG_POLICY, "{policy}");
    // A remote guard has none.
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("remote", &guard.url))
        .await;
    let all = records(&log);
    assert!(all[1]["spec"]["policy"].is_null(), "{}", all[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// R29: `serve --listen 127.0.0.1:0` records the address it is bound to
/// as the mesh instance, not the port-0 address it was asked for.
#[tokio::test]
async fn r29_records_carry_the_bound_listen_address() {
    let dir = folder("hardening-bound");
    let log = dir.join("log");
    std::fs::write(dir.join("policy.toml"), LOG_POLICY).unwrap();
    let config = log_config_file(
        &dir,
        &log,
        "\n[[guard]]\nname = \"policy\"\npolicy = \"policy.toml\"\n",
    );
    let _serve = KillOnDrop(
        serve_command(&config, 0)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let written = eventually_within(500, || {
        segment::list(&log).is_ok_and(|files| !files.is_empty()) && !records(&log).is_empty()
    })
    .await;
    assert!(written, "the config's guard is recorded at start");
    let record = &records(&log)[0];
    let mesh = record["mesh"].as_str().unwrap();
    assert_ne!(mesh, "127.0.0.1:0", "{record}");
    let addr: std::net::SocketAddr = mesh.parse().unwrap();
    assert_ne!(addr.port(), 0, "{record}");
    // The address is the one that answers (once it listens: bounded).
    let answered = tokio::time::timeout(Duration::from_secs(20), async {
        while Coordinator::connect(format!("http://{addr}"))
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        answered.is_ok(),
        "the recorded address {addr} is the mesh's"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
