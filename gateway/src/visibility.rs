//! Tool visibility (`--hide-skipped-tools`): the upstream's `tools/list`
//! answers without the tools the mesh's chain skips whatever a call's
//! arguments (`PreToolService.AlwaysSkipped`: a constant policy rule that
//! steers or cancels the tool, or `unguarded = "cancel"` for a tool no
//! enforced guard applies to), so that a model is not offered what it may
//! never call. Off by default: hiding changes what the model is offered.
//!
//! Hiding is advisory. A hidden tool called anyway is judged as every call
//! is (and skipped). Anything the gateway cannot ask the mesh about is
//! shown, never hidden:
//!
//! * a mesh that cannot be reached, refuses, or does not answer within
//!   [`ASK_TIMEOUT`]: every tool of the answer is shown (and the failure
//!   logged), and the listing is never failed for it;
//! * a tool without a string `name`, a name longer than
//!   [`guardmesh_client::ALWAYS_SKIPPED_MAX_NAME_BYTES`] bytes, and the
//!   names past the first [`guardmesh_client::ALWAYS_SKIPPED_MAX_TOOLS`]
//!   distinct ones of one answer: shown (the gateway never sends the mesh
//!   a request past its bounds, whatever the upstream lists).
//!
//! What the client receives is the gateway's serialization of the answer
//! it read, without the hidden tools' entries; `result.tools` and each
//! tool's `name` are found under any spelling Go's `encoding/json` reads
//! as those names.

use crate::json::{self, Json};
use crate::judge::{Judge, JudgeError};
use guardmesh_client::casefold;
use guardmesh_client::{ALWAYS_SKIPPED_MAX_NAME_BYTES, ALWAYS_SKIPPED_MAX_TOOLS};
use std::collections::HashSet;
use std::time::Duration;

/// How the gateway lists the upstream's tools (flattened into `mcp stdio`
/// and `mcp http`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct VisibilityArgs {
    /// Leaves out of the upstream's tools/list answers the tools the mesh's
    /// chain skips whatever a call's arguments (a policy rule whose `when`
    /// is `true`, or unguarded = "cancel" for tools no guard applies to),
    /// so a model is not offered what it may never call. Advisory: calls
    /// are judged either way; when the mesh cannot be asked, every tool is
    /// listed.
    #[arg(long, env = "GUARDMESH_HIDE_SKIPPED_TOOLS")]
    pub hide_skipped_tools: bool,
}

/// Longest wait for the mesh's answer about one listing; past it every
/// tool of the listing is shown.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// The tools of a `tools/list` answer `message` (the gateway's
/// serialization of a response) the gateway asks the mesh about: each
/// string `name` within the mesh's bounds, once, in listing order, at
/// most as many as the mesh takes.
pub fn asked(message: &Json) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut asked = Vec::new();
    for tool in tools(message) {
        if asked.len() == ALWAYS_SKIPPED_MAX_TOOLS {
            break;
        }
        let Some(name) = name(tool) else { continue };
        if name.len() <= ALWAYS_SKIPPED_MAX_NAME_BYTES && seen.insert(name) {
            asked.push(name.to_owned());
        }
    }
    asked
}

/// The tool entries of a `tools/list` answer.
fn tools(message: &Json) -> impl Iterator<Item = &Json> {
    let list = member(message, "result").and_then(|result| member(result, "tools"));
    match list {
        Some(Json::Array(tools)) => tools.iter(),
        _ => [].iter(),
    }
}

/// The member of `object` named `name` under any spelling Go's
/// `encoding/json` reads as it (the upstream's answer was refused when two
/// of them collide).
fn member<'a>(object: &'a Json, name: &str) -> Option<&'a Json> {
    match object {
        Json::Object(members) => members
            .iter()
            .find(|(k, _)| casefold::equal_fold(k, name))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// A tool entry's name, when it is a string.
fn name(tool: &Json) -> Option<&str> {
    member(tool, "name").and_then(Json::as_str)
}

/// `message` without the tools named in `hidden`; how many were left out.
pub fn without(message: &mut Json, hidden: &HashSet<String>) -> usize {
    let mut removed = 0;
    for tools in crate::schemas::tool_lists(message) {
        let before = tools.len();
        tools.retain(|tool| name(tool).is_none_or(|n| !hidden.contains(n)));
        removed += before - tools.len();
    }
    removed
}

impl Judge {
    /// The `tools/list` answer `message` (the gateway's serialization of
    /// the upstream's response) as the client gets it: without the tools
    /// the chain always skips when `--hide-skipped-tools` is on, else as
    /// it is. Never fails: what cannot be asked is shown.
    pub async fn visible_tools(&self, message: String) -> String {
        if !self.hides_skipped_tools() {
            return message;
        }
        let Ok(read) = json::read(&message) else {
            return message;
        };
        let mut value = read.value;
        let asked = asked(&value);
        if asked.is_empty() {
            return message;
        }
        let count = asked.len();
        let answer = tokio::time::timeout(ASK_TIMEOUT, self.always_skipped(asked)).await;
        let skipped = match answer {
            Ok(Ok(skipped)) => skipped,
            Ok(Err(error)) => {
                tracing::warn!(%error, tools = count, "tools/list relayed whole: the mesh was not asked which tools it always skips");
                return message;
            }
            Err(_) => {
                tracing::warn!(
                    tools = count,
                    "tools/list relayed whole: the mesh did not say within {ASK_TIMEOUT:?} which tools it always skips"
                );
                return message;
            }
        };
        if skipped.is_empty() {
            return message;
        }
        let hidden: HashSet<String> = skipped.into_iter().map(|s| s.tool).collect();
        let removed = without(&mut value, &hidden);
        tracing::debug!(removed, "tools/list: tools the chain always skips left out");
        value.to_text()
    }

    /// Which of `tools` the mesh's chain always skips
    /// (`PreToolService.AlwaysSkipped`), by the mesh in this process or
    /// over gRPC.
    async fn always_skipped(
        &self,
        tools: Vec<String>,
    ) -> Result<Vec<guardmesh_client::proto::SkippedTool>, JudgeError> {
        let refused = |status: tonic::Status| JudgeError::Refused {
            code: status.code(),
            message: status.message().to_owned(),
        };
        if let Some(local) = &self.local_mesh() {
            return local
                .0
                .always_skipped(tools)
                .await
                .map(|answer| answer.tools)
                .map_err(refused);
        }
        let coordinator = self.connected().await?;
        coordinator
            .always_skipped(tools, Some(ASK_TIMEOUT))
            .await
            .map(|answer| answer.tools)
            .map_err(|error| match error {
                guardmesh_client::ClientError::Status(status)
                    if std::error::Error::source(&status).is_none() =>
                {
                    refused(status)
                }
                other => JudgeError::Unreachable {
                    mesh: self.connect_args().mesh.clone(),
                    message: crate::judge::error_chain(&other),
                },
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(tools: &str) -> Json {
        json::read(&format!(
            r#"{{"jsonrpc":"2.0","id":1,"result":{{"tools":[{tools}],"nextCursor":"c"}}}}"#
        ))
        .expect("json")
        .value
    }

    #[test]
    fn r20_a_hostile_listing_is_asked_about_within_the_meshs_bounds() {
        // 100k tools: the first 4,096 distinct names are asked about.
        let many: Vec<String> = (0..100_000)
            .map(|i| format!(r#"{{"name":"t{i}","inputSchema":{{}}}}"#))
            .collect();
        let first = asked(&listing(&many.join(",")));
        assert_eq!(first.len(), ALWAYS_SKIPPED_MAX_TOOLS);
        assert_eq!(first[0], "t0");
        // Huge names, repeats and names that are not strings are not asked.
        let huge = "x".repeat(ALWAYS_SKIPPED_MAX_NAME_BYTES + 1);
        let at = "y".repeat(ALWAYS_SKIPPED_MAX_NAME_BYTES);
        let bounded = asked(&listing(&format!(
            r#"{{"name":"{huge}"}},{{"name":"a"}},{{"name":"a"}},{{"name":7}},{{}},{{"name":"{at}"}}"#
        )));
        assert_eq!(bounded, ["a".to_owned(), at]);
    }

    #[test]
    fn r31_hidden_tools_are_left_out_and_everything_else_is_kept() {
        let mut value = listing(
            r#"{"name":"delete_db","inputSchema":{}},{"name":"read_file","inputSchema":{"type":"object"}},{"name":7}"#,
        );
        let hidden = HashSet::from(["delete_db".to_owned()]);
        assert_eq!(without(&mut value, &hidden), 1);
        let out: serde_json::Value = serde_json::from_str(&value.to_text()).unwrap();
        let names: Vec<&serde_json::Value> = out["result"]["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["name"])
            .collect();
        assert_eq!(
            names,
            [&serde_json::json!("read_file"), &serde_json::json!(7)]
        );
        assert_eq!(out["result"]["nextCursor"], "c");
        assert_eq!(out["id"], 1);
    }

    #[test]
    fn r31_members_go_reads_as_tools_and_name_are_found() {
        let mut value = json::read(
            r#"{"jsonrpc":"2.0","id":1,"result":{"Tools":[{"NAME":"delete_db"},{"name":"keep"}]}}"#,
        )
        .unwrap()
        .value;
        assert_eq!(asked(&value), ["delete_db".to_owned(), "keep".to_owned()]);
        let hidden = HashSet::from(["delete_db".to_owned()]);
        assert_eq!(without(&mut value, &hidden), 1);
        assert!(!value.to_text().contains("delete_db"));
    }
}
