//! Writing to stdout and stderr without panicking. `print!`, `println!` and `eprintln!` panic
//! when a write fails (a closed pipe, a full disk); the binaries write through this module
//! instead.
//!
//! * A closed pipe ends the process the way it ends `cat` or `grep`: [`die_on_closed_pipe`]
//!   restores the default action of SIGPIPE (the Rust runtime sets it to "ignore"), so the first
//!   write to a pipe whose reader has gone kills the process silently — status 141 in a shell.
//!   Where SIGPIPE is blocked and the write returns `EPIPE` instead, [`Stdout`] exits quietly
//!   with that same status.
//! * Any other error writing stdout (a full disk) is a [`WriteError`] naming stdout, for the
//!   binary to report and exit 1.
//! * Errors writing stderr are dropped ([`note!`](crate::note)): there is nowhere left to
//!   report them.

use std::fmt;
use std::io::{self, Write};

/// The status a shell reports for a process killed by SIGPIPE (128 + 13).
pub const CLOSED_PIPE_STATUS: i32 = 128 + 13;

/// Restores SIGPIPE's default action (terminate). Call from `main` before any thread exists; a
/// server keeps the Rust runtime's "ignore" (a client hanging up must fail one write only).
pub fn die_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: `signal` with `SIG_DFL` installs no handler; it only resets the disposition the
    // Rust runtime set before `main`, before any thread of ours exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[derive(Debug, thiserror::Error)]
#[error("writing to stdout: {0}")]
pub struct WriteError(#[source] pub io::Error);

/// Locked stdout whose writes report errors instead of panicking.
pub struct Stdout {
    inner: io::StdoutLock<'static>,
}

impl Stdout {
    pub fn lock() -> Stdout {
        Stdout {
            inner: io::stdout().lock(),
        }
    }

    /// Writes `text` (buffered until a newline or [`Stdout::flush`]).
    pub fn write(&mut self, text: &str) -> Result<(), WriteError> {
        self.inner.write_all(text.as_bytes()).map_err(fail)
    }

    /// Writes `text` and a newline.
    pub fn line(&mut self, text: &str) -> Result<(), WriteError> {
        self.write(text)?;
        self.write("\n")
    }

    /// Pushes buffered text out, so that streamed tokens show at once and a full disk is
    /// reported before the process exits (the runtime's flush at exit ignores errors).
    pub fn flush(&mut self) -> Result<(), WriteError> {
        self.inner.flush().map_err(fail)
    }
}

fn fail(e: io::Error) -> WriteError {
    if e.kind() == io::ErrorKind::BrokenPipe {
        // Whoever read our output has stopped reading: that is not an error to report.
        std::process::exit(CLOSED_PIPE_STATUS);
    }
    WriteError(e)
}

/// Writes one line to stderr, dropping any error. Use through [`note!`](crate::note).
pub fn note_line(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args);
    let _ = err.write_all(b"\n");
}

/// `eprintln!` that never panics: a line on stderr, or nothing if stderr cannot be written.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::cli::output::note_line(format_args!($($arg)*))
    };
}
