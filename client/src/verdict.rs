//! Constructors for a guard's verdicts.
//!
//! A guard returns verdicts only for the calls it objects to or rewrites;
//! every call without a verdict proceeds.

use crate::proto::{Ask, Rewrite, Skip, SkipKind, Verdict, verdict::Outcome};

/// Skips the call as *steer*: the model reads `content` as an error result
/// and is expected to fix the call and retry.
pub fn steer(call_id: impl Into<String>, content: impl Into<String>) -> Verdict {
    skip(call_id, content, SkipKind::Steer)
}

/// Skips the call as *cancel*: the model reads `content` as a benign result
/// ("not allowed") and is expected to move on.
pub fn cancel(call_id: impl Into<String>, content: impl Into<String>) -> Verdict {
    skip(call_id, content, SkipKind::Cancel)
}

/// Asks a person first (R35): the call does not run now; the mesh makes an
/// approval request carrying `reason` for the approver, and the call runs
/// only when the same call comes back with that request approved. The
/// model reads the mesh's own text meanwhile (see [`ask_with_content`]).
pub fn ask(call_id: impl Into<String>, reason: impl Into<String>) -> Verdict {
    ask_with_content(call_id, reason, "")
}

/// [`ask`], with `content` as what the model reads while the call waits.
pub fn ask_with_content(
    call_id: impl Into<String>,
    reason: impl Into<String>,
    content: impl Into<String>,
) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(Outcome::Ask(Ask {
            reason: reason.into(),
            content: content.into(),
        })),
    }
}

fn skip(call_id: impl Into<String>, content: impl Into<String>, kind: SkipKind) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(Outcome::Skip(Skip {
            content: content.into(),
            kind: kind as i32,
        })),
    }
}

/// Replaces the call's arguments (mutate guards, within their grant).
pub fn rewrite_arguments(call_id: impl Into<String>, arguments: &serde_json::Value) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(Outcome::Rewrite(Rewrite {
            tool: None,
            arguments: Some(arguments.to_string()),
        })),
    }
}

/// Replaces a result (R33; mutate guards judging results, within their
/// result grant): `result` is the whole new MCP `CallToolResult`, carried
/// in `Rewrite.arguments`.
pub fn rewrite_result(call_id: impl Into<String>, result: &serde_json::Value) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(Outcome::Rewrite(Rewrite {
            tool: None,
            arguments: Some(result.to_string()),
        })),
    }
}

/// Blocks a result (R33): the model reads `content` as an error result
/// instead of the tool's result.
pub fn block_result(call_id: impl Into<String>, content: impl Into<String>) -> Verdict {
    skip(call_id, content, SkipKind::Steer)
}

/// Renames the call's tool, optionally with new arguments (mutate guards
/// whose grant allows renaming).
pub fn rename(
    call_id: impl Into<String>,
    tool: impl Into<String>,
    arguments: Option<&serde_json::Value>,
) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: Some(Outcome::Rewrite(Rewrite {
            tool: Some(tool.into()),
            arguments: arguments.map(|a| a.to_string()),
        })),
    }
}

/// An explicit proceed. Never needed (no verdict means proceed), but useful
/// for guards that answer every call.
pub fn proceed(call_id: impl Into<String>) -> Verdict {
    Verdict {
        labels: Vec::new(),
        call_id: call_id.into(),
        outcome: None,
    }
}

/// `verdict` adding `labels` to the batch's session (R34), e.g.
/// `secret:fs`: each 1 to 128 bytes of ASCII letters, digits and
/// `_ - . : /`, at most 8 per verdict (others are refused and counted).
/// With a proceed, a skip or a rewrite alike; a plain label is
/// `labelled(proceed(id), ["secret:fs"])`.
pub fn labelled<I, S>(mut verdict: Verdict, labels: I) -> Verdict
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    verdict.labels.extend(labels.into_iter().map(Into::into));
    verdict
}
