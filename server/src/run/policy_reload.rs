//! Reloading the policy files of the config's policy guards (R27): on
//! SIGHUP, and when a file changes on disk.
//!
//! Either way a file is read whole and compiled before anything changes: a
//! file that cannot be read or does not compile is refused, the running
//! policy is kept, and the refusal is logged and counted
//! (`guardmesh_policy_reloads_total{outcome="refused"}`), like an applied
//! reload (`outcome="applied"`).
//!
//! Only a regular file of at most [`MAX_POLICY_FILE_BYTES`] is read: a
//! FIFO, a device (a link to `/dev/zero`), a folder or a larger (sparse)
//! file is refused before a byte of it is read, and the file is opened
//! non-blocking, so that a FIFO put in its place cannot hold the reload.
//! Reading and compiling run on a blocking thread, never on the threads
//! that judge batches.
//!
//! The watch is on the files' folders, not on the files, so that a file
//! replaced by a rename (as editors and deployment tools write) is seen as
//! well as one written in place. Only a complete file is applied: a reload
//! follows a file *closed after writing* (inotify `IN_CLOSE_WRITE`), a file
//! *renamed into place*, or a new link or special file put in its place,
//! never a write still under way. Changes are then debounced: a reload
//! happens once the folder has been quiet for [`QUIET`]. A change that
//! leaves a file's text as the running policy's is not a reload.

use crate::Mesh;
use crate::config::GuardConfig;
use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long a watched folder must be quiet before changed files are read.
pub(crate) const QUIET: Duration = Duration::from_millis(200);

pub(crate) use crate::files::MAX_POLICY_FILE_BYTES;

/// The policy file of a config guard, relative to the config's folder.
fn policy_file(folder: &Path, guard: &GuardConfig) -> Option<PathBuf> {
    // A loaded config's paths are resolved against its folder already: a
    // relative config path (`examples/flows/mesh.toml`) must not have its
    // folder joined twice.
    guard.policy.as_ref().map(|f| {
        if f.starts_with(folder) {
            f.clone()
        } else {
            folder.join(f)
        }
    })
}

/// Why a reload was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trigger {
    /// SIGHUP: reload whatever the file holds.
    Signal,
    /// The file changed on disk: reload unless its text is the running one.
    Change,
}

/// Why a policy file was not read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is {kind}, not a regular file: a policy is read only from a regular file")]
    NotRegular { path: String, kind: &'static str },
    #[error("{path} holds {size} bytes, more than a policy file may ({limit} bytes)")]
    TooLarge { path: String, size: u64, limit: u64 },
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not UTF-8 text")]
    NotText { path: String },
}

impl ReadError {
    /// The reason label of the refusal's count and log.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::Open { .. } | Self::Read { .. } => "unreadable",
            Self::NotRegular { .. } => "not_regular",
            Self::TooLarge { .. } => "too_large",
            Self::NotText { .. } => "not_text",
        }
    }
}

/// Reads the policy file at `path` (following links): only a regular file
/// of at most `limit` bytes. Opened non-blocking, so that a FIFO never
/// waits for a writer; the type and size are those of the file opened, so
/// that nothing swapped in between a check and the read is read; and no
/// more than `limit` bytes are read, whatever the file grows to meanwhile.
/// Blocking: call it off the runtime's threads.
pub(crate) fn read_policy_file(path: &Path, limit: u64) -> Result<String, ReadError> {
    use crate::files::FileError;
    let shown = || path.display().to_string();
    let bytes = crate::files::read_regular(path, limit).map_err(|error| match error {
        FileError::Open(source) => ReadError::Open {
            path: shown(),
            source,
        },
        FileError::NotRegular { kind } => ReadError::NotRegular {
            path: shown(),
            kind,
        },
        FileError::TooLarge { size, limit } => ReadError::TooLarge {
            path: shown(),
            size,
            limit,
        },
        FileError::Read(source) => ReadError::Read {
            path: shown(),
            source,
        },
    })?;
    String::from_utf8(bytes).map_err(|_| ReadError::NotText { path: shown() })
}

/// Why a reload was refused.
#[derive(Debug, thiserror::Error)]
enum ReloadError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{path}: {error}")]
    Compile { path: String, error: String },
    #[error("{0}")]
    Register(String),
    #[error("the reload's worker stopped: {0}")]
    Worker(String),
}

/// Reads and compiles `file` on a blocking thread (R27, R25: judging never
/// waits on a reload's file or compiler).
async fn load(file: PathBuf) -> Result<String, ReloadError> {
    tokio::task::spawn_blocking(move || {
        let source = read_policy_file(&file, MAX_POLICY_FILE_BYTES)?;
        crate::policy::Policy::compile(&source)
            .map(|_| source)
            .map_err(|e| ReloadError::Compile {
                path: file.display().to_string(),
                error: e.to_string(),
            })
    })
    .await
    .map_err(|e| ReloadError::Worker(e.to_string()))?
}

/// Re-reads a config policy guard's file and registers it again in place
/// (R16: same position); a file that cannot be read or does not compile is
/// refused whole and the running policy is kept (R27), logged and counted.
/// A guard deregistered since the start is not brought back.
pub(crate) async fn reload_policy(
    mesh: &Mesh,
    folder: &Path,
    mut guard: GuardConfig,
    trigger: Trigger,
) {
    let name = guard.name.trim().to_owned();
    let Some(running) = mesh
        .registry()
        .chain()
        .guards
        .iter()
        .find(|g| g.name == name)
        .map(|g| g.policy.as_ref().map(|p| p.source.clone()))
    else {
        return;
    };
    let Some(file) = policy_file(folder, &guard) else {
        return;
    };
    let loaded = load(file).await;
    if trigger == Trigger::Change
        && let Ok(source) = &loaded
        && running.as_deref() == Some(source.as_str())
    {
        return;
    }
    let result = match loaded {
        Ok(source) => {
            guard.policy_source = Some(source);
            let admission = crate::registry::Admission::of(&mesh.config);
            match crate::registry::admit(guard.to_spec(), &admission).await {
                Ok(checked) => mesh
                    .registry()
                    .register(checked, None)
                    .await
                    .map_err(|e| ReloadError::Register(e.to_string())),
                Err(e) => Err(ReloadError::Register(e.to_string())),
            }
        }
        Err(error) => Err(error),
    };
    let how = match trigger {
        Trigger::Signal => "SIGHUP",
        Trigger::Change => "file change",
    };
    match result {
        Ok(registered) => {
            if let Some(log) = mesh.decision_log() {
                log.config_guards(&[guard.to_spec()], registered.revision)
                    .await;
            }
            mesh.metrics.policy_reload("applied");
            tracing::info!(guard = %name, revision = registered.revision, on = how, "policy reloaded");
            // R27: a rule naming a tool the guard is never sent is reported.
            if let Some(source) = &guard.policy_source {
                // Registered just now: compiled, not compiled again here.
                for never in
                    crate::policy::never_sent_compiled(source, &guard.tools).unwrap_or_default()
                {
                    tracing::warn!(guard = %name, "{never}");
                }
            }
        }
        Err(error) => {
            mesh.metrics.policy_reload("refused");
            let reason = match &error {
                ReloadError::Read(read) => read.reason(),
                ReloadError::Compile { .. } => "does_not_compile",
                ReloadError::Register(_) => "not_registered",
                ReloadError::Worker(_) => "worker_failed",
            };
            tracing::warn!(guard = %name, %error, reason, on = how, "policy reload refused; the running policy is kept");
        }
    }
}

/// The paths of `event` whose file may now be complete: closed after
/// writing, renamed into place, or created as something other than a
/// regular file (a link or a FIFO put in a policy file's place, which no
/// close will follow). Writes still under way (`IN_MODIFY`, the creation
/// of a regular file) are not.
fn completed(event: notify::Event) -> Vec<PathBuf> {
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => event.paths,
        // A rename's destination is its last path.
        EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => {
            event.paths.into_iter().last().into_iter().collect()
        }
        EventKind::Create(_) => event
            .paths
            .into_iter()
            .filter(|path| {
                std::fs::symlink_metadata(path).is_ok_and(|meta| !meta.file_type().is_file())
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Watches the policy files of `guards` and reloads each when it changes,
/// until the returned watcher is dropped. Fails when a folder cannot be
/// watched.
pub(crate) fn watch(
    mesh: Arc<Mesh>,
    folder: PathBuf,
    guards: Vec<GuardConfig>,
) -> Result<notify::RecommendedWatcher, notify::Error> {
    let (tx, mut rx) = mpsc::unbounded_channel::<PathBuf>();
    let mut watcher =
        notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(event) => {
                for path in completed(event) {
                    let _ = tx.send(path);
                }
            }
            Err(error) => tracing::warn!(%error, "watching the policy files"),
        })?;
    let files: Vec<(PathBuf, GuardConfig)> = guards
        .into_iter()
        .filter_map(|g| Some((absolute(&policy_file(&folder, &g)?), g)))
        .collect();
    let folders: HashSet<PathBuf> = files
        .iter()
        .filter_map(|(file, _)| file.parent().map(Path::to_path_buf))
        .collect();
    for dir in &folders {
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
    }
    tokio::spawn(async move {
        let mut changed: HashSet<PathBuf> = HashSet::new();
        loop {
            // Wait for a change, then for QUIET without one.
            let Some(path) = rx.recv().await else { return };
            changed.insert(path);
            loop {
                match tokio::time::timeout(QUIET, rx.recv()).await {
                    Ok(Some(path)) => {
                        changed.insert(path);
                    }
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            for (file, guard) in &files {
                if changed.contains(file) {
                    reload_policy(&mesh, &folder, guard.clone(), Trigger::Change).await;
                }
            }
            changed.clear();
        }
    });
    Ok(watcher)
}

/// `path` made absolute (the watcher reports absolute paths), without
/// resolving links: a linked file is reloaded when the link is replaced.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "guardmesh-read-policy-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn r27_a_regular_file_within_the_bound_is_read() {
        let path = dir("regular").join("p.toml");
        std::fs::write(&path, "abc").unwrap();
        assert_eq!(read_policy_file(&path, 3).unwrap(), "abc");
        assert!(matches!(
            read_policy_file(&path, 2),
            Err(ReadError::TooLarge { size: 3, .. })
        ));
    }

    #[test]
    fn r27_a_fifo_is_refused_without_waiting_for_a_writer() {
        let path = dir("fifo").join("p.toml");
        let _ = std::fs::remove_file(&path);
        let status = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        let error = read_policy_file(&path, MAX_POLICY_FILE_BYTES).unwrap_err();
        assert!(
            matches!(error, ReadError::NotRegular { kind: "a FIFO", .. }),
            "{error}"
        );
    }

    #[test]
    fn r27_a_link_to_dev_zero_is_refused_before_a_byte_is_read() {
        let path = dir("zero").join("p.toml");
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let error = read_policy_file(&path, MAX_POLICY_FILE_BYTES).unwrap_err();
        assert_eq!(error.reason(), "not_regular", "{error}");
    }

    #[test]
    fn r27_a_sparse_file_over_the_bound_is_refused_by_its_size() {
        let path = dir("sparse").join("p.toml");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(1 << 30).unwrap();
        let error = read_policy_file(&path, MAX_POLICY_FILE_BYTES).unwrap_err();
        assert!(
            matches!(error, ReadError::TooLarge { size, .. } if size == 1 << 30),
            "{error}"
        );
        let _ = std::fs::remove_file(&path);
    }
}
