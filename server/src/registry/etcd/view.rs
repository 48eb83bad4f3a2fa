//! The replica's view of the keys under its prefix: listing them, applying
//! a put or a delete, reading a stored registration back as a guard, and
//! publishing the chain the view holds (R17).

use super::connect::retried;
use super::error::{RequestError, StoredError};
use super::keys::{escape_address, prefix_end};
use super::{Shared, to_u64};
use crate::registry::ChainSpec;
use crate::registry::spec::Guard;
use etcd_client::{GetOptions, KeyValue};
use guardmesh_proto::v1::GuardSpec;
use prost::Message;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// One registration as stored.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    create_revision: i64,
    mod_revision: i64,
    guard: Arc<Guard>,
}

/// What a replica knows of the keys under its prefix.
#[derive(Debug, Default)]
pub(super) struct View {
    /// The etcd revision the view reflects; events at or below it are old.
    pub(super) revision: i64,
    /// Revision of the last chain change (R17).
    pub(super) chain_revision: i64,
    pub(super) guards: HashMap<String, Entry>,
    /// Every key under `<prefix>/guards/` (valid or not), by name, with its
    /// mod revision: what the freshness probe compares with the quorum's.
    pub(super) guard_keys: BTreeMap<String, i64>,
    pub(super) invalid: BTreeMap<String, String>,
    pub(super) alive: HashSet<String>,
    pub(super) heartbeated: HashSet<String>,
    /// Replicas announced by heartbeats: guard name -> key suffix ->
    /// address (R32).
    pub(super) replicas: BTreeMap<String, BTreeMap<String, String>>,
}

impl Shared {
    pub(super) fn view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lists every key under the prefix and replaces the view with it.
    /// Returns the listing's revision.
    pub(super) async fn list(&self, timeout: Duration) -> Result<i64, RequestError> {
        let sent = Instant::now();
        let (revision, kvs) = self.read_all(timeout).await?;
        let changed = {
            let mut view = self.view();
            if revision <= view.revision {
                // An older listing than what the watch already applied.
                None
            } else {
                let mut next = View {
                    revision,
                    heartbeated: view.heartbeated.clone(),
                    ..View::default()
                };
                for kv in &kvs {
                    self.apply_put(&mut next, kv, Some(&view.guards));
                }
                for name in view.alive.difference(&next.alive) {
                    self.log_expired(&next, name);
                }
                let changed = chain_key(&view) != chain_key(&next);
                *view = next;
                if changed {
                    self.rebuild(&view);
                }
                self.publish_replicas(&view);
                Some(changed)
            }
        };
        self.contact(sent);
        if changed.is_some() {
            self.applied.send_replace(to_u64(revision));
        }
        Ok(revision)
    }

    /// Reads every key under the prefix, in pages (etcd limits the size of
    /// one answer, 4 MiB by default), all at the revision of the first page.
    /// The first page is a linearizable read (etcd's default): a member cut
    /// off from the quorum cannot answer it with its old state.
    async fn read_all(&self, timeout: Duration) -> Result<(i64, Vec<KeyValue>), RequestError> {
        const PAGE: i64 = 512;
        let started = Instant::now();
        let end = prefix_end(self.keys.root.as_bytes());
        let mut from = self.keys.root.clone().into_bytes();
        let mut revision = 0;
        let mut kvs = Vec::new();
        loop {
            let mut response = retried(
                timeout.saturating_sub(started.elapsed()),
                self.config.endpoints.len(),
                "listing the registry",
                &|| self.reauthenticate(),
                || {
                    let mut kv = self.client.kv_client();
                    let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
                    if revision > 0 {
                        options = options.with_revision(revision);
                    }
                    let from = from.clone();
                    async move { kv.get(from, Some(options)).await }
                },
            )
            .await?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            let more = response.more();
            let page = response.take_kvs();
            match page.last() {
                Some(last) if more => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => {
                    kvs.extend(page);
                    return Ok((revision, kvs));
                }
            }
            kvs.extend(page);
        }
    }

    /// Applies a put of `kv` to `view`. `previous` lets a listing reuse the
    /// compiled guard of an unchanged registration.
    pub(super) fn apply_put(
        &self,
        view: &mut View,
        kv: &KeyValue,
        previous: Option<&HashMap<String, Entry>>,
    ) {
        let Ok(key) = std::str::from_utf8(kv.key()) else {
            return;
        };
        if key == self.keys.revision {
            view.chain_revision = view.chain_revision.max(kv.mod_revision());
        } else if let Some(name) = key.strip_prefix(self.keys.guards.as_str()) {
            view.chain_revision = view.chain_revision.max(kv.mod_revision());
            view.guard_keys.insert(name.to_owned(), kv.mod_revision());
            if let Some(entry) = previous
                .and_then(|p| p.get(name))
                .filter(|e| e.mod_revision == kv.mod_revision())
            {
                view.guards.insert(name.to_owned(), entry.clone());
                return;
            }
            match self.decode(name, kv.value()) {
                Ok(guard) => {
                    view.invalid.remove(key);
                    view.guards.insert(
                        name.to_owned(),
                        Entry {
                            create_revision: kv.create_revision(),
                            mod_revision: kv.mod_revision(),
                            guard,
                        },
                    );
                }
                Err(reason) => {
                    tracing::error!(key, %reason, "etcd registry: registration cannot be read; batches are refused until it is fixed or deregistered");
                    view.guards.remove(name);
                    view.invalid.insert(key.to_owned(), reason.to_string());
                }
            }
        } else if let Some(name) = key.strip_prefix(self.keys.alive.as_str()) {
            if view.alive.insert(name.to_owned()) && previous.is_none() {
                tracing::info!(guard = name, "etcd registry: guard heartbeating");
            }
            view.heartbeated.insert(name.to_owned());
        } else if let Some((name, suffix)) = key
            .strip_prefix(self.keys.replicas.as_str())
            .and_then(|rest| rest.rsplit_once('/'))
        {
            // The value is the address; the key must be its escaped form,
            // so that one address is one key.
            let Ok(address) = std::str::from_utf8(kv.value()) else {
                tracing::warn!(
                    key,
                    "etcd registry: announced replica is not UTF-8; ignored"
                );
                return;
            };
            if name.is_empty() || escape_address(address) != suffix {
                tracing::warn!(
                    key,
                    address,
                    "etcd registry: announced replica's key does not name its address; ignored"
                );
                return;
            }
            let set = view.replicas.entry(name.to_owned()).or_default();
            if set.insert(suffix.to_owned(), address.to_owned()).is_none() && previous.is_none() {
                tracing::info!(guard = name, address, "etcd registry: replica announced");
            }
            view.heartbeated.insert(name.to_owned());
        }
    }

    /// Applies a delete of `kv`'s key to `view`.
    pub(super) fn apply_delete(&self, view: &mut View, kv: &KeyValue) {
        let Ok(key) = std::str::from_utf8(kv.key()) else {
            return;
        };
        if let Some(name) = key.strip_prefix(self.keys.guards.as_str()) {
            view.chain_revision = view.chain_revision.max(kv.mod_revision());
            view.guard_keys.remove(name);
            view.guards.remove(name);
            view.invalid.remove(key);
        } else if let Some(name) = key.strip_prefix(self.keys.alive.as_str())
            && view.alive.remove(name)
        {
            self.log_expired(view, name);
        } else if let Some((name, suffix)) = key
            .strip_prefix(self.keys.replicas.as_str())
            .and_then(|rest| rest.rsplit_once('/'))
            && let Some(set) = view.replicas.get_mut(name)
            && let Some(address) = set.remove(suffix)
        {
            tracing::info!(
                guard = name,
                address,
                "etcd registry: replica left (its heartbeat lease ended)"
            );
            if set.is_empty() {
                view.replicas.remove(name);
                if !view.alive.contains(name) {
                    self.log_expired(view, name);
                }
            }
        }
    }

    fn log_expired(&self, view: &View, name: &str) {
        match view.guards.get(name) {
            Some(entry) => tracing::warn!(
                guard = name,
                failure_policy = entry.guard.failure_policy.name(),
                "etcd registry: guard heartbeat lapsed; it stays in the chain and its failure policy applies while it cannot be reached (R15)"
            ),
            None => tracing::debug!(
                guard = name,
                "etcd registry: heartbeat of an unregistered guard lapsed"
            ),
        }
    }

    /// A stored registration as a guard: the one this replica admitted
    /// and wrote, if it is that one; otherwise read and checked here, its
    /// policy compiled once (another replica wrote it).
    fn decode(&self, name: &str, value: &[u8]) -> Result<Arc<Guard>, StoredError> {
        if let Some(guard) = self.own_write(name, value) {
            return Ok(guard);
        }
        let spec = GuardSpec::decode(value)?;
        let guard =
            crate::registry::registration::from_store(&spec, self.default_timeout).map(Arc::new)?;
        if guard.name != name {
            return Err(StoredError::Misnamed {
                key: name.to_owned(),
                name: guard.name.clone(),
            });
        }
        Ok(guard)
    }

    /// Publishes the view's chain (R17: a new snapshot, old ones unchanged).
    pub(super) fn rebuild(&self, view: &View) {
        let mut entries: Vec<&Entry> = view.guards.values().collect();
        entries.sort_by(|a, b| {
            (a.guard.priority, a.create_revision, &a.guard.name).cmp(&(
                b.guard.priority,
                b.create_revision,
                &b.guard.name,
            ))
        });
        self.chain.store(Arc::new(ChainSpec {
            revision: to_u64(view.chain_revision),
            guards: entries.into_iter().map(|e| e.guard.clone()).collect(),
        }));
        self.unreadable.store(
            view.invalid
                .iter()
                .next()
                .map(|(key, why)| Arc::new((key.clone(), why.clone()))),
        );
    }
}

/// What the chain is made of: a listing that yields the same key reuses the
/// published `ChainSpec` (and the mesh its chain snapshot).
pub(super) fn chain_key(view: &View) -> (i64, Vec<(String, i64)>) {
    let mut guards: Vec<(String, i64)> = view
        .guards
        .iter()
        .map(|(name, e)| (name.clone(), e.mod_revision))
        .collect();
    guards.sort_unstable();
    (view.chain_revision, guards)
}
