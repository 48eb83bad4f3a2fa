//! Reading a log (R29): its files in order, each line checked by the
//! chain and checkpoint rules as it is read ([`super::verify`]), so that
//! what a reader shows has verified; and reading on as the log grows and
//! rotates (`guardmesh log show --follow`).
//!
//! [`verify_with`](super::verify::verify_with) is this reader with nothing
//! to show: one reader, one set of rules.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::chain::Header;
use super::segment;
use super::verify::{BadRecord, Chain, Verifier, VerifyError, VerifyOptions, VerifyReport};

/// The longest line read (64 MiB): a record is bounded by the batch limits
/// far below this; a longer line is not a record, and reading it whole
/// would hold a hostile file's bytes in memory.
pub const MAX_LINE_BYTES: u64 = 64 << 20;

/// One record as read.
#[derive(Debug, Clone, Copy)]
pub struct ReadLine<'a> {
    /// The file it is in.
    pub file: &'a Path,
    /// 1-based line number in `file`.
    pub line: u64,
    /// Its sequence number.
    pub seq: u64,
    /// Its `kind`: `decision`, `chain_change`, `refusal_summary`,
    /// `checkpoint` or `gap`.
    pub kind: &'a str,
    /// The line's bytes, without its newline.
    pub bytes: &'a [u8],
}

/// A reader of a log directory (or one of its files) that can be read
/// again as the log grows.
pub struct LogReader {
    path: PathBuf,
    dir: bool,
    /// The files known so far, with the seq their names stand for.
    files: Vec<(u64, PathBuf)>,
    /// The file being read, its byte offset after the last complete line,
    /// and the lines read in it.
    index: usize,
    offset: u64,
    line_no: u64,
    /// Bytes after the last complete line of the file being read: a line
    /// being written, or a file cut short.
    partial: bool,
    /// `None` when reading without verification.
    verifier: Option<Verifier>,
}

impl LogReader {
    /// A reader of the log at `path` (a directory, or one of its files),
    /// checking every line with `verify` (`None`: no checks beyond
    /// parsing; nothing read is vouched for).
    pub fn open(path: &Path, verify: Option<&VerifyOptions>) -> Result<Self, VerifyError> {
        let metadata = std::fs::metadata(path).map_err(|err| io_error(path, err))?;
        let dir = metadata.is_dir();
        let (files, chain) = if dir {
            let files = segment::list(path).map_err(|err| io_error(path, err))?;
            (files, Chain::genesis())
        } else {
            let named = path
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(segment::parse_file_name);
            (
                vec![(named.unwrap_or(0), path.to_path_buf())],
                Chain::from_file(named),
            )
        };
        let verifier = verify
            .map(|options| Verifier::new(options, dir, chain))
            .transpose()?;
        Ok(LogReader {
            path: path.to_path_buf(),
            dir,
            files,
            index: 0,
            offset: 0,
            line_no: 0,
            partial: false,
            verifier,
        })
    }

    /// Reads every complete line there is now, from where the last call
    /// stopped, into `visit`, following the log into files written since.
    /// A line still being written at the end of the last file is left for
    /// the next call; at the end of any other file it is an error.
    pub fn read<E: From<VerifyError>>(
        &mut self,
        mut visit: impl FnMut(ReadLine<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        loop {
            if self.files.is_empty() {
                self.relist()?;
                if self.files.is_empty() {
                    return Ok(());
                }
            }
            self.drain(&mut visit)?;
            if self.index + 1 >= self.files.len() {
                self.relist()?;
                if self.index + 1 >= self.files.len() {
                    return Ok(());
                }
                // A file was added: what was written to this one before
                // the rotation.
                self.drain(&mut visit)?;
            }
            if self.partial {
                return Err(self.incomplete().into());
            }
            let file = &self.files[self.index].1;
            if let Some(verifier) = &mut self.verifier {
                verifier.file_ended(file, self.line_no)?;
            }
            self.index += 1;
            self.offset = 0;
            self.line_no = 0;
        }
    }

    /// The log ends here: a line left incomplete is an error, and with
    /// verification, the rules about the whole log are checked and the
    /// report returned (`None` when there was no file to read, or no
    /// verification).
    pub fn finish(self) -> Result<Option<VerifyReport>, VerifyError> {
        if self.files.is_empty() {
            return Err(VerifyError::Empty(self.path));
        }
        if self.partial {
            return Err(self.incomplete());
        }
        match self.verifier {
            Some(verifier) => verifier.finish(&self.files[self.index].1).map(Some),
            None => Ok(None),
        }
    }

    /// Whether lines are checked as they are read.
    pub fn verifies(&self) -> bool {
        self.verifier.is_some()
    }

    fn relist(&mut self) -> Result<(), VerifyError> {
        if !self.dir {
            return Ok(());
        }
        let listed = segment::list(&self.path).map_err(|err| io_error(&self.path, err))?;
        // Only files after the ones already read: a file that vanished
        // (the budget removed it) is not read again, and one that appears
        // before the current one is not a rotation.
        let last = self.files.last().map(|(seq, _)| *seq);
        for (seq, file) in listed {
            if last.is_none_or(|last| seq > last) {
                self.files.push((seq, file));
            }
        }
        Ok(())
    }

    /// Reads the complete lines of the current file after `offset`.
    fn drain<E: From<VerifyError>>(
        &mut self,
        visit: &mut impl FnMut(ReadLine<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let (named_seq, file) = &self.files[self.index];
        let mut handle = File::open(file).map_err(|err| io_error(file, err))?;
        handle
            .seek(SeekFrom::Start(self.offset))
            .map_err(|err| io_error(file, err))?;
        let mut reader = BufReader::new(handle);
        let mut buf = Vec::new();
        self.partial = false;
        loop {
            buf.clear();
            let read = (&mut reader)
                .take(MAX_LINE_BYTES + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|err| io_error(file, err))?;
            if read == 0 {
                return Ok(());
            }
            if buf.last() != Some(&b'\n') {
                if buf.len() as u64 > MAX_LINE_BYTES {
                    return Err(VerifyError::Bad(BadRecord {
                        file: file.clone(),
                        line: self.line_no + 1,
                        seq: None,
                        id: None,
                        reason: format!(
                            "the line is longer than {MAX_LINE_BYTES} bytes: not a decision log record"
                        ),
                    })
                    .into());
                }
                self.partial = true;
                return Ok(());
            }
            let line = &buf[..buf.len() - 1];
            let line_no = self.line_no + 1;
            let header = match &mut self.verifier {
                Some(verifier) => verifier.line(file, *named_seq, line_no, line)?,
                None => Header::parse(line).map_err(|reason| {
                    VerifyError::Bad(BadRecord {
                        file: file.clone(),
                        line: line_no,
                        seq: None,
                        id: None,
                        reason: format!("the line {reason}"),
                    })
                })?,
            };
            self.line_no = line_no;
            self.offset += read as u64;
            visit(ReadLine {
                file,
                line: line_no,
                seq: header.seq,
                kind: &header.kind,
                bytes: line,
            })?;
        }
    }

    fn incomplete(&self) -> VerifyError {
        VerifyError::Bad(BadRecord {
            file: self.files[self.index].1.clone(),
            line: self.line_no + 1,
            seq: None,
            id: None,
            reason: "the last line is incomplete (no newline): the file was truncated or is still being written"
                .to_owned(),
        })
    }
}

fn io_error(path: &Path, err: std::io::Error) -> VerifyError {
    VerifyError::Io {
        path: path.to_path_buf(),
        message: err.to_string(),
    }
}
