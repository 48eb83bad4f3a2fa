//! The benchmark's figures: latency summaries, throughput, memory, the
//! ratios the targets are stated in, the printed table and the JSON file.

use super::Error;
use hdrhistogram::Histogram;
use serde_json::{Map, Value, json};
use std::fmt::Write as _;
use std::time::Duration;

/// A latency histogram in nanoseconds, 3 significant figures, up to an hour.
pub(super) fn histogram() -> Result<Histogram<u64>, Error> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
        .map_err(|e| format!("histogram: {e}").into())
}

/// Records one latency.
pub(super) fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    histogram.saturating_record(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
}

fn us(nanos: u64) -> f64 {
    nanos as f64 / 1000.0
}

/// CPU time of the three parties, summed over the measured operations.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Cpu {
    /// The mesh process (zero for direct scenarios).
    pub mesh: Duration,
    /// The guard process (guards, direct baselines and echo).
    pub guards: Duration,
    /// This process: the load generator.
    pub client: Duration,
}

impl Cpu {
    pub(super) fn since(self, before: Cpu) -> Cpu {
        Cpu {
            mesh: self.mesh.saturating_sub(before.mesh),
            guards: self.guards.saturating_sub(before.guards),
            client: self.client.saturating_sub(before.client),
        }
    }

    pub(super) fn add(&mut self, other: Cpu) {
        self.mesh += other.mesh;
        self.guards += other.guards;
        self.client += other.client;
    }
}

/// CPU microseconds per operation.
#[derive(Debug, Clone, Copy)]
pub(super) struct CpuPerOp {
    pub mesh: Option<f64>,
    pub guards: f64,
    pub client: f64,
}

impl CpuPerOp {
    fn new(cpu: Cpu, ops: u64, has_mesh: bool) -> Self {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / ops.max(1) as f64;
        Self {
            mesh: has_mesh.then(|| per(cpu.mesh)),
            guards: per(cpu.guards),
            client: per(cpu.client),
        }
    }

    fn json(&self) -> Value {
        json!({ "mesh": self.mesh, "guards": self.guards, "client": self.client })
    }
}

/// One latency scenario, summarised.
#[derive(Debug, Clone)]
pub(super) struct Latency {
    pub name: &'static str,
    pub what: &'static str,
    pub n: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
    pub cpu: CpuPerOp,
}

impl Latency {
    pub(super) fn new(
        name: &'static str,
        what: &'static str,
        histogram: &Histogram<u64>,
        cpu: Cpu,
        has_mesh: bool,
    ) -> Self {
        let q = |q: f64| us(histogram.value_at_quantile(q));
        Self {
            name,
            what,
            n: histogram.len(),
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            p999: q(0.999),
            max: us(histogram.max()),
            mean: histogram.mean() / 1000.0,
            cpu: CpuPerOp::new(cpu, histogram.len(), has_mesh),
        }
    }

    fn json(&self) -> Value {
        json!({
            "what": self.what,
            "n": self.n,
            "p50_us": self.p50,
            "p90_us": self.p90,
            "p99_us": self.p99,
            "p999_us": self.p999,
            "max_us": self.max,
            "mean_us": self.mean,
            "cpu_us_per_op": self.cpu.json(),
        })
    }
}

/// One closed-loop throughput run (all its windows summed).
#[derive(Debug, Clone)]
pub(super) struct Throughput {
    pub name: String,
    pub what: String,
    pub ops: u64,
    pub seconds: f64,
    pub per_second: f64,
    pub p50: f64,
    pub p99: f64,
    /// For `mesh_4`, `mesh` is the mesh process; for `echo`, `guards` is the
    /// echo server (it lives in the guard process).
    pub cpu: CpuPerOp,
}

impl Throughput {
    pub(super) fn new(
        name: String,
        what: String,
        histogram: &Histogram<u64>,
        elapsed: Duration,
        cpu: Cpu,
        has_mesh: bool,
    ) -> Self {
        let ops = histogram.len();
        let seconds = elapsed.as_secs_f64();
        Self {
            name,
            what,
            ops,
            seconds,
            per_second: if seconds > 0.0 {
                ops as f64 / seconds
            } else {
                0.0
            },
            p50: us(histogram.value_at_quantile(0.5)),
            p99: us(histogram.value_at_quantile(0.99)),
            cpu: CpuPerOp::new(cpu, ops, has_mesh),
        }
    }

    /// CPU of the serving process per operation: the mesh for a mesh run,
    /// the echo server otherwise.
    pub(super) fn server_cpu(&self) -> f64 {
        self.cpu.mesh.unwrap_or(self.cpu.guards)
    }

    fn json(&self) -> Value {
        json!({
            "what": self.what,
            "ops": self.ops,
            "seconds": self.seconds,
            "per_second": self.per_second,
            "p50_us": self.p50,
            "p99_us": self.p99,
            "server_cpu_us_per_op": self.server_cpu(),
            "cpu_us_per_op": self.cpu.json(),
        })
    }
}

/// The mesh's memory with idle coordinator streams.
#[derive(Debug, Clone)]
pub(super) struct Memory {
    pub idle_bytes: u64,
    pub streams: usize,
    pub connections: usize,
    pub with_streams_bytes: u64,
}

impl Memory {
    /// No memory figures (a run of one group).
    pub(super) fn none() -> Memory {
        Memory {
            idle_bytes: 0,
            streams: 0,
            connections: 0,
            with_streams_bytes: 0,
        }
    }

    pub(super) fn mib(bytes: u64) -> f64 {
        bytes as f64 / (1024.0 * 1024.0)
    }

    fn kib_per_stream(&self) -> f64 {
        (self.with_streams_bytes as f64 - self.idle_bytes as f64)
            / 1024.0
            / self.streams.max(1) as f64
    }
}

/// How a figure is held to its target.
#[derive(Debug, Clone, Copy)]
pub(super) enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Bound {
    fn met(self, value: f64) -> bool {
        match self {
            Self::AtMost(limit) => value <= limit,
            Self::AtLeast(limit) => value >= limit,
        }
    }

    fn text(self) -> String {
        match self {
            Self::AtMost(limit) => format!("<= {limit}"),
            Self::AtLeast(limit) => format!(">= {limit}"),
        }
    }
}

/// The targets of the performance issues, by JSON key (the latest issue's
/// "target this issue" where it restates a key).
pub(super) const TARGETS: &[(&str, Bound)] = &[
    ("mesh4_vs_direct_p50", Bound::AtMost(1.5)),
    ("mesh4_vs_direct_parallel4_p50", Bound::AtMost(1.0)),
    ("mesh4_5ms_vs_direct_5ms_p50", Bound::AtMost(1.03)),
    ("parallel_vs_sequential_5ms_p50", Bound::AtMost(0.27)),
    ("early_veto_vs_1ms_p50", Bound::AtMost(1.2)),
    ("throughput_mesh4_vs_echo", Bound::AtLeast(0.6)),
    ("cpu_per_batch_mesh4_vs_echo_call", Bound::AtMost(1.6)),
    ("rss_mib_1000_streams", Bound::AtMost(34.0)),
    ("policy20_vs_no_guard_p50", Bound::AtMost(1.10)),
    ("cpu_per_batch_log_signed_vs_log_on", Bound::AtMost(1.05)),
];

/// Everything one run measured.
#[derive(Debug, Clone)]
pub(super) struct Results {
    pub quick: bool,
    /// How the run was set up (sizes, counts, runtimes), for the JSON.
    pub setup: Map<String, Value>,
    pub latency: Vec<Latency>,
    pub throughput: Vec<Throughput>,
    pub memory: Memory,
    /// Figures computed by a scenario group itself (the MCP gateway's, the
    /// policy guards').
    pub extra_ratios: Vec<(String, f64)>,
}

impl Results {
    fn latency(&self, name: &str) -> Result<&Latency, Error> {
        self.latency
            .iter()
            .find(|l| l.name == name)
            .ok_or_else(|| format!("no figures for scenario {name}").into())
    }

    fn throughput(&self, name: &str) -> Result<&Throughput, Error> {
        self.throughput
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| format!("no figures for throughput run {name}").into())
    }

    /// The ratios (and the memory figure) the targets are stated in, plus a
    /// few that help read them.
    pub(super) fn ratios(&self) -> Result<Vec<(String, f64)>, Error> {
        if self.setup.get("only").and_then(Value::as_str) == Some("decision-log") {
            return Ok(super::decision_log::ratios(&self.latency, &self.throughput));
        }
        if self.setup.get("only").and_then(Value::as_str) == Some("compare") {
            return Ok(super::compare::ratios(&self.latency, &self.throughput));
        }
        if matches!(
            self.setup.get("only").and_then(Value::as_str),
            Some("mcp" | "replicas" | "sessions" | "busy" | "memory")
        ) {
            return Ok(self.extra_ratios.clone());
        }
        if self.setup.get("only").and_then(Value::as_str) == Some("throughput") {
            let mesh_load = self.throughput("mesh_4")?;
            let relay_load = self.throughput("relay_floor_4")?;
            let echo_load = self.throughput("echo")?;
            let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
            return Ok(vec![
                (
                    "throughput_mesh4_vs_relay_floor4".to_owned(),
                    ratio(mesh_load.per_second, relay_load.per_second),
                ),
                (
                    "cpu_per_batch_mesh4_vs_relay_floor4".to_owned(),
                    ratio(mesh_load.server_cpu(), relay_load.server_cpu()),
                ),
                (
                    "throughput_relay_floor4_vs_echo".to_owned(),
                    ratio(relay_load.per_second, echo_load.per_second),
                ),
                (
                    "cpu_per_batch_relay_floor4_vs_echo_call".to_owned(),
                    ratio(relay_load.server_cpu(), echo_load.server_cpu()),
                ),
            ]);
        }
        let direct = self.latency("direct_unary")?;
        let parallel = self.latency("direct_parallel_4")?;
        let floor = self.latency("stream_floor")?;
        let mesh1 = self.latency("mesh_1")?;
        let mesh4 = self.latency("mesh_4")?;
        let direct5 = self.latency("direct_unary_5ms")?;
        let mesh5 = self.latency("mesh_4_5ms")?;
        let parallel5 = self.latency("direct_parallel_4_5ms")?;
        let sequential = self.latency("sequential_4_5ms")?;
        let veto = self.latency("veto_1ms")?;
        let early = self.latency("early_veto")?;
        let relay4 = self.latency("relay_floor_4")?;
        let relay5 = self.latency("relay_floor_4_5ms")?;
        let mesh_load = self.throughput("mesh_4")?;
        let relay_load = self.throughput("relay_floor_4")?;
        let echo_load = self.throughput("echo")?;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let fixed = vec![
            ("mesh4_vs_direct_p50", ratio(mesh4.p50, direct.p50)),
            ("mesh4_vs_direct_p99", ratio(mesh4.p99, direct.p99)),
            (
                "mesh4_vs_direct_parallel4_p50",
                ratio(mesh4.p50, parallel.p50),
            ),
            (
                "mesh4_vs_direct_parallel4_p99",
                ratio(mesh4.p99, parallel.p99),
            ),
            (
                "direct_parallel4_vs_direct_p50",
                ratio(parallel.p50, direct.p50),
            ),
            ("mesh1_vs_direct_p50", ratio(mesh1.p50, direct.p50)),
            // The mesh has two hops (coordinator to mesh, mesh to guard),
            // each at least one message round trip on an open stream.
            ("stream_floor_p50_us", floor.p50),
            (
                "mesh1_vs_two_stream_hops_p50",
                ratio(mesh1.p50, 2.0 * floor.p50),
            ),
            (
                "mesh1_overhead_us_over_two_stream_hops",
                mesh1.p50 - 2.0 * floor.p50,
            ),
            ("direct_vs_stream_floor_p50", ratio(direct.p50, floor.p50)),
            ("mesh4_vs_mesh1_p50", ratio(mesh4.p50, mesh1.p50)),
            ("mesh4_5ms_vs_direct_5ms_p50", ratio(mesh5.p50, direct5.p50)),
            ("mesh4_5ms_vs_direct_5ms_p99", ratio(mesh5.p99, direct5.p99)),
            // What a user without the mesh does with four 5 ms guards: the
            // slowest of four sleeps, not one, is waited for either way.
            (
                "mesh4_5ms_vs_direct_parallel4_5ms_p50",
                ratio(mesh5.p50, parallel5.p50),
            ),
            (
                "mesh4_5ms_vs_direct_parallel4_5ms_p99",
                ratio(mesh5.p99, parallel5.p99),
            ),
            (
                "direct_parallel4_5ms_vs_direct_5ms_p50",
                ratio(parallel5.p50, direct5.p50),
            ),
            (
                "parallel_vs_sequential_5ms_p50",
                ratio(mesh5.p50, sequential.p50),
            ),
            ("early_veto_vs_1ms_p50", ratio(early.p50, veto.p50)),
            ("early_veto_vs_1ms_p99", ratio(early.p99, veto.p99)),
            (
                "throughput_mesh4_vs_echo",
                ratio(mesh_load.per_second, echo_load.per_second),
            ),
            (
                "cpu_per_batch_mesh4_vs_echo_call",
                ratio(mesh_load.server_cpu(), echo_load.server_cpu()),
            ),
            (
                "rss_mib_1000_streams",
                Memory::mib(self.memory.with_streams_bytes),
            ),
            // The relay floor: the mesh's hops with none of its work. The
            // floor's own ratios are what no mesh on these hops can beat on
            // this machine; `mesh4_vs_relay_floor4_*` is what the mesh's work
            // adds to them.
            ("mesh4_vs_relay_floor4_p50", ratio(mesh4.p50, relay4.p50)),
            ("relay_floor4_vs_direct_p50", ratio(relay4.p50, direct.p50)),
            (
                "relay_floor4_vs_direct_parallel4_p50",
                ratio(relay4.p50, parallel.p50),
            ),
            (
                "mesh4_5ms_vs_relay_floor4_5ms_p50",
                ratio(mesh5.p50, relay5.p50),
            ),
            (
                "relay_floor4_5ms_vs_direct_5ms_p50",
                ratio(relay5.p50, direct5.p50),
            ),
            (
                "throughput_relay_floor4_vs_echo",
                ratio(relay_load.per_second, echo_load.per_second),
            ),
            (
                "throughput_mesh4_vs_relay_floor4",
                ratio(mesh_load.per_second, relay_load.per_second),
            ),
            (
                "cpu_per_batch_relay_floor4_vs_echo_call",
                ratio(relay_load.server_cpu(), echo_load.server_cpu()),
            ),
            (
                "cpu_per_batch_mesh4_vs_relay_floor4",
                ratio(mesh_load.server_cpu(), relay_load.server_cpu()),
            ),
        ];
        let mut ratios: Vec<(String, f64)> =
            fixed.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        // The mesh with a given number of worker threads (`mesh_4_threads_N`).
        for load in &self.throughput {
            if let Some(threads) = load.name.strip_prefix("mesh_4_threads_") {
                ratios.push((
                    format!("throughput_mesh4_threads_{threads}_vs_echo"),
                    ratio(load.per_second, echo_load.per_second),
                ));
                ratios.push((
                    format!("cpu_per_batch_mesh4_threads_{threads}_vs_echo_call"),
                    ratio(load.server_cpu(), echo_load.server_cpu()),
                ));
            }
        }
        ratios.extend(super::decision_log::ratios(&self.latency, &self.throughput));
        ratios.extend(self.extra_ratios.iter().cloned());
        Ok(ratios)
    }

    /// The printed report.
    pub(super) fn table(&self) -> Result<String, Error> {
        let mut out = String::new();
        let rounds = self
            .setup
            .get("rounds")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if !self.latency.is_empty() {
            let _ = writeln!(
                out,
                "\nlatency: one batch in flight, {rounds} interleaved rounds after warm-up (µs; CPU µs per batch)"
            );
            let _ = writeln!(
                out,
                "{:<18} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
                "scenario",
                "n",
                "p50",
                "p90",
                "p99",
                "p99.9",
                "max",
                "mesh cpu",
                "guard cpu",
                "client cpu"
            );
        }
        for l in &self.latency {
            let mesh = l.cpu.mesh.map_or("-".to_owned(), |v| format!("{v:.1}"));
            let _ = writeln!(
                out,
                "{:<18} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9} {:>9.1} {:>9.1}",
                l.name, l.n, l.p50, l.p90, l.p99, l.p999, l.max, mesh, l.cpu.guards, l.cpu.client
            );
        }
        let in_flight = self
            .setup
            .get("in_flight")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let windows = self
            .setup
            .get("throughput_windows")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let window = self
            .setup
            .get("throughput_window_s")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        if !self.throughput.is_empty() {
            let _ = writeln!(
                out,
                "\nthroughput: closed loop, {in_flight} in flight, {windows} window(s) of {window:.1} s each (CPU µs per op)"
            );
            let _ = writeln!(
                out,
                "{:<18} {:>9} {:>11} {:>9} {:>9} {:>11} {:>9} {:>10}",
                "load", "ops", "ops/s", "p50 µs", "p99 µs", "server cpu", "guard cpu", "client cpu"
            );
        }
        for t in &self.throughput {
            let guards = if t.cpu.mesh.is_some() {
                format!("{:.1}", t.cpu.guards)
            } else {
                "-".to_owned()
            };
            let _ = writeln!(
                out,
                "{:<18} {:>9} {:>11.0} {:>9.1} {:>9.1} {:>11.1} {:>9} {:>10.1}",
                t.name,
                t.ops,
                t.per_second,
                t.p50,
                t.p99,
                t.server_cpu(),
                guards,
                t.cpu.client
            );
        }
        let m = &self.memory;
        if m.streams > 0 {
            let _ = writeln!(
                out,
                "\nmemory: mesh RSS {:.1} MiB with no stream, {:.1} MiB with {} idle coordinator streams on {} connections ({:+.1} KiB per stream)",
                Memory::mib(m.idle_bytes),
                Memory::mib(m.with_streams_bytes),
                m.streams,
                m.connections,
                m.kib_per_stream()
            );
        }
        // Scenarios a run could not measure here (a store not installed).
        for why in self
            .setup
            .get("skipped")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            let _ = writeln!(out, "\nSKIPPED {why}");
        }
        let _ = writeln!(
            out,
            "\n{:<34} {:>9}  {:<9} result",
            "ratio", "value", "target"
        );
        for (key, value) in self.ratios()? {
            let target = TARGETS.iter().find(|(k, _)| *k == key).map(|(_, b)| *b);
            let (target, verdict) = match target {
                Some(bound) => (
                    bound.text(),
                    if bound.met(value) { "met" } else { "MISSED" },
                ),
                None => (String::new(), ""),
            };
            let _ = writeln!(out, "{key:<34} {value:>9.3}  {target:<9} {verdict}");
        }
        Ok(out)
    }

    /// Every figure and ratio. The ratios the issue names are also
    /// top-level keys.
    pub(super) fn json(&self) -> Result<Value, Error> {
        let ratios = self.ratios()?;
        let mut root = Map::new();
        root.insert("benchmark".into(), json!("guardmesh bench"));
        root.insert("quick".into(), json!(self.quick));
        root.insert(
            "finished_unix_s".into(),
            json!(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or_default()
            ),
        );
        for (key, value) in &ratios {
            root.insert(key.clone(), json!(value));
        }
        root.insert(
            "ratios".into(),
            Value::Object(ratios.iter().map(|(k, v)| (k.clone(), json!(v))).collect()),
        );
        root.insert(
            "targets".into(),
            Value::Object(
                TARGETS
                    .iter()
                    .map(|(key, bound)| {
                        let value = ratios
                            .iter()
                            .find(|(k, _)| k == key)
                            .map(|(_, v)| *v)
                            .unwrap_or(f64::NAN);
                        (
                            (*key).into(),
                            json!({ "value": value, "target": bound.text(), "met": bound.met(value) }),
                        )
                    })
                    .collect(),
            ),
        );
        root.insert(
            "latency".into(),
            Value::Object(
                self.latency
                    .iter()
                    .map(|l| (l.name.into(), l.json()))
                    .collect(),
            ),
        );
        root.insert(
            "throughput".into(),
            Value::Object(
                self.throughput
                    .iter()
                    .map(|t| (t.name.clone(), t.json()))
                    .collect(),
            ),
        );
        let m = &self.memory;
        root.insert(
            "memory".into(),
            json!({
                "rss_mib_idle": Memory::mib(m.idle_bytes),
                "rss_mib_with_streams": Memory::mib(m.with_streams_bytes),
                "streams": m.streams,
                "connections": m.connections,
                "kib_per_stream": m.kib_per_stream(),
            }),
        );
        root.insert("setup".into(), Value::Object(self.setup.clone()));
        Ok(Value::Object(root))
    }
}
