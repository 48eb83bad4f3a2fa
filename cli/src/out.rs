//! Standard output for the commands whose work is a report. A reader that
//! stops early (`guardmesh replay --json | head`) is not an error: the rest
//! of the report has nowhere to go, so it is dropped and the command ends
//! as it would have, without a panic or an error text.
//!
//! Signals are left alone: with `SIGPIPE` at its default, a write to a
//! closed socket (the demo's in-process mesh, a client's connection) would
//! end the process too.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once stdout's reader has gone.
static GONE: AtomicBool = AtomicBool::new(false);

/// Writes `args` to stdout, and nothing once its reader has gone. Another
/// failure to write is said on stderr once.
pub(crate) fn write(args: fmt::Arguments<'_>) {
    if GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(error) = out.write_fmt(args).and_then(|()| out.flush())
        && !GONE.swap(true, Ordering::Relaxed)
        && error.kind() != std::io::ErrorKind::BrokenPipe
    {
        eprintln!("error: cannot write to stdout: {error}");
    }
}

/// Whether stdout's reader has gone: a command that would go on writing
/// (`guardmesh log show --follow | head`) can stop.
pub(crate) fn gone() -> bool {
    GONE.load(Ordering::Relaxed)
}

/// `println!` for reports (see the module's documentation).
macro_rules! outln {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` for reports.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}
