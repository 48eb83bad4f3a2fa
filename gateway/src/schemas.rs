//! Output schemas taken out of the upstream's `tools/list` results, so that
//! every answer the gateway makes is one the official MCP SDK clients
//! accept, for every tool (R31).
//!
//! A tool that declares an `outputSchema` binds its server to answer every
//! non-error result with `structuredContent` that conforms to it, and the
//! official clients check: the TypeScript SDK's `callTool` throws
//! (`-32600 ... has an output schema but did not return structured
//! content`), the Python SDK's `call_tool` raises. A cancel (R31) is a tool
//! result with `isError: false` holding the guard's text, so that the model
//! reads "not allowed, move on" rather than "failed, try again": it has no
//! structured content, and none can be made up that conforms to an
//! arbitrary schema and still says what the guard said.
//!
//! The gateway is the server its clients see, so it lists the upstream's
//! tools without their output schemas. What that costs: a client no longer
//! learns the shape of a tool's structured output from `tools/list` (it
//! still receives the `structuredContent` of every call that ran, but does
//! not validate it). What the alternative would have cost: answering a
//! cancel with `isError: true` for the tools that declare a schema would
//! make a cancel read as a steer ("fix it and retry") for exactly those
//! tools, and a model would retry what it may not do.
//!
//! Only the upstream's answers to the client's `tools/list` requests are
//! changed (matched by request id), and in them only the `outputSchema` of
//! each tool, under any spelling Go's `encoding/json` takes for it; the rest
//! is re-serialized as the gateway reads it.

use crate::json::{self, Json};
use guardmesh_client::casefold;

/// The `tools` arrays of `message`, a response to a `tools/list` request,
/// under any spelling Go's `encoding/json` takes for `result` and `tools`.
pub(crate) fn tool_lists(message: &mut Json) -> impl Iterator<Item = &mut Vec<Json>> {
    let members = match message {
        Json::Object(members) => Some(members),
        _ => None,
    };
    members
        .into_iter()
        .flatten()
        .filter(|(key, _)| casefold::equal_fold(key, "result"))
        .filter_map(|(_, result)| match result {
            Json::Object(result) => Some(result),
            _ => None,
        })
        .flatten()
        .filter(|(key, _)| casefold::equal_fold(key, "tools"))
        .filter_map(|(_, tools)| match tools {
            Json::Array(tools) => Some(tools),
            _ => None,
        })
}

/// `message` (a response to a `tools/list` request) without the output
/// schemas of its tools; `None` when it holds none (forward it unchanged)
/// or cannot be read (the client's SDK will refuse it as it would have).
pub fn without_output_schemas(message: &str) -> Option<String> {
    let mut value = json::read(message).ok()?.value;
    let mut removed = 0;
    for tools in tool_lists(&mut value) {
        for tool in tools {
            if let Json::Object(fields) = tool {
                let before = fields.len();
                fields.retain(|(name, _)| !casefold::equal_fold(name, "outputSchema"));
                removed += before - fields.len();
            }
        }
    }
    (removed > 0).then(|| value.to_text())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r31_output_schemas_are_removed_from_each_tool_and_nothing_else() {
        let listed = r#"{"jsonrpc":"2.0","id":3,"result":{"tools":[
            {"name":"write_file","inputSchema":{"type":"object"},"outputSchema":{"type":"object","properties":{"content":{"type":"string"}}}},
            {"name":"echo","inputSchema":{"type":"object"},"annotations":{"outputSchema":"kept: not a tool field"}}
        ],"nextCursor":"c2"}}"#;
        let out = without_output_schemas(listed).expect("a schema to remove");
        let value: serde_json::Value = serde_json::from_str(&out).unwrap();
        let tools = value["result"]["tools"].as_array().unwrap();
        assert!(tools[0].get("outputSchema").is_none(), "{out}");
        assert_eq!(tools[0]["name"], "write_file");
        assert_eq!(tools[0]["inputSchema"]["type"], "object");
        assert_eq!(
            tools[1]["annotations"]["outputSchema"],
            "kept: not a tool field"
        );
        assert_eq!(value["result"]["nextCursor"], "c2");
        assert_eq!(value["id"], 3);
    }

    #[test]
    fn r31_every_spelling_a_peer_reads_as_output_schema_is_removed() {
        // Escaped, and case-folded as Go's encoding/json matches members.
        for key in [
            r"output\u0053chema",
            "OutputSchema",
            "outputschema",
            "outputſchema",
        ] {
            let listed = format!(
                r#"{{"jsonrpc":"2.0","id":1,"result":{{"tools":[{{"name":"t","inputSchema":{{}},"{key}":{{"type":"object"}}}}]}}}}"#
            );
            let out = without_output_schemas(&listed).unwrap_or_else(|| panic!("{key}"));
            assert!(
                !out.to_ascii_lowercase().contains("schema\":{\"type"),
                "{key}: {out}"
            );
        }
    }

    #[test]
    fn r31_a_list_without_output_schemas_is_forwarded_as_it_came() {
        let listed =
            r#"{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"t","inputSchema":{}}]}}"#;
        assert_eq!(without_output_schemas(listed), None);
        assert_eq!(without_output_schemas("not json"), None);
    }
}
