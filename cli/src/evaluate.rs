//! `guardmesh evaluate` for scripts: the input (one batch, or several as
//! JSON Lines, from a file or stdin), the `--json` output, and the exit
//! codes. The command itself (connecting with `MeshArgs`) is in `app`.
//!
//! Exit codes (also in `guardmesh evaluate --help` and docs/quick_start.md):
//!
//! | code | meaning |
//! |---|---|
//! | 0 | every call of every batch may proceed (a zero-call batch too, R1) |
//! | 1 | nothing was judged: the input cannot be read or is not a batch, the mesh cannot be reached, or a credential file cannot be read |
//! | 2 | usage error (the command line itself) |
//! | 3 | the mesh answered every batch, and at least one call was steered or cancelled, or a result blocked |
//! | 4 | the mesh refused (R20) or aborted (R13) a batch, or refused the caller (R24): none of that batch's calls may run |
//!
//! When several apply, the highest-numbered among 3 and 4 wins; 1 stops at
//! once.

use guardmesh_client::proto::{Action, GuardRole, ToolCall, TraceStatus};
use guardmesh_client::{BatchDecision, ClientError, Outcome, ResultOutcome};
use serde_json::{Value, json};

/// Every call proceeds.
pub(crate) const EXIT_PROCEED: u8 = 0;
/// Nothing was judged (input, network, credentials).
pub(crate) const EXIT_ERROR: u8 = 1;
/// Some call was steered or cancelled.
pub(crate) const EXIT_SKIPPED: u8 = 3;
/// The mesh refused or aborted a batch.
pub(crate) const EXIT_REFUSED: u8 = 4;

/// The exit codes, for `--help`.
pub(crate) const EXIT_CODES_HELP: &str = "Exit codes: 0 every call proceeds; 1 nothing was \
judged (unreadable input, mesh unreachable); 2 usage error; 3 at least one call was steered or \
cancelled, or a result blocked; 4 the mesh refused or aborted a batch (none of its calls may run).";

// The input's format (one batch, or several as JSON Lines) is read as the
// conformance kit reads its `--batch` files.
pub(crate) use guardmesh_conformance::batch_file::parse_batches;

/// How one batch went.
pub(crate) enum Judged {
    /// The mesh's decision.
    Decided(Box<BatchDecision>),
    /// The mesh answered with an error status: refused or aborted.
    Refused(tonic::Status),
}

/// Whether a client error is the mesh's answer (a refusal) rather than a
/// failure to reach it. The SDK reports a broken transport as `UNAVAILABLE`
/// with the transport error as its source; a status the mesh sent has none.
pub(crate) fn refusal(error: ClientError) -> Result<tonic::Status, ClientError> {
    match error {
        ClientError::Status(status)
            if std::error::Error::source(&status).is_none()
                || status.code() != tonic::Code::Unavailable =>
        {
            Ok(status)
        }
        other => Err(other),
    }
}

/// The exit code of a run whose batches were all answered.
pub(crate) fn exit_code(judged: &[Judged]) -> u8 {
    let mut code = EXIT_PROCEED;
    for j in judged {
        let this = match j {
            Judged::Refused(_) => EXIT_REFUSED,
            Judged::Decided(d)
                if d.calls.iter().all(|c| c.proceeds())
                    && d.results.iter().all(|r| !r.blocked()) =>
            {
                EXIT_PROCEED
            }
            Judged::Decided(_) => EXIT_SKIPPED,
        };
        code = code.max(this);
    }
    code
}

/// A call's arguments as JSON: the object when they parse, else the text.
fn arguments(text: &str) -> Value {
    if text.is_empty() {
        return json!({});
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

fn call_json(call: &ToolCall) -> Value {
    json!({
        "call_id": call.call_id,
        "tool": call.tool,
        "arguments": arguments(&call.arguments),
    })
}

fn status_name(status: i32) -> String {
    TraceStatus::try_from(status).map_or_else(|_| format!("unknown({status})"), |s| s.name().into())
}

/// One batch's decision as one JSON object (`--json`): the proto's
/// `BatchDecision` with its field names, enums by their contract names
/// (`proceed`, `skipped`, ...), and arguments as JSON objects.
pub(crate) fn decision_json(session: &str, decision: &BatchDecision) -> Value {
    let decisions: Vec<Value> = decision
        .calls
        .iter()
        .map(|c| {
            let (action, content) = match &c.outcome {
                Outcome::Proceed => (Action::Proceed, None),
                Outcome::Steer { content } => (Action::Steer, Some(content.as_str())),
                Outcome::Cancel { content } => (Action::Cancel, Some(content.as_str())),
                Outcome::Ask { content, .. } => (Action::Ask, Some(content.as_str())),
            };
            let mut d = json!({
                "call_id": c.call_id,
                "action": action.name(),
                "content": content,
                "decided_by": c.decided_by,
                "rule": c.rule,
                "failure": c.failure,
                "bypassed": c.bypassed,
                "rewritten_by": c.rewritten_by,
                "original": call_json(&c.original),
            });
            if c.proceeds() {
                d["call"] = call_json(&c.final_call);
            }
            if let Some(approval) = c.ask() {
                d["approval"] = json!({
                    "id": approval.id,
                    "guard": approval.guard,
                    "reason": approval.reason,
                    "digest": approval.digest,
                    "expires_at_ms": approval.expires_at_ms,
                });
            }
            if let Some(why) = &c.approval_refused {
                d["approval_refused"] = json!(why);
            }
            d
        })
        .collect();
    let trace: Vec<Value> = decision
        .trace
        .iter()
        .map(|t| {
            let mut entry = json!({
                "guard": t.guard,
                "role": GuardRole::try_from(t.role).map_or("unknown", GuardRole::name),
                "status": status_name(t.status),
                "latency_us": t.latency_us,
                "sent_call_ids": t.sent_call_ids,
                "skipped_call_ids": t.skipped_call_ids,
                "rewritten_call_ids": t.rewritten_call_ids,
                "error": t.error,
            });
            if t.dry_run_status != 0 {
                entry["dry_run_status"] = status_name(t.dry_run_status).into();
            }
            if !t.rules.is_empty() {
                entry["rules"] = json!(t.rules);
            }
            entry
        })
        .collect();
    let mut out = json!({
        "batch_id": decision.batch_id,
        "session_id": session,
        "chain_revision": decision.chain_revision,
        "trace_id": decision.trace_id,
        "decisions": decisions,
        "trace": trace,
    });
    if !decision.results.is_empty() {
        out["results"] = decision
            .results
            .iter()
            .map(|r| {
                let (outcome, content) = match &r.outcome {
                    ResultOutcome::Pass => ("pass", None),
                    ResultOutcome::Rewrite => ("rewrite", None),
                    ResultOutcome::Block { content } => ("block", Some(content.as_str())),
                };
                json!({
                    "call_id": r.call_id,
                    "outcome": outcome,
                    "content": content,
                    "decided_by": r.decided_by,
                    "failure": r.failure,
                    "bypassed": r.bypassed,
                    "rewritten_by": r.rewritten_by,
                    "result": arguments(&r.result),
                })
            })
            .collect();
    }
    out
}

/// A refused batch as one JSON object (`--json`), in place of its decision.
pub(crate) fn refusal_json(session: &str, status: &tonic::Status) -> Value {
    json!({
        "session_id": session,
        "error": {
            "code": format!("{:?}", status.code()),
            "message": status.message(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_object_or_json_lines() {
        let one = r#"{
            "calls": [{"call_id": "c", "tool": "t", "arguments": {"a": 1, "a": 2}}]
        }"#;
        let batches = parse_batches(one, "f").unwrap();
        assert_eq!(batches.len(), 1);
        // The arguments are passed as written, duplicates included (the
        // mesh refuses them, R20).
        let call = batches.into_iter().next().unwrap().calls.remove(0);
        assert_eq!(call.into_call().arguments, r#"{"a": 1, "a": 2}"#);

        let lines = "{\"calls\": []}\n{\"session_id\": \"s\", \"calls\": []}\n";
        let batches = parse_batches(lines, "f").unwrap();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[1].session_id, "s");

        let bad = "{\"calls\": []}\n\n{\"calls\": \"nope\"}\n";
        let error = parse_batches(bad, "in").err().unwrap();
        assert!(
            error.contains("in is not a batch (batch 2, line 3)"),
            "{error}"
        );
        assert!(parse_batches("  \n", "in").is_err());
        assert!(parse_batches("{\"calls\": []} nope", "in").is_err());
    }
}
