//! Paused-time tests of a guard's replica pool (R32) over scripted guards:
//! the choice by load, ejection and failover of a failed replica's
//! requests, draining of a replica that left, busy replicas (R25) and the
//! failure policy only when no replica can judge (R13). The real-process
//! versions are in the integration module `guard_replicas`.

use super::discover::ReplicaTarget;
use super::pool::{EJECT_INITIAL, GuardPool, Request, SpawnLink};
use super::scripted::{ScriptedGuard, ScriptedNet, Step, proceed};
use super::transport::GuardTransport;
use super::{GuardFailure, GuardLink, LinkConfig, LinkEvent, NotSent, wire};
use crate::link::events::{EventSender, Events, mailbox};
use crate::observe::metrics::Metrics;
use guardmesh_proto::v1::{GuardBatch, ToolCall};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn url(i: usize) -> String {
    format!("http://127.0.0.{}:30000", i + 2)
}

struct Rig {
    guards: Vec<Arc<ScriptedGuard>>,
    pool: GuardPool,
    metrics: Arc<Metrics>,
    events: Events,
    tx: EventSender,
    set: Option<watch::Sender<Arc<[ReplicaTarget]>>>,
}

fn answer_after(
    delay: Duration,
) -> impl Fn(&GuardBatch) -> Vec<Step> + Clone + Send + Sync + 'static {
    move |b: &GuardBatch| {
        vec![Step::answer(b, b.calls.iter().map(|c| proceed(&c.call_id)).collect()).after(delay)]
    }
}

/// The script of replica `i` for [`rig`]: `first` on replica 0, `rest` on
/// the others.
fn replica_0_apart<A, B>(first: A, rest: B) -> impl Fn(usize) -> Box<Script>
where
    A: Fn(&GuardBatch) -> Vec<Step> + Clone + Send + Sync + 'static,
    B: Fn(&GuardBatch) -> Vec<Step> + Clone + Send + Sync + 'static,
{
    move |i| -> Box<Script> {
        if i == 0 {
            Box::new(first.clone())
        } else {
            Box::new(rest.clone())
        }
    }
}

type Script = dyn Fn(&GuardBatch) -> Vec<Step> + Send + Sync;

/// Links of the guard "g" to its replicas on `net`.
fn spawn_links(config: LinkConfig, net: &Arc<ScriptedNet>, metrics: &Arc<Metrics>) -> SpawnLink {
    let transport = net.clone() as Arc<dyn GuardTransport>;
    let metrics = metrics.clone();
    Box::new(move |target| {
        GuardLink::spawn_with(
            "g",
            &target.endpoint,
            config.clone(),
            transport.clone(),
            None,
            metrics.clone(),
        )
    })
}

/// Sends `pool` a one-call batch tagged `tag`, the guard's time `within`.
fn send(pool: &GuardPool, tx: &EventSender, tag: usize, within: Duration) -> Result<u64, NotSent> {
    let calls = [ToolCall {
        call_id: format!("c{tag}"),
        tool: "t".into(),
        arguments: "{}".into(),
    }];
    let shared = wire::shared_part(None, calls.iter());
    let batch = GuardBatch {
        batch_id: format!("b{tag}"),
        guard: "g".into(),
        deadline_ms: u32::try_from(within.as_millis()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    pool.send(Request {
        head: wire::Head::of(&batch),
        shared,
        tag,
        events: tx.clone(),
        client: 1,
        sender: crate::link::fair::Sender::default(),
        stall: Duration::from_secs(1),
        until: Instant::now() + within,
        at: Instant::now(),
    })
}

/// A pool over `n` scripted replicas each running `script(i)`, following
/// a watch the test holds (`rig.set`).
fn rig<S>(n: usize, change: impl FnOnce(&mut LinkConfig), script: impl Fn(usize) -> S) -> Rig
where
    S: Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
{
    let net = ScriptedNet::new();
    let guards = (0..n).map(|i| net.guard(&url(i), script(i))).collect();
    let mut config = LinkConfig {
        backoff_initial: ms(20),
        backoff_max: ms(200),
        ..LinkConfig::default()
    };
    change(&mut config);
    let metrics = Arc::new(Metrics::with_max_latency(Duration::from_secs(30)));
    let targets: Arc<[ReplicaTarget]> = (0..n).map(|i| ReplicaTarget::new(url(i))).collect();
    let (set, replicas) = watch::channel(targets);
    let pool = GuardPool::new(
        "g",
        replicas,
        spawn_links(config, &net, &metrics),
        metrics.clone(),
    );
    let (tx, events) = mailbox();
    Rig {
        guards,
        pool,
        metrics,
        events,
        tx,
        set: Some(set),
    }
}

impl Rig {
    /// Sends a one-call batch tagged `tag`, the guard's time `within`.
    fn send(&self, tag: usize, within: Duration) -> Result<u64, NotSent> {
        send(&self.pool, &self.tx, tag, within)
    }

    /// Sends one batch per tag of `tags`, each the guard's time `within`.
    fn send_all(&self, tags: std::ops::Range<usize>, within: Duration) {
        for tag in tags {
            self.send(tag, within).expect("sent");
        }
    }

    async fn next(&mut self) -> LinkEvent {
        self.events.recv().await
    }

    /// Waits for the next `n` events, each an answer.
    async fn answers(&mut self, n: usize) {
        for _ in 0..n {
            let event = self.next().await;
            assert!(matches!(event, LinkEvent::Answer { .. }), "{event:?}");
        }
    }

    /// Batches each replica read.
    fn reads(&self) -> Vec<usize> {
        self.guards.iter().map(|g| g.requests()).collect()
    }

    /// The batch ids each replica read.
    fn batch_ids(&self, i: usize) -> Vec<String> {
        self.guards[i]
            .batches()
            .into_iter()
            .map(|b| b.batch_id)
            .collect()
    }
}

/// A limit of requests at once that never adapts, and holds every request
/// a test sends (R25: none waits for room).
fn fixed_limit(config: &mut LinkConfig) {
    config.min_in_flight = 256;
    config.max_in_flight = 256;
}

/// Lets the links connect and read what is queued.
async fn settle() {
    tokio::time::sleep(ms(1)).await;
}

#[tokio::test(start_paused = true)]
async fn r32_requests_spread_over_replicas_by_outstanding_requests() {
    // Nothing is answered: each request adds to its replica's load, so
    // the two choices keep the replicas within a few requests of even
    // (under a fixed limit that holds them all).
    let rig = rig(3, fixed_limit, |_| |_: &GuardBatch| Vec::new());
    settle().await;
    rig.send_all(0..60, Duration::from_secs(5));
    settle().await;
    let reads = rig.reads();
    assert_eq!(reads.iter().sum::<usize>(), 60);
    for (i, n) in reads.iter().enumerate() {
        assert!((17..=23).contains(n), "replica {i}: {reads:?}");
    }
    let outstanding = rig.pool.outstanding();
    assert_eq!(outstanding.iter().map(|(_, n)| n).sum::<usize>(), 60);
    let text = rig.metrics.encode();
    assert!(
        text.contains(&format!(
            r#"guardmesh_guard_replica_requests_total{{guard="g",replica="{}"}} {}"#,
            url(0),
            reads[0]
        )),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn r32_a_replica_five_times_slower_gets_a_small_share() {
    // Closed loop: 12 requests always in flight, for 3 s of virtual time.
    let mut rig = rig(
        3,
        |_| {},
        |i| answer_after(if i == 0 { ms(50) } else { ms(10) }),
    );
    settle().await;
    rig.send_all(0..12, Duration::from_secs(1));
    let end = Instant::now() + Duration::from_secs(3);
    let mut answered: HashMap<String, usize> = HashMap::new();
    let mut tag = 12;
    while Instant::now() < end {
        match rig.next().await {
            LinkEvent::Answer { replica, .. } => {
                *answered.entry(replica.to_string()).or_default() += 1;
            }
            LinkEvent::Failed { failure, .. } => panic!("failed: {failure}"),
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
        rig.send(tag, Duration::from_secs(1)).unwrap();
        tag += 1;
    }
    let total: usize = answered.values().sum();
    let slow = answered.get(&url(0)).copied().unwrap_or(0);
    assert!(total > 1000, "{answered:?}");
    // Even would be a third; by latency alone a ninth or less.
    assert!(slow * 100 / total <= 15, "{answered:?}");
}

#[tokio::test(start_paused = true)]
async fn r32_equal_replicas_share_evenly_at_light_load_despite_latency_noise() {
    // One request at a time: every replica holds none when the choice is
    // made, so only the latency estimates tell them apart, and those of
    // equal replicas differ by noise (here 10, 12 and 14 ms). A choice
    // that followed the noise sent two thirds to the first replica and
    // none to the third; within the tie band each gets an even share.
    let mut rig = rig(3, |_| {}, |i| answer_after(ms(10 + 2 * i as u64)));
    settle().await;
    let total = 600;
    let mut answered: HashMap<String, usize> = HashMap::new();
    for tag in 0..total {
        rig.send(tag, Duration::from_secs(1)).unwrap();
        match rig.next().await {
            LinkEvent::Answer { replica, .. } => {
                *answered.entry(replica.to_string()).or_default() += 1;
            }
            LinkEvent::Failed { failure, .. } => panic!("failed: {failure}"),
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
    }
    // R32: within 25% of even (150-250 of 600; a fair coin stays within
    // 4 standard deviations of it).
    for i in 0..3 {
        let n = answered.get(&url(i)).copied().unwrap_or(0);
        assert!((150..=250).contains(&n), "replica {i}: {answered:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn r32_requests_on_a_replica_that_dies_are_answered_by_another() {
    // Replica 0 answers late; it dies with requests in flight on it. (Its
    // circuit is off here: each failed request counts towards it, and an
    // open circuit would keep it out for `circuit_open_for` on its own.)
    let mut rig = rig(3, |c| c.circuit_failures = 0, |_| answer_after(ms(100)));
    settle().await;
    rig.send_all(0..30, Duration::from_secs(2));
    settle().await;
    let on_dead = rig.reads()[0];
    assert!(on_dead > 0);
    tokio::time::sleep(ms(20)).await;
    rig.guards[0].kill();
    let mut by_tag = HashMap::new();
    for _ in 0..30 {
        match rig.next().await {
            LinkEvent::Answer { tag, replica, .. } => {
                assert_ne!(&*replica, url(0), "the dead replica answered");
                by_tag.insert(tag, replica);
            }
            LinkEvent::Failed { failure, .. } => panic!("R32: failed: {failure}"),
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
    }
    assert_eq!(by_tag.len(), 30, "every batch answered once");
    // The batches the dead replica held were read again elsewhere: the
    // same batch id on two replicas.
    let again: usize = rig
        .batch_ids(0)
        .iter()
        .filter(|id| rig.batch_ids(1).contains(id) || rig.batch_ids(2).contains(id))
        .count();
    assert_eq!(again, on_dead);
    assert!(
        rig.metrics.encode().contains(&format!(
            r#"guardmesh_guard_replica_ejections_total{{guard="g",replica="{}"}} 1
"#,
            url(0)
        )),
        "{}",
        rig.metrics.encode()
    );
    // Ejected: for its backoff it gets nothing, though it is back.
    rig.guards[0].restart();
    tokio::time::sleep(ms(50)).await;
    let before = rig.reads()[0];
    rig.send_all(100..130, Duration::from_secs(2));
    settle().await;
    assert_eq!(rig.reads()[0], before, "an ejected replica got requests");
    rig.answers(30).await;
    // After the ejection, it takes its share again.
    tokio::time::sleep(EJECT_INITIAL).await;
    rig.send_all(200..230, Duration::from_secs(2));
    settle().await;
    assert!(
        rig.reads()[0] > before,
        "{:?} connects {} streams {}",
        rig.reads(),
        rig.guards[0].connects(),
        rig.guards[0].streams()
    );
}

#[tokio::test(start_paused = true)]
async fn r13_a_failed_request_is_not_sent_again_once_the_guard_s_time_is_up() {
    // Replica 0 fails every stream 300 ms after reading; the guard's time
    // is 200 ms: the failure comes too late to send the request again.
    let mut rig = rig(
        2,
        |_| {},
        replica_0_apart(
            |_: &GuardBatch| vec![Step::fail(tonic::Status::unavailable("reset")).after(ms(300))],
            |_: &GuardBatch| Vec::new(),
        ),
    );
    // Replica 1 is down: replica 0 takes the request.
    rig.guards[1].kill();
    settle().await;
    let sent = rig.send(0, ms(200));
    assert!(sent.is_ok());
    let event = rig.next().await;
    assert!(
        matches!(event, LinkEvent::Failed { ref failure, .. } if matches!(failure, GuardFailure::Status { .. })),
        "{event:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn r13_when_no_replica_can_judge_the_failure_policy_applies() {
    // Every replica refuses connections: the request fails (at once, or
    // by event), never hangs.
    let mut rig = rig(3, |_| {}, |_| answer_after(ms(1)));
    for guard in &rig.guards {
        guard.kill();
    }
    settle().await;
    tokio::time::sleep(ms(5)).await;
    let started = Instant::now();
    match rig.send(0, Duration::from_secs(1)) {
        Err(NotSent::Failed(GuardFailure::Unreachable(_))) => {}
        Ok(_) => match rig.next().await {
            LinkEvent::Failed {
                failure: GuardFailure::Unreachable(_),
                ..
            } => {}
            other => panic!("{other:?}"),
        },
        Err(other) => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn r15_a_guard_whose_replicas_all_left_fails_per_policy() {
    let mut rig = rig(2, |_| {}, |_| answer_after(ms(1)));
    settle().await;
    let set = rig.set.take().unwrap();
    set.send_replace(Arc::from(Vec::new()));
    settle().await;
    assert!(rig.pool.endpoints().is_empty());
    match rig.send(0, Duration::from_secs(1)) {
        Err(NotSent::Failed(GuardFailure::Unreachable(reason))) => {
            assert!(reason.contains("no replicas"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn r32_a_replica_that_left_gets_no_new_requests_and_finishes_its_own() {
    let mut rig = rig(2, |_| {}, |_| answer_after(ms(100)));
    settle().await;
    rig.send_all(0..10, Duration::from_secs(2));
    settle().await;
    let held = rig.reads()[0];
    assert!(held > 0);
    // Replica 0 leaves the set while it holds requests.
    let set = rig.set.take().unwrap();
    set.send_replace(Arc::from(vec![ReplicaTarget::new(url(1))]));
    settle().await;
    assert_eq!(rig.pool.endpoints(), [url(1)]);
    rig.send_all(10..20, Duration::from_secs(2));
    settle().await;
    assert_eq!(rig.reads()[0], held, "a draining replica got a request");
    let mut from_left = 0;
    for _ in 0..20 {
        match rig.next().await {
            LinkEvent::Answer { replica, .. } => from_left += usize::from(*replica == *url(0)),
            LinkEvent::Failed { failure, .. } => panic!("{failure}"),
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
    }
    assert_eq!(from_left, held, "its own requests were answered by it");
    // It comes back: a link again, and requests.
    set.send_replace(Arc::from(vec![
        ReplicaTarget::new(url(1)),
        ReplicaTarget::new(url(0)),
    ]));
    settle().await;
    rig.send_all(20..40, Duration::from_secs(2));
    settle().await;
    assert!(rig.reads()[0] > held);
}

#[tokio::test(start_paused = true)]
async fn r25_a_full_replica_sends_the_request_to_another_and_all_full_sheds() {
    // Replicas that take nothing off their stream and a queue bound of a
    // few bytes: each holds one request, then is full. Within the stall
    // bound that is load: busy, never a failure.
    let rig = rig(
        3,
        |c| c.max_queued_bytes = 64,
        |_| |_: &GuardBatch| Vec::new(),
    );
    settle().await;
    for guard in &rig.guards {
        guard.reading(false);
    }
    rig.send_all(0..3, Duration::from_secs(5));
    let outstanding: Vec<usize> = rig.pool.outstanding().into_iter().map(|(_, n)| n).collect();
    assert_eq!(outstanding, [1, 1, 1]);
    match rig.send(3, Duration::from_secs(5)) {
        Err(NotSent::Busy(_)) => {}
        other => panic!("R25: expected busy, got {other:?}"),
    }
    let text = rig.metrics.encode();
    assert!(
        !text.contains("guardmesh_guard_replica_ejections_total{"),
        "busy ejected a replica: {text}"
    );
}

#[tokio::test(start_paused = true)]
async fn r32_one_replica_s_failures_never_open_the_others_circuits() {
    let mut rig = rig(
        2,
        |c| c.circuit_failures = 2,
        replica_0_apart(
            |_: &GuardBatch| vec![Step::fail(tonic::Status::unavailable("reset"))],
            answer_after(Duration::ZERO),
        ),
    );
    settle().await;
    for round in 0..20 {
        rig.send(round, Duration::from_secs(1)).unwrap();
        match rig.next().await {
            LinkEvent::Answer { replica, .. } => assert_eq!(&*replica, url(1)),
            LinkEvent::Failed { failure, .. } => panic!("round {round}: {failure}"),
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
        // Past any ejection: replica 0 keeps being tried and failing.
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    // Replica 0 kept failing (its circuit opened, then probed), and
    // replica 1 answered every round.
    assert!(rig.reads()[0] >= 2, "{:?}", rig.reads());
}

#[tokio::test(start_paused = true)]
async fn r13_a_final_answer_resets_the_replica_s_circuit_without_the_batch_telling() {
    // Two failures, an answer, two failures, an answer...: never three
    // failures in a row, so the circuit (3) never opens. The rig reports
    // each failure back as a batch does; of an answer, the pool tells the
    // replica's circuit itself.
    let mut rig = rig(
        1,
        |c| c.circuit_failures = 3,
        |_| {
            |b: &GuardBatch| {
                let tag: usize = b.batch_id[1..].parse().expect("b<tag>");
                if tag % 3 == 2 {
                    vec![Step::answer(b, vec![])]
                } else {
                    vec![Step::fail(tonic::Status::unavailable("reset"))]
                }
            }
        },
    );
    settle().await;
    for tag in 0..9 {
        // Past the reconnect's backoff, well within an open circuit's 5 s.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let sent = rig.send(tag, Duration::from_secs(1));
        assert!(sent.is_ok(), "R13: round {tag} refused: {sent:?}");
        match rig.next().await {
            LinkEvent::Answer { .. } => assert_eq!(tag % 3, 2, "round {tag}"),
            LinkEvent::Failed {
                failure, replica, ..
            } => {
                assert_ne!(tag % 3, 2, "round {tag}: {failure}");
                assert!(
                    matches!(failure, GuardFailure::Status { .. }),
                    "R13: round {tag} failed by an open circuit: {failure}"
                );
                rig.pool.record(Some(&replica), Err(&failure));
            }
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn r32_a_request_with_a_partial_answer_is_not_sent_again() {
    let mut rig = rig(
        2,
        |_| {},
        |_| {
            |b: &GuardBatch| {
                vec![
                    Step::partial(b, vec![]),
                    Step::fail(tonic::Status::unavailable("reset")).after(ms(10)),
                ]
            }
        },
    );
    settle().await;
    rig.send(0, Duration::from_secs(1)).unwrap();
    assert!(matches!(rig.next().await, LinkEvent::Answer { .. }));
    assert!(matches!(rig.next().await, LinkEvent::Failed { .. }));
    settle().await;
    assert_eq!(rig.reads().iter().sum::<usize>(), 1);
}

#[tokio::test(start_paused = true)]
async fn r32_a_pool_of_one_fails_as_a_single_link_did() {
    let mut rig = rig(
        1,
        |_| {},
        |_| |_: &GuardBatch| vec![Step::fail(tonic::Status::unavailable("reset"))],
    );
    settle().await;
    rig.send(0, Duration::from_secs(1)).unwrap();
    match rig.next().await {
        LinkEvent::Failed {
            failure: GuardFailure::Status { .. },
            replica,
            ..
        } => assert_eq!(&*replica, url(0)),
        other => panic!("{other:?}"),
    }
    assert_eq!(rig.reads(), [1]);
}

/// Resolves every name to the first two scripted replicas, counting lookups.
struct FirstTwo(std::sync::atomic::AtomicU64);

impl super::discover::dns::Resolve for FirstTwo {
    fn lookup<'a>(
        &'a self,
        _: &'a str,
        _: u16,
    ) -> futures::future::BoxFuture<'a, std::io::Result<Vec<std::net::IpAddr>>> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Box::pin(async {
            Ok(vec![
                "127.0.0.2".parse().unwrap(),
                "127.0.0.3".parse().unwrap(),
            ])
        })
    }
}

#[tokio::test(start_paused = true)]
async fn r32_a_name_is_its_addresses_and_a_failed_one_asks_for_a_resolution() {
    use super::discover::sources::{GuardSources, NameSettings};
    use std::sync::atomic::Ordering;
    let net = ScriptedNet::new();
    let guards: Vec<_> = (0..2)
        .map(|i| net.guard(&url(i), answer_after(ms(100))))
        .collect();
    let config = LinkConfig {
        backoff_initial: ms(20),
        backoff_max: ms(200),
        circuit_failures: 0,
        ..LinkConfig::default()
    };
    let metrics = Arc::new(Metrics::with_max_latency(Duration::from_secs(30)));
    let resolver = Arc::new(FirstTwo(std::sync::atomic::AtomicU64::new(0)));
    let sources = GuardSources::new(
        "g",
        Some(NameSettings {
            policy: Arc::new(crate::link::dial::EndpointPolicy::default()),
            interval: Duration::from_secs(3600),
            resolver: resolver.clone(),
        }),
        None,
    );
    let pool = GuardPool::registered(
        "g",
        ["http://guard.test:30000".to_string()],
        sources,
        None,
        spawn_links(config, &net, &metrics),
        metrics.clone(),
    );
    assert_eq!(pool.registered_targets(), ["http://guard.test:30000"]);
    for _ in 0..20 {
        if pool.endpoints() == [url(0), url(1)] {
            break;
        }
        tokio::time::sleep(ms(10)).await;
    }
    assert_eq!(pool.endpoints(), [url(0), url(1)], "the name's addresses");
    assert_eq!(resolver.0.load(Ordering::Relaxed), 1);
    let (tx, mut events) = mailbox();
    for tag in 0..10 {
        send(&pool, &tx, tag, ms(2000)).unwrap();
    }
    settle().await;
    assert!(guards[0].requests() > 0);
    guards[0].kill();
    for _ in 0..10 {
        match events.recv().await {
            LinkEvent::Answer { replica, .. } => assert_eq!(&*replica, url(1)),
            LinkEvent::Failed { failure, .. } => panic!("failed: {failure}"),
            LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
        }
    }
    // The failure asked for a resolution long before the hour's interval.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        resolver.0.load(Ordering::Relaxed) >= 2,
        "a failed replica of a name asks the name to be resolved again"
    );
}

/// The batch numbers in `ids` (`b<tag>`).
fn tags(ids: &[String]) -> Vec<usize> {
    ids.iter()
        .filter_map(|id| id.strip_prefix('b')?.parse().ok())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn r32_a_draining_replica_gets_no_new_requests_and_finishes_what_it_holds() {
    let mut rig = rig(3, |_| {}, |_| answer_after(ms(10)));
    settle().await;
    let health = rig.pool.health_of(&url(0)).expect("replica 0");
    // Replica 0 holds requests when it reports NOT_SERVING.
    rig.send_all(0..30, ms(1000));
    health.set_draining(true);
    rig.send_all(30..90, ms(1000));
    rig.answers(90).await;
    let held = tags(&rig.batch_ids(0));
    assert!(
        !held.is_empty(),
        "replica 0 held requests: {:?}",
        rig.reads()
    );
    assert!(
        held.iter().all(|t| *t < 30),
        "R32: a draining replica got new requests: {held:?}"
    );
    // SERVING again: it is chosen again.
    health.set_draining(false);
    rig.send_all(90..150, ms(1000));
    rig.answers(60).await;
    assert!(
        tags(&rig.batch_ids(0)).iter().any(|t| *t >= 90),
        "R32: back to SERVING, it judges again: {:?}",
        rig.reads()
    );
    // Every replica draining: they still judge (never a failure, R15).
    for i in 0..3 {
        rig.pool
            .health_of(&url(i))
            .expect("replica")
            .set_draining(true);
    }
    rig.send_all(150..160, ms(1000));
    rig.answers(10).await;
}

impl Rig {
    /// Sends a one-call batch tagged `tag` and waits for it as a batch
    /// does: the answer's replica, or the failure; at the guard's time
    /// (`within`) the request is withdrawn and it timed out (R14).
    async fn judge(&mut self, tag: usize, within: Duration) -> Result<Arc<str>, GuardFailure> {
        let until = Instant::now() + within;
        let id = match self.send(tag, within) {
            Ok(id) => id,
            Err(NotSent::Failed(failure)) => return Err(failure),
            Err(NotSent::Busy(busy)) => panic!("busy: {busy}"),
            Err(NotSent::NoRoom(busy)) => panic!("no room: {busy}"),
        };
        loop {
            tokio::select! {
                event = self.events.recv() => match event {
                    LinkEvent::Answer { tag: t, replica, .. } if t == tag => return Ok(replica),
                    LinkEvent::Failed { tag: t, failure, .. } if t == tag => return Err(failure),
                    LinkEvent::Shed { busy, .. } => panic!("shed: {busy}"),
                    _ => {}
                },
                () = tokio::time::sleep_until(until) => {
                    self.pool.cancel(id);
                    return Err(GuardFailure::TimedOut(within));
                }
            }
        }
    }
}

/// A replica that answers its `n`-th batch (from 1) after `slow`, the
/// others after `fast`.
fn slow_at(
    n: usize,
    slow: Duration,
    fast: Duration,
) -> impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static {
    let read = std::sync::atomic::AtomicUsize::new(0);
    move |b: &GuardBatch| {
        let k = read.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let delay = if k == n { slow } else { fast };
        vec![Step::answer(b, b.calls.iter().map(|c| proceed(&c.call_id)).collect()).after(delay)]
    }
}

#[tokio::test(start_paused = true)]
async fn r32_a_replica_that_never_answered_is_priced_at_a_default_not_as_the_cheapest() {
    // Replica 0 takes its stream and never answers; the two others answer
    // in 10 ms. A replica with no answer yet used to cost nothing (its
    // estimate started at zero), so every draw that included it chose it
    // and the batch waited for the guard's whole time.
    let mut rig = rig(
        3,
        |_| {},
        replica_0_apart(|_: &GuardBatch| Vec::new(), answer_after(ms(10))),
    );
    settle().await;
    let mut timed_out = 0;
    for tag in 0..60 {
        if let Err(failure) = rig.judge(tag, Duration::from_secs(1)).await {
            assert!(
                matches!(failure, GuardFailure::TimedOut(_)),
                "{tag}: {failure}"
            );
            timed_out += 1;
        }
    }
    let reads = rig.reads();
    eprintln!("reads {reads:?}, timed out {timed_out}");
    // Priced like its peers, it may get the first request; once that is
    // older than the estimate it costs more than either peer.
    assert!(
        reads[0] <= 3,
        "R32: the replica that never answered read {} of 60: {reads:?}",
        reads[0]
    );
}

#[tokio::test(start_paused = true)]
async fn r32_a_slow_answer_raises_the_estimate_at_once() {
    // Three replicas at 10 ms; replica 0 answers its third batch after
    // 100 ms. One request at a time: each choice compares estimates only.
    let mut rig = rig(
        3,
        |_| {},
        |i| slow_at(if i == 0 { 3 } else { 0 }, ms(100), ms(10)),
    );
    settle().await;
    let mut tag = 0;
    while rig.guards[0].answered() < 3 {
        rig.judge(tag, Duration::from_secs(1)).await.unwrap();
        tag += 1;
        assert!(
            tag < 500,
            "replica 0 never got three batches: {:?}",
            rig.reads()
        );
    }
    let before = rig.reads()[0];
    // The next 30 requests (300 ms): a plain average moved only a tenth of
    // the way (10 to 19 ms, a tie with 10 ms) and kept sending it a third.
    for tag in tag..tag + 30 {
        rig.judge(tag, Duration::from_secs(1)).await.unwrap();
    }
    assert_eq!(
        rig.reads()[0],
        before,
        "R32: one slow answer did not raise replica 0's cost at once: {:?}",
        rig.reads()
    );
}

#[tokio::test(start_paused = true)]
async fn r32_a_once_slow_replica_is_chosen_again_as_its_estimate_decays() {
    // Three replicas at 10 ms; replica 0 takes 300 ms more from 1 s to
    // 2 s, then is fast again. One request at a time for 6 s.
    let start = Instant::now();
    let mut rig = rig(
        3,
        |_| {},
        |i| {
            move |b: &GuardBatch| {
                let at = start.elapsed();
                let slow = i == 0 && at >= Duration::from_secs(1) && at < Duration::from_secs(2);
                answer_after(if slow { ms(310) } else { ms(10) })(b)
            }
        },
    );
    settle().await;
    let mut tag = 0;
    while start.elapsed() < Duration::from_secs(6) {
        rig.judge(tag, Duration::from_secs(1)).await.unwrap();
        tag += 1;
    }
    let read_at: Vec<Duration> = rig.guards[0]
        .read_at()
        .into_iter()
        .map(|at| at - start)
        .collect();
    let slow = read_at
        .iter()
        .filter(|at| (ms(1000)..ms(2000)).contains(*at))
        .count();
    assert!(slow >= 1, "replica 0 was never slow: {read_at:?}");
    // Its last slow answer came by 2.31 s: after that it is fast again,
    // and is tried again once what it cost has decayed.
    let again = read_at.iter().find(|at| **at >= ms(2310));
    assert!(
        again.is_some_and(|at| *at < ms(4500)),
        "R32: the once-slow replica was not chosen again within 2.2 s of recovering (first at {again:?})"
    );
    // And in the last second it takes about its share (a third).
    let last = read_at.iter().filter(|at| **at >= ms(5000)).count();
    let total_last = rig
        .guards
        .iter()
        .flat_map(|g| g.read_at())
        .filter(|at| *at - start >= ms(5000))
        .count();
    assert!(
        last * 5 >= total_last,
        "R32: {last} of the last second's {total_last} batches on the recovered replica"
    );
}

#[tokio::test(start_paused = true)]
async fn r32_a_request_that_times_out_on_one_replica_is_answered_by_another() {
    // Replica 0 answers its first two batches in 10 ms, then takes
    // batches and never answers; the others answer in 10 ms. The guard's
    // time is 1 s: a request that waited for it there timed out (R13).
    let mut rig = rig(
        3,
        |_| {},
        |i| {
            let read = std::sync::atomic::AtomicUsize::new(0);
            move |b: &GuardBatch| {
                let k = read.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i == 0 && k >= 2 {
                    Vec::new()
                } else {
                    answer_after(ms(10))(b)
                }
            }
        },
    );
    settle().await;
    let mut took = HashMap::new();
    let mut tag = 0;
    let mut last = None;
    while last != Some(tag) {
        let started = Instant::now();
        match rig.judge(tag, Duration::from_secs(1)).await {
            Ok(replica) => {
                took.insert(format!("b{tag}"), (replica, started.elapsed()));
            }
            Err(failure) => panic!("R32: batch {tag} failed while two replicas judge: {failure}"),
        }
        tag += 1;
        // 20 batches more once replica 0 held one it did not answer.
        if last.is_none() && rig.reads()[0] > 2 {
            last = Some(tag + 20);
        }
        assert!(
            tag < 1000,
            "replica 0 got no third batch: {:?}",
            rig.reads()
        );
    }
    let hung: Vec<String> = rig.batch_ids(0).into_iter().skip(2).collect();
    assert!(!hung.is_empty());
    for id in &hung {
        let (replica, waited) = &took[id];
        assert_ne!(&**replica, url(0), "{id}");
        assert!(
            rig.batch_ids(1).contains(id) || rig.batch_ids(2).contains(id),
            "{id} was not sent again"
        );
        // Half the guard's time on the hung replica, then 10 ms on another.
        assert_eq!(*waited, ms(510), "{id}");
    }
    assert_eq!(rig.guards[0].cancels().len(), hung.len(), "told to stop");
    let text = rig.metrics.encode();
    assert!(
        text.contains(&format!(
            r#"guardmesh_guard_replica_ejections_total{{guard="g",replica="{}"}} 1
"#,
            url(0)
        )),
        "the replica that timed out was ejected: {text}"
    );
}

#[tokio::test(start_paused = true)]
async fn r13_every_replica_hung_fails_at_the_guard_s_time_and_each_batch_is_sent_at_most_twice() {
    // A fixed limit that holds them all: no request waits for room.
    let mut rig = rig(3, fixed_limit, |_| |_: &GuardBatch| Vec::new());
    settle().await;
    // 50 batches at once, then 10 one at a time: each times out at the
    // guard's time (1 s), the batch's failure policy then applies (R13).
    let ids: Vec<u64> = (0..50)
        .map(|tag| rig.send(tag, Duration::from_secs(1)).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(rig.events.try_recv().is_none(), "nothing answered");
    for id in ids {
        rig.pool.cancel(id);
    }
    for tag in 50..60 {
        let started = Instant::now();
        let failure = rig.judge(tag, Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(failure, GuardFailure::TimedOut(_)), "{failure}");
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }
    // A hung guard is not hammered: a batch goes to two replicas at most,
    // and the failovers stay within the budget.
    let mut sent: HashMap<String, usize> = HashMap::new();
    for i in 0..3 {
        for id in rig.batch_ids(i) {
            *sent.entry(id).or_default() += 1;
        }
    }
    assert_eq!(sent.len(), 60);
    assert!(sent.values().all(|n| *n <= 2), "{sent:?}");
    // The 50 sent at once, in one window of the budget: 10 moves and a
    // fifth of the requests.
    let burst: usize = (0..50).map(|tag| sent[&format!("b{tag}")]).sum();
    let total: usize = sent.values().sum();
    eprintln!("{burst} requests for the 50 batches at once, {total} for all 60");
    assert!(burst <= 50 + 10 + 10, "{burst} requests for 50 batches");
}

#[tokio::test(start_paused = true)]
async fn r32_at_most_half_the_replicas_are_ejected_at_once() {
    // Four replicas whose streams all fail: the request is tried on each
    // and then fails (R13), but two replicas at most are ejected.
    let mut rig = rig(
        4,
        |c| c.circuit_failures = 0,
        |_| |_: &GuardBatch| vec![Step::fail(tonic::Status::unavailable("reset"))],
    );
    settle().await;
    let failure = rig.judge(0, Duration::from_secs(1)).await.unwrap_err();
    assert!(matches!(failure, GuardFailure::Status { .. }), "{failure}");
    assert_eq!(rig.reads(), [1, 1, 1, 1]);
    let text = rig.metrics.encode();
    let ejected = (0..4)
        .filter(|i| {
            text.contains(&format!(
                r#"guardmesh_guard_replica_ejections_total{{guard="g",replica="{}"}} 1"#,
                url(*i)
            ))
        })
        .count();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("guardmesh_guard_replica_ejections_total{"))
        .collect();
    assert_eq!(ejected, 2, "R32: never more than half ejected: {lines:?}");
}

/// The value of the series `name{labels}` in `text`.
fn series(text: &str, name: &str, labels: &str) -> Option<i64> {
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|value| value.trim().parse().ok())
}

#[tokio::test(start_paused = true)]
async fn r25_the_flow_gauges_follow_requests_held_waiting_and_answered() {
    // Two replicas of a fixed limit of 2: six requests are four held and
    // two waiting; once every one is answered, nothing is held or waits.
    let mut rig = rig(
        2,
        |c| {
            c.min_in_flight = 2;
            c.max_in_flight = 2;
        },
        |_| answer_after(ms(100)),
    );
    settle().await;
    rig.send_all(0..6, Duration::from_secs(5));
    settle().await;
    let text = rig.metrics.encode();
    assert_eq!(flow(&text), [Some(4), Some(4), Some(2)], "{text}");
    for i in 0..2 {
        let replica = format!(r#"guard="g",replica="{}""#, url(i));
        let of = |name| series(&text, name, &replica);
        assert_eq!(
            [
                of("guardmesh_guard_replica_limit"),
                of("guardmesh_guard_replica_outstanding")
            ],
            [Some(2), Some(2)],
            "{text}"
        );
    }
    rig.answers(6).await;
    settle().await;
    let text = rig.metrics.encode();
    assert_eq!(flow(&text), [Some(0), Some(4), Some(0)], "{text}");
}

/// Guard `g`'s in-flight, limit and waiting gauges in `text`.
fn flow(text: &str) -> [Option<i64>; 3] {
    ["in_flight", "limit", "waiting"]
        .map(|gauge| series(text, &format!("guardmesh_guard_{gauge}"), r#"guard="g""#))
}
