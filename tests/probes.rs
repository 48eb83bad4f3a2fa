//! The probes of process supervisors (issue 37) against the real
//! `guardmesh serve` process: `/healthz` and `/readyz` on the metrics port,
//! and SIGTERM drain within `[server] shutdown_grace_ms`.
//!
//! Every wait is bounded; the only time asserted is an upper bound with a
//! wide margin (the process exits within its grace period, not after the
//! guard's far longer delay).

use crate::harness::*;
use guardmesh_client::{Batch, ClientError, Coordinator};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `guardmesh serve` started without waiting for its gRPC listener (the
/// probes answer before it is up).
struct Serve {
    child: Child,
    url: String,
    metrics: u16,
    dir: PathBuf,
}

impl Serve {
    /// Starts the mesh with `config` (a `metrics_listen` line is added) and
    /// waits (bounded) until `/healthz` answers.
    async fn start(name: &str, config: &str) -> Self {
        let dir = fresh_dir(name);
        let port = free_port();
        let metrics = free_port();
        let file = dir.join("mesh.toml");
        std::fs::write(
            &file,
            format!("metrics_listen = \"127.0.0.1:{metrics}\"\n{config}"),
        )
        .unwrap();
        let child = spawn_serve(&file, port, &dir.join("mesh.log"), None);
        let mut serve = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            metrics,
            dir,
        };
        for _ in 0..500 {
            if let Some((200, _)) = get(metrics, "/healthz").await {
                return serve;
            }
            if let Ok(Some(status)) = serve.child.try_wait() {
                panic!("guardmesh serve exited with {status}:\n{}", serve.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("/healthz did not answer:\n{}", serve.log());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("mesh.log")).unwrap_or_default()
    }

    async fn probe(&self, path: &str) -> (u16, String) {
        get(self.metrics, path)
            .await
            .unwrap_or_else(|| panic!("{path} did not answer:\n{}", self.log()))
    }

    /// Polls `/readyz` (bounded, ~`tries` × 50 ms) until its status is
    /// `status`; returns the last answer.
    async fn readyz_until(&self, status: u16, tries: usize) -> (u16, String) {
        let mut last = (0, String::new());
        for _ in 0..tries {
            last = get(self.metrics, "/readyz").await.unwrap_or_default();
            if last.0 == status {
                return last;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "/readyz never answered {status}; last {last:?}\n{}",
            self.log()
        );
    }

    /// Once the mesh is ready, a coordinator and a batch of its session
    /// `s`, which `held` has (and holds): the batch's answer comes with the
    /// session, open until then.
    async fn held_batch(&self, held: &HeldHandle) -> (Coordinator, HeldBatch) {
        self.readyz_until(200, 200).await;
        let coordinator = Coordinator::connect(self.url.clone()).await.unwrap();
        let session = coordinator.session("s").await.unwrap();
        let mut in_flight: HeldBatch = Box::pin(async move {
            let answer = session.evaluate(Batch::new(0).call("c1", "t", "{}")).await;
            (answer, session)
        });
        until_held(&mut in_flight, &held.guard).await;
        (coordinator, in_flight)
    }

    /// Fails unless `status` is a success and the log says `text`.
    fn assert_exited_saying(&self, status: std::process::ExitStatus, text: &str) {
        assert!(status.success(), "exit status {status}:\n{}", self.log());
        assert!(self.log().contains(text), "{}", self.log());
    }

    fn signal(&self, signal: &str) {
        send_signal(&self.child, signal);
    }

    /// Waits at most `bound` for the process to exit.
    async fn exit_within(&mut self, bound: Duration) -> std::process::ExitStatus {
        match self.exited_within(bound).await {
            Some(status) => status,
            None => panic!("the mesh did not exit within {bound:?}:\n{}", self.log()),
        }
    }

    /// The exit status if the process exits within `bound`.
    async fn exited_within(&mut self, bound: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` on the metrics port: (status, body), or None when nothing
/// answers within 5 s.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let fetch = async {
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        tcp.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut text = String::new();
        tcp.read_to_string(&mut text).await.ok()?;
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n")?.1.to_owned();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()
        .flatten()
}

#[tokio::test]
async fn healthz_and_readyz_answer_plain_text_on_the_metrics_port() {
    let serve = Serve::start("plain", "").await;
    let (status, body) = serve.probe("/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, body) = serve.readyz_until(200, 200).await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    let (status, body) = serve.probe("/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("guardmesh_"), "{body}");
    let (status, body) = serve.probe("/nothing").await;
    assert_eq!(status, 404);
    assert!(body.contains("/readyz"), "{body}");
    // The gRPC listener is up once /readyz says so.
    assert!(Coordinator::connect(serve.url.clone()).await.is_ok());
}

#[tokio::test]
async fn readyz_is_503_until_etcd_confirms_the_chain_and_again_once_etcd_is_gone() {
    let mut etcd = crate::etcd::Etcd::unstarted();
    let secret = session_secret(etcd.dir(), "session.secret");
    let config = format!(
        r#"
[registry]
kind = "etcd"
endpoints = ["{}"]
prefix = "/guardmesh/probes"
dial_timeout_ms = 60000
request_timeout_ms = 1000
staleness_window_ms = 1000
after_window = "refuse"

[sessions]
secret_file = {:?}
"#,
        etcd.url(),
        secret.display().to_string()
    );
    // etcd is not running yet: the mesh is alive but not ready.
    let serve = Serve::start("etcd", &config).await;
    let (status, body) = serve.probe("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("registry is not loaded"), "{body}");
    assert_eq!(serve.probe("/healthz").await.0, 200);
    let (status, _) = serve.probe("/metrics").await;
    assert_eq!(status, 503, "no metrics before the mesh exists");

    etcd.spawn().await;
    let (_, body) = serve.readyz_until(200, 600).await;
    assert!(body.starts_with("ready\n"), "{body}");
    assert!(Coordinator::connect(serve.url.clone()).await.is_ok());

    // etcd goes away: past the staleness window the replica refuses to
    // judge, and /readyz says so while /healthz still answers.
    etcd.stop();
    let (_, body) = serve.readyz_until(503, 600).await;
    assert!(body.contains("registry:"), "{body}");
    assert!(body.contains("staleness window"), "{body}");
    assert_eq!(serve.probe("/healthz").await.0, 200);
}

#[tokio::test]
async fn readyz_is_503_when_the_decision_log_directory_cannot_be_written() {
    let logs = fresh_dir("probes-log");
    let log_dir = logs.join("decisions");
    let config = format!(
        "[decision_log]\ndir = {:?}\n",
        log_dir.display().to_string()
    );
    let serve = Serve::start("log", &config).await;
    serve.readyz_until(200, 200).await;
    // The directory disappears (an unmounted volume): no record could be
    // written, and the probe names it.
    std::fs::remove_dir_all(&log_dir).unwrap();
    let (_, body) = serve.readyz_until(503, 100).await;
    assert!(body.contains("decision log"), "{body}");
    assert!(body.contains("not writable"), "{body}");
    assert_eq!(serve.probe("/healthz").await.0, 200);
    let _ = std::fs::remove_dir_all(&logs);
}

#[tokio::test]
async fn sigterm_drains_readyz_turns_503_in_flight_batch_answered_new_streams_refused() {
    let held = held_guard().await;
    let config = held_guard_config(
        &held.url,
        30000,
        "\n[server]\nshutdown_grace_ms = 20000\n",
        20000,
    );
    let mut serve = Serve::start("drain", &config).await;
    let (coordinator, mut in_flight) = serve.held_batch(&held).await;

    serve.signal("TERM");
    let (_, body) = while_held(
        &mut in_flight,
        "answered while held",
        serve.readyz_until(503, 200),
    )
    .await;
    assert!(body.contains("draining"), "{body}");
    // New streams are refused, on a new connection and on the open one.
    refuses_while_held(&mut in_flight, &serve.url).await;
    let second = while_held(&mut in_flight, "answered while held", async {
        match coordinator.session("late").await {
            Err(error) => Some(error),
            Ok(late) => late
                .evaluate(Batch::new(1).call("c1", "t", "{}"))
                .await
                .err(),
        }
    })
    .await;
    assert!(
        second.is_some(),
        "a stream opened while draining takes no batch"
    );
    assert_eq!(held.guard.requests(), 1, "nothing new reached the guard");

    // The in-flight batch is answered in full, then the process exits 0.
    held.guard.release();
    let d = in_flight
        .await
        .0
        .unwrap_or_else(|e| panic!("the in-flight batch: {e}\n{}", serve.log()));
    assert!(d.calls[0].proceeds(), "{d:?}");
    let status = serve.exit_within(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}:\n{}", serve.log());
}

/// A batch in flight: its answer, and its session.
type HeldBatch = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = (
                    Result<guardmesh_client::BatchDecision, ClientError>,
                    guardmesh_client::Session,
                ),
            > + Send,
    >,
>;

/// Fails unless the held batch `in_flight` ends within 10 s with its
/// stream cut (an error), not a decision; `what` names the cut.
async fn assert_cut(in_flight: HeldBatch, what: &str) {
    match tokio::time::timeout(Duration::from_secs(10), in_flight).await {
        Ok((
            Err(
                ClientError::Status(_)
                | ClientError::SessionClosed(_)
                | ClientError::NotJudged { .. },
            ),
            _,
        )) => {}
        other => panic!("{what}: {other:?}"),
    }
}

/// A mesh whose one guard, `held`, never answers, with batch timeouts of
/// 60 s and `grace_ms` of shutdown grace, and a batch `held` holds
/// ([`Serve::held_batch`]).
async fn serve_held(
    name: &str,
    held: &HeldHandle,
    grace_ms: u64,
) -> (Serve, Coordinator, HeldBatch) {
    let more =
        format!("max_batch_timeout_ms = 60000\n\n[server]\nshutdown_grace_ms = {grace_ms}\n");
    let config = held_guard_config(&held.url, 60000, &more, 60000);
    let serve = Serve::start(name, &config).await;
    let (coordinator, in_flight) = serve.held_batch(held).await;
    (serve, coordinator, in_flight)
}

#[tokio::test]
async fn sigterm_exits_within_the_grace_period_while_a_batch_is_still_held() {
    // The guard holds its batch for good; the mesh would wait up to the
    // batch's 60 s timeout without a grace period.
    let held = held_guard().await;
    let (mut serve, _coordinator, in_flight) = serve_held("grace", &held, 1000).await;

    serve.signal("TERM");
    // 1 s of grace; 20 s is the wide bound (the batch's timeout is 60 s).
    let status = serve.exit_within(Duration::from_secs(20)).await;
    serve.assert_exited_saying(status, "shutdown grace period over");
    // The coordinator sees its stream end with an error, not a decision.
    assert_cut(in_flight, "a batch cut by the grace period").await;
}

#[tokio::test]
async fn a_second_sigterm_cuts_the_drain_short() {
    // A 60 s grace and a batch held for good: only the second signal can
    // end the drain early (what an operator pressing Ctrl-C twice expects).
    let held = held_guard().await;
    let (mut serve, _coordinator, in_flight) = serve_held("second-signal", &held, 60000).await;

    serve.signal("TERM");
    let (status, _) = serve.readyz_until(503, 200).await;
    assert_eq!(status, 503, "draining after the first signal");
    // The drain holds: the batch is still in flight a second later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        serve.child.try_wait().unwrap().is_none(),
        "one signal drains, it does not exit with a batch in flight:\n{}",
        serve.log()
    );
    // The second signal (resent a few times in case the first resend came
    // before the mesh listened for it) ends the drain far inside the grace.
    let mut exited = None;
    for _ in 0..5 {
        serve.signal("TERM");
        exited = serve.exited_within(Duration::from_secs(2)).await;
        if exited.is_some() {
            break;
        }
    }
    let status = exited.unwrap_or_else(|| panic!("still draining:\n{}", serve.log()));
    serve.assert_exited_saying(status, "second shutdown signal");
    assert_cut(in_flight, "a batch cut by the second signal").await;
}

/// `systemd-analyze`, or None (with a message) where it is not installed.
fn systemd_analyze() -> Option<&'static str> {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        eprintln!(
            "SKIPPED: systemd-analyze is not installed (apt-get install systemd); \
             deploy/systemd/guardmesh.service not verified"
        );
    }
    found.then_some("systemd-analyze")
}

#[test]
fn systemd_unit_verifies_and_its_sandbox_exposure_stays_low() {
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    let unit = std::fs::read_to_string(repo_root().join("deploy/systemd/guardmesh.service"))
        .expect("deploy/systemd/guardmesh.service");
    for directive in [
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=\n",
        "StateDirectory=guardmesh",
        "KillSignal=SIGTERM",
        "Type=notify\n",
        "WatchdogSec=",
    ] {
        assert!(unit.contains(directive), "the unit lacks {directive:?}");
    }
    // docs/operations.md installs every credential the unit loads, root's
    // and mode 0600 (systemd reads it as root; the service reads the copy).
    let docs = std::fs::read_to_string(repo_root().join("docs/operations.md")).unwrap();
    let loaded: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("LoadCredential="))
        .collect();
    assert!(!loaded.is_empty(), "the unit loads no credentials");
    for credential in loaded {
        let (name, source) = credential.split_once(':').unwrap();
        assert!(
            docs.lines()
                .any(|l| l.starts_with("install -m 0600 ") && l.ends_with(source)),
            "docs/operations.md does not install {source} with mode 0600"
        );
        assert!(
            docs.contains(&format!("$CREDENTIALS_DIRECTORY/{name}")),
            "docs/operations.md's config does not read {name} from $CREDENTIALS_DIRECTORY"
        );
    }
    // verify checks that ExecStart names an executable: the one built here.
    let dir = fresh_dir("probes-systemd");
    let file = dir.join("guardmesh.service");
    std::fs::write(
        &file,
        unit.replace("/usr/local/bin/guardmesh", env!("CARGO_BIN_EXE_guardmesh")),
    )
    .unwrap();
    let verify = Command::new(analyze)
        .arg("verify")
        .arg(&file)
        .output()
        .expect("run systemd-analyze verify");
    let said = String::from_utf8_lossy(&verify.stderr);
    assert!(
        verify.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {}\n{said}",
        verify.status
    );
    // The sandbox's exposure score (0 best, 10 worst) at most 2.0.
    let security = Command::new(analyze)
        .args(["security", "--offline=true", "--threshold=20"])
        .arg(&file)
        .output()
        .expect("run systemd-analyze security");
    assert!(
        security.status.success(),
        "systemd-analyze security: exposure above 2.0:\n{}",
        String::from_utf8_lossy(&security.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Frames of one HTTP/2 connection read raw until the server closes it,
/// answering its SETTINGS and PINGs as a client must: the GOAWAY frames'
/// error codes, in order (bounded: 15 s).
async fn goaways_until_closed(port: u16) -> Vec<u32> {
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut goaways = Vec::new();
    let read = async {
        loop {
            let mut head = [0u8; 9];
            if tcp.read_exact(&mut head).await.is_err() {
                return;
            }
            let length =
                usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; length];
            if tcp.read_exact(&mut payload).await.is_err() {
                return;
            }
            match (head[3], head[4] & 1) {
                // SETTINGS, not an ACK: acknowledged.
                (4, 0) => tcp.write_all(b"\0\0\0\x04\x01\0\0\0\0").await.unwrap(),
                // PING, not an ACK: answered with its payload.
                (6, 0) => {
                    tcp.write_all(b"\0\0\x08\x06\x01\0\0\0\0").await.unwrap();
                    tcp.write_all(&payload).await.unwrap();
                }
                (7, _) => goaways.push(u32::from_be_bytes([
                    payload[4], payload[5], payload[6], payload[7],
                ])),
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(15), read)
        .await
        .expect("the connection was not closed within 15 s");
    goaways
}

/// `[server] max_connection_age_ms`: a connection past its age is sent
/// GOAWAY (NO_ERROR) and closed, so that long-lived coordinators and guards
/// spread over replicas added after they connected (docs/operations.md);
/// a coordinator's next batch goes over a new connection and no batch is
/// lost (R19: each answered exactly once); a stream still open when the
/// grace after the GOAWAY ends is cut, and a new one works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_connections_past_their_age_get_goaway_and_clients_reconnect() {
    let policy = repo_root().join("examples/policy/policy.toml");
    let serve = Serve::start(
        "connection-age",
        &format!(
            "[server]\nmax_connection_age_ms = 300\nmax_connection_age_grace_ms = 1500\n\
             [decision_log]\ndir = \"log\"\n\
             [[guard]]\nname = \"sql-policy\"\npolicy = {:?}\ntools = [\"sql.*\"]\n",
            policy.display().to_string()
        ),
    )
    .await;
    let port: u16 = serve.url.rsplit(':').next().unwrap().parse().unwrap();

    // An idle connection: GOAWAY with NO_ERROR, then closed.
    let mut coordinator = None;
    for _ in 0..200 {
        if let Ok(c) = Coordinator::connect(serve.url.clone()).await {
            coordinator = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let coordinator = coordinator.expect("the mesh's listener came up");
    let goaways = goaways_until_closed(port).await;
    assert!(
        !goaways.is_empty() && goaways.iter().all(|code| *code == 0),
        "GOAWAY frames before the close: {goaways:?}\n{}",
        serve.log()
    );

    // Unary batches spread over several ages: every one answered.
    let batches = 8u32;
    for turn in 0..batches {
        let decision = coordinator
            .evaluate_once(
                "aged",
                Batch::new(turn).call("c1", "sql.query", r#"{"query": "SELECT 1"}"#),
            )
            .await
            .unwrap_or_else(|e| panic!("batch {turn} lost: {e:?}\n{}", serve.log()));
        assert_eq!(decision.execute.len(), 1, "{decision:?}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let aged = records(&serve.dir.join("log"));
    let peers: std::collections::BTreeSet<String> = aged
        .iter()
        .filter(|r| r["kind"] == "decision")
        .map(|r| r["caller"]["peer"].as_str().unwrap_or_default().to_owned())
        .collect();
    let decided = aged.iter().filter(|r| r["kind"] == "decision").count();
    assert_eq!(decided, batches as usize, "each batch judged once");
    assert!(
        peers.len() >= 2,
        "the coordinator never reconnected: peers {peers:?}"
    );

    // A stream kept open past the age and its grace is cut. The SDK's
    // session opens a new stream on the next batch: a batch in flight at
    // the cut fails as not judged (none of its calls runs), every other
    // one is judged, and the session's batches came over more than one
    // connection.
    let session = coordinator.session("long").await.unwrap();
    let mut judged = Vec::new();
    let mut cut = Vec::new();
    for turn in 0..40 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match session
            .evaluate(Batch::new(turn).call("c1", "sql.query", r#"{"query": "SELECT 1"}"#))
            .await
        {
            Ok(decision) => {
                assert_eq!(decision.execute.len(), 1, "{decision:?}");
                judged.push(decision.batch_id.clone());
            }
            // The connection went under the batch: tonic reports it as
            // UNAVAILABLE, or UNKNOWN when the reset came while reading a
            // body.
            Err(ClientError::Status(status))
            | Err(ClientError::NotJudged {
                status: Some(status),
                ..
            }) => {
                assert!(
                    matches!(
                        status.code(),
                        tonic::Code::Unavailable | tonic::Code::Unknown
                    ),
                    "{status:?}"
                );
                cut.push(turn);
            }
            Err(ClientError::SessionClosed(_))
            | Err(ClientError::NotJudged { status: None, .. }) => cut.push(turn),
            Err(other) => panic!("batch {turn} of a stream past its age: {other:?}"),
        }
    }
    assert!(
        cut.len() <= 4,
        "a cut fails at most the batch in flight: {cut:?}"
    );
    let written = records(&serve.dir.join("log"));
    let long: Vec<&serde_json::Value> = written
        .iter()
        .filter(|r| r["kind"] == "decision" && r["batch"]["session_id"] == "long")
        .collect();
    // Every batch the client was answered for is recorded once; a batch
    // cut on its way back may have been decided (and so recorded) before
    // the cut: at most one record each, and no more records than that.
    for id in &judged {
        let n = long
            .iter()
            .filter(|r| r["batch"]["batch_id"] == id.as_str())
            .count();
        assert_eq!(n, 1, "batch {id} answered and recorded {n} times");
    }
    assert!(
        long.len() >= judged.len() && long.len() <= judged.len() + cut.len(),
        "{} records for {} answered and {} cut batches",
        long.len(),
        judged.len(),
        cut.len()
    );
    let peers: std::collections::BTreeSet<&str> = long
        .iter()
        .map(|r| r["caller"]["peer"].as_str().unwrap_or_default())
        .collect();
    assert!(
        peers.len() >= 2,
        "the long stream was never cut past its age and grace: peers {peers:?}\n{}",
        serve.log()
    );
}

/// Reads datagrams from the NOTIFY_SOCKET stand-in until one holds `line`
/// (bounded: 30 s); every datagram read, in order.
async fn notified_until(
    socket: &tokio::net::UnixDatagram,
    line: &str,
    log: &dyn Fn() -> String,
) -> Vec<String> {
    let mut seen = Vec::new();
    let read = async {
        let mut buf = vec![0u8; 4096];
        loop {
            let n = socket.recv(&mut buf).await.unwrap();
            let message = String::from_utf8_lossy(&buf[..n]).into_owned();
            let done = message.lines().any(|l| l == line);
            seen.push(message);
            if done {
                return;
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .is_err()
    {
        panic!("no {line} within 30 s; got {seen:?}\n{}", log());
    }
    seen
}

/// systemd `Type=notify` (deploy/systemd/guardmesh.service): `READY=1` is
/// sent only once the gRPC listener accepts connections (a batch sent the
/// moment it arrives is judged), `WATCHDOG=1` keeps coming at half of
/// `WATCHDOG_USEC`, `STOPPING=1` when SIGTERM starts the drain; the signing
/// key is read from `$CREDENTIALS_DIRECTORY` (`LoadCredential=`), as the
/// unit passes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_ready_after_the_listener_watchdog_stopping_and_credentials() {
    let dir = fresh_dir("systemd-notify");
    let credentials = dir.join("credentials");
    std::fs::create_dir_all(&credentials).unwrap();
    let keygen = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["log", "keygen", "--out"])
        .arg(credentials.join("log-signing.key"))
        .output()
        .unwrap();
    assert!(keygen.status.success(), "{keygen:?}");
    let socket = tokio::net::UnixDatagram::bind(dir.join("notify.sock")).unwrap();
    let policy = repo_root().join("examples/policy/policy.toml");
    let config = dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[decision_log]\ndir = \"log\"\nsigning_key = \"$CREDENTIALS_DIRECTORY/log-signing.key\"\n\
             [[guard]]\nname = \"sql-policy\"\npolicy = {:?}\ntools = [\"sql.*\"]\n",
            policy.display().to_string()
        ),
    )
    .unwrap();
    let port = free_port();
    let log_file = dir.join("mesh.log");
    let mut child = serve_command(&config, port)
        .env("NOTIFY_SOCKET", dir.join("notify.sock"))
        .env("WATCHDOG_USEC", "200000")
        .env("CREDENTIALS_DIRECTORY", &credentials)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_file).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log_file).unwrap_or_default();

    let first = notified_until(&socket, "READY=1", &log).await;
    assert!(first.iter().all(|m| !m.contains("STOPPING=1")), "{first:?}");
    // Ready means listening: no retry.
    let coordinator = Coordinator::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap_or_else(|e| panic!("READY=1 before the listener was up: {e}\n{}", log()));
    let decision = coordinator
        .evaluate_once(
            "s",
            Batch::new(0).call("c1", "sql.query", r#"{"query": "DELETE FROM users"}"#),
        )
        .await
        .unwrap();
    assert!(decision.execute.is_empty(), "{decision:?}");
    // The watchdog keeps being fed while the mesh runs.
    for _ in 0..3 {
        notified_until(&socket, "WATCHDOG=1", &log).await;
    }
    send_signal(&child, "TERM");
    notified_until(&socket, "STOPPING=1", &log).await;
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status}\n{}", log());
    // The log was signed with the key from the credentials folder.
    assert!(
        std::fs::read_dir(dir.join("log"))
            .unwrap()
            .flatten()
            .any(|f| f.file_name().to_string_lossy().contains("checkpoint")
                || std::fs::read_to_string(f.path()).is_ok_and(|t| t.contains("\"checkpoint\""))),
        "no checkpoint signed\n{}",
        log()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
