//! Session memory through a real mesh (R34): flows across batches, rates,
//! isolation between identities, and a store that cannot answer or cannot
//! write.
//!
//! Values seen in results are mostly fed through the results phase's hook
//! (`SessionMemory::result_seen`) directly, so that these tests hold the
//! memory apart from the results phase (R33), which `results`,
//! `sessions_store` and `readme_flows` drive through the mesh; the test of
//! a store whose writes fail sends its results through the mesh, since
//! what it holds is the mesh's answer to them (R13).

use crate::harness::*;
use guardmesh_client::proto::FailurePolicy;
use guardmesh_client::{Batch, BatchDecision, Coordinator, Outcome, Registration};
use guardmesh_server::session::{
    Applied, Digester, Memory, SessionKey, SessionLimits, SessionMemory, SessionStore, StoreError,
    Update, Write,
};
use std::sync::Arc;

fn relaybleed() -> String {
    std::fs::read_to_string(repo_root().join("examples/policy/relaybleed.toml")).unwrap()
}

/// The decision on call `c` of `tool` with `args`, sent alone in
/// `session`.
pub(crate) async fn decision(
    c: &Coordinator,
    session: &str,
    turn: u32,
    tool: &str,
    args: &str,
) -> BatchDecision {
    c.evaluate_once(session, Batch::new(turn).call("c", tool, args))
        .await
        .unwrap()
}

/// The outcome of call `c` of `tool` with `args`, sent alone in `session`.
pub(crate) async fn outcome(
    c: &Coordinator,
    session: &str,
    turn: u32,
    tool: &str,
    args: &str,
) -> Outcome {
    let d = decision(c, session, turn, tool, args).await;
    d.call("c").unwrap().outcome.clone()
}

pub(crate) fn proceeds(o: &Outcome) -> bool {
    matches!(o, Outcome::Proceed)
}

/// Runs the `.env` read `r1` in `session`: it proceeds and is recorded by
/// the mesh.
pub(crate) async fn read_dotenv(c: &Coordinator, session: &str, turn: u32) {
    let d = c
        .evaluate_once(
            session,
            Batch::new(turn).call("r1", "fs.read_file", r#"{"path":".env"}"#),
        )
        .await
        .unwrap();
    assert!(proceeds(&d.call("r1").unwrap().outcome));
}

/// The decision on `result`, sent in `session` as the result of the `.env`
/// read `r1`.
pub(crate) async fn dotenv_result(
    c: &Coordinator,
    session: &str,
    turn: u32,
    result: &str,
) -> BatchDecision {
    c.evaluate_once(
        session,
        Batch::new(turn).result("r1", "fs.read_file", "fs", result),
    )
    .await
    .unwrap()
}

/// [`read_dotenv`], and its result: a `CallToolResult` holding `secret`.
pub(crate) async fn read_env(c: &Coordinator, session: &str, turn: u32, secret: &str) -> String {
    read_dotenv(c, session, turn).await;
    serde_json::json!({
        "content": [{"type": "text", "text": format!("DB_PASSWORD={secret}\n")}]
    })
    .to_string()
}

/// Keeps `mesh`'s session memory in `store` (a random session secret, the
/// default bounds).
pub(crate) fn attach_store(mesh: &TestMesh, store: Arc<dyn SessionStore>) {
    let memory = SessionMemory::new(store, Digester::random(), SessionLimits::default());
    mesh.mesh.attach_sessions(Arc::new(memory)).unwrap();
}

/// [`flows`], the mesh's session memory kept in `store`.
async fn flows_in(mesh: &TestMesh, store: Arc<dyn SessionStore>) -> Coordinator {
    attach_store(mesh, store);
    flows(mesh).await
}

/// A mesh whose `[auth]` knows ops and the two callers `names` (each with
/// token `<name>-token` and role `evaluate`), with `policy` registered by
/// ops as policy guard `guard`: the mesh and a coordinator of each caller.
pub(crate) async fn two_callers(
    names: [&str; 2],
    guard: &str,
    policy: String,
) -> (TestMesh, Coordinator, Coordinator) {
    let pki = TestPki::new();
    let tokens = names.map(|name| format!("{name}-token"));
    let evaluate: &[&str] = &["evaluate"];
    let principals = [
        OPS,
        (names[0], tokens[0].as_str(), evaluate),
        (names[1], tokens[1].as_str(), evaluate),
    ];
    let (mesh, url) = TestMesh::with_tokens(&pki, &principals, "").await;
    let ops = pki.registrar(&url, "ops-token").await;
    ops.register(Registration::policy(guard, policy).build())
        .await
        .unwrap();
    let first = pki.coordinator(&url, &tokens[0]).await;
    let second = pki.coordinator(&url, &tokens[1]).await;
    (mesh, first, second)
}

/// Registers the relaybleed flow rules as policy guard `flows`: a
/// coordinator of the mesh.
async fn flows(mesh: &TestMesh) -> guardmesh_client::Coordinator {
    mesh.register(Registration::policy("flows", relaybleed()))
        .await;
    mesh.coordinator().await
}

#[tokio::test]
async fn r34_relaybleed_denied_to_another_server_allowed_back_and_elsewhere() {
    let mesh = TestMesh::start().await;
    let c = flows(&mesh).await;
    let secret = "hunter2-Sup3rS3cret";
    let insert = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{secret}')"}}"#);
    // No prior read: allowed.
    assert!(proceeds(
        &outcome(&c, "s1", 0, "sqlite.query", &insert).await
    ));
    // The read runs (recorded by the mesh), and its result is read.
    let result = read_env(&c, "s1", 1, secret).await;
    mesh.mesh
        .sessions()
        .result_seen(
            &SessionKey::new("", "s1"),
            "r1",
            "fs.read_file",
            "fs",
            &result,
            &[],
        )
        .await
        .unwrap();
    // Sent to another server: denied.
    let denied = outcome(&c, "s1", 2, "sqlite.query", &insert).await;
    assert!(
        matches!(&denied, Outcome::Cancel { content } if content.contains("read from the fs server")),
        "{denied:?}"
    );
    // Written back to fs: allowed.
    let back = format!(r#"{{"path":"backup.env","content":"DB_PASSWORD={secret}"}}"#);
    assert!(proceeds(
        &outcome(&c, "s1", 3, "fs.write_file", &back).await
    ));
    // Another session: allowed.
    assert!(proceeds(
        &outcome(&c, "s2", 0, "sqlite.query", &insert).await
    ));
    // A result for a call that never ran in the session teaches nothing.
    let never = mesh
        .mesh
        .sessions()
        .result_seen(
            &SessionKey::new("", "s2"),
            "r1",
            "fs.read_file",
            "fs",
            &result,
            &[],
        )
        .await;
    assert!(never.is_err());
    mesh.shutdown().await;
}

/// R33, R34: a coordinator that sends no session id has one session per
/// identity (the empty id): the results it sends through the mesh are
/// remembered there as its calls are, so leaving the id out is no way
/// around a flow rule; a named session still learns nothing from it.
#[tokio::test]
async fn r33_r34_no_session_id_is_one_session_not_a_way_around_a_flow_rule() {
    let mesh = TestMesh::start().await;
    let c = flows(&mesh).await;
    let secret = "hunter2-Sup3rS3cret";
    let result = read_env(&c, "", 0, secret).await;
    let d = dotenv_result(&c, "", 1, &result).await;
    assert!(!d.result("r1").unwrap().blocked());
    let insert = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{secret}')"}}"#);
    let denied = outcome(&c, "", 2, "sqlite.query", &insert).await;
    assert!(
        matches!(&denied, Outcome::Cancel { content } if content.contains("read from the fs server")),
        "{denied:?}"
    );
    assert!(proceeds(
        &outcome(&c, "named", 0, "sqlite.query", &insert).await
    ));
    mesh.shutdown().await;
}

#[tokio::test]
async fn r34_rate_limit_per_session_never_shared_with_another_identity() {
    let (mesh, alice, mallory) = two_callers(["alice", "mallory"], "flows", relaybleed()).await;
    for turn in 0..3 {
        assert!(
            proceeds(&outcome(&alice, "s", turn, "email.send", "{}").await),
            "email {turn}"
        );
    }
    let fourth = outcome(&alice, "s", 3, "email.send", "{}").await;
    assert!(matches!(fourth, Outcome::Cancel { .. }), "{fourth:?}");
    // Mallory claims Alice's session id: a session of Mallory's own, with
    // none of Alice's calls, and Mallory's calls do not count for Alice.
    for turn in 0..3 {
        assert!(proceeds(
            &outcome(&mallory, "s", turn, "email.send", "{}").await
        ));
    }
    assert!(matches!(
        outcome(&mallory, "s", 3, "email.send", "{}").await,
        Outcome::Cancel { .. }
    ));
    // Alice's other session starts afresh.
    assert!(proceeds(&outcome(&alice, "t", 0, "email.send", "{}").await));
    mesh.shutdown().await;
}

/// A store that cannot be reached.
#[derive(Debug)]
pub(crate) struct Down;

#[tonic::async_trait]
impl SessionStore for Down {
    async fn load(&self, _: &SessionKey) -> Result<Option<Memory>, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn update(&self, _: &SessionKey, _: Write<'_>) -> Result<Applied, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    fn kind(&self) -> &'static str {
        "down"
    }
}

#[tokio::test]
async fn r34_store_down_fails_the_session_rules_per_their_guard_policy() {
    let mesh = TestMesh::start().await;
    attach_store(&mesh, Arc::new(Down));
    let c = flows(&mesh).await;
    let d = decision(&c, "s", 0, "email.send", "{}").await;
    let call = d.call("c").unwrap();
    assert!(
        matches!(&call.outcome, Outcome::Cancel { content } if content.contains("unavailable")),
        "fail closed, never no history so proceed: {call:?}"
    );
    assert!(call.failure);
    let error = &d.guard("flows").unwrap().error;
    assert!(error.contains("session memory unavailable"), "{error}");
    // fail_open: the guard is bypassed, and the decision says so.
    mesh.register(
        Registration::policy("flows", relaybleed()).failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let d = decision(&c, "s", 1, "email.send", "{}").await;
    let call = d.call("c").unwrap();
    assert!(proceeds(&call.outcome));
    assert!(call.bypassed.contains(&"flows".to_owned()), "{call:?}");
    mesh.shutdown().await;
}

/// The mesh's own store whose writes fail while `failing` is set: the
/// memory reads, but what a batch adds to it cannot be written.
#[derive(Debug)]
struct WritesFail {
    inner: guardmesh_server::session::LocalStore,
    failing: std::sync::atomic::AtomicBool,
}

impl WritesFail {
    fn fail(&self, failing: bool) {
        self.failing
            .store(failing, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl SessionStore for WritesFail {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        self.inner.load(key).await
    }
    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(StoreError::TimedOut(std::time::Duration::from_millis(300)));
        }
        self.inner.update(key, write).await
    }
    fn kind(&self) -> &'static str {
        "writes-fail"
    }
}

/// R13, R34: what cannot be remembered is not passed. With the memory
/// readable but its writes failing, a call the relaybleed rules let run
/// (an `fs` read, which no rule reads the memory for) and a result of a
/// call that ran fail per the failure policy of the guard that reads
/// sessions: `fail_closed` cancels the call and blocks the result (an
/// error result, as a blocked result is), both marked as failures;
/// `fail_open` lets them through and records the guard as bypassed;
/// `abort` refuses the batch naming the guard.
#[tokio::test]
async fn r13_r34_a_call_or_result_that_cannot_be_remembered_fails_per_the_readers_policy() {
    let mesh = TestMesh::start().await;
    let store = Arc::new(WritesFail {
        inner: guardmesh_server::session::LocalStore::new(SessionLimits::default()),
        failing: false.into(),
    });
    let c = flows_in(&mesh, store.clone()).await;
    let env = r#"{"path":".env"}"#;
    let secret = "hunter2-Sup3rS3cret";
    let read = |turn: u32, id: &str| Batch::new(turn).call(id, "fs.read_file", env);
    let result = |turn: u32, id: &str| {
        let json = serde_json::json!({
            "content": [{"type": "text", "text": format!("DB_PASSWORD={secret}\n")}]
        })
        .to_string();
        Batch::new(turn).result(id, "fs.read_file", "fs", json)
    };

    // fail_closed (the default): the call does not run.
    store.fail(true);
    let d = c.evaluate_once("s", read(0, "r1")).await.unwrap();
    let call = d.call("r1").unwrap();
    assert!(
        matches!(&call.outcome, Outcome::Cancel { content } if content.contains("flows")),
        "a call that cannot be remembered ran: {call:?}"
    );
    assert!(call.failure && d.execute.is_empty(), "{d:?}");
    let error = &d.guard("flows").unwrap().error;
    assert!(error.contains("session memory"), "{error}");
    // A result of a call that ran is not passed.
    store.fail(false);
    let d = c.evaluate_once("s", read(1, "r2")).await.unwrap();
    assert!(proceeds(&d.call("r2").unwrap().outcome));
    store.fail(true);
    let d = c.evaluate_once("s", result(2, "r2")).await.unwrap();
    let r = d.result("r2").unwrap();
    assert!(
        r.blocked() && r.failure,
        "a result that cannot be remembered was passed: {r:?}"
    );
    assert!(!r.result.contains(secret), "{}", r.result);
    assert_eq!(r.result_json().unwrap()["isError"], true);

    // fail_open: through, and the decision says the guard was bypassed.
    mesh.register(
        Registration::policy("flows", relaybleed()).failure_policy(FailurePolicy::FailOpen),
    )
    .await;
    let d = c.evaluate_once("t", read(0, "r1")).await.unwrap();
    let call = d.call("r1").unwrap();
    assert!(proceeds(&call.outcome), "{call:?}");
    assert!(call.bypassed.contains(&"flows".to_owned()), "{call:?}");
    store.fail(false);
    let d = c.evaluate_once("t", read(1, "r2")).await.unwrap();
    assert!(proceeds(&d.call("r2").unwrap().outcome));
    store.fail(true);
    let d = c.evaluate_once("t", result(2, "r2")).await.unwrap();
    let r = d.result("r2").unwrap();
    assert!(!r.blocked(), "{r:?}");
    assert!(r.bypassed.contains(&"flows".to_owned()), "{r:?}");

    // abort: the batch is refused, naming the guard.
    mesh.register(Registration::policy("flows", relaybleed()).failure_policy(FailurePolicy::Abort))
        .await;
    let refused = c.evaluate_once("u", read(0, "r1")).await.unwrap_err();
    assert!(refused.to_string().contains("flows"), "{refused}");
    mesh.shutdown().await;
}

/// R25: a policy that does not name `session` never touches the store (a
/// store that is down changes nothing for it).
#[tokio::test]
async fn r34_policies_without_session_pay_nothing() {
    let mesh = TestMesh::start().await;
    attach_store(&mesh, Arc::new(Down));
    let plain = "[[rule]]\nname='no-rm'\nwhen='call.tool == \"shell.rm\"'\naction='cancel'\nmessage='\"no\"'\n";
    mesh.register(Registration::policy("plain", plain)).await;
    let c = mesh.coordinator().await;
    assert!(proceeds(&outcome(&c, "s", 0, "email.send", "{}").await));
    let stats = mesh.mesh.sessions().stats();
    assert_eq!(stats.reads.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(stats.writes.load(std::sync::atomic::Ordering::Relaxed), 0);
    mesh.shutdown().await;
}

/// A mesh replica whose registry and session memory are on etcd.
async fn replica(
    endpoints: Vec<String>,
    prefix: &str,
) -> (
    TestMesh,
    Arc<guardmesh_server::registry::etcd::EtcdRegistry>,
) {
    use guardmesh_server::registry::etcd::EtcdRegistry;
    use guardmesh_server::session::etcd::EtcdStore;
    let config = fast_config();
    let registry = Arc::new(
        EtcdRegistry::connect(
            crate::etcd::cluster_settings(endpoints.clone(), prefix),
            config.default_guard_timeout,
        )
        .await
        .unwrap(),
    );
    let mesh = TestMesh::with_registry(config, registry.clone()).await;
    let client = etcd_client::Client::connect(endpoints, None).await.unwrap();
    let digester = Digester::new(&[7u8; 32]).unwrap();
    let memory = SessionMemory::new(
        Arc::new(EtcdStore::new(client, prefix, &digester)),
        digester.clone(),
        SessionLimits::default(),
    );
    mesh.mesh.attach_sessions(Arc::new(memory)).unwrap();
    (mesh, registry)
}

/// Two replicas, each on its own members of a 3-member etcd cluster: what
/// one learns (calls that ran, a label, values seen) is enforced by the
/// other at the session's next batch; with etcd gone, the session rules
/// fail closed (R34, R13).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_replicas_on_a_3_member_etcd_share_session_memory() {
    let cluster = crate::etcd::Cluster::start().await;
    let urls = cluster.urls();
    let prefix = "/t/sessions/";
    let (a, _ra) = replica(urls[..1].to_vec(), prefix).await;
    let (b, rb) = replica(urls[1..].to_vec(), prefix).await;
    let out = a
        .registrar()
        .await
        .register(Registration::policy("flows", relaybleed()).build())
        .await
        .unwrap();
    assert!(
        rb.wait_for(out.revision, std::time::Duration::from_secs(15))
            .await
    );
    let (ca, cb) = (a.coordinator().await, b.coordinator().await);
    // Emails alternate between the replicas; the fourth is refused.
    let mut took = Vec::new();
    for turn in 0..3 {
        let c = if turn % 2 == 0 { &ca } else { &cb };
        let started = std::time::Instant::now();
        assert!(
            proceeds(&outcome(c, "s", turn, "email.send", "{}").await),
            "email {turn}"
        );
        took.push(started.elapsed());
    }
    assert!(matches!(
        outcome(&cb, "s", 3, "email.send", "{}").await,
        Outcome::Cancel { .. }
    ));
    // A label set through A is enforced by B at the next batch.
    let key = SessionKey::new("", "s");
    let label = Update {
        labels: vec!["secret:fs".into()],
        ..Update::default()
    };
    a.mesh.sessions().record(&key, &label).await.unwrap();
    assert!(matches!(
        outcome(&cb, "s", 4, "http.get", r#"{"url":"https://example.com"}"#).await,
        Outcome::Cancel { .. }
    ));
    // A value read through A (its result fed to A's hook) is followed on B.
    read_dotenv(&ca, "s", 5).await;
    let result =
        r#"{"content":[{"type":"text","text":"TOKEN=ghp_abcdefghijklmnopqrstuv0123456789"}]}"#;
    a.mesh
        .sessions()
        .result_seen(&key, "r1", "fs.read_file", "fs", result, &[])
        .await
        .unwrap();
    let leak = r#"{"sql":"INSERT INTO t VALUES ('ghp_abcdefghijklmnopqrstuv0123456789')"}"#;
    assert!(matches!(
        outcome(&cb, "s", 6, "sqlite.query", leak).await,
        Outcome::Cancel { .. }
    ));
    took.sort();
    eprintln!(
        "etcd session memory: {} batches, p50 {:?} (one read and one write per batch)",
        took.len(),
        took[took.len() / 2]
    );
    // etcd gone: B still judges with its chain (within its staleness
    // window) but cannot read the session: its rules fail closed.
    drop(cluster);
    let d = cb
        .evaluate_once("s", Batch::new(7).call("c", "email.send", "{}"))
        .await;
    match d {
        Ok(d) => {
            let call = d.call("c").unwrap();
            assert!(
                matches!(call.outcome, Outcome::Cancel { .. }) && call.failure,
                "{call:?}"
            );
        }
        // Or the replica already refuses its stale chain (R17).
        Err(e) => assert_eq!(e.code(), Some(tonic::Code::Unavailable), "{e}"),
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// R25: a flood of sessions, each filled past its bounds, leaves a real
/// `guardmesh serve` within its bounds: at most 256 sessions of 16 KiB.
/// The flood sends 32 000 calls in 500 sessions (bounded in time on a
/// debug build; 4000 sessions, 256 000 calls, measured 47 MiB before and
/// after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_a_flood_of_sessions_keeps_serve_within_its_bounds() {
    let dir = std::env::temp_dir().join(format!("guardmesh-sessions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("flows.toml");
    std::fs::write(&policy, relaybleed()).unwrap();
    let config = format!(
        "[sessions]\nmax_sessions = 256\nmax_sessions_per_identity = 256\n\n\
         [[guard]]\nname = \"flows\"\npolicy = {:?}\n",
        policy.display().to_string()
    );
    let mesh = MeshProcess::start("sessions-flood", &config, None).await;
    let c = mesh.coordinator().await;
    let batch = |s: usize| {
        (0..64).fold(Batch::new(0), |b, i| {
            // A tool no rule bounds: every call runs and is recorded (a
            // batch of emails would stop at the third, R34).
            b.call(
                format!("call-{s}-{i}"),
                "crm.update",
                format!(r#"{{"to":"user{s}@example.com","n":{i}}}"#),
            )
        })
    };
    // Warm up: the allocator's and the runtime's own first use.
    for s in 0..300 {
        c.evaluate_once(&format!("warm-{s}"), batch(s))
            .await
            .unwrap();
    }
    let (before, _) = mesh.memory_mib();
    let sessions = 500;
    let mut done = 0;
    while done < sessions {
        let round: Vec<_> = (done..(done + 8).min(sessions))
            .map(|s| {
                let c = c.clone();
                async move { c.evaluate_once(&format!("s-{s}"), batch(s)).await }
            })
            .collect();
        for d in futures::future::join_all(round).await {
            d.unwrap();
        }
        done += 8;
    }
    let (after, peak) = mesh.memory_mib();
    eprintln!("sessions flood: RSS {before} MiB before, {after} MiB after, peak {peak} MiB");
    assert!(
        after <= before + 24,
        "RSS grew from {before} to {after} MiB under a bounded session memory"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// R34 "forgetting is never innocence": through a real `guardmesh serve`
/// with the default session bounds, a session reads a secret, then more
/// sessions than the mesh keeps (`max_sessions`, past the per-identity
/// bound too) push it out. Its memory is gone, but it comes back as a
/// session that lost memory, never as a new one: the shipped relaybleed
/// rules (nothing leaves fs once values are lost) still stop its insert of
/// the secret, while a session that never was may send anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_a_session_pushed_out_by_a_flood_of_sessions_still_cannot_send_its_secret() {
    let dir = std::env::temp_dir().join(format!("guardmesh-dropped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("flows.toml");
    std::fs::write(&policy, relaybleed()).unwrap();
    let config = format!(
        "[[guard]]\nname = \"flows\"\npolicy = {:?}\nfailure_policy = \"fail_closed\"\n",
        policy.display().to_string()
    );
    let mesh = MeshProcess::start("sessions-dropped", &config, None).await;
    let c = mesh.coordinator().await;
    let secret = "hunter2-Sup3rS3cretValue";
    let insert = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{secret}')"}}"#);
    use futures::StreamExt;
    let within = std::time::Duration::from_secs(60);
    // The secret is read (the call runs, its result comes back).
    let result = read_env(&c, "victim", 1, secret).await;
    tokio::time::timeout(
        within,
        c.evaluate_once(
            "victim",
            Batch::new(2).result("r1", "fs.read_file", "fs", result),
        ),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(!proceeds(
        &outcome(&c, "victim", 3, "sqlite.query", &insert).await
    ));
    // More sessions than the mesh keeps, 32 batches at a time.
    let flood = SessionLimits::default().max_sessions + 100;
    let sent = futures::stream::iter(0..flood)
        .map(|s| {
            let c = c.clone();
            async move {
                c.evaluate_once(
                    &format!("flood-{s}"),
                    Batch::new(0).call("n", "notes.add", r#"{"text":"hello"}"#),
                )
                .await
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>();
    let started = std::time::Instant::now();
    for d in tokio::time::timeout(within, sent)
        .await
        .expect("the flood answered within 60 s")
    {
        assert!(proceeds(&d.unwrap().call("n").unwrap().outcome));
    }
    eprintln!("{flood} sessions sent in {:?}", started.elapsed());
    let o = outcome(&c, "victim", 4, "sqlite.query", &insert).await;
    assert!(
        matches!(&o, Outcome::Cancel { content } if content.contains("forgot values")),
        "a session pushed out by other sessions reads as new: {o:?}"
    );
    assert!(proceeds(
        &outcome(&c, "never-seen", 0, "sqlite.query", &insert).await
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shared store on which another replica writes the session between
/// every batch's read and its write, `changes` times (`u32::MAX`: always).
#[derive(Debug)]
struct ChangedMeanwhile {
    inner: guardmesh_server::session::LocalStore,
    changes: std::sync::atomic::AtomicU32,
    reads: std::sync::atomic::AtomicU32,
}

#[tonic::async_trait]
impl SessionStore for ChangedMeanwhile {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.load(key).await
    }
    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        if write.update.read_at.is_some()
            && self
                .changes
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(StoreError::Changed);
        }
        self.inner.update(key, write).await
    }
    fn kind(&self) -> &'static str {
        "changed-meanwhile"
    }
}

/// R34, R13: a batch whose session memory (shared by replicas) another
/// replica wrote between its read and its write is judged again on the
/// memory as it is now, and its calls run once written; a batch that
/// finds the memory changed at every try fails per the failure policy of
/// the guard that reads sessions (here `fail_closed`: cancelled as a
/// failure, naming the change), within its deadline, never "proceed".
#[tokio::test]
async fn r13_r34_a_batch_whose_memory_changed_meanwhile_is_judged_again_or_fails_closed() {
    use std::sync::atomic::Ordering::SeqCst;
    let mesh = TestMesh::start().await;
    let store = Arc::new(ChangedMeanwhile {
        inner: guardmesh_server::session::LocalStore::new(SessionLimits::default()),
        changes: 2.into(),
        reads: 0.into(),
    });
    let c = flows_in(&mesh, store.clone()).await;
    let email = r#"{"to":"a@example.com"}"#;
    // Changed twice: judged three times, then written and run.
    let o = outcome(&c, "s", 0, "email.send", email).await;
    assert!(proceeds(&o), "{o:?}");
    assert_eq!(
        store.reads.load(SeqCst),
        3,
        "not judged again on a fresh read"
    );
    assert_eq!(store.changes.load(SeqCst), 0);
    // Always changed: cancelled as a failure, naming why.
    store.changes.store(u32::MAX, SeqCst);
    store.reads.store(0, SeqCst);
    let started = std::time::Instant::now();
    let d = decision(&c, "s", 1, "email.send", email).await;
    let call = d.call("c").unwrap();
    assert!(
        matches!(&call.outcome, Outcome::Cancel { content } if content.contains("flows")),
        "a call judged on a memory that kept changing ran: {call:?}"
    );
    assert!(call.failure && d.execute.is_empty(), "{d:?}");
    let error = &d.guard("flows").unwrap().error;
    assert!(error.contains("changed"), "{error}");
    assert_eq!(
        store.reads.load(SeqCst),
        4,
        "judged again a bounded number of times"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // What ran is in the memory once: the first email only.
    store.changes.store(0, SeqCst);
    let memory = store
        .inner
        .load(&SessionKey::new("", "s"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(memory.calls_total, 1, "{memory:?}");
    mesh.shutdown().await;
}

/// R34: one large result cannot wash a secret out of the memory into a
/// proceed. The `.env` secret is read; then a listing of many distinct
/// names (more values than the session's bytes hold) comes back from fs,
/// and pushes the secret's digest out. The shipped relaybleed rules still
/// cancel the insert of the secret into sqlite: the session lost values,
/// so nothing leaves fs; a fresh session may insert it.
#[tokio::test]
async fn r34_one_large_result_cannot_wash_a_secret_out_into_a_proceed() {
    let mesh = TestMesh::start().await;
    let c = flows(&mesh).await;
    let secret = "hunter2-Sup3rS3cretValue";
    let result = read_env(&c, "washed", 1, secret).await;
    let d = dotenv_result(&c, "washed", 2, &result).await;
    assert_eq!(d.results.len(), 1);
    // Many results of many distinct names each, until the memory dropped
    // values: the secret's digest, the oldest, goes first.
    for turn in 0..8u32 {
        let id = format!("l{turn}");
        let d = c
            .evaluate_once(
                "washed",
                Batch::new(10 + 2 * turn).call(&id, "fs.list_directory", r#"{"path":"/srv"}"#),
            )
            .await
            .unwrap();
        assert!(proceeds(&d.call(&id).unwrap().outcome));
        let names: Vec<String> = (0..200)
            .map(|i| format!("file-{turn}-{i:04}-abcdefgh.txt"))
            .collect();
        let listing = serde_json::json!({
            "content": [{"type": "text", "text": names.join("\n")}]
        })
        .to_string();
        c.evaluate_once(
            "washed",
            Batch::new(11 + 2 * turn).result(&id, "fs.list_directory", "fs", listing),
        )
        .await
        .unwrap();
    }
    let insert = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{secret}')"}}"#);
    let o = outcome(&c, "washed", 99, "sqlite.query", &insert).await;
    assert!(
        matches!(&o, Outcome::Cancel { .. }),
        "a secret washed out of the memory by large results was sent on: {o:?}"
    );
    assert!(proceeds(
        &outcome(&c, "fresh", 0, "sqlite.query", &insert).await
    ));
    mesh.shutdown().await;
}

/// R34: a rate cannot be washed out by a flood of calls. Three emails run;
/// then enough `fs` calls to push them out of the session's memory; the
/// fourth email within the hour is not counted as the first: the count
/// over a window whose calls the memory dropped fails the rule, and the
/// relaybleed guard (`fail_closed`) cancels the email as a failure, naming
/// why. Another session still sends.
#[tokio::test]
async fn r34_a_rate_cannot_be_washed_out_by_a_flood_of_calls() {
    let mesh = TestMesh::start().await;
    let c = flows(&mesh).await;
    let email = r#"{"to":"a@example.com"}"#;
    for turn in 0..3 {
        assert!(proceeds(
            &outcome(&c, "flooded", turn, "email.send", email).await
        ));
    }
    for turn in 0..12u32 {
        let mut batch = Batch::new(10 + turn);
        for i in 0..25 {
            batch = batch.call(format!("f{i}"), "fs.read_file", r#"{"path":"notes.txt"}"#);
        }
        let d = c.evaluate_once("flooded", batch).await.unwrap();
        assert_eq!(d.execute.len(), 25, "{d:?}");
    }
    let d = c
        .evaluate_once("flooded", Batch::new(99).call("e", "email.send", email))
        .await
        .unwrap();
    let call = d.call("e").unwrap();
    assert!(
        matches!(call.outcome, Outcome::Cancel { .. }) && call.failure,
        "a fourth email within the hour ran once the first three were pushed out: {call:?}"
    );
    let error = &d.guard("flows").unwrap().error;
    assert!(error.contains("dropped calls"), "{error}");
    assert!(proceeds(&outcome(&c, "calm", 0, "email.send", email).await));
    mesh.shutdown().await;
}
