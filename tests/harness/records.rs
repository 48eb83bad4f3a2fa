//! Decision logs on disk (R29): a fresh folder per test, the records a
//! log holds read back as JSON, and the policies the log tests judge with.

use guardmesh_server::decision_log::segment;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A fresh folder for one test's log.
pub(crate) fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("guardmesh-declog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every record of the log in `dir`, in order, across its segment files.
pub(crate) fn records(dir: &Path) -> Vec<Value> {
    segment::list(dir)
        .unwrap()
        .into_iter()
        .flat_map(|(_, file)| {
            std::fs::read_to_string(file)
                .unwrap()
                .lines()
                .map(|line| serde_json::from_str::<Value>(line).unwrap())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Text of a process's output.
pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The decision-log tests' policy: cancels every call of tool `danger`.
pub(crate) const LOG_POLICY: &str = policy_rule!(name: "no-danger", tools: ["danger"], action: "cancel",
    when: r#""true""#,
    message: r#"'"no danger"'"#);

/// A stricter candidate: also cancels `read` calls of paths under /etc.
pub(crate) const LOG_VETO: &str = policy_rule!(name: "no-etc", tools: ["read"], action: "cancel",
    when: r#""has(call.args.path) && call.args.path.startsWith('/etc')""#,
    message: r#"'"not /etc"'"#);
