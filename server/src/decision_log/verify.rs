//! Verification of a log (R29): every line sealed, every record chained to
//! the one before, across files; the first record that breaks it is named
//! by file, line and id.
//!
//! What is checked, line by line, in file order:
//!
//! 1. the line is complete (ends with a newline) and not empty;
//! 2. its own `hash` matches its bytes (an edited record is named itself);
//! 3. it is a record of a known format version;
//! 4. its `seq` is the previous one's + 1 (0 for the first record of the
//!    log): records removed or swapped are named at the first record out
//!    of place;
//! 5. its `prev` is the SHA-256 of the previous line ([`GENESIS`] for the
//!    first record of the log);
//! 6. the first record of a file has the sequence number its name says.
//!
//! With the writer's public key ([`VerifyOptions::key`]), the checkpoints
//! are checked too (see [`super::checkpoint`]):
//!
//! 7. every checkpoint and gap record is signed by the key, sits where it
//!    says (`records`, `head`, `segment`), and the log holds at least one;
//! 8. no more than `every` records follow a checkpoint before the next one;
//! 9. a `rotate` checkpoint ends its file and the next file exists; every
//!    file but the last ends with one;
//! 10. after a `close` checkpoint comes an `open` checkpoint or a gap;
//! 11. a gap record fails the verification unless gaps are accepted.
//!
//! With an outside checkpoint as well ([`VerifyOptions::anchor`]: the
//! witness file, or a file holding one checkpoint line), its last line must
//! be signed by the key and the log must hold that very record: a log cut
//! before it, or rewritten after it, is refused.
//!
//! A directory is verified whole, from the genesis record. A single file is
//! verified on its own: from the genesis record if it is the log's first
//! file, otherwise from whatever its first record links to (which only the
//! file before it can confirm).

use std::fmt;
use std::path::{Path, PathBuf};

use ed25519_dalek::VerifyingKey;

use super::chain::{self, GENESIS, Header, SealError};
use super::checkpoint::{self, Sealed};
use super::read::LogReader;
use super::record::FORMAT_VERSION;

/// A log that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// The files read, in order.
    pub files: Vec<PathBuf>,
    /// Records read.
    pub records: u64,
    /// Records with at least one masked or omitted value.
    pub masked_records: u64,
    /// The last record: the head of the chain.
    pub last: Option<RecordRef>,
    /// Whether checkpoint signatures were checked (a key was given).
    pub signatures_checked: bool,
    /// Checkpoints (and gaps) whose signature verified.
    pub checkpoints: u64,
    /// Records after the last checkpoint: not sealed yet (a running mesh,
    /// or one that stopped without its `close` checkpoint).
    pub unsealed: u64,
    /// The log ends with a `close` checkpoint.
    pub closed: bool,
    /// Gap records: `(seq of the gap, seq of the checkpoint it says is
    /// missing)`.
    pub gaps: Vec<(u64, u64)>,
    /// The outside checkpoint the log was checked against: its seq.
    pub anchored_at: Option<u64>,
}

/// What [`verify_with`] checks beyond the hash chain.
#[derive(Debug, Clone, Default)]
pub struct VerifyOptions {
    /// The writer's public key: checkpoints are checked.
    pub key: Option<VerifyingKey>,
    /// A witness file (or a directory holding the key's witness file), or
    /// a file whose last line is a checkpoint; needs `key`.
    pub anchor: Option<PathBuf>,
    /// A checkpoint line kept outside the log, given as bytes (e.g. read
    /// from the etcd anchor); needs `key`; used when `anchor` is `None`.
    pub anchor_line: Option<Vec<u8>>,
    /// Gap records are reported, not refused.
    pub allow_gap: bool,
}

/// Where a record is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRef {
    pub file: PathBuf,
    /// 1-based line number in `file`.
    pub line: u64,
    pub seq: u64,
    pub id: String,
    /// The record's own hash.
    pub hash: String,
}

/// The first record that breaks the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRecord {
    pub file: PathBuf,
    /// 1-based line number in `file`.
    pub line: u64,
    /// The record's `seq` and `id`, when the line could be read.
    pub seq: Option<u64>,
    pub id: Option<String>,
    pub reason: String,
}

impl fmt::Display for BadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: ", self.file.display(), self.line)?;
        if let Some(id) = &self.id {
            write!(f, "record {id}")?;
            if let Some(seq) = self.seq {
                write!(f, " (seq {seq})")?;
            }
            write!(f, ": ")?;
        }
        write!(f, "{}", self.reason)
    }
}

/// Why a log did not verify.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VerifyError {
    #[error("cannot read {path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{0}: no decision log files (decisions-<seq>.jsonl)")]
    Empty(PathBuf),
    #[error("{0}")]
    Bad(BadRecord),
    /// The outside checkpoint cannot be used.
    #[error("{0}")]
    Anchor(String),
    /// The log as a whole is not what its checkpoints vouch for (cut short,
    /// a file missing, no checkpoint at all, gaps).
    #[error("{0}")]
    Sealing(String),
}

/// Reads the last line of an anchor file and checks it against `key`.
fn read_anchor(path: &Path, key: &VerifyingKey) -> Result<Sealed, VerifyError> {
    let file = checkpoint::witness_file(path, &checkpoint::key_id(key));
    let text = std::fs::read(&file).map_err(|err| VerifyError::Io {
        path: file.clone(),
        message: err.to_string(),
    })?;
    let mut last = None;
    for (index, line) in text.split(|&b| b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        match checkpoint::check_line(line, key) {
            Ok(Some(sealed)) => last = Some(sealed),
            Ok(None) => {
                return Err(VerifyError::Anchor(format!(
                    "{}:{}: not a checkpoint",
                    file.display(),
                    index + 1
                )));
            }
            Err(reason) => {
                return Err(VerifyError::Anchor(format!(
                    "{}:{}: the checkpoint {reason}",
                    file.display(),
                    index + 1
                )));
            }
        }
    }
    last.ok_or_else(|| VerifyError::Anchor(format!("{}: holds no checkpoint", file.display())))
}

/// The checkpoint rules' state along the log (with a key).
#[derive(Default)]
struct Seals {
    /// The last checkpoint seen: its seq and `every`.
    last: Option<(u64, u64)>,
    /// Records since the last checkpoint (or since the start).
    since: u64,
    /// The last line of the current file so far is a `rotate` checkpoint.
    rotated: bool,
    /// The last record is a `close` checkpoint.
    closed: bool,
}

/// Verifies the hash chain of the log at `path`: a log directory, or one
/// of its files. Checks no signature: see [`verify_with`].
pub fn verify(path: &Path) -> Result<VerifyReport, VerifyError> {
    verify_with(path, &VerifyOptions::default())
}

/// Verifies the log at `path` with `options`: its hash chain, and with a
/// key its checkpoints, and with an anchor that it holds the latest
/// checkpoint kept outside it.
///
/// It reads the log with [`LogReader`], as `guardmesh log show` does.
pub fn verify_with(path: &Path, options: &VerifyOptions) -> Result<VerifyReport, VerifyError> {
    let mut reader = LogReader::open(path, Some(options))?;
    reader.read(|_| Ok::<(), VerifyError>(()))?;
    reader
        .finish()?
        .ok_or_else(|| VerifyError::Empty(path.to_path_buf()))
}

/// The chain and checkpoint rules, applied line by line as a log is read
/// (by [`LogReader`]), so that a reader that prints records only prints
/// records that verified.
pub(crate) struct Verifier {
    options: VerifyOptions,
    /// The outside checkpoint, read and checked against the key.
    anchor: Option<Sealed>,
    /// Whether the log held the anchor's record, and whether it matched.
    anchor_found: Option<bool>,
    seals: Seals,
    chain: Chain,
    /// A whole log directory (not one of its files).
    dir: bool,
    report: VerifyReport,
}

impl Verifier {
    /// A verifier for a log directory (`dir`) or one of its files whose
    /// first record must carry `chain`.
    pub(crate) fn new(
        options: &VerifyOptions,
        dir: bool,
        chain: Chain,
    ) -> Result<Self, VerifyError> {
        let anchor = match (&options.anchor, &options.anchor_line, &options.key) {
            (Some(anchor), _, Some(key)) => Some(read_anchor(anchor, key)?),
            (None, Some(line), Some(key)) => match checkpoint::check_line(line, key) {
                Ok(Some(sealed)) => Some(sealed),
                Ok(None) => {
                    return Err(VerifyError::Anchor(
                        "the outside checkpoint given is not a checkpoint".to_owned(),
                    ));
                }
                Err(reason) => {
                    return Err(VerifyError::Anchor(format!(
                        "the outside checkpoint given {reason}"
                    )));
                }
            },
            (Some(_), _, None) | (None, Some(_), None) => {
                return Err(VerifyError::Anchor(
                    "an outside checkpoint is checked with the key: give --key".to_owned(),
                ));
            }
            _ => None,
        };
        Ok(Verifier {
            options: options.clone(),
            anchor,
            anchor_found: None,
            seals: Seals::default(),
            chain,
            dir,
            report: VerifyReport {
                files: Vec::new(),
                records: 0,
                masked_records: 0,
                last: None,
                signatures_checked: options.key.is_some(),
                checkpoints: 0,
                unsealed: 0,
                closed: false,
                gaps: Vec::new(),
                anchored_at: None,
            },
        })
    }

    /// Checks one complete line (without its newline), line `line_no` of
    /// `file`, the file named for seq `named_seq`.
    pub(crate) fn line(
        &mut self,
        file: &Path,
        named_seq: u64,
        line_no: u64,
        line: &[u8],
    ) -> Result<Header, VerifyError> {
        let first_of_file = line_no == 1;
        let bad = |header: Option<&Header>, reason: String| {
            VerifyError::Bad(BadRecord {
                file: file.to_path_buf(),
                line: line_no,
                seq: header.map(|h| h.seq),
                id: header.map(|h| h.id.clone()),
                reason,
            })
        };
        if line.is_empty() {
            return Err(bad(None, "empty line".to_owned()));
        }
        match chain::check_seal(line) {
            Ok(()) => {}
            Err(SealError::Missing) => {
                return Err(bad(
                    Header::parse(line).ok().as_ref(),
                    "the line does not end with its hash: edited or not a decision log record"
                        .to_owned(),
                ));
            }
            Err(SealError::Mismatch) => {
                return Err(bad(
                    Header::parse(line).ok().as_ref(),
                    "its hash does not match its bytes: the record was edited".to_owned(),
                ));
            }
        }
        let header = match Header::parse(line) {
            Ok(header) => header,
            Err(reason) => return Err(bad(None, format!("the line {reason}"))),
        };
        if header.v != FORMAT_VERSION {
            return Err(bad(
                Some(&header),
                format!(
                    "unknown format version {} (this build reads {FORMAT_VERSION})",
                    header.v
                ),
            ));
        }
        if let Some(expected) = self.chain.seq
            && header.seq != expected
        {
            let what = if header.seq > expected {
                format!(
                    "out of place, expected seq {expected}: records removed or reordered before it"
                )
            } else {
                format!("out of order, expected seq {expected}: a record repeated or moved back")
            };
            return Err(bad(Some(&header), what));
        }
        if let Some(expected) = &self.chain.prev
            && &header.prev != expected
        {
            let reason = if expected == GENESIS {
                "the first record of the log does not carry the genesis value: earlier records or files were removed"
                    .to_owned()
            } else {
                "its prev does not match the hash of the line before it: a record before it was changed, removed or inserted"
                    .to_owned()
            };
            return Err(bad(Some(&header), reason));
        }
        if first_of_file && header.seq != named_seq && self.dir {
            return Err(bad(
                Some(&header),
                format!("the file is named for seq {named_seq}: files renamed or records moved"),
            ));
        }
        let hash = chain::sha256_hex(line);
        if let Some(key) = &self.options.key {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            seal_rules(key, line, &header, &name, &mut self.seals, &mut self.report)
                .map_err(|reason| bad(Some(&header), reason.to_string()))?;
        }
        if let Some(anchor) = &self.anchor
            && anchor.seq == header.seq
        {
            self.anchor_found = Some(anchor.hash == hash);
        }
        self.report.records += 1;
        if header.masked > 0 {
            self.report.masked_records += 1;
        }
        self.chain = Chain {
            seq: Some(header.seq + 1),
            prev: Some(hash),
        };
        self.report.last = Some(RecordRef {
            file: file.to_path_buf(),
            line: line_no,
            seq: header.seq,
            id: header.id.clone(),
            hash: std::str::from_utf8(&line[line.len() - 66..line.len() - 2])
                .unwrap_or_default()
                .to_owned(),
        });
        Ok(header)
    }

    /// `file`, which held `lines` lines, ended and another file follows
    /// it: once the log is signed, it must end with its `rotate`
    /// checkpoint.
    pub(crate) fn file_ended(&mut self, file: &Path, lines: u64) -> Result<(), VerifyError> {
        if self.options.key.is_some()
            && self.dir
            && self.seals.last.is_some()
            && !self.seals.rotated
        {
            return Err(VerifyError::Bad(BadRecord {
                file: file.to_path_buf(),
                line: lines,
                seq: None,
                id: None,
                reason: "the file does not end with its rotate checkpoint: records were cut from its end"
                    .to_owned(),
            }));
        }
        self.seals.rotated = false;
        self.report.files.push(file.to_path_buf());
        Ok(())
    }

    /// The log ended with `last` (its last file): the rules about the
    /// whole log, and the report.
    pub(crate) fn finish(mut self, last: &Path) -> Result<VerifyReport, VerifyError> {
        self.report.files.push(last.to_path_buf());
        let mut report = self.report;
        if self.options.key.is_some() {
            let Some((last_seal, _)) = self.seals.last else {
                return Err(VerifyError::Sealing(
                    "no signed checkpoint in the log: it was written without a key, or rewritten"
                        .to_owned(),
                ));
            };
            if self.seals.rotated && self.dir {
                return Err(VerifyError::Sealing(format!(
                    "the log ends with the rotate checkpoint at seq {last_seal}: the file after it (decisions-{:020}.jsonl) is missing",
                    last_seal + 1
                )));
            }
            report.unsealed = self.seals.since;
            report.closed = self.seals.closed;
        }
        if let Some(anchor) = &self.anchor {
            let head = report.last.as_ref().map(|last| last.seq);
            match self.anchor_found {
                Some(true) => report.anchored_at = Some(anchor.seq),
                Some(false) => {
                    return Err(VerifyError::Sealing(format!(
                        "the record at seq {} is not the checkpoint kept outside the log (written {}): the log was rewritten",
                        anchor.seq, anchor.time
                    )));
                }
                None => {
                    let missing = (anchor.seq + 1).saturating_sub(head.map_or(0, |seq| seq + 1));
                    return Err(VerifyError::Sealing(format!(
                        "the log ends at seq {} but the checkpoint kept outside it vouches for seq {} (written {}): \
                         {missing} records missing: records were cut from its end or its last files removed",
                        head.map_or_else(|| "-".to_owned(), |seq| seq.to_string()),
                        anchor.seq,
                        anchor.time
                    )));
                }
            }
        }
        if !report.gaps.is_empty() && !self.options.allow_gap {
            let list: Vec<String> = report
                .gaps
                .iter()
                .map(|(seq, missing)| format!("at seq {seq} (checkpoint seq {missing} missing)"))
                .collect();
            return Err(VerifyError::Sealing(format!(
                "the log has gap records, where the mesh was restarted on a log missing records: {}; \
                 pass --allow-gap to accept them",
                list.join(", ")
            )));
        }
        Ok(report)
    }
}

/// Which checkpoint rule a line breaks; each message completes "the
/// record ...".
#[derive(Debug, thiserror::Error)]
enum SealRule {
    #[error("{0}")]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("is not a checkpoint")]
    NotACheckpoint,
    #[error(
        "follows the mesh's closing checkpoint without an opening one: appended after the mesh stopped"
    )]
    AfterClose,
    #[error("follows the rotate checkpoint that closed its file: appended after it")]
    AfterRotate,
    #[error(
        "no checkpoint where one was due: {since} records follow the checkpoint at seq {at} (one every {every} at most)"
    )]
    Overdue { since: u64, at: u64, every: u64 },
    #[error("the checkpoint says it is in {segment}: files renamed or records moved")]
    Moved { segment: String },
    #[error("follows the mesh's closing checkpoint without an opening one")]
    CheckpointAfterClose,
    #[error(
        "no checkpoint where one was due: {since} records before the first checkpoint (one every {every} at most)"
    )]
    FirstOverdue { since: u64, every: u64 },
}

/// The checkpoint rules for one line (with a key); the reason it breaks
/// them.
fn seal_rules(
    key: &VerifyingKey,
    line: &[u8],
    header: &Header,
    file_name: &str,
    seals: &mut Seals,
    report: &mut VerifyReport,
) -> Result<(), SealRule> {
    let sealed = match header.kind.as_str() {
        "checkpoint" | "gap" => match checkpoint::check_line(line, key)? {
            Some(sealed) => sealed,
            None => return Err(SealRule::NotACheckpoint),
        },
        _ => {
            if seals.closed {
                return Err(SealRule::AfterClose);
            }
            if seals.rotated {
                return Err(SealRule::AfterRotate);
            }
            seals.since += 1;
            if let Some((at, every)) = seals.last
                && seals.since > every
            {
                return Err(SealRule::Overdue {
                    since: seals.since,
                    at,
                    every,
                });
            }
            return Ok(());
        }
    };
    if sealed.segment != file_name {
        return Err(SealRule::Moved {
            segment: sealed.segment,
        });
    }
    if seals.closed && sealed.reason != "open" && sealed.reason != "gap" {
        return Err(SealRule::CheckpointAfterClose);
    }
    // Before the first checkpoint: any number of records if it opens the
    // log's signed part (a key added to an existing log), else `every`.
    if seals.last.is_none()
        && sealed.reason != "open"
        && sealed.reason != "gap"
        && seals.since > sealed.every
    {
        return Err(SealRule::FirstOverdue {
            since: seals.since,
            every: sealed.every,
        });
    }
    if let Some(missing) = &sealed.missing {
        report.gaps.push((sealed.seq, missing.0));
    }
    report.checkpoints += 1;
    seals.last = Some((sealed.seq, sealed.every));
    seals.since = 0;
    seals.rotated = sealed.reason == "rotate";
    seals.closed = sealed.reason == "close";
    Ok(())
}

/// What the next record must carry; `None` where it cannot be known.
pub(crate) struct Chain {
    seq: Option<u64>,
    prev: Option<String>,
}

impl Chain {
    pub(crate) fn genesis() -> Self {
        Chain {
            seq: Some(0),
            prev: Some(GENESIS.to_owned()),
        }
    }
    /// The chain a file holding the records from `seq` on starts with:
    /// from the genesis record for the log's first file, otherwise from
    /// whatever its first record links to (which only the file before it
    /// can confirm). `seq` is `None` when the file is not named as a log
    /// file.
    pub(crate) fn from_file(seq: Option<u64>) -> Self {
        match seq {
            Some(0) => Chain::genesis(),
            seq => Chain { seq, prev: None },
        }
    }
}
