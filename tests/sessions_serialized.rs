//! R34: two batches of one session are judged as if one ran after the
//! other, and a call's rules see the calls before it in its own batch, so
//! a count or a flow cannot be raced by sending batches at once, nor by
//! sending many calls in one batch: on one mesh, and on two `guardmesh
//! serve` replicas sharing their sessions through etcd or Redis.

use crate::harness::*;
use guardmesh_client::{Batch, Outcome, Registration};

fn relaybleed() -> String {
    std::fs::read_to_string(repo_root().join("examples/policy/relaybleed.toml")).unwrap()
}

/// A single-email batch of turn `turn`: its call `e`.
fn email(turn: u32) -> Batch {
    Batch::new(turn).call("e", "email.send", r#"{"to":"a@example.com"}"#)
}

/// What becomes of a single-email batch of turn `turn` of `session`.
async fn one_email(c: &guardmesh_client::Coordinator, session: &str, turn: u32) -> Outcome {
    let d = c.evaluate_once(session, email(turn)).await.unwrap();
    d.call("e").unwrap().outcome.clone()
}

/// Six single-call batches sent at once, each on a connection of its own,
/// in turn to each of `urls`; `batch(turn)` is each one's session and
/// batch, its call `e`. How many of the calls ran; each that did not was
/// cancelled with content holding `cancelled`.
pub(crate) async fn six_at_once(
    urls: &[String],
    cancelled: &str,
    batch: impl Fn(u32) -> (String, Batch),
) -> usize {
    let mut sent = Vec::new();
    for turn in 0..6u32 {
        let url = urls[turn as usize % urls.len()].clone();
        let (session, batch) = batch(turn);
        sent.push(tokio::spawn(async move {
            let c = guardmesh_client::Coordinator::connect(url).await.unwrap();
            let d = c.evaluate_once(&session, batch).await.unwrap();
            (session, d.call("e").unwrap().outcome.clone())
        }));
    }
    let mut proceeded = 0;
    for sent in sent {
        let (session, outcome) = sent.await.unwrap();
        match outcome {
            Outcome::Proceed => proceeded += 1,
            Outcome::Cancel { content } => {
                assert!(content.contains(cancelled), "{session}: {content}");
            }
            other => panic!("{session}: {other:?}"),
        }
    }
    proceeded
}

/// Six single-email batches of `session` sent at once, each on a
/// connection of its own, in turn to each of `urls`: how many ran. Every
/// other one is cancelled by the three-emails rule.
async fn six_emails_at_once(urls: &[String], session: &str) -> usize {
    six_at_once(urls, "3 emails", |turn| (session.to_owned(), email(turn))).await
}

/// A remote guard that reads the session's memory (it asks for it) and
/// cancels every call once three emails ran; a little time judging, so
/// that batches overlap.
async fn email_rate_guard() -> TestGuard {
    script_guard(|b| {
        let sent = b
            .session
            .as_ref()
            .and_then(|m| m.counts.get("email.send").copied())
            .unwrap_or(0);
        Script {
            delay: std::time::Duration::from_millis(20),
            verdicts: b
                .calls
                .iter()
                .filter(|_| sent >= 3)
                .map(|c| guardmesh_client::verdict::cancel(&c.call_id, "at most 3 emails"))
                .collect(),
            ..Script::default()
        }
    })
    .await
}

/// Six single-email batches of one session sent at once, each on a
/// connection of its own: `email-rate` lets exactly three run. Another
/// session is not held up by them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_concurrent_batches_of_one_session_cannot_race_a_count() {
    let mesh = TestMesh::start().await;
    mesh.register(Registration::policy("flows", relaybleed()))
        .await;
    for round in 0..3 {
        let proceeded =
            six_emails_at_once(std::slice::from_ref(&mesh.url), &format!("race-{round}")).await;
        assert_eq!(proceeded, 3, "round {round}");
    }
    // Another session still gets its own three.
    let c = mesh.coordinator().await;
    assert_eq!(one_email(&c, "other", 0).await, Outcome::Proceed);
    mesh.shutdown().await;
}

/// The same race judged by a remote guard that reads the memory (it asked
/// for it): its count of the session's emails sees every email an earlier
/// batch let run, so six batches at once let exactly three run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_a_remote_guard_that_reads_the_memory_cannot_be_raced() {
    let mesh = TestMesh::start().await;
    let guard = email_rate_guard().await;
    mesh.register(Registration::validate("rate", &guard.url).reads_session_memory())
        .await;
    assert_eq!(
        six_emails_at_once(std::slice::from_ref(&mesh.url), "remote-race").await,
        3
    );
    mesh.shutdown().await;
}

/// One batch of six `email.send` calls in a fresh session: `email-rate`
/// ("at most 3 an hour") lets the first three run and cancels the others,
/// as six batches of one call would. The next batch of the session sends
/// none, and a call of another tool in the batch is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_one_batch_of_many_calls_cannot_pass_a_count() {
    let mesh = TestMesh::start().await;
    mesh.register(Registration::policy("flows", relaybleed()))
        .await;
    let c = mesh.coordinator().await;
    let batch = (0..7).fold(Batch::new(0), |b, i| {
        let tool = if i == 2 { "fs.read_file" } else { "email.send" };
        b.call(
            format!("e{i}"),
            tool,
            format!(r#"{{"to":"a{i}@example.com"}}"#),
        )
    });
    let d = c.evaluate_once("burst", batch).await.unwrap();
    let proceeded: Vec<bool> = d
        .calls
        .iter()
        .map(|call| matches!(call.outcome, Outcome::Proceed))
        .collect();
    assert_eq!(
        proceeded,
        [true, true, true, true, false, false, false],
        "{d:?}"
    );
    for call in d
        .calls
        .iter()
        .filter(|c| !matches!(c.outcome, Outcome::Proceed))
    {
        assert!(
            matches!(&call.outcome, Outcome::Cancel { content } if content.contains("3 emails")),
            "{call:?}"
        );
    }
    let o = one_email(&c, "burst", 1).await;
    assert!(matches!(o, Outcome::Cancel { .. }), "{o:?}");
    mesh.shutdown().await;
}

/// Six single-email batches of one session sent at once, three to each of
/// two replicas sharing `store`: `email-rate` lets exactly three run in all,
/// round after round (R34: a batch judged on a memory another replica
/// changed before its write is judged again on the new memory).
async fn six_at_once_on_two_replicas(a: &MeshProcess, b: &MeshProcess) {
    for round in 0..4 {
        let urls = [a.url.clone(), b.url.clone()];
        let proceeded = six_emails_at_once(&urls, &format!("race-{round}")).await;
        assert_eq!(proceeded, 3, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_two_replicas_on_etcd_cannot_race_a_count() {
    let cluster = crate::etcd::Cluster::start().await;
    let dir = fresh_dir("race-etcd");
    let (a, b) = crate::sessions_store::etcd_replicas(&cluster, &dir, "race-etcd", "").await;
    six_at_once_on_two_replicas(&a, &b).await;
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_two_replicas_on_redis_cannot_race_a_count() {
    use crate::sessions_store::{Redis, redis_replicas};
    let Some(redis) = Redis::start("r34_two_replicas_on_redis_cannot_race_a_count").await else {
        return;
    };
    let dir = fresh_dir("race-redis");
    let (a, b) = redis_replicas(&redis, &dir, "race-redis", "").await;
    six_at_once_on_two_replicas(&a, &b).await;
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The race judged by a remote guard that reads the memory, on two
/// replicas sharing their sessions through Redis: a batch judged on a
/// memory the other replica changed before its write is judged again,
/// the guard asked again on the new memory, so six batches at once, three
/// to each replica, let exactly three run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r34_a_remote_guard_that_reads_the_memory_cannot_be_raced_across_replicas() {
    use crate::sessions_store::{Redis, secret_file};
    let Some(redis) =
        Redis::start("r34_a_remote_guard_that_reads_the_memory_cannot_be_raced_across_replicas")
            .await
    else {
        return;
    };
    let guard = email_rate_guard().await;
    let dir = fresh_dir("race-remote");
    let secret = secret_file(&dir, "session.secret");
    let config = format!(
        "[registry]\nprefix = \"/t/race-remote\"\n\n[sessions]\nstore = \"redis\"\n\
         redis_url = {:?}\nsecret_file = {:?}\n\n[[guard]]\nname = \"rate\"\n\
         endpoint = {:?}\nsession_memory = \"read\"\nfailure_policy = \"fail_closed\"\n",
        redis.url(),
        secret.display().to_string(),
        guard.url,
    );
    let a = MeshProcess::start("race-remote-a", &config, None).await;
    let b = MeshProcess::start("race-remote-b", &config, None).await;
    for round in 0..3 {
        let urls = [a.url.clone(), b.url.clone()];
        let proceeded = six_emails_at_once(&urls, &format!("remote-race-{round}")).await;
        assert_eq!(proceeded, 3, "round {round}");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}
