//! Replicas of a CPU-bound guard (R32): throughput of one guard registered
//! with 1, 2 and 4 replicas, each replica a guard process of its own
//! (`guardmesh bench-guards`, one runtime thread) whose every request costs
//! [`CPU_MS`] ms of CPU, busy, not asleep. One replica judges one request at
//! a time; the mesh spreads a guard's requests over its replicas, so with
//! enough cores the throughput grows with the replicas. The meshes' windows
//! alternate as the other throughput runs' do.
//!
//! Figures: `replicas2_vs_replicas1_throughput` and
//! `replicas4_vs_replicas1_throughput`. On a machine with few cores the mesh,
//! the load generator and the replicas share them: on two, about 2 is the
//! ceiling however many replicas run.

use super::{
    Error, GuardProcess, Load, LoadRun, LoadTotals, MeshProcess, Plan, Throughput, Work,
    closed_loop,
};
use crate::bench::BenchArgs;
use crate::bench::guards::GuardDef;
use std::path::Path;
use std::sync::Arc;

/// CPU each request costs a replica, in milliseconds.
pub(super) const CPU_MS: u64 = 1;
/// The guard's name, in every replica.
const GUARD: &str = "cpu-1ms";
/// The replica counts measured.
const COUNTS: [usize; 3] = [1, 2, 4];
/// The guard's timeout: one replica's queue of every batch in flight (64
/// by default), [`CPU_MS`] ms each (more in a debug build), must fit.
const TIMEOUT_MS: u64 = 5000;

/// The figures of the replica runs.
pub(super) struct ReplicaFigures {
    pub throughput: Vec<Throughput>,
    pub ratios: Vec<(String, f64)>,
}

/// The `[[guard]]` section of the guard with its first `n` replicas.
fn section(replicas: &[GuardProcess], n: usize) -> Result<String, Error> {
    let mut urls = Vec::with_capacity(n);
    for replica in &replicas[..n] {
        urls.push(format!("\"{}\"", replica.stream_url(GUARD)?));
    }
    let (first, rest) = urls.split_first().ok_or("no replica")?;
    Ok(format!(
        "\n[[guard]]\nname = \"{GUARD}\"\nendpoint = {first}\nreplicas = [{}]\ntimeout_ms = {TIMEOUT_MS}\n",
        rest.join(", ")
    ))
}

/// Starts four replica processes and measures the guard with 1, 2 and 4.
pub(super) async fn run(
    exe: &Path,
    dir: &Path,
    work: &Arc<Work>,
    plan: &Plan,
    args: &BenchArgs,
) -> Result<ReplicaFigures, Error> {
    let in_flight = args.in_flight.max(1);
    let max = COUNTS.iter().copied().max().unwrap_or(1);
    eprintln!(
        "[bench] replicas: one guard of {CPU_MS} ms CPU per request with {COUNTS:?} replica processes; {in_flight} in flight"
    );
    let defs = [GuardDef::cpu(GUARD, CPU_MS)];
    let mut replicas = Vec::with_capacity(max);
    for i in 0..max {
        // Each replica process logs in a directory of its own.
        let sub = dir.join(format!("replica-{}", i + 1));
        std::fs::create_dir_all(&sub)
            .map_err(|e| format!("cannot create {}: {e}", sub.display()))?;
        replicas.push(GuardProcess::start(exe, &sub, &defs, args).await?);
    }
    let mut runs = Vec::with_capacity(COUNTS.len());
    for n in COUNTS {
        let name = format!("replicas_{n}");
        let mesh = MeshProcess::start_config(
            exe,
            dir,
            &format!("throughput_{name}"),
            &section(&replicas, n)?,
            1,
            None,
        )
        .await?;
        let coordinator = mesh.coordinator().await?;
        let mut loads = Vec::with_capacity(in_flight);
        for i in 0..in_flight {
            loads.push(Load::Mesh(Arc::new(
                coordinator.session(format!("load-{i}")).await?,
            )));
        }
        runs.push(LoadRun {
            name,
            what: format!(
                "batches through the mesh, one guard of {CPU_MS} ms CPU per request, {n} replica process(es) (guard CPU: replica 1's)"
            ),
            mesh: Some(mesh),
            loads,
            totals: LoadTotals::new()?,
        });
    }
    let guards_pid = replicas[0].child.pid();
    let measured = async {
        for _ in 0..plan.throughput_windows {
            for run in runs.iter_mut() {
                closed_loop(
                    &run.loads,
                    work,
                    plan.throughput_warmup,
                    plan.throughput_window,
                    run.mesh.as_ref().map(MeshProcess::pid),
                    guards_pid,
                    &mut run.totals,
                )
                .await
                .map_err(|e| format!("throughput {}: {e}", run.name))?;
            }
        }
        Ok::<(), Error>(())
    }
    .await;
    if let Err(error) = measured {
        // Say which process died, if one did.
        for replica in &mut replicas {
            replica.child.check_alive()?;
        }
        for run in &mut runs {
            if let Some(mesh) = &mut run.mesh {
                mesh.child.check_alive()?;
            }
        }
        return Err(error);
    }
    let throughput: Vec<Throughput> = runs
        .into_iter()
        .map(|run| {
            Throughput::new(
                run.name,
                run.what,
                &run.totals.histogram,
                run.totals.elapsed,
                run.totals.cpu,
                true,
            )
        })
        .collect();
    let ratios = ratios(&throughput);
    Ok(ReplicaFigures { throughput, ratios })
}

/// Throughput with 2 and 4 replicas over that with 1.
fn ratios(throughput: &[Throughput]) -> Vec<(String, f64)> {
    let per_second = |n: usize| {
        let name = format!("replicas_{n}");
        throughput
            .iter()
            .find(|t| t.name == name)
            .map_or(f64::NAN, |t| t.per_second)
    };
    let one = per_second(1);
    let ratio = |a: f64| if one > 0.0 { a / one } else { f64::NAN };
    vec![
        (
            "replicas2_vs_replicas1_throughput".to_owned(),
            ratio(per_second(2)),
        ),
        (
            "replicas4_vs_replicas1_throughput".to_owned(),
            ratio(per_second(4)),
        ),
    ]
}
