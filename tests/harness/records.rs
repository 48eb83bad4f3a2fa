//! Decision logs on disk (R29): a fresh folder per test and the records a
//! log holds, read back as JSON.

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
