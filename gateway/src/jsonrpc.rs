//! Reading client messages the way the gateway must: strictly, once, and
//! alike to every peer; and writing what it forwards itself.
//!
//! Every message from the MCP client is read once ([`crate::json`]) and
//! classified before anything is forwarded ([`classify`]):
//!
//! * a `tools/call` request becomes a [`ToolCallRequest`], to be judged by the
//!   mesh (R31), and forwarded on proceed as the gateway writes it
//!   ([`ToolCallRequest::forward`]);
//! * any other valid JSON-RPC message is forwarded as the gateway writes it
//!   (R31: it passes through, its members, unknown ones included, and its
//!   numbers as read; only the bytes between them are the gateway's);
//! * anything the gateway cannot read alike to every peer is answered with a
//!   JSON-RPC error and nothing of it is forwarded: invalid JSON, two member
//!   names of one object equal or equal under Go's case folding at any depth
//!   (Python and JavaScript take the last of two equal names, Go's
//!   `encoding/json` matches `METHOD` and `paramſ` as `method` and
//!   `params`), a member the JSON-RPC envelope does not have, a bare CR on
//!   stdio ([`classify_line`]: the Python SDK splits lines there), a
//!   `tools/call` with unreadable params or an id that is not a string or a
//!   number, and a JSON-RPC batch with any such element (refused whole).
//!   An upstream parser that reads a message differently from the gateway
//!   could otherwise run a call that no guard judged.
//!
//! The answers the gateway writes itself use the protocol types of `rmcp`
//! ([`rmcp::model::CallToolResult`], [`rmcp::model::ErrorData`]); the id of
//! a request is echoed as the gateway read it.

use crate::json::{self, Json};
use rmcp::model::{CallToolResult, ContentBlock, ErrorCode, ErrorData};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::fmt;

/// JSON-RPC error codes the gateway answers with (documented in
/// docs/mcp-and-hooks.md).
pub mod codes {
    use rmcp::model::ErrorCode;
    /// The message is not valid JSON (JSON-RPC parse error).
    pub const PARSE_ERROR: ErrorCode = ErrorCode::PARSE_ERROR;
    /// The message is JSON but not one the gateway can read alike to every
    /// peer: duplicate member names or names equal under case folding, an
    /// unknown envelope member, a bare CR on stdio, an empty batch or one
    /// with such an element, an id that is neither string nor number.
    pub const INVALID_REQUEST: ErrorCode = ErrorCode::INVALID_REQUEST;
    /// A `tools/call` whose params cannot be judged: not an object, no tool
    /// name, arguments that are not a JSON object.
    pub const INVALID_PARAMS: ErrorCode = ErrorCode::INVALID_PARAMS;
    /// The mesh answered the batch with an error instead of decisions: refused
    /// (R20), aborted by a guard with policy `abort` (R13), or a stale chain
    /// (R17). `data.grpcCode` names the gRPC code. Nothing was forwarded.
    pub const MESH_REFUSED: ErrorCode = ErrorCode(-32070);
    /// The mesh could not be reached (or did not answer in time). Nothing was
    /// forwarded.
    pub const MESH_UNREACHABLE: ErrorCode = ErrorCode(-32071);
    /// The message is larger than `--max-message-bytes`; it was discarded.
    pub const TOO_LARGE: ErrorCode = ErrorCode(-32072);
    /// `mcp http`: the upstream MCP server could not be reached (HTTP 502).
    pub const INTERNAL_ERROR_UPSTREAM: ErrorCode = ErrorCode(-32073);
}

/// The members of a JSON object in order, read without losing a byte of
/// their values; duplicate member names are refused (RFC 7493 I-JSON), since
/// parsers disagree on which of two `"method"` members counts.
#[derive(Debug)]
pub struct Members(pub Vec<(String, Box<RawValue>)>);

impl Members {
    /// The raw value of member `key`.
    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_ref())
    }

    /// Replaces (or appends) member `key`.
    pub fn set(&mut self, key: &str, value: Box<RawValue>) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.0.push((key.to_owned(), value)),
        }
    }

    /// The object as JSON text, members in their order.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{");
        for (i, (key, value)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            // A String always serializes.
            out.push_str(&serde_json::to_string(key).unwrap_or_default());
            out.push(':');
            out.push_str(value.get());
        }
        out.push('}');
        out
    }
}

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members: Vec<(String, Box<RawValue>)> = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if members.iter().any(|(k, _)| *k == key) {
                        return Err(serde::de::Error::custom(format!(
                            "duplicate member name {key:?}"
                        )));
                    }
                    let value = map.next_value::<Box<RawValue>>()?;
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(MembersVisitor)
    }
}

/// The members a JSON-RPC 2.0 message may have. Any other member is
/// refused: a peer that matches names case-insensitively would read
/// `Method` or `PARAMS` as the real thing.
const ENVELOPE: [&str; 6] = ["jsonrpc", "id", "method", "params", "result", "error"];

/// A `tools/call` request, read for judging.
#[derive(Debug, Clone)]
pub struct ToolCallRequest {
    /// The request id, as the gateway writes it (a string or a number).
    pub id: Box<RawValue>,
    /// The message as read, to write out with a rewritten call.
    pub message: Json,
    /// The message as the gateway writes it, written once when it was read:
    /// what is forwarded when the mesh changes nothing.
    text: String,
    /// The tool's name.
    pub name: String,
    /// The arguments' JSON text as the gateway writes them (cut from the
    /// message's text); empty when the call has none.
    pub arguments: String,
    /// `params._meta.traceparent`, W3C trace context to join (R22).
    pub traceparent: Option<String>,
}

/// Why the final call of a decision cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("the final arguments are not a JSON object the gateway can read: {0}")]
    Arguments(String),
}

impl ToolCallRequest {
    /// The call id the mesh sees: the JSON text of the request id, so that
    /// `1` and `"1"` stay distinct (R2).
    pub fn call_id(&self) -> &str {
        self.id.get()
    }

    /// The message to forward for the final call (R31: final tool name and
    /// arguments), in the gateway's serialization: the message as read
    /// when the mesh changed nothing, else with `params.name` and
    /// `params.arguments` replaced. Final arguments the gateway cannot read
    /// as it reads a client's (an object, no names that collide) are an
    /// error: nothing is forwarded.
    pub fn forward(&self, tool: &str, arguments: &str) -> Result<String, ForwardError> {
        if tool == self.name && arguments == self.arguments {
            return Ok(self.text.clone());
        }
        let arguments = if arguments.trim().is_empty() {
            Json::Object(Vec::new())
        } else {
            let read = json::read(arguments).map_err(|e| ForwardError::Arguments(e.to_string()))?;
            if let Some(ambiguity) = read.ambiguity {
                return Err(ForwardError::Arguments(ambiguity.to_string()));
            }
            if !matches!(read.value, Json::Object(_)) {
                return Err(ForwardError::Arguments("not an object".into()));
            }
            read.value
        };
        let mut message = self.message.clone();
        if let Json::Object(members) = &mut message
            && let Some((_, params)) = members.iter_mut().find(|(k, _)| k == "params")
        {
            params.set("name", Json::String(tool.to_owned()));
            params.set("arguments", arguments);
        }
        Ok(message.to_text())
    }
}

/// What to do with one message (or one element of a batch).
#[derive(Debug)]
pub enum Item {
    /// A `tools/call` to judge.
    ToolCall(Box<ToolCallRequest>),
    /// Forward this text, the gateway's serialization of the message.
    Forward {
        text: String,
        /// The id's key ([`id_key`]) when the message is a request, whose
        /// response is to come.
        request: Option<String>,
        /// A `tools/list` request: its response is relayed without the
        /// tools' output schemas ([`crate::schemas`]).
        lists_tools: bool,
    },
    /// Answer with this error; forward nothing.
    Reject {
        id: Option<Box<RawValue>>,
        error: ErrorData,
    },
    /// A `tools/call` sent as a notification (no id): it cannot be answered
    /// and must not run unjudged, so it is dropped (and logged).
    Drop(String),
}

/// A message from the client, classified.
#[derive(Debug)]
pub enum Incoming {
    Single(Item),
    /// A JSON-RPC batch (an array) whose every element the gateway can
    /// judge or forward: element by element. A batch with an element the
    /// gateway cannot read is refused whole ([`classify`]).
    Batch(Vec<Item>),
}

/// Classifies one line read from a stdio client: [`classify`], and a bare
/// CR anywhere in it is refused (a line may end in CR LF). The Python SDK
/// reads stdin with universal newlines, so a CR ends a line there: a message
/// the gateway reads whole would be several to the server.
pub fn classify_line(line: &[u8]) -> Result<Incoming, ErrorData> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let framing = line.contains(&b'\r').then(|| {
        "a bare CR (carriage return) in the message: a peer reading lines with universal \
         newlines (the Python SDK) splits the message there"
            .to_owned()
    });
    classify_with(line, framing)
}

/// Classifies one message from the client (an HTTP body, or a line of
/// stdio). `Err` holds the error to answer with (id null) when the message
/// cannot be read at all, or is a batch refused whole.
pub fn classify(bytes: &[u8]) -> Result<Incoming, ErrorData> {
    classify_with(bytes, None)
}

fn classify_with(bytes: &[u8], framing: Option<String>) -> Result<Incoming, ErrorData> {
    let parse_error = |e: &dyn fmt::Display| {
        ErrorData::new(codes::PARSE_ERROR, format!("parse error: {e}"), None)
    };
    let parse_error = |e: &dyn fmt::Display| match &framing {
        // Say why the line may have been cut where it was.
        Some(framing) => parse_error(&format!("{e}; {framing}")),
        None => parse_error(e),
    };
    let text = std::str::from_utf8(bytes).map_err(|e| parse_error(&e))?;
    let read = json::read(text).map_err(|e| parse_error(&e))?;
    // What makes the whole message unreadable alike to every peer.
    let problem = framing.or_else(|| read.ambiguity.as_ref().map(ToString::to_string));
    match read.value {
        Json::Array(elements) => {
            if elements.is_empty() {
                return Err(ErrorData::new(
                    codes::INVALID_REQUEST,
                    "an empty JSON-RPC batch",
                    None,
                ));
            }
            let items: Vec<Item> = elements.into_iter().map(|e| item(e, None)).collect();
            let refused = problem.or_else(|| {
                items.iter().enumerate().find_map(|(i, item)| match item {
                    Item::Reject { error, .. } => Some(format!("element {i}: {}", error.message)),
                    Item::Drop(why) => Some(format!("element {i}: {why}")),
                    _ => None,
                })
            });
            match refused {
                None => Ok(Incoming::Batch(items)),
                Some(why) => Err(ErrorData::new(
                    codes::INVALID_REQUEST,
                    format!(
                        "guardmesh: the JSON-RPC batch was refused whole, nothing of it was \
                         forwarded: {why}"
                    ),
                    None,
                )),
            }
        }
        value => Ok(Incoming::Single(item(value, problem))),
    }
}

fn invalid(id: Option<Box<RawValue>>, code: ErrorCode, message: String) -> Item {
    Item::Reject {
        id,
        error: ErrorData::new(code, message, None),
    }
}

/// A request id as the gateway writes it, if it is one JSON-RPC allows
/// (a string or a number).
fn id_of(value: &Json) -> Option<Box<RawValue>> {
    match value {
        Json::String(_) | Json::Number(_) => RawValue::from_string(value.to_text()).ok(),
        _ => None,
    }
}

/// Classifies one JSON value (a message or a batch element); `problem`
/// refuses it whatever it is.
fn item(value: Json, problem: Option<String>) -> Item {
    let Json::Object(members) = &value else {
        return invalid(
            None,
            codes::INVALID_REQUEST,
            "a JSON-RPC message must be an object".into(),
        );
    };
    // The id to answer a refusal with: only one that no peer can read
    // differently (one member of that name, under case folding too).
    let id = {
        let mut ids = members
            .iter()
            .filter(|(k, _)| guardmesh_client::casefold::equal_fold(k, "id"));
        match (ids.next(), ids.next()) {
            (Some((name, id)), None) if name == "id" => id_of(id),
            _ => None,
        }
    };
    let refuse = |message: String| invalid(id.clone(), codes::INVALID_REQUEST, message);
    if let Some(problem) = problem {
        return refuse(format!(
            "guardmesh: the message was not forwarded: {problem}"
        ));
    }
    if let Some((name, _)) = members
        .iter()
        .find(|(k, _)| !ENVELOPE.contains(&k.as_str()))
    {
        return refuse(format!(
            "guardmesh: unknown member {name:?} in a JSON-RPC message (allowed: {})",
            ENVELOPE.join(", ")
        ));
    }
    if value.get("jsonrpc").and_then(Json::as_str) != Some("2.0") {
        return refuse("`jsonrpc` must be \"2.0\"".into());
    }
    let has_id = value.get("id").is_some();
    if has_id && id.is_none() && value.get("error").is_none() {
        return refuse("`id` must be a string or a number".into());
    }
    let Some(method) = value.get("method") else {
        // A response to a request of the server: an id, and a result or an
        // error.
        if value.get("params").is_some()
            || !has_id
            || value.get("result").is_some() == value.get("error").is_some()
        {
            return refuse(
                "a JSON-RPC response has an id and exactly one of `result` and `error`".into(),
            );
        }
        return Item::Forward {
            text: value.to_text(),
            request: None,
            lists_tools: false,
        };
    };
    let Some(method) = method.as_str() else {
        return refuse("`method` is not a string".into());
    };
    if value.get("result").is_some() || value.get("error").is_some() {
        return refuse("a JSON-RPC request has no `result` or `error`".into());
    }
    let params = value.get("params");
    if method != "tools/call" {
        if !matches!(params, None | Some(Json::Object(_) | Json::Array(_))) {
            return invalid(
                id,
                codes::INVALID_PARAMS,
                "`params` must be an object or an array".into(),
            );
        }
        return Item::Forward {
            request: id.as_deref().map(id_key),
            text: value.to_text(),
            lists_tools: method == "tools/list",
        };
    }
    let Some(id) = id else {
        return Item::Drop("a tools/call without an id (a notification) is not forwarded".into());
    };
    let bad_params =
        |message: &str| invalid(Some(id.clone()), codes::INVALID_PARAMS, message.into());
    let Some(params @ Json::Object(_)) = params else {
        return bad_params("tools/call params must be an object");
    };
    let name = match params.get("name").and_then(Json::as_str) {
        Some(name) if !name.is_empty() => name.to_owned(),
        _ => return bad_params("tools/call params.name must be a non-empty string"),
    };
    if !matches!(params.get("arguments"), None | Some(Json::Object(_))) {
        return bad_params("tools/call params.arguments must be a JSON object");
    }
    let traceparent = params
        .get("_meta")
        .and_then(|m| m.get("traceparent"))
        .and_then(Json::as_str)
        .map(str::to_owned);
    let (text, arguments) = write_tool_call(&value);
    let arguments = text.get(arguments).unwrap_or_default().to_owned();
    Item::ToolCall(Box::new(ToolCallRequest {
        id,
        message: value,
        text,
        arguments,
        name,
        traceparent,
    }))
}

/// The text of a `tools/call` message (an object whose `params` is an
/// object), and where `params.arguments` is in it: one serialization for
/// what is judged and what is forwarded.
fn write_tool_call(message: &Json) -> (String, std::ops::Range<usize>) {
    let mut out = String::with_capacity(256);
    let mut arguments = 0..0;
    let Json::Object(members) = message else {
        message.write(&mut out);
        return (out, arguments);
    };
    out.push('{');
    for (i, (key, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json::write_string(key, &mut out);
        out.push(':');
        match value {
            Json::Object(params) if key == "params" => {
                out.push('{');
                for (j, (key, value)) in params.iter().enumerate() {
                    if j > 0 {
                        out.push(',');
                    }
                    json::write_string(key, &mut out);
                    out.push(':');
                    let start = out.len();
                    value.write(&mut out);
                    if key == "arguments" && arguments.is_empty() {
                        arguments = start..out.len();
                    }
                }
                out.push('}');
            }
            value => value.write(&mut out),
        }
    }
    out.push('}');
    (out, arguments)
}

#[derive(Serialize)]
struct ResultMessage<'a, T> {
    jsonrpc: &'static str,
    id: &'a RawValue,
    result: T,
}

#[derive(Serialize)]
struct ErrorMessage<'a> {
    jsonrpc: &'static str,
    id: Option<&'a RawValue>,
    error: &'a ErrorData,
}

/// A tool result answered by the gateway: steer is `isError: true`, cancel
/// `isError: false`, both holding the guard's content as text (R31).
pub fn tool_result(id: &RawValue, content: &str, is_error: bool) -> String {
    let blocks = vec![ContentBlock::text(content)];
    let result = if is_error {
        CallToolResult::error(blocks)
    } else {
        CallToolResult::success(blocks)
    };
    // `resultType: "complete"` (rmcp's default) is required by the
    // 2026-07-28 revision and ignored by clients of earlier ones (both are
    // tested with the official Python SDK).
    serde_json::to_string(&ResultMessage {
        jsonrpc: "2.0",
        id,
        result,
    })
    .unwrap_or_default()
}

/// A JSON-RPC error answer (`id` null when the request's id is unknown).
pub fn error(id: Option<&RawValue>, error: &ErrorData) -> String {
    serde_json::to_string(&ErrorMessage {
        jsonrpc: "2.0",
        id,
        error,
    })
    .unwrap_or_default()
}

/// The id of a message from the upstream when it is a response (an id and no
/// method), as a key comparable with request ids.
pub fn response_key(bytes: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Envelope<'a> {
        #[serde(borrow)]
        id: Option<&'a RawValue>,
        method: Option<&'a RawValue>,
    }
    let envelope: Envelope = serde_json::from_slice(bytes).ok()?;
    if envelope.method.is_some() {
        return None;
    }
    envelope.id.map(id_key)
}

/// A comparison key for a request id: numbers by value where they are
/// integers (`1` and `1.0` are one id), strings as themselves.
pub fn id_key(id: &RawValue) -> String {
    match serde_json::from_str::<rmcp::model::NumberOrString>(id.get()) {
        Ok(rmcp::model::NumberOrString::Number(n)) => n.to_string(),
        Ok(rmcp::model::NumberOrString::String(s)) => format!("s:{s}"),
        Err(_) => format!("raw:{}", id.get()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn single(text: &str) -> Item {
        match classify(text.as_bytes()) {
            Ok(Incoming::Single(item)) => item,
            other => panic!("{other:?}"),
        }
    }

    fn refusal(item: Item) -> (Option<String>, String) {
        match item {
            Item::Reject { id, error } => {
                (id.map(|i| i.get().to_owned()), error.message.into_owned())
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn r31_other_messages_are_forwarded_as_the_gateway_writes_them() {
        let text = "{\"jsonrpc\":\"2.0\", \"id\":1,\"method\":\"tools/list\",\"params\":{\"x\":1.50,\"_meta\":{\"u\":\"\u{2028}\"}}}";
        match single(text) {
            Item::Forward {
                text,
                request,
                lists_tools,
            } => {
                assert!(lists_tools);
                assert_eq!(
                    text,
                    r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"x":1.50,"_meta":{"u":"\u2028"}}}"#
                );
                assert_eq!(request.as_deref(), Some("1"));
            }
            other => panic!("{other:?}"),
        }
        let response = r#"{"jsonrpc":"2.0","id":"s1","result":{"roots":[]}}"#;
        assert!(matches!(
            single(response),
            Item::Forward { request: None, .. }
        ));
    }

    #[test]
    fn r31_tool_call_is_read_for_judging() {
        let text = r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"t","arguments":{"x":1},"_meta":{"traceparent":"00-x"}}}"#;
        let Item::ToolCall(call) = single(text) else {
            panic!()
        };
        assert_eq!(call.call_id(), r#""a""#);
        assert_eq!(call.name, "t");
        assert_eq!(call.arguments, r#"{"x":1}"#);
        assert_eq!(call.traceparent.as_deref(), Some("00-x"));
        assert_eq!(call.forward("t", r#"{"x":1}"#).unwrap(), text);
        let rewritten: serde_json::Value =
            serde_json::from_str(&call.forward("u", r#"{"x":2}"#).unwrap()).unwrap();
        assert_eq!(rewritten["params"]["name"], "u");
        assert_eq!(rewritten["params"]["arguments"]["x"], 2);
        assert_eq!(rewritten["params"]["_meta"]["traceparent"], "00-x");
        assert_eq!(rewritten["id"], "a");
        // Final arguments the gateway could not read as a client's are
        // never forwarded.
        assert!(call.forward("t", r#"{"p":1,"P":2}"#).is_err());
        assert!(call.forward("t", "[1]").is_err());
    }

    #[test]
    fn r31_unreadable_tool_calls_are_never_forwarded() {
        for text in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"t"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","name":"u"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":[1]}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":null}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":[]}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":""}}"#,
            r#"{"jsonrpc":"2.0","id":{},"method":"tools/call","params":{"name":"t"}}"#,
            r#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"t"}}"#,
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"t"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":7}"#,
        ] {
            assert!(
                matches!(single(text), Item::Reject { .. } | Item::Drop(_)),
                "{text}"
            );
        }
        assert!(classify(b"{\"jsonrpc\":").is_err());
        assert!(classify(b"[]").is_err());
    }

    #[test]
    fn r31_r20_names_peers_read_differently_are_refused_with_the_id() {
        for (text, named) in [
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"ping","METHOD":"tools/call"}"#,
                "METHOD",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"Method":"tools/call"}"#,
                "Method",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"ping","params":{},"paramſ":{}}"#,
                "paramſ",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","Name":"b"}}"#,
                "Name",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","arguments":{"path":"x","PATH":"y"}}}"#,
                "PATH",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"ping","params":{"_meta":{"a":[{"mask":1,"MASK":2}]}}}"#,
                "/params/_meta/a/0",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"notifications/x","extra":1}"#,
                "extra",
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{},"error":{}}"#,
                "exactly one",
            ),
            (r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#, "2.0"),
        ] {
            let (id, message) = refusal(single(text));
            assert_eq!(id.as_deref(), Some("1"), "{text}");
            assert!(message.contains(named), "{text}: {message}");
        }
        // An id that is itself ambiguous is not echoed.
        let (id, _) = refusal(single(r#"{"jsonrpc":"2.0","id":1,"ID":2,"method":"ping"}"#));
        assert_eq!(id, None);
    }

    #[test]
    fn r31_a_bare_cr_on_stdio_is_refused_and_crlf_is_a_line_end() {
        let carrier = "{\"jsonrpc\":\"2.0\",\"id\":\"x\",\"method\":\"ping\",\"params\":{\"_meta\":{\"x\":\r{\"a\":1}\r}}}";
        let Ok(Incoming::Single(item)) = classify_line(carrier.as_bytes()) else {
            panic!()
        };
        let (id, message) = refusal(item);
        assert_eq!(id.as_deref(), Some(r#""x""#));
        assert!(message.contains("CR"), "{message}");
        let crlf = "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\r";
        assert!(matches!(
            classify_line(crlf.as_bytes()),
            Ok(Incoming::Single(Item::Forward { .. }))
        ));
        // Over HTTP a CR is whitespace, and it is not forwarded anyway.
        assert!(matches!(
            classify(carrier.as_bytes()),
            Ok(Incoming::Single(Item::Forward { .. }))
        ));
    }

    #[test]
    fn r31_a_batch_with_an_element_it_cannot_judge_is_refused_whole() {
        let good = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;
        for bad in [
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"a","name":"b"}}"#,
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"a"}}"#,
            r#"{"jsonrpc":"2.0","id":2,"Method":"tools/call"}"#,
            "7",
        ] {
            let error = classify(format!("[{good},{bad}]").as_bytes()).unwrap_err();
            assert_eq!(error.code, codes::INVALID_REQUEST);
            assert!(
                error.message.contains("element 1") || error.message.contains("\"/1/"),
                "{}",
                error.message
            );
        }
        assert!(matches!(
            classify(format!("[{good},{good}]").as_bytes()),
            Ok(Incoming::Batch(items)) if items.len() == 2
        ));
    }

    #[test]
    fn r31_answers_use_the_raw_id() {
        let id = RawValue::from_string("12345678901234567890".into()).unwrap();
        let text = tool_result(&id, "no", true);
        assert!(text.starts_with(r#"{"jsonrpc":"2.0","id":12345678901234567890,"#));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["result"]["isError"], true);
        assert_eq!(v["result"]["content"][0]["text"], "no");
        assert_eq!(id_key(&RawValue::from_string("1.0".into()).unwrap()), "1");
        assert_eq!(
            response_key(br#"{"jsonrpc":"2.0","id":"1","result":{}}"#).as_deref(),
            Some("s:1")
        );
    }

    #[test]
    fn r31_a_tool_call_is_written_once_for_judging_and_forwarding() {
        for text in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}"#,
            r#"{"params":{"arguments":{"a":[1.50,{"b":"\u2028"}]},"name":"t"},"id":"x","method":"tools/call","jsonrpc":"2.0"}"#,
            "{ \"jsonrpc\" : \"2.0\", \"id\" : 7 , \"method\":\"tools/call\",\"params\":{\"_meta\":{\"arguments\":1},\"name\":\"t\",\"arguments\":{ \"q\\\"\": \"\u{85}\" }}}",
        ] {
            let Item::ToolCall(call) = single(text) else {
                panic!("{text}")
            };
            let whole = call.message.to_text();
            assert_eq!(call.forward(&call.name, &call.arguments).unwrap(), whole);
            let arguments = call
                .message
                .get("params")
                .and_then(|p| p.get("arguments"))
                .map(Json::to_text)
                .unwrap_or_default();
            assert_eq!(call.arguments, arguments, "{text}");
        }
    }
}
