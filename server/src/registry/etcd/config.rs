//! The etcd registry's settings (the `[registry]` section of the config
//! file), and what a replica does once its staleness window has passed.

use super::error::ConnectError;
use super::keys::Keys;
use crate::etcd_tls::TlsFiles;
use serde::Deserialize;
use std::time::Duration;

/// What a replica does once etcd has been unreachable for longer than the
/// staleness window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterWindow {
    /// Refuse batches with UNAVAILABLE: a chain that may have lost a guard
    /// since (or gained one) is not trusted to judge. The default.
    #[default]
    Refuse,
    /// Keep judging with the last chain, and keep saying it is stale. For
    /// deployments that value availability over a possibly outdated chain.
    ServeStale,
}

/// Settings of the etcd registry (the `[registry]` section of the config).
#[derive(Clone)]
pub struct EtcdConfig {
    /// `http://host:port` (or `https://` with the `etcd-tls` feature).
    pub endpoints: Vec<String>,
    /// Key prefix of this chain, e.g. `/guardmesh/prod`. Meshes with the same
    /// prefix serve the same chain.
    pub prefix: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub tls: Option<TlsFiles>,
    /// How long start-up may take to reach etcd before the replica gives up.
    pub dial_timeout: Duration,
    /// Deadline of every etcd request (retries on another member included),
    /// and of the watch's answer to a progress request.
    pub request_timeout: Duration,
    /// How often the replica confirms its chain with etcd's quorum (and
    /// asks its watch for progress); how often a guard's heartbeat
    /// (`guardmesh heartbeat`) renews its lease.
    pub heartbeat_interval: Duration,
    /// Time to live of a guard's heartbeat lease (etcd rounds it to whole
    /// seconds and enforces its own minimum, about 2 s).
    pub lease_ttl: Duration,
    /// How long a replica that lost etcd keeps judging with its last chain.
    pub staleness_window: Duration,
    /// What it does after that.
    pub after_window: AfterWindow,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            prefix: "/guardmesh".to_owned(),
            username: None,
            password: None,
            tls: None,
            dial_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(1),
            lease_ttl: Duration::from_secs(10),
            staleness_window: Duration::from_secs(30),
            after_window: AfterWindow::Refuse,
        }
    }
}

// Hand-written so that the password never reaches a log line.
impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .field("dial_timeout", &self.dial_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("lease_ttl", &self.lease_ttl)
            .field("staleness_window", &self.staleness_window)
            .field("after_window", &self.after_window)
            .finish()
    }
}

impl EtcdConfig {
    /// Plain `http://` endpoints under `prefix`, without credentials, with
    /// the default timeouts.
    pub fn plain(endpoints: Vec<String>, prefix: &str) -> Self {
        Self {
            endpoints,
            prefix: prefix.to_owned(),
            ..Self::default()
        }
    }

    /// Refuses settings that could only fail later, with the key to fix
    /// (what `config check` reports, and a mesh refuses before it connects).
    pub fn validate(&self) -> Result<(), ConnectError> {
        let bad = |what: String| Err(ConnectError::Config(format!("[registry] {what}")));
        if self.endpoints.is_empty() {
            return bad("endpoints must not be empty".into());
        }
        if self.username.is_some() != self.password.is_some() {
            return bad("username and password (or password_env) go together".into());
        }
        let prefix = self.prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return bad(format!(
                "prefix {:?} is empty: give each chain its own prefix, e.g. \"/guardmesh\"",
                self.prefix
            ));
        }
        for (name, value) in [
            ("dial_timeout_ms", self.dial_timeout),
            ("request_timeout_ms", self.request_timeout),
            ("heartbeat_interval_ms", self.heartbeat_interval),
            ("lease_ttl_s", self.lease_ttl),
        ] {
            if value.is_zero() {
                return bad(format!("{name} must be greater than 0"));
            }
        }
        if self.lease_ttl <= self.heartbeat_interval {
            return bad(format!(
                "lease_ttl_s ({:?}) must be longer than heartbeat_interval_ms ({:?}), or every lease lapses between two heartbeats",
                self.lease_ttl, self.heartbeat_interval
            ));
        }
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        if (https || self.tls.is_some()) && !cfg!(feature = "etcd-tls") {
            return bad(
                "TLS (https:// endpoints, ca_file, cert_file, key_file, tls_domain) needs a guardmesh built with `--features etcd-tls`".into(),
            );
        }
        Ok(())
    }

    /// The liveness key of guard `name`: `<prefix>/alive/<name>`, which a
    /// guard (or `guardmesh heartbeat` beside it) keeps on a lease.
    pub fn alive_key(&self, name: &str) -> String {
        self.keys().alive(name.trim())
    }

    /// The key that announces `address` as one replica of guard `name`
    /// (R32): `<prefix>/replicas/<name>/<address>`, with `%` and `/` of the
    /// address escaped so that the name is everything before the last `/`.
    /// `guardmesh heartbeat --replica` keeps it on that replica's lease,
    /// with the address as its value.
    pub fn replica_key(&self, name: &str, address: &str) -> String {
        self.keys().replica(name.trim(), address)
    }

    pub(super) fn keys(&self) -> Keys {
        let prefix = self.prefix.trim_end_matches('/');
        Keys {
            root: format!("{prefix}/"),
            guards: format!("{prefix}/guards/"),
            alive: format!("{prefix}/alive/"),
            replicas: format!("{prefix}/replicas/"),
            revision: format!("{prefix}/revision"),
            removed: format!("{prefix}/removed/"),
            owner: format!("{prefix}/owner/"),
            owned: format!("{prefix}/owned/"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_refused_with_the_key_to_fix() {
        let check = |config: EtcdConfig| config.validate().unwrap_err().to_string();
        let base = EtcdConfig::default();
        assert!(
            check(EtcdConfig {
                prefix: "/".into(),
                ..base.clone()
            })
            .contains("prefix")
        );
        assert!(
            check(EtcdConfig {
                endpoints: vec![],
                ..base.clone()
            })
            .contains("endpoints")
        );
        assert!(
            check(EtcdConfig {
                username: Some("u".into()),
                ..base.clone()
            })
            .contains("password")
        );
        assert!(
            check(EtcdConfig {
                lease_ttl: Duration::from_secs(1),
                heartbeat_interval: Duration::from_secs(2),
                ..base.clone()
            })
            .contains("lease_ttl_s")
        );
        assert!(base.validate().is_ok());
        let shown = format!(
            "{:?}",
            EtcdConfig {
                username: Some("u".into()),
                password: Some("hunter2".into()),
                ..base
            }
        );
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
