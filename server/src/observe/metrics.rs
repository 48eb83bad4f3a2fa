//! Counters and histograms of the mesh, in the Prometheus text format.
//!
//! Each mesh owns its [`Metrics`] (no process globals), so several meshes in
//! one process (tests, the demo) keep separate, exact counts.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabel {
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardStatusLabel {
    guard: String,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardLabel {
    guard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

/// The mesh's metrics.
pub struct Metrics {
    registry: Registry,
    batches: Family<OutcomeLabel, Counter>,
    calls: Family<DecisionLabel, Counter>,
    guard_outcomes: Family<GuardStatusLabel, Counter>,
    bypassed: Family<GuardLabel, Counter>,
    unguarded: Family<DecisionLabel, Counter>,
    policy_reloads: Family<OutcomeLabel, Counter>,
    spurious: Family<GuardLabel, Counter>,
    circuit_opened: Family<GuardLabel, Counter>,
    streams_opened: Family<GuardLabel, Counter>,
    auth_refused: Family<CodeLabel, Counter>,
    connections_refused: Family<ReasonLabel, Counter>,
    connections_open: Gauge,
    refused: Family<ReasonLabel, Counter>,
    guard_latency: Family<GuardLabel, Histogram, fn() -> Histogram>,
    batch_latency: Histogram,
    chain_guards: Gauge,
    registry_stale: Gauge<f64, std::sync::atomic::AtomicU64>,
    registry_usable: Gauge,
    log_records: Family<KindLabel, Counter>,
    log_failures: Family<KindLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("guardmesh");
        let batches = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "batches",
            "Batches answered, by outcome (decided, refused, aborted)",
            batches.clone(),
        );
        let calls = Family::<DecisionLabel, Counter>::default();
        registry.register(
            "calls",
            "Call decisions, by decision (proceed, steer, cancel)",
            calls.clone(),
        );
        let guard_outcomes = Family::<GuardStatusLabel, Counter>::default();
        registry.register(
            "guard_outcomes",
            "What each guard did per batch, by guard and trace status",
            guard_outcomes.clone(),
        );
        let bypassed = Family::<GuardLabel, Counter>::default();
        registry.register(
            "guard_bypassed_calls",
            "Calls that proceeded past a failed fail_open guard, by guard",
            bypassed.clone(),
        );
        let unguarded = Family::<DecisionLabel, Counter>::default();
        registry.register(
            "unguarded_calls",
            "Calls no enforced guard applied to (R28), by what the mesh did (proceed, cancel)",
            unguarded.clone(),
        );
        let policy_reloads = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "policy_reloads",
            "Policy files reloaded on SIGHUP or a change on disk (R27), by outcome (applied, refused: the running policy is kept)",
            policy_reloads.clone(),
        );
        let spurious = Family::<GuardLabel, Counter>::default();
        registry.register(
            "guard_spurious_answers",
            "Answers from guards for requests no batch waits for (late, cancelled, unknown)",
            spurious.clone(),
        );
        let circuit_opened = Family::<GuardLabel, Counter>::default();
        registry.register(
            "guard_circuit_opened",
            "Times a guard's circuit breaker opened, by guard",
            circuit_opened.clone(),
        );
        let streams_opened = Family::<GuardLabel, Counter>::default();
        registry.register(
            "guard_streams_opened",
            "Judge streams the mesh opened to each guard (the first, and one per reconnect)",
            streams_opened.clone(),
        );
        let auth_refused = Family::<CodeLabel, Counter>::default();
        registry.register(
            "auth_refused",
            "Requests refused by authentication (unauthenticated) or authorization (permission_denied)",
            auth_refused.clone(),
        );
        let connections_refused = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "connections_refused",
            "Client connections closed before carrying a request, by reason (over_limit, \
             handshake_timeout, handshake_failed, bad_preface, closed)",
            connections_refused.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Client connections open on the gRPC listener, handshaking or serving",
            connections_open.clone(),
        );
        let refused = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "batches_refused",
            "Batches refused before any guard was contacted, by reason",
            refused.clone(),
        );
        let guard_latency =
            Family::<GuardLabel, Histogram, fn() -> Histogram>::new_with_constructor(
                latency_histogram,
            );
        registry.register(
            "guard_latency_seconds",
            "Time from sending a batch to a guard to its answer or failure",
            guard_latency.clone(),
        );
        let batch_latency = latency_histogram();
        registry.register(
            "batch_latency_seconds",
            "Time to decide a batch",
            batch_latency.clone(),
        );
        let chain_guards = Gauge::default();
        registry.register(
            "chain_guards",
            "Guards in the current chain",
            chain_guards.clone(),
        );
        let registry_stale = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "registry_stale_seconds",
            "How long the chain has gone unconfirmed by its shared store (0 when current)",
            registry_stale.clone(),
        );
        let registry_usable = Gauge::default();
        registry_usable.set(1);
        registry.register(
            "registry_usable",
            "1 while batches may be judged with the registry's chain, 0 after the staleness window",
            registry_usable.clone(),
        );
        let log_records = Family::<KindLabel, Counter>::default();
        registry.register(
            "decision_log_records",
            "Decision log records written (R29), by kind (decision, chain_change)",
            log_records.clone(),
        );
        let log_failures = Family::<KindLabel, Counter>::default();
        registry.register(
            "decision_log_failures",
            "Decision log records that could not be written, by kind (decision, chain_change)",
            log_failures.clone(),
        );
        Self {
            registry,
            log_records,
            log_failures,
            batches,
            calls,
            guard_outcomes,
            bypassed,
            unguarded,
            policy_reloads,
            spurious,
            circuit_opened,
            streams_opened,
            auth_refused,
            connections_refused,
            connections_open,
            refused,
            guard_latency,
            batch_latency,
            chain_guards,
            registry_stale,
            registry_usable,
        }
    }

    pub fn batch(&self, outcome: &'static str, seconds: f64) {
        self.batches.get_or_create(&OutcomeLabel { outcome }).inc();
        if outcome == "decided" {
            self.batch_latency.observe(seconds);
        }
    }

    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub fn call(&self, decision: &'static str) {
        self.calls.get_or_create(&DecisionLabel { decision }).inc();
    }

    pub fn guard_outcome(&self, guard: &str, status: &'static str, seconds: Option<f64>) {
        self.guard_outcomes
            .get_or_create(&GuardStatusLabel {
                guard: guard.to_owned(),
                status,
            })
            .inc();
        if let Some(seconds) = seconds {
            self.guard_latency
                .get_or_create(&GuardLabel {
                    guard: guard.to_owned(),
                })
                .observe(seconds);
        }
    }

    pub fn bypassed(&self, guard: &str) {
        self.bypassed
            .get_or_create(&GuardLabel {
                guard: guard.to_owned(),
            })
            .inc();
    }

    /// A call no enforced guard applied to (R28): `proceed` or `cancel`.
    pub fn unguarded(&self, decision: &'static str) {
        self.unguarded
            .get_or_create(&DecisionLabel { decision })
            .inc();
    }

    /// A decision log record written (`decision`, `chain_change`).
    pub fn decision_log_record(&self, kind: &'static str) {
        self.log_records.get_or_create(&KindLabel { kind }).inc();
    }

    /// A decision log record that could not be written.
    pub fn decision_log_failure(&self, kind: &'static str) {
        self.log_failures.get_or_create(&KindLabel { kind }).inc();
    }

    /// A policy file reloaded (`applied`) or refused, the running policy
    /// kept (`refused`).
    pub fn policy_reload(&self, outcome: &'static str) {
        self.policy_reloads
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    pub fn spurious_answer(&self, guard: &str) {
        self.spurious
            .get_or_create(&GuardLabel {
                guard: guard.to_owned(),
            })
            .inc();
    }

    pub fn circuit_opened(&self, guard: &str) {
        self.circuit_opened
            .get_or_create(&GuardLabel {
                guard: guard.to_owned(),
            })
            .inc();
    }

    pub fn guard_stream_opened(&self, guard: &str) {
        self.streams_opened
            .get_or_create(&GuardLabel {
                guard: guard.to_owned(),
            })
            .inc();
    }

    pub fn auth_refused(&self, code: tonic::Code) {
        let code = match code {
            tonic::Code::Unauthenticated => "unauthenticated".to_owned(),
            tonic::Code::PermissionDenied => "permission_denied".to_owned(),
            other => format!("{other:?}").to_ascii_lowercase(),
        };
        self.auth_refused.get_or_create(&CodeLabel { code }).inc();
    }

    /// A client connection closed before it carried a request (R25).
    pub fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// A client connection opened (`true`) or closed (`false`).
    pub fn connection_open(&self, open: bool) {
        if open {
            self.connections_open.inc();
        } else {
            self.connections_open.dec();
        }
    }

    pub fn registry_state(&self, stale: Option<std::time::Duration>, usable: bool) {
        self.registry_stale
            .set(stale.map_or(0.0, |d| d.as_secs_f64()));
        self.registry_usable.set(i64::from(usable));
    }

    pub fn chain_size(&self, guards: usize) {
        self.chain_guards
            .set(i64::try_from(guards).unwrap_or(i64::MAX));
    }

    /// The metrics in the Prometheus text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
