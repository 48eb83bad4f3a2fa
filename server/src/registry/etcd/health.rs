//! Whether the chain is current: the freshness probe against etcd's
//! quorum every heartbeat, the staleness window and its policy, and what a
//! replica reports about its registry and the liveness of its guards.

use super::config::AfterWindow;
use super::connect::retried;
use super::error::RequestError;
use super::{EtcdRegistry, Shared, to_u64};
use etcd_client::GetOptions;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// Whether a guard of the chain is heartbeating (liveness never changes the
/// chain: R15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Its heartbeat lease is live.
    Alive,
    /// It heartbeated once (as far as this replica saw) and its lease lapsed
    /// or was revoked. It stays in the chain and fails per its policy.
    Expired,
    /// No heartbeat seen. Guards that do not talk to etcd are always here;
    /// that is not an error.
    NoHeartbeat,
}

/// What a replica knows about its registry, for health, metrics and logs.
#[derive(Debug, Clone)]
pub struct RegistryStatus {
    /// Whether etcd's quorum confirmed the chain at the last probe (a
    /// linearizable read, every heartbeat interval).
    pub connected: bool,
    /// Revision of the chain being served (R17).
    pub revision: u64,
    /// Revision of the latest change under the prefix the replica has
    /// applied (guards, heartbeats), or of its latest listing.
    pub applied_revision: u64,
    pub guards: usize,
    /// How long the chain has gone unconfirmed, while etcd is unreachable.
    pub stale_for: Option<Duration>,
    /// Whether batches are judged right now (false after the staleness
    /// window under `after_window = "refuse"`).
    pub serving: bool,
    /// Why etcd was last unreachable.
    pub last_error: Option<String>,
    /// How many times the replica listed the keys again because its watch
    /// could not resume (compacted history, a new cluster) or fell behind
    /// the chain the quorum confirmed.
    pub relists: u64,
    /// The chain's guards, in order, with their liveness.
    pub liveness: Vec<(String, Liveness)>,
    /// Keys under `<prefix>/guards/` that do not decode to a valid
    /// registration, with why. While there is one the replica refuses
    /// batches (`check`), rather than judge without that guard.
    pub invalid: Vec<(String, String)>,
}

/// Connection state, for staleness.
#[derive(Debug)]
pub(super) struct Health {
    pub(super) connected: bool,
    /// When etcd's quorum last confirmed the chain: the time a linearizable
    /// read was sent whose answer matched the chain (or a listing).
    pub(super) last_contact: Instant,
    pub(super) last_error: Option<String>,
    pub(super) relists: u64,
    /// Whether passing the staleness window was logged for this outage.
    pub(super) window_logged: bool,
}

/// Whether a replica may judge, given how long etcd has been unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Freshness {
    Fresh,
    /// Unreachable, within the window: judge with the last chain.
    Stale,
    /// Past the window, policy `serve_stale`.
    ServeStale,
    /// Past the window, policy `refuse`.
    Refuse,
}

pub(super) fn freshness(
    connected: bool,
    since_contact: Duration,
    window: Duration,
    policy: AfterWindow,
) -> Freshness {
    if connected {
        Freshness::Fresh
    } else if since_contact <= window {
        Freshness::Stale
    } else {
        match policy {
            AfterWindow::Refuse => Freshness::Refuse,
            AfterWindow::ServeStale => Freshness::ServeStale,
        }
    }
}

impl EtcdRegistry {
    /// What the replica knows about etcd and the chain. Cheap enough for a
    /// health check or a metrics scrape.
    pub fn status(&self) -> RegistryStatus {
        let chain = self.shared.chain.load_full();
        let (connected, since, last_error, relists) = {
            let health = self.shared.health();
            (
                self.shared.confirmed(&health),
                health.last_contact.elapsed(),
                health.last_error.clone(),
                health.relists,
            )
        };
        let freshness = freshness(
            connected,
            since,
            self.shared.config.staleness_window,
            self.shared.config.after_window,
        );
        let view = self.shared.view();
        let liveness = chain
            .guards
            .iter()
            .map(|g| {
                let state = if view.alive.contains(&g.name) || view.replicas.contains_key(&g.name) {
                    Liveness::Alive
                } else if view.heartbeated.contains(&g.name) {
                    Liveness::Expired
                } else {
                    Liveness::NoHeartbeat
                };
                (g.name.clone(), state)
            })
            .collect();
        RegistryStatus {
            connected,
            revision: chain.revision,
            applied_revision: to_u64(view.revision),
            guards: chain.guards.len(),
            stale_for: (!connected).then_some(since),
            serving: freshness != Freshness::Refuse,
            last_error,
            relists,
            liveness,
            invalid: view
                .invalid
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }
}

impl Shared {
    pub(super) fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the chain counts as confirmed: the last probe succeeded, and
    /// recently enough (a probe that stopped running confirms nothing).
    pub(super) fn confirmed(&self, health: &Health) -> bool {
        health.connected
            && health.last_contact.elapsed()
                <= self.config.heartbeat_interval + self.config.request_timeout * 4
    }

    /// Records that etcd's quorum confirmed the chain as of `at` (when the
    /// confirming read was sent).
    pub(super) fn contact(&self, at: Instant) {
        let mut health = self.health();
        if !health.connected {
            let outage = health.last_contact.elapsed();
            health.connected = true;
            health.window_logged = false;
            if health.last_error.is_some() {
                tracing::info!(
                    outage_ms = u64::try_from(outage.as_millis()).unwrap_or(u64::MAX),
                    revision = self.chain.load().revision,
                    "etcd registry: the chain is confirmed with etcd's quorum again"
                );
            }
        }
        health.last_contact = health.last_contact.max(at);
    }

    /// Records that etcd could not be reached, and logs the staleness once
    /// per outage and once more when the window passes.
    fn lost(&self, cause: &str) {
        let window = self.config.staleness_window;
        let revision = self.chain.load().revision;
        let mut health = self.health();
        if health.connected {
            health.connected = false;
            tracing::warn!(
                cause,
                revision,
                window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
                "etcd registry: cannot confirm the chain with etcd's quorum; judging with the last chain until the staleness window passes"
            );
        } else {
            tracing::debug!(cause, "etcd registry: etcd still unreachable");
        }
        health.last_error = Some(cause.to_owned());
        let since = health.last_contact.elapsed();
        if since > window && !health.window_logged {
            health.window_logged = true;
            match self.config.after_window {
                AfterWindow::Refuse => tracing::error!(
                    cause,
                    revision,
                    stale_ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX),
                    "etcd registry: staleness window passed; refusing batches with UNAVAILABLE until the quorum confirms the chain"
                ),
                AfterWindow::ServeStale => tracing::error!(
                    cause,
                    revision,
                    stale_ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX),
                    "etcd registry: staleness window passed; still judging with the stale chain (after_window = serve_stale)"
                ),
            }
        }
    }

    /// Confirms the chain with etcd's quorum every heartbeat, for as long as
    /// the registry lives: this, not the watch, is what keeps the chain
    /// fresh (R17). A member cut off from the quorum still answers the watch
    /// and its progress requests from its old state; it cannot answer a
    /// linearizable read.
    pub(super) async fn confirm(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let sent = Instant::now();
            match self.probe().await {
                Ok(()) => self.contact(sent),
                Err(cause) => self.lost(&cause.to_string()),
            }
        }
    }

    /// One freshness probe: a linearizable read of the registration keys
    /// (names and revisions only). The chain is confirmed when the view has
    /// applied at least the read's revision, or holds the same keys at the
    /// same revisions; otherwise the watch is behind the quorum and the
    /// chain is listed again.
    async fn probe(&self) -> Result<(), RequestError> {
        let response = retried(
            self.config.request_timeout,
            self.config.endpoints.len(),
            "confirming the chain with etcd's quorum",
            &|| self.reauthenticate(),
            || {
                let mut kv = self.client.kv_client();
                let guards = self.keys.guards.clone();
                async move {
                    kv.get(
                        guards,
                        Some(GetOptions::new().with_prefix().with_keys_only()),
                    )
                    .await
                }
            },
        )
        .await?;
        let revision = response.header().map_or(0, |h| h.revision());
        let current = || {
            let view = self.view();
            view.revision >= revision || {
                let quorum = response.kvs().iter().filter_map(|kv| {
                    let key = std::str::from_utf8(kv.key()).ok()?;
                    Some((
                        key.strip_prefix(self.keys.guards.as_str())?,
                        kv.mod_revision(),
                    ))
                });
                quorum.eq(view.guard_keys.iter().map(|(k, v)| (k.as_str(), *v)))
            }
        };
        // Right after a change the watch may be a moment behind the read:
        // give it the request timeout to catch up before listing.
        let mut applied = self.applied.subscribe();
        let caught_up = tokio::time::timeout(self.config.request_timeout, async {
            while !current() {
                if applied.changed().await.is_err() {
                    return false;
                }
            }
            true
        })
        .await;
        if matches!(caught_up, Ok(true)) {
            return Ok(());
        }
        tracing::info!(
            revision,
            "etcd registry: the watch is behind the quorum's chain; listing it"
        );
        self.list(self.config.request_timeout).await?;
        self.health().relists += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_policy() {
        let w = Duration::from_secs(10);
        let refuse = AfterWindow::Refuse;
        let stale = AfterWindow::ServeStale;
        let secs = Duration::from_secs;
        for (current, since, after, want) in [
            (true, secs(99), refuse, Freshness::Fresh),
            (false, secs(3), refuse, Freshness::Stale),
            (false, w, refuse, Freshness::Stale),
            (false, secs(11), refuse, Freshness::Refuse),
            (false, secs(11), stale, Freshness::ServeStale),
        ] {
            assert_eq!(freshness(current, since, w, after), want, "{since:?}");
        }
    }
}
