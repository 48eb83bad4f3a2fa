//! Reading client messages the way the gateway must: strictly, and without
//! changing what it passes on.
//!
//! Every message from the MCP client is classified before anything is
//! forwarded ([`classify`]):
//!
//! * a `tools/call` request becomes a [`ToolCallRequest`], to be judged by the
//!   mesh (R31);
//! * any other valid JSON-RPC message is forwarded as the exact bytes received
//!   (R31: other messages pass through unchanged);
//! * anything the gateway cannot read with certainty (invalid JSON, duplicate
//!   member names, a `tools/call` with unreadable params or an id that is not
//!   a string or a number) is answered with a JSON-RPC error and never
//!   forwarded: an upstream parser more lenient than this one could otherwise
//!   run a call that no guard judged.
//!
//! The answers the gateway writes itself use the protocol types of `rmcp`
//! ([`rmcp::model::CallToolResult`], [`rmcp::model::ErrorData`]); the id of
//! a request is echoed as the exact JSON text the client sent.

use rmcp::model::{CallToolResult, ContentBlock, ErrorCode, ErrorData};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::fmt;

/// JSON-RPC error codes the gateway answers with (documented in the README,
/// "Agents and MCP").
pub mod codes {
    use rmcp::model::ErrorCode;
    /// The message is not valid JSON (JSON-RPC parse error).
    pub const PARSE_ERROR: ErrorCode = ErrorCode::PARSE_ERROR;
    /// The message is JSON but not a request the gateway can read: duplicate
    /// member names, an empty batch, an id that is neither string nor number.
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

/// The first significant character of a raw JSON value.
fn lead(raw: &RawValue) -> u8 {
    raw.get()
        .bytes()
        .find(|b| !b.is_ascii_whitespace())
        .unwrap_or(b' ')
}

/// A `tools/call` request, read for judging.
#[derive(Debug)]
pub struct ToolCallRequest {
    /// The request id, exactly as sent (a string or a number).
    pub id: Box<RawValue>,
    /// The message's members, to rebuild it with the final call.
    pub members: Members,
    /// The members of `params`.
    pub params: Members,
    /// The tool's name.
    pub name: String,
    /// The arguments' JSON text; empty when the call has none.
    pub arguments: String,
    /// `params._meta.traceparent`, W3C trace context to join (R22).
    pub traceparent: Option<String>,
    /// The message exactly as received.
    pub original: Box<RawValue>,
}

impl ToolCallRequest {
    /// The call id the mesh sees: the JSON text of the request id, so that
    /// `1` and `"1"` stay distinct (R2).
    pub fn call_id(&self) -> &str {
        self.id.get()
    }

    /// The message to forward for the final call (R31: final tool name and
    /// arguments). The original bytes when the mesh changed nothing.
    pub fn forward(&self, tool: &str, arguments: &str) -> String {
        if tool == self.name && arguments == self.arguments {
            return self.original.get().to_owned();
        }
        let mut params = Members(
            self.params
                .0
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        if let Ok(name) = serde_json::value::to_raw_value(tool) {
            params.set("name", name);
        }
        let arguments = if arguments.trim().is_empty() {
            "{}"
        } else {
            arguments
        };
        if let Ok(arguments) = RawValue::from_string(arguments.to_owned()) {
            params.set("arguments", arguments);
        }
        let mut message = Members(
            self.members
                .0
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        if let Ok(params) = RawValue::from_string(params.to_json()) {
            message.set("params", params);
        }
        message.to_json()
    }
}

/// What to do with one message (or one element of a batch).
#[derive(Debug)]
pub enum Item {
    /// A `tools/call` to judge.
    ToolCall(Box<ToolCallRequest>),
    /// Forward verbatim.
    Forward(Box<RawValue>),
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
    /// A JSON-RPC batch (an array), element by element.
    Batch(Vec<Item>),
}

/// Classifies one message from the client. `Err` holds the error to answer
/// with (id null) when the message is not JSON at all.
pub fn classify(bytes: &[u8]) -> Result<Incoming, ErrorData> {
    let raw: Box<RawValue> = serde_json::from_slice(bytes)
        .map_err(|e| ErrorData::new(codes::PARSE_ERROR, format!("parse error: {e}"), None))?;
    match lead(&raw) {
        b'[' => {
            let elements: Vec<Box<RawValue>> = serde_json::from_str(raw.get()).map_err(|e| {
                ErrorData::new(codes::PARSE_ERROR, format!("parse error: {e}"), None)
            })?;
            if elements.is_empty() {
                return Err(ErrorData::new(
                    codes::INVALID_REQUEST,
                    "an empty JSON-RPC batch",
                    None,
                ));
            }
            Ok(Incoming::Batch(elements.into_iter().map(item).collect()))
        }
        _ => Ok(Incoming::Single(item(raw))),
    }
}

fn invalid(id: Option<Box<RawValue>>, code: ErrorCode, message: String) -> Item {
    Item::Reject {
        id,
        error: ErrorData::new(code, message, None),
    }
}

/// Classifies one JSON value (a message or a batch element).
fn item(raw: Box<RawValue>) -> Item {
    if lead(&raw) != b'{' {
        return invalid(
            None,
            codes::INVALID_REQUEST,
            "a JSON-RPC message must be an object".into(),
        );
    }
    let members: Members = match serde_json::from_str(raw.get()) {
        Ok(members) => members,
        Err(e) => {
            return invalid(
                None,
                codes::INVALID_REQUEST,
                format!("invalid message: {e}"),
            );
        }
    };
    let id = members.get("id").map(ToOwned::to_owned);
    let valid_id = id
        .as_deref()
        .map(|id| matches!(lead(id), b'"' | b'-' | b'0'..=b'9'));
    let Some(method) = members.get("method") else {
        // A response to a request of the server, or an error: forwarded.
        return Item::Forward(raw);
    };
    let Ok(method) = serde_json::from_str::<String>(method.get()) else {
        let id = id.filter(|_| valid_id == Some(true));
        return invalid(
            id,
            codes::INVALID_REQUEST,
            "`method` is not a string".into(),
        );
    };
    if method != "tools/call" {
        return Item::Forward(raw);
    }
    match valid_id {
        None => {
            return Item::Drop(
                "a tools/call without an id (a notification) is not forwarded".into(),
            );
        }
        Some(false) => {
            return invalid(
                None,
                codes::INVALID_REQUEST,
                "a tools/call id must be a string or a number".into(),
            );
        }
        Some(true) => {}
    }
    let id = id.unwrap_or_else(|| raw.clone());
    let params: Members = match members.get("params") {
        Some(p) if lead(p) == b'{' => match serde_json::from_str(p.get()) {
            Ok(params) => params,
            Err(e) => {
                return invalid(
                    Some(id),
                    codes::INVALID_PARAMS,
                    format!("tools/call params: {e}"),
                );
            }
        },
        _ => {
            return invalid(
                Some(id),
                codes::INVALID_PARAMS,
                "tools/call params must be an object".into(),
            );
        }
    };
    let name = match params
        .get("name")
        .map(|n| serde_json::from_str::<String>(n.get()))
    {
        Some(Ok(name)) if !name.is_empty() => name,
        _ => {
            return invalid(
                Some(id),
                codes::INVALID_PARAMS,
                "tools/call params.name must be a non-empty string".into(),
            );
        }
    };
    let arguments = match params.get("arguments") {
        None => String::new(),
        Some(a) if lead(a) == b'{' => a.get().to_owned(),
        Some(_) => {
            return invalid(
                Some(id),
                codes::INVALID_PARAMS,
                "tools/call params.arguments must be a JSON object".into(),
            );
        }
    };
    let traceparent = params
        .get("_meta")
        .and_then(|m| serde_json::from_str::<serde_json::Value>(m.get()).ok())
        .and_then(|m| m.get("traceparent")?.as_str().map(str::to_owned));
    Item::ToolCall(Box::new(ToolCallRequest {
        id,
        members,
        params,
        name,
        arguments,
        traceparent,
        original: raw,
    }))
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

    #[test]
    fn r31_other_messages_are_forwarded_verbatim() {
        let text = r#"{"jsonrpc":"2.0", "id":1,"method":"tools/list","params":{"x":1.50}}"#;
        match single(text) {
            Item::Forward(raw) => assert_eq!(raw.get(), text),
            other => panic!("{other:?}"),
        }
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
        assert_eq!(call.forward("t", r#"{"x":1}"#), text);
        let rewritten: serde_json::Value =
            serde_json::from_str(&call.forward("u", r#"{"x":2}"#)).unwrap();
        assert_eq!(rewritten["params"]["name"], "u");
        assert_eq!(rewritten["params"]["arguments"]["x"], 2);
        assert_eq!(rewritten["params"]["_meta"]["traceparent"], "00-x");
        assert_eq!(rewritten["id"], "a");
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
}
