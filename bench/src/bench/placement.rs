//! Where the benchmark's processes run (`--placement`).
//!
//! On small VMs a batch's round trip on loopback is bimodal with where the
//! scheduler puts its two ends: when the coordinator and the mesh share a
//! virtual CPU they hand off without waking one, when they do not, each
//! hand-off wakes a halted one. Unpinned (`os`), which mode a scenario
//! lands in is the scheduler's choice, and it can differ between the two
//! sides of a ratio. `split` and `one` fix it for every scenario of a run:
//!
//! * `os`: no pinning (as `guardmesh bench` always ran);
//! * `split`: the load generator (this process, and every thread it starts)
//!   on the first CPU it may use, every child (meshes, guards, relay, MCP
//!   gateways) on the others: the coordinator apart from what it calls;
//! * `one`: everything on the first CPU (as `taskset -c N guardmesh bench`).

use super::Error;

/// `--placement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Placement {
    /// No pinning: wherever the scheduler puts each process.
    #[default]
    Os,
    /// The load generator on the first allowed CPU, its children on the rest.
    Split,
    /// Everything on the first allowed CPU.
    One,
}

/// The CPUs of each side; `None`: not pinned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Pinning {
    pub load: Option<Vec<usize>>,
    pub children: Option<Vec<usize>>,
}

impl Placement {
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Os => "os",
            Self::Split => "split",
            Self::One => "one",
        }
    }

    /// The pinning of this placement given the CPUs this process may use
    /// (ascending).
    pub(super) fn pinning(self, allowed: &[usize]) -> Result<Pinning, Error> {
        let first = || {
            allowed
                .first()
                .copied()
                .ok_or("this process may use no CPU (sched_getaffinity)")
        };
        match self {
            Self::Os => Ok(Pinning::default()),
            Self::One => Ok(Pinning {
                load: Some(vec![first()?]),
                children: Some(vec![first()?]),
            }),
            Self::Split => {
                if allowed.len() < 2 {
                    return Err(format!(
                        "--placement split needs two CPUs, and this process may use {} ({allowed:?}); \
                         use --placement one or os",
                        allowed.len()
                    )
                    .into());
                }
                Ok(Pinning {
                    load: Some(vec![first()?]),
                    children: Some(allowed[1..].to_vec()),
                })
            }
        }
    }
}

/// The CPUs children are pinned to, once [`apply`] set them.
static CHILDREN: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// Pins the calling thread (before the runtime starts, so every thread it
/// starts inherits it) and records the children's CPUs for
/// [`pin_child`]. Returns the pinning applied.
pub(super) fn apply(placement: Placement) -> Result<Pinning, Error> {
    if placement == Placement::Os {
        return Ok(Pinning::default());
    }
    let pinning = placement.pinning(&allowed_cpus()?)?;
    if let Some(load) = &pinning.load {
        set_affinity(load)?;
    }
    if let Some(children) = &pinning.children {
        let _ = CHILDREN.set(children.clone());
    }
    Ok(pinning)
}

#[cfg(target_os = "linux")]
fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: CPU_SET bounds-checks `cpu` against the set's size.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    set
}

/// The CPUs this process may use, ascending.
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Result<Vec<usize>, Error> {
    // SAFETY: as in `cpu_set`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(format!("sched_getaffinity: {}", std::io::Error::last_os_error()).into());
    }
    let size = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    // SAFETY: CPU_ISSET reads within the set for cpu < CPU_SETSIZE.
    Ok((0..size)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

#[cfg(target_os = "linux")]
fn set_affinity(cpus: &[usize]) -> Result<(), Error> {
    let set = cpu_set(cpus);
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(format!(
            "cannot pin the benchmark to CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        )
        .into());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Result<Vec<usize>, Error> {
    Err("--placement split and one need Linux (sched_setaffinity)".into())
}

#[cfg(not(target_os = "linux"))]
fn set_affinity(_cpus: &[usize]) -> Result<(), Error> {
    Err("--placement split and one need Linux (sched_setaffinity)".into())
}

/// Pins a child started by `command` to the children's CPUs, if set.
pub(super) fn pin_child(command: &mut std::process::Command) {
    if let Some(cpus) = CHILDREN.get() {
        pin_to(command, cpus);
    }
}

/// Pins the process `command` starts to `cpus`, from its start.
fn pin_to(command: &mut std::process::Command, cpus: &[usize]) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let set = cpu_set(cpus);
        // SAFETY: sched_setaffinity(2) is a plain system call and the
        // closure only reads its own copy of `set`; it runs in the forked
        // child just before exec, as `pre_exec` requires.
        unsafe {
            command.pre_exec(move || {
                if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (command, cpus);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_puts_the_load_generator_alone_on_the_first_cpu() {
        let pinning = Placement::Split.pinning(&[2, 3, 5]).expect("three CPUs");
        assert_eq!(pinning.load, Some(vec![2]));
        assert_eq!(pinning.children, Some(vec![3, 5]));
    }

    #[test]
    fn split_on_one_cpu_is_refused_with_what_to_use_instead() {
        let error = Placement::Split.pinning(&[0]).expect_err("one CPU");
        let text = error.to_string();
        assert!(text.contains("needs two CPUs"), "{text}");
        assert!(text.contains("--placement one"), "{text}");
    }

    #[test]
    fn one_pins_everything_to_the_first_cpu_and_os_pins_nothing() {
        let one = Placement::One.pinning(&[1, 4]).expect("two CPUs");
        assert_eq!(one.load, Some(vec![1]));
        assert_eq!(one.children, Some(vec![1]));
        assert_eq!(
            Placement::Os.pinning(&[0, 1]).expect("os"),
            Pinning::default()
        );
        assert!(Placement::One.pinning(&[]).is_err());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_pinned_child_may_run_only_on_its_cpus() {
        let allowed = allowed_cpus().expect("sched_getaffinity");
        if allowed.len() < 2 {
            // One CPU: a child inherits it whether pinned or not, so this
            // machine cannot tell (CI machines have two).
            eprintln!("skipped: one CPU ({allowed:?})");
            return;
        }
        let last = *allowed.last().expect("two CPUs");
        let mut command = std::process::Command::new("cat");
        command.arg("/proc/self/status");
        pin_to(&mut command, &[last]);
        let output = command.output().expect("cat runs");
        let status = String::from_utf8_lossy(&output.stdout);
        let line = status
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))
            .expect("Linux shows the allowed CPUs");
        assert_eq!(
            line.split_whitespace().nth(1),
            Some(last.to_string().as_str()),
            "{line}"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_may_use_at_least_one_cpu() {
        let allowed = allowed_cpus().expect("sched_getaffinity");
        assert!(!allowed.is_empty());
        assert!(allowed.windows(2).all(|w| w[0] < w[1]), "{allowed:?}");
    }
}
