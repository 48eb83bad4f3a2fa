//! The decision log's cost (R29): the standard scenario (`mesh_4`, four
//! zero-latency guards, batches of 4 calls) on four meshes that differ
//! only in their `[decision_log]`:
//!
//! | scenario | `[decision_log]` |
//! |---|---|
//! | `log_off` | none |
//! | `log_fsync_record` | `durability = "every_record"`: a batch is answered once its record is on disk (`fdatasync`, shared by concurrent batches) |
//! | `log_fsync_interval` | `durability = "interval"`, `sync_interval_ms = 100`: answered once written to the file |
//! | `log_signed` | as `log_fsync_record`, with a `signing_key`: signed checkpoints at the default `checkpoint_every` (1000) and `checkpoint_interval_ms` (10 s), and a witness file |
//!
//! Latency (one batch in flight) in one group whose scenarios alternate
//! round by round, then throughput (closed loop) with windows alternating,
//! so the ratios `log_fsync_record_vs_off_p50`,
//! `log_fsync_interval_vs_off_p50` and `log_signed_vs_off_p50` compare
//! figures measured side by side. What signing adds is
//! `cpu_per_batch_log_signed_vs_log_on` (mesh CPU per batch, signed log
//! against the same log without a key; the target is at most 1.05).
//! The logs are written under the run's temporary folder, on the disk of
//! the system's temporary directory: the fsync cost is that disk's.

use super::report::{Latency, Throughput};
use super::{
    Error, GuardProcess, Load, LoadRun, LoadTotals, MeshProcess, Op, Plan, Scenario, Work, ZERO,
    run_group,
};
use std::path::Path;
use std::sync::Arc;

/// The scenarios: name, description, `[decision_log] durability`.
const VARIANTS: [(&str, &str, Option<&str>); 4] = [
    ("log_off", "mesh_4, no decision log", None),
    (
        "log_fsync_record",
        "mesh_4, decision log with fsync per record (group commit)",
        Some("every_record"),
    ),
    (
        "log_fsync_interval",
        "mesh_4, decision log with fsync every 100 ms",
        Some("interval"),
    ),
    (
        SIGNED,
        "mesh_4, decision log with fsync per record and signed checkpoints (defaults)",
        Some("every_record"),
    ),
];

/// The scenario with a signing key.
const SIGNED: &str = "log_signed";

/// The `[decision_log]` section of a scenario's config.
fn section(dir: &Path, label: &str, durability: Option<&str>) -> Result<String, Error> {
    let Some(durability) = durability else {
        return Ok(String::new());
    };
    let mut section = format!(
        "\n[decision_log]\ndir = {:?}\ndurability = \"{durability}\"\nsync_interval_ms = 100\nmask = [\"password\", \"*.api_key\"]\n",
        dir.join(format!("{label}-log")).display().to_string()
    );
    if label == SIGNED {
        let key = dir.join(format!("{label}.key"));
        guardmesh_server::decision_log::checkpoint::generate(&key)
            .map_err(|e| format!("cannot write the bench's signing key: {e}"))?;
        section.push_str(&format!(
            "signing_key = {:?}\nwitness = {:?}\n",
            key.display().to_string(),
            dir.join(format!("{label}-witness.jsonl"))
                .display()
                .to_string()
        ));
    }
    Ok(section)
}

/// Runs the three scenarios: their latency figures, then their
/// throughput figures.
pub(super) async fn run(
    exe: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    work: &Arc<Work>,
    plan: &Plan,
    in_flight: usize,
) -> Result<(Vec<Latency>, Vec<Throughput>), Error> {
    let mut meshes = Vec::new();
    for (label, _, durability) in VARIANTS {
        let extra = section(dir, label, durability)?;
        let sections = MeshProcess::guard_sections(guards, &ZERO)? + &extra;
        meshes.push(MeshProcess::start_config(exe, dir, label, &sections, ZERO.len(), None).await?);
    }
    let mut scenarios = Vec::new();
    for (&(label, what, _), mesh) in VARIANTS.iter().zip(&meshes) {
        scenarios.push(Scenario::new(
            label,
            what,
            Op::Mesh(mesh.session(label).await?),
            false,
            Some(mesh),
            plan.fast,
        )?);
    }
    let latency = {
        let mut refs: Vec<&mut MeshProcess> = meshes.iter_mut().collect();
        run_group(
            "decision log",
            &mut scenarios,
            plan.rounds,
            work,
            guards,
            &mut refs,
        )
        .await?
    };
    drop(scenarios);

    eprintln!(
        "[bench] throughput: {} with {in_flight} in flight",
        VARIANTS.map(|v| v.0).join(", ")
    );
    let mut runs = Vec::new();
    for ((label, what, _), mesh) in VARIANTS.into_iter().zip(meshes) {
        let coordinator = mesh.coordinator().await?;
        let mut loads = Vec::with_capacity(in_flight);
        for i in 0..in_flight {
            loads.push(Load::Mesh(Arc::new(
                coordinator.session(format!("load-{i}")).await?,
            )));
        }
        runs.push(LoadRun {
            name: label.to_owned(),
            what: what.to_owned(),
            mesh: Some(mesh),
            loads,
            totals: LoadTotals::new()?,
        });
    }
    super::run_windows(&mut runs, guards, work, plan).await?;
    let throughput = runs
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
    Ok((latency, throughput))
}

/// The log's cost as ratios against `log_off` (and signing's against the
/// same log without a key), measured in the same run; none when the run
/// has no such figures.
pub(super) fn ratios(latency: &[Latency], throughput: &[Throughput]) -> Vec<(String, f64)> {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let mut out = Vec::new();
    let find = |name: &str| latency.iter().find(|l| l.name == name);
    if let Some(off) = find("log_off") {
        for (label, key) in [
            ("log_fsync_record", "log_fsync_record"),
            ("log_fsync_interval", "log_fsync_interval"),
            (SIGNED, SIGNED),
        ] {
            let Some(on) = find(label) else { continue };
            out.push((format!("{key}_vs_off_p50"), ratio(on.p50, off.p50)));
            out.push((format!("{key}_vs_off_p99"), ratio(on.p99, off.p99)));
            if let (Some(on_cpu), Some(off_cpu)) = (on.cpu.mesh, off.cpu.mesh) {
                out.push((
                    format!("latency_mesh_cpu_{key}_vs_off"),
                    ratio(on_cpu, off_cpu),
                ));
            }
        }
    }
    if let (Some(unsigned), Some(signed)) = (find("log_fsync_record"), find(SIGNED)) {
        out.push((
            "log_signed_vs_log_on_p50".to_owned(),
            ratio(signed.p50, unsigned.p50),
        ));
    }
    let find = |name: &str| throughput.iter().find(|t| t.name == name);
    if let Some(off) = find("log_off") {
        for key in ["log_fsync_record", "log_fsync_interval", SIGNED] {
            let Some(on) = find(key) else { continue };
            out.push((
                format!("throughput_{key}_vs_off"),
                ratio(on.per_second, off.per_second),
            ));
            out.push((
                format!("cpu_per_batch_{key}_vs_off"),
                ratio(on.server_cpu(), off.server_cpu()),
            ));
        }
    }
    if let (Some(unsigned), Some(signed)) = (find("log_fsync_record"), find(SIGNED)) {
        out.push((
            "cpu_per_batch_log_signed_vs_log_on".to_owned(),
            ratio(signed.server_cpu(), unsigned.server_cpu()),
        ));
    }
    out
}
