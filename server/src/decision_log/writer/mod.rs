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
//!
//! * this file: [`DecisionLog`], the handle appends go through, and its
//!   settings;
//! * `task`: the writer task: group commit, the sync and checkpoint
//!   timers, closing;
//! * `files`: records numbered, chained and sealed into lines, written,
//!   rotated and synced, checkpoints among them;
//! * `open`: opening a log: the directory's lock, resuming after its last
//!   record, the checkpoint anchored in etcd.

mod files;
mod open;
mod task;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::anchor::{AnchorConfig, OutsideFailures, Publisher};
use super::checkpoint::{Known, SealConfig, Sealer};
use super::error::LogError;
use super::mask::MaskRules;
use super::record::Entry;
use task::Timers;

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
                let (known, publisher) = open::open_anchor(seal, anchor, failures.clone()).await?;
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
        let timers = Timers::new(config.durability, seal_interval);
        tokio::spawn(task::run(writer, timers, rx));
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

/// The files and the chain; used from the blocking pool only. Opened in
/// `open`, written in `files`.
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
