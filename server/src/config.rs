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

use crate::link::LinkConfig;
use crate::mesh::MeshConfig;
use crate::validate::Limits;
use guardmesh_proto::v1::{FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;
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
    #[serde(rename = "guard")]
    pub guards: Vec<GuardConfig>,
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
            guards: Vec::new(),
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
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let l = Limits::default();
        Self {
            max_calls_per_batch: l.max_calls_per_batch,
            max_batch_bytes: l.max_batch_bytes,
            max_argument_bytes: l.max_argument_bytes,
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
}

impl Default for LinksConfig {
    fn default() -> Self {
        let l = LinkConfig::default();
        Self {
            connect_timeout_ms: millis(l.connect_timeout),
            backoff_initial_ms: millis(l.backoff_initial),
            backoff_max_ms: millis(l.backoff_max),
            max_answer_bytes: l.max_decoding_message_size,
        }
    }
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

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text, &shown)
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
            },
            link: LinkConfig {
                connect_timeout: Duration::from_millis(self.guard_links.connect_timeout_ms),
                backoff_initial: Duration::from_millis(self.guard_links.backoff_initial_ms.max(1)),
                backoff_max: Duration::from_millis(self.guard_links.backoff_max_ms.max(1)),
                max_decoding_message_size: self.guard_links.max_answer_bytes,
                ..LinkConfig::default()
            },
        }
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
