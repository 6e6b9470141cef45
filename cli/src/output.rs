//! Printing for a Unix tool that also talks to the network.
//!
//! `keel jobs | head` closes stdout under us. Rust's `println!` would panic on that, and the
//! usual cure (SIGPIPE back to its default) is wrong here: hyper writes to sockets with
//! `writev`, which raises SIGPIPE too, so a coordinator that drops the connection (a plaintext
//! call to a TLS server) would kill `keel` without a word. So SIGPIPE stays ignored, and:
//! - a line for stdout that cannot be written is an error the command returns (`?`), so its
//!   destructors run (`keel local` stops its cluster) before `main` ends quietly with status 0
//!   when the cause was a closed pipe ([`is_closed_pipe`]);
//! - a line for stderr that cannot be written is dropped: diagnostics must never be what fails.

use std::fmt;
use std::io::{ErrorKind, Write};

/// stdout's reader has gone (`keel jobs | head` after its lines): not a failure of the command.
/// Its own type, so that it is never confused with a broken pipe on a network connection.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct StdoutClosed;

/// Writes one line to stdout.
///
/// Errors: [`StdoutClosed`] when the reader of a pipe has gone; other write errors as they are.
pub fn stdout_line(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    match writeln!(std::io::stdout().lock(), "{args}") {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(anyhow::Error::new(e).context("writing to stdout")),
    }
}

/// Writes one line to stderr; a failed write is ignored (there is nowhere left to report it).
pub fn stderr_line(args: fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// Whether `error` is [`StdoutClosed`] (the user's `| head` is done reading).
pub fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| cause.is::<StdoutClosed>())
}

/// `println!` that returns the write's error from the enclosing function (`?`, so destructors
/// run), for a command returning `anyhow::Result`.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::output::stdout_line(format_args!($($arg)*))? };
}

/// `eprintln!` that neither panics nor fails when stderr is closed.
macro_rules! errln {
    ($($arg:tt)*) => { $crate::output::stderr_line(format_args!($($arg)*)) };
}

pub(crate) use {errln, outln};
