//! `[approvals]`: a guard's ask and the request a person answers (R35).

use super::describe::table;
use serde::Deserialize;

table! {
    /// `[approvals]`: how long an approval request lives, and how many one
    /// session may have waiting (R35).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct ApprovalsConfig {
        /// How long an approval request may wait for its answer and its
        /// use, in milliseconds; past it a request nobody answered cancels
        /// its call, and an approval not used is refused.
        pub ttl_ms: u64,
        /// Approval requests one session may have waiting at once; past it
        /// a guard's ask cancels its call, saying so (a flood of asks is
        /// bounded).
        pub max_open_per_session: usize,
        /// Approval requests one caller identity may have waiting at once
        /// over all its sessions; past it a guard's ask cancels its call,
        /// saying so.
        pub max_open_per_identity: usize,
    }
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        let settings = crate::approval::Settings::default();
        Self {
            ttl_ms: u64::try_from(settings.ttl.as_millis()).unwrap_or(u64::MAX),
            max_open_per_session: settings.max_open_per_session,
            max_open_per_identity: settings.max_open_per_identity,
        }
    }
}

impl ApprovalsConfig {
    /// The settings the mesh runs with.
    pub fn settings(&self) -> crate::approval::Settings {
        crate::approval::Settings {
            ttl: std::time::Duration::from_millis(self.ttl_ms.max(1)),
            max_open_per_session: self.max_open_per_session.max(1),
            max_open_per_identity: self.max_open_per_identity.max(1),
        }
    }
}
