//! The session secret (`[sessions] secret_file`): the key of the digests of
//! values seen and of call arguments (R34). Replicas that share a store
//! must have the same secret, or a value read through one replica has
//! another digest on the next and is never recognised; so a shared store
//! needs the secret in a file every replica reads, and the secret itself is
//! never written into the store (a reader of the store would then hold the
//! key of every digest in it).
//!
//! The file's bytes, all of them (a trailing newline included), are the
//! secret: at least [`MIN_SECRET_BYTES`], at most [`MAX_SECRET_BYTES`], and
//! not a placeholder (fewer than [`MIN_DISTINCT_BYTES`] distinct bytes, as
//! in 32 spaces or `aaaa...`). A file others than its owner may read is
//! accepted with a warning, as the decision log's signing key is.

use super::digest::Digester;
use std::path::Path;

/// Fewest bytes of a secret.
pub const MIN_SECRET_BYTES: usize = 32;

/// Most bytes of a secret file: a larger file is not a secret file.
pub const MAX_SECRET_BYTES: u64 = 4096;

/// Fewest distinct byte values of a secret (32 random bytes have about 30).
pub const MIN_DISTINCT_BYTES: usize = 8;

/// How to make a secret file, for the errors that ask for one.
pub const HOW_TO_CREATE: &str = "create one with `head -c 32 /dev/urandom > FILE && chmod 600 FILE`, copy the same file to every replica, and name it in [sessions] secret_file";

/// Why the session secret cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("sessions.secret_file {path}: cannot read it: {cause}")]
    Unreadable { path: String, cause: String },
    #[error(
        "sessions.secret_file {path} holds {len} bytes; at least {MIN_SECRET_BYTES} are needed: {HOW_TO_CREATE}"
    )]
    Short { path: String, len: usize },
    #[error(
        "sessions.secret_file {path} holds only {distinct} distinct byte values: it looks like a placeholder, not a secret: {HOW_TO_CREATE}"
    )]
    Placeholder { path: String, distinct: usize },
}

/// Reads the secret at `path` and keys a [`Digester`] with it.
pub fn read_secret(path: &Path) -> Result<Digester, SecretError> {
    let shown = path.display().to_string();
    let bytes =
        crate::files::read(path, MAX_SECRET_BYTES).map_err(|e| SecretError::Unreadable {
            path: shown.clone(),
            cause: e.to_string(),
        })?;
    if bytes.len() < MIN_SECRET_BYTES {
        return Err(SecretError::Short {
            path: shown,
            len: bytes.len(),
        });
    }
    let mut seen = [false; 256];
    for b in &bytes {
        seen[usize::from(*b)] = true;
    }
    let distinct = seen.iter().filter(|s| **s).count();
    if distinct < MIN_DISTINCT_BYTES {
        return Err(SecretError::Placeholder {
            path: shown,
            distinct,
        });
    }
    #[cfg(unix)]
    if let Ok(metadata) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt;
        if metadata.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                file = %shown,
                "the session secret is readable by others than its owner: whoever reads it and the session store can test guesses of the values sessions read (chmod 600)"
            );
        }
    }
    Digester::new(&bytes).map_err(|e| SecretError::Short {
        path: shown,
        len: e.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(bytes: &[u8]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        f
    }

    #[test]
    fn r34_short_placeholder_missing_and_oversized_secrets_are_refused_by_name() {
        let short = file(&[7u8; 31]);
        let e = read_secret(short.path()).unwrap_err().to_string();
        assert!(
            e.contains("sessions.secret_file") && e.contains("31 bytes"),
            "{e}"
        );
        assert!(e.contains("head -c 32 /dev/urandom"), "{e}");
        let blank = file(&[b' '; 64]);
        let e = read_secret(blank.path()).unwrap_err().to_string();
        assert!(e.contains("placeholder"), "{e}");
        let aaaa = file(b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n");
        assert!(read_secret(aaaa.path()).is_err());
        let e = read_secret(Path::new("/nonexistent/guardmesh-secret"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot read") && e.contains("/nonexistent"),
            "{e}"
        );
        let huge = file(&[1u8; 5000]);
        assert!(
            read_secret(huge.path()).is_err(),
            "5000 bytes is no secret file"
        );
        let dir = tempfile::tempdir().unwrap();
        assert!(read_secret(dir.path()).is_err(), "a directory");
    }

    #[test]
    fn r34_the_same_secret_file_gives_the_same_digests_another_does_not() {
        let secret: Vec<u8> = (0u8..32).map(|i| i.wrapping_mul(37)).collect();
        let (a, b) = (file(&secret), file(&secret));
        let mut other = secret.clone();
        other[0] ^= 1;
        let c = file(&other);
        let value = "ghp_abcdefghijklmnopqrstuv0123456789";
        let (da, db, dc) = (
            read_secret(a.path()).unwrap().digest(value),
            read_secret(b.path()).unwrap().digest(value),
            read_secret(c.path()).unwrap().digest(value),
        );
        assert_eq!(da, db);
        assert_ne!(da, dc);
    }
}
