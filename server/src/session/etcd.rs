//! Session memory shared by replicas through the registry's etcd (R34):
//! one key per session under `<prefix>.sessions/` (beside the registry's
//! keys, see [`super::store::sessions_prefix`]), its memory as JSON,
//! updated by compare-and-swap on the key's revision (so two replicas
//! updating one session never lose each other's entries), read
//! linearizably (a member cut off from its quorum refuses rather than
//! answers from old state: the rules that need the memory then fail per
//! their guard's policy, as R17's stale chain does). Each session's key is
//! on a lease of one and a half times the memory's age, granted again at
//! the first write once half of the age has passed, so an abandoned
//! session leaves the store by itself, but never while an entry of it is
//! still within the age (R34: memory the store lost would read as a new
//! session); see [`lease_ttl`].
//!
//! The key names the session by a digest of its identity and id, so the
//! store's keys do not list who has sessions.

use super::key::SessionKey;
use super::memory::{Applied, Memory};
use super::store::{Put, Record, SECRET_CHECK, SecretAgreement, SessionStore, StoreError, Write};
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

/// Attempts of one update that meets concurrent updates of its session.
const ATTEMPTS: u32 = 8;

/// The time to live, in seconds, of a lease a session's key is put on:
/// one and a half times the memory's age (rounded up). A lease is granted
/// again only at a write half of the age or more after the last grant, so
/// the last write under a lease comes less than half the age after it:
/// the key outlives that write's entries by at least their age.
pub(crate) fn lease_ttl(max_age: std::time::Duration) -> i64 {
    let ms = max_age
        .as_millis()
        .saturating_add(max_age.as_millis().div_ceil(2));
    i64::try_from(ms.div_ceil(1000)).unwrap_or(i64::MAX).max(1)
}

/// The etcd store.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    /// Keys the sessions' names (the session secret).
    names: super::Digester,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unavailable(error: etcd_client::Error) -> StoreError {
    StoreError::Unavailable(error.to_string())
}

impl EtcdStore {
    /// Sessions of the chain at the registry's `prefix`, under
    /// `<prefix>.sessions/` of the etcd `client` talks to, each named by
    /// a digest of its key under `names` (the session secret:
    /// [`SessionKey::stored_name`]).
    pub fn new(client: Client, prefix: &str, names: &super::Digester) -> Self {
        Self {
            client,
            prefix: super::store::sessions_prefix(prefix),
            names: names.clone(),
        }
    }

    fn key(&self, key: &SessionKey) -> String {
        format!("{}{}", self.prefix, key.stored_name(&self.names))
    }

    /// The memory at `key`, its revision (0: absent) and lease.
    async fn get(&self, key: &str) -> Result<(Option<Memory>, i64, i64), StoreError> {
        let mut client = self.client.clone();
        let response = client.get(key, None).await.map_err(unavailable)?;
        match response.kvs().first() {
            None => Ok((None, 0, 0)),
            Some(kv) => {
                let memory = serde_json::from_slice(kv.value())
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok((Some(memory), kv.mod_revision(), kv.lease()))
            }
        }
    }
}

#[tonic::async_trait]
impl SessionStore for EtcdStore {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        Ok(self.get(&self.key(key)).await?.0)
    }

    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        let (update, limits, now) = (write.update, write.limits, write.now);
        let key = self.key(key);
        let mut client = self.client.clone();
        for _ in 0..ATTEMPTS {
            let (memory, revision, mut lease) = self.get(&key).await?;
            super::store::still_as_read(memory.as_ref(), update)?;
            let mut memory = memory.unwrap_or_else(|| Memory::begun(update));
            let applied = memory.apply(update, limits, now);
            // A lease lives the memory's age from its grant, whatever is
            // written later: past half of it a new one is granted, so an
            // active session's recent entries never go with its first
            // lease. (The old lease, left without keys, ends by itself.)
            let age = u64::try_from(limits.max_age.as_millis()).unwrap_or(u64::MAX);
            if lease == 0 || now.saturating_sub(memory.lease_at) >= age / 2 {
                lease = client
                    .lease_grant(lease_ttl(limits.max_age), None)
                    .await
                    .map_err(unavailable)?
                    .id();
                memory.lease_at = now;
            }
            let value =
                serde_json::to_vec(&memory).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            let unchanged = if revision == 0 {
                Compare::version(key.clone(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
            };
            let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(
                key.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )]);
            let response = client.txn(txn).await.map_err(unavailable)?;
            if response.succeeded() {
                return Ok(applied);
            }
        }
        Err(StoreError::Contended(ATTEMPTS))
    }

    async fn agree_on_secret(&self, check: &str) -> Result<SecretAgreement, StoreError> {
        let key = format!("{}{SECRET_CHECK}", self.prefix);
        let mut client = self.client.clone();
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), check, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let response = client.txn(txn).await.map_err(unavailable)?;
        if response.succeeded() {
            return Ok(SecretAgreement::First);
        }
        let there = response.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        Ok(SecretAgreement::with(there.as_deref(), check))
    }

    async fn record(&self, name: &str) -> Result<Option<Record>, StoreError> {
        let mut client = self.client.clone();
        let key = format!("{}{name}", self.prefix);
        let response = client.get(key, None).await.map_err(unavailable)?;
        Ok(response.kvs().first().map(|kv| Record {
            value: kv.value().to_vec(),
            version: kv.mod_revision().to_string(),
        }))
    }

    async fn put_record(&self, put: Put<'_>) -> Result<bool, StoreError> {
        let Put { name, version, .. } = put;
        let mut client = self.client.clone();
        let key = format!("{}{name}", self.prefix);
        let unchanged = match version {
            None => Compare::version(key.clone(), CompareOp::Equal, 0),
            Some(version) => {
                let revision: i64 = version
                    .parse()
                    .map_err(|_| StoreError::Corrupt(format!("a record version {version:?}")))?;
                Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
            }
        };
        let seconds = i64::try_from(put.ttl.as_millis().div_ceil(1000))
            .unwrap_or(i64::MAX)
            .max(1);
        let lease = client
            .lease_grant(seconds, None)
            .await
            .map_err(unavailable)?
            .id();
        let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(
            key,
            put.value,
            Some(PutOptions::new().with_lease(lease)),
        )]);
        let response = client.txn(txn).await.map_err(unavailable)?;
        Ok(response.succeeded())
    }

    async fn records(&self, prefix: &str, limit: usize) -> Result<Vec<Record>, StoreError> {
        let mut client = self.client.clone();
        let key = format!("{}{prefix}", self.prefix);
        let options = GetOptions::new()
            .with_prefix()
            .with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
        let response = client.get(key, Some(options)).await.map_err(unavailable)?;
        Ok(response
            .kvs()
            .iter()
            .map(|kv| Record {
                value: kv.value().to_vec(),
                version: kv.mod_revision().to_string(),
            })
            .collect())
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }
}

#[cfg(test)]
mod tests {
    use super::lease_ttl;
    use std::time::Duration;

    /// R34: a session's key in etcd outlives every entry still within the
    /// memory's age. The last write under a lease comes less than half the
    /// age after its grant (a later write grants a new lease), so the
    /// lease must live at least one and a half times the age.
    #[test]
    fn r34_a_sessions_lease_outlives_its_newest_entries_age() {
        for age_ms in [1, 999, 1_000, 1_500, 60_000, 3_600_001, 86_400_000] {
            let age = Duration::from_millis(age_ms);
            let ttl_ms = u64::try_from(lease_ttl(age)).unwrap() * 1000;
            let last_write = age_ms / 2 + age_ms % 2; // just before half of it
            assert!(
                ttl_ms >= last_write + age_ms,
                "age {age_ms} ms: a lease of {ttl_ms} ms ends before an entry \
                 written {last_write} ms after its grant is past the age"
            );
        }
        assert_eq!(lease_ttl(Duration::from_secs(24 * 3600)), 36 * 3600);
    }
}
