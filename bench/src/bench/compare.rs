//! This build against another build of guardmesh, in one run:
//! `guardmesh bench --only compare --baseline OLD_GUARDMESH`.
//!
//! Comparing two full runs, one per build, compares two moments of a
//! machine whose latency moves between modes from run to run; comparing
//! the builds' scenarios interleaved round by round in one group measures
//! both in the same moments. The group:
//!
//! | scenario | process |
//! |---|---|
//! | `mesh_4` | this build's `serve`, four zero-latency guards |
//! | `baseline_mesh_4` | the baseline's `serve`, the same config |
//! | `relay_floor_4` | the relay floor (this build): the hops alone |
//! | `no_guard` | this build's `serve`, no guard |
//! | `baseline_no_guard` | the baseline's, no guard |
//! | `policy20` | this build's `serve`, the 20-rule policy guard |
//! | `baseline_policy20` | the baseline's, the same policy |
//! | `session_on` | this build's `serve`, the relaybleed flow rules reading one long session's memory (R34) |
//! | `baseline_session_on` | the baseline's, the same |
//! | `session_on_redis` | this build's `serve`, the same with the memory in a `redis-server` on loopback (skipped without one) |
//! | `baseline_session_on_redis` | the baseline's, the same Redis |
//!
//! The session scenarios give a change to session memory (its reads,
//! writes and the serialization of a session's batches) its before and
//! after in one run; a baseline older than session memory cannot read
//! their rules, and they are skipped, naming why.
//!
//! Then throughput: this build's `mesh_4`, the baseline's and the relay
//! floor, each a fresh process, `--in-flight` batches at a time (each on a
//! session of its own, as the full run's throughput load), their windows
//! interleaved: `throughput_mesh4_vs_baseline` and
//! `cpu_per_batch_mesh4_vs_baseline`, and the full run's two tripwire
//! figures for both builds (`throughput_mesh4_vs_relay_floor4`,
//! `throughput_baseline_mesh4_vs_relay_floor4`, and the same for
//! `cpu_per_batch_`).
//!
//! Its ratios name the build: `mesh4_vs_baseline_p50` is this build's p50
//! over the baseline's; `mesh4_vs_relay_floor4_p50` and
//! `baseline_mesh4_vs_relay_floor4_p50` are each build against the same
//! floor, measured side by side. The baseline must read the config this
//! build writes for these scenarios (`listen`, `[[guard]]` with `endpoint`
//! or `policy`), which every release since policy guards does.

use super::report::{Latency, Throughput};
use super::{
    Error, GuardProcess, LoadRun, MeshProcess, Op, Plan, Scenario, Work, ZERO, policy, run_group,
    run_windows,
};
use std::path::Path;
use std::sync::Arc;

/// The scenarios' names, in the order they are listed.
pub(super) const MESH4: &str = "mesh_4";
pub(super) const BASELINE_MESH4: &str = "baseline_mesh_4";
pub(super) const RELAY4: &str = "relay_floor_4";
pub(super) const NO_GUARD: &str = "no_guard";
pub(super) const BASELINE_NO_GUARD: &str = "baseline_no_guard";
pub(super) const POLICY20: &str = "policy20";
pub(super) const BASELINE_POLICY20: &str = "baseline_policy20";
pub(super) const SESSION_ON: &str = "session_on";
pub(super) const BASELINE_SESSION_ON: &str = "baseline_session_on";
pub(super) const SESSION_ON_REDIS: &str = "session_on_redis";
pub(super) const BASELINE_SESSION_ON_REDIS: &str = "baseline_session_on_redis";

/// The relaybleed rules both builds read: without the rules on
/// `session.values_lost` (newer than some baselines, which would fail the
/// guard on them), none of which the benchmark's batch reaches anyway.
fn rules_both_read(rules: &str) -> String {
    rules
        .split("[[rule]]")
        .enumerate()
        .filter(|(i, rule)| *i == 0 || !rule.contains("values_lost"))
        .map(|(i, rule)| {
            if i == 0 {
                rule.to_owned()
            } else {
                format!("[[rule]]{rule}")
            }
        })
        .collect()
}

/// A session secret for meshes sharing a store: 32 bytes no caller knows,
/// readable by its owner only.
fn write_secret(dir: &Path) -> Result<std::path::PathBuf, Error> {
    use std::hash::BuildHasher;
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("session.secret");
    let bytes: Vec<u8> = (0..4u64)
        .flat_map(|i| std::hash::RandomState::new().hash_one(i).to_le_bytes())
        .collect();
    std::fs::write(&path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("cannot restrict {}: {e}", path.display()))?;
    Ok(path)
}

/// What the group measured.
pub(super) struct Figures {
    /// Every scenario's latency, one batch in flight.
    pub latency: Vec<Latency>,
    /// Closed-loop throughput and CPU per batch of this build's `mesh_4`,
    /// the baseline's and the relay floor, windows interleaved.
    pub throughput: Vec<Throughput>,
}

/// A scenario of the latency group: its name, what it is, and its mesh.
type Started = (&'static str, &'static str, MeshProcess);

/// The baseline's scenario `baseline` and this build's `this`, both with
/// config `sections`; none, said loudly, when the baseline cannot run it
/// (a build older than a feature the scenario uses: its config refused).
async fn pair_or_skip(
    exe: &Path,
    baseline: &Path,
    dir: &Path,
    this: (&'static str, &'static str),
    other: (&'static str, &'static str),
    sections: &str,
) -> Result<Option<[Started; 2]>, Error> {
    let theirs = match MeshProcess::start_config(baseline, dir, other.0, sections, 1, None).await {
        Ok(mesh) => mesh,
        Err(error) => {
            eprintln!(
                "[bench] {} and {} skipped: the baseline cannot run them: {error}",
                this.0, other.0
            );
            return Ok(None);
        }
    };
    let ours = MeshProcess::start_config(exe, dir, this.0, sections, 1, None).await?;
    Ok(Some([(this.0, this.1, ours), (other.0, other.1, theirs)]))
}

/// Runs the group: this build's and the baseline's meshes, interleaved
/// round by round (latency), then window by window (throughput, `in_flight`
/// batches at a time).
pub(super) async fn run(
    exe: &Path,
    baseline: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    work: &Arc<Work>,
    plan: &Plan,
    in_flight: usize,
) -> Result<Figures, Error> {
    if !baseline.is_file() {
        return Err(format!(
            "--baseline {}: not a file (the guardmesh executable to compare against)",
            baseline.display()
        )
        .into());
    }
    let (rules, _, _) = policy::write(dir)?;
    let policy_section = policy::guard_section("policy20", &rules);
    let zero = MeshProcess::guard_sections(guards, &ZERO)?;
    let flows = dir.join("relaybleed.toml");
    std::fs::write(&flows, rules_both_read(super::sessions::RELAYBLEED))
        .map_err(|e| format!("cannot write {}: {e}", flows.display()))?;
    let flows_section = format!(
        "\n[[guard]]\nname = \"flows\"\npolicy = {:?}\n",
        flows.display().to_string()
    );
    let redis = super::sessions::StoreServer::redis(dir).await?;
    if redis.is_none() {
        eprintln!(
            "no `redis-server` on PATH: {SESSION_ON_REDIS} and {BASELINE_SESSION_ON_REDIS} are skipped"
        );
    }
    let mut started: Vec<Started> = vec![
        (
            MESH4,
            "this build, 4 zero-latency guards",
            MeshProcess::start_config(exe, dir, MESH4, &zero, ZERO.len(), None).await?,
        ),
        (
            BASELINE_MESH4,
            "the baseline build, 4 zero-latency guards",
            MeshProcess::start_config(baseline, dir, BASELINE_MESH4, &zero, ZERO.len(), None)
                .await?,
        ),
        (
            RELAY4,
            "the relay floor: the hops to 4 zero-latency guards",
            MeshProcess::start_relay(exe, dir, RELAY4, guards, &ZERO, None).await?,
        ),
        (
            NO_GUARD,
            "this build, no guard",
            MeshProcess::start_config(exe, dir, NO_GUARD, "", 0, None).await?,
        ),
        (
            BASELINE_NO_GUARD,
            "the baseline build, no guard",
            MeshProcess::start_config(baseline, dir, BASELINE_NO_GUARD, "", 0, None).await?,
        ),
        (
            POLICY20,
            "this build, one policy guard of 20 rules",
            MeshProcess::start_config(exe, dir, POLICY20, &policy_section, 1, None).await?,
        ),
        (
            BASELINE_POLICY20,
            "the baseline build, one policy guard of 20 rules",
            MeshProcess::start_config(baseline, dir, BASELINE_POLICY20, &policy_section, 1, None)
                .await?,
        ),
    ];
    started.extend(
        pair_or_skip(
            exe,
            baseline,
            dir,
            (
                SESSION_ON,
                "this build, the relaybleed rules on one session's memory",
            ),
            (
                BASELINE_SESSION_ON,
                "the baseline build, the relaybleed rules on one session's memory",
            ),
            &flows_section,
        )
        .await?
        .into_iter()
        .flatten(),
    );
    if let Some(redis) = &redis {
        let secret = write_secret(dir)?;
        // `[sessions]` first: the guard's table follows it.
        let section = format!(
            "\n[sessions]\nstore = \"redis\"\nredis_url = {:?}\nsecret_file = {:?}\n{flows_section}",
            redis.url,
            secret.display().to_string()
        );
        started.extend(
            pair_or_skip(
                exe,
                baseline,
                dir,
                (
                    SESSION_ON_REDIS,
                    "this build, the relaybleed rules, the memory in Redis",
                ),
                (
                    BASELINE_SESSION_ON_REDIS,
                    "the baseline build, the relaybleed rules, the memory in Redis",
                ),
                &section,
            )
            .await?
            .into_iter()
            .flatten(),
        );
    }
    let mut scenarios = Vec::with_capacity(started.len());
    for (name, what, mesh) in &started {
        scenarios.push(Scenario::new(
            name,
            what,
            Op::Mesh(mesh.session(name).await?),
            false,
            Some(mesh),
            plan.fast,
        )?);
    }
    let mut meshes: Vec<MeshProcess> = started.into_iter().map(|(_, _, mesh)| mesh).collect();
    let mut refs: Vec<&mut MeshProcess> = meshes.iter_mut().collect();
    let latency = run_group(
        "this build against the baseline",
        &mut scenarios,
        plan.rounds,
        work,
        guards,
        &mut refs,
    )
    .await?;
    drop(scenarios);
    drop(meshes);
    let throughput = throughput(exe, baseline, dir, guards, work, plan, in_flight).await?;
    Ok(Figures {
        latency,
        throughput,
    })
}

/// Closed-loop throughput of this build's `mesh_4`, the baseline's and the
/// relay floor, each a fresh process, their windows interleaved: the CPU
/// per batch and batches per second of both builds in the same moments.
async fn throughput(
    exe: &Path,
    baseline: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    work: &Arc<Work>,
    plan: &Plan,
    in_flight: usize,
) -> Result<Vec<Throughput>, Error> {
    eprintln!("[bench] throughput: {MESH4}, {BASELINE_MESH4}, {RELAY4}; {in_flight} in flight");
    let zero = MeshProcess::guard_sections(guards, &ZERO)?;
    let label = |name: &str| format!("throughput_{name}");
    let ours = MeshProcess::start_config(exe, dir, &label(MESH4), &zero, ZERO.len(), None).await?;
    let theirs = MeshProcess::start_config(
        baseline,
        dir,
        &label(BASELINE_MESH4),
        &zero,
        ZERO.len(),
        None,
    )
    .await?;
    let relay = MeshProcess::start_relay(exe, dir, &label(RELAY4), guards, &ZERO, None).await?;
    let mut runs = vec![
        LoadRun::on_mesh(
            MESH4.into(),
            "batches through this build, 4 zero-latency guards".into(),
            ours,
            in_flight,
        )
        .await?,
        LoadRun::on_mesh(
            BASELINE_MESH4.into(),
            "batches through the baseline build, 4 zero-latency guards".into(),
            theirs,
            in_flight,
        )
        .await?,
        LoadRun::on_mesh(
            RELAY4.into(),
            "batches through the relay floor: the hops, none of the work".into(),
            relay,
            in_flight,
        )
        .await?,
    ];
    run_windows(&mut runs, guards, work, plan).await?;
    Ok(runs.into_iter().map(LoadRun::figures).collect())
}

/// The group's ratios; none for a scenario the run does not have.
pub(super) fn ratios(latency: &[Latency], throughput: &[Throughput]) -> Vec<(String, f64)> {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let find = |name: &str| latency.iter().find(|l| l.name == name);
    let mut out = Vec::new();
    let load = |name: &str| throughput.iter().find(|t| t.name == name);
    let mut loads = |key: &str, a: &str, b: &str| {
        let (Some(a), Some(b)) = (load(a), load(b)) else {
            return;
        };
        out.push((
            format!("throughput_{key}"),
            ratio(a.per_second, b.per_second),
        ));
        out.push((
            format!("cpu_per_batch_{key}"),
            ratio(a.server_cpu(), b.server_cpu()),
        ));
    };
    loads("mesh4_vs_baseline", MESH4, BASELINE_MESH4);
    // The figures of a full run, named as there, for this build and the
    // baseline against the same floor.
    loads("mesh4_vs_relay_floor4", MESH4, RELAY4);
    loads("baseline_mesh4_vs_relay_floor4", BASELINE_MESH4, RELAY4);
    let mut pair = |key: &str, a: &str, b: &str| {
        let (Some(a), Some(b)) = (find(a), find(b)) else {
            return;
        };
        out.push((format!("{key}_p50"), ratio(a.p50, b.p50)));
        out.push((format!("{key}_p99"), ratio(a.p99, b.p99)));
        if let (Some(a_cpu), Some(b_cpu)) = (a.cpu.mesh, b.cpu.mesh) {
            out.push((format!("{key}_mesh_cpu"), ratio(a_cpu, b_cpu)));
        }
    };
    pair("mesh4_vs_baseline", MESH4, BASELINE_MESH4);
    pair("no_guard_vs_baseline", NO_GUARD, BASELINE_NO_GUARD);
    pair("policy20_vs_baseline", POLICY20, BASELINE_POLICY20);
    pair("session_on_vs_baseline", SESSION_ON, BASELINE_SESSION_ON);
    pair(
        "session_on_redis_vs_baseline",
        SESSION_ON_REDIS,
        BASELINE_SESSION_ON_REDIS,
    );
    pair("mesh4_vs_relay_floor4", MESH4, RELAY4);
    pair("baseline_mesh4_vs_relay_floor4", BASELINE_MESH4, RELAY4);
    pair("policy20_vs_no_guard", POLICY20, NO_GUARD);
    pair(
        "baseline_policy20_vs_no_guard",
        BASELINE_POLICY20,
        BASELINE_NO_GUARD,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules both builds read keep every rule but those on
    /// `session.values_lost`, each whole.
    #[test]
    fn the_compared_flow_rules_leave_out_only_the_newer_field() {
        let rules = rules_both_read(crate::bench::sessions::RELAYBLEED);
        assert!(!rules.contains("values_lost"), "{rules}");
        let all = crate::bench::sessions::RELAYBLEED
            .matches("[[rule]]")
            .count();
        assert_eq!(rules.matches("[[rule]]").count(), all - 1, "{rules}");
        assert!(
            rules.contains("at-most-3-emails-an-hour") && rules.contains("fs-values-stay-on-fs")
        );
    }
    use crate::bench::report::{Cpu, histogram};

    /// The ratio named `key`; a test fails naming it when it is missing.
    fn ratio_of(ratios: &[(String, f64)], key: &str) -> f64 {
        ratios
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("no {key} in {ratios:?}"))
    }

    fn latency(name: &'static str, p50_us: u64) -> Latency {
        let mut h = histogram().expect("histogram");
        for _ in 0..100 {
            h.record(p50_us * 1000).expect("record");
        }
        Latency::new(name, "", &h, Cpu::default(), false)
    }

    #[test]
    fn each_build_is_compared_with_the_other_and_with_the_same_floor() {
        let figures = [
            latency(MESH4, 120),
            latency(BASELINE_MESH4, 150),
            latency(RELAY4, 100),
        ];
        let ratios = ratios(&figures, &[]);
        let get = |k: &str| ratio_of(&ratios, k);
        assert!((get("mesh4_vs_baseline_p50") - 0.8).abs() < 0.02);
        assert!((get("mesh4_vs_relay_floor4_p50") - 1.2).abs() < 0.02);
        assert!((get("baseline_mesh4_vs_relay_floor4_p50") - 1.5).abs() < 0.02);
        // No policy scenarios in this run: no policy ratios, rather than NaN.
        assert!(!ratios.iter().any(|(k, _)| k.starts_with("policy20")));
        // No throughput figures: no throughput or CPU ratios.
        assert!(
            !ratios
                .iter()
                .any(|(k, _)| k.starts_with("throughput") || k.starts_with("cpu_per_batch"))
        );
    }

    /// A throughput run of `ops` batches in one second, the serving
    /// process using `cpu_ms` of CPU.
    fn load(name: &'static str, ops: u64, cpu_ms: u64) -> Throughput {
        let mut h = histogram().expect("histogram");
        for _ in 0..ops {
            h.record(1_000_000).expect("record");
        }
        let cpu = Cpu {
            mesh: std::time::Duration::from_millis(cpu_ms),
            ..Cpu::default()
        };
        Throughput::new(
            name.into(),
            String::new(),
            &h,
            std::time::Duration::from_secs(1),
            cpu,
            true,
        )
    }

    /// The figures for both builds against the floor of the same
    /// windows, and this build against the baseline, each named for what
    /// it divides.
    #[test]
    fn both_builds_throughput_and_cpu_are_read_against_the_same_floor() {
        let loads = [
            load(MESH4, 800, 400),
            load(BASELINE_MESH4, 1000, 360),
            load(RELAY4, 1000, 300),
        ];
        let ratios = ratios(&[], &loads);
        let get = |k: &str| ratio_of(&ratios, k);
        // Per second: 800 against 1000.
        assert!((get("throughput_mesh4_vs_baseline") - 0.8).abs() < 0.01);
        assert!((get("throughput_mesh4_vs_relay_floor4") - 0.8).abs() < 0.01);
        assert!((get("throughput_baseline_mesh4_vs_relay_floor4") - 1.0).abs() < 0.01);
        // Per batch: 500 µs, 360 µs and 300 µs of CPU.
        assert!((get("cpu_per_batch_mesh4_vs_baseline") - 500.0 / 360.0).abs() < 0.01);
        assert!((get("cpu_per_batch_mesh4_vs_relay_floor4") - 500.0 / 300.0).abs() < 0.01);
        assert!((get("cpu_per_batch_baseline_mesh4_vs_relay_floor4") - 1.2).abs() < 0.01);
        // No latency scenarios: no latency ratios.
        assert!(!ratios.iter().any(|(k, _)| k.ends_with("_p50")));
    }
}
