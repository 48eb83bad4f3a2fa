//! Writes: registering and deregistering in etcd transactions, an owner's
//! quota checked in the same transaction (R25), and waiting until the
//! replica has read its own write back.

use super::connect::retried;
use super::{Shared, to_u64};
use crate::registry::spec::Guard;
use crate::registry::{CheckedGuard, Deregistered, Owner, Registered, RegistryError};
use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp, TxnOpResponse};
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

/// Registrations a replica is writing: name -> (the bytes stored, the
/// guard admitted).
pub(super) type Written = HashMap<String, (Vec<u8>, Arc<Guard>)>;

impl Shared {
    fn written(&self) -> std::sync::MutexGuard<'_, Written> {
        self.written.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The guard this replica admitted and is writing (or wrote) as
    /// `value` under `name`, taken once its write is read back.
    pub(super) fn own_write(&self, name: &str, value: &[u8]) -> Option<Arc<Guard>> {
        let mut written = self.written();
        match written.get(name) {
            Some((stored, guard)) if stored.as_slice() == value => {
                let guard = guard.clone();
                written.remove(name);
                Some(guard)
            }
            _ => None,
        }
    }

    /// Runs a write transaction, retried on another member within the
    /// request timeout (the transactions of this registry are idempotent).
    async fn transaction(
        &self,
        what: &'static str,
        txn: Txn,
    ) -> Result<etcd_client::TxnResponse, RegistryError> {
        retried(
            self.config.request_timeout,
            self.config.endpoints.len(),
            what,
            &|| self.reauthenticate(),
            || {
                let mut kv = self.client.kv_client();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            },
        )
        .await
        .map_err(|e| RegistryError::Unavailable(e.to_string()))
    }

    /// Waits until this replica's view includes `revision`, so that a
    /// `Register` followed by a batch on the same replica sees the guard.
    /// If the watch lags (or is reconnecting), lists instead.
    async fn settle(&self, revision: i64) {
        let target = to_u64(revision);
        let mut applied = self.applied.subscribe();
        let caught_up = matches!(
            tokio::time::timeout(
                self.config.request_timeout,
                applied.wait_for(|r| *r >= target),
            )
            .await,
            Ok(Ok(_))
        );
        if !caught_up && let Err(cause) = self.list(self.config.request_timeout).await {
            tracing::warn!(%cause, revision, "etcd registry: could not read back a write; the chain follows once the watch catches up");
        }
    }

    pub(super) async fn register(
        &self,
        checked: CheckedGuard,
        owner: Option<Owner>,
        only_if_absent: bool,
    ) -> Result<Registered, RegistryError> {
        let name = checked.name().to_owned();
        // Stored as given (not as compiled): each replica applies its own
        // default timeout to `timeout_ms = 0`.
        let stored = checked.stored().encode_to_vec();
        // This replica's own watch reads the write back: it reuses the
        // guard checked here rather than compile it again.
        self.written()
            .insert(name.clone(), (stored.clone(), checked.guard().clone()));
        let result = self
            .write_registration(&checked, stored, owner, only_if_absent)
            .await;
        if result.is_err() {
            self.written().remove(&name);
        }
        result
    }

    /// The registration's transaction, and the settling of its result.
    async fn write_registration(
        &self,
        checked: &CheckedGuard,
        stored: Vec<u8>,
        owner: Option<Owner>,
        only_if_absent: bool,
    ) -> Result<Registered, RegistryError> {
        let name = checked.name().to_owned();
        let key = self.keys.guard(&name);
        let tombstone = self.keys.removed(&name);
        let write = || {
            vec![
                TxnOp::put(key.clone(), stored.clone(), None),
                TxnOp::put(self.keys.revision.clone(), name.clone(), None),
            ]
        };
        let absent = Compare::version(key.clone(), CompareOp::Equal, 0);
        let txn = if only_if_absent {
            // Seeding from a config file: never over a registration, and
            // never over a deliberate removal (R17), which leaves a tombstone.
            let never_removed = Compare::version(tombstone.clone(), CompareOp::Equal, 0);
            Txn::new()
                .when([absent, never_removed])
                .and_then(write())
                .or_else([TxnOp::get(tombstone.clone(), None)])
        } else {
            // Creating and updating are the same put; the comparison only
            // tells which one happened. An update keeps the key's
            // create_revision, hence its position (R16). An explicit
            // registration clears a tombstone: the name may be seeded again
            // once it is deregistered again.
            let mut ops = write();
            ops.push(TxnOp::delete(tombstone.clone(), None));
            Txn::new().when([absent]).and_then(ops.clone()).or_else(ops)
        };
        // Retried: the same put again leaves the same state. (If an attempt
        // that timed out was applied, the next one reports an update.)
        // The answer of the registration's own transaction, and the
        // revision of the write (a nested transaction's answer has none).
        let (response, written_at) = match &owner {
            None => {
                let response = self.transaction("registering", txn).await?;
                let revision = response.header().map_or(0, |h| h.revision());
                (response, revision)
            }
            Some(owner) => self.owned_transaction(checked.guard(), owner, txn).await?,
        };
        let created = response.succeeded();
        let revision = if only_if_absent && !created {
            let removed_at = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().map(KeyValue::mod_revision),
                _ => None,
            });
            if let Some(removed_at) = removed_at {
                tracing::warn!(
                    guard = %name,
                    removed_at,
                    "etcd registry: this guard was deregistered; its config file entry is not applied (register it through GuardRegistry to bring it back)"
                );
            }
            self.written().remove(&name);
            // Nothing written: answer with what is served.
            i64::try_from(self.chain.load().revision).unwrap_or(i64::MAX)
        } else {
            self.settle(written_at).await;
            written_at
        };
        let chain = self.chain.load();
        let position = chain
            .guards
            .iter()
            .position(|g| g.name == name)
            .unwrap_or(chain.guards.len());
        Ok(Registered {
            revision: to_u64(revision),
            position,
            created,
        })
    }

    /// Runs `registration` (a transaction on the guard's keys) only if
    /// `owner` may register `guard`, and records the guard as the owner's in
    /// the same transaction (R25). The owner's count is read, checked, and
    /// the write made on condition that none of the owner's keys (nor the
    /// guard's owner) changed since the read: two replicas registering for
    /// one identity at once cannot both pass on the same count; the one that
    /// loses reads again. Returns the answer of `registration` itself, and
    /// the revision of the write.
    async fn owned_transaction(
        &self,
        guard: &Guard,
        owner: &Owner,
        registration: Txn,
    ) -> Result<(etcd_client::TxnResponse, i64), RegistryError> {
        let name = &guard.name;
        let owned_by = self.keys.owned_by(&owner.identity);
        let owner_key = self.keys.owner(name);
        let mine = format!("{owned_by}{name}");
        let started = Instant::now();
        loop {
            let read = Txn::new().and_then([
                TxnOp::get(
                    owned_by.clone(),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                ),
                TxnOp::get(owner_key.clone(), None),
            ]);
            let response = self
                .transaction("reading the registrar's quota", read)
                .await?;
            let read_at = response.header().map_or(0, |h| h.revision());
            let mut owned = Vec::new();
            let mut previous = None;
            for op in response.op_responses() {
                let TxnOpResponse::Get(get) = op else {
                    continue;
                };
                for kv in get.kvs() {
                    let Ok(key) = std::str::from_utf8(kv.key()) else {
                        continue;
                    };
                    if let Some(owned_name) = key.strip_prefix(owned_by.as_str()) {
                        owned.push(owned_name.to_owned());
                    } else if key == owner_key {
                        previous = Some(String::from_utf8_lossy(kv.value()).into_owned());
                    }
                }
            }
            let already = owned.iter().any(|n| n == name);
            owned.retain(|n| n != name);
            // The bytes of the owner's other guards, as this replica
            // compiled them: once its chain holds every one of them (a
            // guard registered through another replica a moment ago may
            // not have reached it yet).
            let holds_all = || {
                let chain = self.chain.load();
                owned
                    .iter()
                    .all(|name| chain.guards.iter().any(|g| g.name == *name))
            };
            if !holds_all() {
                self.settle(read_at).await;
            }
            let used = {
                let chain = self.chain.load();
                chain
                    .guards
                    .iter()
                    .filter(|g| owned.contains(&g.name))
                    .map(|g| crate::registry::registration::policy_bytes(g))
                    .fold(0usize, usize::saturating_add)
            };
            owner.admits(guard, owned.len(), already, used)?;
            let mut ops = vec![
                TxnOp::txn(registration.clone()),
                TxnOp::put(mine.clone(), Vec::new(), None),
                TxnOp::put(owner_key.clone(), owner.identity.clone(), None),
            ];
            if let Some(previous) = previous.filter(|p| *p != owner.identity) {
                ops.push(TxnOp::delete(
                    format!("{}{name}", self.keys.owned_by(&previous)),
                    None,
                ));
            }
            let unchanged = [
                Compare::mod_revision(owned_by.clone(), CompareOp::Less, read_at + 1).with_prefix(),
                Compare::mod_revision(owner_key.clone(), CompareOp::Less, read_at + 1),
            ];
            let response = self
                .transaction("registering", Txn::new().when(unchanged).and_then(ops))
                .await?;
            if response.succeeded() {
                let revision = response.header().map_or(0, |h| h.revision());
                return nested(response)
                    .map(|inner| (inner, revision))
                    .ok_or_else(|| {
                        RegistryError::Unavailable(
                            "registering: etcd answered without the registration's result".into(),
                        )
                    });
            }
            if started.elapsed() > self.config.request_timeout {
                return Err(RegistryError::Unavailable(format!(
                    "registering: the quota of {} kept changing for {:?}; try again",
                    owner.identity, self.config.request_timeout
                )));
            }
            tracing::debug!(guard = %name, identity = %owner.identity, "etcd registry: the registrar's guards changed meanwhile; reading its quota again");
        }
    }

    /// Removes a registration and leaves a tombstone `<prefix>/removed/<name>`,
    /// so that no replica's config file brings the guard back (R17). The
    /// tombstone holds a value unique to this call: when a retried attempt
    /// finds the guard gone, the tombstone tells whether an earlier attempt
    /// of this same call removed it (an attempt can time out and still be
    /// applied). The guard's owner records go in the same transaction, which
    /// frees its place in the owner's quota (R25).
    pub(super) async fn deregister(&self, name: String) -> Result<Deregistered, RegistryError> {
        let name = name.trim();
        let key = self.keys.guard(name);
        let tombstone = self.keys.removed(name);
        let owner_key = self.keys.owner(name);
        let mark = format!("{:016x}", rand::random::<u64>());
        let removal = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Greater, 0)])
            .and_then([
                TxnOp::delete(key, None),
                TxnOp::put(self.keys.revision.clone(), name, None),
                TxnOp::put(tombstone.clone(), mark.clone(), None),
            ])
            .or_else([TxnOp::get(tombstone, None)]);
        let started = Instant::now();
        let response = loop {
            let read = self
                .transaction(
                    "reading the guard's owner",
                    Txn::new().and_then([TxnOp::get(owner_key.clone(), None)]),
                )
                .await?;
            let read_at = read.header().map_or(0, |h| h.revision());
            let owner = read.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get
                    .kvs()
                    .first()
                    .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
                _ => None,
            });
            let mut ops = vec![TxnOp::txn(removal.clone())];
            if let Some(owner) = owner {
                ops.push(TxnOp::delete(owner_key.clone(), None));
                ops.push(TxnOp::delete(
                    format!("{}{name}", self.keys.owned_by(&owner)),
                    None,
                ));
            }
            let unchanged = Compare::mod_revision(owner_key.clone(), CompareOp::Less, read_at + 1);
            let response = self
                .transaction("deregistering", Txn::new().when([unchanged]).and_then(ops))
                .await?;
            if response.succeeded() {
                let revision = response.header().map_or(0, |h| h.revision());
                if let Some(inner) = nested(response) {
                    break (inner, revision);
                }
            }
            if started.elapsed() > self.config.request_timeout {
                return Err(RegistryError::Unavailable(format!(
                    "deregistering: the owner of {name:?} kept changing for {:?}; try again",
                    self.config.request_timeout
                )));
            }
        };
        let (response, written_at) = response;
        let revision = if response.succeeded() {
            written_at
        } else {
            let ours = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get
                    .kvs()
                    .first()
                    .filter(|kv| kv.value() == mark.as_bytes())
                    .map(KeyValue::mod_revision),
                _ => None,
            });
            match ours {
                Some(revision) => revision,
                None => {
                    return Ok(Deregistered {
                        revision: self.chain.load().revision,
                        removed: false,
                    });
                }
            }
        };
        self.settle(revision).await;
        Ok(Deregistered {
            revision: to_u64(revision),
            removed: true,
        })
    }
}

/// The answer of the transaction nested in `response`'s first branch.
fn nested(response: etcd_client::TxnResponse) -> Option<etcd_client::TxnResponse> {
    response.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(inner) => Some(inner),
        _ => None,
    })
}
