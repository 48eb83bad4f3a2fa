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
//!
//! Non-blocking is a flag of the pipe's or socket's open file description,
//! which the gateway shares with whoever else holds the same descriptor (a
//! shell script that runs the gateway and then writes to the same stdout):
//! the flags are put back as they were found when the gateway is done with
//! its stdin and stdout.

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
    use std::io::IoSlice;
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
    use std::os::unix::fs::FileTypeExt;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
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
        let stdin = std::io::stdin();
        let flags = Flags::save(stdin.as_fd())?;
        match kind(stdin.as_fd())? {
            Kind::Pipe(file) => Some(Box::new(Restoring {
                inner: pipe::Receiver::from_file(file).ok()?,
                _flags: flags,
            })),
            Kind::Socket(socket) => Some(Box::new(Restoring {
                inner: socket,
                _flags: flags,
            })),
        }
    }

    pub(super) fn writer() -> Option<Box<dyn AsyncWrite + Unpin + Send>> {
        let stdout = std::io::stdout();
        let flags = Flags::save(stdout.as_fd())?;
        match kind(stdout.as_fd())? {
            Kind::Pipe(file) => Some(Box::new(Restoring {
                inner: pipe::Sender::from_file(file).ok()?,
                _flags: flags,
            })),
            Kind::Socket(socket) => Some(Box::new(Restoring {
                inner: socket,
                _flags: flags,
            })),
        }
    }

    /// A standard descriptor's file status flags as found, put back on drop
    /// (through the standard descriptor itself, which stays open for the
    /// life of the process and shares the open file description).
    struct Flags {
        fd: RawFd,
        flags: libc::c_int,
    }

    impl Flags {
        fn save(fd: BorrowedFd<'_>) -> Option<Self> {
            let fd = fd.as_raw_fd();
            // SAFETY: F_GETFL reads the flags of a descriptor that is open
            // (borrowed); it touches no memory.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            (flags >= 0).then_some(Self { fd, flags })
        }
    }

    impl Drop for Flags {
        fn drop(&mut self) {
            // SAFETY: F_SETFL on a standard descriptor, which is never
            // closed while the process runs; it touches no memory.
            unsafe {
                libc::fcntl(self.fd, libc::F_SETFL, self.flags);
            }
        }
    }

    /// A reader or writer that puts its descriptor's flags back when it is
    /// dropped (after `inner`, fields drop in order).
    struct Restoring<T> {
        inner: T,
        _flags: Flags,
    }

    impl<T: AsyncRead + Unpin> AsyncRead for Restoring<T> {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
        }
    }

    impl<T: AsyncWrite + Unpin> AsyncWrite for Restoring<T> {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
        }

        fn is_write_vectored(&self) -> bool {
            self.inner.is_write_vectored()
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }
}
