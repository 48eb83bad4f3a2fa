//! Following the prefix: the watch and its progress requests, resuming
//! after an outage, listing again when the missed history is gone.

use super::connect::timed;
use super::error::RequestError;
use super::view::chain_key;
use super::{Shared, to_u64};
use etcd_client::{Event, WatchOptions, WatchStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why the watch stopped following.
enum Stopped {
    /// etcd could not be reached: resume from the last revision seen.
    Lost(String),
    /// The missed history is gone (compacted) or belongs to another store:
    /// list the keys again.
    Relist(String),
    /// etcd refused the watch's auth token (tokens do not survive an etcd
    /// restart). Unary requests get a new one by themselves; a watch is
    /// cancelled in-band instead, so the replica authenticates again.
    Unauthenticated(String),
}

impl Shared {
    /// Applies one watch response's events.
    ///
    /// The view's revision moves with the events' own revisions, never with
    /// a response header: etcd 3.4.23 can answer a progress request with a
    /// revision whose events are still on their way, and trusting it would
    /// both skip those events and tell a waiting writer too early.
    fn apply_events(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let mut view = self.view();
        let floor = view.revision;
        let mut reached = floor;
        let before = chain_key(&view);
        for event in events {
            let Some(kv) = event.kv() else { continue };
            if kv.mod_revision() <= floor {
                // Already in a listing taken after this event.
                continue;
            }
            reached = reached.max(kv.mod_revision());
            // A delete event's key has no version; reading that rather than
            // `Event::event_type` (which panics on an unknown type) keeps a
            // surprising message from taking the replica down.
            if kv.version() == 0 {
                self.apply_delete(&mut view, kv);
            } else {
                self.apply_put(&mut view, kv, None);
            }
        }
        view.revision = reached;
        self.publish_replicas(&view);
        if chain_key(&view) != before {
            self.rebuild(&view);
            tracing::debug!(
                revision = view.chain_revision,
                guards = view.guards.len(),
                "etcd registry: chain changed"
            );
        }
        let revision = view.revision;
        drop(view);
        self.applied.send_if_modified(|applied| {
            let next = to_u64(revision);
            let moved = next > *applied;
            *applied = (*applied).max(next);
            moved
        });
    }

    /// Follows the prefix for as long as the registry lives: watches from
    /// `revision + 1`, resumes after an outage, lists again when the missed
    /// history is gone.
    pub(super) async fn follow(self: Arc<Self>, mut revision: i64) {
        let initial_backoff = Duration::from_millis(50);
        let max_backoff = self.config.heartbeat_interval.max(initial_backoff);
        let mut backoff = initial_backoff;
        let mut cluster_id = 0u64;
        let mut relist = false;
        let mut failing = false;
        // Whether the chain is current is `confirm`'s to say (it lists
        // when the watch falls behind the quorum); here a broken watch is
        // logged, once per outage, and reopened.
        let broken = |failing: &mut bool, cause: &str| {
            if *failing {
                tracing::debug!(cause, "etcd registry: the watch is still down");
            } else {
                *failing = true;
                tracing::warn!(
                    cause,
                    "etcd registry: the watch stopped; reopening it (the freshness probe picks up changes meanwhile)"
                );
            }
        };
        loop {
            if relist {
                match self.list(self.config.request_timeout).await {
                    Ok(listed) => {
                        self.health().relists += 1;
                        revision = listed;
                        relist = false;
                    }
                    Err(cause) => {
                        broken(&mut failing, &cause.to_string());
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(max_backoff);
                        continue;
                    }
                }
            }
            let stopped = match self.open_watch(revision + 1).await {
                Ok(stream) => {
                    backoff = initial_backoff;
                    if failing {
                        failing = false;
                        tracing::info!("etcd registry: the watch is open again");
                    }
                    self.watch(stream, revision, &mut cluster_id).await
                }
                Err(cause) => Stopped::Lost(cause.to_string()),
            };
            revision = self.view().revision;
            match stopped {
                Stopped::Lost(cause) => {
                    broken(&mut failing, &cause);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(max_backoff);
                }
                Stopped::Relist(cause) => {
                    tracing::info!(%cause, "etcd registry: listing the chain again");
                    relist = true;
                }
                Stopped::Unauthenticated(cause) => {
                    broken(&mut failing, &cause);
                    self.reauthenticate();
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(max_backoff);
                }
            }
        }
    }

    async fn open_watch(&self, start: i64) -> Result<WatchStream, RequestError> {
        let mut client = self.client.watch_client();
        timed(
            self.config.request_timeout,
            "opening the watch",
            client.watch(
                self.keys.root.clone(),
                Some(WatchOptions::new().with_prefix().with_start_revision(start)),
            ),
        )
        .await
    }

    /// Applies the watch's events until it breaks. Asks the watch for a
    /// progress report every heartbeat: silence for longer than the request
    /// timeout means the watch is gone even when no connection error says so.
    /// (An answer does not confirm the chain: see [`Shared::confirm`].)
    async fn watch(&self, mut stream: WatchStream, from: i64, cluster_id: &mut u64) -> Stopped {
        let mut probe = tokio::time::interval(self.config.heartbeat_interval);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_heard = Instant::now();
        let mut created = false;
        loop {
            tokio::select! {
                message = stream.message() => {
                    let response = match message {
                        Ok(Some(response)) => response,
                        Ok(None) => return Stopped::Lost("etcd closed the watch".into()),
                        Err(error) => return Stopped::Lost(format!("watch: {error}")),
                    };
                    last_heard = Instant::now();
                    if response.compact_revision() > 0 {
                        return Stopped::Relist(format!(
                            "the history from revision {} was compacted (at {})",
                            from + 1,
                            response.compact_revision()
                        ));
                    }
                    if response.canceled() {
                        let cause = format!("etcd cancelled the watch: {}", response.cancel_reason());
                        return if response.cancel_reason().contains("auth token") {
                            Stopped::Unauthenticated(cause)
                        } else {
                            Stopped::Lost(cause)
                        };
                    }
                    let (header_revision, header_cluster) = response
                        .header()
                        .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
                    if !created && response.created() {
                        created = true;
                        // Resuming against another store (a restored backup, a
                        // new cluster) would watch revisions that mean
                        // nothing here.
                        if *cluster_id != 0 && header_cluster != 0 && header_cluster != *cluster_id {
                            *cluster_id = header_cluster;
                            return Stopped::Relist("etcd is another cluster now".into());
                        }
                        if header_revision != 0 && header_revision < from {
                            return Stopped::Relist(format!(
                                "etcd's revision went back from {from} to {header_revision}"
                            ));
                        }
                        if header_cluster != 0 {
                            *cluster_id = header_cluster;
                        }
                    }
                    // Not a confirmation of the chain: a member cut off
                    // from the quorum still answers progress requests.
                    // `confirm` does that with a linearizable read.
                    self.apply_events(response.events());
                }
                _ = probe.tick() => {
                    if last_heard.elapsed() > self.config.heartbeat_interval + self.config.request_timeout {
                        return Stopped::Lost(format!(
                            "the watch did not answer a progress request within {:?}",
                            self.config.request_timeout
                        ));
                    }
                    if let Err(error) = stream.request_progress().await {
                        return Stopped::Lost(format!("watch: {error}"));
                    }
                }
            }
        }
    }
}
