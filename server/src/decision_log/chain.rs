//! The hash chain (R29): how a line is sealed and how it links to the one
//! before it.
//!
//! A line is the record's JSON object, written compactly on one line and
//! followed by `\n`. Two SHA-256 hashes, in lowercase hex, protect it:
//!
//! * `hash`, the last member of every line, is the SHA-256 of the line's
//!   bytes before `,"hash":"`: an edited record is detected, and named, by
//!   its own line, the last one of the log included;
//! * `prev` is the SHA-256 of the previous line's exact bytes, without its
//!   `\n` (so including its `hash`), or [`GENESIS`] for the first record of
//!   the log. It links the files of a rotated log too: the first record of
//!   a file chains to the last record of the file before. Together with
//!   `seq` (0, 1, 2, ... across files) a removed, reordered or inserted
//!   record is detected at the first record that follows it.
//!
//! No canonical form is needed: verification hashes the bytes as they are
//! in the file. What a hash chain cannot detect on its own is records cut
//! off the end of the log at a line boundary, or a log rewritten whole with
//! new hashes: the signed checkpoints of [`super::checkpoint`] close the
//! second, and a checkpoint kept outside the log (the witness) the first.

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// `prev` of the first record of a log: 64 zeros.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What ends every line before its newline: `,"hash":"` + 64 hex digits +
/// `"}`.
const SEAL_PREFIX: &[u8] = b",\"hash\":\"";
const SEAL_LEN: usize = SEAL_PREFIX.len() + 64 + 2;

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for byte in digest.iter() {
        hex.push(DIGITS[usize::from(byte >> 4)] as char);
        hex.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
    hex
}

/// Turns the compact JSON object `{...}` of a record (without `hash`) into
/// its sealed line `{...,"hash":"..."}` (without newline).
pub(crate) fn seal(mut object: Vec<u8>) -> Vec<u8> {
    debug_assert_eq!(object.last(), Some(&b'}'));
    object.pop();
    let hash = sha256_hex(&object);
    object.extend_from_slice(SEAL_PREFIX);
    object.extend_from_slice(hash.as_bytes());
    object.extend_from_slice(b"\"}");
    object
}

/// Why a line's seal does not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SealError {
    /// The line does not end with a `hash` member.
    Missing,
    /// The `hash` member does not match the line's bytes.
    Mismatch,
}

/// Checks a line's own `hash` (the line without its newline).
pub(crate) fn check_seal(line: &[u8]) -> Result<(), SealError> {
    if line.len() < SEAL_LEN + 1 || !line.ends_with(b"\"}") {
        return Err(SealError::Missing);
    }
    let (body, seal) = line.split_at(line.len() - SEAL_LEN);
    let Some(hash) = seal.strip_prefix(SEAL_PREFIX) else {
        return Err(SealError::Missing);
    };
    if sha256_hex(body).as_bytes() == &hash[..64] {
        Ok(())
    } else {
        Err(SealError::Mismatch)
    }
}

/// The members of a line that the chain is about.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Header {
    pub v: u32,
    pub seq: u64,
    pub id: String,
    pub prev: String,
    #[serde(default)]
    pub masked: u32,
    #[serde(default)]
    pub kind: String,
    /// A checkpoint's reason (`rotate`, `close`, ...).
    #[serde(default)]
    pub reason: Option<String>,
}

/// A line that is not a record: the message completes "the line ...".
#[derive(Debug, thiserror::Error)]
#[error("is not a decision log record ({0})")]
pub(crate) struct NotARecord(#[source] serde_json::Error);

impl Header {
    pub(crate) fn parse(line: &[u8]) -> Result<Header, NotARecord> {
        serde_json::from_slice(line).map_err(NotARecord)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r29_a_sealed_line_checks_and_any_edit_breaks_it() {
        let line = seal(br#"{"v":1,"seq":0,"a":"b"}"#.to_vec());
        assert!(line.starts_with(br#"{"v":1,"seq":0,"a":"b","hash":""#));
        assert_eq!(check_seal(&line), Ok(()));
        let value: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(value["hash"], sha256_hex(br#"{"v":1,"seq":0,"a":"b""#));
        for at in 0..line.len() {
            let mut edited = line.clone();
            edited[at] ^= 0x01;
            assert!(
                check_seal(&edited).is_err(),
                "edit at byte {at} not detected"
            );
        }
        assert_eq!(check_seal(b"{}"), Err(SealError::Missing));
    }

    #[test]
    fn sha256_of_the_empty_string() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(GENESIS.len(), 64);
    }
}
