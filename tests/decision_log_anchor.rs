//! The decision log's etcd anchor (R29): a real `guardmesh serve` with a
//! signing key and the etcd registry on a real 3-member etcd cluster puts
//! every checkpoint to `<prefix>/decision-log/<key id>/<instance>`. A log
//! cut after its anchor was written is refused at start and by `guardmesh
//! log verify --etcd` (even with the log directory's own state file gone
//! and no witness), or continued after a signed gap record with
//! `allow_gap`; a forged record appended after the anchor fails verify;
//! and with etcd down the batches keep being answered while the failed
//! puts are counted.

use crate::etcd::Cluster;
use crate::harness::*;
use guardmesh_server::decision_log::{chain, checkpoint, segment};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const INSTANCE: &str = "mesh-a";

/// A fresh folder with a key pair written by `guardmesh log keygen`.
fn keyed_folder(name: &str) -> PathBuf {
    let dir = folder(name);
    log_keygen(&dir);
    dir
}

/// The mesh's config: the etcd registry on `endpoints` under `prefix`, the
/// decision log signed (checkpoints every 4 records), no witness: the
/// anchor in etcd is the only copy of the checkpoints outside the log's
/// directory.
fn config(dir: &Path, endpoints: &[String], prefix: &str, extra: &str, metrics: u16) -> String {
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, LOG_POLICY).unwrap();
    let endpoints: Vec<String> = endpoints.iter().map(|e| format!("{e:?}")).collect();
    format!(
        "metrics_listen = \"127.0.0.1:{metrics}\"\n\n\
         [registry]\nkind = \"etcd\"\nendpoints = [{}]\nprefix = {prefix:?}\n\
         request_timeout_ms = 500\nstaleness_window_ms = 600000\n\n\
         [sessions]\nsecret_file = {:?}\n\n\
         [decision_log]\ndir = {:?}\nmax_file_bytes = 5000\nsigning_key = {:?}\n\
         checkpoint_every = 4\ninstance = {INSTANCE:?}\n{extra}\n\n\
         [[guard]]\nname = \"policy\"\npolicy = {:?}\n",
        endpoints.join(", "),
        path(&session_secret(dir, "session.secret")),
        path(&dir.join("log")),
        path(&dir.join("log.key")),
        path(&policy),
    )
}

/// The etcd key of the anchor of this test's mesh.
fn anchor_key(dir: &Path, prefix: &str) -> String {
    let public = checkpoint::read_verifying_key(&dir.join("log.key.pub")).unwrap();
    format!(
        "{prefix}/decision-log/{}/{INSTANCE}",
        checkpoint::key_id(&public)
    )
}

async fn anchored(cluster: &Cluster, key: &str) -> Option<String> {
    let mut client = etcd_client::Client::connect(cluster.urls(), None)
        .await
        .unwrap();
    let answer = client.get(key, None).await.unwrap();
    answer
        .kvs()
        .first()
        .map(|kv| String::from_utf8(kv.value().to_vec()).unwrap())
}

/// Serves `n` batches, stops the mesh cleanly, and waits (bounded) until
/// etcd holds the log's last line, its closing checkpoint.
async fn serve_and_stop(name: &str, dir: &Path, cluster: &Cluster, prefix: &str, extra: &str) {
    let config = config(dir, &cluster.urls(), prefix, extra, free_port());
    let mut mesh = MeshProcess::start(name, &config, None).await;
    log_batches(&mesh.url, name, 6, Some(Duration::from_secs(10))).await;
    mesh.signal("TERM");
    let status = mesh.exit_status().await;
    assert!(status.success(), "{status}\n{}", mesh.log());
    let last = log_lines(&dir.join("log")).pop().unwrap();
    assert!(last.contains("\"reason\":\"close\""), "{last}");
    let key = anchor_key(dir, prefix);
    let deadline = Instant::now() + Duration::from_secs(20);
    while anchored(cluster, &key).await.as_deref() != Some(last.as_str()) {
        assert!(
            Instant::now() < deadline,
            "etcd does not hold the closing checkpoint at {key}: {:?}\n{}",
            anchored(cluster, &key).await,
            mesh.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Cuts the last `n` lines of the log, and removes the directory's own
/// copy of the latest checkpoint, as someone with write access to the log
/// directory would.
fn cut_tail(log: &Path, n: usize) {
    cut_last_lines(log, n);
    std::fs::remove_file(log.join(checkpoint::STATE_FILE)).unwrap();
}

/// `guardmesh log verify` of `dir`'s log with the key and the etcd anchor,
/// run off this runtime's thread: the cluster's peer proxies run on it.
async fn verify_etcd(dir: &Path, cluster: &Cluster, prefix: &str, extra: &[&str]) -> Output {
    let endpoints = cluster.urls().join(",");
    let anchor = [
        "--etcd",
        &endpoints,
        "--etcd-prefix",
        prefix,
        "--instance",
        INSTANCE,
    ];
    verify_with(dir, &[&anchor[..], extra].concat()).await
}

/// A `guardmesh log verify` that found the log wrong (exit code 1),
/// saying `says`.
#[track_caller]
fn assert_verify_failed(out: &Output, says: &str) {
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
}

/// A mesh served and stopped once by [`serve_and_stop`] as `name`, with
/// its log in the keyed folder `name` and its anchor under `/name` on a
/// cluster of its own: the cluster, the folder and the prefix.
async fn served_once(name: &str) -> (Cluster, PathBuf, String) {
    let cluster = Cluster::start().await;
    let dir = keyed_folder(name);
    let prefix = format!("/{name}");
    serve_and_stop(name, &dir, &cluster, &prefix, "").await;
    (cluster, dir, prefix)
}

#[tokio::test]
async fn r29_a_log_cut_after_its_etcd_anchor_refuses_to_start_and_fails_verify() {
    let (cluster, dir, prefix) = served_once("anchor-cut").await;
    let out = verify_etcd(&dir, &cluster, &prefix, &[]).await;
    assert_succeeded(&out);
    assert!(text(&out.stdout).contains("anchor: the log holds the outside checkpoint"));

    let log = dir.join("log");
    cut_tail(&log, 3);
    let before = log_lines(&log);
    let stderr = serve_refused(
        &dir,
        &config(&dir, &cluster.urls(), &prefix, "", free_port()),
    )
    .await;
    assert!(
        stderr.contains("known from the etcd")
            && stderr.contains("3 records missing")
            && stderr.contains("allow_gap"),
        "{stderr}"
    );
    assert_eq!(log_lines(&log), before, "a refused start wrote to the log");

    let out = verify_etcd(&dir, &cluster, &prefix, &[]).await;
    assert_verify_failed(&out, "3 records missing");
}

#[tokio::test]
async fn r29_with_allow_gap_a_mesh_behind_its_etcd_anchor_starts_after_a_signed_gap() {
    let cluster = Cluster::start().await;
    let dir = keyed_folder("anchor-gap");
    let prefix = "/anchor-gap";
    serve_and_stop("anchor-gap-1", &dir, &cluster, prefix, "").await;
    let log = dir.join("log");
    cut_tail(&log, 2);
    serve_and_stop("anchor-gap-2", &dir, &cluster, prefix, "allow_gap = true").await;
    let gaps: Vec<_> = records(&log)
        .into_iter()
        .filter(|r| r["kind"] == "gap")
        .collect();
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(gaps[0]["source"], "etcd", "{gaps:?}");
    // Verify names the gap, and accepts it when told to; the anchor is now
    // the second run's closing checkpoint.
    let out = verify_etcd(&dir, &cluster, prefix, &[]).await;
    assert_verify_failed(&out, "gap");
    let out = verify_etcd(&dir, &cluster, prefix, &["--allow-gap"]).await;
    assert_succeeded(&out);
    assert!(text(&out.stdout).contains("gap: at seq"));
}

#[tokio::test]
async fn r29_a_record_forged_after_the_etcd_anchor_fails_verify_with_the_key() {
    let (cluster, dir, prefix) = served_once("anchor-forged").await;
    let log = dir.join("log");
    let lines = log_lines(&log);
    let last = lines.last().unwrap();
    let decision = lines
        .iter()
        .rfind(|l| l.contains("\"kind\":\"decision\""))
        .unwrap()
        .replace("\"action\":\"cancel\"", "\"action\":\"proceed\"");
    let seq: serde_json::Value = serde_json::from_str(last).unwrap();
    let forged = set_member(
        &decision,
        "seq",
        &(seq["seq"].as_u64().unwrap() + 1).to_string(),
    );
    let forged = set_member(
        &forged,
        "prev",
        &format!("\"{}\"", chain::sha256_hex(last.as_bytes())),
    );
    let body = &forged[..forged.rfind(",\"hash\":\"").unwrap()];
    let forged = format!(
        "{body},\"hash\":\"{}\"}}",
        chain::sha256_hex(body.as_bytes())
    );
    let (_, file) = segment::list(&log).unwrap().pop().unwrap();
    let mut text_now = std::fs::read_to_string(&file).unwrap();
    text_now.push_str(&forged);
    text_now.push('\n');
    std::fs::write(&file, text_now).unwrap();

    // The chain alone holds: the forgery is well made.
    let out = guardmesh(&["log", "verify", path(&log)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // With the key and the anchor it is refused.
    let out = verify_etcd(&dir, &cluster, &prefix, &[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
}

/// A sample of the mesh's Prometheus metrics at `port`; 0 when absent.
async fn metric(port: u16, sample: &str) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return 0.0;
    };
    let request = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if stream.write_all(request.as_bytes()).await.is_err() {
        return 0.0;
    }
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out).await;
    out.lines()
        .find_map(|line| line.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn r29_with_etcd_down_batches_are_answered_and_failed_anchors_counted() {
    let mut cluster = Cluster::start().await;
    let dir = keyed_folder("anchor-down");
    let prefix = "/anchor-down";
    let metrics = free_port();
    let config = config(&dir, &cluster.urls(), prefix, "", metrics);
    let mesh = MeshProcess::start("anchor-down", &config, None).await;
    let key = anchor_key(&dir, prefix);
    // The `open` checkpoint reaches etcd.
    let deadline = Instant::now() + Duration::from_secs(20);
    while anchored(&cluster, &key).await.is_none() {
        assert!(Instant::now() < deadline, "no anchor\n{}", mesh.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let sample = "guardmesh_decision_log_failures_total{kind=\"checkpoint_etcd\"}";
    assert_eq!(metric(metrics, sample).await, 0.0);

    for member in &mut cluster.members {
        member.kill();
    }
    // Checkpoints every 4 records: several puts fall due, and fail; every
    // batch is answered meanwhile, each within the bound of `batches`.
    let started = Instant::now();
    log_batches(&mesh.url, "down", 12, Some(Duration::from_secs(10))).await;
    let took = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(metrics, sample).await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "no failed anchor counted\n{}",
            mesh.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Still answering, and the failure is in the mesh's log.
    log_batches(&mesh.url, "still", 4, Some(Duration::from_secs(10))).await;
    assert!(
        mesh.log().contains("checkpoint not anchored in etcd"),
        "{}",
        mesh.log()
    );
    eprintln!("12 batches with etcd down: {took:?}");
    let records = records(&dir.join("log"));
    let answered = records.iter().filter(|r| r["kind"] == "decision").count();
    assert_eq!(answered, 16, "every batch recorded");
}

/// `guardmesh log verify` of `dir`'s log with the key and `args`, run off
/// this runtime's thread.
async fn verify_with(dir: &Path, args: &[&str]) -> Output {
    let (log, public) = (dir.join("log"), dir.join("log.key.pub"));
    let mut all = vec!["log", "verify", path(&log), "--key", path(&public)];
    all.extend_from_slice(args);
    guardmesh_off_thread(all).await
}

#[tokio::test]
async fn r29_log_verify_reads_the_etcd_anchor_with_the_mesh_configs_credentials() {
    let (cluster, dir, prefix) = served_once("anchor-auth").await;

    // The cluster turns on authentication after the mesh ran: reading the
    // anchor now needs the user the mesh's config names.
    let mut admin = etcd_client::Client::connect(cluster.urls(), None)
        .await
        .unwrap();
    admin.user_add("root", "anchor-pw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    // Without credentials (--etcd): the anchor cannot be read, and verify
    // says so instead of passing without it.
    let out = verify_etcd(&dir, &cluster, &prefix, &[]).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));

    // With the mesh's config (user and password from the environment, as
    // an operator keeps it): the anchor is read and the log holds it.
    let mesh_config = config(&dir, &cluster.urls(), &prefix, "", free_port()).replace(
        "request_timeout_ms = 500\n",
        "request_timeout_ms = 500\nusername = \"root\"\npassword_env = \"ANCHOR_TEST_ETCD_PW\"\n",
    );
    let file = dir.join("mesh.toml");
    std::fs::write(&file, mesh_config).unwrap();
    let out = verify_with_config(&dir, &file).await;
    assert_succeeded(&out);
    assert!(
        text(&out.stdout).contains("anchor: the log holds the outside checkpoint"),
        "{}",
        text(&out.stdout)
    );

    // The config's anchor is the one checked: a cut log fails verify.
    cut_tail(&dir.join("log"), 3);
    let out = verify_with_config(&dir, &file).await;
    assert_verify_failed(&out, "3 records missing");
}

/// `guardmesh log verify --config FILE` with the etcd password in the
/// environment variable the config names.
async fn verify_with_config(dir: &Path, file: &Path) -> Output {
    let (log, public, file) = (dir.join("log"), dir.join("log.key.pub"), file.to_owned());
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["log", "verify", path(&log), "--key", path(&public)])
            .args(["--config", path(&file)])
            .env("ANCHOR_TEST_ETCD_PW", "anchor-pw")
            .output()
            .expect("run guardmesh")
    })
    .await
    .unwrap()
}

#[test]
fn r29_log_verify_instance_without_etcd_or_config_is_an_error() {
    // `--instance` says whose etcd anchor the log must hold. Without
    // `--etcd` or `--config` there is nothing to read it from: the command
    // fails naming the missing flags, rather than checking the log without
    // the anchor the user asked for and reporting "ok".
    let dir = keyed_folder("verify-instance-alone");
    let log = dir.join("log");
    std::fs::create_dir_all(&log).unwrap();
    let out = guardmesh(&[
        "log",
        "verify",
        path(&log),
        "--key",
        path(&dir.join("log.key.pub")),
        "--instance",
        INSTANCE,
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--instance") && stderr.contains("--etcd") && stderr.contains("--config"),
        "{stderr}"
    );
    assert!(text(&out.stdout).is_empty(), "{}", text(&out.stdout));
}
