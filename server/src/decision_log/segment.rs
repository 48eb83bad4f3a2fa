//! The files of a log: one directory, files rotated by size and named by
//! the sequence number of their first record,
//! `decisions-00000000000000000000.jsonl`, `decisions-00000000000000001234.jsonl`.
//!
//! Twenty digits hold any `u64`, so the names sort the same as text and as
//! numbers, and the order of the files is never ambiguous. Other files in
//! the directory are ignored.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

const PREFIX: &str = "decisions-";
const SUFFIX: &str = ".jsonl";

/// The file name of the file whose first record has sequence `seq`.
pub fn file_name(seq: u64) -> String {
    format!("{PREFIX}{seq:020}{SUFFIX}")
}

/// The first sequence number a log file name stands for, if it is one.
pub fn parse_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The log files of `dir`, in order, with their first sequence numbers.
pub fn list(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(seq) = name.to_str().and_then(parse_file_name) else {
            continue;
        };
        files.push((seq, entry.path()));
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r29_names_sort_as_their_sequence_numbers() {
        assert_eq!(file_name(0), "decisions-00000000000000000000.jsonl");
        assert_eq!(parse_file_name(&file_name(u64::MAX)), Some(u64::MAX));
        let mut names = [file_name(10), file_name(9), file_name(100)];
        names.sort();
        assert_eq!(names, [file_name(9), file_name(10), file_name(100)]);
        for other in [
            "decisions-1.jsonl",
            "decisions-0000000000000000000a.jsonl",
            "x.jsonl",
        ] {
            assert_eq!(parse_file_name(other), None);
        }
    }
}
