//! The benchmark's child processes, and what `/proc` says about them.
//!
//! Every child is wrapped in a [`Child`] that kills (SIGKILL) and reaps it
//! when dropped, so a benchmark that ends, fails or panics leaves nothing
//! behind. On Linux each child also gets a parent-death signal, so that even
//! a benchmark killed with SIGKILL takes its children with it.

use super::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::time::Duration;
use tokio::sync::mpsc;

/// A child process, killed and reaped on drop.
pub(super) struct Child {
    what: String,
    child: std::process::Child,
    log: Option<PathBuf>,
    /// Held open so that the child sees EOF on stdin when this drops.
    stdin: Option<ChildStdin>,
}

impl Child {
    /// Starts `command`. Its stderr goes to `log` when given (and is shown
    /// in errors), its stdout is returned line by line when `lines` is set.
    pub(super) fn spawn(
        what: impl Into<String>,
        mut command: Command,
        log: Option<PathBuf>,
        lines: Option<mpsc::UnboundedSender<String>>,
    ) -> Result<Self, Error> {
        let what = what.into();
        die_with_parent(&mut command);
        super::placement::pin_child(&mut command);
        command.stdin(Stdio::piped());
        command.stdout(if lines.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        match &log {
            Some(path) => {
                let file = std::fs::File::create(path)
                    .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
                command.stderr(file);
            }
            None => {
                command.stderr(Stdio::inherit());
            }
        }
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {what}: {e}"))?;
        if let (Some(tx), Some(stdout)) = (lines, child.stdout.take()) {
            std::thread::Builder::new()
                .name(format!("bench-stdout-{}", child.id()))
                .spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        match line {
                            Ok(line) => {
                                if tx.send(line).is_err() {
                                    break;
                                }
                            }
                            Err(_) => break,
                        }
                    }
                })
                .map_err(|e| format!("cannot read the output of {what}: {e}"))?;
        }
        let stdin = child.stdin.take();
        Ok(Self {
            what,
            child,
            log,
            stdin,
        })
    }

    /// Writes `line` to the child's stdin (a request of the benchmark's
    /// own protocol with it).
    pub(super) fn send_line(&mut self, line: &str) -> Result<(), Error> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| format!("{} has no stdin", self.what))?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("cannot write to {}: {e}", self.what).into())
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// An error if the process has exited, naming how and showing the end
    /// of its log.
    pub(super) fn check_alive(&mut self) -> Result<(), Error> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                Err(format!("{} exited ({status}){}", self.what, self.log_tail()).into())
            }
            Err(error) => Err(format!("{}: cannot check its state: {error}", self.what).into()),
        }
    }

    /// The last lines of the child's log, prefixed for an error message.
    pub(super) fn log_tail(&self) -> String {
        let Some(path) = &self.log else {
            return String::new();
        };
        let mut text = String::new();
        if std::fs::File::open(path)
            .and_then(|mut f| f.read_to_string(&mut text))
            .is_err()
        {
            return String::new();
        }
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(12)..].join("\n    ");
        if tail.is_empty() {
            String::new()
        } else {
            format!("; the end of its log ({}):\n    {tail}", path.display())
        }
    }

    /// Resident set size, in bytes.
    pub(super) fn rss(&self) -> Result<u64, Error> {
        rss_bytes(self.pid())
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid(), prctl(2) and getppid() are async-signal-safe, and the
    // closure touches no memory shared with the parent; it runs in the forked
    // child just before exec, as `pre_exec` requires.
    let parent = unsafe { libc::getpid() };
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then nobody would
            // ever send the signal.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the benchmark exited"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

/// Clock ticks per second of `/proc/<pid>/stat` times.
fn clock_ticks() -> u64 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if ticks > 0 {
            return ticks as u64;
        }
    }
    100
}

/// User + system CPU time of process `pid`, all its threads, from
/// `/proc/<pid>/stat` (the kernel's own accounting, in clock ticks).
pub(super) fn cpu_time(pid: u32) -> Result<Duration, Error> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    // The command name (field 2) may hold spaces and parentheses: the fields
    // we need come after its last ')'. There, index 0 is field 3 (state),
    // utime is field 14 and stime field 15.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| format!("{path}: unexpected format"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> Result<u64, Error> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| format!("{path}: unexpected format").into())
    };
    let ticks = field(11)? + field(12)?;
    Ok(Duration::from_nanos(
        ticks.saturating_mul(1_000_000_000) / clock_ticks(),
    ))
}

/// Resident set size of process `pid` in bytes (`VmRSS` of
/// `/proc/<pid>/status`).
pub(super) fn rss_bytes(pid: u32) -> Result<u64, Error> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| format!("{path}: no VmRSS line").into())
}

/// A temporary folder, removed with its contents on drop.
pub(super) struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub(super) fn new(prefix: &str) -> Result<Self, Error> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(Self { path })
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
