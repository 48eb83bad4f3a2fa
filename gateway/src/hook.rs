//! `guardmesh hook pre-tool-use`: an agent host's `PreToolUse` hook.
//!
//! Reads the hook's JSON on stdin (`hook_event_name`, `tool_name`,
//! `tool_input`, `tool_use_id`, `session_id`; other fields are ignored),
//! judges the call as a batch of one (call id `tool_use_id`, session
//! `session_id`), and answers on stdout in the host's format (`--format`):
//!
//! | decision | stdout (`claude`) | stdout (`codex`) | exit |
//! |---|---|---|---|
//! | proceed, unchanged | nothing (the host's own permission flow applies) | nothing | 0 |
//! | proceed, arguments rewritten | `permissionDecision: "ask"` with `updatedInput` | `"allow"` with `updatedInput` | 0 |
//! | proceed, tool renamed | `deny` (a hook cannot rename a call) | `deny` | 0 |
//! | steer or cancel | `deny`, the content as `permissionDecisionReason` | `deny` | 0 |
//! | refused or aborted by the mesh | `deny` saying so | `deny` | 0 |
//! | mesh unreachable, or no answer by `--deadline-ms` | `deny` saying so; with `--fail-open`, nothing | the same | 0 |
//! | stdin unreadable or not read by the deadline, or an event other than `PreToolUse` | nothing; the reason on stderr (the host blocks the call) | the same | 2 |
//!
//! R31b. Every answer is given within one overall deadline (`--deadline-ms`,
//! default [`DEFAULT_DEADLINE_MS`]), counted from the start: reading stdin,
//! connecting and the mesh's answer all fall within it, and the batch is
//! sent with a gRPC timeout a little shorter, so that the mesh applies its
//! guards' failure policies (R13, R14) before the hook gives up on it. A
//! mesh that accepts connections and never answers (a stopped process, a
//! wedged proxy) is therefore denied in time: the hosts let the call run
//! when a hook exceeds their own timeout, so the hook must never be the one
//! that is late.
//!
//! What the hosts read, as their documentation and source state it (checked
//! December 2026):
//!
//! * Claude Code (`--format claude`, the default): the hook's JSON on
//!   stdout with exit 0 carries `hookSpecificOutput.permissionDecision`
//!   (`allow`, `deny` or `ask`) and an optional `updatedInput` that replaces
//!   the tool's input. `allow` skips the permission prompt the user would
//!   otherwise see, `ask` shows it (with the replaced input), `deny` blocks
//!   the call and gives the reason to the model. No output leaves the
//!   host's own permission rules in charge. Exit 2 blocks the call and
//!   feeds stderr to the model; any other failure, and a hook that runs
//!   past its timeout (60 seconds unless configured), is a non-blocking
//!   error: the call proceeds. Hence a rewrite is answered `ask`: the
//!   rewritten call still meets the user's prompt wherever the original
//!   would have, and an approval the host did not ask for is never given.
//! * OpenAI Codex CLI (`--format codex`): a PreToolUse answer may be `deny`
//!   with a non-empty `permissionDecisionReason` (blocks, the reason goes
//!   to the model), or `allow` only together with `updatedInput` (the
//!   rewrite is applied; the hook's outcome carries no approval, so Codex's
//!   own approval policy still judges the rewritten call), or nothing. It
//!   reports `ask`, a bare `allow`, `updatedInput` without `allow` and a
//!   `deny` without a reason as a failed hook and runs the original call,
//!   so the hook never prints them. Exit 2 with a reason on stderr blocks;
//!   other exit codes and timeouts (600 seconds unless configured) fail
//!   open. Codex releases from before `updatedInput` was accepted on
//!   PreToolUse (mid-2026) read the rewrite answer as a failed hook too.

use crate::judge::{Judge, JudgeArgs, JudgeError};
use guardmesh_client::Outcome;
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

/// The default overall deadline, in milliseconds: well under the hosts'
/// own hook timeouts (60 s in Claude Code, 600 s in Codex).
pub const DEFAULT_DEADLINE_MS: u64 = 10_000;

/// Longest deadline accepted: shorter than the shortest host timeout.
pub const MAX_DEADLINE_MS: u64 = 55_000;

/// The event this hook judges; every other one is refused.
const PRE_TOOL_USE: &str = "PreToolUse";

/// Which host reads the answer.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Claude Code: a rewrite is `ask` with `updatedInput`.
    #[default]
    Claude,
    /// OpenAI Codex CLI: a rewrite is `allow` with `updatedInput` (its only
    /// rewrite form); never `ask`.
    Codex,
}

/// `guardmesh hook pre-tool-use`.
#[derive(clap::Args, Debug, Clone)]
pub struct PreToolUseArgs {
    #[command(flatten)]
    pub mesh: JudgeArgs,
    /// Let the call through when the mesh cannot be reached or does not
    /// answer by the deadline (default: deny).
    #[arg(long)]
    pub fail_open: bool,
    /// Largest input accepted on stdin, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_input_bytes: usize,
    /// The host whose hook format to speak.
    #[arg(long, value_enum, default_value_t = Format::Claude)]
    pub format: Format,
    /// Overall deadline in milliseconds, from start to answer (reading
    /// stdin, connecting, the mesh's answer); past it the call is denied.
    #[arg(long, default_value_t = DEFAULT_DEADLINE_MS,
          value_parser = clap::value_parser!(u64).range(1..=MAX_DEADLINE_MS))]
    pub deadline_ms: u64,
}

/// The fields of a `PreToolUse` input the hook reads. Anything else is
/// ignored, so that new fields of the host never break the hook.
#[derive(Deserialize)]
struct Input {
    #[serde(default)]
    hook_event_name: Option<String>,
    tool_name: String,
    tool_input: Value,
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
}

/// Only the event name, read first, so that another event's input is
/// refused as such whatever its other fields.
#[derive(Deserialize)]
struct Event {
    #[serde(default)]
    hook_event_name: Option<Value>,
}

/// What the hook prints and exits with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookAnswer {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl HookAnswer {
    fn nothing(stderr: String) -> Self {
        Self {
            exit_code: 0,
            stdout: String::new(),
            stderr,
        }
    }
}

/// A `hookSpecificOutput` answer. The reason is never blank: Codex reads a
/// `deny` without one as a failed hook, and runs the call.
fn decision(permission: &str, reason: &str, updated: Option<Value>) -> HookAnswer {
    let reason = if reason.trim().is_empty() {
        "guardmesh: blocked by the mesh"
    } else {
        reason
    };
    let mut output = json!({
        "hookEventName": PRE_TOOL_USE,
        "permissionDecision": permission,
        "permissionDecisionReason": reason,
    });
    if let (Some(updated), Some(map)) = (updated, output.as_object_mut()) {
        map.insert("updatedInput".into(), updated);
    }
    HookAnswer {
        exit_code: 0,
        stdout: json!({ "hookSpecificOutput": output }).to_string(),
        stderr: String::new(),
    }
}

fn deny(reason: &str) -> HookAnswer {
    decision("deny", reason, None)
}

/// Exit 2, which both hosts read as "block the call", the reason on stderr.
fn blocked(why: &str) -> HookAnswer {
    HookAnswer {
        exit_code: 2,
        stdout: String::new(),
        stderr: format!("guardmesh: {why}; blocking the call\n"),
    }
}

fn unreadable(why: String) -> HookAnswer {
    blocked(&format!("cannot read the PreToolUse input: {why}"))
}

/// `text` cut to `max` characters, marked when cut.
fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

/// The event of `input`, refused unless it is `PreToolUse` exactly.
fn check_event(input: &[u8]) -> Result<(), HookAnswer> {
    let event: Event = serde_json::from_slice(input).map_err(|e| unreadable(e.to_string()))?;
    match event.hook_event_name {
        Some(Value::String(name)) if name == PRE_TOOL_USE => Ok(()),
        Some(Value::String(name)) => Err(blocked(&format!(
            "hook_event_name {:?} is not {PRE_TOOL_USE}, the only event this hook judges",
            clip(&name, 64)
        ))),
        Some(other) => Err(blocked(&format!(
            "hook_event_name is not a string ({}); this hook judges {PRE_TOOL_USE} only",
            clip(&other.to_string(), 64)
        ))),
        None => Err(unreadable(format!(
            "it has no hook_event_name; this hook judges {PRE_TOOL_USE} only"
        ))),
    }
}

/// What the hook answers when the mesh gave no decision: a deny, or with
/// `--fail-open` nothing and a warning.
fn undecided(args: &PreToolUseArgs, why: String) -> HookAnswer {
    if args.fail_open {
        HookAnswer::nothing(format!(
            "guardmesh: {why}; --fail-open lets the call through\n"
        ))
    } else {
        deny(&format!("guardmesh: {why}; the call was not run"))
    }
}

fn late(args: &PreToolUseArgs) -> String {
    format!(
        "the mesh at {} did not answer within {} ms (--deadline-ms)",
        args.mesh.connect.mesh, args.deadline_ms
    )
}

/// Judges one hook input, answering by `deadline`.
pub async fn answer(args: &PreToolUseArgs, input: &[u8], deadline: Instant) -> HookAnswer {
    if let Err(refused) = check_event(input) {
        return refused;
    }
    let input: Input = match serde_json::from_slice(input) {
        Ok(input) => input,
        Err(e) => return unreadable(e.to_string()),
    };
    debug_assert_eq!(input.hook_event_name.as_deref(), Some(PRE_TOOL_USE));
    if !input.tool_input.is_object() {
        return unreadable("tool_input is not a JSON object".into());
    }
    if input.tool_name.is_empty() {
        return unreadable("tool_name is empty".into());
    }
    let call_id = input
        .tool_use_id
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| "pre-tool-use".into());
    let session = input
        .session_id
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| "hook".into());
    // The mesh's own deadline for the batch ends before ours, so that a
    // slow guard is failed by the mesh (R13, R14) and answered, rather
    // than the whole batch given up on here.
    let mut mesh = args.mesh.clone();
    let left = deadline.saturating_duration_since(Instant::now());
    let margin = (left / 5).min(Duration::from_secs(1));
    let budget = u64::try_from(left.saturating_sub(margin).as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    mesh.timeout_ms = match mesh.timeout_ms {
        0 => budget,
        asked => asked.min(budget),
    };
    let judge = Judge::new(mesh, "hook-pre-tool-use");
    let arguments = input.tool_input.to_string();
    let calls = vec![(call_id.clone(), input.tool_name.clone(), arguments.clone())];
    let judged = tokio::time::timeout_at(deadline, judge.evaluate(&session, calls, None)).await;
    let decision_ = match judged {
        Ok(Ok(d)) => d,
        Ok(Err(error @ JudgeError::Unreachable { .. })) => {
            return undecided(args, error.to_string());
        }
        // The batch's gRPC timeout (set above) ran out: the mesh did not
        // answer in time, which is no judgement of the call.
        Ok(Err(JudgeError::Refused {
            code: tonic::Code::Cancelled | tonic::Code::DeadlineExceeded,
            ..
        })) => {
            return undecided(args, late(args));
        }
        Ok(Err(error)) => return deny(&format!("guardmesh: {error}")),
        Err(_) => return undecided(args, late(args)),
    };
    let Some(call) = decision_.call(&call_id) else {
        return deny("guardmesh: the mesh returned no decision");
    };
    match &call.outcome {
        Outcome::Steer { content } | Outcome::Cancel { content } => deny(content),
        // R35: the host's own prompt asks the person (Claude Code's
        // `permissionDecision: "ask"`); a host without one is denied, with
        // the request to approve named.
        Outcome::Ask { approval, .. } => {
            let reason = format!(
                "guardmesh: the guard {} asks a person to approve this call: {} (approval request {})",
                approval.guard, approval.reason, approval.id
            );
            match args.format {
                Format::Claude => decision("ask", &reason, None),
                Format::Codex => deny(&reason),
            }
        }
        Outcome::Proceed if call.final_call.tool != input.tool_name => deny(&format!(
            "guardmesh: a guard renamed the call to {:?}, which a hook cannot do",
            call.final_call.tool
        )),
        Outcome::Proceed if call.final_call.arguments != arguments => {
            match serde_json::from_str::<Value>(&call.final_call.arguments) {
                Ok(updated) if updated.is_object() => {
                    let reason =
                        format!("guardmesh: rewritten by {}", call.rewritten_by.join(", "));
                    // R31b: the host's own permission flow still applies.
                    let permission = match args.format {
                        Format::Claude => "ask",
                        Format::Codex => "allow",
                    };
                    decision(permission, &reason, Some(updated))
                }
                _ => deny("guardmesh: the rewritten arguments are not a JSON object"),
            }
        }
        Outcome::Proceed => HookAnswer::nothing(String::new()),
    }
}

/// Reads stdin whole, within `limit` bytes.
async fn read_input(limit: usize) -> Result<Vec<u8>, String> {
    let mut input = Vec::new();
    let most = u64::try_from(limit).unwrap_or(u64::MAX);
    match tokio::io::stdin()
        .take(most.saturating_add(1))
        .read_to_end(&mut input)
        .await
    {
        Ok(n) if n > limit => Err(format!("input longer than {limit} bytes")),
        Ok(_) => Ok(input),
        Err(e) => Err(e.to_string()),
    }
}

/// Runs the hook on stdin/stdout; returns the exit code.
pub async fn pre_tool_use(args: PreToolUseArgs) -> i32 {
    let deadline = Instant::now() + Duration::from_millis(args.deadline_ms);
    let answer = match tokio::time::timeout_at(deadline, read_input(args.max_input_bytes)).await {
        Ok(Ok(input)) => answer(&args, &input, deadline).await,
        Ok(Err(why)) => unreadable(why),
        Err(_) => unreadable(format!(
            "stdin was not closed within {} ms (--deadline-ms)",
            args.deadline_ms
        )),
    };
    let mut stdout = tokio::io::stdout();
    let _ = stdout.write_all(answer.stdout.as_bytes()).await;
    let _ = stdout.flush().await;
    eprint!("{}", answer.stderr);
    answer.exit_code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r31b_events_other_than_pre_tool_use_are_blocked() {
        assert!(check_event(br#"{"hook_event_name":"PreToolUse"}"#).is_ok());
        for input in [
            r#"{"hook_event_name":"PostToolUse"}"#,
            r#"{"hook_event_name":"preToolUse"}"#,
            r#"{"hook_event_name":null}"#,
            r#"{"hook_event_name":["PreToolUse"]}"#,
            r#"{}"#,
            "[]",
        ] {
            let refused = check_event(input.as_bytes()).unwrap_err();
            assert_eq!(refused.exit_code, 2, "{input}");
            assert!(refused.stdout.is_empty());
            assert!(refused.stderr.contains("blocking the call"), "{input}");
        }
    }

    #[test]
    fn r31b_a_deny_always_has_a_reason() {
        let answer = deny("  ");
        let out: Value = serde_json::from_str(&answer.stdout).unwrap();
        let reason = out["hookSpecificOutput"]["permissionDecisionReason"]
            .as_str()
            .unwrap();
        assert!(!reason.trim().is_empty());
    }
}
