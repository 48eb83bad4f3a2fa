//! `[guard_links]`: how the mesh dials and keeps its links to guards.

use super::describe::table;
use super::{SettingError, millis};
use crate::link::LinkConfig;
use serde::Deserialize;
use std::time::Duration;

table! {
    /// `[guard_links]`: how the mesh dials guards.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct LinksConfig {
        /// Deadline of one connection attempt to a guard, in milliseconds.
        pub connect_timeout_ms: u64,
        /// First pause before dialing a lost guard again, in milliseconds;
        /// doubles up to backoff_max_ms.
        pub backoff_initial_ms: u64,
        /// Longest pause between dials of a lost guard, in milliseconds.
        pub backoff_max_ms: u64,
        /// Largest answer accepted from a guard, in bytes.
        pub max_answer_bytes: usize,
        /// Consecutive failures that open a guard's circuit; 0 disables the
        /// circuit.
        pub circuit_failures: u32,
        /// How long an open circuit fails at once before one probe goes
        /// through, in milliseconds.
        pub circuit_open_ms: u64,
        // 300000 is what default grpcio servers accept (R26).
        /// HTTP/2 PING after this long without a frame from the guard, in
        /// milliseconds; 0: off. Below 300000 only with keepalive_force (R26).
        pub keepalive_interval_ms: u64,
        /// How long a PING to a guard may go unanswered, in milliseconds.
        pub keepalive_timeout_ms: u64,
        /// Accept a keepalive_interval_ms below 300000 (for guards whose
        /// servers allow it).
        pub keepalive_force: bool,
        /// TCP keepalive and TCP_USER_TIMEOUT: a vanished guard host is
        /// noticed within about this long, in milliseconds; 0: off, else at
        /// least 2000.
        pub dead_peer_timeout_ms: u64,
        /// Bytes of requests queued for a guard that is not reading them;
        /// past it batches fail at that guard per its policy (R25).
        pub max_queued_bytes: usize,
        /// How often a guard endpoint that is a DNS name is resolved again
        /// for its replicas, in milliseconds (at least 1000); a failed
        /// connection asks sooner (R32).
        pub resolve_interval_ms: u64,
        /// The most requests one replica of a guard is sent at once: the
        /// ceiling of the limit the mesh adapts from the replica's
        /// latency (R25).
        pub max_in_flight: usize,
        /// The least that limit falls to; set it to max_in_flight for a
        /// fixed limit (R25).
        pub min_in_flight: usize,
        /// Requests that may wait for room at a guard's replicas, all
        /// clients together; one client holds at most a quarter. Past it,
        /// or after half the guard's time, batches are shed with
        /// RESOURCE_EXHAUSTED (R25).
        pub max_waiting: usize,
    }
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
            max_in_flight: l.max_in_flight,
            min_in_flight: l.min_in_flight,
            max_waiting: l.max_waiting,
        }
    }
}

impl LinksConfig {
    /// Refuses link settings that default guard servers would punish (R26)
    /// or that cannot work.
    pub(super) fn problems(&self, out: &mut Vec<SettingError>) {
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
        if self.max_in_flight == 0 {
            out.push(SettingError::Zero {
                key: "guard_links.max_in_flight",
            });
        }
        if self.min_in_flight == 0 {
            out.push(SettingError::Zero {
                key: "guard_links.min_in_flight",
            });
        }
        if self.min_in_flight > self.max_in_flight {
            out.push(SettingError::Above {
                key: "guard_links.min_in_flight",
                bound: "guard_links.max_in_flight",
            });
        }
        if self.max_waiting == 0 {
            out.push(SettingError::Zero {
                key: "guard_links.max_waiting",
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

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use std::time::Duration;

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
        assert!(
            crate::config::check_error("[guard_links]\ndead_peer_timeout_ms = 500")
                .contains("dead_peer_timeout_ms")
        );
    }

    #[test]
    fn r25_guard_queue_bound_is_read_and_must_be_positive() {
        let config = Config::parse("[guard_links]\nmax_queued_bytes = 1048576", "t").unwrap();
        assert_eq!(config.mesh_config().link.max_queued_bytes, 1 << 20);
        assert!(
            crate::config::check_error("[guard_links]\nmax_queued_bytes = 0")
                .contains("max_queued_bytes")
        );
    }

    #[test]
    fn r25_the_in_flight_limit_and_the_waiting_bound_have_safe_defaults_and_are_checked() {
        let link = Config::default().mesh_config().link;
        assert_eq!(
            (link.min_in_flight, link.max_in_flight, link.max_waiting),
            (1, 256, 1024)
        );
        let config = Config::parse(
            "[guard_links]\nmin_in_flight = 8\nmax_in_flight = 8\nmax_waiting = 64",
            "t",
        )
        .unwrap();
        assert!(config.check().is_ok());
        let link = config.mesh_config().link;
        assert_eq!(
            (link.min_in_flight, link.max_in_flight, link.max_waiting),
            (8, 8, 64)
        );
        for (text, key) in [
            ("max_in_flight = 0", "max_in_flight"),
            ("max_waiting = 0", "max_waiting"),
            ("min_in_flight = 9\nmax_in_flight = 8", "min_in_flight"),
        ] {
            let config = Config::parse(&format!("[guard_links]\n{text}"), "t").unwrap();
            let err = config.check().unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }
}
