//! Reloading the policy files of the config's policy guards (R27): on
//! SIGHUP, and when a file changes on disk.
//!
//! Either way a file is read whole and compiled before anything changes: a
//! file that cannot be read or does not compile is refused, the running
//! policy is kept, and the refusal is logged and counted
//! (`guardmesh_policy_reloads_total{outcome="refused"}`), like an applied
//! reload (`outcome="applied"`).
//!
//! The watch is on the files' folders, not on the files, so that a file
//! replaced by a rename (as editors and deployment tools write) is seen as
//! well as one written in place. Changes are debounced: a reload happens
//! once the folder has been quiet for [`QUIET`], so a file written in
//! several steps is read once, when done. A change that leaves a file's
//! text as the running policy's is not a reload.

use guardmesh_server::Mesh;
use guardmesh_server::config::GuardConfig;
use notify::{EventKind, RecursiveMode, Watcher};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long a watched folder must be quiet before changed files are read.
pub(crate) const QUIET: Duration = Duration::from_millis(200);

/// The policy file of a config guard, relative to the config's folder.
fn policy_file(folder: &Path, guard: &GuardConfig) -> Option<PathBuf> {
    guard.policy.as_ref().map(|f| folder.join(f))
}

/// Why a reload was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trigger {
    /// SIGHUP: reload whatever the file holds.
    Signal,
    /// The file changed on disk: reload unless its text is the running one.
    Change,
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
    let loaded = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))
        .and_then(|source| {
            guardmesh_server::policy::Policy::compile(&source)
                .map(|_| source)
                .map_err(|e| format!("{}: {e}", file.display()))
        });
    if trigger == Trigger::Change
        && let Ok(source) = &loaded
        && running.as_deref() == Some(source.as_str())
    {
        return;
    }
    let result = match loaded {
        Ok(source) => {
            guard.policy_source = Some(source);
            mesh.registry()
                .register(guard.to_spec())
                .await
                .map_err(|e| e.to_string())
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
        }
        Err(error) => {
            mesh.metrics.policy_reload("refused");
            tracing::warn!(guard = %name, %error, on = how, "policy reload refused; the running policy is kept");
        }
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
                if matches!(
                    event.kind,
                    EventKind::Create(_) | EventKind::Modify(_) | EventKind::Remove(_)
                ) {
                    for path in event.paths {
                        let _ = tx.send(path);
                    }
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
