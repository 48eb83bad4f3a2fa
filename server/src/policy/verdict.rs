//! What judging one call with a policy gives.

use serde::{Deserialize, Serialize};

use super::error::EvalError;

/// What a matching rule does to the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Skip the call with an error result: the model should fix it (R7).
    Steer,
    /// Skip the call with a result that is not an error: do not retry (R7).
    Cancel,
    /// Ask a person first (R35): the call waits for an approval; the
    /// rule's message is the reason the approver reads.
    Ask,
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Action::Steer => "steer",
            Action::Cancel => "cancel",
            Action::Ask => "ask",
        })
    }
}

/// The rule that decided a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The rule's name.
    pub rule: String,
    /// Its action.
    pub action: Action,
    /// Its message, evaluated for this call: the skipped call's content.
    pub message: String,
    /// R34: the labels the rule adds to the session when it decides.
    pub labels: std::sync::Arc<[String]>,
}

/// The policy's judgement of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// No rule matched: the policy defers (proceed).
    Proceed,
    /// The first rule that matched, in file order.
    Matched(Verdict),
    /// The call could not be judged: a failure of the guard (R13), never a
    /// proceed (R27).
    Error(EvalError),
    /// A rule failed on the call (a failure of the guard, R13), and a later
    /// rule matched it: that rule's verdict stands whatever the failure
    /// policy, so an error never lets a later rule be skipped.
    FailedThen(EvalError, Verdict),
    /// The call's own content put its evaluation over a bound (its cost
    /// estimate or its work budget): skipped as steer naming the bound
    /// (R13), whatever the failure policy.
    Bounded(Verdict),
    /// The guard's time was up before the call was judged (R14): a
    /// failure of the guard (`timed_out`, R13).
    TimedOut,
}
