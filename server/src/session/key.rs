//! Whose memory: a session is keyed by the caller's identity (as the auth
//! layer established it, `security::auth`) *and* the session id the batch
//! names, so a caller that claims another caller's session id reaches a
//! memory of its own, never the other's (R34).

use serde::{Deserialize, Serialize};

/// The session id an identity's memory is kept under (R34): it begins
/// with a NUL, as no session id a coordinator may send does (R20).
pub const IDENTITY_SESSION_ID: &str = "\0identity";

/// Whether `session_id` is one the mesh keeps for itself (it begins with a
/// NUL): refused from coordinators (R20).
pub fn is_reserved_session_id(session_id: &str) -> bool {
    session_id.starts_with('\0')
}

/// The key of one session's memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionKey {
    /// The authenticated caller; empty on a mesh without principals (where
    /// every caller may do everything, R24), which then shares one space
    /// of session ids.
    pub identity: String,
    /// The batch's session id (`BatchContext.session_id`).
    pub session_id: String,
}

impl SessionKey {
    pub fn new(identity: impl Into<String>, session_id: impl Into<String>) -> Self {
        Self {
            identity: identity.into(),
            session_id: session_id.into(),
        }
    }

    /// The key of the memory of `identity` across all its sessions (R34):
    /// the identity with [`IDENTITY_SESSION_ID`], a session id no
    /// coordinator may send (R20, [`is_reserved_session_id`]), so no batch
    /// reads or writes it as a session.
    pub fn identity(identity: impl Into<String>) -> Self {
        Self::new(identity, IDENTITY_SESSION_ID)
    }

    /// Whether the batch named a session at all: a batch without a session
    /// id has no memory (nothing is read or written for it).
    pub fn is_anonymous(&self) -> bool {
        self.session_id.is_empty()
    }

    /// The key as a store's key: both parts length-prefixed, so no choice of
    /// identity and session id can spell another pair's key.
    pub fn store_key(&self) -> String {
        format!(
            "{}:{}/{}:{}",
            self.identity.len(),
            self.identity,
            self.session_id.len(),
            self.session_id
        )
    }

    /// The session's name in a shared store (etcd, Redis): the HMAC-SHA256
    /// of [`SessionKey::store_key`] under the session secret, in hex, so
    /// the store's keys do not list who has sessions, and a reader of the
    /// store without the secret cannot confirm a guess of one either.
    pub fn stored_name(&self, digester: &super::Digester) -> String {
        digester.session_name(&self.store_key())
    }

    /// Bytes this key holds.
    pub fn bytes(&self) -> usize {
        self.identity.len() + self.session_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r34_no_identity_and_session_pair_spells_another_pairs_store_key() {
        let a = SessionKey::new("alice/x", "y");
        let b = SessionKey::new("alice", "x/y");
        let c = SessionKey::new("alice:1", "y");
        assert_ne!(a.store_key(), b.store_key());
        assert_ne!(a.store_key(), c.store_key());
        assert_ne!(
            SessionKey::new("", "3:abc").store_key(),
            SessionKey::new("3:abc", "").store_key()
        );
    }

    /// R34, R20: an identity's memory is under a session id that no
    /// coordinator may send, and one identity's never spells another's.
    #[test]
    fn r34_an_identity_memory_key_is_no_session_a_coordinator_can_name() {
        let key = SessionKey::identity("alice");
        assert!(is_reserved_session_id(&key.session_id));
        assert!(!is_reserved_session_id("identity"));
        assert!(!is_reserved_session_id(""));
        assert_ne!(key, SessionKey::new("alice", "identity"));
        assert_ne!(
            SessionKey::identity("alice").store_key(),
            SessionKey::identity("bob").store_key()
        );
    }

    #[test]
    fn r34_a_stored_name_cannot_be_confirmed_without_the_secret() {
        use sha2::Digest as _;
        let a = super::super::Digester::new(&[1u8; 32]).unwrap();
        let b = super::super::Digester::new(&[2u8; 32]).unwrap();
        let key = SessionKey::new("alice", "s-1");
        let name = key.stored_name(&a);
        // 64 hex digits, the same for every replica with the secret.
        assert_eq!(name.len(), 64);
        assert!(name.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(
            name,
            key.stored_name(&super::super::Digester::new(&[1u8; 32]).unwrap())
        );
        // A guess hashed without the secret, or under another secret, does
        // not meet it.
        let plain: String = sha2::Sha256::digest(key.store_key().as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_ne!(name, plain);
        assert_ne!(name, key.stored_name(&b));
        // Nor the digest of a value seen under the same secret.
        assert!(!name.starts_with(&super::super::digest::to_hex(&a.digest(&key.store_key()))));
        // Other sessions, other names.
        assert_ne!(name, SessionKey::new("alice", "s-2").stored_name(&a));
        assert_ne!(name, SessionKey::new("bob", "s-1").stored_name(&a));
    }
}
