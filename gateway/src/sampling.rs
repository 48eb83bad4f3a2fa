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
    if message.get("method").is_some() && message.get("id").is_none() {
        // A notification is judged as a request would be: `tool_use`
        // blocks in its `inputResponses` never go upstream unjudged.
        return judged_request(judge, session, text).await.ok();
    }
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
    let responses =
        match member_mut(&mut message, "params").and_then(|p| member_mut(p, "inputResponses")) {
            Some(Json::Object(responses)) => responses,
            None => return Ok(text),
            // Not the map the revision defines: no peer is sent what the
            // gateway could not read as it (its `tool_use` blocks unjudged).
            Some(_) => {
                let data = rmcp::model::ErrorData::new(
                    rmcp::model::ErrorCode::INVALID_PARAMS,
                    "guardmesh: params.inputResponses must be an object of the client's answers; \
                 the request was not forwarded",
                    None,
                );
                return Err(crate::upstream::refuse(&text, &data));
            }
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

/// Why a `tool_result` block whose `toolUseId` names no call the gateway
/// remembers is withheld (R33).
const NOT_JUDGED_HERE: &str = "it answers a tool_use that is not a call judged through this \
     gateway (or one no longer remembered), and a result is never judged under a tool name the \
     server wrote";

/// The members of a `tool_result` block the results phase judges (those
/// of a tool result, R33).
const JUDGED: [&str; 4] = ["content", "structuredContent", "isError", "_meta"];

fn is_tool_result(block: &Json) -> bool {
    member(block, "type").and_then(Json::as_str) == Some("tool_result")
}

/// The `tool_use` and `tool_result` blocks of the sampling requests the
/// upstream's message carries to the client's model: the `messages` of its
/// `params` when it is a request or a notification, and those of each
/// request of `result.inputRequests` (2026-07-28: an `input_required`
/// result). Names are matched as Go's `encoding/json` matches them.
fn sampling_blocks(message: &mut Json) -> Vec<&mut Json> {
    let is_request = message.get("method").is_some();
    let Json::Object(members) = message else {
        return Vec::new();
    };
    let mut params: Vec<&mut Json> = Vec::new();
    for (name, value) in members.iter_mut() {
        if is_request && equal_fold(name, "params") {
            params.push(value);
        } else if !is_request
            && equal_fold(name, "result")
            && let Some(Json::Object(requests)) = member_mut(value, "inputRequests")
        {
            params.extend(
                requests
                    .iter_mut()
                    .filter_map(|(_, request)| member_mut(request, "params")),
            );
        }
    }
    let mut blocks = Vec::new();
    for params in params {
        let Some(Json::Array(messages)) = member_mut(params, "messages") else {
            continue;
        };
        for message in messages.iter_mut() {
            match member_mut(message, "content") {
                Some(Json::Array(items)) => blocks.extend(
                    items
                        .iter_mut()
                        .filter(|b| is_tool_use(b) || is_tool_result(b)),
                ),
                Some(block) if is_tool_use(block) || is_tool_result(block) => blocks.push(block),
                _ => {}
            }
        }
    }
    blocks
}

/// Whether the upstream's message `message` carries `tool_result` blocks to
/// the client's model ([`judged_for_client`] may change it).
pub fn carries_tool_results(message: &Json) -> bool {
    let is_request = message.get("method").is_some();
    let Json::Object(members) = message else {
        return false;
    };
    let in_messages = |params: &Json| match member(params, "messages") {
        Some(Json::Array(messages)) => messages.iter().any(|m| match member(m, "content") {
            Some(Json::Array(items)) => items.iter().any(is_tool_result),
            Some(block) => is_tool_result(block),
            None => false,
        }),
        _ => false,
    };
    members.iter().any(|(name, value)| {
        if is_request {
            equal_fold(name, "params") && in_messages(value)
        } else {
            equal_fold(name, "result")
                && matches!(
                    member(value, "inputRequests"),
                    Some(Json::Object(requests)) if requests
                        .iter()
                        .any(|(_, r)| member(r, "params").is_some_and(in_messages))
                )
        }
    })
}

/// A `tool_result` block as the client's model reads it: its `toolUseId`,
/// and the members of `result` (a tool result the mesh decided).
fn tool_result_block(id: Json, result: Json) -> Json {
    let mut members = vec![
        ("type".into(), Json::String("tool_result".into())),
        ("toolUseId".into(), id),
    ];
    if let Json::Object(decided) = result {
        members.extend(
            decided
                .into_iter()
                .filter(|(k, _)| JUDGED.contains(&k.as_str())),
        );
    }
    Json::Object(members)
}

/// A withheld tool result: an error result saying why.
fn withheld(why: &str) -> Json {
    Json::Object(vec![
        (
            "content".into(),
            Json::Array(vec![text_block(format!(
                "guardmesh: this tool result was withheld: {why}"
            ))]),
        ),
        ("isError".into(), Json::Bool(true)),
    ])
}

/// R33: what the client receives of the upstream's message `message` in
/// `session`: unchanged unless it carries `tool_result` blocks to the
/// client's model ([`sampling_blocks`]: a `sampling/createMessage` request,
/// or one inside an `input_required` result). Each `tool_result` block then
/// goes through the results phase, all of the message in one batch, and
/// the client's model reads the result as the mesh decided it (passed,
/// rewritten, or blocked as an error result), the block's other members
/// dropped:
///
/// | the block's `toolUseId` names | judged |
/// |---|---|
/// | a `tool_use` of a sampling answer in the session that the mesh let proceed, when the chain judged results | as the result of that call (its call id and final tool) |
/// | such a `tool_use`, when the chain judged no results then | no: relayed as read |
/// | anything else (a call the gateway did not judge, or no longer remembers) | no: withheld, unless the latest decision said the chain judges no results (then relayed as read) |
///
/// A `tool_use` block of the message itself never names the result's
/// tool: the upstream writes it, and could name a harmless tool whose
/// results no guard reads. So a withheld result teaches the session's
/// memory nothing (it was never sent to the mesh), and the client's model
/// never reads it. A result the mesh does not judge (unreachable, refused,
/// no decision) is withheld too: the block holds an error result saying
/// so.
pub async fn judged_for_client(judge: &Judge, session: &str, mut message: Json) -> Json {
    let mut blocks = sampling_blocks(&mut message);
    if !blocks.iter().any(|b| is_tool_result(b)) {
        return message;
    }
    // What becomes of each `tool_result` block: judged as the result of a
    // call, relayed, or withheld (why).
    enum Plan {
        Judge(PendingResult),
        Relay,
        Withhold(String),
    }
    let mut results = Vec::new();
    let mut plans = Vec::new();
    for block in blocks.iter().filter(|b| is_tool_result(b)) {
        let id = member(block, "toolUseId")
            .and_then(Json::as_str)
            .unwrap_or_default();
        let plan = match judge.sampled_call(session, id) {
            Some(Some(pending)) => Plan::Judge(pending),
            // A call that proceeded when the chain judged no results, or
            // one never seen: relayed only while the mesh's latest
            // decision still says the chain judges none (a results guard
            // registered since is not escaped by what was true then).
            _ if judge.judges_no_results() => Plan::Relay,
            // Never judged under a tool a `tool_use` of the upstream's own
            // names: the upstream writes that block, and could name a tool
            // whose results no guard reads.
            _ => Plan::Withhold(NOT_JUDGED_HERE.into()),
        };
        if let Plan::Judge(pending) = &plan {
            let judged: Vec<(String, Json)> = match block {
                Json::Object(members) => JUDGED
                    .iter()
                    .filter_map(|name| {
                        members
                            .iter()
                            .find(|(k, _)| equal_fold(k, name))
                            .map(|(_, v)| ((*name).to_owned(), v.clone()))
                    })
                    .collect(),
                _ => Vec::new(),
            };
            results.push((pending.clone(), Json::Object(judged).to_text()));
        }
        plans.push(plan);
    }
    let decision = if results.is_empty() {
        Ok(BatchDecision::empty(String::new()))
    } else {
        judge
            .evaluate_results(session, results)
            .await
            .map_err(|error| {
                tracing::warn!(%error, "a tool result sent through sampling was withheld");
                format!("the mesh did not judge it: {error}")
            })
    };
    let tool_results = blocks.iter_mut().filter(|b| is_tool_result(b));
    for (block, plan) in tool_results.zip(plans) {
        let id = member(block, "toolUseId")
            .cloned()
            .unwrap_or(Json::String(String::new()));
        let result = match (plan, &decision) {
            (Plan::Relay, _) => continue,
            (Plan::Withhold(why), _) => withheld(&why),
            (Plan::Judge(_), Err(why)) => withheld(why),
            (Plan::Judge(pending), Ok(decision)) => match decision
                .result(&pending.call_id)
                .and_then(|decided| json::read(&decided.result).ok())
            {
                Some(decided) if decided.ambiguity.is_none() => decided.value,
                _ => withheld("the mesh returned no decision for it"),
            },
        };
        **block = tool_result_block(id, result);
    }
    message
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

    /// R33, R20: what the gateway remembers of sampled calls is bounded by
    /// count and bytes whatever peers write, and one session's flood
    /// forgets its own calls, not another session's.
    #[test]
    fn r20_r33_sampled_calls_are_remembered_within_bounds() {
        use crate::judge::{MAX_SAMPLED_CALLS_PER_SESSION, MAX_SAMPLED_ID_BYTES, PendingResult};
        let judge = unreachable_judge();
        let pending = |n: usize| {
            Some(PendingResult {
                call_id: format!("c{n}"),
                tool: "read_db".into(),
            })
        };
        judge.remember_sampled("victim", "u1", pending(0));
        for n in 0..MAX_SAMPLED_CALLS_PER_SESSION * 20 {
            judge.remember_sampled("flood", &format!("f{n}"), pending(n));
        }
        assert_eq!(
            judge
                .sampled_call("victim", "u1")
                .flatten()
                .map(|p| p.call_id),
            Some("c0".to_owned()),
            "another session's flood evicted the victim's call"
        );
        let last = MAX_SAMPLED_CALLS_PER_SESSION * 20 - 1;
        assert!(judge.sampled_call("flood", &format!("f{last}")).is_some());
        assert!(judge.sampled_call("flood", "f0").is_none());
        let long = "u".repeat(MAX_SAMPLED_ID_BYTES + 1);
        judge.remember_sampled("victim", &long, pending(1));
        assert!(judge.sampled_call("victim", &long).is_none());
        let edge = "u".repeat(MAX_SAMPLED_ID_BYTES);
        judge.remember_sampled("victim", &edge, pending(2));
        assert!(judge.sampled_call("victim", &edge).is_some());
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

    /// R33: a `tool_result` block sent to the client's model (in a
    /// sampling request, or one inside an `input_required` result, under
    /// any spelling Go reads as the names) that the mesh cannot judge is
    /// withheld: an error result saying why, its other members dropped.
    #[tokio::test]
    async fn r33_a_tool_result_the_mesh_cannot_judge_never_reaches_the_model() {
        let judge = unreachable_judge();
        let secret = "AKIAIOSFODNN7EXAMPLE";
        let messages = format!(
            r#"[{{"role":"assistant","content":{{"type":"tool_use","id":"u1","name":"read_db","input":{{}}}}}},{{"role":"user","Content":[{{"Type":"tool_result","toolUseId":"u1","content":[{{"type":"text","text":"{secret}"}}],"extra":"{secret}"}}]}},{{"role":"user","content":{{"type":"tool_result","toolUseId":"nobody","content":[{{"type":"text","text":"{secret}"}}]}}}}]"#
        );
        for text in [
            format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"sampling/createMessage","params":{{"maxTokens":9,"messages":{messages}}}}}"#
            ),
            format!(
                r#"{{"jsonrpc":"2.0","id":1,"result":{{"resultType":"input_required","InputRequests":{{"m":{{"method":"sampling/createMessage","Params":{{"maxTokens":9,"Messages":{messages}}}}}}}}}}}"#
            ),
        ] {
            let message = json::read(&text).unwrap().value;
            assert!(carries_tool_results(&message), "{text}");
            let out = judged_for_client(&judge, "s", message).await.to_text();
            assert!(!out.contains(secret), "{out}");
            // Both withheld as not judged here, "u1" too: the `tool_use`
            // naming it is the upstream's word, not a judged call (the
            // mesh is not even asked).
            assert_eq!(
                out.matches("this tool result was withheld").count(),
                2,
                "{out}"
            );
            assert_eq!(
                out.matches("not a call judged through this gateway")
                    .count(),
                2,
                "{out}"
            );
            assert!(out.contains(r#""toolUseId":"u1""#), "{out}");
        }
        // A call remembered as proceeding while the chain judged no results
        // is not relayed on that memory once the mesh may judge them.
        judge.remember_sampled("s", "then", None);
        let stale = json::read(&format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"sampling/createMessage","params":{{"messages":[{{"role":"user","content":{{"type":"tool_result","toolUseId":"then","content":[{{"type":"text","text":"{secret}"}}]}}}}]}}}}"#
        ))
        .unwrap()
        .value;
        let out = judged_for_client(&judge, "s", stale).await.to_text();
        assert!(!out.contains(secret), "{out}");
        let plain = json::read(
            r#"{"jsonrpc":"2.0","id":1,"method":"sampling/createMessage","params":{"messages":[{"role":"user","content":{"type":"text","text":"tool_result"}}]}}"#,
        )
        .unwrap()
        .value;
        assert!(!carries_tool_results(&plain));
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
        // A notification carrying them is judged alike (or not forwarded).
        let notification = r#"{"jsonrpc":"2.0","method":"prompts/get","params":{"name":"p","inputResponses":{"m":{"content":{"type":"tool_use","id":"u","name":"delete_db","input":{}}}}}}"#;
        let out = judged_answer(&judge, "s", notification.to_owned()).await;
        assert!(
            out.as_deref()
                .is_none_or(|out| !out.contains("\"tool_use\"")),
            "{out:?}"
        );
        let cancelled = r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":3,"reason":"tool_use"}}"#;
        assert_eq!(
            judged_answer(&judge, "s", cancelled.to_owned())
                .await
                .as_deref(),
            Some(cancelled)
        );
        // Answers that are not the revision's map of answers are refused,
        // never forwarded with their blocks unread.
        for text in [
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"plan","inputResponses":[{"content":{"type":"tool_use","id":"u1","name":"delete_db","input":{}}}]}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"prompts/get","params":{"name":"p","inputresponses":"tool_use"}}"#,
        ] {
            let refused = judged_request(&judge, "s", text.to_owned())
                .await
                .unwrap_err();
            assert!(refused.contains("-32602"), "{refused}");
            assert!(
                refused.contains("inputResponses must be an object"),
                "{refused}"
            );
            assert!(!refused.contains("delete_db"), "{refused}");
        }
    }
}
