//! Decision logs on disk (R29): a fresh folder per test, the records a
//! log holds read back as JSON, and the policies the log tests judge with.

use super::TestMesh;
use guardmesh_server::decision_log::{DecisionLog, LogConfig, MeshLog, OnLogFailure, segment};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A fresh folder for one test's log.
pub(crate) fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("guardmesh-declog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every line of the log in `dir`, in order, across its segment files.
pub(crate) fn log_lines(dir: &Path) -> Vec<String> {
    segment::list(dir)
        .unwrap()
        .into_iter()
        .flat_map(|(_, file)| {
            std::fs::read_to_string(file)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every record of the log in `dir`, in order, across its segment files.
pub(crate) fn records(dir: &Path) -> Vec<Value> {
    log_lines(dir)
        .iter()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .collect()
}

impl TestMesh {
    /// Opens the decision log `config` describes and attaches it to the
    /// mesh, which does `on_failure` when a record cannot be written.
    pub(crate) async fn attach_log(&self, config: LogConfig, on_failure: OnLogFailure) {
        let log = DecisionLog::open(config).await.unwrap();
        self.mesh
            .attach_decision_log(MeshLog::new(log, on_failure, self.mesh.metrics.clone()))
            .unwrap();
    }
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
