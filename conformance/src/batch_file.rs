//! The batch input of `guardmesh evaluate` and of `guardmesh conformance
//! --batch`: one JSON batch, or several separated by whitespace (JSON Lines).

use guardmesh_proto::v1::{ToolCall, ToolResult};
use serde_json::value::RawValue;

/// One batch of the input.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchInput {
    #[serde(default)]
    pub session_id: String,
    #[serde(default)]
    pub turn_index: u32,
    #[serde(default)]
    pub model_text: String,
    #[serde(default)]
    pub metadata: std::collections::HashMap<String, String>,
    #[serde(default)]
    pub calls: Vec<CallInput>,
    /// Results of calls that ran (R33), judged before the model reads them.
    #[serde(default)]
    pub results: Vec<ResultInput>,
}

/// One result of a batch (R33): the MCP `CallToolResult` of a call that
/// ran, kept as the exact text given.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResultInput {
    call_id: String,
    tool: String,
    /// The server or namespace the tool belongs to.
    #[serde(default)]
    server: String,
    result: Box<RawValue>,
}

impl ResultInput {
    /// The result as the mesh is sent it.
    pub fn into_result(self) -> ToolResult {
        ToolResult {
            call_id: self.call_id,
            tool: self.tool,
            server: self.server,
            result: self.result.get().to_owned(),
        }
    }
}

/// One call of a batch. The arguments are kept as the exact text given, so
/// the mesh judges (and refuses, R20) what was written, not a re-encoding.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallInput {
    call_id: String,
    tool: String,
    #[serde(default)]
    arguments: Option<Box<RawValue>>,
}

impl CallInput {
    /// The call as the mesh is sent it.
    pub fn into_call(self) -> ToolCall {
        ToolCall {
            call_id: self.call_id,
            tool: self.tool,
            arguments: self
                .arguments
                .map(|a| a.get().to_owned())
                .unwrap_or_default(),
        }
    }
}

/// Reads the input: one JSON object, or several separated by whitespace
/// (JSON Lines: one batch per line). `source` names the input in errors.
pub fn parse_batches(text: &str, source: &str) -> Result<Vec<BatchInput>, String> {
    let mut batches = Vec::new();
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<&RawValue>();
    loop {
        let start = stream.byte_offset();
        let Some(next) = stream.next() else { break };
        let n = batches.len() + 1;
        let line = |offset: usize| {
            let skipped = text[offset.min(text.len())..]
                .bytes()
                .take_while(u8::is_ascii_whitespace)
                .filter(|b| *b == b'\n')
                .count();
            text[..offset.min(text.len())].matches('\n').count() + skipped + 1
        };
        let raw = next.map_err(|e| format!("{source} is not a batch (batch {n}): {e}"))?;
        let batch: BatchInput = serde_json::from_str(raw.get()).map_err(|e| {
            format!(
                "{source} is not a batch (batch {n}, line {}): {e}",
                line(start)
            )
        })?;
        batches.push(batch);
    }
    if batches.is_empty() {
        return Err(format!("{source} is not a batch: no JSON object in it"));
    }
    Ok(batches)
}
