//! Session memory shared by real `guardmesh serve` replicas (R34): through
//! the registry's etcd (a real 3-member cluster) and through a real Redis,
//! with the relaybleed policy (`examples/policy/relaybleed.toml`). A secret
//! read through one replica (its result sent back through the results
//! phase, R33) and sent to another server through the other replica is
//! cancelled; with the store down or answering garbage the session rules
//! fail closed (R13), never "no history, so proceed". A shared store
//! without the session secret does not start.
//!
//! Redis is Debian's `redis-server` (scripts/setup-redis), started by each
//! test on a free loopback port with nothing saved; a test that needs it
//! says so loudly and returns when the binary is absent.
//!
//! `r34_store_costs_per_batch` prints what each store adds per batch.

use crate::etcd::Cluster;
use crate::harness::*;
use guardmesh_client::{Batch, BatchDecision, Coordinator, Outcome};
use guardmesh_server::session::{CallRan, SessionKey, Update, store::sessions_prefix};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The value a `.env` read returns, and that must not reach sqlite.
const SECRET: &str = "hunter2-Sup3rS3cretValue";

pub(crate) fn secret_file(dir: &Path, name: &str) -> PathBuf {
    session_secret(dir, name)
}

/// A mesh config: `registry` and `sessions` sections, and the relaybleed
/// policy as the fail-closed guard `flows`.
pub(crate) fn mesh_config(dir: &Path, registry: &str, sessions: &str) -> String {
    let policy = dir.join("relaybleed.toml");
    std::fs::copy(repo_root().join("examples/policy/relaybleed.toml"), &policy).unwrap();
    format!(
        "{registry}\n\n[sessions]\n{sessions}\n\n[[guard]]\nname = \"flows\"\npolicy = {:?}\n\
         failure_policy = \"fail_closed\"\n",
        policy.display().to_string()
    )
}

/// `[registry]` on etcd at `endpoints` under `prefix`, with a staleness
/// window longer than any test: a lost quorum never refuses the batches
/// here, so what is asserted is the session rules' own failure.
pub(crate) fn etcd_registry(endpoints: &[String], prefix: &str) -> String {
    let endpoints: Vec<String> = endpoints.iter().map(|e| format!("{e:?}")).collect();
    format!(
        "[registry]\nkind = \"etcd\"\nendpoints = [{}]\nprefix = {prefix:?}\n\
         request_timeout_ms = 700\nheartbeat_interval_ms = 200\nstaleness_window_ms = 600000",
        endpoints.join(", ")
    )
}

/// Two `guardmesh serve` replicas, `NAME-a` on the first member of
/// `cluster` and `NAME-b` on the others, their chain and session memory
/// in etcd under `/t/NAME`, one secret file in `dir`; `[sessions]` has
/// `more` lines besides.
pub(crate) async fn etcd_replicas(
    cluster: &Cluster,
    dir: &Path,
    name: &str,
    more: &str,
) -> (MeshProcess, MeshProcess) {
    let urls = cluster.urls();
    let secret = secret_file(dir, "session.secret");
    let prefix = format!("/t/{name}");
    let sessions = format!("secret_file = {:?}\n{more}", secret.display().to_string());
    let mut replicas = Vec::new();
    for (replica, urls) in [("a", &urls[..1]), ("b", &urls[1..])] {
        let config = mesh_config(dir, &etcd_registry(urls, &prefix), &sessions);
        replicas.push(MeshProcess::start(&format!("{name}-{replica}"), &config, None).await);
    }
    let b = replicas.pop().unwrap();
    (replicas.pop().unwrap(), b)
}

/// Two `guardmesh serve` replicas `NAME-a` and `NAME-b` of one config,
/// their session memory in `redis` and their registries (each its own, in
/// memory) under `/t/NAME`, one secret file in `dir`; `[sessions]` has
/// `more` lines besides.
pub(crate) async fn redis_replicas(
    redis: &Redis,
    dir: &Path,
    name: &str,
    more: &str,
) -> (MeshProcess, MeshProcess) {
    let secret = secret_file(dir, "session.secret");
    let registry = format!("[registry]\nprefix = \"/t/{name}\"");
    let sessions = format!(
        "store = \"redis\"\nredis_url = {:?}\nsecret_file = {:?}\n{more}",
        redis.url(),
        secret.display().to_string()
    );
    let config = mesh_config(dir, &registry, &sessions);
    let a = MeshProcess::start(&format!("{name}-a"), &config, None).await;
    let b = MeshProcess::start(&format!("{name}-b"), &config, None).await;
    (a, b)
}

/// The batch outcome of the one call `c` of `tool`.
async fn outcome(c: &Coordinator, session: &str, turn: u32, tool: &str, args: &str) -> Outcome {
    decide(c, session, Batch::new(turn).call("c", tool, args))
        .await
        .call("c")
        .unwrap()
        .outcome
        .clone()
}

/// The outcome of a harmless fetch in `session` (batch `turn`): what the
/// session rules let through once they can read the memory.
async fn fetch(c: &Coordinator, session: &str, turn: u32) -> Outcome {
    outcome(
        c,
        session,
        turn,
        "http.get",
        r#"{"url":"https://example.com"}"#,
    )
    .await
}

/// The memory's update of one call `id` of `fs.read_file` on server `fs`
/// (arguments of 16 zero bytes), as a replica records it.
fn read_file_ran(id: String) -> Update {
    Update {
        calls: vec![CallRan {
            id,
            tool: "fs.read_file".into(),
            server: "fs".into(),
            args: "00".repeat(16),
            at: 0,
            seq: 0,
        }],
        ..Update::default()
    }
}

/// `batch` in `session`, answered within 10 s.
async fn decide(c: &Coordinator, session: &str, batch: Batch) -> BatchDecision {
    tokio::time::timeout(Duration::from_secs(10), c.evaluate_once(session, batch))
        .await
        .expect("answered within 10 s")
        .expect("answered")
}

/// The `.env` read: the call runs through `reader`, its result (holding
/// `SECRET`) comes back through the results phase of the same replica.
async fn read_the_secret(reader: &Coordinator, session: &str) {
    let d = decide(
        reader,
        session,
        Batch::new(1).call("r1", "fs.read_file", r#"{"path":".env"}"#),
    )
    .await;
    assert_eq!(d.call("r1").unwrap().outcome, Outcome::Proceed, "{d:?}");
    let result = serde_json::json!({
        "content": [{"type": "text", "text": format!("DB_PASSWORD={SECRET}\nDEBUG=1\n")}]
    })
    .to_string();
    decide(
        reader,
        session,
        Batch::new(2).result("r1", "fs.read_file", "fs", result),
    )
    .await;
}

fn insert_secret() -> String {
    format!(r#"{{"sql":"INSERT INTO notes VALUES ('{SECRET}')"}}"#)
}

fn cancelled(o: &Outcome) -> bool {
    matches!(o, Outcome::Cancel { .. })
}

/// The relaybleed flow across two replicas: read through `a`, sent to
/// sqlite through `b` (cancelled); written back to fs through `b`, and the
/// same insert in another session (allowed).
async fn flow_across(a: &Coordinator, b: &Coordinator, session: &str) {
    // Before the read: allowed on either replica.
    assert_eq!(
        outcome(b, session, 0, "sqlite.query", &insert_secret()).await,
        Outcome::Proceed
    );
    read_the_secret(a, session).await;
    let o = outcome(b, session, 3, "sqlite.query", &insert_secret()).await;
    assert!(
        cancelled(&o),
        "a secret read on one replica and sent on the other must be cancelled: {o:?}"
    );
    assert_eq!(
        outcome(
            b,
            session,
            4,
            "fs.write_file",
            &format!(r#"{{"path":"backup.env","text":"{SECRET}"}}"#)
        )
        .await,
        Outcome::Proceed,
        "written back to fs: allowed"
    );
    assert_eq!(
        outcome(
            b,
            &format!("{session}-other"),
            0,
            "sqlite.query",
            &insert_secret()
        )
        .await,
        Outcome::Proceed,
        "another session never read it"
    );
}

/// A coordinator on each of the replicas `a` and `b`, once the flow ran
/// across them in session `s` ([`flow_across`]).
async fn flowed_across(a: &MeshProcess, b: &MeshProcess) -> (Coordinator, Coordinator) {
    let (ca, cb) = (
        Coordinator::connect(a.url.clone()).await.unwrap(),
        Coordinator::connect(b.url.clone()).await.unwrap(),
    );
    flow_across(&ca, &cb, "s").await;
    (ca, cb)
}

/// A batch whose session rules cannot read the memory: cancelled as a
/// failure (fail_closed), answered within `bound`.
async fn fails_closed(c: &Coordinator, session: &str, bound: Duration) -> BatchDecision {
    let started = Instant::now();
    let d = decide(
        c,
        session,
        Batch::new(9).call("c", "http.get", r#"{"url":"https://example.com"}"#),
    )
    .await;
    let took = started.elapsed();
    let call = d.call("c").unwrap();
    assert!(
        cancelled(&call.outcome) && call.failure,
        "the store cannot answer: fail closed, never proceed: {call:?}"
    );
    assert!(took < bound, "answered in {took:?}, past {bound:?}");
    d
}

// ---------------------------------------------------------------------------
// A real Redis
// ---------------------------------------------------------------------------

fn redis_binary() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join("redis-server"))
        .chain([PathBuf::from("/usr/bin/redis-server")])
        .find(|candidate| candidate.is_file())
}

/// A [`Redis`] for the test `$test`, or a return from the test (skipped,
/// said loudly) when `redis-server` is not installed.
macro_rules! redis_or_skip {
    ($test:literal) => {
        match Redis::start($test).await {
            Some(redis) => redis,
            None => return,
        }
    };
}

/// `redis-server` on a free loopback port, nothing saved; killed when
/// dropped.
pub(crate) struct Redis {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl Redis {
    /// None (said loudly) when `redis-server` is not installed.
    pub(crate) async fn start(test: &str) -> Option<Self> {
        let Some(bin) = redis_binary() else {
            eprintln!(
                "\n!!! {test}: SKIPPED: redis-server is not installed; run scripts/setup-redis \
                 (apt-get install -y redis-server) !!!\n"
            );
            return None;
        };
        for _ in 0..3 {
            let mut redis = Self {
                child: None,
                port: free_port(),
                dir: fresh_dir("store-redis"),
            };
            if redis.spawn(&bin).await {
                return Some(redis);
            }
            eprintln!(
                "redis-server did not start on {}: {}",
                redis.port,
                redis.log()
            );
        }
        panic!("redis-server did not start, 3 times");
    }

    /// Starts the process on the struct's port; whether it answers PING
    /// within 10 s.
    async fn spawn(&mut self, bin: &Path) -> bool {
        let log = std::fs::File::create(self.dir.join("redis.log")).unwrap();
        let child = Command::new(bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return true;
            }
            if let Some(child) = &mut self.child
                && let Ok(Some(_)) = child.try_wait()
            {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Starts it again on the same port (empty: nothing was saved).
    pub(crate) async fn restart(&mut self) {
        self.kill();
        let bin = redis_binary().expect("redis-server");
        assert!(
            self.spawn(&bin).await,
            "redis-server did not start again: {}",
            self.log()
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process's id, while it runs.
    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn connection(&self) -> Option<redis::Connection> {
        let client = redis::Client::open(self.url()).ok()?;
        client
            .get_connection_with_timeout(Duration::from_secs(2))
            .ok()
    }

    fn ping(&self) -> bool {
        self.connection()
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).ok())
            .is_some_and(|p| p == "PONG")
    }

    /// Runs one command and returns its answer.
    pub(crate) fn command<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.connection().expect("connect to the test's redis");
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut c)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// Calls of `command` (lower case) since the start, from `INFO
    /// commandstats`.
    pub(crate) fn calls(&self, command: &str) -> u64 {
        let info: String = self.command(&["INFO", "commandstats"]);
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The name of `session`'s key (no identity: a mesh without principals)
/// in a shared store under the registry's `prefix`, the replicas' session
/// secret in the file `secret`.
fn stored_key(prefix: &str, session: &str, secret: &Path) -> String {
    let digester = guardmesh_server::session::secret::read_secret(secret).unwrap();
    format!(
        "{}{}",
        sessions_prefix(prefix),
        SessionKey::new("", session).stored_name(&digester)
    )
}

/// The name a reader of the store without the secret would guess for
/// `session`: a plain SHA-256 of its key.
fn guessed_key(prefix: &str, session: &str) -> String {
    use sha2::Digest as _;
    let plain = sha2::Sha256::digest(SessionKey::new("", session).store_key().as_bytes());
    let hex: String = plain.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}{hex}", sessions_prefix(prefix))
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

/// Two `guardmesh serve` replicas, each on its own members of a 3-member
/// etcd cluster, the session memory in the registry's etcd (the default
/// with an etcd registry), one secret file: the relaybleed flow read on
/// one and sent on the other is cancelled; the store holds no value and
/// no secret, outside the registry's keys; with the quorum gone the session
/// rules fail closed within the store's deadline (R34, R13).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_two_serve_replicas_on_a_3_member_etcd_share_session_memory() {
    let mut cluster = Cluster::start().await;
    let urls = cluster.urls();
    let dir = fresh_dir("store-etcd");
    let (a, b) = etcd_replicas(&cluster, &dir, "store-etcd", "store_timeout_ms = 300").await;
    let (prefix, secret) = ("/t/store-etcd", secret_file(&dir, "session.secret"));
    let (ca, cb) = flowed_across(&a, &b).await;
    // What etcd holds: the sessions beside the registry's keys, by digest
    // only; neither the value read nor the session secret.
    let mut client = etcd_client::Client::connect(urls.clone(), None)
        .await
        .unwrap();
    let all = client
        .get("", Some(etcd_client::GetOptions::new().with_all_keys()))
        .await
        .unwrap();
    let secret_bytes = std::fs::read(&secret).unwrap();
    let mut sessions_seen = 0;
    for kv in all.kvs() {
        let (key, value) = (String::from_utf8_lossy(kv.key()), kv.value());
        assert!(
            !value.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "{key} holds the value read"
        );
        assert!(
            !value.windows(32).any(|w| w == &secret_bytes[..32]),
            "{key} holds the session secret"
        );
        if key.starts_with(&sessions_prefix(prefix)) && !key.ends_with("/secret-check") {
            sessions_seen += 1;
        }
        assert!(
            !key.starts_with(&format!("{prefix}/")) || !key.contains("session"),
            "session memory under the registry's watched prefix: {key}"
        );
    }
    assert_eq!(sessions_seen, 2, "sessions s and s-other");
    let key = stored_key(prefix, "s", &secret);
    let held = client.get(key.as_str(), None).await.unwrap();
    assert_eq!(held.kvs().len(), 1, "{key}");
    // Without the secret, a guess of who has a session is not confirmed.
    let guess = guessed_key(prefix, "s");
    let held = client.get(guess.as_str(), None).await.unwrap();
    assert!(held.kvs().is_empty(), "{guess} confirms a guessed session");
    // The quorum gone: every linearizable read is refused; the session
    // rules fail closed within the store's deadline, on both replicas.
    cluster.members[1].kill();
    cluster.members[2].kill();
    let started = Instant::now();
    let d = fails_closed(&ca, "s", Duration::from_secs(5)).await;
    eprintln!(
        "etcd without quorum: a session batch answered (cancelled) in {:?}",
        started.elapsed()
    );
    let error = &d.guard("flows").unwrap().error;
    assert!(error.contains("session memory"), "{error}");
    fails_closed(&cb, "s", Duration::from_secs(5)).await;
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same with `store = "redis"` on two replicas whose registries are
/// their own (memory): the flow is cancelled across them; a session whose
/// value in Redis is not JSON, or not a string, fails closed (Corrupt)
/// without being overwritten; with Redis gone, the session rules fail
/// closed within the store's deadline; Redis back, they judge again, and a
/// session Redis lost reads as lost, never as new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_two_serve_replicas_on_redis_share_session_memory() {
    let mut redis = redis_or_skip!("r34_two_serve_replicas_on_redis_share_session_memory");
    let dir = fresh_dir("store-redis");
    let (a, b) = redis_replicas(&redis, &dir, "store-redis", "store_timeout_ms = 300").await;
    let (prefix, secret) = ("/t/store-redis", secret_file(&dir, "session.secret"));
    let (ca, cb) = flowed_across(&a, &b).await;
    // One key per session, JSON, on a time to live of the memory's age
    // (24 h by default); no value read, no secret.
    let key = stored_key(prefix, "s", &secret);
    let value: String = redis.command(&["GET", &key]);
    // Without the secret, a guess of who has a session is not confirmed.
    let guessed: i64 = redis.command(&["EXISTS", &guessed_key(prefix, "s")]);
    assert_eq!(guessed, 0, "a guessed session name is in Redis");
    let memory: serde_json::Value = serde_json::from_str(&value).unwrap();
    assert!(
        memory["seen"].as_array().is_some_and(|s| !s.is_empty()),
        "{value}"
    );
    assert!(!value.contains(SECRET));
    let ttl: i64 = redis.command(&["PTTL", &key]);
    assert!(ttl > 23 * 3600 * 1000 && ttl <= 24 * 3600 * 1000, "{ttl}");
    let keys: Vec<String> = redis.command(&["KEYS", "*"]);
    let secret_bytes = std::fs::read(&secret).unwrap();
    for k in &keys {
        assert!(k.starts_with(&sessions_prefix(prefix)), "{k}");
        let v: Vec<u8> = redis.command(&["GET", k]);
        assert!(!v.windows(32).any(|w| w == &secret_bytes[..32]), "{k}");
    }
    let sessions = keys.iter().filter(|k| !k.ends_with("/secret-check"));
    assert_eq!(
        sessions.count(),
        2,
        "sessions s and s-other, and the check: {keys:?}"
    );
    // Garbage in the store: not JSON, then not a string. Never read as an
    // empty session, never overwritten by the next update.
    let garbage = stored_key(prefix, "g", &secret);
    let _: () = redis.command(&["SET", &garbage, "{not json"]);
    let d = fails_closed(&cb, "g", Duration::from_secs(5)).await;
    let error = &d.guard("flows").unwrap().error;
    assert!(error.contains("cannot be read"), "{error}");
    let still: String = redis.command(&["GET", &garbage]);
    assert_eq!(still, "{not json");
    let _: () = redis.command(&["DEL", &garbage]);
    let _: i64 = redis.command(&["LPUSH", &garbage, "x"]);
    fails_closed(&ca, "g", Duration::from_secs(5)).await;
    // Redis gone: fail closed within the deadline, on both replicas.
    redis.kill();
    let started = Instant::now();
    fails_closed(&ca, "s", Duration::from_secs(5)).await;
    eprintln!(
        "redis down: a session batch answered (cancelled) in {:?}",
        started.elapsed()
    );
    fails_closed(&cb, "s", Duration::from_secs(5)).await;
    // Redis back (empty): each replica connects again by itself, and the
    // rules judge again, within a bounded wait.
    redis.restart().await;
    for c in [&ca, &cb] {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let o = fetch(c, "after", 0).await;
            if o == Outcome::Proceed {
                break;
            }
            assert!(Instant::now() < deadline, "Redis is back, yet: {o:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Redis came back without the session `s`, which read the secret: on
    // both replicas (each wrote `s`) it reads as a session that lost its
    // memory, never as a new one, so relaybleed as shipped still cancels
    // the secret's insert; the first write begins it again as lost.
    for c in [&ca, &cb] {
        let o = outcome(c, "s", 10, "sqlite.query", &insert_secret()).await;
        assert!(
            matches!(&o, Outcome::Cancel { content } if content.contains("forgot values")),
            "a session the store lost reads as new: {o:?}"
        );
    }
    let o = outcome(&ca, "s", 11, "fs.read_file", r#"{"path":"notes.txt"}"#).await;
    assert_eq!(o, Outcome::Proceed);
    let value: String = redis.command(&["GET", &key]);
    let memory: serde_json::Value = serde_json::from_str(&value).unwrap();
    assert_eq!(memory["dropped"], true, "{value}");
    let o = outcome(&cb, "s", 12, "sqlite.query", &insert_secret()).await;
    assert!(matches!(o, Outcome::Cancel { .. }), "{o:?}");
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Refused starts (R34): a shared store (etcd through the registry, or
/// Redis) without `sessions.secret_file`, naming the key and how to make
/// one; a secret file too short, a placeholder, or missing; a Redis URL of
/// another scheme or with `#insecure`; `redis_url` without `store =
/// "redis"`. None of them needs the store running: each is refused before
/// anything is connected. `config check` reports the missing secret too.
/// Starts `guardmesh serve` on `config` and waits (at most 20 s) for it
/// to exit; panics naming `what` if it starts or exits with success.
/// Returns what it logged.
async fn refused_start(config: &Path, log: &Path, what: &str) -> String {
    let mut child = spawn_serve(config, free_port(), log, None);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "{what}: the mesh started: {}",
                std::fs::read_to_string(log).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let text = std::fs::read_to_string(log).unwrap();
    assert!(!status.success(), "{what}: {text}");
    text
}

#[tokio::test]
async fn r34_a_shared_store_without_a_usable_secret_does_not_start() {
    let dir = fresh_dir("store-refused");
    let etcd = etcd_registry(&["http://127.0.0.1:9".to_owned()], "/t/refused");
    let short = dir.join("short.secret");
    std::fs::write(&short, [7u8; 16]).unwrap();
    let blank = dir.join("blank.secret");
    std::fs::write(&blank, [b'a'; 48]).unwrap();
    let good = secret_file(&dir, "good.secret");
    let empty = dir.join("empty.password");
    std::fs::write(&empty, "\n").unwrap();
    let cases: Vec<(&str, String, String, &[&str])> = vec![
        (
            "etcd-no-secret",
            etcd.clone(),
            String::new(),
            &["sessions.secret_file", "head -c 32 /dev/urandom", "etcd"],
        ),
        (
            "redis-no-secret",
            String::new(),
            "store = \"redis\"\nredis_url = \"redis://127.0.0.1:9\"".into(),
            &["sessions.secret_file", "head -c 32 /dev/urandom", "redis"],
        ),
        (
            "short",
            etcd.clone(),
            format!("secret_file = {:?}", short.display().to_string()),
            &["sessions.secret_file", "16 bytes", "at least 32"],
        ),
        (
            "placeholder",
            etcd.clone(),
            format!("secret_file = {:?}", blank.display().to_string()),
            &["sessions.secret_file", "placeholder"],
        ),
        (
            "missing",
            etcd.clone(),
            format!(
                "secret_file = {:?}",
                dir.join("nothing-here").display().to_string()
            ),
            &["sessions.secret_file", "cannot read"],
        ),
        (
            "scheme",
            String::new(),
            format!(
                "store = \"redis\"\nredis_url = \"http://127.0.0.1:6379\"\nsecret_file = {:?}",
                good.display().to_string()
            ),
            &["sessions.redis_url", "redis://"],
        ),
        (
            "insecure",
            String::new(),
            format!(
                "store = \"redis\"\nredis_url = \"rediss://127.0.0.1:6379/#insecure\"\nsecret_file = {:?}",
                good.display().to_string()
            ),
            &["sessions.redis_url", "fragment"],
        ),
        (
            "empty-password",
            String::new(),
            format!(
                "store = \"redis\"\nredis_url = \"redis://127.0.0.1:9\"\nsecret_file = {:?}\nredis_password_file = {:?}",
                good.display().to_string(),
                empty.display().to_string()
            ),
            &["sessions.redis_password_file", "empty"],
        ),
        (
            "url-without-redis",
            String::new(),
            "redis_url = \"redis://127.0.0.1:6379\"".into(),
            &["sessions.redis_url", "store = \"redis\""],
        ),
    ];
    for (name, registry, sessions, expected) in cases {
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, mesh_config(&dir, &registry, &sessions)).unwrap();
        let text = refused_start(&file, &dir.join(format!("{name}.log")), name).await;
        for part in expected {
            assert!(text.contains(part), "{name}: {part:?} not in: {text}");
        }
    }
    // `config check` says the same, with the key and how to fix it.
    let file = dir.join("check.toml");
    std::fs::write(&file, mesh_config(&dir, &etcd, "")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["config", "check"])
        .arg(&file)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("sessions.secret_file"), "{text}");
    assert!(text.contains("head -c 32 /dev/urandom"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// p50 and p99 of `n` session-reading batches (one `fs.read_file` call,
/// recorded) through `c`, in one session.
async fn timed_batches(c: &Coordinator, session: &str, n: u32) -> (Duration, Duration) {
    let mut took = Vec::new();
    for turn in 0..n {
        let started = Instant::now();
        let d = decide(
            c,
            session,
            Batch::new(turn).call(
                format!("c{turn}"),
                "fs.read_file",
                format!(r#"{{"path":"f{turn}"}}"#),
            ),
        )
        .await;
        took.push(started.elapsed());
        assert_eq!(d.calls[0].outcome, Outcome::Proceed);
    }
    took.sort();
    (took[took.len() / 2], took[took.len() * 99 / 100])
}

/// What each store adds to a batch that reads session memory (printed, not
/// asserted: the lead's bench holds the figures): p50 and p99 of 200
/// batches through a `guardmesh serve` with the memory in its own memory,
/// in a 3-member etcd, and in Redis; the store's writes per batch (etcd's
/// revision, Redis's command counts); and how long a batch takes to be
/// cancelled with the store down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_store_costs_per_batch() {
    const N: u32 = 200;
    let dir = fresh_dir("store-costs");
    let secret = secret_file(&dir, "session.secret");
    let secret = secret.display().to_string();
    let mut lines = Vec::new();
    // In the mesh's memory.
    let memory = MeshProcess::start(
        "store-costs-memory",
        &mesh_config(
            &dir,
            "",
            &format!("store = \"memory\"\nsecret_file = {secret:?}"),
        ),
        None,
    )
    .await;
    let c = Coordinator::connect(memory.url.clone()).await.unwrap();
    timed_batches(&c, "warm", 20).await;
    let (p50_memory, p99) = timed_batches(&c, "s", N).await;
    lines.push(format!("memory: p50 {p50_memory:?} p99 {p99:?}"));
    drop(memory);
    // etcd, 3 members.
    let mut cluster = Cluster::start().await;
    let prefix = "/t/costs";
    let etcd = MeshProcess::start(
        "store-costs-etcd",
        &mesh_config(
            &dir,
            &etcd_registry(&cluster.urls(), prefix),
            &format!("secret_file = {secret:?}"),
        ),
        None,
    )
    .await;
    let c = Coordinator::connect(etcd.url.clone()).await.unwrap();
    timed_batches(&c, "warm", 20).await;
    let mut client = etcd_client::Client::connect(cluster.urls(), None)
        .await
        .unwrap();
    let revision = |r: etcd_client::GetResponse| r.header().map_or(0, |h| h.revision());
    let before = revision(client.get("x", None).await.unwrap());
    let (p50, p99) = timed_batches(&c, "s", N).await;
    let after = revision(client.get("x", None).await.unwrap());
    lines.push(format!(
        "etcd (3 members): p50 {p50:?} (+{:?}) p99 {p99:?}; {:.2} writes per batch",
        p50.saturating_sub(p50_memory),
        (after - before) as f64 / f64::from(N)
    ));
    cluster.members[1].kill();
    cluster.members[2].kill();
    let started = Instant::now();
    fails_closed(&c, "s", Duration::from_secs(5)).await;
    lines.push(format!(
        "etcd without quorum: cancelled (fail_closed) in {:?}",
        started.elapsed()
    ));
    drop(etcd);
    drop(cluster);
    // Redis.
    if let Some(mut redis) = Redis::start("r34_store_costs_per_batch").await {
        let mesh = MeshProcess::start(
            "store-costs-redis",
            &mesh_config(
                &dir,
                "",
                &format!(
                    "store = \"redis\"\nredis_url = {:?}\nsecret_file = {secret:?}",
                    redis.url()
                ),
            ),
            None,
        )
        .await;
        let c = mesh.coordinator().await;
        timed_batches(&c, "warm", 20).await;
        let (gets, sets) = (
            redis.calls("get"),
            redis.calls("evalsha") + redis.calls("eval"),
        );
        let (p50, p99) = timed_batches(&c, "s", N).await;
        let (gets, sets) = (
            redis.calls("get") - gets,
            redis.calls("evalsha") + redis.calls("eval") - sets,
        );
        lines.push(format!(
            "redis: p50 {p50:?} (+{:?}) p99 {p99:?}; {:.2} writes and {:.2} reads per batch",
            p50.saturating_sub(p50_memory),
            sets as f64 / f64::from(N),
            gets as f64 / f64::from(N)
        ));
        redis.kill();
        let started = Instant::now();
        fails_closed(&c, "s", Duration::from_secs(5)).await;
        lines.push(format!(
            "redis down: cancelled (fail_closed) in {:?}",
            started.elapsed()
        ));
    }
    eprintln!("\nsession store costs per session-reading batch ({N} batches, one call each):");
    for line in lines {
        eprintln!("  {line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two replicas' stores (each its own connection) updating one session at
/// once, 4 tasks each, 10 updates a task: every update that succeeded is
/// in the memory (none overwrote another), and one that did not says so
/// (`Contended`), never silently (R34).
async fn no_update_is_lost(
    a: std::sync::Arc<dyn guardmesh_server::session::SessionStore>,
    b: std::sync::Arc<dyn guardmesh_server::session::SessionStore>,
) {
    use guardmesh_server::session::{SessionLimits, StoreError, Write, now_ms};
    let key = SessionKey::new("", "contended");
    let limits = SessionLimits::default();
    let mut tasks = Vec::new();
    for (replica, store) in [("a", a.clone()), ("b", b.clone())] {
        for task in 0..4 {
            let (store, key) = (store.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                let mut ok = 0u64;
                for i in 0..10 {
                    let update = read_file_ran(format!("{replica}-{task}-{i}"));
                    match store
                        .update(
                            &key,
                            Write {
                                update: &update,
                                limits: &limits,
                                now: now_ms(),
                            },
                        )
                        .await
                    {
                        Ok(_) => ok += 1,
                        Err(StoreError::Contended(_)) => {}
                        Err(e) => panic!("{replica}: {e}"),
                    }
                }
                ok
            }));
        }
    }
    let mut ok = 0;
    for task in tasks {
        ok += task.await.unwrap();
    }
    let memory = a.load(&key).await.unwrap().expect("the session");
    assert_eq!(memory.calls_total, ok, "an update that succeeded was lost");
    assert_eq!(memory.calls.len() as u64, ok);
    assert!(ok >= 40, "only {ok} of 80 updates got through");
    eprintln!(
        "{}: {ok} of 80 concurrent updates applied, none lost",
        a.kind()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_replicas_updating_one_session_in_redis_lose_no_update() {
    use guardmesh_server::session::redis::{RedisSettings, RedisStore};
    let redis = redis_or_skip!("r34_replicas_updating_one_session_in_redis_lose_no_update");
    let settings = RedisSettings {
        url: redis.url(),
        password: None,
        prefix: "/t/contended".into(),
        request_timeout: Duration::from_secs(2),
        dial_timeout: Duration::from_secs(5),
    };
    let names = guardmesh_server::session::Digester::new(&[3u8; 32]).unwrap();
    let a = RedisStore::connect(&settings, &names).await.unwrap();
    let b = RedisStore::connect(&settings, &names).await.unwrap();
    no_update_is_lost(std::sync::Arc::new(a), std::sync::Arc::new(b)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_replicas_updating_one_session_in_etcd_lose_no_update() {
    use guardmesh_server::session::etcd::EtcdStore;
    let cluster = Cluster::start().await;
    let urls = cluster.urls();
    let a = etcd_client::Client::connect(&urls[..1], None)
        .await
        .unwrap();
    let b = etcd_client::Client::connect(&urls[1..], None)
        .await
        .unwrap();
    let names = guardmesh_server::session::Digester::new(&[3u8; 32]).unwrap();
    no_update_is_lost(
        std::sync::Arc::new(EtcdStore::new(a, "/t/contended", &names)),
        std::sync::Arc::new(EtcdStore::new(b, "/t/contended", &names)),
    )
    .await;
}

/// A replica whose session secret is not the one the replicas already on
/// the store use does not start, naming the setting: its digests would
/// never meet theirs, and every flow across replicas would be missed
/// (R34). The replica with the same secret starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_a_replica_with_another_secret_does_not_start() {
    let redis = redis_or_skip!("r34_a_replica_with_another_secret_does_not_start");
    let dir = fresh_dir("store-secrets");
    let config = |secret: &Path| {
        mesh_config(
            &dir,
            "[registry]\nprefix = \"/t/secrets\"",
            &format!(
                "store = \"redis\"\nredis_url = {:?}\nsecret_file = {:?}",
                redis.url(),
                secret.display().to_string()
            ),
        )
    };
    let first = secret_file(&dir, "first.secret");
    let other = secret_file(&dir, "other.secret");
    let a = MeshProcess::start("secrets-a", &config(&first), None).await;
    let file = dir.join("other.toml");
    std::fs::write(&file, config(&other)).unwrap();
    let text = refused_start(&file, &dir.join("other.log"), "another secret").await;
    assert!(
        text.contains("sessions.secret_file") && text.contains("same file"),
        "{text}"
    );
    let b = MeshProcess::start("secrets-b", &config(&first), None).await;
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// In etcd a session's key lives on a lease of one and a half times the
/// memory's age: an active session keeps what it learned recently past its
/// first lease (the lease is granted again past half of the age), an
/// abandoned one leaves the store (R34). With a 4 s age: written at 0 s and
/// 2.5 s, still there at 5 s with the later entry; gone once 6 s pass
/// without a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_an_active_session_outlives_its_first_etcd_lease() {
    use guardmesh_server::session::etcd::EtcdStore;
    use guardmesh_server::session::{SessionLimits, SessionStore as _, Write, now_ms};
    let cluster = Cluster::start().await;
    let client = etcd_client::Client::connect(cluster.urls(), None)
        .await
        .unwrap();
    let names = guardmesh_server::session::Digester::new(&[3u8; 32]).unwrap();
    let store = EtcdStore::new(client, "/t/lease", &names);
    let limits = SessionLimits {
        max_age: Duration::from_secs(4),
        ..SessionLimits::default()
    };
    let key = SessionKey::new("", "active");
    let write = async |id: &str| {
        let write = Write {
            update: &read_file_ran(id.to_owned()),
            limits: &limits,
            now: now_ms(),
        };
        store.update(&key, write).await.unwrap();
    };
    write("first").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    write("second").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let memory = store
        .load(&key)
        .await
        .unwrap()
        .expect("an active session is kept");
    assert!(memory.calls.iter().any(|c| c.id == "second"), "{memory:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.load(&key).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "an abandoned session stays in etcd"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------
// What a paused store cannot remember is not passed (R34, R13)
// ---------------------------------------------------------------------------

/// A store process paused (SIGSTOP) while held, resumed (SIGCONT) when
/// dropped: a failed assertion never leaves a stopped process behind.
struct Paused(libc::pid_t);

impl Paused {
    fn new(pid: Option<u32>) -> Self {
        let pid = libc::pid_t::try_from(pid.expect("the store runs")).expect("a process id");
        // SAFETY: `kill` only sends a signal to the store process this
        // test started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0, "SIGSTOP");
        Self(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        // SAFETY: as in `Paused::new`.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// Waits (bounded) until the session rules of `c` judge again: a call
/// that reads the memory proceeds in a session of its own.
async fn until_the_store_answers(c: &Coordinator) {
    let deadline = Instant::now() + Duration::from_secs(15);
    for turn in 0.. {
        let o = fetch(c, "probe", turn).await;
        if o == Outcome::Proceed {
            return;
        }
        assert!(Instant::now() < deadline, "the store is back, yet: {o:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `.env` read's result, holding [`SECRET`].
fn env_result() -> String {
    serde_json::json!({
        "content": [{"type": "text", "text": format!("DB_PASSWORD={SECRET}\nDEBUG=1\n")}]
    })
    .to_string()
}

/// R13, R34 on a store paused by `pause` (the store's process id): while
/// a call is judged, the `.env` read (which no rule reads the memory for)
/// cannot be remembered and does not proceed (fail_closed, a failure);
/// while a result is judged, the result cannot be remembered and is
/// blocked as a failure, an error result without the secret. Resumed, the
/// session judges as before: the read runs, its result passes and is
/// remembered, the secret sent to sqlite is cancelled and written back to
/// fs is allowed.
async fn a_paused_store_passes_nothing_it_cannot_remember(c: &Coordinator, pid: Option<u32>) {
    let session = "paused";
    let read =
        |turn: u32, id: &str| Batch::new(turn).call(id, "fs.read_file", r#"{"path":".env"}"#);
    until_the_store_answers(c).await;
    {
        let _paused = Paused::new(pid);
        let d = decide(c, session, read(0, "r0")).await;
        let call = d.call("r0").unwrap();
        assert!(
            cancelled(&call.outcome) && call.failure,
            "the store paused while the call was judged: it must not proceed: {call:?}"
        );
        assert!(d.execute.is_empty(), "{d:?}");
    }
    until_the_store_answers(c).await;
    let d = decide(c, session, read(1, "r1")).await;
    assert_eq!(d.call("r1").unwrap().outcome, Outcome::Proceed, "{d:?}");
    {
        let _paused = Paused::new(pid);
        let d = decide(
            c,
            session,
            Batch::new(2).result("r1", "fs.read_file", "fs", env_result()),
        )
        .await;
        let r = d.result("r1").unwrap();
        assert!(
            r.blocked() && r.failure,
            "the store paused while the result was judged: it must not pass: {r:?}"
        );
        assert!(!r.result.contains(SECRET), "{}", r.result);
        assert_eq!(r.result_json().unwrap()["isError"], true, "{}", r.result);
    }
    until_the_store_answers(c).await;
    let d = decide(
        c,
        session,
        Batch::new(3).result("r1", "fs.read_file", "fs", env_result()),
    )
    .await;
    let r = d.result("r1").unwrap();
    assert!(!r.blocked() && !r.failure, "{r:?}");
    let o = outcome(c, session, 4, "sqlite.query", &insert_secret()).await;
    assert!(
        cancelled(&o),
        "the value read, once remembered, is followed: {o:?}"
    );
    let back = format!(r#"{{"path":"backup.env","text":"{SECRET}"}}"#);
    assert_eq!(
        outcome(c, session, 5, "fs.write_file", &back).await,
        Outcome::Proceed
    );
}

/// [`a_paused_store_passes_nothing_it_cannot_remember`] on a real etcd
/// (one member, the registry's and the sessions' store), its process
/// paused with SIGSTOP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r13_r34_a_paused_etcd_passes_no_call_or_result_it_cannot_remember() {
    let etcd = crate::etcd::Etcd::start().await;
    let dir = fresh_dir("store-etcd-paused");
    let secret = secret_file(&dir, "session.secret");
    let sessions = format!(
        "secret_file = {:?}\nstore_timeout_ms = 300",
        secret.display().to_string()
    );
    let config = mesh_config(&dir, &etcd_registry(&[etcd.url()], "/t/paused"), &sessions);
    let mesh = MeshProcess::start("store-etcd-paused", &config, None).await;
    let c = Coordinator::connect(mesh.url.clone()).await.unwrap();
    a_paused_store_passes_nothing_it_cannot_remember(&c, etcd.pid()).await;
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

/// [`a_paused_store_passes_nothing_it_cannot_remember`] on a real
/// `redis-server`, its process paused with SIGSTOP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r13_r34_a_paused_redis_passes_no_call_or_result_it_cannot_remember() {
    let redis =
        redis_or_skip!("r13_r34_a_paused_redis_passes_no_call_or_result_it_cannot_remember");
    let dir = fresh_dir("store-redis-paused");
    let secret = secret_file(&dir, "session.secret");
    let sessions = format!(
        "store = \"redis\"\nredis_url = {:?}\nsecret_file = {:?}\nstore_timeout_ms = 300",
        redis.url(),
        secret.display().to_string()
    );
    let config = mesh_config(&dir, "[registry]\nprefix = \"/t/paused\"", &sessions);
    let mesh = MeshProcess::start("store-redis-paused", &config, None).await;
    let c = Coordinator::connect(mesh.url.clone()).await.unwrap();
    a_paused_store_passes_nothing_it_cannot_remember(&c, redis.pid()).await;
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}
