//! Reading the small files a config names (the config itself, policy files,
//! certificates, keys, token files, the decision log's signing key): only a
//! regular file, of at most a bound, opened non-blocking, so that a FIFO or
//! a device named in their place never waits for a writer and a sparse
//! gigabyte is refused by its size rather than read. A leaf module: it
//! imports nothing of the crate.

use std::io::Read;
use std::path::Path;

/// The most a config file may hold.
pub const MAX_CONFIG_FILE_BYTES: u64 = 4 << 20;
/// The most a policy file may hold (R27, R25): far more than any policy
/// needs (at most 256 rules of at most 4 KiB per expression).
pub const MAX_POLICY_FILE_BYTES: u64 = 4 << 20;
/// The most a certificate, key or token file may hold (a chain of a dozen
/// certificates is under 32 KiB).
pub const MAX_SECRET_FILE_BYTES: u64 = 1 << 20;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// It could not be opened.
    #[error("{0}")]
    Open(std::io::Error),
    /// It is a folder, FIFO, device or socket.
    #[error("it is {kind}, not a regular file")]
    NotRegular { kind: &'static str },
    /// It holds more than the bound.
    #[error("it holds {size} bytes, more than the {limit} allowed")]
    TooLarge { size: u64, limit: u64 },
    /// Reading it failed.
    #[error("{0}")]
    Read(std::io::Error),
}

impl From<FileError> for std::io::Error {
    fn from(error: FileError) -> Self {
        match error {
            FileError::Open(e) | FileError::Read(e) => e,
            other => std::io::Error::new(std::io::ErrorKind::InvalidInput, other.to_string()),
        }
    }
}

/// What kind of file `file_type` is, for an error.
pub fn kind_of(file_type: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if file_type.is_dir() {
        "a folder"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// The bytes of the regular file at `path` (links followed), at most
/// `limit` of them. Opened non-blocking; the type and size checked are those
/// of the file opened (nothing swapped in between is read), and no more
/// than `limit` bytes are read, whatever the file grows to meanwhile.
/// Blocking: call it at start-up or off the runtime's threads.
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(FileError::Open)?;
    let meta = file.metadata().map_err(FileError::Read)?;
    if !meta.file_type().is_file() {
        return Err(FileError::NotRegular {
            kind: kind_of(meta.file_type()),
        });
    }
    if meta.len() > limit {
        return Err(FileError::TooLarge {
            size: meta.len(),
            limit,
        });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(FileError::Read)?;
    if bytes.len() as u64 > limit {
        return Err(FileError::TooLarge {
            size: bytes.len() as u64,
            limit,
        });
    }
    Ok(bytes)
}

/// [`read_regular`] as an I/O result: the drop-in for `std::fs::read`.
pub fn read(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    Ok(read_regular(path, limit)?)
}

/// [`read`] as UTF-8 text: the drop-in for `std::fs::read_to_string`.
pub fn read_to_string(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read(path, limit)?).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "stream did not contain valid UTF-8",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("guardmesh-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn r25_a_fifo_a_folder_and_a_sparse_gigabyte_are_refused_at_once() {
        let dir = folder("kinds");
        let fifo = dir.join("cert.pem");
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let error = read(&fifo, MAX_SECRET_FILE_BYTES).unwrap_err();
        assert_eq!(error.to_string(), "it is a FIFO, not a regular file");
        let error = read(&dir, MAX_SECRET_FILE_BYTES).unwrap_err();
        assert_eq!(error.to_string(), "it is a folder, not a regular file");
        let big = dir.join("big.pem");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(1 << 30)
            .unwrap();
        let error = read(&big, MAX_SECRET_FILE_BYTES).unwrap_err();
        assert_eq!(
            error.to_string(),
            "it holds 1073741824 bytes, more than the 1048576 allowed"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_regular_file_within_the_bound_is_read_whole_and_text_must_be_utf8() {
        let dir = folder("regular");
        let file = dir.join("token");
        std::fs::write(&file, b"secret\n").unwrap();
        assert_eq!(read_to_string(&file, 7).unwrap(), "secret\n");
        assert!(read(&file, 6).is_err(), "one byte over the bound");
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        assert_eq!(
            read_to_string(&file, 16).unwrap_err().kind(),
            std::io::ErrorKind::InvalidData
        );
        let missing = read(&dir.join("missing"), 16).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
