//! Where session memory lives, behind [`SessionStore`]: in the mesh's own
//! memory ([`super::local::LocalStore`], a single mesh), or in a store all
//! replicas share ([`super::etcd::EtcdStore`]), so that what one replica
//! learned is seen by the next batch of that session on any replica (R34).

use super::key::SessionKey;
use super::limits::SessionLimits;
use super::memory::{Applied, Memory, Update};
use std::time::Duration;

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
}

/// A store of session memory.
#[tonic::async_trait]
pub trait SessionStore: Send + Sync + std::fmt::Debug {
    /// The memory of `key`, if it has any.
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError>;

    /// Applies `update` to the memory of `key` at `now` (milliseconds since
    /// the Unix epoch), within `limits`, atomically with respect to other
    /// updates of the same session.
    async fn update(
        &self,
        key: &SessionKey,
        update: &Update,
        limits: &SessionLimits,
        now: u64,
    ) -> Result<Applied, StoreError>;

    /// Its kind, for logs and metrics: `memory`, `etcd`.
    fn kind(&self) -> &'static str;

    /// Sessions and bytes it holds, where it can tell cheaply.
    fn held(&self) -> Option<(usize, usize)> {
        None
    }
}
