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
//!
//! Stderr ([`Stderr`]): the gateway's own log lines and the upstream's
//! stderr lines go through one bounded queue to one writer thread, so that
//! a log line never blocks the relay: when nobody reads the gateway's
//! stderr and the queue is full, lines are dropped and counted, and the
//! count is written as soon as stderr takes lines again.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};

/// Bytes of stderr lines the queue holds at most; past it lines are
/// dropped and counted.
pub const STDERR_QUEUE_BYTES: usize = 256 << 10;

/// A bounded queue of lines in front of a writer on its own thread; see the
/// module's documentation.
pub struct Stderr {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<Queue>,
    /// Signalled when a line is queued, and when the queue is written out.
    changed: Condvar,
    dropped: AtomicU64,
    max_bytes: usize,
}

#[derive(Default)]
struct Queue {
    lines: VecDeque<Vec<u8>>,
    bytes: usize,
    /// The writer is writing a line taken off the queue.
    writing: bool,
    /// The writer should report the dropped count now.
    report: bool,
}

impl Stderr {
    /// A queue of at most `max_bytes` in front of `out`, written by a thread
    /// of its own.
    pub fn new(out: impl Write + Send + 'static, max_bytes: usize) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            changed: Condvar::new(),
            dropped: AtomicU64::new(0),
            max_bytes,
        });
        let writer = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("guardmesh-stderr".into())
            .spawn(move || writer.write_out(out));
        if spawned.is_err() {
            // No thread: every line is dropped (and counted), nothing blocks.
            shared.lock().writing = true;
        }
        Self { shared }
    }

    /// Queues `line` (a whole line, its newline included); drops and counts
    /// it when the queue is full. Never blocks on the output.
    pub fn offer(&self, line: Vec<u8>) -> bool {
        let mut queue = self.shared.lock();
        if queue.bytes + line.len() > self.shared.max_bytes {
            drop(queue);
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        queue.bytes += line.len();
        queue.lines.push_back(line);
        drop(queue);
        self.shared.changed.notify_all();
        true
    }

    /// Lines dropped so far.
    #[cfg(test)]
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Waits (at most `within`) until every queued line and the count of
    /// dropped ones are written; whether they were.
    pub fn flush(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut queue = self.shared.lock();
        queue.report = true;
        self.shared.changed.notify_all();
        loop {
            if queue.lines.is_empty() && !queue.writing && !queue.report {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            queue = self
                .shared
                .changed
                .wait_timeout(queue, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The writer thread: writes lines as they come; after each, reports
    /// lines dropped since the last report. Stops writing (lines are then
    /// dropped as they come) if `out` fails.
    fn write_out(&self, mut out: impl Write) {
        let mut reported = 0;
        let mut broken = false;
        loop {
            let line = {
                let mut queue = self.lock();
                queue.writing = false;
                self.changed.notify_all();
                while queue.lines.is_empty() && !queue.report {
                    queue = self
                        .changed
                        .wait(queue)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                let line = queue.lines.pop_front();
                if let Some(line) = &line {
                    queue.bytes -= line.len();
                }
                queue.writing = true;
                queue.report = false;
                line
            };
            if broken {
                continue;
            }
            if let Some(line) = line {
                broken = out.write_all(&line).and_then(|()| out.flush()).is_err();
            }
            let dropped = self.dropped.load(Ordering::Relaxed);
            if !broken && dropped > reported {
                let text = format!(
                    "guardmesh: {} stderr lines dropped: stderr was not read as fast as \
                     they came ({dropped} since the start)\n",
                    dropped - reported
                );
                broken = out
                    .write_all(text.as_bytes())
                    .and_then(|()| out.flush())
                    .is_err();
                reported = dropped;
            }
        }
    }
}

/// The process's stderr behind the queue ([`Stderr`]).
pub fn stderr() -> &'static Stderr {
    static STDERR: OnceLock<Stderr> = OnceLock::new();
    STDERR.get_or_init(|| Stderr::new(std::io::stderr(), STDERR_QUEUE_BYTES))
}

/// A log writer onto [`stderr`]: each event (one formatted line, written
/// with one call) is queued whole.
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        stderr().offer(buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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
