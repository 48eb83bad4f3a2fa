//! Opening a log: the directory's lock, the chain resumed after the last
//! record of the last file (refused on a damaged tail), the checkpoint
//! known outside the log checked, and the etcd anchor read.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::Writer;
use super::files::sync_dir;
use crate::decision_log::anchor::{AnchorClient, AnchorConfig, OutsideFailures, Publisher};
use crate::decision_log::chain::{self, GENESIS, Header};
use crate::decision_log::checkpoint::{self, Known, SealConfig, SealKind, Sealer};
use crate::decision_log::error::LogError;
use crate::decision_log::record::FORMAT_VERSION;
use crate::decision_log::segment;

impl Writer {
    pub(super) fn open(
        dir: PathBuf,
        mesh: String,
        max_file_bytes: u64,
        export: Option<crate::decision_log::otlp::Export>,
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
}

/// Reads the etcd anchor of the log (checked with the key) and starts the
/// task that keeps it: what the log must hold, and the publisher.
pub(super) async fn open_anchor(
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
    let key = crate::decision_log::anchor::anchor_key(
        &anchor.etcd.prefix,
        &checkpoint::key_id(&verifying),
        &anchor.instance,
    );
    let refused = |error: crate::decision_log::anchor::AnchorError| {
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
