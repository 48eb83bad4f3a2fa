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
//!
//! At the 2026-07-28 revision a sampling request travels inside an
//! `input_required` result, and the client's answer inside the retried
//! request's `params.inputResponses` ([`judged_request`]): every value there
//! holding `tool_use` blocks is judged exactly so, all of one request in one
//! batch, once the request itself may go upstream.
//!
//! The tools' results go back to the client's model in the upstream's next
//! sampling request, as `tool_result` blocks of its `messages`
//! ([`judged_for_client`]): each goes through the results phase (R33) in
//! the session, as the result of the call its `toolUseId` names, before
//! the client sees it; see [`judged_for_client`] for which are judged.

use crate::json::{self, Json};
use crate::judge::{Judge, PendingResult, approval_needed};
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
    let Some(result) = member_mut(&mut message, "result") else {
        return Some(text);
    };
    if !judge_tool_uses(judge, session, &mut [result]).await {
        return Some(text);
    }
    Some(message.to_text())
}

/// What goes upstream for the client's request `text` (the gateway's
/// serialization, a request the gateway lets go upstream) in `session`:
/// unchanged unless a value of its `params.inputResponses` (2026-07-28: the
/// client's answers to an `input_required` result) holds `tool_use`
/// blocks; then each block judged as in a sampling answer, all of the
/// request in one batch. Any value holding them is judged, whatever the
/// request it answers (a sampling answer, or anything written like one).
/// `Err`: nothing is forwarded, and the client gets this answer (the
/// request could not be read again; never the case for what the gateway
/// wrote).
pub async fn judged_request(judge: &Judge, session: &str, text: String) -> Result<String, String> {
    if !may_use_tools(&text) {
        return Ok(text);
    }
    let Ok(read) = json::read(&text) else {
        tracing::warn!("a client request the gateway cannot read again was not forwarded");
        let data = rmcp::model::ErrorData::new(
            rmcp::model::ErrorCode::INVALID_REQUEST,
            "guardmesh: the request could not be read again to judge its tool calls; it was \
             not forwarded",
            None,
        );
        return Err(crate::upstream::refuse(&text, &data));
    };
    let mut message = read.value;
    let Some(Json::Object(responses)) =
        member_mut(&mut message, "params").and_then(|p| member_mut(p, "inputResponses"))
    else {
        return Ok(text);
    };
    let mut answers: Vec<&mut Json> = responses.iter_mut().map(|(_, v)| v).collect();
    if !judge_tool_uses(judge, session, &mut answers).await {
        return Ok(text);
    }
    Ok(message.to_text())
}

/// The `tool_use` blocks of the sampling answer `answer` (its `content`: an
/// array of blocks, or one block).
fn tool_uses(answer: &Json) -> Vec<&Json> {
    match member(answer, "content") {
        Some(Json::Array(items)) => items.iter().filter(|b| is_tool_use(b)).collect(),
        Some(block) if is_tool_use(block) => vec![block],
        _ => Vec::new(),
    }
}

/// [`tool_uses`], to be changed.
fn tool_uses_mut(answer: &mut Json) -> Vec<&mut Json> {
    match member_mut(answer, "content") {
        Some(Json::Array(items)) => items.iter_mut().filter(|b| is_tool_use(b)).collect(),
        Some(block) if is_tool_use(block) => vec![block],
        _ => Vec::new(),
    }
}

/// Judges the `tool_use` blocks of the sampling answers `answers` as one
/// batch of calls of `session`, each block changed in place as the
/// module's documentation says; false when there were none.
async fn judge_tool_uses(judge: &Judge, session: &str, answers: &mut [&mut Json]) -> bool {
    let n = ANSWERS.fetch_add(1, Ordering::Relaxed);
    // One batch for the answers' calls; a block that cannot be judged is
    // not sent (it is replaced below).
    let mut calls = Vec::new();
    let mut ids = Vec::new();
    let blocks = answers.iter().flat_map(|answer| tool_uses(answer));
    for (i, block) in blocks.enumerate() {
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
    if ids.is_empty() {
        return false;
    }
    let judged = if calls.is_empty() {
        Ok(BatchDecision::empty(String::new()))
    } else {
        judge.evaluate(session, calls, None).await.map_err(|error| {
            tracing::warn!(%error, "a tool_use through sampling was not forwarded");
            format!("the mesh did not judge it: {error}")
        })
    };
    let mut ids = ids.iter();
    for answer in answers.iter_mut() {
        for block in tool_uses_mut(answer) {
            match ids.next().and_then(Option::as_ref) {
                Some(id) => {
                    decide(block, id, &judged);
                    remember(judge, session, block, id, &judged);
                }
                None => {
                    let name = member(block, "name")
                        .and_then(Json::as_str)
                        .unwrap_or_default()
                        .to_owned();
                    *block = text_block(format!(
                        "guardmesh: the tool call {name} was not run: it cannot be judged \
                         (a tool_use needs a string `name` and an object `input`)"
                    ));
                }
            }
        }
        if tool_uses(answer).is_empty()
            && let Some(stop) = member_mut(answer, "stopReason")
            && stop.as_str() == Some("toolUse")
        {
            *stop = Json::String("endTurn".into());
        }
    }
    true
}

/// R33: a `tool_use` block the mesh let proceed (still one after
/// [`decide`]) is remembered by its `id`, with the result the mesh judges
/// when the chain judges results.
fn remember(
    judge: &Judge,
    session: &str,
    block: &Json,
    call_id: &str,
    judged: &Result<BatchDecision, String>,
) {
    let (Ok(decision), true) = (judged, is_tool_use(block)) else {
        return;
    };
    let Some(id) = member(block, "id").and_then(Json::as_str) else {
        return;
    };
    let pending = decision.judges_results.then(|| PendingResult {
        call_id: call_id.to_owned(),
        tool: member(block, "name")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_owned(),
    });
    judge.remember_sampled(session, id, pending);
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

    /// R31 at 2026-07-28: a request's `inputResponses` values holding
    /// `tool_use` blocks (under any spelling Go reads as the names) are
    /// judged like a sampling answer; with the mesh unreachable, none is
    /// forwarded. A request without them is forwarded unchanged.
    #[tokio::test]
    async fn r31_a_tool_use_in_input_responses_the_mesh_cannot_judge_is_never_forwarded() {
        let judge = unreachable_judge();
        for text in [
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"plan","arguments":{},"requestState":"s","inputResponses":{"model":{"role":"assistant","content":[{"type":"tool_use","id":"u1","name":"delete_db","input":{}}],"model":"m","stopReason":"toolUse"}}}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"prompts/get","params":{"name":"p","InputResponses":{"a":{"action":"accept"},"b":{"Content":{"Type":"tool_use","id":"u1","NAME":"delete_db","input":{}},"stopReason":"toolUse"}}}}"#,
        ] {
            let out = judged_request(&judge, "s", text.to_owned()).await.unwrap();
            assert!(!out.contains("\"tool_use\""), "{out}");
            assert!(out.contains("the tool call delete_db was not run"), "{out}");
            assert!(!out.contains("toolUse"), "{out}");
        }
        for text in [
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"tool_use","arguments":{}}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"x","inputResponses":{"a":{"content":{"type":"text","text":"tool_use"}}}}}"#,
        ] {
            assert_eq!(
                judged_request(&judge, "s", text.to_owned())
                    .await
                    .as_deref(),
                Ok(text)
            );
        }
    }
}
