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
//! after in one run.
//!
//! Its ratios name the build: `mesh4_vs_baseline_p50` is this build's p50
//! over the baseline's; `mesh4_vs_relay_floor4_p50` and
//! `baseline_mesh4_vs_relay_floor4_p50` are each build against the same
//! floor, measured side by side. The baseline must read the config this
//! build writes for these scenarios (`listen`, `[[guard]]` with `endpoint`
//! or `policy`), which every release since policy guards does.

use super::report::Latency;
use super::{Error, GuardProcess, MeshProcess, Op, Plan, Scenario, Work, ZERO, policy, run_group};
use std::path::Path;

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

/// Runs the group: this build's and the baseline's meshes, interleaved.
pub(super) async fn run(
    exe: &Path,
    baseline: &Path,
    dir: &Path,
    guards: &mut GuardProcess,
    work: &Work,
    plan: &Plan,
) -> Result<Vec<Latency>, Error> {
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
    let mut meshes = vec![
        MeshProcess::start_config(exe, dir, MESH4, &zero, ZERO.len(), None).await?,
        MeshProcess::start_config(baseline, dir, BASELINE_MESH4, &zero, ZERO.len(), None).await?,
        MeshProcess::start_relay(exe, dir, RELAY4, guards, &ZERO, None).await?,
        MeshProcess::start_config(exe, dir, NO_GUARD, "", 0, None).await?,
        MeshProcess::start_config(baseline, dir, BASELINE_NO_GUARD, "", 0, None).await?,
        MeshProcess::start_config(exe, dir, POLICY20, &policy_section, 1, None).await?,
        MeshProcess::start_config(baseline, dir, BASELINE_POLICY20, &policy_section, 1, None)
            .await?,
        MeshProcess::start_config(exe, dir, SESSION_ON, &flows_section, 1, None).await?,
        MeshProcess::start_config(baseline, dir, BASELINE_SESSION_ON, &flows_section, 1, None)
            .await?,
    ];
    if let Some(redis) = &redis {
        let secret = write_secret(dir)?;
        // `[sessions]` first: the guard's table follows it.
        let section = format!(
            "\n[sessions]\nstore = \"redis\"\nredis_url = {:?}\nsecret_file = {:?}\n{flows_section}",
            redis.url,
            secret.display().to_string()
        );
        meshes
            .push(MeshProcess::start_config(exe, dir, SESSION_ON_REDIS, &section, 1, None).await?);
        meshes.push(
            MeshProcess::start_config(baseline, dir, BASELINE_SESSION_ON_REDIS, &section, 1, None)
                .await?,
        );
    }
    let described: [(&'static str, &'static str); 11] = [
        (MESH4, "this build, 4 zero-latency guards"),
        (BASELINE_MESH4, "the baseline build, 4 zero-latency guards"),
        (RELAY4, "the relay floor: the hops to 4 zero-latency guards"),
        (NO_GUARD, "this build, no guard"),
        (BASELINE_NO_GUARD, "the baseline build, no guard"),
        (POLICY20, "this build, one policy guard of 20 rules"),
        (
            BASELINE_POLICY20,
            "the baseline build, one policy guard of 20 rules",
        ),
        (
            SESSION_ON,
            "this build, the relaybleed rules on one session's memory",
        ),
        (
            BASELINE_SESSION_ON,
            "the baseline build, the relaybleed rules on one session's memory",
        ),
        (
            SESSION_ON_REDIS,
            "this build, the relaybleed rules, the memory in Redis",
        ),
        (
            BASELINE_SESSION_ON_REDIS,
            "the baseline build, the relaybleed rules, the memory in Redis",
        ),
    ];
    let mut scenarios = Vec::with_capacity(described.len());
    for ((name, what), mesh) in described.into_iter().zip(&meshes) {
        scenarios.push(Scenario::new(
            name,
            what,
            Op::Mesh(mesh.session(name).await?),
            false,
            Some(mesh),
            plan.fast,
        )?);
    }
    let mut refs: Vec<&mut MeshProcess> = meshes.iter_mut().collect();
    run_group(
        "this build against the baseline",
        &mut scenarios,
        plan.rounds,
        work,
        guards,
        &mut refs,
    )
    .await
}

/// The group's ratios; none for a scenario the run does not have.
pub(super) fn ratios(latency: &[Latency]) -> Vec<(String, f64)> {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let find = |name: &str| latency.iter().find(|l| l.name == name);
    let mut out = Vec::new();
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
        let ratios = ratios(&figures);
        let get = |k: &str| {
            ratios
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("no {k} in {ratios:?}"))
        };
        assert!((get("mesh4_vs_baseline_p50") - 0.8).abs() < 0.02);
        assert!((get("mesh4_vs_relay_floor4_p50") - 1.2).abs() < 0.02);
        assert!((get("baseline_mesh4_vs_relay_floor4_p50") - 1.5).abs() < 0.02);
        // No policy scenarios in this run: no policy ratios, rather than NaN.
        assert!(!ratios.iter().any(|(k, _)| k.starts_with("policy20")));
    }
}
