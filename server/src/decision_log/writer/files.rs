//! The write path: records numbered, chained and sealed into lines, with
//! the checkpoints that fall due among them, written whole or not at all,
//! the file rotated by size and synced; a failed fsync poisons the log.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use super::{Appended, Writer};
use crate::decision_log::chain;
use crate::decision_log::checkpoint::{SealKind, Sealer};
use crate::decision_log::error::LogError;
use crate::decision_log::record::{Entry, FORMAT_VERSION, Unsealed};
use crate::decision_log::segment;

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
    /// The line of `bytes` at `seq`, with its hash; it answers no append
    /// until `slot` says which.
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
    /// The name of the file written to.
    fn segment_name(&self) -> String {
        self.path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Writes a checkpoint (or gap) now, syncs it, and keeps it outside the
    /// log. An `interval` checkpoint is skipped when nothing is unsealed.
    pub(super) fn seal_now(&mut self, kind: SealKind) -> Result<(), LogError> {
        let Some(sealer) = &self.sealer else {
            return Ok(());
        };
        if matches!(kind, SealKind::Checkpoint("interval")) && sealer.since == 0 {
            return Ok(());
        }
        self.not_poisoned()?;
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
        Ok(Line {
            id,
            masked,
            ..Line::seal(chain::seal(object), seq)
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
    pub(super) fn append(
        &mut self,
        entries: Vec<(Entry, u32)>,
        sync: bool,
    ) -> Vec<Result<Appended, LogError>> {
        let count = entries.len();
        if let Err(error) = self.not_poisoned() {
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
    pub(super) fn sync(&mut self) -> Result<(), LogError> {
        self.not_poisoned()?;
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

    /// [`LogError::Poisoned`] once a failure has stopped the log.
    fn not_poisoned(&self) -> Result<(), LogError> {
        match &self.poisoned {
            Some(reason) => Err(LogError::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn poison(&mut self, reason: String) {
        tracing::error!(%reason, "decision log stopped");
        self.poisoned.get_or_insert(reason);
    }
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|err| LogError::io("fsync", dir, &err))
}
