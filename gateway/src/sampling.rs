//! A tool call a model asks for through sampling (R31): the client's answer
//! to an upstream's `sampling/createMessage` may hold `tool_use` content
//! blocks, which the upstream runs as tool calls. Each is judged by the
//! mesh as a call of the session (the block's `name` as the tool, its
//! `input` as the arguments), all of one answer in one batch, before the
//! upstream receives the answer:
//!
//! | decision | what the upstream receives in the block's place |
//! |---|---|
//! | proceed | the `tool_use` block, with the final tool name and arguments (rewrites applied) |
//! | steer, cancel | a `text` block: `guardmesh: the tool call NAME was not run (steer\|cancel): CONTENT` |
//! | ask (R35) | a `text` block naming the approval request |
//! | no decision, batch refused or aborted, mesh unreachable, a block the gateway cannot judge (no string `name`, `input` not an object) | a `text` block saying why the call was not run |
//!
//! Judging never fails open: a `tool_use` block the mesh did not let
//! proceed is never forwarded. When no `tool_use` block is left, a
//! `stopReason` of `toolUse` becomes `endTurn`, so the upstream's sampling
//! loop reads a finished turn. Member names inside the result are matched
//! as Go's `encoding/json` matches them (case-insensitively), so an
//! upstream that reads `"Type"` as `type` is judged alike.

use crate::json::{self, Json};
use crate::judge::{Judge, approval_needed};
use guardmesh_client::casefold::equal_fold;
use guardmesh_client::{BatchDecision, Outcome};
use std::sync::atomic::{AtomicU64, Ordering};

/// Answers judged, counted for their call ids.
static ANSWERS: AtomicU64 = AtomicU64::new(1);

/// Whether the client message `text` (the gateway's serialization) may
/// hold a `tool_use` block: the gateway writes strings unescaped, so a
/// block's type is always spelled out in it.
pub fn may_use_tools(text: &str) -> bool {
    text.contains("tool_use")
}

/// The member of `object` named `name` as Go reads names.
fn member_mut<'a>(object: &'a mut Json, name: &str) -> Option<&'a mut Json> {
    match object {
        Json::Object(members) => members
            .iter_mut()
            .find(|(k, _)| equal_fold(k, name))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn member<'a>(object: &'a Json, name: &str) -> Option<&'a Json> {
    match object {
        Json::Object(members) => members
            .iter()
            .find(|(k, _)| equal_fold(k, name))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn is_tool_use(block: &Json) -> bool {
    member(block, "type").and_then(Json::as_str) == Some("tool_use")
}

/// A text content block.
fn text_block(text: String) -> Json {
    Json::Object(vec![
        ("type".into(), Json::String("text".into())),
        ("text".into(), Json::String(text)),
    ])
}

/// What becomes of one `tool_use` block: kept (with the final call) or
/// replaced by a text block.
fn decide(block: &mut Json, call_id: &str, judged: &Result<BatchDecision, String>) {
    let name = member(block, "name")
        .and_then(Json::as_str)
        .unwrap_or_default()
        .to_owned();
    let not_run = |why: &str| {
        text_block(format!(
            "guardmesh: the tool call {name} was not run: {why}"
        ))
    };
    let decision = match judged {
        Ok(decision) => decision.call(call_id),
        Err(why) => {
            *block = not_run(why);
            return;
        }
    };
    let Some(decided) = decision else {
        *block = not_run("the mesh returned no decision for it");
        return;
    };
    match &decided.outcome {
        Outcome::Proceed => {
            let final_call = &decided.final_call;
            let arguments = if final_call.arguments.trim().is_empty() {
                Ok(Json::Object(Vec::new()))
            } else {
                match json::read(&final_call.arguments) {
                    Ok(read)
                        if read.ambiguity.is_none() && matches!(read.value, Json::Object(_)) =>
                    {
                        Ok(read.value)
                    }
                    _ => Err(()),
                }
            };
            let Ok(arguments) = arguments else {
                *block = not_run("the final arguments are not a JSON object the gateway can read");
                return;
            };
            if let Some(name) = member_mut(block, "name") {
                *name = Json::String(final_call.tool.clone());
            }
            if let Some(input) = member_mut(block, "input") {
                *input = arguments;
            }
        }
        Outcome::Steer { content } => *block = not_run(&format!("(steer) {content}")),
        Outcome::Cancel { content } => *block = not_run(&format!("(cancel) {content}")),
        Outcome::Ask { content, approval } => {
            *block = not_run(&format!("(ask) {}", approval_needed(content, &approval.id)));
        }
    }
}

/// What goes upstream for the client's message `text` (the gateway's
/// serialization) in `session`: unchanged unless it is a response whose
/// result holds `tool_use` blocks; then each block judged (see the
/// module's documentation). `None`: nothing is forwarded (the message
/// could not be read again; never the case for what the gateway wrote).
pub async fn judged_answer(judge: &Judge, session: &str, text: String) -> Option<String> {
    if !may_use_tools(&text) {
        return Some(text);
    }
    let Ok(read) = json::read(&text) else {
        tracing::warn!("a client answer the gateway cannot read again was not forwarded");
        return None;
    };
    let mut message = read.value;
    if message.get("method").is_some() || message.get("result").is_none() {
        return Some(text);
    }
    let n = ANSWERS.fetch_add(1, Ordering::Relaxed);
    let Some(result) = member_mut(&mut message, "result") else {
        return Some(text);
    };
    let Some(content) = member_mut(result, "content") else {
        return Some(text);
    };
    let mut blocks: Vec<&mut Json> = match &mut *content {
        Json::Array(items) => items.iter_mut().filter(|b| is_tool_use(b)).collect(),
        block if is_tool_use(block) => vec![block],
        _ => Vec::new(),
    };
    if blocks.is_empty() {
        return Some(text);
    }
    // One batch for the answer's calls; a block that cannot be judged is
    // not sent (it is replaced below).
    let mut calls = Vec::new();
    let mut ids = Vec::with_capacity(blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        let call_id = format!("sampling-{n}-{i}");
        let name = member(block, "name").and_then(Json::as_str);
        let input = member(block, "input");
        match (name, input) {
            (Some(name), Some(input @ Json::Object(_))) if !name.is_empty() => {
                calls.push((call_id.clone(), name.to_owned(), input.to_text()));
                ids.push(Some(call_id));
            }
            _ => ids.push(None),
        }
    }
    let judged = if calls.is_empty() {
        Ok(BatchDecision::empty(String::new()))
    } else {
        judge.evaluate(session, calls, None).await.map_err(|error| {
            tracing::warn!(%error, "a tool_use through sampling was not forwarded");
            format!("the mesh did not judge it: {error}")
        })
    };
    for (block, id) in blocks.iter_mut().zip(&ids) {
        match id {
            Some(id) => decide(block, id, &judged),
            None => {
                let name = member(block, "name")
                    .and_then(Json::as_str)
                    .unwrap_or_default()
                    .to_owned();
                **block = text_block(format!(
                    "guardmesh: the tool call {name} was not run: it cannot be judged \
                     (a tool_use needs a string `name` and an object `input`)"
                ));
            }
        }
    }
    let left = match &*content {
        Json::Array(items) => items.iter().any(is_tool_use),
        block => is_tool_use(block),
    };
    if !left
        && let Some(stop) = member_mut(result, "stopReason")
        && stop.as_str() == Some("toolUse")
    {
        *stop = Json::String("endTurn".into());
    }
    Some(message.to_text())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable_judge() -> Judge {
        let mut args = crate::judge::JudgeArgs::default();
        // Nothing listens on port 1 of the loopback.
        args.connect.mesh = "http://127.0.0.1:1".into();
        Judge::new(args, "test")
    }

    #[tokio::test]
    async fn r31_answers_without_tool_use_pass_unchanged() {
        let judge = unreachable_judge();
        for text in [
            r#"{"jsonrpc":"2.0","id":1,"result":{"role":"assistant","content":{"type":"text","text":"tool_use"},"model":"m"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"x","params":{"type":"tool_use"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hi"}]}}"#,
        ] {
            assert_eq!(
                judged_answer(&judge, "s", text.to_owned()).await.as_deref(),
                Some(text)
            );
        }
    }

    /// Could-not-judge is never proceed: with the mesh unreachable, every
    /// `tool_use` block (under any spelling Go reads as its names) is
    /// replaced, and `stopReason` says the turn ended.
    #[tokio::test]
    async fn r31_a_tool_use_the_mesh_cannot_judge_is_never_forwarded() {
        let judge = unreachable_judge();
        for text in [
            r#"{"jsonrpc":"2.0","id":1,"result":{"role":"assistant","content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"t1","name":"delete_db","input":{}}],"model":"m","stopReason":"toolUse"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{"role":"assistant","Content":{"TYPE":"tool_use","id":"t1","Name":"delete_db","input":{}},"model":"m","stopReason":"toolUse"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"delete_db","input":"not an object"}],"model":"m"}}"#,
        ] {
            let out = judged_answer(&judge, "s", text.to_owned()).await.unwrap();
            assert!(!out.contains("\"tool_use\""), "{out}");
            assert!(out.contains("the tool call delete_db was not run"), "{out}");
            assert!(!out.contains("toolUse"), "{out}");
        }
    }
}
