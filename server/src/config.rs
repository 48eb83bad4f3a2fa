//! The mesh's TOML config file.
//!
//! ```toml
//! listen = "127.0.0.1:50051"
//! default_guard_timeout_ms = 1000
//! default_batch_timeout_ms = 5000
//! max_batch_timeout_ms = 30000
//!
//! [limits]
//! max_calls_per_batch = 256
//! max_batch_bytes = 4194304
//! max_argument_bytes = 1048576
//! max_inflight_batches = 4096
//! max_batches_per_stream = 256
//! max_json_depth = 64
//! max_id_bytes = 256
//! max_metadata_entries = 1024
//! max_inflight_bytes = 268435456
//! max_stream_bytes = 16777216
//! max_coordinator_streams = 4096
//! max_tool_name_chars = 128
//! tool_name_extra_chars = ""
//!
//! [guard_links]
//! connect_timeout_ms = 2000
//! backoff_initial_ms = 50
//! backoff_max_ms = 2000
//! max_answer_bytes = 4194304
//! circuit_failures = 5
//! circuit_open_ms = 5000
//! keepalive_interval_ms = 300000
//! keepalive_timeout_ms = 20000
//! dead_peer_timeout_ms = 30000
//! max_queued_bytes = 16777216
//!
//! [[guard]]
//! name = "sql-where"
//! endpoint = "http://127.0.0.1:7001"
//! tools = ["sql.*"]
//! timeout_ms = 200
//! failure_policy = "fail_closed"
//! ```
//!
//! Guards declared here are registered at start, in file order (R16).
//!
//! `[registry]` chooses where the chain lives: `kind = "memory"` (the
//! default: in this process, nothing to install) or `kind = "etcd"`, shared by
//! every replica with the same `prefix` (see [`crate::registry::etcd`]):
//!
//! ```toml
//! [registry]
//! kind = "etcd"
//! endpoints = ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]
//! prefix = "/guardmesh/prod"
//! username = "guardmesh"
//! password_env = "GUARDMESH_ETCD_PASSWORD"   # or password = "..."
//! staleness_window_ms = 30000
//! after_window = "refuse"                    # or "serve_stale"
//! ```
//!
//! With etcd, `[[guard]]` entries are registered only where no guard of that
//! name is registered yet, so a replica restarting with an older file does
//! not roll back a change made through `GuardRegistry`.

use crate::link::LinkConfig;
use crate::mesh::MeshConfig;
use crate::security::auth::Role;
use crate::validate::Limits;
use guardmesh_proto::v1::{FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub mod check;
mod error;
pub mod keys;
pub use error::{ConfigError, DecisionLogError, LogSettingError, PolicyFileError, SettingError};

/// The whole config file. Every field has a default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the gRPC server.
    pub listen: SocketAddr,
    /// Address of the Prometheus metrics endpoint; none when unset.
    pub metrics_listen: Option<SocketAddr>,
    pub default_guard_timeout_ms: u64,
    pub default_batch_timeout_ms: u64,
    pub max_batch_timeout_ms: u64,
    pub limits: LimitsConfig,
    pub guard_links: LinksConfig,
    /// TLS on the mesh's listener.
    pub tls: Option<TlsConfig>,
    /// Authentication and roles. Absent: no authentication (a warning is
    /// printed at start).
    pub auth: Option<AuthConfig>,
    /// TLS towards `https://` guards.
    pub guard_tls: Option<GuardTlsConfig>,
    pub endpoint_policy: EndpointPolicyConfig,
    #[serde(rename = "guard")]
    pub guards: Vec<GuardConfig>,
    pub registry: RegistryConfig,
    /// `[server]`: the listener against silent and dead clients (R25).
    pub server: ServerConfig,
    /// What happens to a call no enforced guard applies to (R28):
    /// `proceed` (the default) or `cancel` (default deny).
    pub unguarded: crate::mesh::Unguarded,
    /// Whether `guardmesh serve` reloads the config's policy files when they
    /// change on disk (default); `false`: only on SIGHUP, for teams that roll
    /// policies out by signal.
    pub watch_policies: bool,
    /// `[decision_log]`: one record per batch answered and per chain
    /// change (R29). Absent: no log, at no cost.
    pub decision_log: Option<DecisionLogConfig>,
    /// `[sessions]`: the bounds of session memory (R34).
    pub sessions: SessionsConfig,
}

/// `[sessions]`: where session memory is kept and its bounds (R25, R34).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionsConfig {
    /// Where the memory is kept: with the registry (etcd when the registry
    /// is, else this mesh's memory), in this mesh's memory, or in Redis.
    pub store: SessionStoreKind,
    /// With `store = "redis"`: `redis://` or `rediss://` URL.
    pub redis_url: Option<String>,
    /// With `store = "redis"`: a file holding Redis's password (replaces
    /// the URL's).
    pub redis_password_file: Option<PathBuf>,
    /// The session secret that keys the digests (R34): required with a
    /// shared store, the same file on every replica.
    pub secret_file: Option<PathBuf>,
    /// Deadline of each operation on the store.
    pub store_timeout_ms: u64,
    pub max_bytes: usize,
    pub max_entries: usize,
    pub max_age_ms: u64,
    pub max_labels: usize,
    pub max_label_bytes: usize,
    pub max_values_per_result: usize,
    pub max_sessions: usize,
    pub max_sessions_per_identity: usize,
}

/// `[sessions] store`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStoreKind {
    /// etcd when the registry is etcd, else this mesh's memory.
    #[default]
    Registry,
    /// This mesh's memory: not shared with other replicas.
    Memory,
    /// Redis or Valkey at `redis_url`.
    Redis,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        let l = crate::session::SessionLimits::default();
        Self {
            store: SessionStoreKind::Registry,
            redis_url: None,
            redis_password_file: None,
            secret_file: None,
            store_timeout_ms: millis(crate::session::DEFAULT_STORE_TIMEOUT),
            max_bytes: l.max_bytes,
            max_entries: l.max_entries,
            max_age_ms: millis(l.max_age),
            max_labels: l.max_labels,
            max_label_bytes: l.max_label_bytes,
            max_values_per_result: l.max_values_per_result,
            max_sessions: l.max_sessions,
            max_sessions_per_identity: l.max_sessions_per_identity,
        }
    }
}

/// Where session memory is kept, as `[sessions] store` and `[registry]`
/// resolve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionPlace {
    /// This mesh's memory.
    Local,
    /// The registry's etcd.
    Etcd,
    /// Redis or Valkey at `redis_url`.
    Redis,
}

impl SessionPlace {
    /// Whether replicas share it (and so need one secret).
    pub fn shared(self) -> bool {
        !matches!(self, Self::Local)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "memory",
            Self::Etcd => "etcd",
            Self::Redis => "redis",
        }
    }
}

/// A `[sessions]` section that cannot start a mesh.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionsSettingError {
    #[error(
        "sessions.secret_file is not set, yet session memory is shared through {store}: every \
         replica must key the digests of values seen with the same secret, which is never \
         written into the store; {}",
        crate::session::secret::HOW_TO_CREATE
    )]
    NoSecret { store: &'static str },
    #[error(
        "sessions.store = \"redis\" needs sessions.redis_url, e.g. redis_url = \"redis://127.0.0.1:6379\""
    )]
    NoRedisUrl,
    #[error(
        "sessions.{key} is set but sessions.store is not \"redis\": set store = \"redis\", or remove {key}"
    )]
    RedisOnly { key: &'static str },
    #[error("{0}")]
    RedisUrl(String),
}

impl SessionsSettingError {
    /// The key at fault.
    pub fn key(&self) -> &'static str {
        match self {
            Self::NoSecret { .. } => "sessions.secret_file",
            Self::NoRedisUrl | Self::RedisUrl(_) => "sessions.redis_url",
            Self::RedisOnly { key } if *key == "redis_password_file" => {
                "sessions.redis_password_file"
            }
            Self::RedisOnly { .. } => "sessions.redis_url",
        }
    }
}

impl SessionsConfig {
    /// Where the memory is kept with `registry`, and whether the section can
    /// start a mesh there: a shared store needs `secret_file`; Redis needs a
    /// `redis_url` the store accepts.
    pub fn place(&self, registry: &RegistryConfig) -> Result<SessionPlace, SessionsSettingError> {
        let place = match (self.store, registry.kind) {
            (SessionStoreKind::Registry, RegistryKind::Etcd) => SessionPlace::Etcd,
            (SessionStoreKind::Registry | SessionStoreKind::Memory, _) => SessionPlace::Local,
            (SessionStoreKind::Redis, _) => SessionPlace::Redis,
        };
        if place != SessionPlace::Redis {
            if self.redis_url.is_some() {
                return Err(SessionsSettingError::RedisOnly { key: "redis_url" });
            }
            if self.redis_password_file.is_some() {
                return Err(SessionsSettingError::RedisOnly {
                    key: "redis_password_file",
                });
            }
        } else {
            let url = self
                .redis_url
                .as_deref()
                .ok_or(SessionsSettingError::NoRedisUrl)?;
            crate::session::redis::check_url(url)
                .map_err(|e| SessionsSettingError::RedisUrl(e.to_string()))?;
        }
        if place.shared() && self.secret_file.is_none() {
            return Err(SessionsSettingError::NoSecret {
                store: place.name(),
            });
        }
        Ok(place)
    }

    /// The deadline of each store operation.
    pub fn store_timeout(&self) -> Duration {
        Duration::from_millis(self.store_timeout_ms.max(1))
    }

    /// The bounds this section describes.
    pub fn limits(&self) -> crate::session::SessionLimits {
        crate::session::SessionLimits {
            max_bytes: self.max_bytes,
            max_entries: self.max_entries,
            max_age: Duration::from_millis(self.max_age_ms),
            max_labels: self.max_labels,
            max_label_bytes: self.max_label_bytes,
            max_values_per_result: self.max_values_per_result,
            max_sessions: self.max_sessions.max(1),
            max_sessions_per_identity: self.max_sessions_per_identity.max(1),
        }
    }
}

/// `[decision_log]` (R29).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionLogConfig {
    /// The log's directory (created if missing; one mesh per directory).
    pub dir: PathBuf,
    /// A file is rotated before it would grow past this size.
    #[serde(default = "default_max_file_bytes")]
    pub max_file_bytes: u64,
    /// `every_record` (the default): a batch is answered once its record is
    /// on disk (fdatasync, shared by concurrent batches); `interval`: once
    /// written to the file, synced every `sync_interval_ms`.
    #[serde(default)]
    pub durability: DurabilityConfig,
    /// With `durability = "interval"`: at most this long between a write
    /// and its fsync.
    #[serde(default = "default_sync_interval_ms")]
    pub sync_interval_ms: u64,
    /// Masking rules: key names (`password`), globs (`*.api_key`) and
    /// paths (`$.headers.authorization`), applied before anything is
    /// written.
    #[serde(default)]
    pub mask: Vec<String>,
    /// Secret formats masked wherever they appear in a record, whatever
    /// the key (`aws-access-key`, `github-token`, `stripe-live-key`,
    /// `private-key`); default: all of them; `[]`: none.
    #[serde(default = "default_mask_formats")]
    pub mask_formats: Vec<String>,
    /// `refuse` (the default): a batch whose record cannot be written is
    /// refused UNAVAILABLE; `answer`: answered, and the loss counted.
    #[serde(default)]
    pub on_log_failure: crate::decision_log::OnLogFailure,
    /// The mesh instance written in every record; default: the listen
    /// address.
    #[serde(default)]
    pub instance: Option<String>,
    /// Also export every record written as an OpenTelemetry log record
    /// over OTLP/gRPC, to where the standard `OTEL_EXPORTER_OTLP_*`
    /// variables say. The file stays the source of truth.
    #[serde(default)]
    pub otlp: bool,
    /// The Ed25519 private key (PKCS#8 PEM, `guardmesh log keygen`) that
    /// signs the log's checkpoints; absent: no checkpoints.
    #[serde(default)]
    pub signing_key: Option<PathBuf>,
    /// With a key: a checkpoint at least every this many records.
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: u64,
    /// With a key: a checkpoint at most this long after a record it does
    /// not seal yet.
    #[serde(default = "default_checkpoint_interval_ms")]
    pub checkpoint_interval_ms: u64,
    /// With a key: every checkpoint is also appended (fsynced) to this file,
    /// or to `checkpoints-<key id>.jsonl` in this directory; put it on
    /// another mount.
    #[serde(default)]
    pub witness: Option<PathBuf>,
    /// With a key: start on a log that ends before its latest checkpoint
    /// after a signed gap record, instead of refusing to start.
    #[serde(default)]
    pub allow_gap: bool,
    /// The most bytes the log's files may hold together; past nine tenths
    /// refusal records are left out (counted in summaries), at the budget
    /// records cannot be written and `on_log_failure` applies. None by
    /// default.
    #[serde(default)]
    pub max_dir_bytes: Option<u64>,
    /// The interval of the bounds on refusal records (default 10000).
    #[serde(default = "default_refusal_interval_ms")]
    pub refusal_interval_ms: u64,
    /// Refusal records per peer address per interval (default 20).
    #[serde(default = "default_refusal_records_per_peer")]
    pub refusal_records_per_peer: u32,
    /// Bytes of refusal records per peer address per interval (default
    /// 32768).
    #[serde(default = "default_refusal_bytes_per_peer")]
    pub refusal_bytes_per_peer: u64,
    /// Refusal records of the whole mesh per interval (default 200).
    #[serde(default = "default_refusal_records")]
    pub refusal_records: u32,
    /// Bytes of refusal records of the whole mesh per interval (default
    /// 262144).
    #[serde(default = "default_refusal_bytes")]
    pub refusal_bytes: u64,
}

fn default_mask_formats() -> Vec<String> {
    crate::secret_formats::KINDS
        .iter()
        .map(|kind| (*kind).to_owned())
        .collect()
}

fn default_checkpoint_every() -> u64 {
    crate::decision_log::checkpoint::DEFAULT_EVERY
}

fn default_checkpoint_interval_ms() -> u64 {
    crate::decision_log::checkpoint::DEFAULT_INTERVAL.as_millis() as u64
}

fn default_refusal_interval_ms() -> u64 {
    crate::decision_log::RefusalLimits::default()
        .interval
        .as_millis() as u64
}

fn default_refusal_records_per_peer() -> u32 {
    crate::decision_log::RefusalLimits::default().records_per_peer
}

fn default_refusal_bytes_per_peer() -> u64 {
    crate::decision_log::RefusalLimits::default().bytes_per_peer
}

fn default_refusal_records() -> u32 {
    crate::decision_log::RefusalLimits::default().records
}

fn default_refusal_bytes() -> u64 {
    crate::decision_log::RefusalLimits::default().bytes
}

/// `[decision_log] durability`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DurabilityConfig {
    #[default]
    EveryRecord,
    Interval,
}

fn default_max_file_bytes() -> u64 {
    64 * 1024 * 1024
}

fn default_sync_interval_ms() -> u64 {
    100
}

impl DecisionLogConfig {
    /// The bounds on refusal records and the directory's budget.
    pub fn limits(&self) -> Result<crate::decision_log::LogLimits, LogSettingError> {
        if self.refusal_interval_ms == 0 {
            return Err(LogSettingError::Zero {
                key: "refusal_interval_ms",
            });
        }
        if self.max_dir_bytes == Some(0) {
            return Err(LogSettingError::ZeroBudget);
        }
        Ok(crate::decision_log::LogLimits {
            refusals: crate::decision_log::RefusalLimits {
                interval: Duration::from_millis(self.refusal_interval_ms),
                records_per_peer: self.refusal_records_per_peer,
                bytes_per_peer: self.refusal_bytes_per_peer,
                records: self.refusal_records,
                bytes: self.refusal_bytes,
            },
            max_dir_bytes: self.max_dir_bytes,
        })
    }

    /// The writer's settings; `instance`: the default mesh instance name.
    pub fn log_config(
        &self,
        instance: &str,
    ) -> Result<crate::decision_log::LogConfig, LogSettingError> {
        let mask = crate::decision_log::MaskRules::new(&self.mask)?
            .with_formats(crate::secret_formats::Formats::named(&self.mask_formats)?);
        if self.max_file_bytes == 0 {
            return Err(LogSettingError::Zero {
                key: "max_file_bytes",
            });
        }
        let durability = match self.durability {
            DurabilityConfig::EveryRecord => crate::decision_log::Durability::EveryRecord,
            DurabilityConfig::Interval if self.sync_interval_ms == 0 => {
                return Err(LogSettingError::ZeroSync);
            }
            DurabilityConfig::Interval => crate::decision_log::Durability::Interval(
                Duration::from_millis(self.sync_interval_ms),
            ),
        };
        let seal = match &self.signing_key {
            None if self.witness.is_some() || self.allow_gap => {
                return Err(LogSettingError::NeedsKey);
            }
            None => None,
            Some(_) if self.checkpoint_every == 0 => {
                return Err(LogSettingError::Zero {
                    key: "checkpoint_every",
                });
            }
            Some(_)
                if self.checkpoint_interval_ms
                    < crate::decision_log::checkpoint::MIN_INTERVAL.as_millis() as u64 =>
            {
                return Err(LogSettingError::CheckpointInterval {
                    min: millis(crate::decision_log::checkpoint::MIN_INTERVAL),
                });
            }
            Some(key) => Some(crate::decision_log::SealConfig {
                key_file: key.clone(),
                every: self.checkpoint_every,
                interval: Duration::from_millis(self.checkpoint_interval_ms),
                witness: self.witness.clone(),
                allow_gap: self.allow_gap,
            }),
        };
        Ok(crate::decision_log::LogConfig {
            max_file_bytes: self.max_file_bytes,
            durability,
            mask,
            otlp: self.otlp,
            seal,
            ..crate::decision_log::LogConfig::new(
                &self.dir,
                self.instance.as_deref().unwrap_or(instance),
            )
        })
    }
}

impl Default for Config {
    fn default() -> Self {
        let mesh = MeshConfig::default();
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            metrics_listen: None,
            default_guard_timeout_ms: millis(mesh.default_guard_timeout),
            default_batch_timeout_ms: millis(mesh.default_batch_timeout),
            max_batch_timeout_ms: millis(mesh.max_batch_timeout),
            limits: LimitsConfig::default(),
            guard_links: LinksConfig::default(),
            tls: None,
            auth: None,
            guard_tls: None,
            endpoint_policy: EndpointPolicyConfig::default(),
            guards: Vec::new(),
            registry: RegistryConfig::default(),
            server: ServerConfig::default(),
            unguarded: crate::mesh::Unguarded::Proceed,
            watch_policies: true,
            decision_log: None,
            sessions: SessionsConfig::default(),
        }
    }
}

/// `[server]`: how the gRPC listener treats connections that say nothing
/// (R25).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Time a new connection has to finish its TLS handshake and send the
    /// HTTP/2 preface and first SETTINGS frame before it is closed.
    pub handshake_timeout_ms: u64,
    /// HTTP/2 PING interval on connections the mesh hears nothing from; 0:
    /// no pings.
    pub keepalive_interval_ms: u64,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout_ms: u64,
    /// Most client connections open at once; past it new ones are closed
    /// at once. 0: the open-file limit less a reserve (1/8, at least 64).
    pub max_connections: usize,
    /// After SIGTERM or SIGINT, how long in-flight batches have to be
    /// answered before the process exits anyway (cutting them). Default
    /// 25000: under Kubernetes' 30 s `terminationGracePeriodSeconds` with
    /// room for a 5 s preStop delay. 0: exit at once.
    pub shutdown_grace_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let l = crate::security::tls::ListenerLimits::default();
        Self {
            handshake_timeout_ms: millis(l.handshake_timeout),
            keepalive_interval_ms: l.keepalive_interval.map_or(0, millis),
            keepalive_timeout_ms: millis(l.keepalive_timeout),
            max_connections: l.max_connections,
            shutdown_grace_ms: DEFAULT_SHUTDOWN_GRACE_MS,
        }
    }
}

/// `[server] shutdown_grace_ms` by default.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 25_000;

impl ServerConfig {
    /// `shutdown_grace_ms` as a duration.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }

    pub fn listener_limits(&self) -> crate::security::tls::ListenerLimits {
        crate::security::tls::ListenerLimits {
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            keepalive_interval: (self.keepalive_interval_ms > 0)
                .then(|| Duration::from_millis(self.keepalive_interval_ms)),
            keepalive_timeout: Duration::from_millis(self.keepalive_timeout_ms),
            max_connections: self.max_connections,
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `[limits]`: what coordinators may send (R20).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    pub max_calls_per_batch: usize,
    pub max_batch_bytes: usize,
    pub max_argument_bytes: usize,
    pub max_inflight_batches: usize,
    pub max_batches_per_stream: usize,
    /// Deepest nesting in one call's arguments, 1..=127.
    pub max_json_depth: usize,
    pub max_id_bytes: usize,
    pub max_metadata_entries: usize,
    pub max_inflight_bytes: usize,
    pub max_stream_bytes: usize,
    pub max_coordinator_streams: usize,
    /// Longest tool name a batch may carry (R20), 1..=1024.
    pub max_tool_name_chars: usize,
    /// Printable ASCII characters tool names may hold besides letters,
    /// digits, `_`, `-` and `.` (R20); nothing else can be allowed.
    pub tool_name_extra_chars: String,
    /// Largest result of one call sent to be judged (R33).
    pub max_result_bytes: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let l = Limits::default();
        Self {
            max_calls_per_batch: l.max_calls_per_batch,
            max_batch_bytes: l.max_batch_bytes,
            max_argument_bytes: l.max_argument_bytes,
            max_inflight_batches: l.max_inflight_batches,
            max_batches_per_stream: l.max_batches_per_stream,
            max_json_depth: l.max_json_depth,
            max_id_bytes: l.max_id_bytes,
            max_metadata_entries: l.max_metadata_entries,
            max_inflight_bytes: l.max_inflight_bytes,
            max_stream_bytes: l.max_stream_bytes,
            max_coordinator_streams: l.max_coordinator_streams,
            max_tool_name_chars: l.tool_names.max_chars,
            tool_name_extra_chars: String::new(),
            max_result_bytes: l.max_result_bytes,
        }
    }
}

/// `[guard_links]`: how the mesh dials guards.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinksConfig {
    pub connect_timeout_ms: u64,
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// Largest answer accepted from a guard.
    pub max_answer_bytes: usize,
    /// Consecutive failures that open a guard's circuit; 0 disables it.
    pub circuit_failures: u32,
    /// How long an open circuit fails at once before one probe goes through.
    pub circuit_open_ms: u64,
    /// HTTP/2 PING after this long without a frame from the guard (0: off).
    /// Below 300000 (what default grpcio servers accept, R26) only with
    /// `keepalive_force`.
    pub keepalive_interval_ms: u64,
    pub keepalive_timeout_ms: u64,
    /// Accept a `keepalive_interval_ms` below 300000 (guards whose servers
    /// are configured to allow it).
    pub keepalive_force: bool,
    /// TCP keepalive and TCP_USER_TIMEOUT: a vanished guard host is noticed
    /// within about this long (0: off).
    pub dead_peer_timeout_ms: u64,
    /// Bytes of requests queued for a guard that is not reading them; past
    /// it, batches fail at that guard per its policy (R25).
    pub max_queued_bytes: usize,
    /// How often a guard endpoint that is a DNS name is resolved again for
    /// its replicas (R32); a failed connection asks sooner.
    pub resolve_interval_ms: u64,
}

impl Default for LinksConfig {
    fn default() -> Self {
        let l = LinkConfig::default();
        Self {
            connect_timeout_ms: millis(l.connect_timeout),
            backoff_initial_ms: millis(l.backoff_initial),
            backoff_max_ms: millis(l.backoff_max),
            max_answer_bytes: l.max_decoding_message_size,
            circuit_failures: l.circuit_failures,
            circuit_open_ms: millis(l.circuit_open_for),
            keepalive_interval_ms: millis(l.keepalive_interval),
            keepalive_timeout_ms: millis(l.keepalive_timeout),
            keepalive_force: false,
            dead_peer_timeout_ms: millis(l.dead_peer_timeout),
            max_queued_bytes: l.max_queued_bytes,
            resolve_interval_ms: millis(crate::link::discover::dns::DEFAULT_RESOLVE_INTERVAL),
        }
    }
}

impl LinksConfig {
    /// Refuses link settings that default guard servers would punish (R26)
    /// or that cannot work.
    fn problems(&self, out: &mut Vec<SettingError>) {
        let floor = millis(crate::link::MIN_PEER_PING_INTERVAL);
        if self.keepalive_interval_ms != 0
            && self.keepalive_interval_ms < floor
            && !self.keepalive_force
        {
            out.push(SettingError::KeepaliveBelowFloor {
                got: self.keepalive_interval_ms,
                floor,
            });
        }
        if self.keepalive_interval_ms != 0 && self.keepalive_timeout_ms == 0 {
            out.push(SettingError::Zero {
                key: "guard_links.keepalive_timeout_ms",
            });
        }
        if self.dead_peer_timeout_ms != 0 && self.dead_peer_timeout_ms < 2000 {
            out.push(SettingError::DeadPeerTooShort {
                got: self.dead_peer_timeout_ms,
            });
        }
        if self.max_queued_bytes == 0 {
            out.push(SettingError::Zero {
                key: "guard_links.max_queued_bytes",
            });
        }
        if self.resolve_interval_ms < millis(crate::link::discover::dns::MIN_RESOLVE_GAP) {
            out.push(SettingError::ResolveIntervalTooShort {
                got: self.resolve_interval_ms,
            });
        }
    }

    /// How often guard endpoints that are DNS names are resolved again
    /// (R32): what [`crate::link::discover::dns::watch_endpoint`] takes.
    pub fn resolve_interval(&self) -> Duration {
        Duration::from_millis(self.resolve_interval_ms)
            .max(crate::link::discover::dns::MIN_RESOLVE_GAP)
    }
}

/// `[registry]`: where the chain lives.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    pub kind: RegistryKind,
    /// etcd client URLs (`http://host:port`; `https://` needs the
    /// `etcd-tls` build feature).
    pub endpoints: Vec<String>,
    /// Key prefix of the chain: replicas with the same prefix share it.
    pub prefix: String,
    pub username: Option<String>,
    pub password: Option<String>,
    /// Name of an environment variable holding the password, to keep the
    /// secret out of the file.
    pub password_env: Option<String>,
    /// PEM roots for etcd's certificate.
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate and key, for etcd's client-cert auth.
    pub cert_file: Option<std::path::PathBuf>,
    pub key_file: Option<std::path::PathBuf>,
    /// Name to verify etcd's certificate against.
    pub tls_domain: Option<String>,
    /// How long start-up may try to reach etcd.
    pub dial_timeout_ms: u64,
    /// Deadline of each etcd request and of the watch's probe answers.
    pub request_timeout_ms: u64,
    /// How often a replica probes its watch and a guard heartbeat renews.
    pub heartbeat_interval_ms: u64,
    /// Time to live of a guard's heartbeat lease, in seconds.
    pub lease_ttl_s: u64,
    /// How long a replica that lost etcd keeps judging with its last chain.
    pub staleness_window_ms: u64,
    /// After that: `refuse` (UNAVAILABLE, the default) or `serve_stale`.
    pub after_window: crate::registry::etcd::AfterWindow,
    /// Bytes of compiled policies the guards one identity registered may
    /// hold together (R25); default 64 MiB. Checked at registration, freed
    /// on deregistration.
    pub max_policy_bytes_per_identity: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegistryKind {
    /// In this process, seeded from `[[guard]]`; one replica.
    #[default]
    Memory,
    /// In etcd, shared by every replica with the same prefix.
    Etcd,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        let e = crate::registry::etcd::EtcdConfig::default();
        Self {
            kind: RegistryKind::Memory,
            endpoints: e.endpoints,
            prefix: e.prefix,
            username: None,
            password: None,
            password_env: None,
            ca_file: None,
            cert_file: None,
            key_file: None,
            tls_domain: None,
            dial_timeout_ms: millis(e.dial_timeout),
            request_timeout_ms: millis(e.request_timeout),
            heartbeat_interval_ms: millis(e.heartbeat_interval),
            lease_ttl_s: e.lease_ttl.as_secs(),
            staleness_window_ms: millis(e.staleness_window),
            after_window: e.after_window,
            max_policy_bytes_per_identity:
                crate::registry::registration::DEFAULT_MAX_POLICY_BYTES_PER_IDENTITY,
        }
    }
}

impl RegistryConfig {
    /// The etcd registry's own settings from this section. Reads
    /// `password_env` here, so a missing secret fails start-up, not the
    /// first request.
    pub fn etcd(
        &self,
    ) -> Result<crate::registry::etcd::EtcdConfig, crate::registry::etcd::ConnectError> {
        use crate::registry::etcd::{ConnectError, EtcdConfig, TlsFiles};
        let password = match (&self.password, &self.password_env) {
            (Some(_), Some(_)) => {
                return Err(ConnectError::Config(
                    "[registry] sets both password and password_env".into(),
                ));
            }
            (Some(password), None) => Some(password.clone()),
            (None, Some(var)) => Some(std::env::var(var).map_err(|_| {
                ConnectError::Config(format!(
                    "[registry] password_env names {var:?}, which is not set"
                ))
            })?),
            (None, None) => None,
        };
        let tls = (self.ca_file.is_some()
            || self.cert_file.is_some()
            || self.key_file.is_some()
            || self.tls_domain.is_some())
        .then(|| TlsFiles {
            ca_file: self.ca_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            domain: self.tls_domain.clone(),
        });
        Ok(EtcdConfig {
            endpoints: self.endpoints.clone(),
            prefix: self.prefix.clone(),
            username: self.username.clone(),
            password,
            tls,
            dial_timeout: Duration::from_millis(self.dial_timeout_ms),
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            heartbeat_interval: Duration::from_millis(self.heartbeat_interval_ms),
            lease_ttl: Duration::from_secs(self.lease_ttl_s),
            staleness_window: Duration::from_millis(self.staleness_window_ms),
            after_window: self.after_window,
        })
    }
}

/// `[tls]`: the mesh's certificate, and the CA of client certificates.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// With it, every client must present a certificate signed by this CA.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

/// `[auth]`: who may do what.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Accept bearer tokens over plaintext when the client is on loopback.
    /// For local development only.
    #[serde(default)]
    pub plaintext_tokens_on_loopback: bool,
    /// With `[tls] client_ca_file`: let a caller without a certificate
    /// authenticate with a bearer token alone (default false: with a client
    /// CA every connection needs a certificate, R24).
    #[serde(default)]
    pub tokens_without_client_cert: bool,
    #[serde(default, rename = "principal")]
    pub principals: Vec<PrincipalConfig>,
}

/// `[[auth.principal]]`: an identity (certificate URI SAN, or a token's
/// name) and its roles.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalConfig {
    pub id: String,
    pub roles: Vec<Role>,
    /// A file holding this principal's bearer token (one line). Without it
    /// the principal is matched by its certificate's URI SAN.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// For `register`: the guard names it may manage start with one of these.
    #[serde(default)]
    pub name_prefixes: Vec<String>,
    /// For `register`: most guards it may have registered (default 64).
    #[serde(default = "default_max_registrations")]
    pub max_registrations: usize,
}

fn default_max_registrations() -> usize {
    64
}

/// `[guard_tls]`: how the mesh verifies `https://` guards, and the client
/// certificate it presents to guards that require mTLS.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardTlsConfig {
    pub ca_file: PathBuf,
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

/// `[endpoint_policy]`: which guard endpoints may be registered and dialed.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EndpointPolicyConfig {
    /// CIDRs, addresses and host names (`*.suffix` allowed). Empty: any
    /// host that is not denied.
    pub allow: Vec<String>,
    /// Refuse link-local and cloud metadata addresses (169.254.0.0/16,
    /// fe80::/10, metadata host names).
    pub deny_link_local: bool,
}

impl Default for EndpointPolicyConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            deny_link_local: true,
        }
    }
}

/// Why the security settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    Tls(#[from] crate::security::tls::TlsError),
    #[error("[endpoint_policy]: {0}")]
    Policy(#[from] crate::link::dial::AllowListError),
    #[error("[auth] principal {id:?}: cannot read token file {path}: {source}")]
    Token {
        id: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("[auth] principal {0:?}: its token file is empty")]
    EmptyToken(String),
    #[error("[[guard]] entry {index} ({name:?}): {source}")]
    Guard {
        index: usize,
        name: String,
        #[source]
        source: Box<crate::registry::spec::SpecError>,
    },
    #[error(
        "[[guard]] entry {index} ({name:?}): endpoint {endpoint} is refused by the endpoint policy: {why}"
    )]
    GuardEndpoint {
        index: usize,
        name: String,
        endpoint: String,
        why: String,
    },
    #[error("[[guard]] entry {index} ({name:?}): its check was interrupted")]
    GuardInterrupted { index: usize, name: String },
}

/// `[[guard]]`: one registration (R16).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    pub name: String,
    /// A remote guard's address; exactly one of `endpoint` and `policy`.
    #[serde(default)]
    pub endpoint: String,
    /// A policy guard's file of CEL rules (R27), relative to the config
    /// file's folder; exactly one of `endpoint` and `policy`.
    #[serde(default)]
    pub policy: Option<std::path::PathBuf>,
    /// The policy file's text, read by [`Config::load`].
    #[serde(skip)]
    pub policy_source: Option<String>,
    #[serde(default, deserialize_with = "by_name")]
    pub role: GuardRole,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub timeout_ms: u32,
    #[serde(default, deserialize_with = "by_name")]
    pub failure_policy: FailurePolicy,
    #[serde(default)]
    pub priority: i32,
    #[serde(default, deserialize_with = "by_name")]
    pub mode: GuardMode,
    #[serde(default)]
    pub grant: Option<GrantConfig>,
    /// For `https://` endpoints: the identity the guard must present.
    #[serde(default)]
    pub server_identity: Option<String>,
    /// R32: the guard's replicas (with `endpoint`, one more each).
    #[serde(default)]
    pub replicas: Vec<String>,
    /// The phases it judges (R33): `calls` (default), `results` or `both`.
    #[serde(default, deserialize_with = "by_name")]
    pub phases: guardmesh_proto::v1::GuardPhases,
    /// For mutate guards judging results: the tools whose results they may
    /// rewrite (R11, R33).
    #[serde(default)]
    pub result_grant: Option<ResultGrantConfig>,
    /// Whether it is sent its batch's session memory (R34): `send`
    /// (default) or `none`.
    #[serde(default, deserialize_with = "by_name")]
    pub session_memory: guardmesh_proto::v1::SessionMemoryUse,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultGrantConfig {
    #[serde(default)]
    pub tools: Vec<String>,
}

/// Reads an enum of the contract by its one spelling (`fail_closed`,
/// `dry_run`, ...), see `guardmesh_proto`'s names.
fn by_name<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = guardmesh_proto::UnknownName>,
{
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(serde::de::Error::custom)
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantConfig {
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub may_rename: bool,
}

impl GuardConfig {
    pub fn to_spec(&self) -> GuardSpec {
        GuardSpec {
            name: self.name.clone(),
            endpoint: self.endpoint.clone(),
            role: self.role as i32,
            tools: self.tools.clone(),
            timeout_ms: self.timeout_ms,
            failure_policy: self.failure_policy as i32,
            priority: self.priority,
            mode: self.mode as i32,
            grant: self.grant.as_ref().map(|g| RewriteGrant {
                tools: g.tools.clone(),
                may_rename: g.may_rename,
            }),
            server_identity: self.server_identity.clone().unwrap_or_default(),
            policy: self.policy_source.clone().unwrap_or_default(),
            replicas: self.replicas.clone(),
            phases: self.phases as i32,
            result_grant: self
                .result_grant
                .as_ref()
                .map(|g| guardmesh_proto::v1::ResultGrant {
                    tools: g.tools.clone(),
                }),
            // Registered over `GuardRegistry` only (SEP-2624 listing).
            interceptor_events: Vec::new(),
            session_memory: self.session_memory as i32,
        }
    }
}

/// The line of each `[[guard]]` entry's `name`, in file order (empty when
/// the text does not parse this way).
fn guard_name_lines(text: &str) -> Vec<usize> {
    #[derive(Deserialize)]
    struct Names {
        #[serde(default, rename = "guard")]
        guards: Vec<Name>,
    }
    #[derive(Deserialize)]
    struct Name {
        name: toml::Spanned<String>,
    }
    toml::from_str::<Names>(text).map_or_else(
        |_| Vec::new(),
        |names| {
            names
                .guards
                .iter()
                .map(|g| text[..g.name.span().start].matches('\n').count() + 1)
                .collect()
        },
    )
}

impl Config {
    /// The decision log's settings for a mesh whose default instance name
    /// is `instance`; with a signing key and the etcd registry, the
    /// checkpoints are anchored in etcd under the registry's prefix, named
    /// by `[decision_log] instance`, or else by the host name and the log
    /// directory (see [`crate::decision_log::anchor`]).
    pub fn decision_log_settings(
        &self,
        section: &DecisionLogConfig,
        instance: &str,
    ) -> Result<crate::decision_log::LogConfig, DecisionLogError> {
        let mut settings = section.log_config(instance)?;
        if self.registry.kind == RegistryKind::Etcd && settings.seal.is_some() {
            let registry = self.registry.etcd()?;
            let etcd = crate::decision_log::anchor::EtcdConfig {
                endpoints: registry.endpoints,
                prefix: registry.prefix,
                username: registry.username,
                password: registry.password,
                tls: registry.tls,
                dial_timeout: registry.dial_timeout,
                request_timeout: registry.request_timeout,
            };
            let instance = section
                .instance
                .clone()
                .unwrap_or_else(|| crate::decision_log::anchor::default_instance(&section.dir));
            settings.anchor = Some(crate::decision_log::anchor::AnchorConfig { etcd, instance });
        }
        Ok(settings)
    }

    /// Parses a config from TOML text; `origin` names it in errors.
    /// Relative paths stay as written: [`load`](Self::load) resolves them.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.to_owned(),
            source,
        })?;
        // What serde read is also what the reference lists (keys::KEYS): a
        // key read here without a reference entry refuses the file.
        if let Some(source) = keys::walk(text).into_iter().next() {
            return Err(ConfigError::Key {
                path: origin.to_owned(),
                source,
            });
        }
        let invalid = |source| ConfigError::Invalid {
            path: origin.to_owned(),
            source,
        };
        if let Some(shape) = config.guard_shapes().into_iter().next() {
            return Err(invalid(shape));
        }
        if let Some((first, second)) = config.duplicate_guard() {
            let lines = guard_name_lines(text);
            return Err(invalid(SettingError::DuplicateGuard {
                first: first + 1,
                second: second + 1,
                name: config.guards[second].name.trim().to_owned(),
                lines: lines.get(first).copied().zip(lines.get(second).copied()),
            }));
        }
        Ok(config)
    }

    /// Every `[[guard]]` entry that is not exactly one of remote and policy.
    fn guard_shapes(&self) -> Vec<SettingError> {
        self.guards
            .iter()
            .enumerate()
            .filter_map(|(i, guard)| {
                let endpoint = !guard.endpoint.trim().is_empty() || !guard.replicas.is_empty();
                let (index, name) = (i + 1, guard.name.clone());
                match (endpoint, guard.policy.is_some()) {
                    (true, true) => Some(SettingError::GuardBoth { index, name }),
                    (false, false) => Some(SettingError::GuardNeither { index, name }),
                    _ => None,
                }
            })
            .collect()
    }

    /// The first two `[[guard]]` entries (0-based) that share a name, as
    /// registration compares names (trimmed).
    pub fn duplicate_guard(&self) -> Option<(usize, usize)> {
        let mut seen = std::collections::HashMap::new();
        for (i, guard) in self.guards.iter().enumerate() {
            if let Some(first) = seen.insert(guard.name.trim(), i) {
                return Some((first, i));
            }
        }
        None
    }

    /// What is accepted but probably not meant, in the `[[guard]]` entries;
    /// printed as warnings at start.
    pub fn guard_warnings(&self) -> Vec<String> {
        let default = Duration::from_millis(self.default_guard_timeout_ms);
        self.guards
            .iter()
            .enumerate()
            // A policy guard is a validate guard, with none of these
            // warnings: its policy is not compiled here (admission does).
            .filter(|(_, g)| g.policy.is_none())
            .filter_map(|(i, g)| {
                let guard = crate::registry::spec::Guard::from_spec(&g.to_spec(), default).ok()?;
                Some(
                    guard
                        .warnings()
                        .into_iter()
                        .map(move |w| format!("[[guard]] entry {}: {w}", i + 1)),
                )
            })
            .flatten()
            .collect()
    }

    /// Refuses settings that cannot work (they would fail every guard or
    /// refuse every batch), naming the key: the first of [`problems`](Self::problems).
    pub fn check(&self) -> Result<(), SettingError> {
        match self.problems().into_iter().next() {
            Some(problem) => Err(problem),
            None => Ok(()),
        }
    }

    /// Every setting that cannot work, in key order, each naming its key.
    pub fn problems(&self) -> Vec<SettingError> {
        let mut out = self.guard_shapes();
        let positive = [
            ("default_guard_timeout_ms", self.default_guard_timeout_ms),
            ("default_batch_timeout_ms", self.default_batch_timeout_ms),
            ("max_batch_timeout_ms", self.max_batch_timeout_ms),
            (
                "limits.max_calls_per_batch",
                self.limits.max_calls_per_batch as u64,
            ),
            ("limits.max_batch_bytes", self.limits.max_batch_bytes as u64),
            (
                "limits.max_result_bytes",
                self.limits.max_result_bytes as u64,
            ),
            (
                "limits.max_argument_bytes",
                self.limits.max_argument_bytes as u64,
            ),
            (
                "limits.max_inflight_batches",
                self.limits.max_inflight_batches as u64,
            ),
            (
                "limits.max_batches_per_stream",
                self.limits.max_batches_per_stream as u64,
            ),
            ("limits.max_id_bytes", self.limits.max_id_bytes as u64),
            (
                "limits.max_metadata_entries",
                self.limits.max_metadata_entries as u64,
            ),
            (
                "limits.max_inflight_bytes",
                self.limits.max_inflight_bytes as u64,
            ),
            (
                "limits.max_stream_bytes",
                self.limits.max_stream_bytes as u64,
            ),
            (
                "limits.max_coordinator_streams",
                self.limits.max_coordinator_streams as u64,
            ),
            (
                "guard_links.connect_timeout_ms",
                self.guard_links.connect_timeout_ms,
            ),
            (
                "guard_links.max_answer_bytes",
                self.guard_links.max_answer_bytes as u64,
            ),
            (
                "server.handshake_timeout_ms",
                self.server.handshake_timeout_ms,
            ),
            (
                "server.keepalive_timeout_ms",
                self.server.keepalive_timeout_ms,
            ),
            (
                "registry.max_policy_bytes_per_identity",
                self.registry.max_policy_bytes_per_identity as u64,
            ),
            ("sessions.store_timeout_ms", self.sessions.store_timeout_ms),
        ];
        for (key, value) in positive {
            if value == 0 {
                out.push(SettingError::Zero { key });
            }
        }
        if let Some((first, second)) = self.duplicate_guard() {
            out.push(SettingError::DuplicateGuard {
                first: first + 1,
                second: second + 1,
                name: self.guards[second].name.trim().to_owned(),
                lines: None,
            });
        }
        let depth = self.limits.max_json_depth;
        let most = crate::validate::ijson::MAX_DEPTH_LIMIT;
        if depth == 0 || depth > most {
            out.push(SettingError::JsonDepth { got: depth, most });
        }
        if let Err(error) = self.tool_names() {
            out.push(SettingError::ToolNames(error));
        }
        if let Some(log) = &self.decision_log {
            if let Err(error) = log.log_config("") {
                out.push(error.into());
            }
            if let Err(error) = log.limits() {
                out.push(error.into());
            }
        }
        self.guard_links.problems(&mut out);
        out
    }

    /// Reads the policy file of every policy guard (R27), relative to
    /// `folder`, and refuses one that does not compile, naming its line.
    pub fn read_policies(&mut self, folder: &Path) -> Result<(), PolicyFileError> {
        for (i, guard) in self.guards.iter_mut().enumerate() {
            let Some(file) = &guard.policy else { continue };
            // Resolved against the config's folder already
            // (`resolve_paths`): joined again only if it is still relative
            // to it, never twice.
            let file = if file.starts_with(folder) {
                file.clone()
            } else {
                folder.join(file)
            };
            let source = crate::files::read_to_string(&file, crate::files::MAX_POLICY_FILE_BYTES)
                .map_err(|source| PolicyFileError::Read {
                index: i + 1,
                name: guard.name.clone(),
                path: file.clone(),
                source,
            })?;
            crate::policy::Policy::compile(&source).map_err(|source| PolicyFileError::Compile {
                index: i + 1,
                name: guard.name.clone(),
                path: file.clone(),
                source: Box::new(source),
            })?;
            // R27: a rule naming a tool the guard is never sent is reported
            // (the file compiled just above: not compiled again).
            for never in
                crate::policy::never_sent_compiled(&source, &guard.tools).unwrap_or_default()
            {
                tracing::warn!(guard = %guard.name, file = %file.display(), "{never}");
            }
            guard.policy_source = Some(source);
        }
        Ok(())
    }

    /// Makes every relative path of the config (each key of type path in
    /// the reference) relative to `folder`, the config file's folder.
    pub fn resolve_paths(&mut self, folder: &Path) {
        let resolve = |path: &mut PathBuf| {
            if path.is_relative() {
                *path = folder.join(&*path);
            }
        };
        let resolve_opt = |path: &mut Option<PathBuf>| {
            if let Some(path) = path {
                resolve(path);
            }
        };
        if let Some(tls) = &mut self.tls {
            resolve(&mut tls.cert_file);
            resolve(&mut tls.key_file);
            resolve_opt(&mut tls.client_ca_file);
        }
        if let Some(auth) = &mut self.auth {
            for principal in &mut auth.principals {
                resolve_opt(&mut principal.token_file);
            }
        }
        if let Some(guard_tls) = &mut self.guard_tls {
            resolve(&mut guard_tls.ca_file);
            resolve_opt(&mut guard_tls.cert_file);
            resolve_opt(&mut guard_tls.key_file);
        }
        for guard in &mut self.guards {
            resolve_opt(&mut guard.policy);
        }
        resolve_opt(&mut self.registry.ca_file);
        resolve_opt(&mut self.registry.cert_file);
        resolve_opt(&mut self.registry.key_file);
        resolve_opt(&mut self.sessions.secret_file);
        resolve_opt(&mut self.sessions.redis_password_file);
        if let Some(log) = &mut self.decision_log {
            resolve(&mut log.dir);
            resolve_opt(&mut log.signing_key);
            resolve_opt(&mut log.witness);
        }
    }

    /// The folder relative paths of the config file at `path` are relative
    /// to.
    pub fn folder_of(path: &Path) -> &Path {
        match path.parent() {
            Some(folder) if !folder.as_os_str().is_empty() => folder,
            _ => Path::new("."),
        }
    }

    /// Reads and parses a config file; relative paths in it are relative to
    /// its folder.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let text = crate::files::read_to_string(path, crate::files::MAX_CONFIG_FILE_BYTES)
            .map_err(|source| ConfigError::Read {
                path: shown.clone(),
                source,
            })?;
        let mut config = Self::parse(&text, &shown)?;
        let folder = Self::folder_of(path);
        config.resolve_paths(folder);
        config
            .read_policies(folder)
            .map_err(|source| ConfigError::Policy {
                path: shown.clone(),
                source,
            })?;
        config.check().map_err(|source| ConfigError::Invalid {
            path: shown,
            source,
        })?;
        Ok(config)
    }

    /// The tool-name grammar of `[limits]` (R20).
    fn tool_names(
        &self,
    ) -> Result<crate::validate::ToolNameGrammar, crate::validate::names::GrammarError> {
        crate::validate::ToolNameGrammar::new(
            self.limits.max_tool_name_chars,
            &self.limits.tool_name_extra_chars,
        )
    }

    /// The mesh settings this config describes.
    pub fn mesh_config(&self) -> MeshConfig {
        MeshConfig {
            default_guard_timeout: Duration::from_millis(self.default_guard_timeout_ms),
            default_batch_timeout: Duration::from_millis(self.default_batch_timeout_ms),
            max_batch_timeout: Duration::from_millis(self.max_batch_timeout_ms),
            limits: Limits {
                max_calls_per_batch: self.limits.max_calls_per_batch,
                max_batch_bytes: self.limits.max_batch_bytes,
                max_argument_bytes: self.limits.max_argument_bytes,
                max_inflight_batches: self.limits.max_inflight_batches.max(1),
                max_batches_per_stream: self.limits.max_batches_per_stream.max(1),
                max_json_depth: self.limits.max_json_depth,
                max_id_bytes: self.limits.max_id_bytes,
                max_metadata_entries: self.limits.max_metadata_entries,
                max_inflight_bytes: self.limits.max_inflight_bytes,
                max_stream_bytes: self.limits.max_stream_bytes,
                max_coordinator_streams: self.limits.max_coordinator_streams,
                // Checked by `check`; a config that skipped it gets the default.
                tool_names: self.tool_names().unwrap_or_default(),
                max_result_bytes: self.limits.max_result_bytes,
            },
            link: LinkConfig {
                connect_timeout: Duration::from_millis(self.guard_links.connect_timeout_ms),
                backoff_initial: Duration::from_millis(self.guard_links.backoff_initial_ms.max(1)),
                backoff_max: Duration::from_millis(self.guard_links.backoff_max_ms.max(1)),
                max_decoding_message_size: self.guard_links.max_answer_bytes,
                circuit_failures: self.guard_links.circuit_failures,
                circuit_open_for: Duration::from_millis(self.guard_links.circuit_open_ms),
                keepalive_interval: Duration::from_millis(self.guard_links.keepalive_interval_ms),
                keepalive_timeout: Duration::from_millis(self.guard_links.keepalive_timeout_ms),
                dead_peer_timeout: Duration::from_millis(self.guard_links.dead_peer_timeout_ms),
                max_queued_bytes: self.guard_links.max_queued_bytes,
                resolve_interval: self.guard_links.resolve_interval(),
                ..LinkConfig::default()
            },
            security: MeshConfig::default().security,
            sessions: self.sessions.limits(),
            unguarded: self.unguarded,
            max_policy_bytes_per_identity: self.registry.max_policy_bytes_per_identity,
        }
    }

    /// The mesh settings with the security sections loaded (certificate,
    /// key and token files are read here), the `[[guard]]` entries checked
    /// as a `Register` call is.
    pub fn build(&self) -> Result<MeshConfig, SecurityError> {
        self.build_with_guards().map(|(config, _)| config)
    }

    /// [`build`](Self::build), and the `[[guard]]` entries admitted, in
    /// file order, for the registry: each checked once, by the admission a
    /// `Register` call goes through (R16).
    pub fn build_with_guards(
        &self,
    ) -> Result<(MeshConfig, Vec<crate::registry::CheckedGuard>), SecurityError> {
        let config = self.build_security()?;
        let admission = crate::registry::Admission::of(&config);
        let mut guards = Vec::with_capacity(self.guards.len());
        for (i, g) in self.guards.iter().enumerate() {
            let guard =
                crate::registry::admit_blocking(g.to_spec(), &admission).map_err(|error| {
                    match error {
                        crate::registry::AdmitError::Endpoint {
                            name,
                            endpoint,
                            why,
                        } => SecurityError::GuardEndpoint {
                            index: i + 1,
                            name,
                            endpoint,
                            why,
                        },
                        crate::registry::AdmitError::Invalid(source) => SecurityError::Guard {
                            index: i + 1,
                            name: g.name.clone(),
                            source: Box::new(source),
                        },
                        crate::registry::AdmitError::Interrupted => {
                            SecurityError::GuardInterrupted {
                                index: i + 1,
                                name: g.name.clone(),
                            }
                        }
                    }
                })?;
            guards.push(guard);
        }
        Ok((config, guards))
    }

    fn build_security(&self) -> Result<MeshConfig, SecurityError> {
        let mut config = self.mesh_config();
        let security = &mut config.security;
        security.listener = self.server.listener_limits();
        if let Some(tls) = &self.tls {
            security.server_tls = Some(crate::security::tls::ServerTls::new(
                &tls.cert_file,
                &tls.key_file,
                tls.client_ca_file.as_deref(),
            )?);
        }
        if let Some(guard_tls) = &self.guard_tls {
            security.guard_tls = Some(std::sync::Arc::new(crate::link::dial::GuardTls::new(
                &guard_tls.ca_file,
                guard_tls.cert_file.as_deref(),
                guard_tls.key_file.as_deref(),
            )?));
        }
        security.endpoint_policy = std::sync::Arc::new(
            crate::link::dial::EndpointPolicy::new(
                &self.endpoint_policy.allow,
                self.endpoint_policy.deny_link_local,
            )
            .map_err(SecurityError::Policy)?,
        );
        if let Some(auth) = &self.auth {
            let mut principals = Vec::new();
            for p in &auth.principals {
                let token = match &p.token_file {
                    None => None,
                    Some(path) => {
                        let text =
                            crate::files::read_to_string(path, crate::files::MAX_SECRET_FILE_BYTES)
                                .map_err(|source| SecurityError::Token {
                                    id: p.id.clone(),
                                    path: path.display().to_string(),
                                    source,
                                })?;
                        let token = text.trim().to_owned();
                        if token.is_empty() {
                            return Err(SecurityError::EmptyToken(p.id.clone()));
                        }
                        Some(token)
                    }
                };
                principals.push(crate::security::auth::Principal {
                    id: p.id.clone(),
                    token,
                    caller: crate::security::auth::Caller {
                        id: p.id.clone(),
                        roles: p.roles.iter().copied().collect(),
                        name_prefixes: p.name_prefixes.clone(),
                        max_registrations: p.max_registrations,
                    },
                });
            }
            security.auth = Some(std::sync::Arc::new(crate::security::auth::AuthPolicy {
                principals,
                plaintext_tokens_on_loopback: auth.plaintext_tokens_on_loopback,
                tokens_without_client_cert: auth.tokens_without_client_cert,
            }));
        }
        Ok(config)
    }

    /// Settings that leave the mesh open; printed as warnings at start.
    pub fn insecure_settings(&self) -> Vec<String> {
        let mut out = self.listener_insecure_settings();
        out.extend(self.mesh_insecure_settings());
        out
    }

    /// The [`Config::insecure_settings`] of the gRPC listener (`[tls]`,
    /// `[auth]`): moot for a mesh judging in a gateway's process, which
    /// opens no listener.
    pub fn listener_insecure_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.tls.is_none() {
            out.push("no [tls]: coordinators and registrars talk to the mesh in plaintext".into());
        } else if self
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_none())
        {
            out.push("[tls] has no client_ca_file: client certificates are not required".into());
        }
        let client_ca = self
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some());
        match &self.auth {
            // R24: the client CA is enforced without roles too.
            None if client_ca => out.push(
                "no [auth]: any client with a valid certificate from client_ca_file may evaluate, \
                 list, register and deregister guards (no roles; clients without one are refused, \
                 health checks stay open)"
                    .into(),
            ),
            None => out.push(
                "no [auth]: any caller may evaluate, register and deregister guards".into(),
            ),
            Some(auth) if client_ca && auth.tokens_without_client_cert => out.push(
                "[auth] tokens_without_client_cert: callers without a client certificate are \
                 admitted with a bearer token alone"
                    .into(),
            ),
            Some(auth) if auth.plaintext_tokens_on_loopback => out.push(
                "[auth] plaintext_tokens_on_loopback: bearer tokens accepted without TLS on loopback".into(),
            ),
            Some(_) => {}
        }
        out
    }

    /// The [`Config::insecure_settings`] of the mesh itself, listener or
    /// not (how it reaches its guards).
    pub fn mesh_insecure_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.endpoint_policy.deny_link_local {
            out.push(
                "[endpoint_policy] deny_link_local = false: guards may point at metadata addresses"
                    .into(),
            );
        }
        if self.guards.iter().any(|g| {
            g.endpoint.starts_with("https://")
                || g.replicas.iter().any(|r| r.starts_with("https://"))
        }) && self.guard_tls.is_none()
        {
            out.push("https guards but no [guard_tls]: they cannot be dialed".into());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r16_config_guards_in_file_order() {
        let config = Config::parse(
            r#"
            listen = "127.0.0.1:0"
            [[guard]]
            name = "b"
            endpoint = "127.0.0.1:1"
            failure_policy = "abort"
            [[guard]]
            name = "a"
            endpoint = "127.0.0.1:2"
            role = "mutate"
            mode = "dry_run"
            grant = { tools = ["sql.*"], may_rename = true }
            "#,
            "test",
        )
        .unwrap();
        let names: Vec<_> = config.guards.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        let a = config.guards[1].to_spec();
        assert_eq!(a.role, GuardRole::Mutate as i32);
        assert_eq!(a.mode, GuardMode::DryRun as i32);
        assert!(a.grant.unwrap().may_rename);
        assert_eq!(
            config.guards[0].to_spec().failure_policy,
            FailurePolicy::Abort as i32
        );
    }

    /// R20: the tool-name grammar is configurable within printable ASCII.
    #[test]
    fn r20_config_tool_name_grammar() {
        let config = Config::parse(
            "[limits]\nmax_tool_name_chars = 16\ntool_name_extra_chars = \"/:\"\n",
            "test",
        )
        .unwrap();
        assert_eq!(config.check(), Ok(()));
        let grammar = config.mesh_config().limits.tool_names;
        assert!(grammar.check("fs/read:v2").is_ok());
        assert!(grammar.check("fs/read:v2-and-more").is_err());
        let default = Config::parse("", "test").unwrap().mesh_config().limits;
        assert_eq!(
            default.tool_names,
            crate::validate::ToolNameGrammar::default()
        );
        for bad in [
            "[limits]\ntool_name_extra_chars = \" \"\n",
            "[limits]\ntool_name_extra_chars = \"\u{200b}\"\n",
            "[limits]\nmax_tool_name_chars = 0\n",
            "[limits]\nmax_tool_name_chars = 5000\n",
        ] {
            let error = Config::parse(bad, "test")
                .unwrap()
                .check()
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("limits.") && error.contains("tool_name"),
                "{error}"
            );
        }
    }

    #[test]
    fn r16_config_refuses_two_guards_of_one_name_naming_both() {
        let text = "listen = \"127.0.0.1:0\"\n\
            [[guard]]\nname = \"a\"\nendpoint = \"127.0.0.1:1\"\n\
            [[guard]]\nname = \"b\"\nendpoint = \"127.0.0.1:2\"\n\
            [[guard]]\nendpoint = \"127.0.0.1:3\"\nname = \" a\"\n";
        let err = Config::parse(text, "cfg.toml").unwrap_err().to_string();
        assert!(
            err.contains("cfg.toml")
                && err.contains("entries 1 (name at line 3) and 3 (name at line 10)")
                && err.contains("\"a\""),
            "{err}"
        );
        // Built another way, the check still refuses it (without lines).
        let mut config = Config::parse(&text.replace("\" a\"", "\"c\""), "t").unwrap();
        config.guards[2].name = "a".into();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("entries 1 and 3")
        );
    }

    #[test]
    fn r11_config_warns_about_a_mutate_guard_with_an_empty_grant() {
        let config = Config::parse(
            r#"
            [[guard]]
            name = "no-grant"
            endpoint = "127.0.0.1:1"
            role = "mutate"
            [[guard]]
            name = "empty-grant"
            endpoint = "127.0.0.1:2"
            role = "mutate"
            grant = { tools = [], may_rename = true }
            [[guard]]
            name = "granted"
            endpoint = "127.0.0.1:3"
            role = "mutate"
            grant = { tools = ["sql.*"] }
            [[guard]]
            name = "validate"
            endpoint = "127.0.0.1:4"
            "#,
            "t",
        )
        .unwrap();
        let warnings = config.guard_warnings();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].contains("entry 1") && warnings[0].contains("no-grant"),
            "{warnings:?}"
        );
        assert!(warnings[1].contains("empty-grant") && warnings[1].contains("empty grant"));
    }

    #[test]
    fn r16_config_guard_endpoints_are_checked_against_the_policy_at_load() {
        let guard =
            |endpoint: &str| format!("[[guard]]\nname = \"g\"\nendpoint = \"{endpoint}\"\n");
        let err = Config::parse(&guard("http://169.254.169.254:80"), "t")
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("entry 1") && err.contains("169.254.169.254") && err.contains("policy"),
            "{err}"
        );
        let text = format!(
            "[endpoint_policy]\nallow = [\"10.0.0.0/8\"]\n{}",
            guard("127.0.0.1:1")
        );
        let err = Config::parse(&text, "t")
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("allow-list"), "{err}");
        let err = Config::parse(&guard("http://0x7f.0.0.1:1"), "t")
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("dotted-quad"), "{err}");
        assert!(
            Config::parse(&guard("127.0.0.1:1"), "t")
                .unwrap()
                .build()
                .is_ok()
        );
    }

    /// R34: where session memory is kept for each `[sessions] store` and
    /// registry kind, and the sections that cannot start a mesh.
    #[test]
    fn r34_sessions_place_follows_the_registry_and_a_shared_store_needs_the_secret() {
        let place = |text: &str| {
            let config = Config::parse(text, "test").unwrap();
            config.sessions.place(&config.registry)
        };
        let etcd = "[registry]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n";
        let secret = "[sessions]\nsecret_file = \"s\"\n";
        assert_eq!(place(""), Ok(SessionPlace::Local));
        assert_eq!(
            place(&format!("{etcd}{secret}")),
            Ok(SessionPlace::Etcd),
            "the registry's etcd by default"
        );
        assert_eq!(
            place(&format!("{etcd}[sessions]\nstore = \"memory\"\n")),
            Ok(SessionPlace::Local),
            "memory on request, no secret needed"
        );
        assert_eq!(
            place(etcd),
            Err(SessionsSettingError::NoSecret { store: "etcd" })
        );
        let redis = "[sessions]\nstore = \"redis\"\nredis_url = \"redis://127.0.0.1:6379\"\n";
        assert_eq!(
            place(redis),
            Err(SessionsSettingError::NoSecret { store: "redis" })
        );
        assert_eq!(
            place(&format!("{redis}secret_file = \"s\"\n")),
            Ok(SessionPlace::Redis)
        );
        assert_eq!(
            place("[sessions]\nstore = \"redis\"\nsecret_file = \"s\"\n"),
            Err(SessionsSettingError::NoRedisUrl)
        );
        assert_eq!(
            place("[sessions]\nredis_password_file = \"p\"\n")
                .unwrap_err()
                .key(),
            "sessions.redis_password_file"
        );
        let error = place(etcd).unwrap_err().to_string();
        assert!(error.contains("head -c 32 /dev/urandom"), "{error}");
        assert!(
            Config::parse("[sessions]\nstore = \"zookeeper\"\n", "test").is_err(),
            "an unknown store"
        );
        let zero = Config::parse("[sessions]\nstore_timeout_ms = 0\n", "test").unwrap();
        assert_eq!(
            zero.check(),
            Err(SettingError::Zero {
                key: "sessions.store_timeout_ms"
            }),
            "a store with no time to answer"
        );
    }

    #[test]
    fn registry_section_defaults_to_memory_and_reads_etcd() {
        let config = Config::parse("", "test").unwrap();
        assert_eq!(config.registry.kind, RegistryKind::Memory);
        let config = Config::parse(
            r#"
            [registry]
            kind = "etcd"
            endpoints = ["http://127.0.0.1:2379"]
            prefix = "/guardmesh/prod"
            username = "mesh"
            password = "secret"
            staleness_window_ms = 5000
            after_window = "serve_stale"
            "#,
            "test",
        )
        .unwrap();
        assert_eq!(config.registry.kind, RegistryKind::Etcd);
        let etcd = config.registry.etcd().unwrap();
        assert_eq!(etcd.prefix, "/guardmesh/prod");
        assert_eq!(etcd.staleness_window, Duration::from_secs(5));
        assert_eq!(
            etcd.after_window,
            crate::registry::etcd::AfterWindow::ServeStale
        );
        assert_eq!(etcd.password.as_deref(), Some("secret"));
        let err = Config::parse("[registry]\nkind = \"zookeeper\"\n", "cfg.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("zookeeper"), "{err}");
    }

    #[test]
    fn config_refuses_settings_that_cannot_work() {
        let config = Config::parse("default_guard_timeout_ms = 0", "t").unwrap();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("default_guard_timeout_ms")
        );
        let config = Config::parse("[guard_links]\nmax_answer_bytes = 0", "t").unwrap();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("max_answer_bytes")
        );
        assert!(Config::default().check().is_ok());
    }

    #[test]
    fn r25_server_section_reads_and_refuses_zero_timeouts() {
        let config = Config::parse(
            "[server]\nhandshake_timeout_ms = 1500\nkeepalive_interval_ms = 0\nmax_connections = 100\n",
            "t",
        )
        .unwrap();
        let limits = config.server.listener_limits();
        assert_eq!(limits.handshake_timeout, Duration::from_millis(1500));
        assert_eq!(limits.keepalive_interval, None);
        assert_eq!(limits.connection_cap(), Some(100));
        let defaults = Config::default().server.listener_limits();
        assert_eq!(defaults.handshake_timeout, Duration::from_secs(10));
        assert_eq!(defaults.keepalive_interval, Some(Duration::from_secs(60)));
        let config = Config::parse("[server]\nhandshake_timeout_ms = 0", "t").unwrap();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("server.handshake_timeout_ms")
        );
        let err = Config::parse("[server]\nhandshake_timeout = 1", "cfg.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("handshake_timeout"), "{err}");
    }

    #[test]
    fn r26_keepalive_below_what_default_guard_servers_accept_is_refused_unless_forced() {
        let defaults = Config::default();
        assert_eq!(defaults.guard_links.keepalive_interval_ms, 300_000);
        let link = defaults.mesh_config().link;
        assert_eq!(link.keepalive_interval, crate::link::MIN_PEER_PING_INTERVAL);
        let config = Config::parse("[guard_links]\nkeepalive_interval_ms = 10000", "t").unwrap();
        let err = config.check().unwrap_err().to_string();
        assert!(
            err.contains("keepalive_interval_ms") && err.contains("too_many_pings"),
            "{err}"
        );
        let config = Config::parse(
            "[guard_links]\nkeepalive_interval_ms = 10000\nkeepalive_force = true",
            "t",
        )
        .unwrap();
        assert!(config.check().is_ok());
        assert_eq!(
            config.mesh_config().link.keepalive_interval,
            Duration::from_secs(10)
        );
        let config = Config::parse("[guard_links]\nkeepalive_interval_ms = 0", "t").unwrap();
        assert!(config.check().is_ok(), "0 turns pings off");
        let config = Config::parse("[guard_links]\ndead_peer_timeout_ms = 500", "t").unwrap();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("dead_peer_timeout_ms")
        );
    }

    #[test]
    fn r25_guard_queue_bound_is_read_and_must_be_positive() {
        let config = Config::parse("[guard_links]\nmax_queued_bytes = 1048576", "t").unwrap();
        assert_eq!(config.mesh_config().link.max_queued_bytes, 1 << 20);
        let config = Config::parse("[guard_links]\nmax_queued_bytes = 0", "t").unwrap();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("max_queued_bytes")
        );
    }

    #[test]
    fn config_errors_name_the_problem() {
        let err = Config::parse(
            "[[guard]]\nname = \"x\"\nendpoint = \"h:1\"\nfailure_policy = \"maybe\"\n",
            "cfg.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cfg.toml") && err.contains("maybe"), "{err}");
        let err = Config::parse("lissen = 1", "cfg.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("lissen"), "{err}");
    }

    #[test]
    fn r20_config_max_json_depth_is_checked_and_applied() {
        assert_eq!(Config::default().mesh_config().limits.max_json_depth, 64);
        for (depth, ok) in [(0, false), (1, true), (127, true), (128, false)] {
            let text = format!("[limits]\nmax_json_depth = {depth}");
            let config = Config::parse(&text, "t").unwrap();
            match config.check() {
                Ok(()) => {
                    assert!(ok, "{depth} accepted");
                    assert_eq!(config.mesh_config().limits.max_json_depth, depth);
                }
                Err(error) => {
                    let error = error.to_string();
                    assert!(!ok, "{depth}: {error}");
                    assert!(error.contains("limits.max_json_depth"), "{error}");
                    assert!(error.contains("127"), "{error}");
                }
            }
        }
    }
}

/// The sample configs of the docs (`docs/quick_start.md`, the full sample,
/// then `docs/security.md`) are configs: every key in them is one this file
/// reads (a misspelt or stale key would be refused at start).
#[cfg(test)]
mod readme {
    use super::*;

    /// The ```toml blocks of the docs that are mesh configs.
    fn samples() -> Vec<String> {
        let readme = concat!(
            include_str!("../../docs/quick_start.md"),
            include_str!("../../docs/security.md")
        );
        let mut blocks = Vec::new();
        let mut current: Option<String> = None;
        for line in readme.lines() {
            match (&mut current, line.trim_end()) {
                (None, "```toml") => current = Some(String::new()),
                (Some(block), "```") => {
                    if block.starts_with("listen = ") {
                        blocks.push(std::mem::take(block));
                    }
                    current = None;
                }
                (Some(block), _) => {
                    block.push_str(line);
                    block.push('\n');
                }
                (None, _) => {}
            }
        }
        blocks
    }

    #[test]
    fn r16_the_readme_sample_configs_parse() {
        let samples = samples();
        assert!(samples.len() >= 2, "{} sample configs found", samples.len());
        for (i, text) in samples.iter().enumerate() {
            let config = Config::parse(text, "docs")
                .unwrap_or_else(|e| panic!("docs sample config {}: {e}", i + 1));
            assert_eq!(config.listen.port(), 50051);
        }
        let full = Config::parse(&samples[0], "docs").expect("the full sample");
        assert!(full.watch_policies);
        assert_eq!(full.guards.len(), 4);
        assert!(full.decision_log.is_some());
    }
}
