//! A busy guard shared by two clients (R25): one guard process that judges
//! two batches at a time, [`DELAY_MS`] ms each (`guardmesh example-guard
//! allow --workers 2`), behind a mesh. A steady client sends one batch
//! every [`PACE`], first alone, then while another client, on its own
//! connection, sends bursts of [`BURST`] batches at once. The bursting
//! client's excess is shed (`RESOURCE_EXHAUSTED`, counted); the steady
//! client's batches must all be judged (a failed or cancelled call fails
//! the run).
//!
//! Figure: `busy_steady_under_burst_vs_alone_p99`, the steady client's p99
//! under the bursts over its p99 alone (the mesh's limit on what a guard
//! holds and its turns across clients keep it within a few of the guard's
//! own latency; the target is at most 3).

use super::Error;
use super::child::Child;
use guardmesh_client::{Batch, Coordinator, Outcome};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// What the guard takes per batch, in milliseconds.
pub(super) const DELAY_MS: u64 = 50;
/// Batches the guard judges at once.
const WORKERS: usize = 2;
/// Batches a burst sends at once.
const BURST: usize = 200;
/// The steady client's pace.
const PACE: Duration = Duration::from_millis(100);
/// The guard's timeout.
const TIMEOUT_MS: u64 = 1000;

/// The figures of the run.
pub(super) struct BusyFigures {
    pub ratios: Vec<(String, f64)>,
    pub setup: Vec<(String, serde_json::Value)>,
}

/// The steady client's batch: one call, proceeded by the guard.
fn batch(round: usize) -> Batch {
    Batch::new(u32::try_from(round % 4_000_000_000).unwrap_or(0))
        .call("c", "fs.read", r#"{"path":"/tmp/x"}"#)
        .timeout(Duration::from_secs(10))
}

/// The steady client's `count` batches, one every [`PACE`]: their round
/// trips; an error when one is not judged.
async fn steady(client: &Coordinator, count: usize, from: usize) -> Result<Vec<Duration>, Error> {
    let mut took = Vec::with_capacity(count);
    let mut ticks = tokio::time::interval(PACE);
    for round in from..from + count {
        ticks.tick().await;
        let sent = Instant::now();
        let decision = client
            .evaluate_once("steady", batch(round))
            .await
            .map_err(|e| format!("busy: the steady client's batch {round} was refused: {e}"))?;
        let judged = decision
            .calls
            .iter()
            .all(|c| matches!(c.outcome, Outcome::Proceed) && !c.failure);
        if !judged {
            return Err(format!(
                "busy: the steady client's batch {round} was not judged: {:?}",
                decision.trace
            )
            .into());
        }
        took.push(sent.elapsed());
    }
    Ok(took)
}

/// One burst from `client`: (judged, shed, failed).
async fn burst(client: &Coordinator, from: usize) -> (usize, usize, usize) {
    let rounds = (0..BURST).map(|i| {
        let client = client.clone();
        async move {
            client
                .evaluate_once(&format!("burst-{}", i % 8), batch(from + i))
                .await
        }
    });
    let (mut judged, mut shed, mut failed) = (0, 0, 0);
    for outcome in futures::future::join_all(rounds).await {
        match outcome {
            Ok(d) if d.calls.iter().all(|c| !c.failure) => judged += 1,
            Ok(_) => failed += 1,
            Err(e) if e.code() == Some(tonic::Code::ResourceExhausted) => shed += 1,
            Err(_) => failed += 1,
        }
    }
    (judged, shed, failed)
}

fn p99(took: &[Duration]) -> f64 {
    let mut sorted = took.to_vec();
    sorted.sort();
    let i = (sorted.len() * 99 / 100).min(sorted.len().saturating_sub(1));
    sorted.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
}

/// Runs the scenario: the guard, a mesh, the steady client alone, then
/// under bursts (one burst with `quick`, one a second otherwise).
pub(super) async fn run(exe: &Path, dir: &Path, quick: bool) -> Result<BusyFigures, Error> {
    let count = if quick { 20 } else { 60 };
    eprintln!(
        "[bench] busy: a guard judging {WORKERS} at a time, {DELAY_MS} ms each; a steady client alone, then under bursts of {BURST}"
    );
    let port = super::free_port()?;
    let mut command = Command::new(exe);
    command.args([
        "example-guard",
        "allow",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--workers",
        &WORKERS.to_string(),
        "--delay-ms",
        &DELAY_MS.to_string(),
    ]);
    let mut guard = Child::spawn(
        "the busy guard",
        command,
        Some(dir.join("busy-guard.log")),
        None,
    )?;
    let section = format!(
        "\n[[guard]]\nname = \"busy\"\nendpoint = \"http://127.0.0.1:{port}\"\ntimeout_ms = {TIMEOUT_MS}\n"
    );
    let mesh = super::MeshProcess::start_config(exe, dir, "busy", &section, 1, None).await?;
    let steady_client = mesh.coordinator().await?;
    let burst_client = mesh.coordinator().await?;
    // The guard is up once it judges.
    let mut ready = false;
    for _ in 0..250 {
        guard.check_alive()?;
        if steady(&steady_client, 1, 0).await.is_ok() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !ready {
        return Err("busy: the guard did not judge within 5 s".into());
    }
    let alone = steady(&steady_client, count, 1).await?;
    let bursts = if quick { 1 } else { count / 10 };
    let bursting = {
        let client = burst_client.clone();
        tokio::spawn(async move {
            let mut totals = (0, 0, 0);
            for b in 0..bursts {
                let started = Instant::now();
                let (judged, shed, failed) = burst(&client, 100_000 + b * BURST).await;
                totals = (totals.0 + judged, totals.1 + shed, totals.2 + failed);
                tokio::time::sleep(Duration::from_secs(1).saturating_sub(started.elapsed())).await;
            }
            totals
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let under = steady(&steady_client, count, 1 + count).await?;
    let (judged, shed, failed) = bursting
        .await
        .map_err(|e| format!("busy: the bursts: {e}"))?;
    guard.check_alive()?;
    drop(mesh);
    let (p99_alone, p99_under) = (p99(&alone), p99(&under));
    eprintln!(
        "[bench] busy: steady p99 {p99_alone:.1} ms alone, {p99_under:.1} ms under bursts; bursts: {judged} judged, {shed} shed, {failed} failed"
    );
    Ok(BusyFigures {
        ratios: vec![(
            "busy_steady_under_burst_vs_alone_p99".to_owned(),
            if p99_alone > 0.0 {
                p99_under / p99_alone
            } else {
                f64::NAN
            },
        )],
        setup: vec![
            ("busy_steady_batches".into(), serde_json::json!(count)),
            ("busy_bursts".into(), serde_json::json!([bursts, BURST])),
            (
                "busy_guard".into(),
                serde_json::json!(format!("{WORKERS} at a time, {DELAY_MS} ms each")),
            ),
            (
                "busy_steady_p99_alone_ms".into(),
                serde_json::json!(p99_alone),
            ),
            (
                "busy_steady_p99_under_ms".into(),
                serde_json::json!(p99_under),
            ),
            (
                "busy_burst_judged_shed_failed".into(),
                serde_json::json!([judged, shed, failed]),
            ),
        ],
    })
}
