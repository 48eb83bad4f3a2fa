//! `[registry]`: where the chain of guards lives.

use super::describe::table;
use super::millis;
use serde::Deserialize;
use std::time::Duration;

table! {
    /// `[registry]`: where the chain lives.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct RegistryConfig {
        /// `memory`: in this process; `etcd`: shared by every replica with the
        /// same prefix.
        pub kind: RegistryKind,
        /// etcd client URLs (`https://` needs the `etcd-tls` build feature).
        pub endpoints: Vec<String>,
        /// Key prefix of the chain: replicas with the same prefix share it.
        pub prefix: String,
        /// etcd user name.
        pub username: Option<String>,
        /// etcd password; prefer password_env.
        pub password: Option<String>,
        // Keeps the secret out of the file.
        /// Name of an environment variable holding the etcd password.
        pub password_env: Option<String>,
        /// PEM roots for etcd's certificate.
        pub ca_file: Option<std::path::PathBuf>,
        /// PEM client certificate for etcd's client-certificate auth.
        pub cert_file: Option<std::path::PathBuf>,
        /// PEM private key of cert_file.
        pub key_file: Option<std::path::PathBuf>,
        /// Name to verify etcd's certificate against, when not the endpoint's
        /// host.
        pub tls_domain: Option<String>,
        /// How long start-up may try to reach etcd, in milliseconds.
        pub dial_timeout_ms: u64,
        // Also the deadline of the watch's probe answers.
        /// Deadline of each etcd request, in milliseconds.
        pub request_timeout_ms: u64,
        /// How often a replica confirms its chain and a guard heartbeat
        /// renews, in milliseconds.
        pub heartbeat_interval_ms: u64,
        /// Time to live of a guard's heartbeat lease, in seconds.
        pub lease_ttl_s: u64,
        /// How long a replica that lost etcd keeps judging with its last
        /// chain, in milliseconds.
        pub staleness_window_ms: u64,
        /// After the staleness window: refuse batches (UNAVAILABLE) or keep
        /// judging with the stale chain.
        pub after_window: crate::registry::etcd::AfterWindow,
        // Checked at registration, freed on deregistration.
        /// Bytes of compiled policies the guards one identity registered may
        /// hold together (R25).
        pub max_policy_bytes_per_identity: usize,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
}
