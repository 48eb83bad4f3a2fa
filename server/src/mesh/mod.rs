//! The mesh: a registry, the links to its guards, and the settings every
//! batch is judged with.
//!
//! Each batch is judged against one [`Chain`] snapshot (R17). Snapshots are
//! rebuilt lazily when the registry's chain changes, reusing the open link of
//! every guard whose endpoint did not change, so a re-registration neither
//! drops the guard's stream nor moves it in the chain.
//!
//! A batch's way through the mesh is one pipeline whatever door it came
//! in by (`pipeline.rs`): the admission stage ([`crate::admit`]), judging
//! ([`crate::judge`], `evaluate.rs`), and the batch's record ([`record`]),
//! each once.

mod batch_session;
mod evaluate;
pub mod interceptor_chain;
pub(crate) mod pipeline;
pub(crate) mod record;
pub mod result_reads;
mod session_turns;
pub mod visibility;

use crate::decision_log::MeshLog;
pub use crate::judge::BatchError;
pub use crate::judge::{Chain, ChainGuard, Unguarded};
use crate::link::dial::{EndpointPolicy, GuardConnector, GuardTls};
use crate::link::discover::dns::SystemResolver;
use crate::link::discover::sources::{GuardSources, NameSettings};
use crate::link::pool::GuardPool;
use crate::link::{GuardLink, LinkConfig};
use crate::observe::metrics::Metrics;
use crate::registry::spec::Guard;
use crate::registry::{ChainSpec, Registry};
use crate::security::auth::AuthPolicy;
use crate::security::tls::ServerTls;
use crate::validate::Limits;
use arc_swap::ArcSwap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Settings of a mesh.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// Timeout of a guard registered with `timeout_ms = 0`.
    pub default_guard_timeout: Duration,
    /// Deadline of a batch that states none.
    pub default_batch_timeout: Duration,
    /// Cap on any batch deadline (R14).
    pub max_batch_timeout: Duration,
    pub limits: Limits,
    pub link: LinkConfig,
    pub security: Security,
    /// What happens to a call no enforced guard applies to (R28).
    pub unguarded: Unguarded,
    /// Bytes of compiled policies the guards one identity registered may
    /// hold together (R25), checked at admission.
    pub max_policy_bytes_per_identity: usize,
    /// The bounds of session memory (R34).
    pub sessions: crate::session::SessionLimits,
    /// Approvals (R35): how long a request lives, how many a session may
    /// have waiting.
    pub approvals: crate::approval::Settings,
}

/// Who may talk to the mesh, and whom the mesh may talk to.
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// TLS on the mesh's listener (coordinators and registrars); with a
    /// client CA, client certificates are required.
    pub server_tls: Option<ServerTls>,
    /// Authentication and roles; `None` lets every caller do everything.
    pub auth: Option<Arc<AuthPolicy>>,
    /// TLS to `https://` guards.
    pub guard_tls: Option<Arc<GuardTls>>,
    /// Which guard endpoints may be registered and dialed.
    pub endpoint_policy: Arc<EndpointPolicy>,
    /// Concurrent HTTP/2 streams per client connection.
    pub max_concurrent_streams: u32,
    /// Handshake deadline, keepalive and connection cap of the listener (R25).
    pub listener: crate::security::tls::ListenerLimits,
}

impl MeshConfig {
    /// A batch's deadline (R14), from now: its `timeout_ms`, else the
    /// mesh's default, shortened to the transport's deadline when there is
    /// one, and capped by `max_batch_timeout`. A transport deadline is the
    /// client's: the mesh answers a little before it, so that a guard
    /// timing out still yields a decision the client can read rather than
    /// its own DEADLINE_EXCEEDED.
    pub fn batch_deadline(
        &self,
        timeout_ms: u32,
        transport: Option<Duration>,
    ) -> tokio::time::Instant {
        let transport = transport.map(|t| t.saturating_sub((t / 20).max(Duration::from_millis(5))));
        let asked = match (timeout_ms, transport) {
            (0, None) => self.default_batch_timeout,
            (0, Some(t)) => t,
            (ms, None) => Duration::from_millis(u64::from(ms)),
            (ms, Some(t)) => Duration::from_millis(u64::from(ms)).min(t),
        };
        tokio::time::Instant::now() + asked.min(self.max_batch_timeout)
    }
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            default_guard_timeout: Duration::from_secs(1),
            default_batch_timeout: Duration::from_secs(5),
            max_batch_timeout: Duration::from_secs(30),
            limits: Limits::default(),
            link: LinkConfig::default(),
            security: Security {
                max_concurrent_streams: 1024,
                ..Security::default()
            },
            unguarded: Unguarded::Proceed,
            max_policy_bytes_per_identity:
                crate::registry::registration::DEFAULT_MAX_POLICY_BYTES_PER_IDENTITY,
            sessions: crate::session::SessionLimits::default(),
            approvals: crate::approval::Settings::default(),
        }
    }
}

// Here rather than beside `Admission` in the registry, which does not
// import the mesh (the modules are layered).
impl crate::registry::Admission {
    /// The admission of a mesh with `config`.
    pub fn of(config: &MeshConfig) -> Self {
        Self {
            default_timeout: config.default_guard_timeout,
            endpoint_policy: config.security.endpoint_policy.clone(),
        }
    }
}

/// The mesh.
pub struct Mesh {
    pub config: MeshConfig,
    pub metrics: Arc<Metrics>,
    registry: Arc<dyn Registry>,
    chain: ArcSwap<Chain>,
    rebuild: Mutex<()>,
    /// One permit per batch being judged (load shedding).
    pub(crate) inflight: Arc<tokio::sync::Semaphore>,
    /// `limits.max_inflight_bytes` in KiB: each batch being judged holds
    /// its weight (load shedding by bytes, R25).
    pub(crate) inflight_bytes: Arc<tokio::sync::Semaphore>,
    /// The decision log (R29), when one is configured; set once at start.
    decision_log: std::sync::OnceLock<MeshLog>,
    /// Where the gRPC server listens, once it serves (span attributes).
    pub(crate) served_at: std::sync::OnceLock<std::net::SocketAddr>,
    /// Told of every result decision (R33), when set (`mesh/result_reads.rs`).
    result_reads: std::sync::OnceLock<Arc<dyn result_reads::ResultReads>>,
    /// Session memory (R34): in this mesh's memory unless a shared store
    /// was attached before the first batch that needed it.
    sessions: std::sync::OnceLock<Arc<crate::session::SessionMemory>>,
    /// A session's batches judged one after another on this mesh (R34).
    session_turns: Arc<session_turns::SessionTurns>,
    /// Approvals (R35): settings and counters.
    pub approvals: crate::approval::Approvals,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("config", &self.config)
            .finish()
    }
}

impl Mesh {
    pub fn new(config: MeshConfig, registry: Arc<dyn Registry>) -> Arc<Self> {
        let metrics = Arc::new(Metrics::with_max_latency(config.max_batch_timeout));
        Arc::new(Self {
            config: config.clone(),
            metrics: metrics.clone(),
            registry,
            chain: ArcSwap::from_pointee(Chain {
                revision: 0,
                guards: Vec::new(),
                spec: Arc::new(ChainSpec::default()),
            }),
            rebuild: Mutex::new(()),
            inflight: Arc::new(tokio::sync::Semaphore::new(
                config.limits.max_inflight_batches.max(1),
            )),
            inflight_bytes: Arc::new(tokio::sync::Semaphore::new(
                (config.limits.max_inflight_bytes / 1024)
                    .clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
            )),
            decision_log: std::sync::OnceLock::new(),
            served_at: std::sync::OnceLock::new(),
            result_reads: std::sync::OnceLock::new(),
            sessions: std::sync::OnceLock::new(),
            session_turns: Arc::default(),
            approvals: crate::approval::Approvals::new(config.approvals).with_metrics(metrics),
        })
    }

    /// Attaches the decision log (R29): from now on every batch answered
    /// and every chain change is recorded. Once per mesh; a second log is
    /// refused (returned).
    pub fn attach_decision_log(&self, log: MeshLog) -> Result<(), MeshLog> {
        self.decision_log.set(log)
    }

    /// The decision log, if one is attached.
    pub fn decision_log(&self) -> Option<&MeshLog> {
        self.decision_log.get()
    }

    /// Where the gRPC server listens, once it serves.
    pub fn served_at(&self) -> Option<std::net::SocketAddr> {
        self.served_at.get().copied()
    }

    /// The pool of links to `guard`'s replicas (R32): each registered
    /// target (an address; a DNS name's addresses, resolved again over
    /// time) and the replicas the registry's heartbeats announce. Each
    /// replica's link dials under the endpoint policy and requires the
    /// pinned identity, as a single-address guard's does; a replica
    /// reached by a name's address must present that name (or the pin).
    /// Nothing here waits: a name is dialed as written until its first
    /// resolution answers.
    fn pool(&self, guard: &Guard) -> GuardPool {
        let name = guard.name.clone();
        let config = self.config.link.clone();
        let metrics = self.metrics.clone();
        let policy = self.config.security.endpoint_policy.clone();
        let security = (
            policy.clone(),
            self.config.security.guard_tls.clone(),
            guard.server_identity.clone(),
            self.config.link.connect_timeout,
        );
        let spawn_metrics = metrics.clone();
        // Scripted transports (tests) reach guards by endpoint as written.
        let names = self.config.link.transport.is_none().then(|| NameSettings {
            policy: policy.clone(),
            interval: self.config.link.resolve_interval,
            resolver: Arc::new(SystemResolver),
        });
        let sources = GuardSources::new(
            &guard.name,
            names,
            self.registry.announced_replicas(&guard.name, policy),
        );
        GuardPool::registered(
            &guard.name,
            guard.targets(),
            sources,
            guard.server_identity.clone(),
            Box::new(move |target| {
                let base = GuardConnector {
                    policy: security.0.clone(),
                    tls: security.1.clone(),
                    pin: security.2.clone(),
                    https: target.endpoint.starts_with("https://"),
                    connect_timeout: security.3,
                };
                let connector = match &target.registered {
                    Some(registered) => base.for_replica(registered, &target.endpoint),
                    None => base,
                };
                GuardLink::spawn(
                    &name,
                    &target.endpoint,
                    config.clone(),
                    connector,
                    spawn_metrics.clone(),
                )
            }),
            metrics,
        )
    }

    pub fn registry(&self) -> &dyn Registry {
        self.registry.as_ref()
    }

    /// The current chain snapshot (R17). Must be called within a tokio
    /// runtime: new guards' links start connecting here.
    pub fn chain(&self) -> Arc<Chain> {
        let spec = self.registry.chain();
        let current = self.chain.load_full();
        if Arc::ptr_eq(&current.spec, &spec) {
            return current;
        }
        let _guard = self.rebuild.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.chain.load_full();
        let spec = self.registry.chain();
        if Arc::ptr_eq(&current.spec, &spec) {
            return current;
        }
        let mut links: HashMap<&str, &Arc<GuardPool>> = current
            .guards
            .iter()
            .filter_map(|g| Some((g.guard.name.as_str(), g.link.as_ref()?)))
            .collect();
        let guards = spec
            .guards
            .iter()
            .map(|guard| {
                if guard.is_policy() {
                    return ChainGuard {
                        guard: guard.clone(),
                        link: None,
                    };
                }
                // The same pin: the pool is kept, and a changed registered
                // list opens links to new replicas and drains the others
                // (compared with the registered targets, not the live
                // replicas, which names and heartbeats add to).
                let link = match links.remove(guard.name.as_str()) {
                    Some(link) if link.identity() == guard.server_identity.as_deref() => {
                        let targets = guard.targets();
                        if link.registered_targets() != targets {
                            link.relist(&targets);
                        }
                        link.clone()
                    }
                    _ => Arc::new(self.pool(guard)),
                };
                ChainGuard {
                    guard: guard.clone(),
                    link: Some(link),
                }
            })
            .collect();
        let chain = Arc::new(Chain {
            revision: spec.revision,
            guards,
            spec,
        });
        self.metrics.chain_size(chain.guards.len());
        self.metrics.guards_registered(
            chain
                .guards
                .iter()
                .map(|g| (g.guard.name.as_str(), g.guard.enforced())),
        );
        self.chain.store(chain.clone());
        chain
    }
}

impl crate::observe::metrics_http::Readiness for Mesh {
    fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    fn registry_refusal(&self) -> Option<String> {
        self.registry().check().err().map(|e| e.to_string())
    }

    fn registry_staleness(&self) -> Option<Duration> {
        self.registry().staleness()
    }

    fn decision_log_dir(&self) -> Option<std::path::PathBuf> {
        self.decision_log().map(|log| log.log().dir().to_path_buf())
    }
}
