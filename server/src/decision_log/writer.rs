//! The writer (R29): records appended to JSON Lines files, hash-chained,
//! rotated by size, made durable per record or per interval, each append
//! answered only once its record is written.
//!
//! [`DecisionLog::append`] masks the entry on the caller's task, then hands
//! it to one writer task and waits for its answer. The writer task takes
//! every request waiting at that moment as one group (group commit): it
//! numbers and chains the group's records, writes them with one `write`
//! per file, and, with [`Durability::EveryRecord`], makes them durable with
//! one `fdatasync` for the whole group before answering. Batches that
//! arrive while an fsync is under way form the next group, so concurrent
//! batches share fsyncs instead of queueing one fsync each. With
//! [`Durability::Interval`] a record is answered once written to the file
//! (it survives a crash of the mesh, not of the machine), and the file is
//! synced at most `interval` after its first unsynced write. The file I/O
//! and the serialization run on tokio's blocking pool, never on the
//! caller's runtime threads.
//!
//! Failures:
//!
//! * a write that fails (disk full, I/O error) fails every record of the
//!   group from the first one not written; the file is cut back to the end
//!   of the last record written and the chain continues from it, so a later
//!   append may succeed. If it cannot be cut back, the log is *poisoned*;
//! * a failed fsync poisons the log (after a failed fsync the kernel may
//!   have dropped the unwritten pages, and a second fsync would not say
//!   so): every later append fails with [`LogError::Poisoned`] until the
//!   mesh restarts;
//! * a rotation that cannot create the next file fails the records that
//!   needed it; the next append tries again.
//!
//! A rotated file is always synced, whatever the durability, and the
//! directory is synced after a file is created in it.
//!
//! One writer per directory: the writer holds an advisory lock on the
//! directory's `.lock` file, and a second writer (another mesh process,
//! or the same log opened twice) is refused at open.
//!
//! On open, an existing log is resumed: the writer reads the last record of
//! the last file and continues its chain there, in the same file. If that
//! record is incomplete (a line without its newline, left by a crash in
//! the middle of a write) or does not match its hash, the log is not
//! resumed: [`LogError::CorruptTail`] says where the last intact record
//! ends. Repairing is left to the operator on purpose, so that no record
//! is ever discarded without someone looking at it. The rest of the log is
//! not read on open; verification is `verify`'s job.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use time::format_description::well_known::Rfc3339;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use uuid::Uuid;

use super::anchor::{AnchorClient, AnchorConfig, OutsideFailures, Publisher};
use super::chain::{self, GENESIS, Header};
use super::checkpoint::{self, Known, SealConfig, SealKind, Sealer};
use super::error::LogError;
use super::mask::MaskRules;
use super::record::{Entry, FORMAT_VERSION, Unsealed};
use super::segment;

/// When records are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Each append is answered once its record is on disk (`fdatasync`);
    /// concurrent appends share one fsync.
    EveryRecord,
    /// Each append is answered once its record is written to the file; the
    /// file is synced at most this long after its first unsynced write.
    Interval(Duration),
}

/// The settings of a decision log.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// The directory of the log's files; created if missing.
    pub dir: PathBuf,
    /// The mesh instance, written in every record.
    pub mesh: String,
    /// A file is rotated before a record would take it past this size (a
    /// record larger than this still goes whole into a file of its own).
    pub max_file_bytes: u64,
    pub durability: Durability,
    pub mask: MaskRules,
    /// Appends waiting for the writer before `append` waits to enqueue.
    pub queue: usize,
    /// Also export every record written as an OpenTelemetry log record
    /// over OTLP (see [`super::otlp`]).
    pub otlp: bool,
    /// Signed checkpoints, their witness, and the restart check (see
    /// [`super::checkpoint`]); `None`: no checkpoints.
    pub seal: Option<SealConfig>,
    /// With `seal`: checkpoints are also anchored in etcd, and the log
    /// must hold the anchored one to start (see [`super::anchor`]).
    pub anchor: Option<AnchorConfig>,
}

impl LogConfig {
    /// Defaults: 64 MiB files, fsync per record, no masking.
    pub fn new(dir: impl Into<PathBuf>, mesh: impl Into<String>) -> Self {
        LogConfig {
            dir: dir.into(),
            mesh: mesh.into(),
            max_file_bytes: 64 * 1024 * 1024,
            durability: Durability::EveryRecord,
            mask: MaskRules::none(),
            queue: 1024,
            otlp: false,
            seal: None,
            anchor: None,
        }
    }
}

/// A record written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    pub seq: u64,
    pub id: String,
    /// How many values were masked in it.
    pub masked: u32,
}

/// An open decision log. Cheap to clone; the writer stops when the last
/// clone is dropped (after syncing) or on [`DecisionLog::close`].
#[derive(Debug, Clone)]
pub struct DecisionLog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tx: mpsc::Sender<Request>,
    mask: MaskRules,
    dir: PathBuf,
    failures: Arc<OutsideFailures>,
}

enum Request {
    Append {
        entry: Box<Entry>,
        masked: u32,
        reply: oneshot::Sender<Result<Appended, LogError>>,
    },
    Sync(oneshot::Sender<Result<(), LogError>>),
    Close(oneshot::Sender<Result<(), LogError>>),
}

/// The most appends committed as one group.
const MAX_GROUP: usize = 512;

impl DecisionLog {
    /// Opens (or creates) the log in `config.dir` and starts its writer on
    /// the current tokio runtime. Fails if the directory cannot be created
    /// or written, or if the tail of an existing log is damaged.
    pub async fn open(config: LogConfig) -> Result<DecisionLog, LogError> {
        if config.max_file_bytes == 0 {
            return Err(LogError::Config(
                "max_file_bytes must be above 0".to_owned(),
            ));
        }
        if config.dir.as_os_str().is_empty() {
            return Err(LogError::Config("no directory given".to_owned()));
        }
        if let Durability::Interval(interval) = config.durability
            && interval.is_zero()
        {
            return Err(LogError::Config(
                "a sync interval of 0: use fsync per record instead".to_owned(),
            ));
        }
        let (dir, mesh, max) = (
            config.dir.clone(),
            config.mesh.clone(),
            config.max_file_bytes,
        );
        let export = if config.otlp {
            Some(super::otlp::Export::from_env().map_err(|e| LogError::Config(e.to_string()))?)
        } else {
            None
        };
        let seal = config.seal.clone();
        let seal_interval = seal.as_ref().map(|seal| seal.interval);
        let failures = Arc::new(OutsideFailures::default());
        // The etcd anchor is read before the log is opened, and its
        // publisher started, so that the `open` checkpoint is anchored too.
        let (anchored, publisher) = match (&seal, &config.anchor) {
            (Some(seal), Some(anchor)) => {
                let (known, publisher) = open_anchor(seal, anchor, failures.clone()).await?;
                (known, Some(publisher))
            }
            _ => (None, None),
        };
        let outside = failures.clone();
        let opened = tokio::task::spawn_blocking(move || {
            Writer::open(dir, mesh, max, export, seal, anchored, outside)
        })
        .await
        .map_err(|err| LogError::Config(format!("opening the log panicked: {err}")))?;
        let mut writer = match opened {
            Ok(writer) => writer,
            Err(error) => {
                if let Some(publisher) = publisher {
                    publisher.abort();
                }
                return Err(error);
            }
        };
        if let Some(publisher) = publisher {
            // The `open` checkpoint (or gap) written by `Writer::open`.
            if let Some(line) = &writer.last_seal {
                publisher.offer(line);
            }
            writer.anchor = Some(publisher);
            if let Some(anchor) = &config.anchor {
                writer.anchor_timeout = anchor.etcd.request_timeout;
            }
        }
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        let timers = Timers {
            durability: config.durability,
            seal_interval,
            sync_at: None,
            seal_at: None,
        };
        tokio::spawn(run(writer, timers, rx));
        Ok(DecisionLog {
            inner: Arc::new(Inner {
                tx,
                mask: config.mask,
                dir: config.dir,
                failures,
            }),
        })
    }

    /// The log's directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Checkpoints not kept outside the log (witness, etcd), counted.
    pub fn outside_failures(&self) -> &OutsideFailures {
        &self.inner.failures
    }

    /// Counts checkpoints not kept outside the log in `metrics` from now
    /// on (`decision_log_failures{kind="checkpoint_witness"}`,
    /// `{kind="checkpoint_etcd"}`).
    pub fn attach_metrics(&self, metrics: Arc<crate::observe::metrics::Metrics>) {
        self.inner.failures.attach(metrics);
    }

    /// The mask rules the log applies.
    pub fn mask_rules(&self) -> &MaskRules {
        &self.inner.mask
    }

    /// Masks `entry`, appends it, and returns once it is written (and, with
    /// [`Durability::EveryRecord`], on disk). An error means the record is
    /// not in the log.
    pub async fn append(&self, mut entry: Entry) -> Result<Appended, LogError> {
        if matches!(entry, Entry::Checkpoint(_) | Entry::Gap(_)) {
            return Err(LogError::Config(
                "checkpoints and gaps are written by the log itself, not appended".to_owned(),
            ));
        }
        let masked = self.inner.mask.mask_entry(&mut entry);
        let (reply, answer) = oneshot::channel();
        self.inner
            .tx
            .send(Request::Append {
                entry: Box::new(entry),
                masked,
                reply,
            })
            .await
            .map_err(|_| LogError::Closed)?;
        answer.await.map_err(|_| LogError::Closed)?
    }

    /// Makes everything appended so far durable.
    pub async fn sync(&self) -> Result<(), LogError> {
        self.control(Request::Sync).await
    }

    /// Syncs and stops the writer; later appends fail with
    /// [`LogError::Closed`].
    pub async fn close(&self) -> Result<(), LogError> {
        self.control(Request::Close).await
    }

    async fn control(
        &self,
        request: fn(oneshot::Sender<Result<(), LogError>>) -> Request,
    ) -> Result<(), LogError> {
        let (reply, answer) = oneshot::channel();
        self.inner
            .tx
            .send(request(reply))
            .await
            .map_err(|_| LogError::Closed)?;
        answer.await.map_err(|_| LogError::Closed)?
    }
}

/// The writer task: groups requests, runs the file work on the blocking
/// pool, answers.
async fn run(writer: Writer, mut timers: Timers, mut rx: mpsc::Receiver<Request>) {
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
struct Timers {
    durability: Durability,
    /// With checkpoints: the longest a record stays unsealed.
    seal_interval: Option<Duration>,
    /// With `Interval`: when the unsynced writes must be synced.
    sync_at: Option<Instant>,
    /// When the records written since the last checkpoint must be sealed.
    seal_at: Option<Instant>,
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

/// Reads the etcd anchor of the log (checked with the key) and starts the
/// task that keeps it: what the log must hold, and the publisher.
async fn open_anchor(
    seal: &SealConfig,
    anchor: &AnchorConfig,
    failures: Arc<OutsideFailures>,
) -> Result<(Option<Known>, Publisher), LogError> {
    let key_file = seal.key_file.clone();
    let verifying = tokio::task::spawn_blocking(move || checkpoint::read_signing_key(&key_file))
        .await
        .map_err(|err| LogError::Config(format!("reading the key panicked: {err}")))?
        .map_err(|err| LogError::Config(err.to_string()))?
        .verifying_key();
    if anchor.instance.is_empty() {
        return Err(LogError::Config(
            "the etcd anchor needs an instance name ([decision_log] instance)".to_owned(),
        ));
    }
    let key = super::anchor::anchor_key(
        &anchor.etcd.prefix,
        &checkpoint::key_id(&verifying),
        &anchor.instance,
    );
    let refused = |error: super::anchor::AnchorError| {
        LogError::Config(format!(
            "cannot read the checkpoint anchored in etcd at {key}: {error}; the log is not opened \
             on a chain it cannot check"
        ))
    };
    let mut client = AnchorClient::connect(&anchor.etcd).await.map_err(refused)?;
    let value = client.get(&key).await.map_err(refused)?;
    let known = match value {
        None => None,
        Some(value) => match checkpoint::check_line(&value, &verifying) {
            Ok(Some(sealed)) => Some(Known {
                sealed,
                source: "etcd",
            }),
            Ok(None) => {
                return Err(LogError::Config(format!(
                    "the etcd anchor at {key} is not a checkpoint; remove the key if it is not this log's"
                )));
            }
            Err(reason) => {
                return Err(LogError::Config(format!(
                    "the checkpoint anchored in etcd at {key} {reason}"
                )));
            }
        },
    };
    tracing::info!(key = %key, anchored = known.as_ref().map(|k| k.sealed.seq), "decision log: checkpoints anchored in etcd");
    let publisher = Publisher::start(client, anchor.etcd.clone(), key, failures);
    Ok((known, publisher))
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

/// The files and the chain; used from the blocking pool only.
struct Writer {
    /// Held while the writer lives: one writer per log directory.
    _lock: File,
    dir: PathBuf,
    mesh: String,
    max_file_bytes: u64,
    file: File,
    path: PathBuf,
    /// Bytes in `file`.
    size: u64,
    /// Written to `file` since its last sync.
    dirty: bool,
    next_seq: u64,
    prev: String,
    poisoned: Option<String>,
    /// Records written are also exported here (`otlp`).
    export: Option<super::otlp::Export>,
    /// Signs checkpoints, when a key is configured.
    sealer: Option<Sealer>,
    /// Puts checkpoints to etcd, off this thread.
    anchor: Option<Publisher>,
    /// How long a closing log waits for its last checkpoint to reach etcd.
    anchor_timeout: Duration,
    /// The checkpoint known from etcd when the log was opened.
    anchored: Option<Known>,
    /// The last checkpoint or gap line written.
    last_seal: Option<Vec<u8>>,
    /// Checkpoints not kept outside, counted.
    failures: Arc<OutsideFailures>,
}

/// A line serialized and sealed, not yet written.
struct Line {
    bytes: Vec<u8>,
    seq: u64,
    id: String,
    masked: u32,
    /// The hash of `bytes`: the next line's `prev`.
    hash: String,
    /// The append this line answers; `None` for a checkpoint.
    slot: Option<usize>,
    /// The file is rotated before this line.
    rotate_before: bool,
}

impl Line {
    fn seal(bytes: Vec<u8>, seq: u64) -> Line {
        Line {
            hash: chain::sha256_hex(&bytes),
            bytes,
            seq,
            id: String::new(),
            masked: 0,
            slot: None,
            rotate_before: false,
        }
    }
}

impl Writer {
    fn open(
        dir: PathBuf,
        mesh: String,
        max_file_bytes: u64,
        export: Option<super::otlp::Export>,
        seal: Option<SealConfig>,
        anchored: Option<Known>,
        failures: Arc<OutsideFailures>,
    ) -> Result<Writer, LogError> {
        if dir.exists() && !dir.is_dir() {
            return Err(LogError::Config(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        let sealer = seal.as_ref().map(Sealer::open).transpose()?;
        fs::create_dir_all(&dir).map_err(|err| LogError::io("create", &dir, &err))?;
        let lock = lock_dir(&dir)?;
        let files = segment::list(&dir).map_err(|err| LogError::io("list", &dir, &err))?;

        // The last record of the log, and where the writer continues.
        let (path, next_seq, prev) = match files.last() {
            None => (dir.join(segment::file_name(0)), 0, GENESIS.to_owned()),
            Some((named, last)) => {
                let mut found = None;
                for (_, file) in files.iter().rev() {
                    if let Some(tail) = last_record(file)? {
                        found = Some((tail, file == last));
                        break;
                    }
                }
                let (next_seq, prev, rotated) = match found {
                    Some(((header, hash), in_last)) => (
                        header.seq + 1,
                        hash,
                        in_last
                            && header.kind == "checkpoint"
                            && header.reason.as_deref() == Some("rotate"),
                    ),
                    None => (0, GENESIS.to_owned(), false),
                };
                // An empty last file (a crash right after a rotation) must
                // be named for the record that comes next.
                if fs::metadata(last).map(|m| m.len()).unwrap_or(0) == 0 && *named != next_seq {
                    return Err(LogError::CorruptTail {
                        path: last.clone(),
                        line: 0,
                        offset: 0,
                        reason: format!(
                            "is empty and named for seq {named}, but the record that comes next is seq {next_seq}"
                        ),
                    });
                }
                if rotated {
                    // A file closed by a `rotate` checkpoint takes nothing
                    // more (a crash before the next file was written).
                    (dir.join(segment::file_name(next_seq)), next_seq, prev)
                } else {
                    (last.clone(), next_seq, prev)
                }
            }
        };
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|err| LogError::io("open", &path, &err))?;
        let size = file
            .metadata()
            .map_err(|err| LogError::io("stat", &path, &err))?
            .len();
        if size == 0 {
            sync_dir(&dir)?;
        }
        let mut writer = Writer {
            _lock: lock,
            dir,
            mesh,
            max_file_bytes,
            file,
            path,
            size,
            dirty: false,
            next_seq,
            prev,
            poisoned: None,
            export,
            sealer,
            anchor: None,
            anchor_timeout: Duration::from_secs(2),
            anchored,
            last_seal: None,
            failures,
        };
        writer.resume_sealed()?;
        Ok(writer)
    }

    /// With a key: refuses a log that does not hold the latest checkpoint
    /// known outside it (or, with `allow_gap`, writes a signed gap record
    /// naming it), then opens the run with an `open` checkpoint.
    fn resume_sealed(&mut self) -> Result<(), LogError> {
        let Some(sealer) = &self.sealer else {
            return Ok(());
        };
        let mut kind = SealKind::Checkpoint("open");
        let mut known = sealer.known(&self.dir)?;
        known.extend(self.anchored.take());
        for known in known {
            let sealed = &known.sealed;
            if checkpoint::log_holds(&self.dir, self.next_seq, sealed.seq, &sealed.hash)? {
                continue;
            }
            if !sealer.allow_gap {
                return Err(LogError::Behind {
                    dir: self.dir.clone(),
                    source_name: known.source,
                    seq: sealed.seq,
                    hash: sealed.hash.clone(),
                    time: sealed.time.clone(),
                    next_seq: self.next_seq,
                });
            }
            tracing::warn!(
                source = known.source,
                missing_seq = sealed.seq,
                next_seq = self.next_seq,
                "decision log: the log does not hold its latest checkpoint; continuing after a gap record (allow_gap)"
            );
            kind = SealKind::Gap {
                missing_seq: sealed.seq,
                missing_hash: sealed.hash.clone(),
                source: known.source,
            };
            break;
        }
        self.seal_now(kind)
    }

    /// The name of the file written to.
    fn segment_name(&self) -> String {
        self.path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Writes a checkpoint (or gap) now, syncs it, and keeps it outside the
    /// log. An `interval` checkpoint is skipped when nothing is unsealed.
    fn seal_now(&mut self, kind: SealKind) -> Result<(), LogError> {
        let Some(sealer) = &self.sealer else {
            return Ok(());
        };
        if matches!(kind, SealKind::Checkpoint("interval")) && sealer.since == 0 {
            return Ok(());
        }
        if let Some(reason) = &self.poisoned {
            return Err(LogError::Poisoned {
                reason: reason.clone(),
            });
        }
        let bytes = sealer.line(
            self.next_seq,
            &self.prev,
            &self.mesh,
            &self.segment_name(),
            kind,
        )?;
        let line = Line::seal(bytes, self.next_seq);
        let mut buf = Vec::with_capacity(line.bytes.len() + 1);
        buf.extend_from_slice(&line.bytes);
        buf.push(b'\n');
        self.write_buf(&buf)?;
        self.next_seq = line.seq + 1;
        self.prev = line.hash.clone();
        if let Some(sealer) = &mut self.sealer {
            sealer.since = 0;
        }
        self.sync()?;
        self.published(&line);
        Ok(())
    }

    /// A checkpoint written and synced: to the witness, the state file and
    /// the OTLP export. A failure there leaves the log intact; it is logged.
    fn published(&mut self, line: &Line) {
        if let Some(sealer) = &self.sealer
            && let Err(error) = sealer.publish(&self.dir, &line.bytes)
        {
            self.failures.count("checkpoint_witness");
            tracing::error!(%error, seq = line.seq, "decision log: checkpoint not kept outside the log");
        }
        if let Some(anchor) = &self.anchor {
            anchor.offer(&line.bytes);
        }
        self.last_seal = Some(line.bytes.clone());
        if let Some(export) = &self.export {
            export.emit(&line.bytes);
        }
    }

    /// A record's line at `seq` after `prev`.
    fn record_line(
        &self,
        seq: u64,
        prev: &str,
        entry: &Entry,
        masked: u32,
    ) -> Result<Line, LogError> {
        let id = Uuid::now_v7().to_string();
        let time = time::OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_default();
        let unsealed = Unsealed {
            v: FORMAT_VERSION,
            seq,
            id: &id,
            time: &time,
            mesh: &self.mesh,
            prev,
            masked,
            entry,
        };
        let object =
            serde_json::to_vec(&unsealed).map_err(|err| LogError::Serialize(err.to_string()))?;
        let bytes = chain::seal(object);
        Ok(Line {
            hash: chain::sha256_hex(&bytes),
            bytes,
            seq,
            id,
            masked,
            slot: None,
            rotate_before: false,
        })
    }

    /// Numbers, chains and seals `entries` (already masked), with the
    /// checkpoints that fall due among them: before a record when `every`
    /// records followed the last one, and as the last line of a file that
    /// is rotated.
    fn plan(&self, entries: &[(Entry, u32)]) -> (Vec<Line>, Vec<Option<LogError>>) {
        let mut lines = Vec::with_capacity(entries.len() + 1);
        let mut failed: Vec<Option<LogError>> = vec![None; entries.len()];
        let (mut seq, mut prev) = (self.next_seq, self.prev.clone());
        let mut size = self.size;
        let mut since = self.sealer.as_ref().map_or(0, |s| s.since);
        let mut segment = self.segment_name();
        let push_seal = |lines: &mut Vec<Line>,
                         seq: &mut u64,
                         prev: &mut String,
                         size: &mut u64,
                         sealer: &Sealer,
                         segment: &str,
                         reason: &'static str|
         -> Result<(), LogError> {
            let bytes = sealer.line(
                *seq,
                prev,
                &self.mesh,
                segment,
                SealKind::Checkpoint(reason),
            )?;
            let line = Line::seal(bytes, *seq);
            *size += line.bytes.len() as u64 + 1;
            *prev = line.hash.clone();
            *seq += 1;
            lines.push(line);
            Ok(())
        };
        for (slot, (entry, masked)) in entries.iter().enumerate() {
            if let Some(sealer) = &self.sealer
                && since >= sealer.every
            {
                if let Err(error) = push_seal(
                    &mut lines, &mut seq, &mut prev, &mut size, sealer, &segment, "count",
                ) {
                    failed[slot] = Some(error);
                    continue;
                }
                since = 0;
            }
            let mut line = match self.record_line(seq, &prev, entry, *masked) {
                Ok(line) => line,
                Err(error) => {
                    failed[slot] = Some(error);
                    continue;
                }
            };
            let len = line.bytes.len() as u64 + 1;
            if size > 0 && size + len > self.max_file_bytes {
                if let Some(sealer) = &self.sealer {
                    // The file's last line vouches for it; the record moves
                    // one place on.
                    let resealed = push_seal(
                        &mut lines, &mut seq, &mut prev, &mut size, sealer, &segment, "rotate",
                    )
                    .and_then(|()| self.record_line(seq, &prev, entry, *masked));
                    match resealed {
                        Ok(moved) => line = moved,
                        Err(error) => {
                            failed[slot] = Some(error);
                            continue;
                        }
                    }
                    since = 0;
                }
                line.rotate_before = true;
                segment = segment::file_name(seq);
                size = 0;
            }
            size += line.bytes.len() as u64 + 1;
            prev = line.hash.clone();
            seq += 1;
            since += 1;
            line.slot = Some(slot);
            lines.push(line);
        }
        (lines, failed)
    }

    /// Appends `entries` (already masked) in order; syncs them when `sync`.
    /// One result per entry.
    fn append(
        &mut self,
        entries: Vec<(Entry, u32)>,
        sync: bool,
    ) -> Vec<Result<Appended, LogError>> {
        let count = entries.len();
        if let Some(reason) = &self.poisoned {
            let error = LogError::Poisoned {
                reason: reason.clone(),
            };
            return vec![Err(error); count];
        }
        let (lines, failed) = self.plan(&entries);
        let mut results: Vec<Option<Result<Appended, LogError>>> =
            failed.into_iter().map(|error| error.map(Err)).collect();

        // Write them, rotating where planned.
        let (written, write_failure) = self.write_lines(&lines);
        let mut sync_failure = None;
        let sealed = lines[..written].iter().any(|line| line.slot.is_none());
        if written > 0 {
            let line = &lines[written - 1];
            self.next_seq = line.seq + 1;
            self.prev = line.hash.clone();
            if let Some(sealer) = &mut self.sealer {
                for line in &lines[..written] {
                    sealer.since = if line.slot.is_none() {
                        0
                    } else {
                        sealer.since + 1
                    };
                }
            }
            // A checkpoint is on disk before it is kept anywhere else.
            if sync || sealed {
                sync_failure = self.sync().err();
            }
        }
        for (index, line) in lines.into_iter().enumerate() {
            let result = match (&sync_failure, &write_failure) {
                // Nothing of this group is known to be on disk.
                (Some(error), _) => Err(error.clone()),
                (None, Some(error)) if index >= written => Err(error.clone()),
                _ => {
                    if line.slot.is_none() {
                        self.published(&line);
                    } else if let Some(export) = &self.export {
                        export.emit(&line.bytes);
                    }
                    Ok(Appended {
                        seq: line.seq,
                        id: line.id,
                        masked: line.masked,
                    })
                }
            };
            if let Some(slot) = line.slot {
                results[slot] = Some(result);
            }
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or(Err(LogError::Closed)))
            .collect()
    }

    /// Writes `lines` in order, rotating before the lines that say so;
    /// returns how many were written, and the failure that stopped the rest.
    fn write_lines(&mut self, lines: &[Line]) -> (usize, Option<LogError>) {
        let mut written = 0;
        let mut buf: Vec<u8> = Vec::new();
        let mut in_buf = 0;
        for line in lines {
            if line.rotate_before {
                if let Err(err) = self.write_buf(&buf) {
                    return (written, Some(err));
                }
                written += in_buf;
                buf.clear();
                in_buf = 0;
                if let Err(err) = self.rotate(line.seq) {
                    return (written, Some(err));
                }
            }
            buf.extend_from_slice(&line.bytes);
            buf.push(b'\n');
            in_buf += 1;
        }
        if let Err(err) = self.write_buf(&buf) {
            return (written, Some(err));
        }
        (written + in_buf, None)
    }
    /// Writes whole lines to the current file, or nothing of them.
    fn write_buf(&mut self, buf: &[u8]) -> Result<(), LogError> {
        if buf.is_empty() {
            return Ok(());
        }
        match self.file.write_all(buf) {
            Ok(()) => {
                self.size += buf.len() as u64;
                self.dirty = true;
                Ok(())
            }
            Err(err) => {
                let error = LogError::io("write", &self.path, &err);
                // Cut back what part of the lines made it, so the file ends
                // with a whole record and the chain can go on.
                if let Err(cut) = self.file.set_len(self.size) {
                    self.poison(format!(
                        "a failed write ({err}) could not be cut back ({cut}) in {}",
                        self.path.display()
                    ));
                }
                Err(error)
            }
        }
    }

    /// Closes the current file (synced) and starts the file of `seq`.
    fn rotate(&mut self, seq: u64) -> Result<(), LogError> {
        self.sync()?;
        let path = self.dir.join(segment::file_name(seq));
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(|err| LogError::io("create", &path, &err))?;
        self.file = file;
        self.path = path;
        self.size = 0;
        self.dirty = false;
        if let Err(err) = sync_dir(&self.dir) {
            self.poison(err.to_string());
            return Err(err);
        }
        Ok(())
    }

    /// Syncs the current file if anything was written since the last sync.
    fn sync(&mut self) -> Result<(), LogError> {
        if let Some(reason) = &self.poisoned {
            return Err(LogError::Poisoned {
                reason: reason.clone(),
            });
        }
        if !self.dirty {
            return Ok(());
        }
        match self.file.sync_data() {
            Ok(()) => {
                self.dirty = false;
                Ok(())
            }
            Err(err) => {
                let error = LogError::io("fsync", &self.path, &err);
                self.poison(error.to_string());
                Err(error)
            }
        }
    }

    fn poison(&mut self, reason: String) {
        tracing::error!(%reason, "decision log stopped");
        self.poisoned.get_or_insert(reason);
    }
}

/// Takes the log directory's lock file, `.lock`, so that a second writer
/// (another mesh process, or a second log in this one) is refused instead
/// of interleaving records and breaking the chain. An advisory `flock`:
/// released by the kernel when the writer ends, even by a crash.
fn lock_dir(dir: &Path) -> Result<File, LogError> {
    let path = dir.join(".lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|err| LogError::io("open", &path, &err))?;
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::WouldBlock {
                return Err(LogError::Config(format!(
                    "{} is already written by another decision log (another mesh, or this one opened twice); \
                     give each mesh instance its own directory",
                    dir.display()
                )));
            }
            return Err(LogError::io("lock", &path, &err));
        }
    }
    Ok(file)
}

fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|err| LogError::io("fsync", dir, &err))
}

/// The last record of `path` and the hash of its line; `None` for an empty
/// file. A damaged tail is [`LogError::CorruptTail`].
fn last_record(path: &Path) -> Result<Option<(Header, String)>, LogError> {
    let io = |err: io::Error| LogError::io("read", path, &err);
    let mut file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len == 0 {
        return Ok(None);
    }
    let corrupt = |offset: u64, reason: &str| -> LogError {
        LogError::CorruptTail {
            path: path.to_path_buf(),
            line: lines_before(path, offset).unwrap_or(0) + 1,
            offset,
            reason: reason.to_owned(),
        }
    };
    // Find the newline before the last line, reading backwards.
    const CHUNK: u64 = 64 * 1024;
    let mut end = len;
    let mut tail: Vec<u8> = Vec::new();
    let start = loop {
        let from = end.saturating_sub(CHUNK);
        let mut chunk = vec![0; (end - from) as usize];
        file.seek(SeekFrom::Start(from)).map_err(io)?;
        file.read_exact(&mut chunk).map_err(io)?;
        chunk.extend_from_slice(&tail);
        tail = chunk;
        // The last byte of the file is the last line's newline, if whole.
        let search = if from + tail.len() as u64 == len {
            &tail[..tail.len() - 1]
        } else {
            &tail[..]
        };
        if let Some(at) = search.iter().rposition(|&b| b == b'\n') {
            break from + at as u64 + 1;
        }
        if from == 0 {
            break 0;
        }
        end = from;
    };
    let line_start = (start - (len - tail.len() as u64)) as usize;
    let line = &tail[line_start..];
    if line.last() != Some(&b'\n') {
        return Err(corrupt(
            start,
            "is incomplete (no newline): a write was cut short",
        ));
    }
    let line = &line[..line.len() - 1];
    if chain::check_seal(line).is_err() {
        return Err(corrupt(start, "does not match its hash"));
    }
    let header = Header::parse(line).map_err(|reason| corrupt(start, &reason.to_string()))?;
    if header.v != FORMAT_VERSION {
        return Err(corrupt(
            start,
            &format!("has an unknown format version {}", header.v),
        ));
    }
    Ok(Some((header, chain::sha256_hex(line))))
}

/// Newlines in the first `offset` bytes of `path` (for error messages).
fn lines_before(path: &Path, offset: u64) -> io::Result<u64> {
    let mut bytes = Vec::new();
    File::open(path)?.take(offset).read_to_end(&mut bytes)?;
    Ok(bytes.iter().filter(|&&b| b == b'\n').count() as u64)
}
