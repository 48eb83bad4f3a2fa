//! One spelling for every enum of the contract outside protobuf: the names
//! config files, command lines, logs, metrics and traces use
//! (`fail_closed`, `dry_run`, `timed_out`, ...). Each enum gets `name()`,
//! `Display` and `FromStr` from the one table below, so no other place
//! spells them.

use crate::v1::{
    Action, ApprovalState, AskFallback, FailurePolicy, GuardMode, GuardPhases, GuardRole,
    ResultAction, SessionMemoryUse, SkipKind, TraceStatus,
};
use std::fmt;
use std::str::FromStr;

/// A name that is not one of an enum's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownName {
    /// What was being named, e.g. "failure policy".
    pub what: &'static str,
    /// The name given.
    pub given: String,
    /// The names that exist.
    pub expected: &'static [&'static str],
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?} (expected one of: {})",
            self.what,
            self.given,
            self.expected.join(", ")
        )
    }
}

impl std::error::Error for UnknownName {}

macro_rules! names {
    ($ty:ident, $what:literal, [$($variant:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            /// Every name of this enum, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// The name used in config files, command lines, logs and metrics.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;

            /// Reads a name, also in kebab case (`fail-open`, the
            /// command-line convention) for every `_` of it.
            fn from_str(text: &str) -> Result<Self, Self::Err> {
                let snake;
                let name = if text.contains('-') {
                    snake = text.replace('-', "_");
                    snake.as_str()
                } else {
                    text
                };
                match name {
                    $($name => Ok(Self::$variant),)+
                    _ => Err(UnknownName {
                        what: $what,
                        given: text.to_owned(),
                        expected: Self::NAMES,
                    }),
                }
            }
        }
    };
}

names!(GuardRole, "guard role", [Validate => "validate", Mutate => "mutate"]);
names!(FailurePolicy, "failure policy", [
    FailClosed => "fail_closed",
    FailOpen => "fail_open",
    Abort => "abort",
]);
names!(GuardMode, "guard mode", [Enforce => "enforce", DryRun => "dry_run"]);
names!(GuardPhases, "guard phases", [
    Calls => "calls",
    Results => "results",
    Both => "both",
]);
names!(SessionMemoryUse, "session memory use", [
    Unspecified => "unspecified",
    None => "none",
    Read => "read",
]);
names!(ResultAction, "result action", [
    Unspecified => "unspecified",
    Pass => "pass",
    Rewrite => "rewrite",
    Block => "block",
]);
names!(SkipKind, "skip kind", [Steer => "steer", Cancel => "cancel"]);
names!(Action, "action", [
    Unspecified => "unspecified",
    Proceed => "proceed",
    Steer => "steer",
    Cancel => "cancel",
    Ask => "ask",
]);
names!(TraceStatus, "trace status", [
    Unspecified => "unspecified",
    Proceeded => "proceeded",
    Skipped => "skipped",
    Rewrote => "rewrote",
    NotApplicable => "not_applicable",
    Superseded => "superseded",
    Failed => "failed",
    TimedOut => "timed_out",
    Malformed => "malformed",
    RejectedRewrite => "rejected_rewrite",
    DryRun => "dry_run",
    Asked => "asked",
]);
names!(AskFallback, "ask fallback", [Cancel => "cancel", Steer => "steer"]);
names!(ApprovalState, "approval state", [
    Unspecified => "unspecified",
    Pending => "pending",
    Approved => "approved",
    Denied => "denied",
    Used => "used",
    Expired => "expired",
]);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name parses back to its variant, and each is the lower-case
    /// tail of the protobuf name, so the two spellings cannot drift apart.
    #[test]
    fn names_round_trip_and_follow_the_proto() {
        fn check<T>(all: &[T], proto: impl Fn(&T) -> &'static str, prefix: &str)
        where
            T: Copy + fmt::Display + FromStr<Err = UnknownName> + PartialEq + fmt::Debug,
        {
            for &value in all {
                let name = value.to_string();
                assert_eq!(name.parse::<T>(), Ok(value));
                // Kebab case too, as command lines spell it.
                assert_eq!(name.replace('_', "-").parse::<T>(), Ok(value));
                let tail = proto(&value).strip_prefix(prefix).unwrap();
                assert_eq!(name, tail.to_ascii_lowercase());
            }
        }
        check(
            &[GuardRole::Validate, GuardRole::Mutate],
            |v| v.as_str_name(),
            "GUARD_ROLE_",
        );
        check(
            &[
                FailurePolicy::FailClosed,
                FailurePolicy::FailOpen,
                FailurePolicy::Abort,
            ],
            |v| v.as_str_name(),
            "FAILURE_POLICY_",
        );
        check(
            &[GuardMode::Enforce, GuardMode::DryRun],
            |v| v.as_str_name(),
            "GUARD_MODE_",
        );
        check(
            &[SkipKind::Steer, SkipKind::Cancel],
            |v| v.as_str_name(),
            "SKIP_KIND_",
        );
        let statuses: Vec<TraceStatus> = (0..=11)
            .filter_map(|n| TraceStatus::try_from(n).ok())
            .collect();
        assert_eq!(statuses.len(), TraceStatus::NAMES.len());
        check(&statuses, |v| v.as_str_name(), "TRACE_STATUS_");
        let actions: Vec<Action> = (0..=4).filter_map(|n| Action::try_from(n).ok()).collect();
        assert_eq!(actions.len(), Action::NAMES.len());
        check(&actions, |v| v.as_str_name(), "ACTION_");
        let states: Vec<ApprovalState> = (0..=5)
            .filter_map(|n| ApprovalState::try_from(n).ok())
            .collect();
        assert_eq!(states.len(), ApprovalState::NAMES.len());
        check(&states, |v| v.as_str_name(), "APPROVAL_STATE_");
        check(
            &[AskFallback::Cancel, AskFallback::Steer],
            |v| v.as_str_name(),
            "ASK_FALLBACK_",
        );
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let error = "fail-shut".parse::<FailurePolicy>().unwrap_err();
        assert_eq!(
            error.to_string(),
            "unknown failure policy \"fail-shut\" (expected one of: fail_closed, fail_open, abort)"
        );
    }
}
