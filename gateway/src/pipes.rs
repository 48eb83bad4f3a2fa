//! The process's stdin and stdout for `guardmesh mcp stdio`.
//!
//! An MCP client starts the gateway with pipes for its stdin and stdout.
//! tokio's `stdin()` and `stdout()` do every read and write on a blocking
//! thread, so each message in and each answer out would be handed to another
//! thread and back. When stdin and stdout are pipes, they are read and
//! written here as non-blocking pipes on the runtime's own reactor instead;
//! anything else (a terminal, a file) keeps tokio's blocking-thread versions.

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::either::Either;

/// Stdin, as a pipe on the reactor when it is one.
pub(crate) fn stdin() -> impl AsyncRead + Unpin + Send + 'static {
    #[cfg(unix)]
    if let Some(pipe) = unix::reader() {
        return Either::Left(pipe);
    }
    Either::Right(tokio::io::stdin())
}

/// Stdout, as a pipe on the reactor when it is one.
pub(crate) fn stdout() -> impl AsyncWrite + Unpin + Send + 'static {
    #[cfg(unix)]
    if let Some(pipe) = unix::writer() {
        return Either::Left(pipe);
    }
    Either::Right(tokio::io::stdout())
}

#[cfg(unix)]
mod unix {
    use std::os::fd::AsFd;
    use tokio::net::unix::pipe;

    /// A copy of stdin's descriptor as a non-blocking pipe reader; `None`
    /// when stdin is not a pipe (the flag is set on the pipe, which the
    /// gateway alone reads).
    pub(super) fn reader() -> Option<pipe::Receiver> {
        let fd = std::io::stdin().as_fd().try_clone_to_owned().ok()?;
        pipe::Receiver::from_file(std::fs::File::from(fd)).ok()
    }

    /// The same for stdout, written by the gateway alone (its logs go to
    /// stderr).
    pub(super) fn writer() -> Option<pipe::Sender> {
        let fd = std::io::stdout().as_fd().try_clone_to_owned().ok()?;
        pipe::Sender::from_file(std::fs::File::from(fd)).ok()
    }
}
