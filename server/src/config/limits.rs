//! `[limits]`: what coordinators may send (R20).

use super::describe::table;
use crate::validate::Limits;
use serde::Deserialize;

table! {
    /// `[limits]`: what coordinators may send (R20).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct LimitsConfig {
        /// Most calls in one batch.
        pub max_calls_per_batch: usize,
        /// Largest batch, in bytes.
        pub max_batch_bytes: usize,
        /// Largest arguments of one call, in bytes.
        pub max_argument_bytes: usize,
        /// Most batches judged at once in the whole mesh.
        pub max_inflight_batches: usize,
        /// Most batches judged at once on one coordinator stream.
        pub max_batches_per_stream: usize,
        /// Deepest nesting in one call's arguments, 1 to 127.
        pub max_json_depth: usize,
        /// Largest result (its `CallToolResult` JSON text) of one call sent
        /// to be judged (R33).
        pub max_result_bytes: usize,
        /// Longest batch, call or session id, in bytes.
        pub max_id_bytes: usize,
        /// Most metadata entries of one batch.
        pub max_metadata_entries: usize,
        /// Bytes of batches being judged at once in the whole mesh.
        pub max_inflight_bytes: usize,
        /// Bytes of batches being judged at once on one coordinator stream.
        pub max_stream_bytes: usize,
        /// Most coordinator streams open at once.
        pub max_coordinator_streams: usize,
        /// Longest tool name a batch may carry, 1 to 1024.
        pub max_tool_name_chars: usize,
        // Nothing else than printable ASCII can be allowed (R20).
        /// Printable ASCII characters tool names may hold besides letters,
        /// digits, `_`, `-` and `.`.
        pub tool_name_extra_chars: String,
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let l = Limits::default();
        Self {
            max_calls_per_batch: l.max_calls_per_batch,
            max_batch_bytes: l.max_batch_bytes,
            max_argument_bytes: l.max_argument_bytes,
            max_inflight_batches: l.max_inflight_batches,
            max_batches_per_stream: l.max_batches_per_stream,
            max_json_depth: l.max_json_depth,
            max_id_bytes: l.max_id_bytes,
            max_metadata_entries: l.max_metadata_entries,
            max_inflight_bytes: l.max_inflight_bytes,
            max_stream_bytes: l.max_stream_bytes,
            max_coordinator_streams: l.max_coordinator_streams,
            max_tool_name_chars: l.tool_names.max_chars,
            tool_name_extra_chars: String::new(),
            max_result_bytes: l.max_result_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    /// R20: the tool-name grammar is configurable within printable ASCII.
    #[test]
    fn r20_config_tool_name_grammar() {
        let config = Config::parse(
            "[limits]\nmax_tool_name_chars = 16\ntool_name_extra_chars = \"/:\"\n",
            "test",
        )
        .unwrap();
        assert_eq!(config.check(), Ok(()));
        let grammar = config.mesh_config().limits.tool_names;
        assert!(grammar.check("fs/read:v2").is_ok());
        assert!(grammar.check("fs/read:v2-and-more").is_err());
        let default = Config::parse("", "test").unwrap().mesh_config().limits;
        assert_eq!(
            default.tool_names,
            crate::validate::ToolNameGrammar::default()
        );
        for bad in [
            "[limits]\ntool_name_extra_chars = \" \"\n",
            "[limits]\ntool_name_extra_chars = \"\u{200b}\"\n",
            "[limits]\nmax_tool_name_chars = 0\n",
            "[limits]\nmax_tool_name_chars = 5000\n",
        ] {
            let error = crate::config::check_error(bad);
            assert!(
                error.contains("limits.") && error.contains("tool_name"),
                "{error}"
            );
        }
    }

    #[test]
    fn r20_config_max_json_depth_is_checked_and_applied() {
        assert_eq!(Config::default().mesh_config().limits.max_json_depth, 64);
        for (depth, ok) in [(0, false), (1, true), (127, true), (128, false)] {
            let text = format!("[limits]\nmax_json_depth = {depth}");
            let config = Config::parse(&text, "t").unwrap();
            match config.check() {
                Ok(()) => {
                    assert!(ok, "{depth} accepted");
                    assert_eq!(config.mesh_config().limits.max_json_depth, depth);
                }
                Err(error) => {
                    let error = error.to_string();
                    assert!(!ok, "{depth}: {error}");
                    assert!(error.contains("limits.max_json_depth"), "{error}");
                    assert!(error.contains("127"), "{error}");
                }
            }
        }
    }
}
