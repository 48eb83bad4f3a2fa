//! Results through the mesh (R33): a request of results is checked here,
//! then carried through the same admission, judging and record as a batch
//! of calls. Each result becomes a call whose `arguments` are its
//! `CallToolResult` JSON (so the R20 checks of ids, tool names and I-JSON,
//! the fold, the traces and the decision record are the ones calls have);
//! the judged batch is turned back into one [`ResultDecision`] per result
//! by [`ResultBatch::answer`].

use crate::validate::{self, Limits, shown_id, truncate};
use guardmesh_proto::v1::{
    Action, BatchDecision, CallDecision, EvaluateRequest, ResultAction, ResultDecision, ToolCall,
    ToolResult,
};
use serde_json::Value;
use std::collections::HashSet;
use tonic::Status;

/// Longest piece of a client's text shown in a refusal, in bytes.
const SHOWN: usize = 64;

/// What a request of results keeps beside its calls while it is judged:
/// the server of each result, in request order.
#[derive(Debug, Clone, Default)]
pub(crate) struct ResultBatch {
    servers: Vec<String>,
}

/// Why a result's JSON is not a `CallToolResult` (R33).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ShapeError {
    #[error("is not a JSON object")]
    NotObject,
    #[error("has no `content` array")]
    NoContent,
    #[error("`content` is not an array")]
    ContentNotArray,
    #[error("`content[{0}]` is not an object with a string `type`")]
    BadBlock(usize),
    #[error("`structuredContent` is not an object")]
    StructuredNotObject,
    #[error("`isError` is not a boolean")]
    IsErrorNotBool,
    #[error("`_meta` is not an object")]
    MetaNotObject,
    #[error("has member {0:?}, which a CallToolResult does not have")]
    UnknownMember(String),
}

/// Checks that `text` is a `CallToolResult` JSON object: `content` (an
/// array of objects with a string `type`), optional `structuredContent`
/// (object), `isError` (boolean) and `_meta` (object), nothing else. The
/// I-JSON rules (R20) are checked apart, as for arguments.
pub(crate) fn check_shape(text: &str) -> Result<(), ShapeError> {
    let Ok(Value::Object(object)) = serde_json::from_str::<Value>(text) else {
        return Err(ShapeError::NotObject);
    };
    let mut content = false;
    for (name, value) in &object {
        match name.as_str() {
            "content" => {
                let Value::Array(blocks) = value else {
                    return Err(ShapeError::ContentNotArray);
                };
                for (i, block) in blocks.iter().enumerate() {
                    if !matches!(block.get("type"), Some(Value::String(_))) {
                        return Err(ShapeError::BadBlock(i));
                    }
                }
                content = true;
            }
            "structuredContent" if !value.is_object() => {
                return Err(ShapeError::StructuredNotObject);
            }
            "isError" if !value.is_boolean() => return Err(ShapeError::IsErrorNotBool),
            "_meta" if !value.is_object() => return Err(ShapeError::MetaNotObject),
            "structuredContent" | "isError" | "_meta" => {}
            other => return Err(ShapeError::UnknownMember(truncate(other, SHOWN).to_owned())),
        }
    }
    if content {
        Ok(())
    } else {
        Err(ShapeError::NoContent)
    }
}

/// The result the model reads instead of a blocked one: an error result
/// holding the guard's content (R33).
pub(crate) fn blocked(content: &str) -> String {
    serde_json::json!({
        "content": [{"type": "text", "text": content}],
        "isError": true,
    })
    .to_string()
}

/// What the model reads of a judged result: the result as it stands when
/// it proceeds (as sent or rewritten), else the error result holding the
/// content of the block (R33).
pub(crate) fn model_reads(call: &CallDecision) -> std::borrow::Cow<'_, str> {
    if call.action == Action::Proceed as i32 {
        std::borrow::Cow::Borrowed(call.call.as_ref().map_or("", |c| c.arguments.as_str()))
    } else {
        std::borrow::Cow::Owned(blocked(&call.content))
    }
}

/// The refusal of a request of results one of whose results (`index`, of
/// the call `call_id` of `tool`) names server `sent` where the mesh
/// recorded its call as one to `recorded` (R34: a result belongs to the
/// server of the call it answers).
pub(crate) fn other_server(
    index: usize,
    call_id: &str,
    tool: &str,
    sent: &str,
    recorded: &str,
) -> validate::Refusal {
    invalid(
        "result_of_another_server",
        format!(
            "result #{index} names server {:?}, but the mesh recorded its call {:?} (tool {:?}) \
             as a call to server {:?}: a result belongs to the server of the call it answers; \
             send it with that server or with none",
            shown_id(sent, SHOWN),
            shown_id(call_id, SHOWN),
            shown_id(tool, SHOWN),
            shown_id(recorded, SHOWN),
        ),
    )
}

/// The refusal of a request of results one of whose results (`index`)
/// names the id `call_id` of a call the mesh recorded as one of tool
/// `recorded`, but tool `sent` (R34: a result answers the call recorded
/// under its id).
pub(crate) fn other_tool(
    index: usize,
    call_id: &str,
    sent: &str,
    recorded: &str,
) -> validate::Refusal {
    invalid(
        "result_of_another_tool",
        format!(
            "result #{index} names tool {:?}, but the mesh recorded its call {:?} as a call of \
             tool {:?}: a result answers the call recorded under its id; send it with that tool",
            shown_id(sent, SHOWN),
            shown_id(call_id, SHOWN),
            shown_id(recorded, SHOWN),
        ),
    )
}

fn invalid(reason: &'static str, message: String) -> validate::Refusal {
    validate::Refusal {
        reason,
        status: Status::invalid_argument(message),
    }
}

/// Takes the results out of `request` and puts them in its calls, checked
/// (R20, R25, R33): `None` for a request of calls. A request with calls
/// and results, a result with an empty or repeated `call_id`, one larger
/// than `limits.max_result_bytes`, or one whose JSON is not a
/// `CallToolResult` is refused, naming the result.
pub(crate) fn take(
    request: &mut EvaluateRequest,
    limits: &Limits,
) -> Result<Option<ResultBatch>, validate::Refusal> {
    if request.results.is_empty() {
        return Ok(None);
    }
    if !request.calls.is_empty() {
        return Err(invalid(
            "calls_and_results",
            format!(
                "a request carries calls or results, not both: this one has {} calls and {} \
                 results; send the results in a request of their own",
                request.calls.len(),
                request.results.len()
            ),
        ));
    }
    let mut seen = HashSet::with_capacity(request.results.len());
    for (index, result) in request.results.iter().enumerate() {
        let id = shown_id(&result.call_id, SHOWN);
        if result.call_id.is_empty() {
            return Err(invalid(
                "empty_call_id",
                format!(
                    "result #{index} (tool {:?}) has an empty call_id",
                    shown_id(&result.tool, SHOWN)
                ),
            ));
        }
        if !seen.insert(result.call_id.as_str()) {
            return Err(invalid(
                "duplicate_call_id",
                format!("result #{index}: call_id {id:?} is repeated in this request"),
            ));
        }
        if result.result.len() > limits.max_result_bytes {
            return Err(validate::Refusal {
                reason: "result_too_large",
                status: Status::resource_exhausted(format!(
                    "the result of call {id:?} is {} bytes, over limits.max_result_bytes ({})",
                    result.result.len(),
                    limits.max_result_bytes
                )),
            });
        }
        if result.server.len() > limits.max_id_bytes {
            return Err(invalid(
                "server_too_long",
                format!(
                    "the server of result {id:?} is {} bytes, over limits.max_id_bytes ({})",
                    result.server.len(),
                    limits.max_id_bytes
                ),
            ));
        }
        if let Err(why) = check_shape(&result.result) {
            return Err(invalid(
                "result_not_call_tool_result",
                format!("the result of call {id:?} is not an MCP CallToolResult: it {why}"),
            ));
        }
    }
    let results = std::mem::take(&mut request.results);
    let mut servers = Vec::with_capacity(results.len());
    request.calls = results
        .into_iter()
        .map(|result| {
            servers.push(result.server);
            ToolCall {
                call_id: result.call_id,
                tool: result.tool,
                arguments: result.result,
            }
        })
        .collect();
    Ok(Some(ResultBatch { servers }))
}

impl ResultBatch {
    /// The results as guards are sent them: `calls` (the results as
    /// calls, as they stand) with their servers.
    pub(crate) fn servers(&self) -> &[String] {
        &self.servers
    }

    /// Result `index` belongs to `server`: the server its call was
    /// recorded with (R34), which guards are then sent.
    pub(crate) fn attribute(&mut self, index: usize, server: &str) {
        if let Some(slot) = self.servers.get_mut(index)
            && slot != server
        {
            server.clone_into(slot);
        }
    }

    /// The answer to a request of results: one [`ResultDecision`] per
    /// result, in request order, from the decisions of its calls (R33).
    pub(crate) fn answer(&self, mut decision: BatchDecision) -> BatchDecision {
        let calls = std::mem::take(&mut decision.decisions);
        decision.execute.clear();
        decision.results = calls
            .into_iter()
            .enumerate()
            .map(|(i, call)| {
                let read = model_reads(&call).into_owned();
                let original = call.original.unwrap_or_default();
                let server = self.servers.get(i).cloned().unwrap_or_default();
                let proceed = call.action == Action::Proceed as i32;
                let (action, result) = if !proceed {
                    (ResultAction::Block, read)
                } else if call.rewritten_by.is_empty() || read == original.arguments {
                    (ResultAction::Pass, read)
                } else {
                    (ResultAction::Rewrite, read)
                };
                ResultDecision {
                    call_id: call.call_id,
                    action: action as i32,
                    result,
                    original: Some(ToolResult {
                        call_id: original.call_id,
                        tool: original.tool,
                        server,
                        result: original.arguments,
                    }),
                    content: call.content,
                    decided_by: call.decided_by,
                    failure: call.failure,
                    rewritten_by: call.rewritten_by,
                    bypassed: call.bypassed,
                }
            })
            .collect();
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn result(id: &str, json: &str) -> ToolResult {
        ToolResult {
            call_id: id.into(),
            tool: "fs.read".into(),
            server: "fs".into(),
            result: json.into(),
        }
    }

    fn request(results: Vec<ToolResult>) -> EvaluateRequest {
        EvaluateRequest {
            batch_id: "b".into(),
            results,
            ..Default::default()
        }
    }

    const OK: &str = r#"{"content":[{"type":"text","text":"hi"}]}"#;

    #[test]
    fn r33_shape_of_a_call_tool_result() {
        assert_eq!(check_shape(OK), Ok(()));
        assert_eq!(
            check_shape(r#"{"content":[],"structuredContent":{"a":1},"isError":false,"_meta":{}}"#),
            Ok(())
        );
        for (bad, why) in [
            ("[]", ShapeError::NotObject),
            ("", ShapeError::NotObject),
            ("{}", ShapeError::NoContent),
            (r#"{"content":"x"}"#, ShapeError::ContentNotArray),
            (r#"{"content":[{"text":"x"}]}"#, ShapeError::BadBlock(0)),
            (
                r#"{"content":[],"structuredContent":[]}"#,
                ShapeError::StructuredNotObject,
            ),
            (
                r#"{"content":[],"isError":"yes"}"#,
                ShapeError::IsErrorNotBool,
            ),
            (
                r#"{"content":[],"extra":1}"#,
                ShapeError::UnknownMember("extra".into()),
            ),
        ] {
            assert_eq!(check_shape(bad), Err(why), "{bad}");
        }
    }

    #[test]
    fn r33_results_become_calls_and_answers_become_result_decisions() {
        let mut req = request(vec![result("a", OK)]);
        let batch = take(&mut req, &Limits::default()).unwrap().unwrap();
        assert!(req.results.is_empty());
        assert_eq!(req.calls.len(), 1);
        assert_eq!(req.calls[0].arguments, OK);
        assert_eq!(batch.servers(), ["fs".to_owned()]);
        assert!(
            take(&mut request(vec![]), &Limits::default())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn r20_r33_bad_result_requests_are_refused_naming_the_result() {
        let limits = Limits {
            max_result_bytes: 64,
            ..Limits::default()
        };
        let mut both = request(vec![result("a", OK)]);
        both.calls.push(ToolCall::default());
        let r = take(&mut both, &limits).unwrap_err();
        assert_eq!(r.status.code(), Code::InvalidArgument);
        assert!(r.status.message().contains("calls or results"));
        let r = take(&mut request(vec![result("", OK)]), &limits).unwrap_err();
        assert_eq!(r.reason, "empty_call_id");
        let r = take(
            &mut request(vec![result("a", OK), result("a", OK)]),
            &limits,
        )
        .unwrap_err();
        assert_eq!(r.reason, "duplicate_call_id");
        assert!(r.status.message().contains("\"a\""));
        let big = format!(
            r#"{{"content":[{{"type":"text","text":"{}"}}]}}"#,
            "x".repeat(64)
        );
        let r = take(&mut request(vec![result("a", &big)]), &limits).unwrap_err();
        assert_eq!(r.status.code(), Code::ResourceExhausted);
        assert!(r.status.message().contains("limits.max_result_bytes"));
        let r = take(&mut request(vec![result("a", "{\"x\":1}")]), &limits).unwrap_err();
        assert_eq!(r.reason, "result_not_call_tool_result");
        assert!(
            r.status.message().contains("\"a\""),
            "{}",
            r.status.message()
        );
    }

    #[test]
    fn r33_a_blocked_result_is_an_error_result_with_the_content() {
        let text = blocked("no \"secrets\"");
        assert_eq!(check_shape(&text), Ok(()));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["isError"], Value::Bool(true));
        assert_eq!(v["content"][0]["text"], "no \"secrets\"");
    }
}
