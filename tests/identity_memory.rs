//! R34: the memory of the caller's identity across its sessions. A rule
//! that reads `identity` binds the principal whatever session ids it
//! sends: a budget counts its calls in every session, a flow sees values
//! read in another session, batches of one identity in different sessions
//! cannot race a count, and memory that cannot be read fails the rule
//! (R13), never "a new identity, so proceed". The session id the mesh
//! keeps the identity's memory under is refused from coordinators (R20).

use crate::harness::*;
use crate::sessions::{
    Down, attach_store, decision, dotenv_result, outcome, proceeds, read_dotenv, read_env,
    two_callers,
};
use crate::sessions_serialized::six_at_once;
use guardmesh_client::{Batch, Coordinator, Outcome, Registration};
use guardmesh_server::session::{
    Applied, Memory, SessionKey, SessionLimits, SessionStore, StoreError, Write,
};
use std::sync::Arc;

fn identity_policy() -> String {
    std::fs::read_to_string(repo_root().join("examples/policy/identity.toml")).unwrap()
}

/// A mesh whose `[auth]` knows `alice` and `bob`, with the example
/// identity policy registered: the coordinators of both.
async fn alice_and_bob() -> (TestMesh, Coordinator, Coordinator) {
    two_callers(["alice", "bob"], "caller", identity_policy()).await
}

/// Three emails an hour per caller: Alice's batches in six different
/// sessions let three run and cancel the rest; Bob, another identity, is
/// not affected, in a session id Alice used or in his own.
#[tokio::test]
async fn r34_an_identity_budget_binds_across_session_ids() {
    let (mesh, alice, bob) = alice_and_bob().await;
    let mut ran = Vec::new();
    for turn in 0..6u32 {
        let o = outcome(&alice, &format!("s-{turn}"), 0, "email.send", "{}").await;
        if let Outcome::Cancel { content } = &o {
            assert!(content.contains("whatever the session"), "{content}");
        }
        ran.push(proceeds(&o));
    }
    assert_eq!(ran, [true, true, true, false, false, false]);
    for (turn, session) in ["s-0", "bob-1", "bob-2"].iter().enumerate() {
        let o = outcome(&bob, session, turn as u32, "email.send", "{}").await;
        assert!(proceeds(&o), "bob in {session}: {o:?}");
    }
    let fourth = outcome(&bob, "bob-3", 3, "email.send", "{}").await;
    assert!(matches!(fourth, Outcome::Cancel { .. }), "{fourth:?}");
    // Alice's budget counts a batch of several calls too.
    let d = alice
        .evaluate_once(
            "s-new",
            Batch::new(9)
                .call("a", "fs.list", "{}")
                .call("b", "email.send", "{}"),
        )
        .await
        .unwrap();
    assert!(proceeds(&d.call("a").unwrap().outcome));
    assert!(matches!(
        d.call("b").unwrap().outcome,
        Outcome::Cancel { .. }
    ));
    mesh.shutdown().await;
}

/// A flow across sessions: a secret read from fs in Alice's session A may
/// not be sent to another server from her session B; Bob sending the same
/// text is not Alice's flow.
#[tokio::test]
async fn r34_a_value_read_in_one_session_cannot_leave_from_another_of_the_same_identity() {
    let (mesh, alice, bob) = alice_and_bob().await;
    let secret = "hunter2-Sup3rS3cret";
    let result = read_env(&alice, "A", 0, secret).await;
    let d = dotenv_result(&alice, "A", 1, &result).await;
    assert!(!d.result("r1").unwrap().blocked());
    let insert = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{secret}')"}}"#);
    let sent = outcome(&alice, "B", 0, "sqlite.query", &insert).await;
    assert!(
        matches!(&sent, Outcome::Cancel { content } if content.contains("fs server")),
        "a value read in session A left from session B: {sent:?}"
    );
    // Written back to fs from session B: allowed; another value: allowed.
    let back = format!(r#"{{"path":".env.bak","content":"{secret}"}}"#);
    assert!(proceeds(
        &outcome(&alice, "B", 1, "fs.write_file", &back).await
    ));
    let other = r#"{"sql":"INSERT INTO notes VALUES ('nothing secret here')"}"#;
    assert!(proceeds(
        &outcome(&alice, "B", 2, "sqlite.query", other).await
    ));
    // Bob never read it.
    assert!(proceeds(
        &outcome(&bob, "B", 0, "sqlite.query", &insert).await
    ));
    mesh.shutdown().await;
}

/// Six single-email batches of one identity, each in a session of its own
/// and on a connection of its own, sent at once: exactly three run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_concurrent_batches_of_one_identity_in_different_sessions_cannot_race_a_count() {
    let mesh = TestMesh::start().await;
    mesh.register(Registration::policy("caller", identity_policy()))
        .await;
    // Without principals, every caller is one identity (R24).
    let proceeded = six_at_once(
        std::slice::from_ref(&mesh.url),
        "whatever the session",
        |turn| {
            let batch = Batch::new(turn).call("e", "email.send", r#"{"to":"a@example.com"}"#);
            (format!("race-{turn}"), batch)
        },
    )
    .await;
    assert_eq!(proceeded, 3);
    mesh.shutdown().await;
}

/// The store down: the identity rule fails, and with it the guard per its
/// failure policy (fail closed by default), never "no history".
#[tokio::test]
async fn r34_r13_identity_memory_that_cannot_be_read_fails_the_rule_closed() {
    let mesh = TestMesh::start().await;
    attach_store(&mesh, Arc::new(Down));
    let only_identity = "[[rule]]\nname='budget'\ntools=['email.send']\n\
        when='identity.count(\"email.send\", \"1h\") >= 3'\naction='cancel'\nmessage='\"over\"'\n";
    mesh.register(Registration::policy("caller", only_identity))
        .await;
    let c = mesh.coordinator().await;
    let d = decision(&c, "s", 0, "email.send", "{}").await;
    let call = d.call("c").unwrap();
    assert!(
        matches!(&call.outcome, Outcome::Cancel { .. }) && call.failure,
        "fail closed, never no history so proceed: {call:?}"
    );
    let error = &d.guard("caller").unwrap().error;
    assert!(error.contains("memory unavailable"), "{error}");
    mesh.shutdown().await;
}

/// R20: the session id the mesh keeps identities' memory under is not one
/// a coordinator may send, so no batch reads or writes it as a session.
#[tokio::test]
async fn r20_r34_the_identity_memory_session_id_is_refused_from_coordinators() {
    let mesh = TestMesh::start().await;
    mesh.register(Registration::policy("caller", identity_policy()))
        .await;
    let c = mesh.coordinator().await;
    let reserved = guardmesh_server::session::SessionKey::identity("").session_id;
    let refused = c
        .evaluate_once(&reserved, Batch::new(0).call("c", "email.send", "{}"))
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("reserved"), "{refused}");
    mesh.shutdown().await;
}

/// Six single-email batches of one identity, each in a session of its own,
/// three to each of two `guardmesh serve` replicas sharing their memory
/// through Redis, sent at once: exactly three run, round after round (a
/// batch judged on an identity memory the other replica changed before
/// its write is judged again on the new memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_two_replicas_on_redis_cannot_race_an_identity_count() {
    use crate::sessions_store::{Redis, secret_file};
    let Some(redis) = Redis::start("r34_two_replicas_on_redis_cannot_race_an_identity_count").await
    else {
        return;
    };
    let dir = fresh_dir("identity-race-redis");
    let secret = secret_file(&dir, "session.secret");
    // A budget per tool, so that each round counts afresh.
    let policy = dir.join("identity.toml");
    std::fs::write(
        &policy,
        "[[rule]]\nname = \"budget\"\ntools = [\"email.*\"]\n\
         when = 'identity.count(call.tool, \"1h\") >= 3'\naction = \"cancel\"\n\
         message = '\"Tool call blocked: no more than 3, whatever the session.\"'\n",
    )
    .unwrap();
    let config = format!(
        "[registry]\nprefix = \"/t/identity-race\"\n\n[sessions]\nstore = \"redis\"\n\
         redis_url = {:?}\nsecret_file = {:?}\n\n[[guard]]\nname = \"caller\"\n\
         policy = {:?}\nfailure_policy = \"fail_closed\"\n",
        redis.url(),
        secret.display().to_string(),
        policy.display().to_string(),
    );
    let a = MeshProcess::start("identity-race-a", &config, None).await;
    let b = MeshProcess::start("identity-race-b", &config, None).await;
    let urls = [a.url.clone(), b.url.clone()];
    for round in 0..3u32 {
        let proceeded = six_at_once(&urls, "", |turn| {
            let batch = Batch::new(turn).call("e", format!("email.r{round}"), "{}");
            (format!("r{round}-s{turn}"), batch)
        })
        .await;
        assert_eq!(proceeded, 3, "round {round}");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// R34, R25: only a chain with a rule that names `identity` reads or
/// writes the identity's memory: a session rule's batch costs one read and
/// one write (its session's), an identity rule's two of each.
#[tokio::test]
async fn r34_only_a_chain_that_reads_identity_pays_for_it() {
    use std::sync::atomic::Ordering::Relaxed;
    let session_only = "[[rule]]\nname='s'\ntools=['email.send']\n\
        when='session.count(\"email.send\", \"1h\") >= 3'\naction='cancel'\nmessage='\"over\"'\n";
    for (policy, per_batch) in [(session_only.to_owned(), 1), (identity_policy(), 2)] {
        let mesh = TestMesh::start().await;
        mesh.register(Registration::policy("p", policy)).await;
        let c = mesh.coordinator().await;
        assert!(proceeds(&outcome(&c, "s", 0, "email.send", "{}").await));
        let stats = mesh.mesh.sessions().stats();
        assert_eq!(stats.reads.load(Relaxed), per_batch);
        assert_eq!(stats.writes.load(Relaxed), per_batch);
        mesh.shutdown().await;
    }
}

/// The mesh's own store whose writes of identities' memory fail while
/// `.1` is set: sessions read and write as usual.
#[derive(Debug)]
struct IdentityWritesFail(
    guardmesh_server::session::LocalStore,
    std::sync::atomic::AtomicBool,
);

#[tonic::async_trait]
impl SessionStore for IdentityWritesFail {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        self.0.load(key).await
    }
    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        if self.1.load(std::sync::atomic::Ordering::SeqCst)
            && guardmesh_server::session::is_reserved_session_id(&key.session_id)
        {
            return Err(StoreError::TimedOut(std::time::Duration::from_millis(300)));
        }
        self.0.update(key, write).await
    }
    fn kind(&self) -> &'static str {
        "identity-writes-fail"
    }
}

/// R13, R34: what cannot be remembered is not passed. A call the identity
/// rules let run whose identity memory cannot be written does not run
/// (the guard is `fail_closed`), and neither is the result of a call that
/// ran: a budget cannot be spent, nor a value read, unrecorded.
#[tokio::test]
async fn r13_r34_a_call_or_result_the_identity_memory_cannot_record_is_not_passed() {
    let mesh = TestMesh::start().await;
    let store = Arc::new(IdentityWritesFail(
        guardmesh_server::session::LocalStore::new(SessionLimits::default()),
        true.into(),
    ));
    attach_store(&mesh, store.clone());
    mesh.register(Registration::policy("caller", identity_policy()))
        .await;
    let c = mesh.coordinator().await;
    for turn in 0..4 {
        let d = c
            .evaluate_once(
                &format!("s-{turn}"),
                Batch::new(turn).call("c", "email.send", "{}"),
            )
            .await
            .unwrap();
        let call = d.call("c").unwrap();
        assert!(
            matches!(&call.outcome, Outcome::Cancel { .. }) && call.failure,
            "a call the identity memory cannot record ran: {call:?}"
        );
        assert!(d.execute.is_empty(), "{d:?}");
    }
    store.1.store(false, std::sync::atomic::Ordering::SeqCst);
    read_dotenv(&c, "r", 0).await;
    store.1.store(true, std::sync::atomic::Ordering::SeqCst);
    let result = serde_json::json!({
        "content": [{"type": "text", "text": "DB_PASSWORD=hunter2-Sup3rS3cret"}]
    })
    .to_string();
    let d = dotenv_result(&c, "r", 1, &result).await;
    let r = d.result("r1").unwrap();
    assert!(
        r.blocked() && r.failure && !r.result.contains("hunter2"),
        "a result the identity memory cannot record was passed: {r:?}"
    );
    mesh.shutdown().await;
}
