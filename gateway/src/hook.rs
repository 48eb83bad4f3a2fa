//! `guardmesh hook pre-tool-use`: an agent host's `PreToolUse` hook.
//!
//! Reads the hook's JSON on stdin (`tool_name`, `tool_input`, `tool_use_id`,
//! `session_id`; other fields are ignored), judges the call as a batch of one
//! (call id `tool_use_id`, session `session_id`), and answers on stdout:
//!
//! | decision | stdout | exit |
//! |---|---|---|
//! | proceed, unchanged | nothing (the host's own permission flow applies) | 0 |
//! | proceed, arguments rewritten | `permissionDecision: "allow"` with `updatedInput` | 0 |
//! | proceed, tool renamed | `deny` (a hook cannot rename a call) | 0 |
//! | steer or cancel | `deny`, the content as `permissionDecisionReason` | 0 |
//! | refused or aborted by the mesh | `deny` saying so | 0 |
//! | mesh unreachable | `deny` saying so; with `--fail-open`, nothing | 0 |
//! | stdin unreadable | nothing; the reason on stderr (the host blocks the call) | 2 |

use crate::judge::{Judge, JudgeError, MeshArgs};
use guardmesh_client::Outcome;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `guardmesh hook pre-tool-use`.
#[derive(clap::Args, Debug, Clone)]
pub struct PreToolUseArgs {
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Let the call through when the mesh cannot be reached (default: deny).
    #[arg(long)]
    pub fail_open: bool,
    /// Largest input accepted on stdin, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_input_bytes: usize,
}

/// The fields of a `PreToolUse` input the hook reads. Anything else is
/// ignored, so that new fields of the host never break the hook.
#[derive(Deserialize)]
struct Input {
    tool_name: String,
    tool_input: Value,
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
}

/// What the hook prints and exits with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookAnswer {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

fn decision(permission: &str, reason: &str, updated: Option<Value>) -> HookAnswer {
    let mut output = json!({
        "hookEventName": "PreToolUse",
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

fn unreadable(why: String) -> HookAnswer {
    HookAnswer {
        exit_code: 2,
        stdout: String::new(),
        stderr: format!("guardmesh: cannot read the PreToolUse input, blocking the call: {why}\n"),
    }
}

/// Judges one hook input.
pub async fn answer(args: &PreToolUseArgs, input: &[u8]) -> HookAnswer {
    let input: Input = match serde_json::from_slice(input) {
        Ok(input) => input,
        Err(e) => return unreadable(e.to_string()),
    };
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
    let judge = Judge::new(args.mesh.clone(), "hook-pre-tool-use");
    let arguments = input.tool_input.to_string();
    let calls = vec![(call_id.clone(), input.tool_name.clone(), arguments.clone())];
    let decision_ = match judge.evaluate(&session, calls, None).await {
        Ok(d) => d,
        Err(error @ JudgeError::Unreachable { .. }) if args.fail_open => {
            return HookAnswer {
                exit_code: 0,
                stdout: String::new(),
                stderr: format!("guardmesh: {error}; --fail-open lets the call through\n"),
            };
        }
        Err(error) => return decision("deny", &format!("guardmesh: {error}"), None),
    };
    let Some(call) = decision_.call(&call_id) else {
        return decision("deny", "guardmesh: the mesh returned no decision", None);
    };
    match &call.outcome {
        Outcome::Steer { content } | Outcome::Cancel { content } => decision("deny", content, None),
        Outcome::Proceed if call.final_call.tool != input.tool_name => decision(
            "deny",
            &format!(
                "guardmesh: a guard renamed the call to {:?}, which a hook cannot do",
                call.final_call.tool
            ),
            None,
        ),
        Outcome::Proceed if call.final_call.arguments != arguments => {
            match serde_json::from_str::<Value>(&call.final_call.arguments) {
                Ok(updated) if updated.is_object() => decision(
                    "allow",
                    &format!("guardmesh: rewritten by {}", call.rewritten_by.join(", ")),
                    Some(updated),
                ),
                _ => decision(
                    "deny",
                    "guardmesh: the rewritten arguments are not a JSON object",
                    None,
                ),
            }
        }
        Outcome::Proceed => HookAnswer {
            exit_code: 0,
            stdout: String::new(),
            stderr: String::new(),
        },
    }
}

/// Runs the hook on stdin/stdout; returns the exit code.
pub async fn pre_tool_use(args: PreToolUseArgs) -> i32 {
    let mut input = Vec::new();
    let limit = u64::try_from(args.max_input_bytes).unwrap_or(u64::MAX);
    let answer = match tokio::io::stdin()
        .take(limit.saturating_add(1))
        .read_to_end(&mut input)
        .await
    {
        Ok(n) if n > args.max_input_bytes => {
            unreadable(format!("input longer than {} bytes", args.max_input_bytes))
        }
        Ok(_) => answer(&args, &input).await,
        Err(e) => unreadable(e.to_string()),
    };
    let mut stdout = tokio::io::stdout();
    let _ = stdout.write_all(answer.stdout.as_bytes()).await;
    let _ = stdout.flush().await;
    eprint!("{}", answer.stderr);
    answer.exit_code
}
