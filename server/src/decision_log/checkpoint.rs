//! Signed checkpoints (R29): the writer seals its chain with an Ed25519 key,
//! so that a log rewritten with fresh hashes no longer verifies, and keeps
//! the latest checkpoint outside the log, so that a log cut short is seen.
//!
//! A checkpoint is a record of the chain (`"kind": "checkpoint"`) written
//! by the writer itself:
//!
//! * when a log is opened (`open`), so the first record of a log written
//!   with a key is a checkpoint;
//! * before a record when `every` records have followed the last checkpoint
//!   (`count`): between two checkpoints there are never more than `every`
//!   records, and `verify --key` refuses a log where there are;
//! * `interval` after the first record that follows a checkpoint, if no
//!   other checkpoint came first (`interval`);
//! * as the last record of a file before rotation (`rotate`): a file that
//!   ends with one must be followed by the next file;
//! * at a clean shutdown (`close`): after it the next record must be the
//!   `open` checkpoint (or a `gap`) of the next run.
//!
//! It holds the number of records before it (`records`, its own `seq`),
//! the head it seals (`head`, the hash of the line before it, its own
//! `prev`), the file it is in (`segment`), the writer's `every` and
//! `interval_ms`, the key id, and `sig`: the Ed25519 signature of
//! `guardmesh decision log checkpoint v1\n` followed by the record's line
//! as written, but with `"sig":""` and without its `hash` member. The
//! signature covers the envelope (seq, id, time, mesh, prev) too.
//!
//! Outside the log, each checkpoint line is appended to the witness file
//! (`witness`, on another mount, fsynced), written to the log directory's
//! `checkpoint.state`, exported over OTLP when the export is on, and put
//! to etcd when the registry is etcd ([`super::anchor`]). On open, a log
//! that does not hold the latest checkpoint of the state file, the witness
//! or the etcd anchor is refused ([`LogError::Behind`]) unless `allow_gap` is
//! set: then a signed `gap` record naming the missing checkpoint is
//! written first, and the chain goes on after it.
//!
//! Keys are PEM files: the private key PKCS#8 (`BEGIN PRIVATE KEY`), the
//! public key SubjectPublicKeyInfo (`BEGIN PUBLIC KEY`), the formats
//! `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use super::chain::{self, Header};
use super::error::LogError;
use super::record::{CheckpointRecord, Entry, FORMAT_VERSION, GapRecord, LogRecord, Unsealed};
use super::segment;

/// Default `checkpoint_every`: records between two checkpoints at most.
pub const DEFAULT_EVERY: u64 = 1000;
/// Default `checkpoint_interval_ms`.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// The shortest `checkpoint_interval_ms` accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// The copy of the latest checkpoint kept in the log's directory.
pub const STATE_FILE: &str = "checkpoint.state";
/// What every signature starts with, so that it can be nothing else.
const DOMAIN: &[u8] = b"guardmesh decision log checkpoint v1\n";

/// A key file that cannot be read, parsed or written.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read key file {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error(
        "{path} is not an Ed25519 {what} key in PEM ({message}); `guardmesh log keygen` writes one"
    )]
    Parse {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error("cannot write key file {path}: {message}")]
    Write { path: PathBuf, message: String },
    #[error("cannot generate a key: {0}")]
    Random(String),
}

/// The signing side's settings (`[decision_log] signing_key`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealConfig {
    /// The PKCS#8 PEM file of the Ed25519 private key.
    pub key_file: PathBuf,
    /// A checkpoint at least every this many records.
    pub every: u64,
    /// A checkpoint at most this long after a record it does not seal yet.
    pub interval: Duration,
    /// The witness: a file, or a directory (then the file is
    /// `checkpoints-<key id>.jsonl` in it).
    pub witness: Option<PathBuf>,
    /// Start on a log shorter than its latest checkpoint, after a signed
    /// gap record, instead of refusing.
    pub allow_gap: bool,
}

impl SealConfig {
    pub fn new(key_file: impl Into<PathBuf>) -> Self {
        SealConfig {
            key_file: key_file.into(),
            every: DEFAULT_EVERY,
            interval: DEFAULT_INTERVAL,
            witness: None,
            allow_gap: false,
        }
    }
}

fn read_text(path: &Path) -> Result<String, KeyError> {
    crate::files::read_to_string(path, crate::files::MAX_SECRET_FILE_BYTES).map_err(|err| {
        KeyError::Read {
            path: path.to_path_buf(),
            message: err.to_string(),
        }
    })
}

/// Reads a private key file (PKCS#8 PEM).
pub fn read_signing_key(path: &Path) -> Result<SigningKey, KeyError> {
    let text = read_text(path)?;
    SigningKey::from_pkcs8_pem(&text).map_err(|err| KeyError::Parse {
        path: path.to_path_buf(),
        what: "private",
        message: err.to_string(),
    })
}

/// Reads a public key file (SPKI PEM); a private key file is accepted too,
/// its public half is used.
pub fn read_verifying_key(path: &Path) -> Result<VerifyingKey, KeyError> {
    let text = read_text(path)?;
    if let Ok(key) = VerifyingKey::from_public_key_pem(&text) {
        return Ok(key);
    }
    match SigningKey::from_pkcs8_pem(&text) {
        Ok(key) => Ok(key.verifying_key()),
        Err(err) => Err(KeyError::Parse {
            path: path.to_path_buf(),
            what: "public",
            message: err.to_string(),
        }),
    }
}

/// The key id written in checkpoints: the first 16 hex digits of the
/// SHA-256 of the 32 bytes of the public key.
pub fn key_id(key: &VerifyingKey) -> String {
    chain::sha256_hex(key.as_bytes())[..16].to_owned()
}

/// A key written by [`generate`].
#[derive(Debug, Clone)]
pub struct NewKey {
    pub private_path: PathBuf,
    pub public_path: PathBuf,
    pub public_pem: String,
    pub key_id: String,
}

/// Generates a key pair: the private key to `out` (created, never
/// overwritten, mode 0600), the public key to `out` + `.pub`.
pub fn generate(out: &Path) -> Result<NewKey, KeyError> {
    use rand::TryRngCore;
    let mut seed = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut seed)
        .map_err(|err| KeyError::Random(err.to_string()))?;
    let key = SigningKey::from_bytes(&seed);
    seed.fill(0);
    let write_error = |path: &Path, message: String| KeyError::Write {
        path: path.to_path_buf(),
        message,
    };
    let private = key
        .to_pkcs8_pem(LineEnding::LF)
        .map_err(|err| write_error(out, err.to_string()))?;
    let public = key
        .verifying_key()
        .to_public_key_pem(LineEnding::LF)
        .map_err(|err| write_error(out, err.to_string()))?;
    let mut public_path = out.as_os_str().to_owned();
    public_path.push(".pub");
    let public_path = PathBuf::from(public_path);
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(out)
        .map_err(|err| write_error(out, err.to_string()))?;
    file.write_all(private.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|err| write_error(out, err.to_string()))?;
    fs::write(&public_path, public.as_bytes())
        .map_err(|err| write_error(&public_path, err.to_string()))?;
    Ok(NewKey {
        private_path: out.to_path_buf(),
        public_path,
        public_pem: public,
        key_id: key_id(&key.verifying_key()),
    })
}

/// The witness file for `path`: `path` itself, or in a directory
/// `checkpoints-<key id>.jsonl`.
pub fn witness_file(path: &Path, key_id: &str) -> PathBuf {
    if path.is_dir() {
        path.join(format!("checkpoints-{key_id}.jsonl"))
    } else {
        path.to_path_buf()
    }
}

/// The bytes a signature covers: [`DOMAIN`] and the line without `hash`,
/// with `sig` empty.
fn message(unsealed: &Unsealed<'_>) -> Result<Vec<u8>, serde_json::Error> {
    let mut bytes = DOMAIN.to_vec();
    serde_json::to_writer(&mut bytes, unsealed)?;
    Ok(bytes)
}

fn sig_mut(entry: &mut Entry) -> Option<&mut String> {
    match entry {
        Entry::Checkpoint(c) => Some(&mut c.sig),
        Entry::Gap(g) => Some(&mut g.sig),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A checkpoint or gap whose signature verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub seq: u64,
    /// The SHA-256 of its whole line (what the next record's `prev` is).
    pub hash: String,
    pub time: String,
    /// The checkpoint's reason, or `gap`.
    pub reason: String,
    pub segment: String,
    pub every: u64,
    /// For a gap: the checkpoint it says is missing, `(seq, hash)`.
    pub missing: Option<(u64, String)>,
}

/// Why a checkpoint or gap line does not check; each message completes
/// "the checkpoint ...".
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("its hash does not match its bytes")]
    Seal,
    #[error("is not a decision log record ({0})")]
    NotARecord(#[source] serde_json::Error),
    #[error("is signed with key {found}, not with the key given ({wanted})")]
    OtherKey { found: String, wanted: String },
    #[error(
        "says it seals another chain than its own place in the log (records/head differ from seq/prev)"
    )]
    OtherChain,
    #[error("its signature is not 64 bytes of hex")]
    SignatureShape,
    #[error("{0}")]
    Message(#[source] serde_json::Error),
    #[error("its signature does not verify: the checkpoint, or the chain it seals, was changed")]
    Signature,
}

/// Checks a checkpoint or gap line (without newline) against `key`: its
/// seal, its signature, and that it says what its envelope says. `Ok(None)`
/// for a line that is a record of another kind.
pub fn check_line(line: &[u8], key: &VerifyingKey) -> Result<Option<Sealed>, CheckpointError> {
    chain::check_seal(line).map_err(|_| CheckpointError::Seal)?;
    let record: LogRecord = serde_json::from_slice(line).map_err(CheckpointError::NotARecord)?;
    let LogRecord {
        v,
        seq,
        id,
        time,
        mesh,
        prev,
        masked,
        mut entry,
        hash: _,
    } = record;
    let (records, head, segment, every, key_id_, reason, missing) = match &entry {
        Entry::Checkpoint(c) => (
            c.records,
            c.head.clone(),
            c.segment.clone(),
            c.every,
            c.key_id.clone(),
            c.reason.clone(),
            None,
        ),
        Entry::Gap(g) => (
            g.records,
            g.head.clone(),
            g.segment.clone(),
            g.every,
            g.key_id.clone(),
            "gap".to_owned(),
            Some((g.missing_seq, g.missing_hash.clone())),
        ),
        _ => return Ok(None),
    };
    let wanted = key_id(key);
    if key_id_ != wanted {
        return Err(CheckpointError::OtherKey {
            found: key_id_,
            wanted,
        });
    }
    if records != seq || head != prev {
        return Err(CheckpointError::OtherChain);
    }
    let sig = sig_mut(&mut entry).map(std::mem::take).unwrap_or_default();
    let signature = unhex(&sig)
        .and_then(|bytes| Signature::from_slice(&bytes).ok())
        .ok_or(CheckpointError::SignatureShape)?;
    let bytes = message(&Unsealed {
        v,
        seq,
        id: &id,
        time: &time,
        mesh: &mesh,
        prev: &prev,
        masked,
        entry: &entry,
    })
    .map_err(CheckpointError::Message)?;
    key.verify_strict(&bytes, &signature)
        .map_err(|_| CheckpointError::Signature)?;
    Ok(Some(Sealed {
        seq,
        hash: chain::sha256_hex(line),
        time,
        reason,
        segment,
        every,
        missing,
    }))
}

/// What the writer writes a seal for.
#[derive(Debug, Clone)]
pub(crate) enum SealKind {
    Checkpoint(&'static str),
    Gap {
        missing_seq: u64,
        missing_hash: String,
        source: &'static str,
    },
}

/// The writer's signing side. Used from the blocking pool only.
pub(crate) struct Sealer {
    key: SigningKey,
    verifying: VerifyingKey,
    pub(crate) key_id: String,
    pub(crate) every: u64,
    pub(crate) interval: Duration,
    pub(crate) allow_gap: bool,
    witness: Option<PathBuf>,
    /// Records written since the last checkpoint.
    pub(crate) since: u64,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// The latest checkpoint known outside the log's files, and where from.
#[derive(Debug, Clone)]
pub(crate) struct Known {
    pub(crate) sealed: Sealed,
    pub(crate) source: &'static str,
}

impl Sealer {
    pub(crate) fn open(config: &SealConfig) -> Result<Sealer, LogError> {
        if config.every == 0 {
            return Err(LogError::Config(
                "checkpoint_every must be above 0".to_owned(),
            ));
        }
        if config.interval < MIN_INTERVAL {
            return Err(LogError::Config(format!(
                "checkpoint_interval_ms must be at least {}",
                MIN_INTERVAL.as_millis()
            )));
        }
        let key =
            read_signing_key(&config.key_file).map_err(|err| LogError::Config(err.to_string()))?;
        #[cfg(unix)]
        if let Ok(metadata) = fs::metadata(&config.key_file) {
            use std::os::unix::fs::PermissionsExt;
            if metadata.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    file = %config.key_file.display(),
                    "the decision log's signing key is readable by others than its owner: whoever reads it can sign a rewritten log (chmod 600)"
                );
            }
        }
        let verifying = key.verifying_key();
        let key_id = key_id(&verifying);
        let witness = config
            .witness
            .as_ref()
            .map(|path| witness_file(path, &key_id));
        Ok(Sealer {
            key,
            verifying,
            key_id,
            every: config.every,
            interval: config.interval,
            allow_gap: config.allow_gap,
            witness,
            since: 0,
        })
    }

    /// A sealed, signed checkpoint or gap line (without newline) at `seq`
    /// after `prev`, in the file `segment`.
    pub(crate) fn line(
        &self,
        seq: u64,
        prev: &str,
        mesh: &str,
        segment: &str,
        kind: SealKind,
    ) -> Result<Vec<u8>, LogError> {
        let id = Uuid::now_v7().to_string();
        let time = time::OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_default();
        let interval_ms = u64::try_from(self.interval.as_millis()).unwrap_or(u64::MAX);
        let mut entry = match kind {
            SealKind::Checkpoint(reason) => Entry::Checkpoint(CheckpointRecord {
                reason: reason.to_owned(),
                records: seq,
                head: prev.to_owned(),
                segment: segment.to_owned(),
                every: self.every,
                interval_ms,
                key_id: self.key_id.clone(),
                sig: String::new(),
            }),
            SealKind::Gap {
                missing_seq,
                missing_hash,
                source,
            } => Entry::Gap(GapRecord {
                records: seq,
                head: prev.to_owned(),
                segment: segment.to_owned(),
                every: self.every,
                interval_ms,
                missing_seq,
                missing_hash,
                source: source.to_owned(),
                key_id: self.key_id.clone(),
                sig: String::new(),
            }),
        };
        let serialize = |err: serde_json::Error| LogError::Serialize(err.to_string());
        fn unsealed<'a>(
            seq: u64,
            id: &'a str,
            time: &'a str,
            mesh: &'a str,
            prev: &'a str,
            entry: &'a Entry,
        ) -> Unsealed<'a> {
            Unsealed {
                v: FORMAT_VERSION,
                seq,
                id,
                time,
                mesh,
                prev,
                masked: 0,
                entry,
            }
        }
        let bytes = message(&unsealed(seq, &id, &time, mesh, prev, &entry)).map_err(serialize)?;
        let signature = self.key.sign(&bytes);
        if let Some(sig) = sig_mut(&mut entry) {
            *sig = hex(&signature.to_bytes());
        }
        let object = serde_json::to_vec(&unsealed(seq, &id, &time, mesh, prev, &entry))
            .map_err(serialize)?;
        Ok(chain::seal(object))
    }

    /// Keeps a checkpoint line written to the log (and synced) outside it:
    /// appended to the witness (fsynced), and as the directory's
    /// `checkpoint.state`. A failure is logged and counted by the caller;
    /// the log itself is intact.
    pub(crate) fn publish(&self, dir: &Path, line: &[u8]) -> Result<(), LogError> {
        if let Some(witness) = &self.witness {
            let mut file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(witness)
                .map_err(|err| LogError::io("open", witness, &err))?;
            let mut bytes = line.to_vec();
            bytes.push(b'\n');
            file.write_all(&bytes)
                .map_err(|err| LogError::io("write", witness, &err))?;
            file.sync_data()
                .map_err(|err| LogError::io("fsync", witness, &err))?;
        }
        let state = dir.join(STATE_FILE);
        let temp = dir.join(format!("{STATE_FILE}.tmp"));
        let mut file = File::create(&temp).map_err(|err| LogError::io("create", &temp, &err))?;
        file.write_all(line)
            .and_then(|()| file.write_all(b"\n"))
            .and_then(|()| file.sync_data())
            .map_err(|err| LogError::io("write", &temp, &err))?;
        fs::rename(&temp, &state).map_err(|err| LogError::io("rename", &state, &err))?;
        Ok(())
    }

    /// The latest checkpoints known outside the log's files: the state
    /// file's and the witness's. A file that is there but holds no
    /// checkpoint signed by this key is an error: the mesh does not start
    /// on a record it cannot trust.
    pub(crate) fn known(&self, dir: &Path) -> Result<Vec<Known>, LogError> {
        let mut known = Vec::new();
        let state = dir.join(STATE_FILE);
        if let Some(sealed) = last_sealed(&state, &self.verifying)? {
            known.push(Known {
                sealed,
                source: "state",
            });
        }
        if let Some(witness) = &self.witness
            && let Some(sealed) = last_sealed(witness, &self.verifying)?
        {
            known.push(Known {
                sealed,
                source: "witness",
            });
        }
        Ok(known)
    }
}

/// The last checkpoint line of `path` (a state or witness file), checked
/// against `key`; `None` when the file is missing or empty. An incomplete
/// last line (a crash in the middle of an append) is skipped.
fn last_sealed(path: &Path, key: &VerifyingKey) -> Result<Option<Sealed>, LogError> {
    let io = |err: io::Error| LogError::io("read", path, &err);
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(io(err)),
    };
    let len = file.metadata().map_err(io)?.len();
    // A checkpoint line is well under 1 KiB: the tail holds the last ones.
    const TAIL: u64 = 16 * 1024;
    let from = len.saturating_sub(TAIL);
    file.seek(SeekFrom::Start(from)).map_err(io)?;
    let mut tail = Vec::new();
    file.read_to_end(&mut tail).map_err(io)?;
    let Some(end) = tail.iter().rposition(|&b| b == b'\n') else {
        return Ok(None);
    };
    let complete = &tail[..end];
    let start = complete
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |at| at + 1);
    if start == 0 && from > 0 {
        return Err(LogError::Config(format!(
            "{}: its last line is longer than a checkpoint",
            path.display()
        )));
    }
    match check_line(&complete[start..], key) {
        Ok(Some(sealed)) => Ok(Some(sealed)),
        Ok(None) => Err(LogError::Config(format!(
            "{}: its last line is not a checkpoint",
            path.display()
        ))),
        Err(reason) => Err(LogError::Config(format!(
            "{}: its last checkpoint {reason}",
            path.display()
        ))),
    }
}

/// Whether the log in `dir` holds the record `seq` with line hash `hash`;
/// `next_seq` is the seq the log's next record would have.
pub(crate) fn log_holds(dir: &Path, next_seq: u64, seq: u64, hash: &str) -> Result<bool, LogError> {
    if seq >= next_seq {
        return Ok(false);
    }
    let files = segment::list(dir).map_err(|err| LogError::io("list", dir, &err))?;
    let Some((_, file)) = files.iter().rev().find(|(first, _)| *first <= seq) else {
        return Ok(false);
    };
    let text = fs::read(file).map_err(|err| LogError::io("read", file, &err))?;
    for line in text.split(|&b| b == b'\n') {
        if let Ok(header) = Header::parse(line)
            && header.seq == seq
        {
            return Ok(chain::sha256_hex(line) == hash);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpoint line `sealer` writes at `seq` after `prev`, sealed
    /// for a count, in file `decisions-0.jsonl` of mesh `m`.
    pub(super) fn count_checkpoint(sealer: &Sealer, seq: u64, prev: &str) -> Vec<u8> {
        sealer
            .line(
                seq,
                prev,
                "m",
                "decisions-0.jsonl",
                SealKind::Checkpoint("count"),
            )
            .unwrap()
    }

    #[test]
    fn r29_a_checkpoint_line_verifies_and_any_change_breaks_it() {
        let dir = tempfile::tempdir().unwrap();
        let key_path = dir.path().join("log.key");
        let new = generate(&key_path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&key_path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(generate(&key_path).is_err(), "an existing key is kept");
        let public = read_verifying_key(&new.public_path).unwrap();
        assert_eq!(key_id(&public), new.key_id);
        let sealer = Sealer::open(&SealConfig::new(&key_path)).unwrap();
        let prev = chain::sha256_hex(b"x");
        let line = count_checkpoint(&sealer, 7, &prev);
        let sealed = check_line(&line, &public).unwrap().unwrap();
        assert_eq!((sealed.seq, sealed.reason.as_str()), (7, "count"));
        // Another key refuses it.
        let other = SigningKey::from_bytes(&[9; 32]).verifying_key();
        assert!(check_line(&line, &other).is_err());
        // A change anywhere, resealed, breaks the signature.
        let text = String::from_utf8(line.clone()).unwrap();
        let body = &text[..text.rfind(",\"hash\"").unwrap()];
        for (from, to) in [
            ("\"seq\":7", "\"seq\":8"),
            ("\"records\":7", "\"records\":8"),
            ("\"reason\":\"count\"", "\"reason\":\"close\""),
            ("\"mesh\":\"m\"", "\"mesh\":\"n\""),
        ] {
            let edited = format!("{}}}", body.replace(from, to));
            let resealed = chain::seal(edited.into_bytes());
            assert!(check_line(&resealed, &public).is_err(), "{from} -> {to}");
        }
    }
}

/// The writer with a key, end to end: checkpoints written, verified,
/// matching the schema; the restart check.
#[cfg(test)]
mod writer_tests {
    use std::time::Duration;

    use serde_json::Value;

    use super::*;
    use crate::decision_log::record::{Action, BatchRecord, Caller, DecisionRecord, Outcome};
    use crate::decision_log::{DecisionLog, LogConfig, VerifyOptions, verify_with};

    fn decision(batch_id: &str, action: Action) -> Entry {
        Entry::Decision(DecisionRecord {
            caller: Caller::default(),
            batch: BatchRecord {
                batch_id: batch_id.to_owned(),
                session_id: "s".to_owned(),
                turn_index: 0,
                model_text: None,
                metadata: Default::default(),
                timeout_ms: None,
                calls: Vec::new(),
            },
            chain_revision: Some(1),
            decisions: vec![crate::decision_log::tests::call_decision("c1", action)],
            trace: Vec::new(),
            trace_id: None,
            outcome: Outcome::decided(),
        })
    }

    struct Setup {
        _dir: tempfile::TempDir,
        log: PathBuf,
        key: PathBuf,
        witness: PathBuf,
    }

    fn setup() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("log.key");
        generate(&key).unwrap();
        let witness = dir.path().join("witness");
        fs::create_dir(&witness).unwrap();
        Setup {
            log: dir.path().join("log"),
            key,
            witness,
            _dir: dir,
        }
    }

    fn config(setup: &Setup, every: u64, allow_gap: bool) -> LogConfig {
        LogConfig {
            max_file_bytes: 5000,
            seal: Some(SealConfig {
                every,
                witness: Some(setup.witness.clone()),
                allow_gap,
                ..SealConfig::new(&setup.key)
            }),
            ..LogConfig::new(&setup.log, "mesh-a")
        }
    }

    async fn write(config: LogConfig, n: usize) {
        let log = DecisionLog::open(config).await.unwrap();
        for i in 0..n {
            log.append(decision(&format!("b{i}"), Action::Cancel))
                .await
                .unwrap();
        }
        log.close().await.unwrap();
    }

    fn options(setup: &Setup, witness: bool, allow_gap: bool) -> VerifyOptions {
        VerifyOptions {
            key: Some(read_verifying_key(&setup.key.with_extension("key.pub")).unwrap()),
            anchor: witness.then(|| setup.witness.clone()),
            anchor_line: None,
            allow_gap,
        }
    }

    fn all_lines(dir: &Path) -> Vec<String> {
        segment::list(dir)
            .unwrap()
            .into_iter()
            .flat_map(|(_, file)| {
                fs::read_to_string(file)
                    .unwrap()
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[tokio::test]
    async fn r29_a_signed_log_verifies_with_its_key_and_witness_and_matches_the_schema() {
        let setup = setup();
        write(config(&setup, 3, false), 20).await;
        write(config(&setup, 3, false), 2).await;
        let report = verify_with(&setup.log, &options(&setup, true, false)).unwrap();
        assert!(report.signatures_checked);
        assert!(report.closed, "{report:?}");
        assert_eq!(report.unsealed, 0);
        assert!(report.files.len() >= 3, "{report:?}");
        assert_eq!(report.anchored_at, report.last.as_ref().map(|l| l.seq));
        let lines = all_lines(&setup.log);
        let kinds: Vec<String> = lines
            .iter()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                format!(
                    "{}:{}",
                    v["kind"].as_str().unwrap(),
                    v["reason"].as_str().unwrap_or("")
                )
            })
            .collect();
        assert_eq!(kinds[0], "checkpoint:open");
        assert_eq!(kinds.last().unwrap(), "checkpoint:close");
        for reason in ["count", "rotate", "close", "open"] {
            assert!(kinds.contains(&format!("checkpoint:{reason}")), "{kinds:?}");
        }
        // Never more than `every` records between two checkpoints.
        let mut run = 0;
        for kind in &kinds {
            run = if kind.starts_with("checkpoint") {
                0
            } else {
                run + 1
            };
            assert!(run <= 3, "{kinds:?}");
        }
        // Without a key: the chain alone, no signature checked.
        let plain = crate::decision_log::verify(&setup.log).unwrap();
        assert!(!plain.signatures_checked);
        // The witness holds the same lines as the log's checkpoints.
        let witness = fs::read_to_string(witness_file(
            &setup.witness,
            &key_id(&read_verifying_key(&setup.key).unwrap()),
        ))
        .unwrap();
        let sealed: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains("\"kind\":\"checkpoint\""))
            .collect();
        assert_eq!(witness.lines().count(), sealed.len());
        assert_eq!(witness.lines().last(), sealed.last().map(|l| l.as_str()));

        let validator = crate::decision_log::tests::schema();
        for line in &lines {
            crate::decision_log::tests::assert_valid_record(&validator, line);
        }
        let mut bad: Value = serde_json::from_str(&lines[0]).unwrap();
        bad["reason"] = Value::from("whenever");
        assert!(!validator.is_valid(&bad));
    }

    /// Cuts the last `n` lines off the log's last file.
    fn cut_tail(dir: &Path, n: usize) {
        let (_, last) = segment::list(dir).unwrap().pop().unwrap();
        let text = fs::read_to_string(&last).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let kept = &lines[..lines.len() - n];
        fs::write(
            &last,
            kept.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )
        .unwrap();
    }

    #[tokio::test]
    async fn r29_a_restart_on_a_shortened_log_is_refused_or_continues_after_a_gap() {
        for source in ["state", "witness"] {
            let setup = setup();
            write(config(&setup, 3, false), 5).await;
            cut_tail(&setup.log, 2);
            if source == "witness" {
                fs::remove_file(setup.log.join(STATE_FILE)).unwrap();
            } else {
                fs::remove_dir_all(&setup.witness).unwrap();
                fs::create_dir(&setup.witness).unwrap();
            }
            let error = DecisionLog::open(config(&setup, 3, false))
                .await
                .unwrap_err();
            assert!(
                matches!(error, LogError::Behind { source_name, .. } if source_name == source),
                "{error}"
            );
            assert!(error.to_string().contains("allow_gap"), "{error}");
            // Nothing was written by the refused start.
            assert!(
                all_lines(&setup.log)
                    .iter()
                    .all(|l| !l.contains("\"kind\":\"gap\""))
            );

            // With allow_gap: a signed gap record first, then the chain.
            write(config(&setup, 3, true), 1).await;
            let lines = all_lines(&setup.log);
            let gap: Value = serde_json::from_str(
                lines
                    .iter()
                    .find(|l| l.contains("\"kind\":\"gap\""))
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(gap["source"], source);
            let error = verify_with(&setup.log, &options(&setup, false, false)).unwrap_err();
            assert!(error.to_string().contains("gap"), "{error}");
            let report = verify_with(&setup.log, &options(&setup, true, true)).unwrap();
            assert_eq!(report.gaps.len(), 1);
            // And the next restart is a normal one.
            write(config(&setup, 3, false), 1).await;
            verify_with(&setup.log, &options(&setup, true, true)).unwrap();
        }
    }

    #[tokio::test]
    async fn r29_an_idle_tail_is_sealed_within_the_interval() {
        let setup = setup();
        let config = LogConfig {
            seal: Some(SealConfig {
                interval: Duration::from_millis(100),
                ..SealConfig::new(&setup.key)
            }),
            ..LogConfig::new(&setup.log, "m")
        };
        let log = DecisionLog::open(config).await.unwrap();
        log.append(decision("b", Action::Proceed)).await.unwrap();
        let mut sealed = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if all_lines(&setup.log)
                .last()
                .is_some_and(|l| l.contains("\"reason\":\"interval\""))
            {
                sealed = true;
                break;
            }
        }
        assert!(sealed, "{:?}", all_lines(&setup.log));
        // Callers cannot append seals.
        let forged = Entry::Checkpoint(CheckpointRecord {
            reason: "close".to_owned(),
            records: 0,
            head: String::new(),
            segment: String::new(),
            every: 1,
            interval_ms: 1,
            key_id: String::new(),
            sig: String::new(),
        });
        assert!(log.append(forged).await.is_err());
        log.close().await.unwrap();
    }

    #[tokio::test]
    async fn r29_a_witness_that_cannot_be_written_is_counted_and_logged_not_fatal() {
        let setup = setup();
        let config = LogConfig {
            seal: Some(SealConfig {
                witness: Some(setup.witness.join("no-such-dir").join("w.jsonl")),
                ..SealConfig::new(&setup.key)
            }),
            ..LogConfig::new(&setup.log, "m")
        };
        let log = DecisionLog::open(config).await.unwrap();
        // The `open` checkpoint is in the log, not in the witness.
        assert_eq!(log.outside_failures().witness(), 1);
        log.append(decision("b", Action::Proceed)).await.unwrap();
        // Counted in the mesh's metrics once attached, earlier ones too.
        let metrics = std::sync::Arc::new(crate::observe::metrics::Metrics::new());
        log.attach_metrics(metrics.clone());
        log.close().await.unwrap();
        assert_eq!(log.outside_failures().witness(), 2);
        let text = metrics.encode();
        assert!(
            text.contains("decision_log_failures_total{kind=\"checkpoint_witness\"} 2"),
            "{text}"
        );
        assert_eq!(log.outside_failures().etcd(), 0);
    }

    /// CPU time of this process (user + system).
    fn cpu() -> Duration {
        // SAFETY: getrusage writes into the struct given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
        };
        tv(usage.ru_utime) + tv(usage.ru_stime)
    }

    /// Not a check: what checkpoints cost. One checkpoint on its own (sign,
    /// witness append and fsync, state file), and the writer's CPU per
    /// record under 64 concurrent appends (group commit, `interval`
    /// durability so that fsyncs of records do not dominate) without a
    /// key, with the default `checkpoint_every` and with 100, in
    /// alternating rounds. Run with `cargo test -p guardmesh-server --lib
    /// decision_log::checkpoint::writer_tests::measure -- --ignored
    /// --nocapture` (add `--release` for production figures).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore]
    async fn measure_checkpoint_cost() {
        let setup = setup();
        let sealer = Sealer::open(&SealConfig {
            witness: Some(setup.witness.clone()),
            ..SealConfig::new(&setup.key)
        })
        .unwrap();
        fs::create_dir_all(&setup.log).unwrap();
        let prev = chain::sha256_hex(b"x");
        let n = 200u32;
        let (cpu0, wall0) = (cpu(), std::time::Instant::now());
        for seq in 0..u64::from(n) {
            let line = super::tests::count_checkpoint(&sealer, seq, &prev);
            std::hint::black_box(&line);
        }
        let sign = (cpu() - cpu0) / n;
        let sign_wall = wall0.elapsed() / n;
        let line = super::tests::count_checkpoint(&sealer, 0, &prev);
        let (cpu0, wall0) = (cpu(), std::time::Instant::now());
        for _ in 0..n {
            sealer.publish(&setup.log, &line).unwrap();
        }
        let publish = (cpu() - cpu0) / n;
        let publish_wall = wall0.elapsed() / n;
        println!(
            "one checkpoint: build+sign {sign:?} CPU ({sign_wall:?} wall); witness+state with 2 fsyncs {publish:?} CPU ({publish_wall:?} wall)"
        );

        let records = 4000usize;
        let variants: [(&str, Option<u64>); 3] = [
            ("no key", None),
            ("every 1000", Some(1000)),
            ("every 100", Some(100)),
        ];
        let mut best = [Duration::MAX; 3];
        for _round in 0..3 {
            for (index, (_, every)) in variants.iter().enumerate() {
                let dir = tempfile::tempdir().unwrap();
                let config = LogConfig {
                    durability: crate::decision_log::Durability::Interval(Duration::from_millis(
                        100,
                    )),
                    seal: every.map(|every| SealConfig {
                        every,
                        witness: Some(dir.path().join("witness.jsonl")),
                        ..SealConfig::new(&setup.key)
                    }),
                    ..LogConfig::new(dir.path().join("log"), "m")
                };
                let log = DecisionLog::open(config).await.unwrap();
                let start = cpu();
                let mut tasks = Vec::new();
                for t in 0..64 {
                    let log = log.clone();
                    tasks.push(tokio::spawn(async move {
                        for i in 0..records / 64 {
                            log.append(decision(&format!("b{t}-{i}"), Action::Cancel))
                                .await
                                .unwrap();
                        }
                    }));
                }
                for task in tasks {
                    task.await.unwrap();
                }
                let per_record = (cpu() - start) / (records / 64 * 64) as u32;
                log.close().await.unwrap();
                best[index] = best[index].min(per_record);
            }
        }
        for ((name, _), cost) in variants.iter().zip(best) {
            let ratio = cost.as_secs_f64() / best[0].as_secs_f64();
            println!("{name}: {cost:?} CPU per record ({ratio:.3} of no key)");
        }
    }
}
