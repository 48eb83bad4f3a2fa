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
//! max_id_bytes = 256
//! max_metadata_entries = 1024
//! max_inflight_bytes = 268435456
//! max_stream_bytes = 16777216
//! max_coordinator_streams = 4096
//!
//! [guard_links]
//! connect_timeout_ms = 2000
//! backoff_initial_ms = 50
//! backoff_max_ms = 2000
//! max_answer_bytes = 4194304
//! circuit_failures = 5
//! circuit_open_ms = 5000
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
//! every replica with the same `prefix` (see [`crate::etcd`]):
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

use crate::auth::Role;
use crate::link::LinkConfig;
use crate::mesh::MeshConfig;
use crate::validate::Limits;
use guardmesh_proto::v1::{FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why the config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("config file {path} is invalid: {source}")]
    Parse {
        path: String,
        #[source]
        source: toml::de::Error,
    },
}

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
    pub max_id_bytes: usize,
    pub max_metadata_entries: usize,
    pub max_inflight_bytes: usize,
    pub max_stream_bytes: usize,
    pub max_coordinator_streams: usize,
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
            max_id_bytes: l.max_id_bytes,
            max_metadata_entries: l.max_metadata_entries,
            max_inflight_bytes: l.max_inflight_bytes,
            max_stream_bytes: l.max_stream_bytes,
            max_coordinator_streams: l.max_coordinator_streams,
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
        }
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
    pub after_window: crate::etcd::AfterWindow,
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
        let e = crate::etcd::EtcdConfig::default();
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
        }
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
    Tls(#[from] crate::tls::TlsError),
    #[error("[endpoint_policy]: {0}")]
    Policy(String),
    #[error("[auth] principal {id:?}: cannot read token file {path}: {source}")]
    Token {
        id: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("[auth] principal {0:?}: its token file is empty")]
    EmptyToken(String),
}

/// `[[guard]]`: one registration (R16).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    pub name: String,
    pub endpoint: String,
    #[serde(default)]
    pub role: RoleConfig,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub timeout_ms: u32,
    #[serde(default)]
    pub failure_policy: PolicyConfig,
    #[serde(default)]
    pub priority: i32,
    #[serde(default)]
    pub mode: ModeConfig,
    #[serde(default)]
    pub grant: Option<GrantConfig>,
    /// For `https://` endpoints: the identity the guard must present.
    #[serde(default)]
    pub server_identity: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleConfig {
    #[default]
    Validate,
    Mutate,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyConfig {
    #[default]
    FailClosed,
    FailOpen,
    Abort,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeConfig {
    #[default]
    Enforce,
    DryRun,
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
            role: match self.role {
                RoleConfig::Validate => GuardRole::Validate,
                RoleConfig::Mutate => GuardRole::Mutate,
            } as i32,
            tools: self.tools.clone(),
            timeout_ms: self.timeout_ms,
            failure_policy: match self.failure_policy {
                PolicyConfig::FailClosed => FailurePolicy::FailClosed,
                PolicyConfig::FailOpen => FailurePolicy::FailOpen,
                PolicyConfig::Abort => FailurePolicy::Abort,
            } as i32,
            priority: self.priority,
            mode: match self.mode {
                ModeConfig::Enforce => GuardMode::Enforce,
                ModeConfig::DryRun => GuardMode::DryRun,
            } as i32,
            grant: self.grant.as_ref().map(|g| RewriteGrant {
                tools: g.tools.clone(),
                may_rename: g.may_rename,
            }),
            server_identity: self.server_identity.clone().unwrap_or_default(),
        }
    }
}

impl Config {
    /// Parses a config from TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.to_owned(),
            source,
        })
    }

    /// Refuses settings that cannot work (they would fail every guard or
    /// refuse every batch), naming the key.
    pub fn check(&self) -> Result<(), String> {
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
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(format!("{key} must be greater than 0"));
            }
        }
        Ok(())
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        let config = Self::parse(&text, &shown)?;
        config.check().map_err(|reason| ConfigError::Invalid {
            path: shown,
            reason,
        })?;
        Ok(config)
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
                max_id_bytes: self.limits.max_id_bytes,
                max_metadata_entries: self.limits.max_metadata_entries,
                max_inflight_bytes: self.limits.max_inflight_bytes,
                max_stream_bytes: self.limits.max_stream_bytes,
                max_coordinator_streams: self.limits.max_coordinator_streams,
            },
            link: LinkConfig {
                connect_timeout: Duration::from_millis(self.guard_links.connect_timeout_ms),
                backoff_initial: Duration::from_millis(self.guard_links.backoff_initial_ms.max(1)),
                backoff_max: Duration::from_millis(self.guard_links.backoff_max_ms.max(1)),
                max_decoding_message_size: self.guard_links.max_answer_bytes,
                circuit_failures: self.guard_links.circuit_failures,
                circuit_open_for: Duration::from_millis(self.guard_links.circuit_open_ms),
                ..LinkConfig::default()
            },
            security: MeshConfig::default().security,
        }
    }

    /// The mesh settings with the security sections loaded (certificate,
    /// key and token files are read here).
    pub fn build(&self) -> Result<MeshConfig, SecurityError> {
        let mut config = self.mesh_config();
        let security = &mut config.security;
        if let Some(tls) = &self.tls {
            security.server_tls = Some(crate::tls::ServerTls::new(
                &tls.cert_file,
                &tls.key_file,
                tls.client_ca_file.as_deref(),
            )?);
        }
        if let Some(guard_tls) = &self.guard_tls {
            security.guard_tls = Some(std::sync::Arc::new(crate::dial::GuardTls::new(
                &guard_tls.ca_file,
                guard_tls.cert_file.as_deref(),
                guard_tls.key_file.as_deref(),
            )?));
        }
        security.endpoint_policy = std::sync::Arc::new(
            crate::dial::EndpointPolicy::new(
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
                        let text = std::fs::read_to_string(path).map_err(|source| {
                            SecurityError::Token {
                                id: p.id.clone(),
                                path: path.display().to_string(),
                                source,
                            }
                        })?;
                        let token = text.trim().to_owned();
                        if token.is_empty() {
                            return Err(SecurityError::EmptyToken(p.id.clone()));
                        }
                        Some(token)
                    }
                };
                principals.push(crate::auth::Principal {
                    id: p.id.clone(),
                    token,
                    caller: crate::auth::Caller {
                        id: p.id.clone(),
                        roles: p.roles.iter().copied().collect(),
                        name_prefixes: p.name_prefixes.clone(),
                        max_registrations: p.max_registrations,
                    },
                });
            }
            security.auth = Some(std::sync::Arc::new(crate::auth::AuthPolicy {
                principals,
                plaintext_tokens_on_loopback: auth.plaintext_tokens_on_loopback,
            }));
        }
        Ok(config)
    }

    /// Settings that leave the mesh open; printed as warnings at start.
    pub fn insecure_settings(&self) -> Vec<String> {
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
        match &self.auth {
            None => out.push(
                "no [auth]: any caller may evaluate, register and deregister guards".into(),
            ),
            Some(auth) if auth.plaintext_tokens_on_loopback => out.push(
                "[auth] plaintext_tokens_on_loopback: bearer tokens accepted without TLS on loopback".into(),
            ),
            Some(_) => {}
        }
        if !self.endpoint_policy.deny_link_local {
            out.push(
                "[endpoint_policy] deny_link_local = false: guards may point at metadata addresses"
                    .into(),
            );
        }
        if self
            .guards
            .iter()
            .any(|g| g.endpoint.starts_with("https://"))
            && self.guard_tls.is_none()
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
        let etcd = crate::etcd::EtcdConfig::from_config(&config.registry).unwrap();
        assert_eq!(etcd.prefix, "/guardmesh/prod");
        assert_eq!(etcd.staleness_window, Duration::from_secs(5));
        assert_eq!(etcd.after_window, crate::etcd::AfterWindow::ServeStale);
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
                .contains("default_guard_timeout_ms")
        );
        let config = Config::parse("[guard_links]\nmax_answer_bytes = 0", "t").unwrap();
        assert!(config.check().unwrap_err().contains("max_answer_bytes"));
        assert!(Config::default().check().is_ok());
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
}
