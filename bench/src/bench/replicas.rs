//! Replicas of a CPU-bound guard (R32): throughput of one guard registered
//! with 1, 2 and 4 replicas, each replica a guard process of its own
//! (`guardmesh bench-guards`) whose every request costs [`CPU_MS`] ms of its
//! CPU time, busy, not asleep. One replica judges one request at a time, on
//! a worker thread, while its runtime thread reads requests and writes
//! answers (see `guards::busy`); the mesh spreads a guard's requests over
//! its replicas, so with enough cores the throughput grows with the
//! replicas. The meshes' windows alternate as the other throughput runs' do.
//!
//! Then one window with 4 replicas, one of which is killed (SIGKILL)
//! halfway through it: every call must still be judged (a failed or
//! cancelled call fails the run), and its p99 is set against `replicas_4`'s.
//!
//! Figures: `replicas2_vs_replicas1_throughput`,
//! `replicas4_vs_replicas1_throughput` and `replicas4_kill_vs_none_p99`. On a
//! machine with few cores the mesh, the load generator and the replicas
//! share them. On two, the ceiling is about 1.5, whatever the number of
//! replicas: a batch costs about 1.5 ms of CPU in all (1.15 ms in the
//! replica, 0.2-0.3 ms in the mesh, under 0.1 ms in the load generator),
//! so two cores judge about 1,300 a second, while one replica alone has one
//! core, about 870 a second (measured: 1.3 to 1.6; docs/performance.md).

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

/// The `[[guard]]` section of the guard with the replicas `replicas`.
fn section(replicas: &[&GuardProcess]) -> Result<String, Error> {
    let mut urls = Vec::with_capacity(replicas.len());
    for replica in replicas {
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
            &section(&replicas.iter().take(n).collect::<Vec<_>>())?,
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
                "batches through the mesh, one guard of {CPU_MS} ms CPU per request (its thread CPU time), {n} replica process(es) (guard CPU: replica 1's)"
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
    // Four replicas again, one of which (a process of its own) is killed
    // halfway through the window: what failing over costs the tail.
    let victim_dir = dir.join("replica-killed");
    std::fs::create_dir_all(&victim_dir)
        .map_err(|e| format!("cannot create {}: {e}", victim_dir.display()))?;
    let mut victim = GuardProcess::start(exe, &victim_dir, &defs, args).await?;
    let mut members: Vec<&GuardProcess> = replicas.iter().skip(1).take(max - 1).collect();
    members.push(&victim);
    let mesh = MeshProcess::start_config(
        exe,
        dir,
        "throughput_replicas_4_kill",
        &section(&members)?,
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
    let mut killed = LoadTotals::new()?;
    let victim_pid = victim.child.pid();
    let killer = tokio::spawn({
        let after = plan.throughput_warmup + plan.throughput_window / 2;
        async move {
            tokio::time::sleep(after).await;
            kill(victim_pid);
        }
    });
    let measured = closed_loop(
        &loads,
        work,
        plan.throughput_warmup,
        plan.throughput_window,
        Some(mesh.pid()),
        members[0].child.pid(),
        &mut killed,
    )
    .await;
    killer.abort();
    measured.map_err(|e| format!("throughput replicas_4_kill: {e}"))?;
    drop(members);
    // The window must really have lost a replica.
    let mut dead = false;
    for _ in 0..50 {
        if victim.child.check_alive().is_err() {
            dead = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    if !dead {
        return Err("replicas_4_kill: the replica to kill was still alive after the window".into());
    }
    runs.push(LoadRun {
        name: "replicas_4_kill".into(),
        what: format!(
            "as replicas_4, one replica killed (SIGKILL) halfway through the window; one window of {:.1} s",
            plan.throughput_window.as_secs_f64()
        ),
        mesh: Some(mesh),
        loads,
        totals: killed,
    });
    drop(victim);
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

/// Kills the process `pid` (SIGKILL).
fn kill(pid: u32) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) is a plain system call on a process this
        // benchmark started and still holds (so its pid is not reused).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// Throughput with 2 and 4 replicas over that with 1, and the p99 with
/// one of 4 replicas killed over that with none.
fn ratios(throughput: &[Throughput]) -> Vec<(String, f64)> {
    let find = |name: &str| throughput.iter().find(|t| t.name == name);
    let per_second = |n: usize| find(&format!("replicas_{n}")).map_or(f64::NAN, |t| t.per_second);
    let one = per_second(1);
    let ratio = |a: f64| if one > 0.0 { a / one } else { f64::NAN };
    let p99 = |name: &str| find(name).map_or(f64::NAN, |t| t.p99);
    let none = p99("replicas_4");
    vec![
        (
            "replicas2_vs_replicas1_throughput".to_owned(),
            ratio(per_second(2)),
        ),
        (
            "replicas4_vs_replicas1_throughput".to_owned(),
            ratio(per_second(4)),
        ),
        (
            "replicas4_kill_vs_none_p99".to_owned(),
            if none > 0.0 {
                p99("replicas_4_kill") / none
            } else {
                f64::NAN
            },
        ),
    ]
}
