//! `[sessions]`: where the memory kept per session lives, and its bounds
//! (R25, R34).

use super::describe::table;
use super::millis;
use super::registry::{RegistryConfig, RegistryKind};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

table! {
    /// `[sessions]`: where session memory is kept and its bounds (R25, R34).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct SessionsConfig {
        /// Where session memory is kept: `registry` (etcd when the registry
        /// is etcd, shared by the replicas; else this mesh's memory),
        /// `memory` (this mesh's memory, never shared: each replica remembers
        /// only what it saw) or `redis` (Redis or Valkey at `redis_url`,
        /// shared).
        pub store: SessionStoreKind,
        /// With store = "redis": `redis://[user:password@]host:port[/db]`, or
        /// `rediss://` for TLS verified against the system's roots; start-up
        /// tries for `registry.dial_timeout_ms`.
        pub redis_url: Option<String>,
        /// With store = "redis": a file holding Redis's password (a final
        /// newline is dropped), used instead of one in the URL.
        pub redis_password_file: Option<PathBuf>,
        // The session secret (R34).
        /// A file whose bytes (at least 32) key the digests of values seen;
        /// required with a shared store (etcd or redis), the same file on
        /// every replica, never written into the store. Create one with
        /// `head -c 32 /dev/urandom > FILE`. Unset with a single mesh: a
        /// random secret per process.
        pub secret_file: Option<PathBuf>,
        /// Deadline of each read or update of a session in the store, in
        /// milliseconds; past it the rules that read `session` fail per their
        /// guard's failure policy.
        pub store_timeout_ms: u64,
        /// Bytes one session's memory may hold; past it the oldest entries go
        /// first.
        pub max_bytes: usize,
        /// Entries (calls, labels, values seen) one session may hold; past it
        /// the oldest go first.
        pub max_entries: usize,
        /// Entries older than this are dropped.
        pub max_age_ms: u64,
        /// Labels one session may hold; past it the oldest go first.
        pub max_labels: usize,
        /// Bytes of one label; a longer one is refused.
        pub max_label_bytes: usize,
        /// Digests kept of the values of one result.
        pub max_values_per_result: usize,
        /// Sessions a mesh keeps in its own memory (a shared store bounds them
        /// by `max_age_ms` instead); past it the least recently updated goes.
        pub max_sessions: usize,
        /// Sessions one identity may have in the mesh's own memory; past it
        /// its least recently updated goes.
        pub max_sessions_per_identity: usize,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, SettingError};

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
}
