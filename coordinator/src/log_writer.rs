//! The coordinator's log writer: one log record is one line, whatever a client sent.
//!
//! Clients name things that end up in log records — a job's origin, corpus paths, a worker's
//! host name and advertise address, error messages quoting them — and `tracing`'s formatter
//! writes `%`-fields and messages as they are, so a `\n` in a corpus path would start a forged
//! line. `tracing_subscriber::fmt` formats each record into one buffer and hands it to the
//! writer in one `write_all`; [`EscapingWriter`] escapes, in that buffer, every line break
//! but the final one and every other control character (`\n`, `\r`, `\u{85}`, `\u{2028}`,
//! `\x1b` when colours are off, ...) as Rust escapes, so the escaping holds at one place for
//! every field and message.

use std::borrow::Cow;
use std::io::{self, Write};
use tracing_subscriber::fmt::MakeWriter;

/// Standard error through an [`EscapingWriter`] (the coordinator's log).
#[derive(Debug, Clone, Copy)]
pub struct EscapingStderr {
    /// Whether the formatter writes colours (ESC sequences of its own are then kept).
    ansi: bool,
}

impl EscapingStderr {
    /// A writer for records formatted with (`ansi`) or without colours.
    pub fn new(ansi: bool) -> Self {
        EscapingStderr { ansi }
    }
}

impl<'a> MakeWriter<'a> for EscapingStderr {
    type Writer = EscapingWriter<io::Stderr>;

    fn make_writer(&'a self) -> Self::Writer {
        EscapingWriter::new(io::stderr(), self.ansi)
    }
}

/// Writes each buffer it is given as one record: see the module documentation.
#[derive(Debug)]
pub struct EscapingWriter<W> {
    /// Where the escaped record goes.
    inner: W,
    /// Keep ESC (the formatter's colours).
    ansi: bool,
}

impl<W: Write> EscapingWriter<W> {
    /// Escapes into `inner`; `ansi` keeps ESC characters (colours).
    pub fn new(inner: W, ansi: bool) -> Self {
        EscapingWriter { inner, ansi }
    }
}

impl<W: Write> Write for EscapingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write_all(&escape_record(buf, self.ansi))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// `record` with every control character but a final `\n` (and tabs, and ESC when
/// `keep_esc`) written as a Rust escape (`\n`, `\r`, `\u{85}`). Bytes that are not UTF-8 are
/// written as `\xNN`.
pub fn escape_record(record: &[u8], keep_esc: bool) -> Cow<'_, [u8]> {
    let (body, newline) = match record.strip_suffix(b"\n") {
        Some(body) => (body, true),
        None => (record, false),
    };
    let text = String::from_utf8_lossy(body);
    let lossy = matches!(text, Cow::Owned(_));
    if !lossy && !text.chars().any(|c| needs_escape(c, keep_esc)) {
        return Cow::Borrowed(record);
    }
    let mut out = String::with_capacity(record.len() + 16);
    if lossy {
        // Not UTF-8 (the formatter writes Strings, so this is only a safety net).
        for &b in body {
            if b.is_ascii() && !needs_escape(b as char, keep_esc) {
                out.push(b as char);
            } else {
                out.push_str(&format!("\\x{b:02x}"));
            }
        }
    } else {
        for c in text.chars() {
            if needs_escape(c, keep_esc) {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
    }
    if newline {
        out.push('\n');
    }
    Cow::Owned(out.into_bytes())
}

/// Whether `c` would break or disguise a log line.
fn needs_escape(c: char, keep_esc: bool) -> bool {
    match c {
        '\t' => false,
        '\x1b' => !keep_esc,
        '\u{2028}' | '\u{2029}' => true,
        c => c.is_control(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_breaks_inside_a_record_are_escaped_and_the_last_kept() {
        let record = b"INFO job submitted origin=a\nERROR forged\r\n";
        let out = escape_record(record, false);
        assert_eq!(&*out, b"INFO job submitted origin=a\\nERROR forged\\r\n");
        let plain = b"INFO plain\ttext\n";
        assert!(matches!(escape_record(plain, false), Cow::Borrowed(_)));
        assert_eq!(&*escape_record(b"\x1b[1mx\n", true), b"\x1b[1mx\n");
        assert_eq!(&*escape_record(b"\x1b[1mx\n", false), b"\\u{1b}[1mx\n");
        assert_eq!(
            &*escape_record("a\u{2028}b\u{85}\n".as_bytes(), false),
            b"a\\u{2028}b\\u{85}\n"
        );
    }
}
