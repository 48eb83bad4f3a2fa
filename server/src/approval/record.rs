//! An approval request as the session store keeps it, the digest of the
//! call it is bound to, and its id (R35).

use guardmesh_proto::v1::{ApprovalRequest, ApprovalState, ToolCall};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The longest reason or note kept, in bytes; longer ones are cut.
pub const MAX_TEXT_BYTES: usize = 1024;

/// Where a stored request stands (expiry aside: see [`Stored::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Standing {
    Pending,
    Approved,
    Denied,
    Used,
}

/// One approval request in the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    pub id: String,
    pub guard: String,
    pub reason: String,
    pub digest: String,
    pub session_id: String,
    /// The stored name of the session's key (identity and id): an approval
    /// holds only in the session, of the identity, that asked.
    pub session_name: String,
    pub chain_revision: u64,
    pub asked_at_ms: u64,
    pub expires_at_ms: u64,
    pub asked_by: String,
    pub tool: String,
    pub arguments: String,
    pub standing: Standing,
    #[serde(default)]
    pub answered_by: String,
    #[serde(default)]
    pub note: String,
    #[serde(default)]
    pub answered_at_ms: u64,
    #[serde(default)]
    pub used_at_ms: u64,
    /// What the call gets if the request expires unanswered (R35).
    #[serde(default)]
    pub steer_on_expiry: bool,
}

impl Stored {
    /// Where it stands at `now`: pending or approved past the expiry is
    /// expired.
    pub fn state(&self, now: u64) -> ApprovalState {
        match self.standing {
            Standing::Pending | Standing::Approved if now >= self.expires_at_ms => {
                ApprovalState::Expired
            }
            Standing::Pending => ApprovalState::Pending,
            Standing::Approved => ApprovalState::Approved,
            Standing::Denied => ApprovalState::Denied,
            Standing::Used => ApprovalState::Used,
        }
    }

    /// Its wire form at `now`.
    pub fn to_wire(&self, now: u64) -> ApprovalRequest {
        ApprovalRequest {
            id: self.id.clone(),
            guard: self.guard.clone(),
            reason: self.reason.clone(),
            digest: self.digest.clone(),
            session_id: self.session_id.clone(),
            chain_revision: self.chain_revision,
            expires_at_ms: self.expires_at_ms,
            state: self.state(now) as i32,
            call: Some(ToolCall {
                call_id: String::new(),
                tool: self.tool.clone(),
                arguments: self.arguments.clone(),
            }),
            asked_at_ms: self.asked_at_ms,
            asked_by: self.asked_by.clone(),
            answered_by: self.answered_by.clone(),
            note: self.note.clone(),
            fallback: if self.steer_on_expiry {
                guardmesh_proto::v1::AskFallback::Steer
            } else {
                guardmesh_proto::v1::AskFallback::Cancel
            } as i32,
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        // A struct of strings and numbers: serializing cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("an approval record: {e}"))
    }
}

/// The digest of a call, as an approval binds it: SHA-256 over the RFC 8785
/// canonical JSON of `{"arguments": ARGUMENTS, "tool": TOOL}`, as
/// lowercase hex. Empty arguments read as `{}`. Arguments that are not JSON
/// (refused before judging, R20) are digested as a string, so they can
/// never equal the digest of an object.
pub fn digest(tool: &str, arguments: &str) -> String {
    let text = arguments.trim();
    let arguments = if text.is_empty() {
        serde_json::Value::Object(serde_json::Map::new())
    } else {
        serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
    };
    let value = serde_json::json!({ "arguments": arguments, "tool": tool });
    let canonical = serde_json_canonicalizer::to_vec(&value).unwrap_or_default();
    let sum = Sha256::digest(&canonical);
    let mut out = String::with_capacity(64);
    for byte in sum {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// A new request id for the session whose approval prefix is `prefix`
/// (32 hex digits: its identity's 16, then its session's; so an
/// identity's and a session's requests share a prefix in the store, and
/// an id of another session is told at once), then 32 random ones.
pub fn new_id(prefix: &str) -> String {
    let random: [u8; 16] = rand::random();
    let mut id = prefix.chars().take(32).collect::<String>();
    for byte in random {
        id.push_str(&format!("{byte:02x}"));
    }
    id
}

/// Whether `id` has the form of a request id: 64 lowercase hex digits.
pub fn well_formed(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Where request `id` lives in the store: `approvals/<session>/<random>`.
pub fn name(id: &str) -> String {
    let (session, random) = id.split_at(32.min(id.len()));
    format!("{}{session}/{random}", PREFIX)
}

/// The prefix of every request's name in the store.
pub const PREFIX: &str = "approvals/";

/// `text` cut to [`MAX_TEXT_BYTES`] at a character boundary.
pub fn clip(text: &str) -> String {
    if text.len() <= MAX_TEXT_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_TEXT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// R35: the digest is over the call's meaning, not its spelling: key
    /// order and whitespace do not change it; a value, a key or the tool
    /// does.
    #[test]
    fn r35_the_digest_is_canonical_and_binds_tool_and_arguments() {
        let a = digest("refund", r#"{"amount": 1500, "to": "acct-1"}"#);
        assert_eq!(a, digest("refund", r#"{"to":"acct-1","amount":1500}"#));
        assert_eq!(a, digest("refund", r#"{"to":"acct-1","amount":1.5e3}"#));
        assert_ne!(a, digest("refund", r#"{"to":"acct-1","amount":1501}"#));
        assert_ne!(a, digest("refunds", r#"{"to":"acct-1","amount":1500}"#));
        assert_ne!(
            a,
            digest("refund", r#"{"to":"acct-1","amount":1500,"x":null}"#)
        );
        assert_eq!(digest("t", ""), digest("t", "{}"));
        assert_ne!(digest("t", "{}"), digest("t", "\"{}\""));
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn r35_ids_carry_their_session_and_are_checked_for_form() {
        let session = "ab".repeat(32);
        let id = new_id(&session);
        assert!(well_formed(&id), "{id}");
        assert!(id.starts_with(&session[..32]));
        assert_ne!(id, new_id(&session));
        assert!(!well_formed(&id.to_uppercase()));
        assert!(!well_formed(&id[..63]));
        assert!(!well_formed("../../etc/passwd"));
        assert_eq!(name(&id), format!("approvals/{}/{}", &id[..32], &id[32..]));
    }

    #[test]
    fn r35_expiry_turns_pending_and_approved_into_expired_only() {
        let mut stored = Stored {
            id: String::new(),
            guard: "g".into(),
            reason: String::new(),
            digest: String::new(),
            session_id: String::new(),
            session_name: String::new(),
            chain_revision: 1,
            asked_at_ms: 0,
            expires_at_ms: 100,
            asked_by: String::new(),
            tool: "t".into(),
            arguments: "{}".into(),
            standing: Standing::Pending,
            answered_by: String::new(),
            note: String::new(),
            answered_at_ms: 0,
            used_at_ms: 0,
            steer_on_expiry: false,
        };
        assert_eq!(stored.state(99), ApprovalState::Pending);
        assert_eq!(stored.state(100), ApprovalState::Expired);
        stored.standing = Standing::Approved;
        assert_eq!(stored.state(100), ApprovalState::Expired);
        stored.standing = Standing::Denied;
        assert_eq!(stored.state(100), ApprovalState::Denied);
        stored.standing = Standing::Used;
        assert_eq!(stored.state(100), ApprovalState::Used);
        assert_eq!(Stored::from_json(&stored.to_json()).unwrap(), stored);
    }
}
