//! The decision log in the mesh (R29) and replay (R30): `guardmesh serve`
//! with a `[decision_log]` section, `guardmesh log verify` and `guardmesh
//! replay` as users run them, and the log's failure policy on an
//! in-process mesh.

use crate::harness::*;
use guardmesh_client::proto::{EvaluateRequest, FailurePolicy, ToolCall};
use guardmesh_client::{Batch, Registration};
use guardmesh_server::decision_log::{LogConfig, OnLogFailure, segment};
use serde_json::Value;
use std::path::{Path, PathBuf};

const SECRET: &str = "hunter2-very-secret";
const TOKEN: &str = "Bearer tok-very-secret";

fn log_bytes(dir: &Path) -> Vec<u8> {
    segment::list(dir)
        .unwrap()
        .into_iter()
        .flat_map(|(_, file)| std::fs::read(file).unwrap())
        .collect()
}

/// The decision records of batch `batch_id`.
fn decisions_of(dir: &Path, batch_id: &str) -> Vec<Value> {
    records(dir)
        .into_iter()
        .filter(|r| r["kind"] == "decision" && r["batch"]["batch_id"] == batch_id)
        .collect()
}

/// A mesh config with the policy guard, the decision log in `dir/log`
/// masking `password` and the `authorization` header, and `extra` guards.
fn config(dir: &Path, extra: &str) -> String {
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, LOG_POLICY).unwrap();
    let veto = dir.join("veto.toml");
    std::fs::write(&veto, LOG_VETO).unwrap();
    format!(
        "[decision_log]\ndir = {:?}\nmask = [\"password\", \"$.headers.authorization\"]\n\n\
         [[guard]]\nname = \"policy\"\npolicy = {:?}\n{extra}",
        dir.join("log").display().to_string(),
        policy.display().to_string()
    )
}

fn request(batch_id: &str, calls: Vec<ToolCall>) -> EvaluateRequest {
    EvaluateRequest {
        batch_id: batch_id.into(),
        calls,
        ..Default::default()
    }
}

fn call(call_id: &str, tool: &str, arguments: &str) -> ToolCall {
    ToolCall {
        call_id: call_id.into(),
        tool: tool.into(),
        arguments: arguments.into(),
    }
}

#[tokio::test]
async fn r29_r30_every_answer_and_chain_change_is_recorded_masked_verified_and_replayed() {
    let dir = folder("run");
    let log = dir.join("log");
    let mesh = MeshProcess::start("declog-run", &config(&dir, ""), None).await;
    // The config's guard is recorded at start.
    let start = records(&log);
    assert_eq!(start.len(), 1, "{start:?}");
    assert_eq!(start[0]["kind"], "chain_change");
    assert_eq!(start[0]["change"], "config_reload");
    assert_eq!(start[0]["guard"], "policy");

    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let arguments = format!(
        r#"{{"path": "/etc/passwd", "password": "{SECRET}", "headers": {{"authorization": "{TOKEN}"}}}}"#
    );

    // Decided: recorded before the answer arrived, so it is in the file as
    // soon as the answer is.
    let d = session
        .evaluate_raw(request(
            "decided",
            vec![call("c1", "read", &arguments), call("c2", "danger", "{}")],
        ))
        .await
        .unwrap();
    assert!(d.call("c1").unwrap().proceeds());
    let found = decisions_of(&log, "decided");
    assert_eq!(found.len(), 1, "{found:?}");
    let record = &found[0];
    assert_eq!(record["outcome"]["status"], "decided");
    assert_eq!(record["decisions"][1]["action"], "cancel");
    assert_eq!(record["decisions"][1]["decided_by"], "policy");
    assert_eq!(record["decisions"][1]["rule"], "no-danger");
    assert_eq!(record["trace"][0]["guard"], "policy");
    assert_eq!(
        record["batch"]["calls"][0]["arguments"]["path"],
        "/etc/passwd"
    );
    assert!(record["masked"].as_u64().unwrap() >= 2, "{record}");

    // Zero calls: decided, no decisions.
    session
        .evaluate_raw(request("empty", vec![]))
        .await
        .unwrap();
    let found = decisions_of(&log, "empty");
    assert_eq!(found.len(), 1);
    assert_eq!(found[0]["outcome"]["status"], "decided");

    // Refused by validation (R20): INVALID_ARGUMENT, recorded with its code.
    let err = session
        .evaluate_raw(request(
            "refused",
            vec![call("x", "read", "{}"), call("x", "read", "{}")],
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument));
    let found = decisions_of(&log, "refused");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["outcome"]["status"], "refused");
    assert_eq!(found[0]["outcome"]["code"], 3);

    // Register an abort guard that cannot be reached: aborted, then
    // deregister it. Both changes are recorded.
    let registrar = guardmesh_client::Registrar::connect(mesh.url.clone())
        .await
        .unwrap();
    registrar
        .register(
            Registration::validate("down", closed_port().await)
                .tools(["other"])
                .failure_policy(FailurePolicy::Abort),
        )
        .await
        .unwrap();
    let err = session
        .evaluate_raw(request("aborted", vec![call("a", "other", "{}")]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    let found = decisions_of(&log, "aborted");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["outcome"]["status"], "aborted");
    registrar.deregister("down").await.unwrap();

    // Unary calls are recorded too.
    coordinator
        .evaluate_once("u", Batch::new(0).call("u1", "read", "{}"))
        .await
        .unwrap();
    assert_eq!(decisions_of(&log, "u/0").len(), 1);

    // Under on_log_failure = "refuse" (the default) each change is
    // recorded as requested before it is applied, then with its result.
    let all = records(&log);
    let changes: Vec<_> = all.iter().filter(|r| r["kind"] == "chain_change").collect();
    assert_eq!(changes.len(), 5, "{changes:?}");
    assert_eq!(changes[1]["change"], "register");
    assert_eq!(changes[1]["guard"], "down");
    assert_eq!(changes[1]["outcome"]["status"], "requested");
    assert!(changes[1]["new_revision"].is_null());
    assert_eq!(changes[2]["change"], "register");
    assert_eq!(changes[2]["guard"], "down");
    assert_eq!(changes[2]["outcome"]["status"], "applied");
    assert_eq!(changes[3]["change"], "deregister");
    assert_eq!(changes[3]["outcome"]["status"], "requested");
    assert_eq!(changes[4]["change"], "deregister");
    assert_eq!(
        changes[4]["old_revision"].as_u64().unwrap() + 1,
        changes[4]["new_revision"].as_u64().unwrap()
    );
    let batches: Vec<_> = all.iter().filter(|r| r["kind"] == "decision").collect();
    assert_eq!(
        batches.len(),
        5,
        "one record per batch answered: {batches:?}"
    );

    // Masked values never reach the file.
    let bytes = text(&log_bytes(&log));
    assert!(!bytes.contains(SECRET), "a masked password is in the log");
    assert!(
        !bytes.contains("tok-very-secret"),
        "a masked header is in the log"
    );

    // R30: the same chain gives no difference; a stricter candidate
    // reports exactly the call it would block; twice the same report.
    let same = dir.join("same.toml");
    std::fs::write(&same, config(&dir, "")).unwrap();
    let out = guardmesh(&[
        "replay",
        &log.display().to_string(),
        "--config",
        &same.display().to_string(),
    ]);
    assert_succeeded(&out);
    let report = text(&out.stdout);
    assert!(report.contains("no call's decision differs"), "{report}");
    assert!(report.contains("1 records had masked values"), "{report}");

    let stricter = dir.join("stricter.toml");
    let veto = format!(
        "\n[[guard]]\nname = \"veto\"\npolicy = {:?}\n",
        dir.join("veto.toml").display().to_string()
    );
    std::fs::write(&stricter, config(&dir, &veto)).unwrap();
    let replay = || {
        guardmesh(&[
            "replay",
            &log.display().to_string(),
            "--config",
            &stricter.display().to_string(),
            "--json",
        ])
    };
    let out = replay();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let differences = report["differences"].as_array().unwrap();
    assert_eq!(differences.len(), 1, "{report}");
    assert_eq!(differences[0]["call_id"], "c1");
    assert_eq!(differences[0]["tool"], "read");
    assert_eq!(differences[0]["recorded"]["action"], "proceed");
    assert_eq!(differences[0]["new"]["action"], "cancel");
    assert_eq!(differences[0]["new"]["guard"], "veto");
    assert_eq!(report["masked_records"], 1);
    assert_eq!(replay().stdout, out.stdout, "replay is deterministic");

    // Verification passes, then names the record whose byte was edited.
    let out = guardmesh(&["log", "verify", &log.display().to_string()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("ok: 10 records"),
        "{}",
        text(&out.stdout)
    );
    drop(mesh);
    let (_, file) = segment::list(&log).unwrap().remove(0);
    let content = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<&str> = content.lines().collect();
    let third: Value = serde_json::from_str(lines[2]).unwrap();
    let edited = content.replacen("\"empty\"", "\"emptY\"", 1);
    assert_ne!(edited, content);
    std::fs::write(&file, edited).unwrap();
    let out = guardmesh(&["log", "verify", &log.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(":3:") && stderr.contains(third["id"].as_str().unwrap()),
        "names line 3 and its record: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn r29_a_log_that_cannot_be_resumed_stops_the_mesh_at_start() {
    let dir = folder("corrupt");
    let log = dir.join("log");
    std::fs::create_dir_all(&log).unwrap();
    std::fs::write(log.join(segment::file_name(0)), "{\"v\":1,\"seq\":0").unwrap();
    let file = dir.join("mesh.toml");
    std::fs::write(&file, config(&dir, "")).unwrap();
    let port = free_port();
    let out = guardmesh(&[
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--config",
        &file.display().to_string(),
    ]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("[decision_log]") && stderr.contains("cannot resume"),
        "{stderr}"
    );
    // Unknown keys are refused like everywhere in the config.
    let error =
        guardmesh_server::config::Config::parse("[decision_log]\ndir = \"x\"\nfsync = true\n", "t")
            .unwrap_err()
            .to_string();
    assert!(error.contains("fsync"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An in-process mesh whose log writes to /dev/full: every append fails.
async fn failing_mesh(on_failure: OnLogFailure) -> Option<(TestMesh, PathBuf)> {
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full");
        return None;
    }
    let dir = folder(&format!("full-{on_failure:?}"));
    std::os::unix::fs::symlink("/dev/full", dir.join(segment::file_name(0))).unwrap();
    let mesh = TestMesh::start().await;
    mesh.attach_log(LogConfig::new(&dir, "test"), on_failure)
        .await;
    Some((mesh, dir))
}

#[tokio::test]
async fn r29_a_decision_that_cannot_be_recorded_is_refused_unavailable() {
    let Some((mesh, _dir)) = failing_mesh(OnLogFailure::Refuse).await else {
        return;
    };
    // R29: a registration that cannot be recorded is not applied either.
    let guard = proceed_guard().await;
    let err = mesh
        .registrar()
        .await
        .register(Registration::validate("g", &guard.url))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    for batch in [
        request("b1", vec![call("c1", "t", "{}")]),
        request("b0", vec![]),
        request("bad", vec![call("", "t", "{}")]),
    ] {
        let err = session.evaluate_raw(batch).await.unwrap_err();
        assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
        assert!(err.to_string().contains("decision log"), "{err}");
    }
    let err = coordinator
        .evaluate_once("u", Batch::new(0).call("c1", "t", "{}"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    assert!(
        metric(
            &mesh,
            "guardmesh_decision_log_failures_total{kind=\"decision\"}"
        ) >= 4.0,
        "{}",
        mesh.mesh.metrics.encode()
    );
}

#[tokio::test]
async fn r29_with_on_log_failure_answer_the_batch_is_answered_and_the_loss_counted() {
    let Some((mesh, _dir)) = failing_mesh(OnLogFailure::Answer).await else {
        return;
    };
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let (_session, d) = mesh
        .session_decides(Batch::new(0).call("c1", "t", "{}"))
        .await;
    assert!(d.call("c1").unwrap().proceeds());
    let lost = metric(
        &mesh,
        "guardmesh_decision_log_failures_total{kind=\"decision\"}",
    );
    assert_eq!(lost, 1.0);
    // The registration was lost too, and counted.
    assert_eq!(
        metric(
            &mesh,
            "guardmesh_decision_log_failures_total{kind=\"chain_change\"}"
        ),
        1.0
    );
}

/// Not a check: the time per batch of an in-process mesh with one policy
/// guard, sequential batches of 4 calls, without a log, with fsync per
/// record and with fsync per 100 ms interval. Run with `cargo test -p
/// guardmesh-cli --test integration decision_log::measure -- --ignored
/// --nocapture`.
#[tokio::test]
#[ignore]
async fn measure_log_cost_per_batch() {
    use guardmesh_server::decision_log::Durability;
    let n = 400;
    let modes = [
        None,
        Some(Durability::EveryRecord),
        Some(Durability::Interval(std::time::Duration::from_millis(100))),
    ];
    for mode in modes {
        let dir = folder(&format!("measure-{mode:?}"));
        let mesh = TestMesh::start().await;
        mesh.register(Registration::policy("policy", LOG_POLICY))
            .await;
        if let Some(durability) = mode {
            let config = LogConfig {
                durability,
                ..LogConfig::new(dir.join("log"), "measure")
            };
            mesh.attach_log(config, OnLogFailure::Refuse).await;
        }
        let session = mesh.coordinator().await.session("m").await.unwrap();
        let batch = || {
            Batch::new(0)
                .call("c1", "read", r#"{"path": "/data/x", "password": "p"}"#)
                .call("c2", "danger", "{}")
                .call("c3", "read", r#"{"path": "/etc/hosts"}"#)
                .call("c4", "write", r#"{"path": "/data/y", "body": "some text"}"#)
        };
        for _ in 0..20 {
            session.evaluate(batch()).await.unwrap();
        }
        let start = std::time::Instant::now();
        for _ in 0..n {
            session.evaluate(batch()).await.unwrap();
        }
        let per = start.elapsed() / n;
        println!("log {mode:?}: {per:?} per batch (sequential, {n} batches)");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// R29 with R24: records name the authenticated caller (its principal id
/// and roles) of batches, streamed and unary, and of chain changes, also a
/// change refused for want of the role.
#[tokio::test]
async fn r29_records_name_the_authenticated_caller() {
    use guardmesh_client::Coordinator;
    let dir = folder("caller");
    let pki = TestPki::new();
    let (mesh, url) = TestMesh::with_tokens(&pki, &[OPS, AGENT], "").await;
    mesh.attach_log(
        LogConfig::new(dir.join("log"), "test"),
        OnLogFailure::Refuse,
    )
    .await;
    let guard = proceed_guard().await;
    let ops = pki.registrar(&url, "ops-token").await;
    ops.register(Registration::validate("g", &guard.url))
        .await
        .unwrap();
    let agent = pki.connection(None, Some("agent-token"));
    let coordinator = Coordinator::connect_with(url.clone(), &agent)
        .await
        .unwrap();
    coordinator
        .evaluate_once("s", Batch::new(0).call("c", "t", "{}"))
        .await
        .unwrap();
    coordinator
        .session("s")
        .await
        .unwrap()
        .evaluate_raw(request("streamed", vec![call("c", "t", "{}")]))
        .await
        .unwrap();
    // A registration the registry refuses is recorded as refused.
    let refused = ops
        .register(Registration::validate("bad", "not a url"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(tonic::Code::InvalidArgument));

    // The registration is recorded as requested, then applied; the refused
    // one, refused by its checks, only as refused.
    let all = records(&dir.join("log"));
    assert_eq!(all.len(), 5, "{all:?}");
    let ids: Vec<_> = all.iter().map(|r| r["caller"]["id"].clone()).collect();
    assert_eq!(ids, ["ops", "ops", "agent", "agent", "ops"], "{all:?}");
    assert_eq!(all[0]["caller"]["roles"][0], "admin");
    assert_eq!(all[0]["outcome"]["status"], "requested");
    assert_eq!(all[1]["outcome"]["status"], "applied");
    assert!(
        all[2]["caller"]["peer"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:")
    );
    assert_eq!(all[4]["change"], "register");
    assert_eq!(all[4]["guard"], "bad");
    assert_eq!(all[4]["outcome"]["status"], "refused");
    assert_eq!(all[4]["outcome"]["code"], 3);
    assert!(all[4]["new_revision"].is_null());
    let _ = std::fs::remove_dir_all(&dir);
}

/// R29, R33: secrets of common formats (`decision_log.mask_formats`, all
/// four by default) leave no copy in the log, whatever field holds them:
/// the call as the coordinator sent it (which the redaction guard then
/// rewrote), a result, the model's text and the metadata. The record says
/// what was there (`[masked:<kind>]`) and still verifies; with
/// `mask_formats = []` the same batch's secret is in the file, as the
/// operator asked.
#[tokio::test]
async fn r29_r33_secrets_of_known_formats_leave_no_copy_in_the_log() {
    use guardmesh_cli::examples::{Example, Kind};
    let aws = "AKIAIOSFODNN7EXAMPLE";
    let stripe = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    let github = format!("ghp_{}", "a1B2".repeat(9));
    let pem_body = "MIIEpAIBAAKCAQEAsecretkeybody";
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let guard = tokio::spawn(guardmesh_client::serve(
        Example::new(Kind::RedactFormats),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let redact = format!(
        "[[guard]]\nname = \"redact\"\nendpoint = {url:?}\nrole = \"mutate\"\nphases = \"both\"\n\
         grant = {{ tools = [\"*\"] }}\nresult_grant = {{ tools = [\"*\"] }}\n"
    );
    let run = |name: &'static str, formats: &'static str| {
        let dir = folder(name);
        let log = dir.join("log");
        let config = format!(
            "[decision_log]\ndir = {:?}\n{formats}\n{redact}",
            log.display().to_string()
        );
        (log, config)
    };

    let (log, config) = run("formats-default", "");
    let mesh = MeshProcess::start("declog-formats", &config, None).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    let args = format!(r#"{{"body":"key {aws} and {stripe}","{github}":1}}"#);
    let d = session
        .evaluate(
            Batch::new(0)
                .call("c", "email.send", &args)
                .model_text(format!("sending {aws} now"))
                .meta("note", format!("token {github}")),
        )
        .await
        .unwrap();
    let sent: String = d.execute.iter().map(|c| c.arguments.clone()).collect();
    assert!(sent.contains("[REDACTED:aws-access-key]"), "{sent}");
    let result = serde_json::json!({"content": [{"type": "text", "text": format!(
        "-----BEGIN OPENSSH PRIVATE KEY-----\n{pem_body}\n-----END OPENSSH PRIVATE KEY-----")}]})
    .to_string();
    session
        .evaluate(Batch::new(1).result("c", "email.send", "email", &result))
        .await
        .unwrap();
    let bytes = text(&log_bytes(&log));
    for secret in [aws, stripe, github.as_str(), pem_body] {
        assert!(!bytes.contains(secret), "{secret} is in the log: {bytes}");
    }
    let record = &decisions_of(&log, &d.batch_id)[0];
    let original = record["batch"]["calls"][0]["arguments"].to_string();
    assert!(
        original.contains("[masked:aws-access-key]") && original.contains("[masked:github-token]"),
        "{original}"
    );
    assert!(record["masked"].as_u64().unwrap() >= 2, "{record}");
    let out = guardmesh(&["log", "verify", &log.display().to_string()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    drop(mesh);

    // The operator's choice: no formats masked; the secret is recorded.
    let (log, config) = run("formats-none", "mask_formats = []");
    let mesh = MeshProcess::start("declog-noformats", &config, None).await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s").await.unwrap();
    session
        .evaluate(Batch::new(0).call("c", "email.send", &args))
        .await
        .unwrap();
    assert!(text(&log_bytes(&log)).contains(aws));
    drop(mesh);
    let _ = stop.send(());
    guard.abort();
}

/// R29: an unknown secret format in `mask_formats` is refused at start,
/// naming it and the known ones.
#[test]
fn r29_an_unknown_mask_format_is_refused_naming_it() {
    let dir = folder("formats-unknown");
    let config = log_config_file(&dir, &dir.join("log"), "mask_formats = [\"aws\"]\n");
    let out = guardmesh(&["config", "check", &config.display().to_string()]);
    let err = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("mask_formats") && err.contains("\"aws\"") && err.contains("github-token"),
        "{err}"
    );
}
