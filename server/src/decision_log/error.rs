//! What can go wrong when the decision log is opened or written (R29).
//!
//! The error is `Clone`: one failed write fails every record of the group
//! that was being committed, and each waiting batch gets its own copy.

use std::io;
use std::path::{Path, PathBuf};

/// A decision log that could not be opened, or a record that could not be
/// written. The batch path refuses the batch `UNAVAILABLE` on any of these
/// (or answers and counts the loss, if so configured).
#[derive(Debug, Clone, thiserror::Error)]
pub enum LogError {
    /// A file system operation failed.
    #[error("decision log: cannot {op} {path}: {message}")]
    Io {
        /// What was being done ("write", "fsync", "create", ...).
        op: &'static str,
        path: PathBuf,
        kind: io::ErrorKind,
        message: String,
    },
    /// The last record of an existing log is incomplete or damaged, so the
    /// chain cannot be continued. Nothing is repaired automatically: the
    /// operator checks the log (`verify`) and moves the file aside or
    /// truncates it at `offset`, the end of the last intact record.
    #[error(
        "decision log: cannot resume {path}: line {line} {reason}; check it with `guardmesh log verify`, \
         then move the file aside or truncate it to {offset} bytes (the end of the last intact record)"
    )]
    CorruptTail {
        path: PathBuf,
        line: u64,
        offset: u64,
        reason: String,
    },
    /// An earlier failure left the file in a state the writer cannot vouch
    /// for (a failed fsync, or a failed write it could not undo). Every
    /// later record fails until the mesh is restarted, which re-checks the
    /// tail of the log.
    #[error("decision log stopped after an earlier failure ({reason}); restart the mesh to resume")]
    Poisoned { reason: String },
    /// The log ends before the latest checkpoint known outside its files
    /// (the directory's `checkpoint.state`, or the witness): records were
    /// cut or files removed. The mesh does not continue such a chain
    /// silently: restore the missing files, or set `allow_gap = true` to go
    /// on after a signed `gap` record that names what is missing.
    #[error(
        "decision log: {dir} does not hold the latest checkpoint known from the {source_name} \
         (seq {seq}, hash {hash}, written {time}); the log's next record would be seq {next_seq} \
         ({missing}): records were cut from its end or files removed, or the log rewritten. \
         Restore them, or set [decision_log] allow_gap = true to continue after a signed gap record",
        missing = behind_by(*seq, *next_seq)
    )]
    Behind {
        dir: PathBuf,
        source_name: &'static str,
        seq: u64,
        hash: String,
        time: String,
        next_seq: u64,
    },
    /// The log was closed, or its writer is gone.
    #[error("decision log is closed")]
    Closed,
    /// The settings cannot work (an empty directory name, a zero file size).
    #[error("decision log: {0}")]
    Config(String),
    /// A record could not be serialized (not expected with the record types
    /// of this module).
    #[error("decision log: cannot serialize a record: {0}")]
    Serialize(String),
}

/// What a log behind a checkpoint misses, for [`LogError::Behind`].
fn behind_by(seq: u64, next_seq: u64) -> String {
    if seq >= next_seq {
        format!("{} records missing", seq + 1 - next_seq)
    } else {
        format!("the record at seq {seq} is not that checkpoint")
    }
}

impl LogError {
    pub(crate) fn io(op: &'static str, path: &Path, err: &io::Error) -> Self {
        LogError::Io {
            op,
            path: path.to_path_buf(),
            kind: err.kind(),
            message: err.to_string(),
        }
    }
}
