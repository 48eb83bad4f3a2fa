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
//! A directory is verified whole, from the genesis record. A single file is
//! verified on its own: from the genesis record if it is the log's first
//! file, otherwise from whatever its first record links to (which only the
//! file before it can confirm).

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use super::chain::{self, GENESIS, Header, SealError};
use super::record::FORMAT_VERSION;
use super::segment;

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
}

/// Verifies the log at `path`: a log directory, or one of its files.
pub fn verify(path: &Path) -> Result<VerifyReport, VerifyError> {
    let io_error = |path: &Path, err: std::io::Error| VerifyError::Io {
        path: path.to_path_buf(),
        message: err.to_string(),
    };
    let metadata = std::fs::metadata(path).map_err(|err| io_error(path, err))?;
    let (files, mut chain) = if metadata.is_dir() {
        let files = segment::list(path).map_err(|err| io_error(path, err))?;
        if files.is_empty() {
            return Err(VerifyError::Empty(path.to_path_buf()));
        }
        (files, Chain::genesis())
    } else {
        let named = path
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(segment::parse_file_name);
        let chain = match named {
            Some(0) => Chain::genesis(),
            // Not the first file, or not named as a log file: the record
            // before its first one is not at hand.
            seq => Chain { seq, prev: None },
        };
        (vec![(named.unwrap_or(0), path.to_path_buf())], chain)
    };

    let mut report = VerifyReport {
        files: Vec::new(),
        records: 0,
        masked_records: 0,
        last: None,
    };
    for (named_seq, file) in &files {
        let reader = File::open(file).map_err(|err| io_error(file, err))?;
        let mut reader = BufReader::new(reader);
        let mut buf = Vec::new();
        let mut line_no = 0u64;
        loop {
            buf.clear();
            let read = reader
                .read_until(b'\n', &mut buf)
                .map_err(|err| io_error(file, err))?;
            if read == 0 {
                break;
            }
            line_no += 1;
            let first_of_file = line_no == 1;
            let bad = |header: Option<&Header>, reason: String| {
                VerifyError::Bad(BadRecord {
                    file: file.clone(),
                    line: line_no,
                    seq: header.map(|h| h.seq),
                    id: header.map(|h| h.id.clone()),
                    reason,
                })
            };
            let complete = buf.last() == Some(&b'\n');
            let line = if complete {
                &buf[..buf.len() - 1]
            } else {
                &buf[..]
            };
            let header = Header::parse(line).ok();
            if !complete {
                return Err(bad(
                    header.as_ref(),
                    "the last line is incomplete (no newline): the file was truncated or is still being written"
                        .to_owned(),
                ));
            }
            if line.is_empty() {
                return Err(bad(None, "empty line".to_owned()));
            }
            match chain::check_seal(line) {
                Ok(()) => {}
                Err(SealError::Missing) => {
                    return Err(bad(
                        header.as_ref(),
                        "the line does not end with its hash: edited or not a decision log record"
                            .to_owned(),
                    ));
                }
                Err(SealError::Mismatch) => {
                    return Err(bad(
                        header.as_ref(),
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
            if let Some(expected) = chain.seq
                && header.seq != expected
            {
                let what = if header.seq > expected {
                    format!(
                        "out of place, expected seq {expected}: records removed or reordered before it"
                    )
                } else {
                    format!(
                        "out of order, expected seq {expected}: a record repeated or moved back"
                    )
                };
                return Err(bad(Some(&header), what));
            }
            if let Some(expected) = &chain.prev
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
            if first_of_file && header.seq != *named_seq && metadata.is_dir() {
                return Err(bad(
                    Some(&header),
                    format!(
                        "the file is named for seq {named_seq}: files renamed or records moved"
                    ),
                ));
            }
            let hash = chain::sha256_hex(line);
            report.records += 1;
            if header.masked > 0 {
                report.masked_records += 1;
            }
            chain = Chain {
                seq: Some(header.seq + 1),
                prev: Some(hash),
            };
            report.last = Some(RecordRef {
                file: file.clone(),
                line: line_no,
                seq: header.seq,
                id: header.id,
                hash: std::str::from_utf8(&line[line.len() - 66..line.len() - 2])
                    .unwrap_or_default()
                    .to_owned(),
            });
        }
        report.files.push(file.clone());
    }
    Ok(report)
}

/// What the next record must carry; `None` where it cannot be known.
struct Chain {
    seq: Option<u64>,
    prev: Option<String>,
}

impl Chain {
    fn genesis() -> Self {
        Chain {
            seq: Some(0),
            prev: Some(GENESIS.to_owned()),
        }
    }
}
