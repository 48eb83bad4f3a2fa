//! Approvals (R35) through a real mesh and real guards on loopback, from
//! the Rust SDK: a guard asks, an approver answers, the coordinator sends
//! the same call again with the approval. Each test names the rule.

use crate::harness::*;
use guardmesh_client::proto::{ApprovalState, TraceStatus};
use guardmesh_client::verdict::{ask, steer};
use guardmesh_client::{Approver, Batch, BatchDecision, Outcome, Registration, Session};
use std::time::Duration;

/// A guard that asks about refunds over 1,000 and proceeds otherwise.
async fn refund_guard() -> TestGuard {
    call_guard(Duration::ZERO, |call| {
        let args: serde_json::Value = serde_json::from_str(&call.arguments).ok()?;
        (call.tool == "refund" && args["amount"].as_f64().unwrap_or(0.0) > 1000.0)
            .then(|| ask(&call.call_id, "refund over 1,000"))
    })
    .await
}

const REFUND: &str = r#"{"amount":1500,"to":"acct-1"}"#;

async fn decide(session: &Session, batch: Batch) -> BatchDecision {
    tokio::time::timeout(Duration::from_secs(10), session.evaluate(batch))
        .await
        .expect("answered within 10 s")
        .expect("judged")
}

/// The id of the approval request the one call of `d` waits for.
fn asked(d: &BatchDecision) -> String {
    let call = &d.calls[0];
    let approval = call
        .ask()
        .unwrap_or_else(|| panic!("an ask, not {:?}", call.outcome));
    assert!(!call.proceeds());
    assert!(d.execute.is_empty(), "an ask runs nothing");
    assert_eq!(approval.state, ApprovalState::Pending as i32);
    approval.id.clone()
}

/// R35: the ask, its approval and one run of the same call; a second use
/// of the approval is refused (the guard asks again); the decision says
/// why and the trace names what the approval stood in for.
#[tokio::test]
async fn r35_approved_call_runs_once_and_a_second_use_asks_again() {
    let mesh = TestMesh::start().await;
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let session = mesh.coordinator().await.session("s1").await.unwrap();
    let d = decide(&session, Batch::turn(0).call("c1", "refund", REFUND)).await;
    let id = asked(&d);
    let approval = d.calls[0].ask().unwrap();
    assert_eq!(approval.guard, "refunds");
    assert_eq!(approval.reason, "refund over 1,000");
    assert_eq!(approval.session_id, "s1");
    assert_eq!(approval.chain_revision, d.chain_revision);
    assert_eq!(approval.digest.len(), 64);
    assert!(
        matches!(&d.calls[0].outcome, Outcome::Ask { content, .. } if content.contains("approve"))
    );
    assert_eq!(status_of(&d, "refunds"), TraceStatus::Asked);
    assert_eq!(d.guard("refunds").unwrap().asked_call_ids, ["c1"]);

    // Sent again before anyone answered: still waiting, same request.
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c1", "refund", REFUND)
            .approval("c1", &id),
    )
    .await;
    assert_eq!(asked(&d), id);

    let approver = Approver::connect(&mesh.url).await.unwrap();
    let pending = approver.pending().await.unwrap();
    assert!(pending.iter().any(|r| r.id == id), "{pending:?}");
    let answered = approver.approve(&id, "checked").await.unwrap();
    assert_eq!(answered.state, ApprovalState::Approved as i32);
    let requests_before = guard.guard.requests();

    let d = decide(
        &session,
        Batch::turn(2)
            .call("c2", "refund", r#"{"to":"acct-1","amount":1500}"#)
            .approval("c2", &id),
    )
    .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
    assert_eq!(d.execute.len(), 1);
    assert_eq!(d.calls[0].approved_by_request.as_deref(), Some(id.as_str()));
    assert_eq!(
        guard.guard.requests(),
        requests_before,
        "the guard that asked is not consulted again"
    );
    assert_eq!(d.guard("refunds").unwrap().approved_call_ids, ["c2"]);

    // The second use: refused, and the guard asks again (a new request).
    let d = decide(
        &session,
        Batch::turn(3)
            .call("c3", "refund", REFUND)
            .approval("c3", &id),
    )
    .await;
    let again = asked(&d);
    assert_ne!(again, id);
    assert_eq!(
        d.calls[0].approval_refused.as_deref(),
        Some("the approval was already used")
    );
    let used = approver.list(ApprovalState::Used, "s1", 0).await.unwrap();
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].id, id);
    // Counted: two requests made, one approved and used, and two
    // approvals named that did not hold (pending, used).
    for (event, count) in [
        ("asked", 2.0),
        ("approved", 1.0),
        ("used", 1.0),
        ("refused", 2.0),
    ] {
        let sample = format!("guardmesh_approvals_total{{event=\"{event}\"}}");
        assert_eq!(metric(&mesh, &sample), count, "{sample}");
    }
    assert_eq!(
        metric(&mesh, "guardmesh_calls_total{decision=\"ask\"}"),
        3.0,
        "three decisions were asks"
    );
}

/// R35: an approval is bound to the call's digest: other arguments or
/// another tool is another call, asked about again; its session: another
/// session's approval is refused; never a proceed without a valid approval.
#[tokio::test]
async fn r35_an_approval_holds_only_for_the_same_call_in_the_same_session() {
    let mesh = TestMesh::start().await;
    let guard = call_guard(Duration::ZERO, |call| {
        call.tool
            .starts_with("refund")
            .then(|| ask(&call.call_id, "refunds need a person"))
    })
    .await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let session = coordinator.session("s1").await.unwrap();
    let id = asked(&decide(&session, Batch::turn(0).call("c1", "refund", REFUND)).await);
    Approver::connect(&mesh.url)
        .await
        .unwrap()
        .approve(&id, "")
        .await
        .unwrap();

    for (tool, args, why) in [
        (
            "refund",
            r#"{"amount":1501,"to":"acct-1"}"#,
            "digest differs",
        ),
        ("refund_all", REFUND, "digest differs"),
    ] {
        let d = decide(
            &session,
            Batch::turn(1).call("c", tool, args).approval("c", &id),
        )
        .await;
        asked(&d);
        let refused = d.calls[0].approval_refused.clone().unwrap_or_default();
        assert!(refused.contains(why), "{tool} {args}: {refused}");
    }
    let other = coordinator.session("s2").await.unwrap();
    let d = decide(
        &other,
        Batch::turn(0)
            .call("c1", "refund", REFUND)
            .approval("c1", &id),
    )
    .await;
    asked(&d);
    assert!(
        d.calls[0]
            .approval_refused
            .as_deref()
            .unwrap_or_default()
            .contains("another session"),
        "{:?}",
        d.calls[0]
    );
    // Forged ids: not of the form, or of nobody.
    for forged in [
        "../../x",
        &"0".repeat(64),
        &format!("{}{}", &id[..32], "f".repeat(32)),
    ] {
        let d = decide(
            &session,
            Batch::turn(2)
                .call("c1", "refund", REFUND)
                .approval("c1", forged),
        )
        .await;
        asked(&d);
        assert!(d.calls[0].approval_refused.is_some(), "{forged}");
    }
    // Still unused: the same call runs on it once.
    let d = decide(
        &session,
        Batch::turn(3)
            .call("c1", "refund", REFUND)
            .approval("c1", &id),
    )
    .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
}

/// R35: the guards after the one that asked still judge the approved
/// call; an earlier skip wins over a later ask, an earlier ask over a
/// later skip (R3); a denied request cancels its call.
#[tokio::test]
async fn r35_r3_asks_order_as_skips_and_later_guards_still_judge() {
    let mesh = TestMesh::start().await;
    let asker = refund_guard().await;
    let later = call_guard(Duration::ZERO, |call| {
        call.arguments
            .contains("acct-9")
            .then(|| steer(&call.call_id, "acct-9 is closed"))
    })
    .await;
    mesh.register(Registration::validate("refunds", &asker.url))
        .await;
    mesh.register(Registration::validate("accounts", &later.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let closed = r#"{"amount":1500,"to":"acct-9"}"#;
    // The earlier guard asks, the later one would steer: the ask decides.
    let d = decide(&session, Batch::turn(0).call("c1", "refund", closed)).await;
    let id = asked(&d);
    let approver = Approver::connect(&mesh.url).await.unwrap();
    approver.approve(&id, "fine by me").await.unwrap();
    // Approved: the later guard still judges it, and steers.
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c1", "refund", closed)
            .approval("c1", &id),
    )
    .await;
    assert!(
        matches!(&d.calls[0].outcome, Outcome::Steer { content } if content == "acct-9 is closed"),
        "{:?}",
        d.calls[0]
    );
    assert_eq!(d.calls[0].decided_by.as_deref(), Some("accounts"));

    // Denied: cancelled, no guard consulted.
    let d = decide(&session, Batch::turn(2).call("c2", "refund", REFUND)).await;
    let denied = asked(&d);
    let answered = approver.deny(&denied, "not this month").await.unwrap();
    assert_eq!(answered.state, ApprovalState::Denied as i32);
    let requests = asker.guard.requests();
    let d = decide(
        &session,
        Batch::turn(3)
            .call("c2", "refund", REFUND)
            .approval("c2", &denied),
    )
    .await;
    match &d.calls[0].outcome {
        Outcome::Cancel { content } => assert!(content.contains("not this month"), "{content}"),
        other => panic!("denied must cancel, not {other:?}"),
    }
    assert_eq!(asker.guard.requests(), requests);
    // A second answer is refused, naming the state.
    let again = approver.approve(&denied, "").await.unwrap_err().to_string();
    assert!(again.contains("already answered"), "{again}");
    let unknown = approver
        .approve("0".repeat(64), "")
        .await
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("no approval request"), "{unknown}");
}

/// R35: a changed chain means ask again; an approval past its expiry is
/// refused, and a request nobody answered expires into a cancel; a flood
/// of asks is bounded per session (`max_open_per_session`).
#[tokio::test]
async fn r35_a_changed_chain_or_an_expiry_asks_again_and_asks_are_bounded() {
    let mut config = fast_config();
    config.approvals.ttl = Duration::from_millis(1500);
    config.approvals.max_open_per_session = 3;
    let mesh = TestMesh::with_config(config).await;
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let approver = Approver::connect(&mesh.url).await.unwrap();

    // The chain changes between the approval and its use.
    let id = asked(&decide(&session, Batch::turn(0).call("c1", "refund", REFUND)).await);
    approver.approve(&id, "").await.unwrap();
    let other = proceed_guard().await;
    mesh.register(Registration::validate("audit", &other.url))
        .await;
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c1", "refund", REFUND)
            .approval("c1", &id),
    )
    .await;
    let again = asked(&d);
    assert!(
        d.calls[0]
            .approval_refused
            .as_deref()
            .unwrap_or_default()
            .contains("chain changed"),
        "{:?}",
        d.calls[0]
    );

    // Nobody answers: past the expiry the request cancels its call, and
    // an approver can no longer answer it.
    let approved = asked(&decide(&session, Batch::turn(2).call("c2", "refund", REFUND)).await);
    approver.approve(&approved, "").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let d = decide(
        &session,
        Batch::turn(3)
            .call("c1", "refund", REFUND)
            .approval("c1", &again),
    )
    .await;
    assert!(
        matches!(&d.calls[0].outcome, Outcome::Cancel { content } if content.contains("expired")),
        "{:?}",
        d.calls[0]
    );
    let late = approver.approve(&again, "").await.unwrap_err().to_string();
    assert!(late.contains("expired"), "{late}");
    // Approved, but used after the expiry: refused, asked again.
    let d = decide(
        &session,
        Batch::turn(4)
            .call("c2", "refund", REFUND)
            .approval("c2", &approved),
    )
    .await;
    asked(&d);
    assert!(
        d.calls[0]
            .approval_refused
            .as_deref()
            .unwrap_or_default()
            .contains("expired"),
        "{:?}",
        d.calls[0]
    );

    // A flood of asks in a fresh session: three wait, the rest cancel,
    // saying why.
    let flood = mesh.coordinator().await.session("flood").await.unwrap();
    let mut batch = Batch::turn(0);
    for i in 0..6 {
        batch = batch.call(format!("c{i}"), "refund", REFUND);
    }
    let d = decide(&flood, batch).await;
    let asks = d.calls.iter().filter(|c| c.ask().is_some()).count();
    assert_eq!(asks, 3, "{:?}", d.calls);
    for call in d.calls.iter().filter(|c| c.ask().is_none()) {
        match &call.outcome {
            Outcome::Cancel { content } => {
                assert!(content.contains("max_open_per_session"), "{content}");
            }
            other => panic!("past the bound an ask cancels, not {other:?}"),
        }
    }
    assert!(d.execute.is_empty());
}

/// R35: one approval raced by many batches at once: exactly one runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_one_approval_raced_runs_exactly_once() {
    let mesh = TestMesh::start().await;
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let approver = Approver::connect(&mesh.url).await.unwrap();
    for round in 0..5u32 {
        // A session per round: the racers that lose ask again, and a
        // session holds at most 16 requests waiting.
        let name = format!("s{round}");
        let session = coordinator.session(&name).await.unwrap();
        let id = asked(&decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await);
        approver.approve(&id, "").await.unwrap();
        let mut racers = tokio::task::JoinSet::new();
        for n in 0..20u32 {
            let coordinator = coordinator.clone();
            let id = id.clone();
            let name = name.clone();
            racers.spawn(async move {
                coordinator
                    .evaluate_once(
                        &name,
                        Batch::turn(n)
                            .call("c", "refund", REFUND)
                            .approval("c", &id),
                    )
                    .await
                    .unwrap()
            });
        }
        let mut ran = 0;
        while let Some(d) = racers.join_next().await {
            let d = d.unwrap();
            if d.calls[0].proceeds() {
                ran += 1;
            } else {
                assert!(d.execute.is_empty());
            }
        }
        assert_eq!(ran, 1, "round {round}: one approval, {ran} runs");
    }
}

/// R35, R24: on a mesh with principals, only the approver role answers;
/// an identity may not approve its own ask.
#[tokio::test]
async fn r35_r24_only_approvers_answer_and_not_their_own_asks() {
    let pki = TestPki::new();
    let (mesh, url) = TestMesh::with_tokens(
        &pki,
        &[
            ("agent", "agent-token", &["evaluate"]),
            ("boss", "boss-token", &["approver"]),
            ("solo", "solo-token", &["evaluate", "approver"]),
            ("ops", "ops-token", &["register"]),
        ],
        "",
    )
    .await;
    let guard = refund_guard().await;
    let connect = |token: &str| pki.connection(None, Some(token));
    guardmesh_client::Registrar::connect_with(&url, &connect("ops-token"))
        .await
        .unwrap()
        .register(Registration::validate("refunds", &guard.url))
        .await
        .unwrap();
    let agent = guardmesh_client::Coordinator::connect_with(&url, &connect("agent-token"))
        .await
        .unwrap();
    let session = agent.session("s").await.unwrap();
    let id = asked(&decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await);
    let as_agent = Approver::connect_with(&url, &connect("agent-token"))
        .await
        .unwrap();
    let refused = as_agent.approve(&id, "").await.unwrap_err().to_string();
    assert!(refused.contains("Approver role"), "{refused}");
    let pending = Approver::connect_with(&url, &connect("boss-token"))
        .await
        .unwrap()
        .pending()
        .await
        .unwrap();
    assert!(pending.iter().any(|r| r.id == id && r.asked_by == "agent"));

    // Asked by `solo`, which holds the approver role too: not its own.
    let solo = guardmesh_client::Coordinator::connect_with(&url, &connect("solo-token"))
        .await
        .unwrap();
    let solo_session = solo.session("t").await.unwrap();
    let own = asked(&decide(&solo_session, Batch::turn(0).call("c", "refund", REFUND)).await);
    let self_approval = Approver::connect_with(&url, &connect("solo-token"))
        .await
        .unwrap()
        .approve(&own, "")
        .await
        .unwrap_err()
        .to_string();
    assert!(self_approval.contains("may not approve"), "{self_approval}");

    let boss = Approver::connect_with(&url, &connect("boss-token"))
        .await
        .unwrap();
    let answered = boss.approve(&id, "ok").await.unwrap();
    assert_eq!(answered.answered_by, "boss");
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
    drop(mesh);
}

/// R35, R20: an approval for a call the batch does not hold refuses the
/// batch, naming the call.
#[tokio::test]
async fn r35_r20_an_approval_for_no_call_of_the_batch_is_refused() {
    let mesh = TestMesh::start().await;
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let error = session
        .evaluate(
            Batch::turn(0)
                .call("c1", "refund", REFUND)
                .approval("nope", "0".repeat(64)),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("\"nope\"") && error.contains("not in the batch"),
        "{error}"
    );
}

/// R35 on two `guardmesh serve` replicas sharing a 3-member etcd (chain
/// and sessions): asked on one, approved on the other; the same approval
/// sent to both replicas at once, 20 times: exactly one use each time;
/// a use on one is refused on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_two_replicas_on_etcd_let_one_approval_run_once() {
    let cluster = crate::etcd::Cluster::start().await;
    let dir = fresh_dir("approvals-etcd");
    let more = "store_timeout_ms = 2000";
    let (a, b) = crate::sessions_store::etcd_replicas(&cluster, &dir, "approvals-etcd", more).await;
    let guard = refund_guard().await;
    a.register(Registration::validate("refunds", &guard.url))
        .await;
    let (ca, cb) = (
        guardmesh_client::Coordinator::connect(a.url.clone())
            .await
            .unwrap(),
        guardmesh_client::Coordinator::connect(b.url.clone())
            .await
            .unwrap(),
    );
    // Both replicas judge under the same chain before the race starts.
    let mut same = false;
    for _ in 0..100 {
        let (da, db) = (
            ca.evaluate_once("warm", Batch::turn(0).call("c", "noop", "{}"))
                .await
                .unwrap(),
            cb.evaluate_once("warm", Batch::turn(0).call("c", "noop", "{}"))
                .await
                .unwrap(),
        );
        if da.chain_revision == db.chain_revision && da.guard("refunds").is_some() {
            same = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(same, "the replicas never judged under one chain");
    let approver_b = Approver::connect(b.url.clone()).await.unwrap();
    for round in 0..20u32 {
        let name = format!("race-{round}");
        let d = ca
            .evaluate_once(&name, Batch::turn(0).call("c", "refund", REFUND))
            .await
            .unwrap();
        let id = asked(&d);
        approver_b.approve(&id, "race").await.unwrap();
        let (da, db) = use_on_both(&ca, &cb, &name, &id).await;
        let ran = [&da, &db].iter().filter(|d| d.calls[0].proceeds()).count();
        assert_eq!(
            ran, 1,
            "round {round}: {:?} / {:?}",
            da.calls[0], db.calls[0]
        );
        for d in [&da, &db] {
            if !d.calls[0].proceeds() {
                assert!(d.execute.is_empty());
                assert!(d.calls[0].approval_refused.is_some(), "{:?}", d.calls[0]);
            }
        }
    }
    drop((a, b, cluster));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A session store that can be made to fail: every operation, or only
/// writes of records (a store paused between a read and a write).
#[derive(Debug)]
struct Flaky {
    inner: guardmesh_server::session::LocalStore,
    down: std::sync::atomic::AtomicBool,
    writes_fail: std::sync::atomic::AtomicBool,
    /// Reads of records never answer.
    hung: std::sync::atomic::AtomicBool,
}

impl Flaky {
    fn err() -> guardmesh_server::session::StoreError {
        guardmesh_server::session::StoreError::Unavailable("the test took it down".into())
    }
    fn down(&self) -> bool {
        self.down.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tonic::async_trait]
impl guardmesh_server::session::SessionStore for Flaky {
    async fn load(
        &self,
        key: &guardmesh_server::session::SessionKey,
    ) -> Result<Option<guardmesh_server::session::Memory>, guardmesh_server::session::StoreError>
    {
        if self.down() {
            return Err(Self::err());
        }
        self.inner.load(key).await
    }
    async fn update(
        &self,
        key: &guardmesh_server::session::SessionKey,
        write: guardmesh_server::session::Write<'_>,
    ) -> Result<guardmesh_server::session::Applied, guardmesh_server::session::StoreError> {
        if self.down() {
            return Err(Self::err());
        }
        self.inner.update(key, write).await
    }
    async fn record(
        &self,
        name: &str,
    ) -> Result<
        Option<guardmesh_server::session::store::Record>,
        guardmesh_server::session::StoreError,
    > {
        if self.down() {
            return Err(Self::err());
        }
        if self.hung.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.record(name).await
    }
    async fn put_record(
        &self,
        put: guardmesh_server::session::Put<'_>,
    ) -> Result<bool, guardmesh_server::session::StoreError> {
        if self.down() || self.writes_fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Self::err());
        }
        self.inner.put_record(put).await
    }
    async fn records(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<guardmesh_server::session::store::Record>, guardmesh_server::session::StoreError>
    {
        if self.down() {
            return Err(Self::err());
        }
        self.inner.records(prefix, limit).await
    }
    fn kind(&self) -> &'static str {
        "flaky"
    }
}

/// A mesh whose session store is a [`Flaky`] one, with the refund guard.
async fn flaky_mesh() -> (TestMesh, std::sync::Arc<Flaky>, TestGuard) {
    let mesh = TestMesh::start().await;
    let store = std::sync::Arc::new(Flaky {
        inner: guardmesh_server::session::LocalStore::new(Default::default()),
        down: Default::default(),
        writes_fail: Default::default(),
        hung: Default::default(),
    });
    mesh.mesh
        .attach_sessions(std::sync::Arc::new(
            guardmesh_server::session::SessionMemory::new(
                store.clone(),
                guardmesh_server::session::Digester::random(),
                Default::default(),
            ),
        ))
        .expect("attached before the first batch");
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    (mesh, store, guard)
}

/// R35, R13: a store that cannot be reached never lets a call through on
/// an approval and makes no request it cannot keep: asking cancels (a
/// failure), approving is UNAVAILABLE, using is refused and the approval
/// stays unused; a store that reads but cannot write (paused between the
/// read and the write of the use) cancels the call, and the approval is
/// still there once the store is back.
#[tokio::test]
async fn r35_r13_a_store_down_or_paused_fails_closed_for_asks_approvals_and_uses() {
    use std::sync::atomic::Ordering::SeqCst;
    let (mesh, store, _guard) = flaky_mesh().await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let approver = Approver::connect(&mesh.url).await.unwrap();

    // Down while asking: the ask cannot be recorded, so it cancels.
    store.down.store(true, SeqCst);
    let d = decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await;
    match &d.calls[0].outcome {
        Outcome::Cancel { content } => {
            assert!(content.contains("could not be recorded"), "{content}")
        }
        other => panic!("an ask the store cannot hold must cancel, not {other:?}"),
    }
    assert!(d.calls[0].failure && d.execute.is_empty());
    store.down.store(false, SeqCst);
    let id = asked(&decide(&session, Batch::turn(1).call("c", "refund", REFUND)).await);

    // Down while approving: UNAVAILABLE, nothing approved.
    store.down.store(true, SeqCst);
    let error = approver.approve(&id, "").await.unwrap_err().to_string();
    assert!(
        error.contains("Unavailable") || error.contains("unavailable"),
        "{error}"
    );
    store.down.store(false, SeqCst);
    let d = decide(
        &session,
        Batch::turn(2)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    assert_eq!(asked(&d), id, "still pending: the approval was not given");
    approver.approve(&id, "").await.unwrap();

    // Down while using: refused, never a proceed.
    store.down.store(true, SeqCst);
    let d = decide(
        &session,
        Batch::turn(3)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    assert!(
        !d.calls[0].proceeds() && d.execute.is_empty(),
        "{:?}",
        d.calls[0]
    );
    assert!(
        d.calls[0]
            .approval_refused
            .as_deref()
            .unwrap_or_default()
            .contains("could not be checked"),
        "{:?}",
        d.calls[0]
    );
    // Paused between the read and the write of the use: cancelled.
    store.down.store(false, SeqCst);
    store.writes_fail.store(true, SeqCst);
    let d = decide(
        &session,
        Batch::turn(4)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    match &d.calls[0].outcome {
        Outcome::Cancel { content } => assert!(content.contains("could not be used"), "{content}"),
        other => panic!("a use the store cannot record must cancel, not {other:?}"),
    }
    assert!(d.execute.is_empty());
    // Back: the approval was never used, and runs once now.
    store.writes_fail.store(false, SeqCst);
    let d = decide(
        &session,
        Batch::turn(5)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
}

/// R35, R27: a policy rule's `action = "ask"` asks as a remote guard does:
/// its message is the approver's reason, and the approved call runs once.
#[tokio::test]
async fn r35_r27_a_policy_rule_asks() {
    let mesh = TestMesh::start().await;
    let policy = r#"
[[rule]]
name = "big-refunds-need-a-person"
tools = ["refund"]
when = "call.args.amount > 1000"
action = "ask"
message = '"refund of " + string(call.args.amount) + " to " + call.args.to'
"#;
    mesh.register(Registration::policy("refund-policy", policy))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await;
    let id = asked(&d);
    let approval = d.calls[0].ask().unwrap();
    assert_eq!(approval.reason, "refund of 1500 to acct-1");
    assert_eq!(
        d.calls[0].rule.as_deref(),
        Some("big-refunds-need-a-person")
    );
    Approver::connect(&mesh.url)
        .await
        .unwrap()
        .approve(&id, "")
        .await
        .unwrap();
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
    // A small refund never asks.
    let d = decide(
        &session,
        Batch::turn(2).call("c", "refund", r#"{"amount":5,"to":"acct-1"}"#),
    )
    .await;
    assert!(d.calls[0].proceeds());
}

/// R35, R10: a mutate guard before the one that asked rewrites the call
/// otherwise on its second pass: the call the asker would see is another
/// digest, so the approval is refused and the guard asks again.
#[tokio::test]
async fn r35_r10_a_call_rewritten_otherwise_after_its_approval_is_asked_again() {
    let mesh = TestMesh::start().await;
    let passes = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let seen = passes.clone();
    let stamp = call_guard(Duration::ZERO, move |call| {
        let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut args: serde_json::Value = serde_json::from_str(&call.arguments).ok()?;
        args["note"] = serde_json::json!(format!("pass {n}"));
        Some(guardmesh_client::verdict::rewrite_arguments(
            &call.call_id,
            &args,
        ))
    })
    .await;
    mesh.register(Registration::mutate("stamp", &stamp.url, ["refund"]))
        .await;
    let asker = refund_guard().await;
    mesh.register(Registration::validate("refunds", &asker.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let id = asked(&decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await);
    Approver::connect(&mesh.url)
        .await
        .unwrap()
        .approve(&id, "")
        .await
        .unwrap();
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    let again = asked(&d);
    assert_ne!(again, id);
    assert!(
        d.calls[0]
            .approval_refused
            .as_deref()
            .unwrap_or_default()
            .contains("digest differs"),
        "{:?}",
        d.calls[0]
    );
    assert_eq!(passes.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// R35: a call two guards ask about runs once both asks are approved: the
/// batch names one approval per guard; each stands in for its own guard,
/// and both are used.
#[tokio::test]
async fn r35_a_call_two_guards_ask_about_needs_both_approvals() {
    let mesh = TestMesh::start().await;
    let first = refund_guard().await;
    let second = call_guard(Duration::ZERO, |call| {
        (call.tool == "refund").then(|| ask(&call.call_id, "every refund is audited"))
    })
    .await;
    mesh.register(Registration::validate("refunds", &first.url))
        .await;
    mesh.register(Registration::validate("audit", &second.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let approver = Approver::connect(&mesh.url).await.unwrap();
    let d = decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await;
    let a1 = asked(&d);
    assert_eq!(d.calls[0].ask().unwrap().guard, "refunds");
    approver.approve(&a1, "").await.unwrap();
    // The first guard's approval stands in; the second guard asks.
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c", "refund", REFUND)
            .approval("c", &a1),
    )
    .await;
    let a2 = asked(&d);
    assert_eq!(d.calls[0].ask().unwrap().guard, "audit");
    assert_eq!(d.calls[0].approval_refused, None, "{:?}", d.calls[0]);
    approver.approve(&a2, "").await.unwrap();
    let d = decide(
        &session,
        Batch::turn(2)
            .call("c", "refund", REFUND)
            .approval("c", &a2)
            .approval("c", &a1),
    )
    .await;
    assert!(d.calls[0].proceeds(), "{:?}", d.calls[0]);
    let mut used: Vec<&str> = d.calls[0]
        .approved_by_request
        .as_deref()
        .unwrap_or_default()
        .split(',')
        .collect();
    used.sort_unstable();
    let mut want = [a1.as_str(), a2.as_str()];
    want.sort_unstable();
    assert_eq!(used, want);
    // Both used: either one again is refused.
    let d = decide(
        &session,
        Batch::turn(3)
            .call("c", "refund", REFUND)
            .approval("c", &a1),
    )
    .await;
    asked(&d);
    assert!(
        d.calls[0]
            .approval_refused
            .as_deref()
            .unwrap_or_default()
            .contains("already used")
    );
    // More than eight for one call refuses the batch.
    let mut batch = Batch::turn(4).call("c", "refund", REFUND);
    for _ in 0..9 {
        batch = batch.approval("c", &a1);
    }
    let error = session.evaluate(batch).await.unwrap_err().to_string();
    assert!(error.contains("more than 8"), "{error}");
}

/// R35, R29: the ask, the approver's answer and the use are decision
/// records: the ask names its request, the answer its approver and note,
/// the use the request it ran on; the log verifies.
#[tokio::test]
async fn r35_r29_asks_answers_and_uses_are_decision_records() {
    use guardmesh_server::decision_log::{LogConfig, OnLogFailure};
    let dir = folder("approvals");
    let mesh = TestMesh::start().await;
    mesh.attach_log(
        LogConfig::new(dir.join("log"), "test"),
        OnLogFailure::Refuse,
    )
    .await;
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let id = asked(&decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await);
    let approver = Approver::connect(&mesh.url).await.unwrap();
    approver.approve(&id, "checked the invoice").await.unwrap();
    // A refused answer is recorded too, with why.
    approver.deny(&id, "").await.unwrap_err();
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    assert!(d.calls[0].proceeds());
    let all = records(&dir.join("log"));
    let decisions: Vec<&serde_json::Value> =
        all.iter().filter(|r| r["kind"] == "decision").collect();
    let answers: Vec<&serde_json::Value> = all.iter().filter(|r| r["kind"] == "approval").collect();
    assert_eq!(decisions.len(), 2, "{all:?}");
    let asked = &decisions[0]["decisions"][0];
    assert_eq!(asked["action"], "ask", "{asked}");
    assert_eq!(asked["approval"]["id"], id.as_str());
    assert_eq!(asked["approval"]["guard"], "refunds");
    assert_eq!(asked["approval"]["reason"], "refund over 1,000");
    let used = &decisions[1]["decisions"][0];
    assert_eq!(used["action"], "proceed");
    assert_eq!(used["approved_by_request"], id.as_str());
    assert_eq!(answers.len(), 2, "{all:?}");
    assert_eq!(answers[0]["request"], id.as_str());
    assert_eq!(answers[0]["answer"], "approve");
    assert_eq!(answers[0]["note"], "checked the invoice");
    assert_eq!(answers[0]["outcome"], "answered");
    assert_eq!(answers[0]["tool"], "refund");
    assert_eq!(answers[1]["answer"], "deny");
    assert!(
        answers[1]["outcome"]
            .as_str()
            .unwrap()
            .contains("already answered"),
        "{}",
        answers[1]
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["log", "verify", &dir.join("log").display().to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// R35: a request nobody answers expires into the asking guard's
/// configured fallback: cancel by default, steer when it registered
/// `ask_fallback` steer; never a proceed.
#[tokio::test]
async fn r35_an_unanswered_request_expires_into_the_guards_fallback() {
    let mut config = fast_config();
    config.approvals.ttl = Duration::from_millis(300);
    let mesh = TestMesh::with_config(config).await;
    let guard = refund_guard().await;
    mesh.register(
        Registration::validate("refunds", &guard.url)
            .ask_fallback(guardmesh_client::proto::AskFallback::Steer),
    )
    .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await;
    let id = asked(&d);
    assert_eq!(
        d.calls[0].ask().unwrap().fallback,
        guardmesh_client::proto::AskFallback::Steer as i32
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let d = decide(
        &session,
        Batch::turn(1)
            .call("c", "refund", REFUND)
            .approval("c", &id),
    )
    .await;
    match &d.calls[0].outcome {
        Outcome::Steer { content } => assert!(content.contains("expired"), "{content}"),
        other => panic!("the guard's fallback is steer, not {other:?}"),
    }
    assert!(d.execute.is_empty());
}

/// R35: the README's "Approvals" example, run as written: its Rust block is
/// a part of `client/examples/approvals.rs` as it is, the example runs
/// against `guardmesh serve` with the README's config, and prints the
/// README's output block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_the_readme_approvals_example_runs_as_written() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let section: String = readme
        .lines()
        .skip_while(|l| !l.starts_with("## Approvals"))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .map(|l| format!("{l}\n"))
        .collect();
    let block = |info: &str| -> String {
        let open = format!("```{info}\n");
        let start = section
            .find(&open)
            .unwrap_or_else(|| panic!("no {info} block"))
            + open.len();
        let end = start + section[start..].find("```\n").expect("a closed block");
        section[start..end].to_owned()
    };
    let example =
        std::fs::read_to_string(repo_root().join("client/examples/approvals.rs")).unwrap();
    assert!(
        example.contains(&block("rust")),
        "the README's Rust block is not client/examples/approvals.rs as it is"
    );
    let sh = block("sh");
    let config = sh
        .split_whitespace()
        .skip_while(|w| *w != "--config")
        .nth(1)
        .expect("serve --config FILE");
    assert!(sh.contains("--example approvals"), "{sh}");
    let mesh = MeshProcess::start_file(
        folder("readme-approvals"),
        &repo_root().join(config),
        None,
        free_port(),
    )
    .await;
    let out = crate::sdk::run_example("approvals", &mesh.url).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), block("text"));
}

/// R35, R25: a flood of asks spread over many sessions of one caller is
/// bounded too (`max_open_per_identity`); another caller's asks are not
/// counted against it.
#[tokio::test]
async fn r35_r25_asks_are_bounded_per_identity_over_its_sessions() {
    let mut config = fast_config();
    config.approvals.max_open_per_session = 3;
    config.approvals.max_open_per_identity = 4;
    let mesh = TestMesh::with_config(config).await;
    let guard = refund_guard().await;
    mesh.register(Registration::validate("refunds", &guard.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let mut asks = 0;
    let mut bounded = 0;
    for s in 0..3 {
        let session = coordinator.session(&format!("flood-{s}")).await.unwrap();
        let mut batch = Batch::turn(0);
        for i in 0..3 {
            batch = batch.call(format!("c{i}"), "refund", REFUND);
        }
        for call in decide(&session, batch).await.calls {
            match &call.outcome {
                Outcome::Ask { .. } => asks += 1,
                Outcome::Cancel { content } if content.contains("max_open_per_identity") => {
                    bounded += 1;
                }
                other => panic!("an ask or the identity's bound, not {other:?}"),
            }
        }
    }
    assert_eq!((asks, bounded), (4, 5));
}

/// R35, R14, R25: a store that hangs while many approvals are checked
/// cannot hold the batch past its deadline: the approvals are refused and
/// nothing proceeds on them.
#[tokio::test]
async fn r35_r14_a_hung_store_cannot_hold_a_batch_that_names_many_approvals() {
    use std::sync::atomic::Ordering::SeqCst;
    let (mesh, store, _guard) = flaky_mesh().await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let id = asked(&decide(&session, Batch::turn(0).call("c", "refund", REFUND)).await);
    store.hung.store(true, SeqCst);
    // 3 calls x 8 approvals: 24 reads of 500 ms each, were they not bounded
    // by the batch's 1 s.
    let mut batch = Batch::turn(1).timeout(Duration::from_secs(1));
    for c in 0..3 {
        batch = batch.call(format!("c{c}"), "refund", REFUND);
        for _ in 0..8 {
            batch = batch.approval(format!("c{c}"), &id);
        }
    }
    let started = std::time::Instant::now();
    let d = decide(&session, batch).await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "answered in {:?}",
        started.elapsed()
    );
    for call in &d.calls {
        assert!(!call.proceeds(), "{call:?}");
        assert!(call.approval_refused.is_some(), "{call:?}");
    }
    assert!(d.execute.is_empty());
}

/// R35 on two `guardmesh serve` replicas sharing sessions through a real
/// Redis (each with its own registry, the same chain registered on both):
/// asked on one, approved and listed on the other, used on both at once
/// 10 times: exactly one use each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r35_two_replicas_on_redis_let_one_approval_run_once() {
    use crate::sessions_store::{Redis, redis_replicas};
    let Some(redis) = Redis::start("r35_two_replicas_on_redis_let_one_approval_run_once").await
    else {
        return;
    };
    let dir = fresh_dir("approvals-redis");
    let more = "store_timeout_ms = 2000";
    let (a, b) = redis_replicas(&redis, &dir, "approvals-redis", more).await;
    let guard = refund_guard().await;
    for mesh in [&a, &b] {
        mesh.register(Registration::validate("refunds", &guard.url))
            .await;
    }
    let (ca, cb) = (
        guardmesh_client::Coordinator::connect(a.url.clone())
            .await
            .unwrap(),
        guardmesh_client::Coordinator::connect(b.url.clone())
            .await
            .unwrap(),
    );
    let approver_b = Approver::connect(b.url.clone()).await.unwrap();
    for round in 0..10u32 {
        let name = format!("race-{round}");
        let d = ca
            .evaluate_once(&name, Batch::turn(0).call("c", "refund", REFUND))
            .await
            .unwrap();
        let id = asked(&d);
        let pending = approver_b
            .list(ApprovalState::Pending, &name, 0)
            .await
            .unwrap();
        assert_eq!(pending.len(), 1, "{pending:?}");
        approver_b.approve(&id, "race").await.unwrap();
        let (da, db) = use_on_both(&ca, &cb, &name, &id).await;
        let ran = [&da, &db].iter().filter(|d| d.calls[0].proceeds()).count();
        assert_eq!(
            ran, 1,
            "round {round}: {:?} / {:?}",
            da.calls[0], db.calls[0]
        );
    }
    drop((a, b, redis));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same call of session `name`, naming approval `id`, sent to both
/// replicas at once: their two decisions.
async fn use_on_both(
    ca: &guardmesh_client::Coordinator,
    cb: &guardmesh_client::Coordinator,
    name: &str,
    id: &str,
) -> (BatchDecision, BatchDecision) {
    let use_on = |c: &guardmesh_client::Coordinator| {
        let c = c.clone();
        async move {
            c.evaluate_once(
                name,
                Batch::turn(1).call("c", "refund", REFUND).approval("c", id),
            )
            .await
            .unwrap()
        }
    };
    tokio::join!(use_on(ca), use_on(cb))
}
