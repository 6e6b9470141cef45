//! Printing for a Unix tool that also talks to the network.
//!
//! `keel jobs | head` closes stdout under us. Rust's `println!` would panic on that, and the
//! usual cure (SIGPIPE back to its default) is wrong here: hyper writes to sockets with
//! `writev`, which raises SIGPIPE too, so a coordinator that drops the connection (a plaintext
//! call to a TLS server) would kill `keel` without a word. So SIGPIPE stays ignored and a broken
//! pipe on our own output ends the program quietly, with status 0, from here.

use std::fmt;
use std::io::{ErrorKind, Write};

/// Writes one line to stdout. A closed pipe exits the process with status 0; any other write
/// error exits with status 1 after saying so on stderr.
pub fn stdout_line(args: fmt::Arguments<'_>) {
    let result = writeln!(std::io::stdout().lock(), "{args}");
    finish(result, "stdout");
}

/// Writes one line to stderr, with the same handling of a closed pipe as [`stdout_line`].
pub fn stderr_line(args: fmt::Arguments<'_>) {
    let result = writeln!(std::io::stderr().lock(), "{args}");
    finish(result, "stderr");
}

fn finish(result: std::io::Result<()>, stream: &str) {
    match result {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            // stderr itself may be what failed; nothing better is left than trying once.
            let _ = writeln!(std::io::stderr(), "keel: writing to {stream}: {e}");
            std::process::exit(1);
        }
    }
}

/// `println!` that ends `keel` quietly when stdout is a closed pipe.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::output::stdout_line(format_args!($($arg)*)) };
}

/// `eprintln!` that ends `keel` quietly when stderr is a closed pipe.
macro_rules! errln {
    ($($arg:tt)*) => { $crate::output::stderr_line(format_args!($($arg)*)) };
}

pub(crate) use {errln, outln};
