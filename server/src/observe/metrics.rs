//! Counters and histograms of the mesh, in the OpenMetrics text format or
//! the Prometheus text format (0.0.4).
//!
//! Each mesh owns its [`Metrics`] (no process globals), so several meshes in
//! one process (tests, the demo) keep separate, exact counts. The process's
//! own figures (`process_*`) are read from `/proc` at each scrape, and the
//! OTLP export failures are the process's (one exporter serves it).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::family::MetricConstructor;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabel {
    decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApprovalLabel {
    event: &'static str,
}

/// What happens to approval requests (R35), the `event` label of
/// `approvals`.
pub(crate) const APPROVAL_EVENTS: [&str; 7] = [
    "asked",
    "approved",
    "denied",
    "used",
    "refused",
    "expired",
    "unrecorded",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardStatusLabel {
    guard: String,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardLabel {
    guard: String,
}

/// R32: one replica of a guard.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabel {
    guard: String,
    replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// Latency buckets: from 50 µs, doubling, up to the first bound at or past
/// `max` (the longest a batch may take), so that no latency the mesh
/// allows falls only in `+Inf`.
pub(crate) fn latency_buckets(max: Duration) -> Vec<f64> {
    let max = max.as_secs_f64();
    let mut buckets = vec![0.000_05];
    while let Some(&last) = buckets.last()
        && last < max
        && buckets.len() < 64
    {
        buckets.push(last * 2.0);
    }
    buckets
}

/// Makes latency histograms with the mesh's buckets.
#[derive(Clone, Debug)]
struct Buckets(Arc<[f64]>);

impl Buckets {
    fn histogram(&self) -> Histogram {
        Histogram::new(self.0.iter().copied())
    }
}

impl MetricConstructor<Histogram> for Buckets {
    fn new_metric(&self) -> Histogram {
        self.histogram()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardWouldLabel {
    guard: String,
    would: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

/// What a dry-run guard would have done with a call (the `would` label).
pub(crate) const WOULD: [&str; 5] = ["proceed", "steer", "cancel", "rewrite", "failed"];

/// The mesh's metrics.
pub struct Metrics {
    registry: Registry,
    batches: FixedCounters<OutcomeLabel>,
    calls: FixedCounters<DecisionLabel>,
    approvals: FixedCounters<ApprovalLabel>,
    guard_outcomes: Family<GuardStatusLabel, Counter>,
    bypassed: Family<GuardLabel, Counter>,
    unguarded: FixedCounters<DecisionLabel>,
    policy_reloads: Family<OutcomeLabel, Counter>,
    spurious: Family<GuardLabel, Counter>,
    circuit_opened: Family<GuardLabel, Counter>,
    streams_opened: Family<GuardLabel, Counter>,
    replica_requests: Family<ReplicaLabel, Counter>,
    replica_outstanding: Family<ReplicaLabel, Gauge>,
    replica_ejections: Family<ReplicaLabel, Counter>,
    replica_failovers: Family<ReplicaLabel, Counter>,
    replica_draining: Family<ReplicaLabel, Gauge>,
    replica_certificate_refused: Family<ReplicaLabel, Counter>,
    replica_limit: Family<ReplicaLabel, Gauge>,
    guard_in_flight: Family<GuardLabel, Gauge>,
    guard_limit: Family<GuardLabel, Gauge>,
    guard_waiting: Family<GuardLabel, Gauge>,
    guard_shed: Family<GuardLabel, Counter>,
    auth_refused: Family<CodeLabel, Counter>,
    connections_refused: Family<ReasonLabel, Counter>,
    connections_open: Gauge,
    refused: Family<ReasonLabel, Counter>,
    guard_latency: Family<GuardLabel, Histogram, Buckets>,
    dry_run_calls: Family<GuardWouldLabel, Counter>,
    batch_latency: Histogram,
    chain_guards: Gauge,
    registry_stale: Gauge<f64, std::sync::atomic::AtomicU64>,
    registry_usable: Gauge,
    log_records: Family<KindLabel, Counter>,
    log_failures: Family<KindLabel, Counter>,
    /// Each guard's outcome counters and latency histogram, looked up by
    /// name once rather than built from labels for every batch (they share
    /// their counts with the families above). Hashed by foldhash, seeded
    /// per process: a lookup per guard per batch.
    guard_series: RwLock<HashMap<String, GuardSeries, foldhash::fast::RandomState>>,
}

/// A counter family whose one label takes a few values known in advance:
/// the series of each is looked up in the family once, on first use (so
/// that `/metrics` shows only series that counted, as with the family
/// alone), then counted without hashing a label set per batch. Other values
/// go through the family.
struct FixedCounters<L> {
    family: Family<L, Counter>,
    label: fn(&'static str) -> L,
    series: Box<[(&'static str, OnceLock<Counter>)]>,
}

impl<L> FixedCounters<L>
where
    L: Clone + std::hash::Hash + Eq,
{
    fn new(
        family: Family<L, Counter>,
        label: fn(&'static str) -> L,
        values: &[&'static str],
    ) -> Self {
        Self {
            family,
            label,
            series: values.iter().map(|&v| (v, OnceLock::new())).collect(),
        }
    }

    fn inc(&self, value: &'static str) {
        match self.series.iter().find(|(v, _)| *v == value) {
            Some((_, series)) => series
                .get_or_init(|| self.family.get_or_create(&(self.label)(value)).clone())
                .inc(),
            None => self.family.get_or_create(&(self.label)(value)).inc(),
        };
    }
}

/// The series a batch updates for one guard.
struct GuardSeries {
    latency: Histogram,
    outcomes: Vec<(&'static str, Counter)>,
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
    /// With latency buckets up to 30 s, the default longest batch.
    pub fn new() -> Self {
        Self::with_max_latency(Duration::from_secs(30))
    }

    /// With latency buckets reaching `max_latency` (the mesh's
    /// `max_batch_timeout`).
    pub fn with_max_latency(max_latency: Duration) -> Self {
        let buckets = Buckets(latency_buckets(max_latency).into());
        let mut root = Registry::default();
        root.register_collector(Box::new(super::process::ProcessCollector));
        let registry = root.sub_registry_with_prefix("guardmesh");
        let batches = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "batches",
            "Batches answered, by outcome (decided, refused, aborted)",
            batches.clone(),
        );
        let calls = Family::<DecisionLabel, Counter>::default();
        registry.register(
            "calls",
            "Call decisions, by decision (proceed, steer, cancel, ask)",
            calls.clone(),
        );
        let approvals = Family::<ApprovalLabel, Counter>::default();
        registry.register(
            "approvals",
            "Approval requests (R35), by event: asked (a request made), approved, denied, \
             used (a call ran on it), refused (an approval named that did not hold), expired \
             (answered too late), unrecorded (an ask cancelled: the session's bound or the store)",
            approvals.clone(),
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
        let replica_requests = Family::<ReplicaLabel, Counter>::default();
        registry.register(
            "guard_replica_requests",
            "Requests sent to each replica of a guard (R32), by guard and replica",
            replica_requests.clone(),
        );
        let replica_outstanding = Family::<ReplicaLabel, Gauge>::default();
        registry.register(
            "guard_replica_outstanding",
            "Requests a replica of a guard has not answered yet (R32), by guard and replica",
            replica_outstanding.clone(),
        );
        let replica_limit = Family::<ReplicaLabel, Gauge>::default();
        registry.register(
            "guard_replica_limit",
            "Requests a replica of a guard may hold at once: the limit the mesh adapts from \
             its latency (R25, R32), by guard and replica",
            replica_limit.clone(),
        );
        let guard_in_flight = Family::<GuardLabel, Gauge>::default();
        registry.register(
            "guard_in_flight",
            "Requests a guard's replicas hold unanswered, all replicas together (R25), by guard",
            guard_in_flight.clone(),
        );
        let guard_limit = Family::<GuardLabel, Gauge>::default();
        registry.register(
            "guard_limit",
            "Requests a guard's replicas may hold at once, their limits together (R25), by guard",
            guard_limit.clone(),
        );
        let guard_waiting = Family::<GuardLabel, Gauge>::default();
        registry.register(
            "guard_waiting",
            "Requests waiting for room at a guard's replicas, taken in turn across clients \
             (R25), by guard",
            guard_waiting.clone(),
        );
        let guard_shed = Family::<GuardLabel, Counter>::default();
        registry.register(
            "guard_shed",
            "Requests to a guard shed while they waited for room, or refused room, because \
             the guard was busy: their batches were answered RESOURCE_EXHAUSTED (R25), by guard",
            guard_shed.clone(),
        );
        let replica_ejections = Family::<ReplicaLabel, Counter>::default();
        registry.register(
            "guard_replica_ejections",
            "Times a replica of a guard was ejected after a failure (R32), by guard and replica",
            replica_ejections.clone(),
        );
        let replica_failovers = Family::<ReplicaLabel, Counter>::default();
        registry.register(
            "guard_replica_failovers",
            "Requests sent again to another replica after this replica failed them (R32)",
            replica_failovers.clone(),
        );
        let replica_draining = Family::<ReplicaLabel, Gauge>::default();
        registry.register(
            "guard_replica_draining",
            "1 while a replica of a guard reports NOT_SERVING on its health watch (draining: \
             no new requests while another replica can take them), else 0 (R32)",
            replica_draining.clone(),
        );
        let replica_certificate_refused = Family::<ReplicaLabel, Counter>::default();
        registry.register(
            "guard_replica_certificate_refused",
            "Connections to a replica of a guard refused at the TLS handshake because its \
             certificate was not the pinned identity or did not verify (R32, R24)",
            replica_certificate_refused.clone(),
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
            Family::<GuardLabel, Histogram, Buckets>::new_with_constructor(buckets.clone());
        registry.register(
            "guard_latency_seconds",
            "Time from sending a batch to a guard to its answer or failure",
            guard_latency.clone(),
        );
        let batch_latency = buckets.histogram();
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
        let dry_run_calls = Family::<GuardWouldLabel, Counter>::default();
        registry.register(
            "dry_run_calls",
            "Calls sent to dry-run guards, by guard and what it would have done \
             (proceed, steer, cancel, rewrite, failed)",
            dry_run_calls.clone(),
        );
        let build_info = Family::<VersionLabel, Gauge>::default();
        build_info
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "build_info",
            "The mesh's version, as a label; the value is 1",
            build_info,
        );
        registry.register(
            "otlp_export_failures",
            "OTLP exports that failed, by signal (traces), for the whole process",
            super::otlp::EXPORT_FAILURES.clone(),
        );
        Self {
            registry: root,
            dry_run_calls,
            log_records,
            log_failures,
            batches: FixedCounters::new(
                batches,
                |outcome| OutcomeLabel { outcome },
                &["decided", "refused", "aborted"],
            ),
            calls: FixedCounters::new(
                calls,
                |decision| DecisionLabel { decision },
                &["proceed", "steer", "cancel", "ask"],
            ),
            approvals: FixedCounters::new(
                approvals,
                |event| ApprovalLabel { event },
                &APPROVAL_EVENTS,
            ),
            guard_outcomes,
            bypassed,
            unguarded: FixedCounters::new(
                unguarded,
                |decision| DecisionLabel { decision },
                &["proceed", "cancel"],
            ),
            policy_reloads,
            spurious,
            circuit_opened,
            streams_opened,
            replica_requests,
            replica_outstanding,
            replica_ejections,
            replica_failovers,
            replica_draining,
            replica_certificate_refused,
            replica_limit,
            guard_in_flight,
            guard_limit,
            guard_waiting,
            guard_shed,
            auth_refused,
            connections_refused,
            connections_open,
            refused,
            guard_latency,
            batch_latency,
            chain_guards,
            registry_stale,
            registry_usable,
            guard_series: RwLock::default(),
        }
    }

    pub fn batch(&self, outcome: &'static str, seconds: f64) {
        self.batches.inc(outcome);
        if outcome == "decided" {
            self.batch_latency.observe(seconds);
        }
    }

    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub fn call(&self, decision: &'static str) {
        self.calls.inc(decision);
    }

    /// One approval event (R35), one of [`APPROVAL_EVENTS`].
    pub fn approval(&self, event: &'static str) {
        self.approvals.inc(event);
    }

    pub fn guard_outcome(&self, guard: &str, status: &'static str, seconds: Option<f64>) {
        {
            let series = self
                .guard_series
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(series) = series.get(guard)
                && let Some((_, counter)) = series.outcomes.iter().find(|(s, _)| *s == status)
            {
                counter.inc();
                if let Some(seconds) = seconds {
                    series.latency.observe(seconds);
                }
                return;
            }
        }
        // First time for this guard and status: the series from the
        // families, kept for the next batches.
        let counter = self
            .guard_outcomes
            .get_or_create(&GuardStatusLabel {
                guard: guard.to_owned(),
                status,
            })
            .clone();
        let latency = self
            .guard_latency
            .get_or_create(&GuardLabel {
                guard: guard.to_owned(),
            })
            .clone();
        counter.inc();
        if let Some(seconds) = seconds {
            latency.observe(seconds);
        }
        let mut series = self
            .guard_series
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = series
            .entry(guard.to_owned())
            .or_insert_with(|| GuardSeries {
                latency,
                outcomes: Vec::new(),
            });
        if !entry.outcomes.iter().any(|(s, _)| *s == status) {
            entry.outcomes.push((status, counter));
        }
    }

    /// A call sent to dry-run guard `guard`, and what it would have done.
    pub fn dry_run_call(&self, guard: &str, would: &'static str) {
        self.dry_run_calls
            .get_or_create(&GuardWouldLabel {
                guard: guard.to_owned(),
                would,
            })
            .inc();
    }

    /// The guards of a new chain (name, and whether it enforces): their
    /// series exist from registration on, at 0, not only after first use.
    pub fn guards_registered<'a>(&self, guards: impl IntoIterator<Item = (&'a str, bool)>) {
        use guardmesh_proto::v1::TraceStatus;
        for (name, enforced) in guards {
            for &status in TraceStatus::NAMES {
                if status != TraceStatus::Unspecified.name() {
                    let _ = self.guard_outcomes.get_or_create(&GuardStatusLabel {
                        guard: name.to_owned(),
                        status,
                    });
                }
            }
            let guard = GuardLabel {
                guard: name.to_owned(),
            };
            let _ = self.guard_latency.get_or_create(&guard);
            let _ = self.bypassed.get_or_create(&guard);
            let _ = self.spurious.get_or_create(&guard);
            let _ = self.circuit_opened.get_or_create(&guard);
            let _ = self.streams_opened.get_or_create(&guard);
            if !enforced {
                for would in WOULD {
                    let _ = self.dry_run_calls.get_or_create(&GuardWouldLabel {
                        guard: name.to_owned(),
                        would,
                    });
                }
            }
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
        self.unguarded.inc(decision);
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

    /// R32, R25: the series of `replica` of `guard`, looked up once when
    /// it joins (a label lookup hashes and allocates; its requests update
    /// the series through these handles). [`Metrics::replica_gone`] takes
    /// them out of the exposition.
    pub fn replica_series(&self, guard: &str, replica: &str) -> ReplicaSeries {
        let label = ReplicaLabel {
            guard: guard.to_owned(),
            replica: replica.to_owned(),
        };
        ReplicaSeries {
            requests: self.replica_requests.get_or_create(&label).clone(),
            outstanding: self.replica_outstanding.get_or_create(&label).clone(),
            limit: self.replica_limit.get_or_create(&label).clone(),
        }
    }

    /// R25: `guard`'s requests in flight, all its replicas together: a
    /// count its pool keeps and publishes on every change (one per pool,
    /// so a pool built again for a reload starts from its own count).
    pub fn guard_held(&self, guard: &str) -> HeldSeries {
        let label = GuardLabel {
            guard: guard.to_owned(),
        };
        let gauge = self.guard_in_flight.get_or_create(&label).clone();
        gauge.set(0);
        HeldSeries {
            count: Arc::new(AtomicUsize::new(0)),
            gauge,
        }
    }

    /// R25: the flow series of `guard`'s pool, looked up once with it.
    pub fn flow_series(&self, guard: &str) -> FlowSeries {
        let label = GuardLabel {
            guard: guard.to_owned(),
        };
        FlowSeries {
            limit: self.guard_limit.get_or_create(&label).clone(),
            waiting: self.guard_waiting.get_or_create(&label).clone(),
        }
    }

    /// R25: a request to `guard` was shed for load.
    pub fn guard_shed(&self, guard: &str) {
        self.guard_shed
            .get_or_create(&GuardLabel {
                guard: guard.to_owned(),
            })
            .inc();
    }

    /// R32: `replica` of `guard` was ejected after a failure.
    pub fn replica_ejected(&self, guard: &str, replica: &str) {
        self.replica_ejections
            .get_or_create(&ReplicaLabel {
                guard: guard.to_owned(),
                replica: replica.to_owned(),
            })
            .inc();
    }

    /// R32: a request `replica` of `guard` failed was sent to another.
    pub fn replica_failover(&self, guard: &str, replica: &str) {
        self.replica_failovers
            .get_or_create(&ReplicaLabel {
                guard: guard.to_owned(),
                replica: replica.to_owned(),
            })
            .inc();
    }

    /// R32: `replica` of `guard` left: its series go (a guard's replicas
    /// come and go; the label set stays bounded by the live ones).
    pub fn replica_gone(&self, guard: &str, replica: &str) {
        let label = ReplicaLabel {
            guard: guard.to_owned(),
            replica: replica.to_owned(),
        };
        self.replica_requests.remove(&label);
        self.replica_outstanding.remove(&label);
        self.replica_ejections.remove(&label);
        self.replica_failovers.remove(&label);
        self.replica_draining.remove(&label);
        self.replica_certificate_refused.remove(&label);
        self.replica_limit.remove(&label);
    }

    /// R32: whether `replica` of `guard` reports `NOT_SERVING` (draining).
    pub fn replica_draining(&self, guard: &str, replica: &str, draining: bool) {
        self.replica_draining
            .get_or_create(&ReplicaLabel {
                guard: guard.to_owned(),
                replica: replica.to_owned(),
            })
            .set(i64::from(draining));
    }

    /// R32, R24: a connection to `replica` of `guard` was refused at the
    /// handshake: its certificate is not the pinned identity (an impostor)
    /// or does not verify.
    pub fn replica_certificate_refused(&self, guard: &str, replica: &str) {
        self.replica_certificate_refused
            .get_or_create(&ReplicaLabel {
                guard: guard.to_owned(),
                replica: replica.to_owned(),
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

    /// The metrics in the OpenMetrics text format (1.0.0).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The metrics in the Prometheus text exposition format (0.0.4).
    pub fn encode_prometheus(&self) -> String {
        openmetrics_to_prometheus(&self.encode())
    }
}

/// Rewrites OpenMetrics text as the Prometheus text format: a counter
/// family is named by its `_total` series, an info family is a gauge named
/// `_info`, `unknown` is `untyped`, and there are no `_created` series,
/// `# UNIT` lines nor `# EOF`.
pub(crate) fn openmetrics_to_prometheus(text: &str) -> String {
    use std::collections::HashMap;
    use std::fmt::Write as _;
    let mut types: HashMap<&str, &str> = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some((name, kind)) = rest.split_once(' ')
        {
            types.insert(name, kind);
        }
    }
    let renamed = |name: &str| -> String {
        match types.get(name) {
            Some(&"counter") => format!("{name}_total"),
            Some(&"info") => format!("{name}_info"),
            _ => name.to_owned(),
        }
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind {
                "counter" | "gauge" | "histogram" | "summary" => kind,
                "info" | "stateset" => "gauge",
                _ => "untyped",
            };
            let _ = writeln!(out, "# TYPE {} {kind}", renamed(name));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let _ = writeln!(out, "# HELP {} {help}", renamed(name));
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if let Some(family) = name.strip_suffix("_created")
            && types.get(family) == Some(&"counter")
        {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_reach_the_longest_batch() {
        for max in [
            Duration::from_millis(1),
            Duration::from_secs(5),
            Duration::from_secs(30),
            Duration::from_secs(300),
        ] {
            let buckets = latency_buckets(max);
            assert_eq!(buckets[0], 0.000_05);
            let last = *buckets.last().unwrap();
            assert!(last >= max.as_secs_f64(), "{max:?}: {buckets:?}");
            assert!(buckets.len() < 2 || buckets[buckets.len() - 2] < max.as_secs_f64());
        }
    }

    /// The per-guard series kept between batches count into the exported
    /// families, status by status and guard by guard.
    #[test]
    fn guard_outcomes_count_per_guard_and_status_batch_after_batch() {
        let metrics = Metrics::new();
        for _ in 0..3 {
            metrics.guard_outcome("a", "proceeded", Some(0.001));
        }
        metrics.guard_outcome("a", "failed", None);
        metrics.guard_outcome("b", "proceeded", Some(0.002));
        let text = metrics.encode_prometheus();
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        let outcome = |guard: &str, status: &str| {
            line(&format!(
                "guardmesh_guard_outcomes_total{{guard=\"{guard}\",status=\"{status}\"}}"
            ))
        };
        assert_eq!(outcome("a", "proceeded"), "3");
        assert_eq!(outcome("a", "failed"), "1");
        assert_eq!(outcome("b", "proceeded"), "1");
        assert_eq!(
            line("guardmesh_guard_latency_seconds_count{guard=\"a\"}"),
            "3"
        );
        assert_eq!(
            line("guardmesh_guard_latency_seconds_count{guard=\"b\"}"),
            "1"
        );
    }

    /// Batch, call and unguarded counters kept between batches count into
    /// the exported families; a series shows once it has counted, and a
    /// value not known in advance still counts.
    #[test]
    fn fixed_label_counters_count_into_their_families() {
        let metrics = Metrics::new();
        let text = metrics.encode_prometheus();
        assert!(!text.contains("guardmesh_calls_total{"), "{text}");
        for _ in 0..3 {
            metrics.call("proceed");
        }
        metrics.call("cancel");
        metrics.unguarded("cancel");
        metrics.batch("decided", 0.001);
        metrics.batch("aborted", 0.001);
        metrics.batch("decided", 0.001);
        metrics.batch("another", 0.0);
        let text = metrics.encode_prometheus();
        for (series, want) in [
            (r#"guardmesh_calls_total{decision="proceed"}"#, "3"),
            (r#"guardmesh_calls_total{decision="cancel"}"#, "1"),
            (r#"guardmesh_unguarded_calls_total{decision="cancel"}"#, "1"),
            (r#"guardmesh_batches_total{outcome="decided"}"#, "2"),
            (r#"guardmesh_batches_total{outcome="aborted"}"#, "1"),
            (r#"guardmesh_batches_total{outcome="another"}"#, "1"),
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(series))
                .unwrap_or_else(|| panic!("no {series} in\n{text}"));
            assert_eq!(line.rsplit(' ').next(), Some(want), "{line}");
        }
        assert!(!text.contains(r#"decision="steer""#), "{text}");
        assert!(
            !text.contains(r#"guardmesh_unguarded_calls_total{decision="proceed"}"#),
            "{text}"
        );
    }

    #[test]
    fn the_prometheus_text_names_counters_by_their_total_and_has_no_eof() {
        let metrics = Metrics::new();
        metrics.batch("decided", 0.001);
        metrics.guards_registered([("g", false)]);
        let open = metrics.encode();
        assert!(open.contains("# TYPE guardmesh_batches counter"), "{open}");
        assert!(open.ends_with("# EOF\n"), "{open}");
        let text = metrics.encode_prometheus();
        assert!(
            text.contains("# TYPE guardmesh_batches_total counter"),
            "{text}"
        );
        assert!(text.contains("# HELP guardmesh_batches_total "), "{text}");
        assert!(
            text.contains("guardmesh_batches_total{outcome=\"decided\"} 1"),
            "{text}"
        );
        assert!(text.contains("# TYPE guardmesh_build_info gauge"), "{text}");
        assert!(
            text.contains("guardmesh_dry_run_calls_total{guard=\"g\",would=\"steer\"} 0"),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        assert!(!text.contains("_created"), "{text}");
    }
}

/// A gauge's value from a count (saturating).
fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// One replica's series ([`Metrics::replica_series`]).
#[derive(Clone, Debug)]
pub struct ReplicaSeries {
    requests: Counter,
    outstanding: Gauge,
    limit: Gauge,
}

impl ReplicaSeries {
    /// R32: a request sent to the replica; `outstanding`: what it holds
    /// unanswered now.
    pub fn sent(&self, outstanding: usize) {
        self.requests.inc();
        self.outstanding(outstanding);
    }

    /// R32: what the replica holds unanswered now.
    pub fn outstanding(&self, outstanding: usize) {
        self.outstanding.set(gauge_value(outstanding));
    }

    /// R25: the requests the replica may hold at once.
    pub fn limit(&self, limit: usize) {
        self.limit.set(gauge_value(limit));
    }
}

/// One guard's flow series ([`Metrics::flow_series`]).
#[derive(Clone, Debug)]
pub struct FlowSeries {
    limit: Gauge,
    waiting: Gauge,
}

impl FlowSeries {
    /// R25: the requests the guard's replicas may hold (`limit`), and
    /// that wait for room (`waiting`).
    pub fn set(&self, limit: usize, waiting: usize) {
        self.limit.set(gauge_value(limit));
        self.waiting.set(gauge_value(waiting));
    }
}

/// The requests one guard's replicas hold, all together
/// ([`Metrics::guard_held`]): counted as each is sent and as each ends,
/// and published as it moves (an atomic add and a store, no lock).
#[derive(Clone, Debug)]
pub struct HeldSeries {
    count: Arc<AtomicUsize>,
    gauge: Gauge,
}

impl HeldSeries {
    /// One more request held.
    pub fn add(&self) {
        let held = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        self.gauge.set(gauge_value(held));
    }

    /// One request fewer (each [`Self::add`] is matched by one).
    pub fn sub(&self) {
        let held = self.count.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
        self.gauge.set(gauge_value(held));
    }
}
