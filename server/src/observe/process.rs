//! The standard `process_*` metrics (CPU seconds, memory, file
//! descriptors, start time), read from `/proc` at each scrape. Where there
//! is no `/proc` (not Linux), none are written.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Writes the `process_*` metrics of this process.
#[derive(Debug)]
pub(crate) struct ProcessCollector;

/// One reading of this process.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProcessStats {
    pub(crate) cpu_seconds: f64,
    pub(crate) resident_bytes: f64,
    pub(crate) virtual_bytes: f64,
    pub(crate) start_time_seconds: f64,
    pub(crate) open_fds: Option<f64>,
    pub(crate) max_fds: Option<f64>,
}

/// Reads `/proc/self/stat` (after the command name, which may hold spaces
/// and parentheses): user and system ticks, start ticks since boot,
/// virtual size, resident pages.
fn parse_stat(stat: &str) -> Option<(u64, u64, u64, u64, u64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    // Fields from the third (state) on; utime is the 14th field overall.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)?, field(15)?, field(22)?, field(23)?, field(24)?))
}

/// The boot time in seconds since the epoch, from `/proc/stat`.
fn parse_btime(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft limit of open files, from `/proc/self/limits`.
fn parse_max_fds(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .next()?;
    soft.parse::<f64>().ok()
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf reads a system constant; it has no preconditions.
    let value = unsafe { libc::sysconf(name) };
    u64::try_from(value).ok().filter(|v| *v > 0)
}

/// Reads this process's figures; `None` without `/proc`.
pub(crate) fn read() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (utime, stime, start, vsize, rss) = parse_stat(&stat)?;
    let ticks = sysconf(libc::_SC_CLK_TCK)? as f64;
    let page = sysconf(libc::_SC_PAGESIZE)? as f64;
    let btime = parse_btime(&std::fs::read_to_string("/proc/stat").ok()?)? as f64;
    Some(ProcessStats {
        cpu_seconds: (utime + stime) as f64 / ticks,
        resident_bytes: rss as f64 * page,
        virtual_bytes: vsize as f64,
        start_time_seconds: btime + start as f64 / ticks,
        open_fds: std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|dir| dir.count() as f64),
        max_fds: std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| parse_max_fds(&l)),
    })
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let gauge = ConstGauge::new(value);
    let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
    gauge.encode(metric)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(stats) = read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(stats.cpu_seconds);
        let metric = encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?;
        cpu.encode(metric)?;
        gauge(
            &mut encoder,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            stats.resident_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            stats.virtual_bytes,
        )?;
        gauge(
            &mut encoder,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            stats.start_time_seconds,
        )?;
        if let Some(open) = stats.open_fds {
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors",
                open,
            )?;
        }
        if let Some(max) = stats.max_fds {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors",
                max,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 110 220 13 14 15 16 17 18 \
                    5000 123456 789 rest";
        assert_eq!(parse_stat(stat), Some((110, 220, 5000, 123456, 789)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn boot_time_and_the_open_file_limit_are_read() {
        assert_eq!(
            parse_btime("cpu 1 2\nbtime 1700000000\n"),
            Some(1_700_000_000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(parse_max_fds(limits), Some(1024.0));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_read() {
        let stats = read().expect("/proc is readable");
        assert!(stats.resident_bytes > 0.0);
        assert!(stats.open_fds.is_some_and(|n| n >= 3.0));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(stats.start_time_seconds <= now + 1.0);
        assert!(stats.start_time_seconds > now - 86_400.0 * 365.0);
    }
}
