//! Circuit breaking and load shedding (issue 6, items 7 and 8): a failing
//! guard's policy applies at once once its circuit opens, and excess load
//! is refused quickly instead of queueing without bound.

use crate::harness::*;
use futures::StreamExt;
use guardmesh_client::proto::{EvaluateRequest, FailurePolicy, ToolCall, TraceStatus};
use guardmesh_client::{Batch, ClientError, Outcome, Registration};
use prost::Message;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn guard_entry(
    d: &guardmesh_client::BatchDecision,
    name: &str,
) -> guardmesh_client::proto::GuardTrace {
    d.trace.iter().find(|t| t.guard == name).unwrap().clone()
}

#[tokio::test]
async fn circuit_opens_after_repeated_failures_and_fail_closed_still_blocks() {
    let mut config = fast_config();
    config.link.circuit_failures = 3;
    config.link.circuit_open_for = Duration::from_millis(300);
    let mesh = TestMesh::with_config(config).await;
    // Hangs while `hang` is set, proceeds otherwise.
    let hang = Arc::new(AtomicBool::new(true));
    let guard = script_guard({
        let hang = hang.clone();
        move |_| Script {
            delay: if hang.load(Ordering::SeqCst) {
                Duration::from_secs(5)
            } else {
                Duration::ZERO
            },
            ..Default::default()
        }
    })
    .await;
    mesh.register(Registration::validate("hangs", &guard.url).timeout(Duration::from_millis(100)))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    for turn in 0..3 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        assert_eq!(
            guard_entry(&d, "hangs").status,
            TraceStatus::TimedOut as i32
        );
    }
    let sent_before = guard.guard.requests();
    // Open: the policy applies without contacting the guard or waiting.
    let d = session
        .evaluate(Batch::new(3).call("c", "t", "{}"))
        .await
        .unwrap();
    let entry = guard_entry(&d, "hangs");
    assert_eq!(entry.status, TraceStatus::Failed as i32);
    assert!(entry.error.contains("circuit open"), "{}", entry.error);
    assert!(
        matches!(d.calls[0].outcome, Outcome::Cancel { .. }) && d.calls[0].failure,
        "an open circuit on a fail_closed guard means skip, not bypass"
    );
    assert_eq!(
        guard.guard.requests(),
        sent_before,
        "not contacted while open"
    );
    assert!(
        mesh.mesh
            .metrics
            .encode()
            .contains(r#"guardmesh_guard_circuit_opened_total{guard="hangs"} 1"#)
    );

    // The guard recovers; after the open period a half-open probe goes
    // through, succeeds, and the circuit closes.
    hang.store(false, Ordering::SeqCst);
    let mut closed = false;
    for turn in 4..100 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        if d.calls[0].proceeds() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(closed, "a successful probe closes the circuit");
    let d = session
        .evaluate(Batch::new(200).call("c", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
}

#[tokio::test]
async fn circuit_open_under_fail_open_is_recorded_as_bypass() {
    let mut config = fast_config();
    config.link.circuit_failures = 2;
    config.link.circuit_open_for = Duration::from_secs(60);
    let mesh = TestMesh::with_config(config).await;
    let down = closed_port().await;
    mesh.register(Registration::validate("down", &down).failure_policy(FailurePolicy::FailOpen))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let mut saw_open = false;
    for turn in 0..10 {
        let d = session
            .evaluate(Batch::new(turn).call("c", "t", "{}"))
            .await
            .unwrap();
        assert!(d.calls[0].proceeds());
        assert_eq!(d.calls[0].bypassed, ["down"], "a failure is never silent");
        saw_open |= guard_entry(&d, "down").error.contains("circuit open");
    }
    assert!(saw_open);
}

#[tokio::test]
async fn overload_excess_batches_are_refused_quickly_and_every_batch_answered_once() {
    let mut config = fast_config();
    config.limits.max_inflight_batches = 4;
    let mesh = TestMesh::with_config(config).await;
    let slow = slow_guard(Duration::from_millis(500)).await;
    mesh.register(Registration::validate("slow", &slow.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let results = futures::future::join_all((0..24).map(|i| {
        session.evaluate_raw(EvaluateRequest {
            batch_id: format!("b{i}"),
            calls: vec![ToolCall {
                call_id: "c".into(),
                tool: "t".into(),
                arguments: "{}".into(),
            }],
            ..Default::default()
        })
    }))
    .await;
    let mut decided = 0;
    let mut shed = 0;
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok(d) => {
                assert_eq!(d.batch_id, format!("b{i}"));
                assert_eq!(d.calls.len(), 1);
                decided += 1;
            }
            Err(ClientError::Status(status)) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                assert!(status.message().contains("overloaded"), "{status:?}");
                shed += 1;
            }
            Err(other) => panic!("batch b{i}: {other}"),
        }
    }
    assert_eq!(decided + shed, 24, "every batch answered exactly once");
    assert!(
        decided >= 4,
        "the limit's worth of batches are judged: {decided}"
    );
    assert!(shed >= 1, "the excess is shed, not queued");
    assert!(
        slow.guard.requests() <= decided,
        "shed batches reach no guard"
    );
    // Zero-call batches need no slot (R1) and the mesh keeps serving.
    let d = session
        .evaluate(Batch::new(99).call("after", "t", "{}"))
        .await
        .unwrap();
    assert!(d.calls[0].proceeds());
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Measures (or sets) what the whole process owns: runs alone in a child
/// process of the test binary (see `harness::isolated`).
#[test]
fn overload_flood_keeps_memory_bounded() {
    isolated("overload::overload_flood_keeps_memory_bounded_in_own_process");
}

#[tokio::test]
#[ignore = "runs in its own process through overload_flood_keeps_memory_bounded"]
async fn overload_flood_keeps_memory_bounded_in_own_process() {
    let _heavy = HEAVY.lock().await;
    let mut config = fast_config();
    config.limits.max_inflight_batches = 8;
    config.limits.max_batches_per_stream = 16;
    let mesh = TestMesh::with_config(config).await;
    let slow = slow_guard(Duration::from_millis(200)).await;
    mesh.register(Registration::validate("slow", &slow.url))
        .await;
    let coordinator = mesh.coordinator().await;
    let args = format!(r#"{{"blob":"{}"}}"#, "x".repeat(4000));
    let before = rss_kib();
    let mut peak = before;
    let mut answered = 0usize;
    // 8 sessions x 5 waves x 100 batches = 4,000 batches of ~4 KB each.
    for _wave in 0..5 {
        let waves = (0..8).map(|s| {
            let coordinator = coordinator.clone();
            let args = args.clone();
            async move {
                let session = coordinator.session(format!("flood-{s}")).await.unwrap();
                let all = futures::future::join_all(
                    (0..100).map(|i| session.evaluate(Batch::new(i).call("c", "t", args.clone()))),
                )
                .await;
                all.len()
            }
        });
        answered += futures::future::join_all(waves)
            .await
            .into_iter()
            .sum::<usize>();
        peak = peak.max(rss_kib());
    }
    assert_eq!(answered, 4000);
    let growth_mib = peak.saturating_sub(before) / 1024;
    eprintln!(
        "flood: 4000 batches, RSS {} MiB -> peak {} MiB",
        before / 1024,
        peak / 1024
    );
    assert!(
        growth_mib < 256,
        "RSS grew by {growth_mib} MiB during the flood"
    );
}

// ---------------------------------------------------------------------------
// Bounded under hostile coordinators (R20, R25). The memory tests run the
// mesh as its own process and read its /proc/PID/status, so that what the
// test's clients hold is not counted.
// ---------------------------------------------------------------------------

use guardmesh_client::proto::{BatchContext, evaluate_response};
use prost::bytes::Bytes;

fn guard_config(name: &str, url: &str, tools: &str) -> String {
    format!(
        "\n[[guard]]\nname = \"{name}\"\nendpoint = \"{url}\"\ntools = [{tools}]\ntimeout_ms = 20000\n"
    )
}

/// A canary on its own connection: a one-call batch of tool `small`,
/// which a proceed guard judges.
async fn canary(url: &str, turn: u32) {
    let coordinator = guardmesh_client::Coordinator::connect(url.to_owned())
        .await
        .unwrap();
    let session = coordinator.session("canary").await.unwrap();
    let d = tokio::time::timeout(
        Duration::from_secs(20),
        session.evaluate(Batch::new(turn).call("c", "small", "{}")),
    )
    .await
    .expect("the canary is answered")
    .unwrap_or_else(|e| panic!("canary: {e}"));
    assert_eq!(d.calls.len(), 1);
    assert!(d.calls[0].proceeds(), "canary: {:?}", d.calls[0]);
    assert_eq!(status_of(&d, "canary"), TraceStatus::Proceeded);
}

fn zero_call(id: String, model_text: &str) -> Bytes {
    batch_bytes(&EvaluateRequest {
        batch_id: id,
        context: Some(BatchContext {
            session_id: "attack".into(),
            model_text: model_text.into(),
            ..Default::default()
        }),
        ..Default::default()
    })
}

#[tokio::test]
async fn r25_a_coordinator_that_does_not_read_its_answers_is_stopped_not_buffered() {
    let _heavy = HEAVY.lock().await;
    let probe = proceed_guard().await;
    let mesh = MeshProcess::start(
        "unread",
        &guard_config("canary", &probe.url, "\"small\""),
        Some("warn"),
    )
    .await;
    let (before, _) = mesh.memory_mib();
    // 30,000 zero-call batches of 4 KiB each (120 MB), on a stream whose
    // answers (7 MB) are never read.
    const BATCHES: usize = 30_000;
    let text = "x".repeat(4096);
    let pulled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let requests = futures::stream::iter(0..BATCHES).map({
        let pulled = pulled.clone();
        move |i| {
            pulled.fetch_add(1, Ordering::SeqCst);
            // 200-byte ids: the answers overflow the client's HTTP/2
            // receive window, as answers do when nobody reads them.
            zero_call(format!("unread-{i:0>200}"), &text)
        }
    });
    let mut attacker = raw_client(&mesh.url).await;
    let answers = raw_evaluate(&mut attacker, requests).await.unwrap();
    // Bounded in time: wait until everything was taken or it stalls.
    let mut last = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = pulled.load(Ordering::SeqCst);
        if now == BATCHES || (now == last && now > 0) {
            break;
        }
        last = now;
    }
    canary(&mesh.url, 1).await;
    let (rss, peak) = mesh.memory_mib();
    let taken = pulled.load(Ordering::SeqCst);
    eprintln!("unread answers: {taken} batches taken; mesh RSS {before} -> {rss} MiB, peak {peak}");
    assert!(
        taken < BATCHES / 2,
        "the mesh stops reading a stream whose answers are not read ({taken} of {BATCHES} taken)"
    );
    assert!(
        peak.saturating_sub(before) < 64,
        "a coordinator that does not read grew the mesh by {} MiB",
        peak - before
    );
    // Reading again resumes the stream: the answers come, in full.
    let mut answers = answers;
    let mut read = 0;
    while read < 1000 {
        let answer = next_answer(&mut answers).await.unwrap().unwrap();
        assert!(matches!(
            answer.result,
            Some(evaluate_response::Result::Decision(_))
        ));
        read += 1;
    }
    canary(&mesh.url, 2).await;
}

/// 4,000,000 bytes: four calls of ~1 MB arguments.
fn big_batch(id: &str) -> Bytes {
    let args = format!(r#"{{"blob":"{}"}}"#, "y".repeat(999_980));
    batch_bytes(&EvaluateRequest {
        batch_id: id.into(),
        calls: (0..4)
            .map(|i| ToolCall {
                call_id: format!("c{i}"),
                tool: "big".into(),
                arguments: args.clone(),
            })
            .collect(),
        timeout_ms: 60_000,
        ..Default::default()
    })
}

#[tokio::test]
async fn r25_batches_in_flight_are_bounded_in_bytes() {
    let _heavy = HEAVY.lock().await;
    let held = held_guard().await;
    let probe = proceed_guard().await;
    let config = format!(
        // Batches are held until the guard is released, however long sending
        // 400 MB takes on a loaded machine: no deadline frees their bytes.
        // Streams and the guard's queue may each hold more than their share,
        // so that the mesh-wide byte bound is the one that acts.
        "max_batch_timeout_ms = 60000\ndefault_batch_timeout_ms = 60000\n\
         [limits]\nmax_stream_bytes = 134217728\n\
         [guard_links]\nmax_queued_bytes = 1073741824\n{}{}",
        guard_config("held", &held.url, "\"big\""),
        guard_config("canary", &probe.url, "\"small\"")
    );
    let mesh = MeshProcess::start("inflight", &config, Some("warn")).await;
    let (before, _) = mesh.memory_mib();
    // 100 batches of 4 MB, 10 streams of 10, held by the guard.
    let batch = big_batch("template");
    assert!(batch.len() <= 4 << 20 && batch.len() > 3_900_000);
    let mut streams = Vec::new();
    for s in 0..10 {
        let mut client = raw_client(&mesh.url).await;
        let requests = futures::stream::iter(0..10).map(move |i| {
            let mut request = EvaluateRequest::decode(big_batch("x")).unwrap();
            request.batch_id = format!("big-{s}-{i}");
            batch_bytes(&request)
        });
        streams.push(raw_evaluate(&mut client, requests).await.unwrap());
    }
    // Every batch is either shed at once or reaches the guard.
    let mut shed = 0;
    let mut pending = Vec::new();
    for mut answers in streams {
        let reader = tokio::spawn(async move {
            let mut shed = 0;
            let mut decided = 0;
            while let Ok(Some(answer)) = next_answer(&mut answers).await {
                match answer.result {
                    Some(evaluate_response::Result::Error(e)) => {
                        assert_eq!(e.code, tonic::Code::ResourceExhausted as i32, "{e:?}");
                        shed += 1;
                    }
                    Some(evaluate_response::Result::Decision(d)) => {
                        assert_eq!(d.decisions.len(), 4);
                        decided += 1;
                    }
                    None => panic!("empty answer"),
                }
                if shed + decided == 10 {
                    break;
                }
            }
            (shed, decided)
        });
        pending.push(reader);
    }
    assert!(
        eventually_within(1500, || held.guard.requests() > 0).await,
        "batches reach the guard"
    );
    // Let the shedding settle (bounded), then measure while they are held.
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if pending.iter().all(|p| p.is_finished()) {
            break;
        }
    }
    canary(&mesh.url, 1).await;
    let (rss, peak) = mesh.memory_mib();
    eprintln!(
        "100 x 4 MB: {} held at the guard; mesh RSS {before} -> {rss} MiB, peak {peak}",
        held.guard.requests()
    );
    assert!(
        peak < 768,
        "100 x 4 MB batches in flight: mesh peak RSS {peak} MiB"
    );
    held.guard.release();
    let mut decided = 0;
    for p in pending {
        let (s, d) = tokio::time::timeout(Duration::from_secs(60), p)
            .await
            .expect("answered")
            .unwrap();
        shed += s;
        decided += d;
    }
    assert_eq!(shed + decided, 100, "every batch answered once");
    assert!(decided >= 1 && shed >= 1, "decided {decided}, shed {shed}");
    canary(&mesh.url, 2).await;
}

#[tokio::test]
async fn r20_sizes_and_counts_are_checked_before_the_batch_is_decoded() {
    let _heavy = HEAVY.lock().await;
    let probe = proceed_guard().await;
    let mesh = MeshProcess::start(
        "decode",
        &guard_config("canary", &probe.url, "\"small\""),
        Some("warn"),
    )
    .await;
    let (before, _) = mesh.memory_mib();
    // Just under max_batch_bytes of empty calls (`1a 00` repeated): two
    // million calls if decoded.
    let mut empty_calls = vec![0x0a, 0x02, b'e', b'1'];
    empty_calls.extend(std::iter::repeat_n([0x1a, 0x00], (4 << 20) / 2 - 8).flatten());
    // A million empty metadata entries in one context.
    let mut context = Vec::new();
    for _ in 0..1_000_000 {
        context.extend([0x22, 0x00]);
    }
    let mut metadata = vec![0x0a, 0x02, b'm', b'1', 0x12];
    prost::encoding::encode_varint(context.len() as u64, &mut metadata);
    metadata.extend(context);
    let ok = batch_bytes(&EvaluateRequest {
        batch_id: "after".into(),
        calls: vec![ToolCall {
            call_id: "c".into(),
            tool: "small".into(),
            arguments: "{}".into(),
        }],
        ..Default::default()
    });
    let messages: Vec<Bytes> = vec![
        empty_calls.clone().into(),
        metadata.into(),
        empty_calls.into(),
        ok,
    ];
    let mut client = raw_client(&mesh.url).await;
    let mut answers = raw_evaluate(&mut client, futures::stream::iter(messages))
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        let answer = tokio::time::timeout(Duration::from_secs(20), next_answer(&mut answers))
            .await
            .expect("answered")
            .unwrap()
            .expect("the stream stays open");
        got.push(answer);
    }
    for answer in &got[..3] {
        let Some(evaluate_response::Result::Error(e)) = &answer.result else {
            panic!("an over-limit batch is refused: {answer:?}")
        };
        assert_eq!(e.code, tonic::Code::ResourceExhausted as i32, "{e:?}");
        assert!(
            e.message.contains("max_calls_per_batch") || e.message.contains("max_metadata_entries"),
            "names the limit: {}",
            e.message
        );
    }
    assert_eq!(got[0].batch_id, "e1");
    assert_eq!(got[1].batch_id, "m1");
    let Some(evaluate_response::Result::Decision(d)) = &got[3].result else {
        panic!("the next batch on the stream is judged: {:?}", got[3])
    };
    assert_eq!(got[3].batch_id, "after");
    assert_eq!(d.decisions.len(), 1);
    canary(&mesh.url, 1).await;
    // A message above the transport limit ends only its own stream.
    let huge: Bytes = vec![0x1a; 16 << 20].into();
    let mut client = raw_client(&mesh.url).await;
    let mut answers = raw_evaluate(&mut client, futures::stream::iter([huge]))
        .await
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(20), next_answer(&mut answers))
        .await
        .expect("answered");
    match end {
        Err(status) => assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}"),
        Ok(other) => panic!("a message above the transport limit ends its stream: {other:?}"),
    }
    canary(&mesh.url, 2).await;
    let (rss, peak) = mesh.memory_mib();
    eprintln!("decode before check: mesh RSS {before} -> {rss} MiB, peak {peak}");
    assert!(
        peak.saturating_sub(before) < 64,
        "over-limit messages grew the mesh by {} MiB",
        peak - before
    );
}

#[tokio::test]
async fn r20_a_unary_call_over_the_transport_limit_is_resource_exhausted() {
    let mesh = TestMesh::start().await;
    let mut client = raw_client(&mesh.url).await;
    let huge: Bytes = vec![0x1a; 17 << 20].into();
    let status = raw_evaluate_batch(&mut client, huge).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    // Over max_batch_bytes but readable: refused, naming the limit.
    let mut empty_calls = vec![0x0a, 0x02, b'u', b'1'];
    empty_calls.extend(std::iter::repeat_n([0x1a, 0x00], 300).flatten());
    let status = raw_evaluate_batch(&mut client, empty_calls.into())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("300 calls"), "{status:?}");
}

#[tokio::test]
async fn r20_over_long_ids_are_refused_and_never_echoed() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let long_id = "i".repeat(1 << 20);
    let long_call = "c".repeat(300);
    let one_call = |batch_id: &str, call_id: &str| {
        batch_bytes(&EvaluateRequest {
            batch_id: batch_id.into(),
            calls: vec![ToolCall {
                call_id: call_id.into(),
                tool: "t".into(),
                arguments: "{}".into(),
            }],
            ..Default::default()
        })
    };
    let messages = vec![
        one_call(&long_id, "c"),
        one_call("b2", &long_call),
        one_call("b3", "c"),
    ];
    let mut client = raw_client(&mesh.url).await;
    let mut answers = raw_evaluate(&mut client, futures::stream::iter(messages))
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(
            tokio::time::timeout(Duration::from_secs(20), next_answer(&mut answers))
                .await
                .expect("answered")
                .unwrap()
                .expect("the stream stays open"),
        );
    }
    got.sort_by_key(|a| a.batch_id.len());
    let (b2, b3, long) = (&got[0], &got[1], &got[2]);
    let (b2, b3) = if b2.batch_id == "b2" {
        (b2, b3)
    } else {
        (b3, b2)
    };
    // The over-long batch id: its answer carries the id cut and marked.
    assert!(
        long.batch_id.len() < 100
            && long.batch_id.starts_with("iiii")
            && long.batch_id.ends_with(&format!("...[{} bytes]", 1 << 20)),
        "the answer echoes {} bytes of the id",
        long.batch_id.len()
    );
    let Some(evaluate_response::Result::Error(e)) = &long.result else {
        panic!("refused: {long:?}")
    };
    assert_eq!(e.code, tonic::Code::InvalidArgument as i32);
    assert!(
        e.message.contains("batch_id") && e.message.len() < 200,
        "{}",
        e.message
    );
    let Some(evaluate_response::Result::Error(e)) = &b2.result else {
        panic!("refused: {b2:?}")
    };
    assert_eq!(e.code, tonic::Code::InvalidArgument as i32);
    assert!(
        e.message.contains("call_id") && e.message.len() < 200,
        "{}",
        e.message
    );
    assert!(
        matches!(&b3.result, Some(evaluate_response::Result::Decision(d)) if d.decisions.len() == 1),
        "the stream goes on: {b3:?}"
    );
    assert_eq!(guard.guard.requests(), 1, "refused batches reach no guard");
    // The same on a unary call.
    let status = raw_evaluate_batch(&mut client, one_call(&long_id, "c"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().len() < 200);
}

#[tokio::test]
async fn r25_coordinator_streams_are_capped_mesh_wide() {
    let mut config = fast_config();
    config.limits.max_coordinator_streams = 8;
    let mesh = TestMesh::with_config(config).await;
    let mut open = Vec::new();
    // Idle streams over two connections.
    for c in 0..2 {
        let mut client = raw_client(&mesh.url).await;
        for _ in 0..4 {
            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
            let answers =
                raw_evaluate(&mut client, tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await
                    .unwrap_or_else(|e| panic!("connection {c}: {e:?}"));
            open.push((tx, answers));
        }
    }
    let mut client = raw_client(&mesh.url).await;
    let (_tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    let refused = raw_evaluate(&mut client, tokio_stream::wrappers::ReceiverStream::new(rx)).await;
    let status = refused.expect_err("a stream past the cap is refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("max_coordinator_streams"),
        "{status:?}"
    );
    // Unary calls still work, and a closed stream frees its place.
    let d = mesh.decides(Batch::new(0).call("c", "t", "{}")).await;
    assert!(d.calls[0].proceeds());
    drop(open.pop());
    let mut reopened = false;
    for _ in 0..100 {
        let (_tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        if raw_evaluate(&mut client, tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .is_ok()
        {
            reopened = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reopened, "a closed stream frees its place");
}

#[tokio::test]
async fn r1_a_zero_call_batch_is_answered_on_a_stream_at_its_limit() {
    let mut config = fast_config();
    config.limits.max_batches_per_stream = 1;
    let mesh = TestMesh::with_config(config).await;
    let held = held_guard().await;
    mesh.register(Registration::validate("held", &held.url))
        .await;
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let first = session.evaluate(Batch::new(0).call("c", "t", "{}"));
    tokio::pin!(first);
    let reached = tokio::select! {
        biased;
        d = &mut first => panic!("answered while held: {d:?}"),
        reached = eventually_within(500, || held.guard.requests() == 1) => reached,
    };
    assert!(reached);
    let (zero, second) = tokio::select! {
        biased;
        d = &mut first => panic!("answered while held: {d:?}"),
        both = async {
            let zero = session
                .evaluate_raw(EvaluateRequest {
                    batch_id: "zero".into(),
                    ..Default::default()
                })
                .await;
            let second = session.evaluate(Batch::new(1).call("c", "t", "{}")).await;
            (zero, second)
        } => both,
    };
    let zero = zero.expect("R1: a zero-call batch is answered at once, even at the stream's limit");
    assert!(zero.calls.is_empty());
    match second {
        Err(ClientError::Status(status)) => {
            assert_eq!(status.code(), tonic::Code::ResourceExhausted)
        }
        other => panic!("a batch with calls past the stream's limit is shed: {other:?}"),
    }
    held.guard.release();
    assert!(first.await.unwrap().calls[0].proceeds());
}

#[tokio::test]
async fn r20_refusals_on_a_stream_are_counted_as_refused_batches() {
    let mesh = TestMesh::start().await;
    let held = held_guard().await;
    mesh.register(Registration::validate("held", &held.url))
        .await;
    let refused = || metric(&mesh, r#"guardmesh_batches_total{outcome="refused"}"#);
    let before = refused();
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let request = EvaluateRequest {
        batch_id: "dup".into(),
        calls: vec![ToolCall {
            call_id: "c".into(),
            tool: "t".into(),
            arguments: "{}".into(),
        }],
        ..Default::default()
    };
    let first = session.evaluate_raw(request.clone());
    tokio::pin!(first);
    let reached = tokio::select! {
        biased;
        d = &mut first => panic!("answered while held: {d:?}"),
        reached = eventually_within(500, || held.guard.requests() == 1) => reached,
    };
    assert!(reached);
    // A duplicate batch id, refused by the stream itself.
    let mut client = raw_client(&mesh.url).await;
    let mut answers = raw_evaluate(
        &mut client,
        futures::stream::iter([batch_bytes(&request), batch_bytes(&request)]),
    )
    .await
    .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), next_answer(&mut answers))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        matches!(&answer.result, Some(evaluate_response::Result::Error(e)) if e.code == tonic::Code::InvalidArgument as i32),
        "{answer:?}"
    );
    assert_eq!(refused() - before, 1.0, "the refusal is counted");
    held.guard.release();
    assert!(first.await.is_ok());
}

#[tokio::test]
async fn r17_a_zero_call_batch_carries_the_current_chain_revision() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    mesh.register(Registration::validate("g2", &guard.url))
        .await;
    let revision = mesh.mesh.registry().chain().revision;
    assert!(revision > 0);
    let session = mesh.coordinator().await.session("s").await.unwrap();
    let d = session
        .evaluate_raw(EvaluateRequest {
            batch_id: "zero".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(d.chain_revision, revision, "R17: a zero-call batch too");
    assert_eq!(guard.guard.requests(), 0, "R1: no guard contacted");
    let mut client = raw_client(&mesh.url).await;
    let d = raw_evaluate_batch(&mut client, zero_call("unary-zero".into(), ""))
        .await
        .unwrap();
    assert_eq!(d.chain_revision, revision);
}
