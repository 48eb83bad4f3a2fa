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
use crate::validate::Limits;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod approvals;
pub mod check;
mod decision_log;
mod describe;
pub mod environment;
mod error;
mod guards;
pub mod keys;
mod limits;
mod links;
mod reference;
mod registry;
mod security;
mod server;
mod sessions;
pub use approvals::ApprovalsConfig;
pub use decision_log::{DecisionLogConfig, DurabilityConfig};
use describe::table;
pub use error::{ConfigError, DecisionLogError, LogSettingError, PolicyFileError, SettingError};
pub use guards::{GrantConfig, GuardConfig, ResultGrantConfig};
pub use limits::LimitsConfig;
pub use links::LinksConfig;
pub use registry::{RegistryConfig, RegistryKind};
pub use security::{
    AuthConfig, EndpointPolicyConfig, GuardTlsConfig, PrincipalConfig, SecurityError, TlsConfig,
};
pub use server::{DEFAULT_SHUTDOWN_GRACE_MS, ServerConfig};
pub use sessions::{SessionPlace, SessionStoreKind, SessionsConfig, SessionsSettingError};

table! {
    /// The whole config file. Every field has a default.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct Config {
        /// Address of the mesh's gRPC listener.
        pub listen: SocketAddr,
        /// Address of the HTTP listener for Prometheus metrics; unset: no
        /// metrics listener.
        pub metrics_listen: Option<SocketAddr>,
        /// Deadline of a guard that registers with `timeout_ms = 0`, in
        /// milliseconds.
        pub default_guard_timeout_ms: u64,
        /// Deadline of a batch that names none, in milliseconds.
        pub default_batch_timeout_ms: u64,
        /// Longest deadline a batch may ask for, in milliseconds.
        pub max_batch_timeout_ms: u64,
        /// What happens to a call no enforced guard applies to (R28): it
        /// proceeds, or is cancelled (default deny).
        pub unguarded: crate::mesh::Unguarded,
        // `guardmesh serve` reloads them; false is for teams that roll
        // policies out by signal.
        /// Reload the policy files of policy guards when they change on disk;
        /// false: only on SIGHUP.
        pub watch_policies: bool,
        /// What coordinators may send (R20).
        pub limits: LimitsConfig,
        /// How the mesh dials and keeps its links to guards.
        pub guard_links: LinksConfig,
        /// How the listener treats silent and dead clients (R25).
        pub server: ServerConfig,
        /// TLS on the mesh's listener; absent: plaintext (a warning is printed
        /// at start).
        pub tls: Option<TlsConfig>,
        /// Authentication and roles; absent: no roles (a warning is printed at
        /// start).
        pub auth: Option<AuthConfig>,
        /// How the mesh verifies `https://` guards, and its client certificate
        /// for guards that require mTLS.
        pub guard_tls: Option<GuardTlsConfig>,
        /// Which guard endpoints may be registered and dialed.
        pub endpoint_policy: EndpointPolicyConfig,
        /// `[[guard]]`: a guard registered at start, in file order (R16).
        #[serde(rename = "guard")]
        pub guards: Vec<GuardConfig>,
        /// Where the chain of guards lives.
        pub registry: RegistryConfig,
        /// Where the memory kept per session for rules that read `session`
        /// lives, and its bounds (R34).
        pub sessions: SessionsConfig,
        /// How long an approval request lives, and how many one session
        /// may have waiting (R35).
        pub approvals: ApprovalsConfig,
        // Absent, it costs nothing.
        /// One record per batch answered and per chain change (R29); absent:
        /// no log.
        pub decision_log: Option<DecisionLogConfig>,
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
            approvals: ApprovalsConfig::default(),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Config {
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
            let lines = guards::guard_name_lines(text);
            return Err(invalid(SettingError::DuplicateGuard {
                first: first + 1,
                second: second + 1,
                name: config.guards[second].name.trim().to_owned(),
                lines: lines.get(first).copied().zip(lines.get(second).copied()),
            }));
        }
        Ok(config)
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
        // Each setting that must be greater than 0, named by its key: its
        // path in the file, `table.key`.
        macro_rules! concat_keys {
            ($first:ident $(. $rest:ident)*) => {
                concat!(stringify!($first) $(, ".", stringify!($rest))*)
            };
        }
        macro_rules! zero {
            ($($key:ident).+) => {
                (concat_keys!($($key).+), self.$($key).+ == 0)
            };
        }
        let zeros = [
            zero!(default_guard_timeout_ms),
            zero!(default_batch_timeout_ms),
            zero!(max_batch_timeout_ms),
            zero!(limits.max_calls_per_batch),
            zero!(limits.max_batch_bytes),
            zero!(limits.max_result_bytes),
            zero!(limits.max_argument_bytes),
            zero!(limits.max_inflight_batches),
            zero!(limits.max_batches_per_stream),
            zero!(limits.max_id_bytes),
            zero!(limits.max_metadata_entries),
            zero!(limits.max_inflight_bytes),
            zero!(limits.max_stream_bytes),
            zero!(limits.max_coordinator_streams),
            zero!(guard_links.connect_timeout_ms),
            zero!(guard_links.max_answer_bytes),
            zero!(server.handshake_timeout_ms),
            zero!(server.keepalive_timeout_ms),
            zero!(registry.max_policy_bytes_per_identity),
            zero!(sessions.store_timeout_ms),
            zero!(approvals.ttl_ms),
            zero!(approvals.max_open_per_session),
            zero!(approvals.max_open_per_identity),
        ];
        for (key, zero) in zeros {
            if zero {
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

    /// Makes every relative path of the config (each key of type path in
    /// the reference) relative to `folder`, the config file's folder; a
    /// path that starts with `$CREDENTIALS_DIRECTORY/` is read from the
    /// folder systemd passes a unit's `LoadCredential=` files in (the
    /// environment variable of that name).
    pub fn resolve_paths(&mut self, folder: &Path) {
        let credentials = std::env::var_os(CREDENTIALS_DIRECTORY).map(PathBuf::from);
        self.resolve_paths_with(folder, credentials.as_deref());
    }

    /// [`Config::resolve_paths`] with the credentials folder given.
    pub fn resolve_paths_with(&mut self, folder: &Path, credentials: Option<&Path>) {
        self.map_paths(|path| {
            if let (Some(dir), Ok(rest)) = (credentials, path.strip_prefix(CREDENTIALS_PREFIX)) {
                *path = dir.join(rest);
            } else if path.is_relative() {
                *path = folder.join(&*path);
            }
        });
    }

    /// Applies `resolve` to every file and folder the config names.
    pub fn map_paths(&mut self, resolve: impl Fn(&mut PathBuf)) {
        let resolve = &resolve;
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
                max_in_flight: self.guard_links.max_in_flight.max(1),
                min_in_flight: self.guard_links.min_in_flight.max(1),
                max_waiting: self.guard_links.max_waiting.max(1),
                ..LinkConfig::default()
            },
            security: MeshConfig::default().security,
            sessions: self.sessions.limits(),
            approvals: self.approvals.settings(),
            unguarded: self.unguarded,
            max_policy_bytes_per_identity: self.registry.max_policy_bytes_per_identity,
        }
    }
}

/// The line `check` refuses the config of `toml` with (tests of every
/// table).
#[cfg(test)]
pub(crate) fn check_error(toml: &str) -> String {
    let config = Config::parse(toml, "t").expect("the test's config parses");
    config
        .check()
        .expect_err("the check refuses it")
        .to_string()
}

/// The environment variable naming the folder of a systemd unit's
/// credentials (`LoadCredential=`).
pub const CREDENTIALS_DIRECTORY: &str = "CREDENTIALS_DIRECTORY";

/// A config path under a systemd unit's credentials folder starts with this.
const CREDENTIALS_PREFIX: &str = "$CREDENTIALS_DIRECTORY";

#[cfg(test)]
mod tests {
    #[test]
    fn paths_under_the_credentials_folder_are_read_from_it() {
        let mut config = super::Config::parse(
            "[sessions]\nsecret_file = \"$CREDENTIALS_DIRECTORY/session.secret\"\n\
             [decision_log]\ndir = \"log\"\nsigning_key = \"$CREDENTIALS_DIRECTORY/log.key\"\n",
            "t",
        )
        .unwrap();
        let folder = std::path::Path::new("/etc/guardmesh");
        let mut unset = config.clone();
        config.resolve_paths_with(folder, Some(std::path::Path::new("/run/credentials/g")));
        assert_eq!(
            config.sessions.secret_file.as_deref(),
            Some(std::path::Path::new("/run/credentials/g/session.secret"))
        );
        let log = config.decision_log.as_ref().unwrap();
        assert_eq!(log.dir, folder.join("log"));
        assert_eq!(
            log.signing_key.as_deref(),
            Some(std::path::Path::new("/run/credentials/g/log.key"))
        );
        // Without the variable the name stays in the path: the error that
        // the file is missing says where it was looked for.
        unset.resolve_paths_with(folder, None);
        assert_eq!(
            unset.sessions.secret_file.as_deref(),
            Some(std::path::Path::new(
                "/etc/guardmesh/$CREDENTIALS_DIRECTORY/session.secret"
            ))
        );
    }

    use super::*;

    #[test]
    fn config_refuses_settings_that_cannot_work() {
        assert!(check_error("default_guard_timeout_ms = 0").contains("default_guard_timeout_ms"));
        assert!(check_error("[guard_links]\nmax_answer_bytes = 0").contains("max_answer_bytes"));
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

    /// A config named by a relative path with a folder in it (as a user
    /// types `guardmesh serve --config examples/flows/mesh.toml`) reads its
    /// policy file from its own folder, not from that folder joined twice.
    /// Unit tests run in the server crate's folder, so the repository's
    /// example is `../examples/flows/mesh.toml` from here.
    #[test]
    fn a_relative_config_path_reads_its_policy_from_its_own_folder() {
        let config = Config::load(std::path::Path::new("../examples/flows/mesh.toml"))
            .unwrap_or_else(|e| panic!("{e}"));
        let source = config.guards[0].policy_source.as_deref().unwrap_or("");
        assert!(source.contains("fs-values-stay-on-fs"), "{source}");
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
            include_str!("../../../docs/quick_start.md"),
            include_str!("../../../docs/security.md")
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
