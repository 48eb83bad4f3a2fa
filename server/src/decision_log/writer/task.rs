//! The writer task: it takes every request waiting as one group, runs the
//! file work on the blocking pool, answers, and syncs and seals on its
//! timers.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::{Appended, Durability, Request, Writer};
use crate::decision_log::checkpoint::SealKind;
use crate::decision_log::error::LogError;
use crate::decision_log::record::Entry;

/// The most appends committed as one group.
const MAX_GROUP: usize = 512;

/// The writer task: groups requests, runs the file work on the blocking
/// pool, answers.
pub(super) async fn run(writer: Writer, mut timers: Timers, mut rx: mpsc::Receiver<Request>) {
    let mut writer = Some(writer);
    loop {
        let first = tokio::select! {
            request = rx.recv() => request,
            () = sleep_until(timers.sync_at), if timers.sync_at.is_some() => {
                timers.sync_at = None;
                let Some(result) = blocking(&mut writer, Writer::sync).await else { return };
                // A failure poisons the writer; the next append reports it.
                let _ = result;
                continue;
            }
            () = sleep_until(timers.seal_at), if timers.seal_at.is_some() => {
                timers.seal_at = None;
                let Some(result) = blocking(&mut writer, |w| w.seal_now(SealKind::Checkpoint("interval"))).await else { return };
                if let Err(error) = result {
                    tracing::error!(%error, "decision log: checkpoint not written");
                }
                continue;
            }
        };
        let Some(first) = first else {
            // Every handle is gone: seal and sync what is written and stop.
            let _ = blocking(&mut writer, |w| w.seal_now(SealKind::Checkpoint("close"))).await;
            let _ = blocking(&mut writer, Writer::sync).await;
            stop_export(&mut writer).await;
            return;
        };
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(request) => group.push(request),
                Err(_) => break,
            }
        }

        let mut pending = Pending::default();
        let mut closing = false;
        for request in group {
            if closing {
                answer_closed(request);
                continue;
            }
            let control = match request {
                Request::Append {
                    entry,
                    masked,
                    reply,
                } => {
                    pending.entries.push((*entry, masked));
                    pending.replies.push(reply);
                    continue;
                }
                control => control,
            };
            // Appends before a sync or close are written first.
            if !pending.flush(&mut writer, &mut timers).await {
                return;
            }
            // A clean shutdown is sealed with a `close` checkpoint.
            if matches!(control, Request::Close(_)) {
                let Some(sealed) =
                    blocking(&mut writer, |w| w.seal_now(SealKind::Checkpoint("close"))).await
                else {
                    return;
                };
                if let Err(error) = sealed {
                    tracing::error!(%error, "decision log: closing checkpoint not written");
                }
            }
            let Some(result) = blocking(&mut writer, Writer::sync).await else {
                return;
            };
            timers.sync_at = None;
            match control {
                Request::Sync(reply) => {
                    let _ = reply.send(result);
                }
                Request::Close(reply) => {
                    // Release the directory before answering, so that the
                    // log can be opened again as soon as `close` returns.
                    stop_export(&mut writer).await;
                    writer = None;
                    let _ = reply.send(result);
                    closing = true;
                }
                Request::Append { .. } => unreachable!("appends are pending"),
            }
        }
        if !pending.flush(&mut writer, &mut timers).await {
            return;
        }
        if closing {
            rx.close();
            while let Some(request) = rx.recv().await {
                answer_closed(request);
            }
            return;
        }
    }
}

/// When the writer task must sync, and seal, by itself.
pub(super) struct Timers {
    durability: Durability,
    /// With checkpoints: the longest a record stays unsealed.
    seal_interval: Option<Duration>,
    /// With `Interval`: when the unsynced writes must be synced.
    sync_at: Option<Instant>,
    /// When the records written since the last checkpoint must be sealed.
    seal_at: Option<Instant>,
}

impl Timers {
    pub(super) fn new(durability: Durability, seal_interval: Option<Duration>) -> Timers {
        Timers {
            durability,
            seal_interval,
            sync_at: None,
            seal_at: None,
        }
    }
}

/// Appends taken from the queue and not yet written.
#[derive(Default)]
struct Pending {
    entries: Vec<(Entry, u32)>,
    replies: Vec<oneshot::Sender<Result<Appended, LogError>>>,
}

impl Pending {
    /// Writes the pending appends as one group and answers them; `false`
    /// if the writer is gone.
    async fn flush(&mut self, writer: &mut Option<Writer>, timers: &mut Timers) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let entries = std::mem::take(&mut self.entries);
        let durability = timers.durability;
        let sync = durability == Durability::EveryRecord;
        let Some(results) = blocking(writer, move |w| w.append(entries, sync)).await else {
            return false;
        };
        let wrote = results.iter().any(Result::is_ok);
        for (reply, result) in self.replies.drain(..).zip(results) {
            let _ = reply.send(result);
        }
        if let Durability::Interval(interval) = durability
            && wrote
            && timers.sync_at.is_none()
        {
            timers.sync_at = Some(Instant::now() + interval);
        }
        if let Some(interval) = timers.seal_interval
            && wrote
            && timers.seal_at.is_none()
        {
            timers.seal_at = Some(Instant::now() + interval);
        }
        true
    }
}

fn answer_closed(request: Request) {
    match request {
        Request::Append { reply, .. } => {
            let _ = reply.send(Err(LogError::Closed));
        }
        Request::Sync(reply) | Request::Close(reply) => {
            let _ = reply.send(Err(LogError::Closed));
        }
    }
}

/// Flushes and stops the OTLP export, if any, off the runtime's threads.
async fn stop_export(writer: &mut Option<Writer>) {
    if let Some(export) = writer.as_mut().and_then(|w| w.export.take()) {
        let _ = tokio::task::spawn_blocking(move || export.shutdown()).await;
    }
    // The closing checkpoint is anchored before the log is released.
    if let Some((publisher, within)) = writer
        .as_mut()
        .and_then(|w| w.anchor.take().map(|p| (p, w.anchor_timeout)))
    {
        publisher.finish(within).await;
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs `work` on the blocking pool with the writer moved there and back.
/// `None` if the work panicked: the writer is gone and the task stops (its
/// handles then see [`LogError::Closed`]).
async fn blocking<T: Send + 'static>(
    slot: &mut Option<Writer>,
    work: impl FnOnce(&mut Writer) -> T + Send + 'static,
) -> Option<T> {
    let mut writer = slot.take()?;
    let (writer, result) = tokio::task::spawn_blocking(move || {
        let result = work(&mut writer);
        (writer, result)
    })
    .await
    .ok()?;
    *slot = Some(writer);
    Some(result)
}
