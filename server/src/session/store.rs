//! Where session memory lives, behind [`SessionStore`]: in the mesh's own
//! memory ([`super::local::LocalStore`], a single mesh), or in a store all
//! replicas share ([`super::etcd::EtcdStore`]), so that what one replica
//! learned is seen by the next batch of that session on any replica (R34).

use super::key::SessionKey;
use super::limits::SessionLimits;
use super::memory::{Applied, Memory, Update};
use std::sync::Arc;
use std::time::Duration;

/// Where a shared store keeps the sessions of the chain at the registry's
/// `prefix`: `<prefix>.sessions/` (`/guardmesh` → `/guardmesh.sessions/`).
/// Beside the registry's keys, not under `<prefix>/`: every replica's
/// registry watches and lists `<prefix>/`, and would otherwise be woken by
/// every session write of every replica.
pub fn sessions_prefix(prefix: &str) -> String {
    format!("{}.sessions/", prefix.trim_end_matches('/'))
}

/// The name, under the sessions' prefix, of the check of the session
/// secret (never a session's: those are 64 hex digits).
pub const SECRET_CHECK: &str = "secret-check";

/// What [`secret_check`] is a digest of.
const SECRET_CHECK_TEXT: &str = "guardmesh session secret check v1";

/// The check of the secret `digester` is keyed with: the digest of a fixed
/// text, which a reader of the store cannot turn back into the secret (no
/// more than the digests of values seen).
pub fn secret_check(digester: &super::Digester) -> String {
    super::digest::to_hex(&digester.digest(SECRET_CHECK_TEXT))
}

/// Whether the replicas sharing a store use one secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretAgreement {
    /// No replica had written a check: this one's is there now.
    First,
    /// The check there is this replica's.
    Same,
    /// Another replica wrote another check: the secrets differ.
    Differs,
}

impl SecretAgreement {
    /// How this replica's `check` agrees with the one a store holds
    /// (`there`) when it could not write its own first; `None`: deleted in
    /// between, so the next start writes it.
    pub(crate) fn with(there: Option<&[u8]>, check: &str) -> Self {
        match there {
            Some(value) if value == check.as_bytes() => Self::Same,
            Some(_) => Self::Differs,
            None => Self::First,
        }
    }
}

/// Why session memory could not be read or written. Rules that need the
/// memory then fail per their guard's failure policy (R13): never "no
/// history, so proceed".
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("the session store is unavailable: {0}")]
    Unavailable(String),
    #[error("the session store did not answer within {0:?}")]
    TimedOut(Duration),
    #[error("a session's memory in the store cannot be read: {0}")]
    Corrupt(String),
    #[error("the session's memory kept changing under {0} attempts to update it")]
    Contended(u32),
    /// The memory changed between the batch's read and its write: another
    /// replica judged a batch of the session meanwhile. The batch is
    /// judged again on the memory as it is now (R34).
    #[error(
        "the session's memory changed after this batch read it \
         (another replica judged a batch of the session at the same time)"
    )]
    Changed,
}

/// [`StoreError::Changed`] when `update` was judged on the memory after
/// [`Memory::writes`] updates and `memory` (the store's, `None`: no
/// memory) has had another since (R34).
pub fn still_as_read(memory: Option<&Memory>, update: &Update) -> Result<(), StoreError> {
    match update.read_at {
        Some(read) if read != memory.map_or(0, |m| m.writes) => Err(StoreError::Changed),
        _ => Ok(()),
    }
}

/// A record beside the sessions, as read: its value and its version (an
/// opaque token that changes with every write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub value: Vec<u8>,
    pub version: String,
}

/// One update of a session's memory, as [`SessionStore::update`] applies
/// it: the change, the bounds it is applied within and the time it is
/// applied at (milliseconds since the Unix epoch).
#[derive(Debug, Clone, Copy)]
pub struct Write<'a> {
    pub update: &'a Update,
    pub limits: &'a SessionLimits,
    pub now: u64,
}

/// One write of a record beside the sessions, as
/// [`SessionStore::put_record`] makes it: `value` at `name`, to live
/// `ttl`, when the record there is still at `version` (`None`: when there
/// is none).
#[derive(Debug, Clone)]
pub struct Put<'a> {
    pub name: &'a str,
    pub version: Option<&'a str>,
    pub value: Vec<u8>,
    pub ttl: Duration,
}

/// What a store that keeps no records answers.
fn no_records(kind: &str) -> StoreError {
    StoreError::Unavailable(format!("the {kind} store keeps no records"))
}

/// A store of session memory.
#[tonic::async_trait]
pub trait SessionStore: Send + Sync + std::fmt::Debug {
    /// The memory of `key`, if it has any.
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError>;

    /// The memory of `key` to read, shared: a store that keeps memory in
    /// this process hands out what it holds without copying it; others
    /// load it.
    async fn snapshot(&self, key: &SessionKey) -> Result<Option<Arc<Memory>>, StoreError> {
        Ok(self.load(key).await?.map(Arc::new))
    }

    /// Applies `update` to the memory of `key` at `now` (milliseconds since
    /// the Unix epoch), within `limits`, atomically with respect to other
    /// updates of the same session.
    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError>;

    /// Makes sure the replicas sharing the store key their digests with one
    /// secret: `check` (a digest of a fixed text under this replica's
    /// secret, [`secret_check`]) is written at [`SECRET_CHECK`] if nothing
    /// is there yet, and compared with what is. A store of one mesh has
    /// nothing to compare.
    async fn agree_on_secret(&self, check: &str) -> Result<SecretAgreement, StoreError> {
        let _ = check;
        Ok(SecretAgreement::First)
    }

    /// A small record beside the sessions (an approval request, R35) at
    /// `name` (under the store's prefix), with its version.
    async fn record(&self, name: &str) -> Result<Option<Record>, StoreError> {
        let _ = name;
        Err(no_records(self.kind()))
    }

    /// Writes `value` at `name` to live `ttl`, when the record there is
    /// still at `version` (`None`: when there is none): the atomic
    /// check-and-record that makes an approval single use across replicas
    /// (R35). `Ok(false)`: it changed since it was read; nothing written.
    async fn put_record(&self, put: Put<'_>) -> Result<bool, StoreError> {
        let _ = put;
        Err(no_records(self.kind()))
    }

    /// The records whose names begin with `prefix`, at most `limit`.
    async fn records(&self, prefix: &str, limit: usize) -> Result<Vec<Record>, StoreError> {
        let _ = (prefix, limit);
        Err(no_records(self.kind()))
    }

    /// Its kind, for logs and metrics: `memory`, `etcd`.
    fn kind(&self) -> &'static str;

    /// Whether other meshes (replicas) share it: their batches' writes
    /// can come between a batch's read and its write, so a batch judged on
    /// the memory writes only if it is still as read
    /// ([`Update::read_at`]). A store of one mesh is serialized by the
    /// mesh's session turns.
    fn shared(&self) -> bool {
        true
    }

    /// Sessions and bytes it holds, where it can tell cheaply.
    fn held(&self) -> Option<(usize, usize)> {
        None
    }
}
