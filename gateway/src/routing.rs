//! The routing headers of the MCP 2026-07-28 revision over HTTP (R31):
//! `Mcp-Method` repeats the request's `method` and `Mcp-Name` its named
//! parameter (`params.name` of `tools/call` and `prompts/get`,
//! `params.uri` of `resources/read`), so that a router or an upstream may
//! act on a request without reading its body; `Mcp-Param-{Header}` mirrors
//! an argument of a `tools/call` whose tool declares it in its
//! `inputSchema` (`"x-mcp-header": "Header"` on a property reached through
//! `properties` alone). Whatever trusts them must see the call the guards
//! judged:
//!
//! * a request whose routing headers disagree with the body the gateway read
//!   is refused (HTTP 400, JSON-RPC `-32020`, the revision's header-mismatch
//!   code), naming the header; nothing is forwarded;
//! * a `tools/call` is forwarded with `Mcp-Name` written from the final call,
//!   and with the `Mcp-Param-*` headers the client sent written again from
//!   the final call's arguments, by the declarations the gateway read in the
//!   upstream's `tools/list` answers ([`ParamHeaders`]). A header whose
//!   argument the final call lacks (or is not a string, number or boolean)
//!   is left out, as the revision's clients leave it out; the gateway adds no
//!   header the client did not send. When the final tool's declarations are
//!   unknown (no `tools/list` answer seen since the gateway started), the
//!   client's `Mcp-Param-*` headers are left out, whether or not a guard
//!   changed the call (and on requests without the revision's routing
//!   headers too): what an upstream reads from them is never what the
//!   client wrote unjudged. An upstream that requires them refuses the call;
//!   the official SDK clients then list the tools and send it again.

use crate::json::{self, Json};
use base64::Engine;
use http::{HeaderMap, HeaderValue};
use rmcp::model::{ErrorCode, ErrorData};

/// The revision's code for routing headers that disagree with the body.
pub const HEADER_MISMATCH: ErrorCode = ErrorCode(-32020);

const METHOD: &str = "mcp-method";
const NAME: &str = "mcp-name";
const PARAM_PREFIX: &str = "mcp-param-";

/// Whether the request carries any routing header (the 2026-07-28 revision).
pub fn present(headers: &HeaderMap) -> bool {
    headers.contains_key(METHOD)
        || headers.contains_key(NAME)
        || headers.keys().any(|k| k.as_str().starts_with(PARAM_PREFIX))
}

/// `headers` without the routing headers: those of a message the gateway
/// sends the upstream itself (its answer to a server request), which
/// name no method of the client's.
pub fn without(headers: &HeaderMap) -> HeaderMap {
    let mut headers = headers.clone();
    let routing: Vec<_> = headers
        .keys()
        .filter(|k| {
            let k = k.as_str();
            k == METHOD || k == NAME || k.starts_with(PARAM_PREFIX)
        })
        .cloned()
        .collect();
    for name in routing {
        headers.remove(name);
    }
    headers
}

/// The parameter `method` names in `Mcp-Name`, if any.
fn named_param(method: &str) -> Option<&'static str> {
    match method {
        "tools/call" | "prompts/get" => Some("name"),
        "resources/read" => Some("uri"),
        _ => None,
    }
}

/// A header value as the revision writes it: plain visible ASCII, or
/// `=?base64?PAYLOAD?=` for anything else.
pub fn decode(value: &HeaderValue) -> Option<String> {
    let text = value.to_str().ok()?;
    match text
        .strip_prefix("=?base64?")
        .and_then(|rest| rest.strip_suffix("?="))
    {
        Some(payload) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(payload)
                .ok()?;
            String::from_utf8(bytes).ok()
        }
        None => Some(text.to_owned()),
    }
}

/// `text` as a header value: itself when it is visible ASCII, else the
/// base64 form.
pub fn encode(text: &str) -> Option<HeaderValue> {
    let plain = !text.is_empty()
        && text.trim() == text
        && text.bytes().all(|b| (0x20..0x7f).contains(&b))
        && !text.starts_with("=?");
    if plain {
        return HeaderValue::from_str(text).ok();
    }
    let payload = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
    HeaderValue::from_str(&format!("=?base64?{payload}?=")).ok()
}

/// The one value of header `name`; an error when it is repeated (readers
/// of the first and of the last copy would disagree).
fn single<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a HeaderValue>, String> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(format!(
            "guardmesh: the {name} header appears more than once"
        ));
    }
    Ok(first)
}

/// Checks the routing headers against a single request the gateway read:
/// its `method` and, for the methods that have one, the named parameter's
/// value. `None` for a request without routing headers.
pub fn check(headers: &HeaderMap, method: &str, named: Option<&str>) -> Result<(), ErrorData> {
    let mismatch = |message: String| ErrorData::new(HEADER_MISMATCH, message, None);
    let header_method = single(headers, METHOD).map_err(mismatch)?;
    let header_name = single(headers, NAME).map_err(mismatch)?;
    if let Some(value) = header_method
        && value.to_str().ok() != Some(method)
    {
        return Err(mismatch(format!(
            "guardmesh: the Mcp-Method header does not match the request's method {method:?}"
        )));
    }
    if let Some(value) = header_name {
        let Some(param) = named_param(method) else {
            return Err(mismatch(format!(
                "guardmesh: an Mcp-Name header on {method:?}, which names nothing"
            )));
        };
        if decode(value).as_deref() != named {
            return Err(mismatch(format!(
                "guardmesh: the Mcp-Name header does not match the request's params.{param}"
            )));
        }
    } else if header_method.is_some() && named.is_some() {
        return Err(mismatch(format!(
            "guardmesh: Mcp-Method {method:?} without the Mcp-Name header its request needs"
        )));
    }
    Ok(())
}

/// Checks the routing headers against a request the gateway forwards as
/// read (not a `tools/call`): its method and named parameter are read from
/// the gateway's own serialization.
pub fn check_text(headers: &HeaderMap, text: &str) -> Result<(), ErrorData> {
    let Ok(read) = json::read(text) else {
        return Ok(());
    };
    let method = read.value.get("method").and_then(Json::as_str);
    let Some(method) = method else {
        // A response to the server: it has no method to route on.
        if present(headers) {
            return Err(ErrorData::new(
                HEADER_MISMATCH,
                "guardmesh: routing headers on a message that is not a request",
                None,
            ));
        }
        return Ok(());
    };
    let named = named_param(method).and_then(|param| {
        read.value
            .get("params")
            .and_then(|p| p.get(param))
            .and_then(Json::as_str)
    });
    check(headers, method, named)
}

/// The `x-mcp-header` declarations of the upstream's tools, read from the
/// `tools/list` answers the gateway relays: tool name, then (header name,
/// path of the argument under `arguments`).
#[derive(Default)]
pub struct ParamHeaders {
    tools: std::sync::Mutex<std::collections::HashMap<String, Declarations>>,
}

type Declarations = Vec<(String, Vec<String>)>;

/// Tools remembered at most (a listing beyond it is not remembered).
const MAX_TOOLS: usize = 4096;

impl ParamHeaders {
    /// Remembers the declarations of the tools in `message`, one JSON-RPC
    /// message or an array of them (a `tools/list` answer).
    pub fn learn(&self, message: &str) {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(message) else {
            return;
        };
        let messages = match value {
            serde_json::Value::Array(many) => many,
            one => vec![one],
        };
        let Ok(mut tools) = self.tools.lock() else {
            return;
        };
        for message in &messages {
            let Some(listed) = message.pointer("/result/tools").and_then(|t| t.as_array()) else {
                continue;
            };
            for tool in listed {
                let Some(name) = tool.get("name").and_then(|n| n.as_str()) else {
                    continue;
                };
                let mut found = Vec::new();
                if let Some(schema) = tool.get("inputSchema") {
                    declarations(schema, &mut Vec::new(), &mut found);
                }
                if tools.len() < MAX_TOOLS || tools.contains_key(name) {
                    tools.insert(name.to_owned(), found);
                }
            }
        }
    }

    fn of(&self, tool: &str) -> Option<Declarations> {
        self.tools.lock().ok()?.get(tool).cloned()
    }
}

/// The `x-mcp-header` declarations under `schema`'s `properties` chain.
fn declarations(schema: &serde_json::Value, path: &mut Vec<String>, out: &mut Declarations) {
    if let Some(header) = schema.get("x-mcp-header").and_then(|h| h.as_str())
        && !path.is_empty()
    {
        out.push((header.to_owned(), path.clone()));
    }
    if let Some(properties) = schema.get("properties").and_then(|p| p.as_object()) {
        for (key, child) in properties {
            path.push(key.clone());
            declarations(child, path, out);
            path.pop();
        }
    }
}

/// An argument as the revision writes it in a header: a string as itself,
/// a boolean as `true`/`false`, a number in decimal (integers beyond 2^53
/// and other values: none).
fn param_text(value: &serde_json::Value) -> Option<String> {
    const SAFE: f64 = 9_007_199_254_740_991.0;
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        serde_json::Value::Number(n) => {
            let f = n.as_f64()?;
            if !f.is_finite() || (f.fract() == 0.0 && f.abs() > SAFE) {
                None
            } else if f.fract() == 0.0 {
                Some(format!("{}", f as i64))
            } else {
                Some(format!("{f}"))
            }
        }
        _ => None,
    }
}

/// The headers of a `tools/call` forwarded as `forwarded` (the gateway's
/// text of the final call) when the client sent it as `original`:
/// `Mcp-Name` from the final tool, and the client's `Mcp-Param-*` headers
/// written from the final arguments (see the module's documentation).
pub fn for_final_call(
    headers: &HeaderMap,
    original: &str,
    forwarded: &str,
    declared: &ParamHeaders,
) -> HeaderMap {
    let mut headers = headers.clone();
    let call = serde_json::from_str::<serde_json::Value>(forwarded).ok();
    let tool = call
        .as_ref()
        .and_then(|c| c.pointer("/params/name"))
        .and_then(|n| n.as_str());
    let sent: Vec<_> = headers
        .keys()
        .filter(|k| k.as_str().starts_with(PARAM_PREFIX))
        .cloned()
        .collect();
    let known = tool.and_then(|tool| declared.of(tool));
    if let Some(known) = known {
        let arguments = call.as_ref().and_then(|c| c.pointer("/params/arguments"));
        for name in sent {
            let header = &name.as_str()[PARAM_PREFIX.len()..];
            let value = known
                .iter()
                .find(|(declared, _)| declared.eq_ignore_ascii_case(header))
                .and_then(|(_, path)| path.iter().try_fold(arguments?, |node, key| node.get(key)))
                .and_then(param_text)
                .and_then(|text| encode(&text));
            headers.remove(&name);
            if let Some(value) = value {
                headers.insert(name, value);
            }
        }
    } else {
        // Nothing to write them from: never forwarded as sent.
        for name in sent {
            headers.remove(name);
        }
    }
    if original != forwarded && headers.contains_key(NAME) {
        match tool.and_then(encode) {
            Some(value) => {
                headers.insert(NAME, value);
            }
            None => {
                headers.remove(NAME);
            }
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    #[test]
    fn r31_routing_headers_must_match_the_body_that_was_judged() {
        let ok = headers(&[("mcp-method", "tools/call"), ("mcp-name", "read_file")]);
        assert!(check(&ok, "tools/call", Some("read_file")).is_ok());
        // The router would see read_file; the server would run delete_file.
        let err = check(&ok, "tools/call", Some("delete_file")).unwrap_err();
        assert_eq!(err.code, HEADER_MISMATCH);
        assert!(err.message.contains("Mcp-Name"), "{}", err.message);
        let err = check(&ok, "ping", None).unwrap_err();
        assert!(err.message.contains("Mcp-Method"), "{}", err.message);
        // Repeated, missing, or on a method that names nothing.
        let twice = headers(&[
            ("mcp-method", "tools/call"),
            ("mcp-name", "a"),
            ("mcp-name", "b"),
        ]);
        assert!(check(&twice, "tools/call", Some("a")).is_err());
        let missing = headers(&[("mcp-method", "tools/call")]);
        assert!(check(&missing, "tools/call", Some("a")).is_err());
        let stray = headers(&[("mcp-method", "ping"), ("mcp-name", "x")]);
        assert!(check(&stray, "ping", None).is_err());
        // Without routing headers (the 2025-11-25 revision), nothing to check.
        assert!(check(&HeaderMap::new(), "tools/call", Some("a")).is_ok());
    }

    #[test]
    fn r31_header_values_in_base64_are_compared_decoded() {
        let name = "écrire";
        let value = encode(name).unwrap();
        assert!(value.to_str().unwrap().starts_with("=?base64?"));
        assert_eq!(decode(&value).as_deref(), Some(name));
        let h = headers(&[
            ("mcp-method", "tools/call"),
            ("mcp-name", value.to_str().unwrap()),
        ]);
        assert!(check(&h, "tools/call", Some(name)).is_ok());
        assert!(check(&h, "tools/call", Some("ecrire")).is_err());
    }

    #[test]
    fn r31_a_rewritten_call_is_forwarded_with_headers_of_the_final_call() {
        let h = headers(&[
            ("mcp-method", "tools/call"),
            ("mcp-name", "read_file"),
            ("mcp-param-path", "/etc/shadow"),
            ("authorization", "Bearer t"),
        ]);
        let original = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file","arguments":{"path":"/etc/shadow"}}}"#;
        let rewritten = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_redacted","arguments":{"path":"/redacted"}}}"#;
        let unknown = ParamHeaders::default();
        let out = for_final_call(&h, original, rewritten, &unknown);
        assert_eq!(out.get("mcp-name").unwrap(), "read_redacted");
        assert!(out.get("mcp-param-path").is_none());
        assert_eq!(out.get("authorization").unwrap(), "Bearer t");
        // Unchanged, but the tool's declarations are unknown: the client's
        // Mcp-Param-* headers are never forwarded as sent (R31).
        let out = for_final_call(&h, original, original, &unknown);
        assert!(out.get("mcp-param-path").is_none(), "{out:?}");
        assert_eq!(out.get("mcp-name").unwrap(), "read_file");
        // Without the revision's routing headers (2025-11-25) too.
        let old = headers(&[
            ("mcp-param-path", "/etc/shadow"),
            ("authorization", "Bearer t"),
        ]);
        let out = for_final_call(&old, original, original, &unknown);
        assert!(out.get("mcp-param-path").is_none(), "{out:?}");
        assert_eq!(out.get("authorization").unwrap(), "Bearer t");
    }

    #[test]
    fn r31_mirrored_params_are_written_from_the_final_call() {
        let declared = ParamHeaders::default();
        declared.learn(
            &serde_json::json!({"jsonrpc": "2.0", "id": 1, "result": {"tools": [
                {"name": "read_file", "inputSchema": {"type": "object", "properties": {
                    "path": {"type": "string", "x-mcp-header": "Path"},
                    "opts": {"type": "object", "properties": {
                        "depth": {"type": "integer", "x-mcp-header": "Depth"}}},
                    "list": {"type": "array", "items": {"x-mcp-header": "Item"}}
                }}}
            ]}})
            .to_string(),
        );
        let h = headers(&[
            ("mcp-method", "tools/call"),
            ("mcp-name", "read_file"),
            ("mcp-param-path", "/etc/shadow"),
            ("mcp-param-depth", "3"),
            ("mcp-param-item", "x"),
        ]);
        let original = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file","arguments":{"path":"/etc/shadow","opts":{"depth":3}}}}"#;
        let rewritten = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file","arguments":{"path":"/redacted","opts":{"depth":1.0}}}}"#;
        let out = for_final_call(&h, original, rewritten, &declared);
        assert_eq!(out.get("mcp-param-path").unwrap(), "/redacted");
        assert_eq!(out.get("mcp-param-depth").unwrap(), "1");
        // Declared under `items`: not a mirrored parameter.
        assert!(out.get("mcp-param-item").is_none());
        // A header the client sent that disagrees with an unchanged call is
        // written from the call as judged.
        let stale = headers(&[
            ("mcp-method", "tools/call"),
            ("mcp-name", "read_file"),
            ("mcp-param-path", "/home/a"),
        ]);
        let out = for_final_call(&stale, original, original, &declared);
        assert_eq!(out.get("mcp-param-path").unwrap(), "/etc/shadow");
        // The final call lacks the argument: the header is left out; none is
        // added that the client did not send.
        let without = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file","arguments":{}}}"#;
        let out = for_final_call(&stale, original, without, &declared);
        assert!(out.get("mcp-param-path").is_none());
        assert!(out.get("mcp-param-depth").is_none());
        // Values that are not plain visible ASCII are written in base64.
        let spaced = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file","arguments":{"path":" /x"}}}"#;
        let out = for_final_call(&stale, original, spaced, &declared);
        let value = out.get("mcp-param-path").unwrap();
        assert!(value.to_str().unwrap().starts_with("=?base64?"));
        assert_eq!(decode(value).as_deref(), Some(" /x"));
    }
}
