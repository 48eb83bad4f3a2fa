//! `[server]`: how the gRPC listener treats silent and dead clients (R25).

use super::describe::table;
use super::millis;
use serde::Deserialize;
use std::time::Duration;

table! {
    /// `[server]`: how the gRPC listener treats connections that say nothing
    /// (R25).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct ServerConfig {
        // Also the first SETTINGS frame; past it the connection is closed.
        /// Time a new connection has to finish TLS and send the HTTP/2
        /// preface, in milliseconds.
        pub handshake_timeout_ms: u64,
        /// HTTP/2 PING interval on connections the mesh hears nothing from,
        /// in milliseconds; 0: no pings.
        pub keepalive_interval_ms: u64,
        /// How long a PING to a client may go unanswered, in milliseconds.
        pub keepalive_timeout_ms: u64,
        // Past it new connections are closed at once.
        /// Most client connections open at once; 0: the open-file limit less
        /// a reserve (1/8, at least 64).
        pub max_connections: usize,
        // Batches still in flight then are cut.
        /// After SIGTERM or SIGINT, how long batches in flight have to be
        /// answered before the process exits anyway, in milliseconds (under
        /// Kubernetes' 30 s terminationGracePeriodSeconds with room for a 5 s
        /// preStop delay); 0: exit at once.
        pub shutdown_grace_ms: u64,
        // Also what spreads long-lived clients over replicas added later.
        /// A client connection older than this is sent an HTTP/2 GOAWAY:
        /// calls in progress finish, new ones go over a new connection (to
        /// any replica behind the Service), in milliseconds; 0: no age.
        pub max_connection_age_ms: u64,
        /// After the GOAWAY of max_connection_age_ms, how long calls and
        /// streams still open on the old connection have before it is
        /// closed, in milliseconds.
        pub max_connection_age_grace_ms: u64,
    }
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
            max_connection_age_ms: 30 * 60 * 1000,
            max_connection_age_grace_ms: 5 * 60 * 1000,
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

    /// `max_connection_age_ms` and its grace, or None without an age.
    pub fn max_connection_age(&self) -> Option<(Duration, Duration)> {
        (self.max_connection_age_ms > 0).then(|| {
            (
                Duration::from_millis(self.max_connection_age_ms),
                Duration::from_millis(self.max_connection_age_grace_ms),
            )
        })
    }

    pub fn listener_limits(&self) -> crate::security::tls::ListenerLimits {
        crate::security::tls::ListenerLimits {
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            keepalive_interval: (self.keepalive_interval_ms > 0)
                .then(|| Duration::from_millis(self.keepalive_interval_ms)),
            keepalive_timeout: Duration::from_millis(self.keepalive_timeout_ms),
            max_connections: self.max_connections,
            max_connection_age: self.max_connection_age(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
        assert!(
            crate::config::check_error("[server]\nhandshake_timeout_ms = 0")
                .contains("server.handshake_timeout_ms")
        );
        let err = Config::parse("[server]\nhandshake_timeout = 1", "cfg.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("handshake_timeout"), "{err}");
    }
}
