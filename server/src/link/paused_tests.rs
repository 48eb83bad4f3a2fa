//! Paused-time tests of one guard link over a scripted guard: its
//! redials and their backoff, cancels, the circuit's timing, the queue's
//! busy and not-reading bounds (R25), unreadable answers (R23) and routing
//! by request id. Each names the real-socket integration test it mirrors;
//! here the times are exact. The scenarios that need no exact time run on
//! both transports (see [`on_both_transports`]): the link over a scripted
//! guard in memory, and over the same guard on a loopback socket.

use super::dial::GuardConnector;
use super::scripted::{
    ScriptedGuard, ScriptedNet, Step, Transport, on_both_transports, proceed, quick_redials,
    serve_on_loopback, steer,
};
use super::transport::GuardTransport;
use super::{GuardFailure, GuardLink, LinkConfig, LinkEvent, NotSent, Report, wire};
use crate::link::events::{EventSender, Events, mailbox};
use crate::observe::metrics::Metrics;
use guardmesh_proto::v1::{GuardBatch, ToolCall};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const URL: &str = "http://127.0.0.1:30000";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A link to a scripted guard (at [`URL`] in memory, or on a loopback
/// socket), with the integration harness's quick redials.
struct Rig {
    guard: Arc<ScriptedGuard>,
    link: GuardLink,
    metrics: Arc<Metrics>,
    events: Events,
    tx: EventSender,
}

fn rig(
    change: impl FnOnce(&mut LinkConfig),
    script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
) -> Rig {
    rig_on(Transport::Scripted, change, script)
}

fn rig_on(
    transport: Transport,
    change: impl FnOnce(&mut LinkConfig),
    script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
) -> Rig {
    let guard = ScriptedGuard::new(script);
    let mut config = quick_redials();
    change(&mut config);
    let metrics = Arc::new(Metrics::with_max_latency(Duration::from_secs(30)));
    let link = match transport {
        Transport::Scripted => {
            let net = ScriptedNet::new();
            net.serve(URL, guard.clone());
            GuardLink::spawn_with(
                "g",
                URL,
                config,
                net as Arc<dyn GuardTransport>,
                None,
                metrics.clone(),
            )
        }
        Transport::Socket => {
            let url = serve_on_loopback(guard.clone());
            let connector = GuardConnector {
                policy: Arc::default(),
                tls: None,
                pin: None,
                https: false,
                connect_timeout: config.connect_timeout,
            };
            GuardLink::spawn("g", &url, config, connector, metrics.clone())
        }
    };
    let (tx, events) = mailbox();
    Rig {
        guard,
        link,
        metrics,
        events,
        tx,
    }
}

impl Rig {
    /// Sends a batch of `calls` (call ids, tool `t`, `arguments`) as
    /// client `client`, tagged `tag`, with a stall bound of 1 s.
    fn send(
        &self,
        tag: usize,
        calls: &[&str],
        arguments: &str,
        client: u64,
    ) -> Result<u64, NotSent> {
        self.send_within(tag, calls, arguments, client, Duration::from_secs(1))
    }

    fn send_within(
        &self,
        tag: usize,
        calls: &[&str],
        arguments: &str,
        client: u64,
        stall: Duration,
    ) -> Result<u64, NotSent> {
        let calls: Vec<ToolCall> = calls
            .iter()
            .map(|id| ToolCall {
                call_id: (*id).into(),
                tool: "t".into(),
                arguments: arguments.into(),
            })
            .collect();
        let shared = wire::shared_part(None, calls.iter());
        let batch = GuardBatch {
            batch_id: format!("b{tag}"),
            guard: "g".into(),
            deadline_ms: 1000,
            ..Default::default()
        };
        let tx = self.tx.clone();
        let report = Report(Arc::new(move |event| {
            tx.send(event);
        }));
        self.link.send(
            &wire::Head::of(&batch),
            shared,
            tag,
            report,
            client,
            stall,
            tokio::time::Instant::now(),
        )
    }

    /// The next event, and how long it took.
    async fn next(&mut self) -> (LinkEvent, Duration) {
        let started = Instant::now();
        let event = self.events.recv().await;
        (event, started.elapsed())
    }

    fn spurious(&self) -> bool {
        self.metrics
            .encode()
            .contains(r#"guardmesh_guard_spurious_answers_total{guard="g"} 1"#)
    }
}

fn answers(b: &GuardBatch) -> Vec<Step> {
    vec![Step::answer(
        b,
        b.calls.iter().map(|c| proceed(&c.call_id)).collect(),
    )]
}

fn failed(result: Result<u64, NotSent>) -> GuardFailure {
    match result {
        Err(NotSent::Failed(failure)) => failure,
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// Paused-time version of
/// `faults::restart_killed_guard_process_fails_per_policy_while_down_then_judges_again`
/// (its redial): the pauses between attempts double within their jitter
/// (half a step to a step) up to the bound, and a stream that answered
/// resets them.
#[tokio::test(start_paused = true)]
async fn r15_redials_with_bounded_exponential_backoff_and_resets_after_an_answer() {
    let mut rig = rig(
        |c| {
            c.backoff_max = ms(100);
            c.circuit_failures = 0;
        },
        answers,
    );
    rig.guard.refuse_connects(5);
    // While down, a request fails at once, naming why.
    tokio::time::sleep(ms(1)).await;
    let failure = failed(rig.send(0, &["c"], "{}", 1));
    assert!(
        failure.to_string().contains("connection refused"),
        "{failure}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let at = rig.guard.connects_at();
    assert_eq!(at.len(), 6, "five refused, the sixth connected");
    for (i, step) in [20, 40, 80, 100, 100].into_iter().enumerate() {
        let pause = at[i + 1] - at[i];
        assert!(
            (ms(step / 2)..=ms(step)).contains(&pause),
            "pause {i}: {pause:?} for a step of {step} ms"
        );
    }
    rig.send(1, &["c"], "{}", 1).unwrap();
    let (event, took) = rig.next().await;
    assert!(
        matches!(event, LinkEvent::Answer { tag: 1, .. }),
        "{event:?}"
    );
    assert_eq!(took, Duration::ZERO);
    // Killed after answering: the first pause is the first step again.
    rig.guard.kill();
    rig.guard.restart();
    tokio::time::sleep(ms(1)).await;
    let killed = Instant::now();
    tokio::time::sleep(ms(100)).await;
    let at = rig.guard.connects_at();
    assert_eq!(at.len(), 7);
    let pause = at[6] - killed;
    assert!(pause <= ms(20), "{pause:?}");
    rig.send(2, &["c"], "{}", 1).unwrap();
    assert!(matches!(
        rig.next().await.0,
        LinkEvent::Answer { tag: 2, .. }
    ));
}

/// Paused-time version of
/// `overload::circuit_opens_after_repeated_failures_and_fail_closed_still_blocks`:
/// open for exactly `circuit_open_for`, then one probe, closed by a success.
#[tokio::test(start_paused = true)]
async fn r13_circuit_opens_for_its_period_then_admits_one_probe() {
    let rig = rig(
        |c| {
            c.circuit_failures = 3;
            c.circuit_open_for = ms(300);
        },
        answers,
    );
    let timeout = GuardFailure::TimedOut(ms(100));
    for _ in 0..3 {
        rig.link.record(Err(&timeout));
    }
    let retry_in = |result| match failed(result) {
        GuardFailure::CircuitOpen {
            failures, retry_in, ..
        } => {
            assert_eq!(failures, 3);
            retry_in
        }
        other => panic!("{other}"),
    };
    assert_eq!(retry_in(rig.send(0, &["c"], "{}", 1)), ms(300));
    tokio::time::sleep(ms(100)).await;
    assert_eq!(retry_in(rig.send(0, &["c"], "{}", 1)), ms(200));
    tokio::time::sleep(ms(199)).await;
    assert_eq!(retry_in(rig.send(0, &["c"], "{}", 1)), ms(1));
    tokio::time::sleep(ms(1)).await;
    rig.send(1, &["c"], "{}", 1).expect("the half-open probe");
    assert_eq!(retry_in(rig.send(2, &["c"], "{}", 1)), Duration::ZERO);
    rig.link.record(Ok(()));
    rig.send(3, &["c"], "{}", 1).expect("closed");
    rig.send(4, &["c"], "{}", 1).expect("closed");
    assert!(
        rig.metrics
            .encode()
            .contains(r#"guardmesh_guard_circuit_opened_total{guard="g"} 1"#)
    );
}

/// Paused-time version of
/// `busy::r13_a_guard_that_takes_nothing_for_its_timeout_still_fails_as_not_reading`
/// and of `busy::r25_a_busy_guard_sheds_the_flooding_client_and_never_cancels_or_opens_its_circuit`:
/// a full queue is load (busy) until the guard has taken nothing for the
/// stall bound, to the millisecond; then it is a failure.
#[tokio::test(start_paused = true)]
async fn r25_full_queue_is_busy_until_the_stall_bound_then_not_reading() {
    let rig = rig(|c| c.max_queued_bytes = 4000, answers);
    rig.guard.reading(false);
    tokio::time::sleep(ms(1)).await;
    let blob = format!(r#"{{"x":"{}"}}"#, "y".repeat(900));
    let stall = ms(300);
    let send = |tag, client| rig.send_within(tag, &["c"], &blob, client, stall);
    send(0, 1).expect("an empty queue takes any request");
    let busy = |result: Result<u64, NotSent>| match result {
        Err(NotSent::Busy(busy)) => busy,
        other => panic!("expected busy, got {other:?}"),
    };
    // Client 1 holds its share (a quarter of 4000 bytes).
    let b = busy(send(1, 1));
    assert_eq!((b.limit, b.share), (4000, 1000));
    for client in 2..=4 {
        send(client as usize, client).expect("other clients have room");
    }
    let b = busy(send(5, 5));
    assert!(b.queued > 3000, "{b}");
    // The queue became non-empty with request 0: one millisecond short of
    // the stall bound since then, still busy; at it, not reading.
    tokio::time::sleep(stall - ms(1)).await;
    busy(send(6, 5));
    tokio::time::sleep(ms(1)).await;
    match failed(send(7, 5)) {
        GuardFailure::NotReading { stalled, limit, .. } => {
            assert_eq!(stalled, stall);
            assert_eq!(limit, 4000);
        }
        other => panic!("{other}"),
    }
    assert_eq!(rig.guard.requests(), 0);
    // It reads again: the queue drains and requests are admitted.
    rig.guard.reading(true);
    tokio::time::sleep(ms(1)).await;
    assert_eq!(rig.guard.requests(), 4);
    send(8, 5).expect("room again");
}

on_both_transports!(
    r5_cancel_reaches_the_guard_and_a_late_answer_is_only_counted,
    r13_refused_judge_stream_fails_with_its_status_then_the_link_redials,
    r19_answers_reach_their_batches_by_request_id_in_any_order,
    r23_partial_answer_with_an_unknown_verdict_field_fails_and_cancels_the_request,
);

/// The scenarios run on both transports, each written once.
mod scenarios {
    use super::*;

    /// Mirrors
    /// `faults::hang_guard_fails_at_its_own_timeout_and_is_told_to_stop`: a
    /// withdrawn request is cancelled at the guard, and its late answer is
    /// dropped and counted, never delivered.
    pub(super) async fn r5_cancel_reaches_the_guard_and_a_late_answer_is_only_counted(
        transport: Transport,
    ) {
        let mut rig = rig_on(
            transport,
            |_| {},
            |b| vec![Step::answer(b, vec![steer(&b.calls[0].call_id, "late")]).after(ms(100))],
        );
        rig.guard.ignore_cancels();
        let id = rig.send(0, &["c"], "{}", 1).unwrap();
        tokio::time::sleep(ms(50)).await;
        rig.link.cancel(id);
        transport.settle().await;
        assert_eq!(rig.guard.cancels(), [id]);
        tokio::time::sleep(ms(100)).await;
        assert_eq!(rig.guard.answered(), 1, "the guard answered anyway");
        assert!(rig.events.try_recv().is_none(), "nothing delivered");
        assert!(rig.spurious(), "{}", rig.metrics.encode());
        // The stream goes on.
        let next = rig.send(1, &["c"], "{}", 1).unwrap();
        assert!(next > id);
        let (event, took) = rig.next().await;
        assert!(
            matches!(event, LinkEvent::Answer { tag: 1, .. }),
            "{event:?}"
        );
        transport.assert_took(took, ms(100), "the next answer");
    }

    /// Mirrors
    /// `faults::unreachable_guard_endpoint_that_is_not_grpc_blocks_under_fail_closed`:
    /// a refused `Judge` stream fails the waiting request with its status; the
    /// link is down until it redials, then serves.
    pub(super) async fn r13_refused_judge_stream_fails_with_its_status_then_the_link_redials(
        transport: Transport,
    ) {
        let mut rig = rig_on(transport, |_| {}, answers);
        rig.guard
            .refuse_stream(tonic::Status::unimplemented("not a guard"));
        rig.send(0, &["c"], "{}", 1).unwrap();
        let (event, took) = rig.next().await;
        match event {
            LinkEvent::Failed {
                failure: GuardFailure::Status { code, message },
                ..
            } => {
                assert_eq!(code, tonic::Code::Unimplemented);
                assert_eq!(message, "not a guard");
            }
            other => panic!("{other:?}"),
        }
        transport.assert_took(took, Duration::ZERO, "failed at once");
        let failure = failed(rig.send(1, &["c"], "{}", 1));
        assert!(
            failure.to_string().contains("Judge stream refused"),
            "{failure}"
        );
        // The first pause is within the first step, 20 ms (the timer rounds
        // up to the millisecond, so it may end at 20 ms exactly).
        tokio::time::sleep(ms(21)).await;
        transport.settle().await;
        assert_eq!(rig.guard.connects(), 2);
        rig.send(2, &["c"], "{}", 1).unwrap();
        assert!(matches!(
            rig.next().await.0,
            LinkEvent::Answer { tag: 2, .. }
        ));
    }

    /// Mirrors
    /// `rules::r19_batches_in_flight_on_one_stream_and_across_streams`: answers
    /// on one stream reach their batches by request id, in whatever order and
    /// at whatever time the guard sends them.
    pub(super) async fn r19_answers_reach_their_batches_by_request_id_in_any_order(
        transport: Transport,
    ) {
        let mut rig = rig_on(
            transport,
            |_| {},
            |b| {
                // b0 answers last, b2 first.
                let delay = match b.batch_id.as_str() {
                    "b0" => 300,
                    "b1" => 200,
                    _ => 100,
                };
                vec![
                    Step::answer(b, vec![steer(&b.calls[0].call_id, &b.batch_id)]).after(ms(delay)),
                ]
            },
        );
        let started = Instant::now();
        let ids: Vec<u64> = (0..3)
            .map(|tag| rig.send(tag, &["c"], "{}", tag as u64 + 1).unwrap())
            .collect();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let (event, _) = rig.next().await;
            let LinkEvent::Answer { tag, response, .. } = event else {
                panic!("{event:?}");
            };
            assert_eq!(response.request_id, ids[tag]);
            let Some(guardmesh_proto::v1::verdict::Outcome::Skip(skip)) =
                &response.verdicts[0].outcome
            else {
                panic!("{response:?}");
            };
            assert_eq!(skip.content, format!("b{tag}"));
            seen.push((tag, started.elapsed()));
        }
        let order: Vec<usize> = seen.iter().map(|(tag, _)| *tag).collect();
        assert_eq!(order, [2, 1, 0]);
        for ((tag, took), want) in seen.into_iter().zip([100, 200, 300]) {
            transport.assert_took(took, ms(want), &format!("b{tag}"));
        }
    }

    /// Mirrors
    /// `faults::r23_unknown_verdict_outcome_fails_the_guard_per_its_policy`
    /// (its partial answer): the request fails at once, the guard is told to
    /// stop, and the stream stays open for the next request.
    pub(super) async fn r23_partial_answer_with_an_unknown_verdict_field_fails_and_cancels_the_request(
        transport: Transport,
    ) {
        let mut rig = rig_on(
            transport,
            |_| {},
            |b| {
                if b.batch_id == "b0" {
                    // A partial answer whose verdict has a field 9 (unknown).
                    let mut verdict = Vec::new();
                    prost::encoding::encode_key(
                        1,
                        prost::encoding::WireType::LengthDelimited,
                        &mut verdict,
                    );
                    prost::encoding::encode_varint(1, &mut verdict);
                    verdict.push(b'c');
                    prost::encoding::encode_key(9, prost::encoding::WireType::Varint, &mut verdict);
                    prost::encoding::encode_varint(1, &mut verdict);
                    let mut bytes = Vec::new();
                    prost::encoding::encode_key(1, prost::encoding::WireType::Varint, &mut bytes);
                    prost::encoding::encode_varint(b.request_id, &mut bytes);
                    prost::encoding::encode_key(
                        2,
                        prost::encoding::WireType::LengthDelimited,
                        &mut bytes,
                    );
                    prost::encoding::encode_varint(verdict.len() as u64, &mut bytes);
                    bytes.extend_from_slice(&verdict);
                    prost::encoding::encode_key(3, prost::encoding::WireType::Varint, &mut bytes);
                    prost::encoding::encode_varint(1, &mut bytes);
                    vec![
                        Step::raw(bytes).after(ms(10)),
                        Step::answer(b, Vec::new()).after(ms(20)),
                    ]
                } else {
                    answers(b)
                }
            },
        );
        let id = rig.send(0, &["c"], "{}", 1).unwrap();
        let (event, took) = rig.next().await;
        match event {
            LinkEvent::Failed {
                tag: 0,
                failure: GuardFailure::UnknownVerdictField(field),
                ..
            } => assert_eq!((field.message, field.number), ("Verdict", 9)),
            other => panic!("{other:?}"),
        }
        transport.assert_took(took, ms(10), "failed when the partial answer came");
        transport.settle().await;
        assert_eq!(rig.guard.cancels(), [id], "told to stop");
        rig.send(1, &["c"], "{}", 1).unwrap();
        assert!(matches!(
            rig.next().await.0,
            LinkEvent::Answer { tag: 1, .. }
        ));
        assert_eq!(rig.guard.streams(), 1, "the stream stayed open");
        assert!(
            !GuardFailure::UnknownVerdictField(wire::UnknownField {
                message: "Verdict",
                number: 9
            })
            .counts_for_circuit()
        );
    }
}
