//! Session memory shared by replicas through the registry's etcd (R34):
//! one key per session under `<prefix>.sessions/` (beside the registry's
//! keys, see [`super::store::sessions_prefix`]), its memory as JSON,
//! updated by compare-and-swap on the key's revision (so two replicas
//! updating one session never lose each other's entries), read
//! linearizably (a member cut off from its quorum refuses rather than
//! answers from old state: the rules that need the memory then fail per
//! their guard's policy, as R17's stale chain does). Each session's key is
//! on a lease of the memory's age, granted again once half of it has
//! passed, so an abandoned session leaves the store by itself and an
//! active one keeps its recent entries.
//!
//! The key names the session by a digest of its identity and id, so the
//! store's keys do not list who has sessions.

use super::key::SessionKey;
use super::limits::SessionLimits;
use super::memory::{Applied, Memory, Update};
use super::store::{SECRET_CHECK, SecretAgreement, SessionStore, StoreError};
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};

/// Attempts of one update that meets concurrent updates of its session.
const ATTEMPTS: u32 = 8;

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

    async fn update(
        &self,
        key: &SessionKey,
        update: &Update,
        limits: &SessionLimits,
        now: u64,
    ) -> Result<Applied, StoreError> {
        let key = self.key(key);
        let mut client = self.client.clone();
        for _ in 0..ATTEMPTS {
            let (memory, revision, mut lease) = self.get(&key).await?;
            let mut memory = memory.unwrap_or_default();
            let applied = memory.apply(update, limits, now);
            // A lease lives the memory's age from its grant, whatever is
            // written later: past half of it a new one is granted, so an
            // active session's recent entries never go with its first
            // lease. (The old lease, left without keys, ends by itself.)
            let age = u64::try_from(limits.max_age.as_millis()).unwrap_or(u64::MAX);
            if lease == 0 || now.saturating_sub(memory.lease_at) >= age / 2 {
                let ttl = i64::try_from(limits.max_age.as_secs())
                    .unwrap_or(i64::MAX)
                    .max(1);
                lease = client
                    .lease_grant(ttl, None)
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
        Ok(match there {
            Some(value) if value == check.as_bytes() => SecretAgreement::Same,
            Some(_) => SecretAgreement::Differs,
            // Deleted in between: the next start writes it.
            None => SecretAgreement::First,
        })
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }
}
