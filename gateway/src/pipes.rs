//! The process's stdin and stdout for `guardmesh mcp stdio`.
//!
//! An MCP client starts the gateway with pipes for its stdin and stdout
//! (Python's and Rust's clients with `pipe(2)`, Node's with a socket pair,
//! as libuv makes them). tokio's `stdin()` and `stdout()` do every read and
//! write on a blocking thread, so each message in and each answer out would
//! be handed to another thread and back. When stdin and stdout are pipes or
//! sockets, they are read and written here without blocking, on the
//! runtime's own reactor instead; anything else (a terminal, a file) keeps
//! tokio's blocking-thread versions.

use tokio::io::{AsyncRead, AsyncWrite};

/// Stdin, on the reactor when it is a pipe or a socket.
pub(crate) fn stdin() -> Box<dyn AsyncRead + Unpin + Send> {
    #[cfg(unix)]
    if let Some(reader) = unix::reader() {
        return reader;
    }
    Box::new(tokio::io::stdin())
}

/// Stdout, on the reactor when it is a pipe or a socket.
pub(crate) fn stdout() -> Box<dyn AsyncWrite + Unpin + Send> {
    #[cfg(unix)]
    if let Some(writer) = unix::writer() {
        return writer;
    }
    Box::new(tokio::io::stdout())
}

#[cfg(unix)]
mod unix {
    use std::fs::File;
    use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
    use std::os::unix::fs::FileTypeExt;
    use tokio::io::{AsyncRead, AsyncWrite};
    use tokio::net::unix::pipe;

    /// What a standard descriptor is, through a copy of it: the copy as a
    /// pipe end or a socket set non-blocking (the flag is set on the pipe
    /// or socket, which the gateway alone uses: its logs go to stderr).
    enum Kind {
        Pipe(File),
        Socket(tokio::net::UnixStream),
    }

    fn kind(fd: BorrowedFd<'_>) -> Option<Kind> {
        let file = File::from(fd.try_clone_to_owned().ok()?);
        let file_type = file.metadata().ok()?.file_type();
        if file_type.is_fifo() {
            return Some(Kind::Pipe(file));
        }
        if file_type.is_socket() {
            let socket = std::os::unix::net::UnixStream::from(OwnedFd::from(file));
            socket.set_nonblocking(true).ok()?;
            return tokio::net::UnixStream::from_std(socket)
                .ok()
                .map(Kind::Socket);
        }
        None
    }

    pub(super) fn reader() -> Option<Box<dyn AsyncRead + Unpin + Send>> {
        match kind(std::io::stdin().as_fd())? {
            Kind::Pipe(file) => Some(Box::new(pipe::Receiver::from_file(file).ok()?)),
            Kind::Socket(socket) => Some(Box::new(socket)),
        }
    }

    pub(super) fn writer() -> Option<Box<dyn AsyncWrite + Unpin + Send>> {
        match kind(std::io::stdout().as_fd())? {
            Kind::Pipe(file) => Some(Box::new(pipe::Sender::from_file(file).ok()?)),
            Kind::Socket(socket) => Some(Box::new(socket)),
        }
    }
}
