//! Session memory as guards see and shape it (R34): remote guards are sent
//! the memory (never a value), may opt out, and add labels with their
//! verdicts; policy rules add labels; labels are bounded, applied only from
//! guards that enforce and did not fail, and recorded. And the redaction
//! guard on calls and results (R29, R33).

use crate::harness::*;
use crate::sessions::{Down, attach_store, decision};
use guardmesh_client::proto::{GuardPhases, SessionMemory as WireMemory};
use guardmesh_client::verdict::{self, labelled};
use guardmesh_client::{Batch, Outcome, Registration};
use guardmesh_server::session::SessionKey;
use prost::Message;
use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::Duration;

const SECRET: &str = "hunter2-Sup3rS3cret-value";

async fn labels_of(mesh: &TestMesh, session: &str) -> Vec<String> {
    mesh.mesh
        .sessions()
        .read(&SessionKey::new("", session))
        .await
        .unwrap()
        .labels()
        .to_vec()
}

fn memory_of(batch: &guardmesh_client::proto::GuardBatch) -> WireMemory {
    batch
        .session
        .clone()
        .unwrap_or_else(|| panic!("batch {} carried no session memory", batch.batch_id))
}

/// R34: a remote guard is sent its batch's session memory: labels, counts
/// per tool, recent calls with a digest of their arguments; never the
/// arguments or a value of a result.
#[tokio::test]
async fn r34_remote_guard_is_sent_session_memory_never_a_value() {
    let mesh = TestMesh::start().await;
    let guard = script_guard(|b| Script {
        verdicts: b
            .calls
            .iter()
            .filter(|c| c.tool == "fs.read_file")
            .map(|c| labelled(verdict::proceed(&c.call_id), ["secret:fs"]))
            .collect(),
        ..Script::default()
    })
    .await;
    mesh.register(
        Registration::validate("watch", &guard.url)
            .reads_session_memory()
            .phases(GuardPhases::Both)
            .timeout(Duration::from_secs(5)),
    )
    .await;
    let c = mesh.coordinator().await;
    let args = format!(r#"{{"path":".env","note":"{SECRET}"}}"#);
    let d = c
        .evaluate_once("s", Batch::new(0).call("r1", "fs.read_file", &args))
        .await
        .unwrap();
    assert!(matches!(d.call("r1").unwrap().outcome, Outcome::Proceed));
    assert_eq!(d.guard("watch").unwrap().labels, ["secret:fs"]);
    // Its result, holding the secret, is read in the session.
    let result = serde_json::json!({
        "content": [{"type": "text", "text": format!("DB_PASSWORD={SECRET}")}]
    })
    .to_string();
    c.evaluate_once(
        "s",
        Batch::new(1).result("r1", "fs.read_file", "fs", &result),
    )
    .await
    .unwrap();
    c.evaluate_once("s", Batch::new(2).call("h1", "http.get", r#"{"url":"x"}"#))
        .await
        .unwrap();
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 3, "a call, a result, a call");
    // The first batch: a session with nothing yet.
    let first = memory_of(&batches[0]);
    assert!(
        first.labels.is_empty() && first.recent.is_empty(),
        "{first:?}"
    );
    assert!(first.unavailable.is_empty());
    // The last: the label, the read, counted, digested.
    let last = memory_of(&batches[2]);
    assert_eq!(last.labels, ["secret:fs"]);
    assert_eq!(last.counts.get("fs.read_file"), Some(&1));
    assert_eq!(last.calls_total, 1);
    assert_eq!(last.results_total, 1);
    assert_eq!(last.recent.len(), 1);
    let read = &last.recent[0];
    assert_eq!(
        (read.tool.as_str(), read.server.as_str()),
        ("fs.read_file", "fs")
    );
    assert_eq!(read.args_digest.len(), 32, "{read:?}");
    assert!(read.args_digest.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(read.at_ms > 0);
    // Never a value: not the arguments, not the result, in any batch's
    // memory as encoded on the wire.
    for batch in &batches {
        let bytes = memory_of(batch).encode_to_vec();
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains(SECRET), "a value in the memory: {text}");
        assert!(!text.contains(".env"), "an argument in the memory: {text}");
    }
    mesh.shutdown().await;
}

/// R34, R25: a guard that does not ask for memory (by saying nothing, the
/// default, or by saying `none`) is sent none and pays nothing for it: a
/// chain of such guards reads nothing from the store (a store that is down
/// changes nothing for it).
#[tokio::test]
async fn r34_a_guard_that_does_not_ask_is_sent_nothing_and_costs_no_read() {
    let mesh = TestMesh::start().await;
    attach_store(&mesh, Arc::new(Down));
    let silent = proceed_guard().await;
    let plain = proceed_guard().await;
    mesh.register(Registration::validate("silent", &silent.url))
        .await;
    mesh.register(Registration::validate("plain", &plain.url).without_session_memory())
        .await;
    let c = mesh.coordinator().await;
    let d = decision(&c, "s", 0, "email.send", "{}").await;
    assert!(matches!(d.call("c").unwrap().outcome, Outcome::Proceed));
    assert!(silent.guard.batches()[0].session.is_none());
    assert!(plain.guard.batches()[0].session.is_none());
    let stats = mesh.mesh.sessions().stats();
    assert_eq!(stats.reads.load(AtomicOrdering::Relaxed), 0);
    assert_eq!(stats.writes.load(AtomicOrdering::Relaxed), 0);
    // The registrations say so when listed.
    let listed = mesh.registrar().await.list().await.unwrap();
    let uses: Vec<(&str, i32)> = listed
        .guards
        .iter()
        .map(|g| (g.name.as_str(), g.session_memory))
        .collect();
    assert_eq!(
        uses,
        [
            (
                "silent",
                guardmesh_client::proto::SessionMemoryUse::Unspecified as i32
            ),
            (
                "plain",
                guardmesh_client::proto::SessionMemoryUse::None as i32
            )
        ]
    );
    mesh.shutdown().await;
}

/// R34, R13: when the memory cannot be read, a guard that wants it is told
/// why, never sent an empty session.
#[tokio::test]
async fn r34_store_down_a_guard_is_told_the_memory_is_unavailable_not_empty() {
    let mesh = TestMesh::start().await;
    attach_store(&mesh, Arc::new(Down));
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("flows", &guard.url).reads_session_memory())
        .await;
    let c = mesh.coordinator().await;
    decision(&c, "s", 0, "email.send", "{}").await;
    let memory = memory_of(&guard.guard.batches()[0]);
    assert!(
        memory.unavailable.contains("unavailable"),
        "told why: {memory:?}"
    );
    assert_eq!(
        memory,
        WireMemory {
            unavailable: memory.unavailable.clone(),
            ..WireMemory::default()
        },
        "nothing else"
    );
    mesh.shutdown().await;
}

/// R34: a label set by a remote guard's verdict is enforced by a policy
/// rule in the next batch (relaybleed.toml: no HTTP after a secret).
#[tokio::test]
async fn r34_a_label_a_guard_sets_is_enforced_by_a_rule_in_the_next_batch() {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |call| {
        (call.tool == "fs.read_file" && call.arguments.contains(".env"))
            .then(|| labelled(verdict::proceed(&call.call_id), ["secret:fs"]))
    })
    .await;
    mesh.register(Registration::validate("secrets", &guard.url))
        .await;
    let relaybleed =
        std::fs::read_to_string(repo_root().join("examples/policy/relaybleed.toml")).unwrap();
    mesh.register(Registration::policy("flows", relaybleed))
        .await;
    let c = mesh.coordinator().await;
    let get = || Batch::new(0).call("h", "http.get", r#"{"url":"https://x"}"#);
    // Before the secret, and in another session: allowed.
    let d = c.evaluate_once("s", get()).await.unwrap();
    assert!(matches!(d.call("h").unwrap().outcome, Outcome::Proceed));
    c.evaluate_once(
        "s",
        Batch::new(1).call("r", "fs.read_file", r#"{"path":".env"}"#),
    )
    .await
    .unwrap();
    let d = c.evaluate_once("s", get()).await.unwrap();
    assert!(
        matches!(&d.call("h").unwrap().outcome, Outcome::Cancel { content } if content.contains("read a secret")),
        "{:?}",
        d.call("h")
    );
    let d = c.evaluate_once("other", get()).await.unwrap();
    assert!(matches!(d.call("h").unwrap().outcome, Outcome::Proceed));
    mesh.shutdown().await;
}

/// R34: labels are bounded: outside the grammar, over-long, past 8 per
/// verdict, or on a verdict for a call the guard was not sent, they are
/// refused and counted; the verdict's outcome stands.
#[tokio::test]
async fn r34_labels_outside_the_grammar_or_bounds_are_refused_and_counted() {
    let mesh = TestMesh::start().await;
    let long = "x".repeat(129);
    let guard = script_guard(move |b| {
        let id = &b.calls[0].call_id;
        let mut many: Vec<String> = (0..10).map(|i| format!("n:{i}")).collect();
        many.push("bad label!".into());
        many.push(long.clone());
        many.push("secret:fs\u{0}".into());
        Script {
            verdicts: vec![
                labelled(verdict::cancel(id, "no"), many),
                labelled(verdict::proceed("not-sent"), ["ghost"]),
            ],
            ..Script::default()
        }
    })
    .await;
    mesh.register(Registration::validate("labeller", &guard.url))
        .await;
    let c = mesh.coordinator().await;
    let d = decision(&c, "s", 0, "email.send", "{}").await;
    assert!(matches!(
        d.call("c").unwrap().outcome,
        Outcome::Cancel { .. }
    ));
    let trace = d.guard("labeller").unwrap();
    let expected: Vec<String> = (0..8).map(|i| format!("n:{i}")).collect();
    assert_eq!(trace.labels, expected);
    // 2 past the 8, 3 outside the grammar or too long, 1 on a call not sent.
    assert_eq!(trace.refused_labels, 6);
    assert_eq!(labels_of(&mesh, "s").await, expected);
    mesh.shutdown().await;
}

/// R34, R18, R13, R11: a dry-run guard's labels are traced as what it
/// would have set, never applied; a guard whose answer is rejected (a
/// validate guard rewriting) sets none.
#[tokio::test]
async fn r34_labels_of_a_dry_run_or_failed_guard_are_not_applied() {
    let mesh = TestMesh::start().await;
    let dry = call_guard(Duration::ZERO, |call| {
        Some(labelled(verdict::proceed(&call.call_id), ["dry:label"]))
    })
    .await;
    let rejected = call_guard(Duration::ZERO, |call| {
        Some(labelled(
            verdict::rewrite_arguments(&call.call_id, &serde_json::json!({"x": 1})),
            ["bad:label"],
        ))
    })
    .await;
    mesh.register(Registration::validate("dry", &dry.url).dry_run())
        .await;
    mesh.register(
        Registration::validate("rejected", &rejected.url)
            .failure_policy(guardmesh_client::proto::FailurePolicy::FailOpen),
    )
    .await;
    let c = mesh.coordinator().await;
    let d = decision(&c, "s", 0, "email.send", "{}").await;
    assert_eq!(d.guard("dry").unwrap().labels, ["dry:label"]);
    assert!(d.guard("rejected").unwrap().labels.is_empty());
    assert!(labels_of(&mesh, "s").await.is_empty());
    mesh.shutdown().await;
}

/// R34, R33: a results guard's verdict labels the session (a secret seen in
/// a result), and the label is in the next batch's memory.
#[tokio::test]
async fn r34_a_result_verdict_labels_the_session() {
    let mesh = TestMesh::start().await;
    let guard = script_guard(|b| Script {
        verdicts: b
            .results
            .iter()
            .filter(|r| r.result.contains("PRIVATE KEY"))
            .map(|r| labelled(verdict::proceed(&r.call_id), ["secret:fs"]))
            .collect(),
        ..Script::default()
    })
    .await;
    mesh.register(Registration::validate("results", &guard.url).phases(GuardPhases::Results))
        .await;
    let c = mesh.coordinator().await;
    c.evaluate_once(
        "s",
        Batch::new(0).call("r", "fs.read_file", r#"{"path":"id_rsa"}"#),
    )
    .await
    .unwrap();
    let result = serde_json::json!({
        "content": [{"type": "text", "text": "-----BEGIN RSA PRIVATE KEY-----\nMIIB\n"}]
    })
    .to_string();
    let d = c
        .evaluate_once(
            "s",
            Batch::new(1).result("r", "fs.read_file", "fs", &result),
        )
        .await
        .unwrap();
    assert_eq!(d.guard("results").unwrap().labels, ["secret:fs"]);
    assert_eq!(labels_of(&mesh, "s").await, ["secret:fs"]);
    assert!(labels_of(&mesh, "other").await.is_empty());
    mesh.shutdown().await;
}

/// R34, R27: a policy rule that decides a call adds its `labels` to the
/// session, and a later batch's rule reads them; a label outside the
/// grammar is refused when the policy is checked.
#[tokio::test]
async fn r34_a_policy_rule_labels_the_session_and_a_bad_label_is_refused() {
    let mesh = TestMesh::start().await;
    let policy = concat!(
        policy_rule!(name: "no-paste-sites", tools: ["http.*"], action: "cancel",
            when: r#"'call.args.url.contains("pastebin")'"#,
            message: r#"'"no paste sites"'"#,
            labels: r#"["exfil:attempt"]"#),
        policy_rule!(name: "no-mail-after-an-attempt", tools: ["email.*"], action: "cancel",
            when: r#"'"exfil:attempt" in session.labels'"#,
            message: r#"'"this session tried to exfiltrate; no email"'"#),
    );
    mesh.register(Registration::policy("exfil", policy)).await;
    let c = mesh.coordinator().await;
    let mail = || Batch::new(0).call("m", "email.send", "{}");
    let d = c.evaluate_once("s", mail()).await.unwrap();
    assert!(matches!(d.call("m").unwrap().outcome, Outcome::Proceed));
    let d = c
        .evaluate_once(
            "s",
            Batch::new(1).call("p", "http.post", r#"{"url":"https://pastebin.com/x"}"#),
        )
        .await
        .unwrap();
    assert!(matches!(
        d.call("p").unwrap().outcome,
        Outcome::Cancel { .. }
    ));
    assert_eq!(d.guard("exfil").unwrap().labels, ["exfil:attempt"]);
    let d = c.evaluate_once("s", mail()).await.unwrap();
    assert!(
        matches!(&d.call("m").unwrap().outcome, Outcome::Cancel { content } if content.contains("exfiltrate")),
        "{:?}",
        d.call("m")
    );
    let d = c.evaluate_once("other", mail()).await.unwrap();
    assert!(matches!(d.call("m").unwrap().outcome, Outcome::Proceed));
    // A label outside the grammar: the policy is refused whole.
    let bad = policy.replace("exfil:attempt\"]", "exfil attempt!\"]");
    let refused = mesh
        .registrar()
        .await
        .register(Registration::policy("bad", bad))
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("is not a label"), "{refused}");
    mesh.shutdown().await;
}

/// R33, R11, R29: the `redact-formats` example guard (mutate, calls and
/// results) replaces secrets of common formats; the tool is sent, and the
/// model reads, no copy, and the decision's final call and result hold
/// none either.
#[tokio::test]
async fn r29_r33_the_redaction_guard_leaves_no_secret_in_calls_or_results() {
    use guardmesh_cli::examples::{Example, Kind};
    let mesh = TestMesh::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(guardmesh_client::serve(
        Example::new(Kind::RedactFormats),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    mesh.register(
        Registration::mutate("redact", &url, ["*"])
            .phases(GuardPhases::Both)
            .result_grant(["*"]),
    )
    .await;
    let aws = "AKIAIOSFODNN7EXAMPLE";
    let stripe = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    let pem_body = "MIIEpAIBAAKCAQEAsecretkeybody";
    let c = mesh.coordinator().await;
    let args = format!(r#"{{"body":"key {aws} and {stripe}"}}"#);
    let d = decision(&c, "s", 0, "email.send", &args).await;
    let sent: String = d.execute.iter().map(|c| c.arguments.clone()).collect();
    assert!(sent.contains("[REDACTED:aws-access-key]"), "{sent}");
    assert!(!sent.contains(aws) && !sent.contains(stripe), "{sent}");
    let result = serde_json::json!({"content": [{"type": "text", "text":
        format!("-----BEGIN OPENSSH PRIVATE KEY-----\n{pem_body}\n-----END OPENSSH PRIVATE KEY-----")}]})
    .to_string();
    let d = c
        .evaluate_once(
            "s",
            Batch::new(1).result("c", "email.send", "email", &result),
        )
        .await
        .unwrap();
    let read = &d.result("c").unwrap().result;
    assert!(read.contains("[REDACTED:private-key]"), "{read}");
    assert!(!read.contains(pem_body), "{read}");
    mesh.shutdown().await;
    let _ = stop.send(());
    server.abort();
}
