//! Bounds on what Keel reads from files that a job names: only regular files, at most a stated
//! size, lines of at most a stated length. Every limit is a constant here, so the errors and
//! the code cannot disagree (docs/security.md lists them).
//!
//! Why these numbers (each is far above any real input and far below what hurts a machine):
//! - [`MAX_CONFIG_BYTES`] (1 MiB): HF's `config.json` for BERT is about 600 bytes.
//! - [`MAX_VOCAB_BYTES`] (64 MiB): a 30,522-token BERT `vocab.txt` is 226 KiB; the largest
//!   multilingual vocabularies (250k tokens) are under 8 MiB.
//! - [`MAX_TOKENIZER_JSON_BYTES`] (256 MiB): `tokenizer.json` holds the vocabulary twice over
//!   plus settings; 256 MiB is 30x the largest vocabulary above.
//! - [`MAX_LINE_BYTES`] (16 MiB): a corpus line is a sentence (text) or a whole document
//!   (JSON Lines); a long Wikipedia article is under 1 MiB of JSON. Reading a line holds it in
//!   memory once as bytes and once as text, so 16 MiB costs at most ~32 MiB.
//! - [`MAX_DOCUMENT_BYTES`] (256 MiB): the preparation holds one document in memory while
//!   it is split into sequences; the King James Bible as a single document is 4.3 MiB.
//! - [`MAX_CORPUS_FILE_BYTES`] (1 TiB, decompressed): corpus files are streamed, so this only
//!   bounds the time spent on one file (and a gzip bomb); English Wikipedia is ~20 GiB.
//!
//! # Layout
//! - [`LimitError`]: what was exceeded, naming the file and the limit.
//! - [`open_regular`]: opens a file only if it is a regular file (not a device, FIFO, folder).
//! - [`read_bounded`], [`read_bounded_to_string`]: a whole small file, refused past a size.
//! - [`read_line_bounded`]: one line of a stream, refused past a length.

use std::fs::File;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

/// Largest model `config.json` read (bytes: 1 MiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Largest `vocab.txt` read (bytes: 64 MiB).
pub const MAX_VOCAB_BYTES: u64 = 64 << 20;
/// Largest `tokenizer.json` read (bytes: 256 MiB).
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 256 << 20;
/// Longest corpus line (bytes, line end included: 16 MiB).
pub const MAX_LINE_BYTES: u64 = 16 << 20;
/// Largest corpus document (bytes of its lines: 256 MiB).
pub const MAX_DOCUMENT_BYTES: u64 = 256 << 20;
/// Largest corpus file (bytes, decompressed: 1 TiB).
pub const MAX_CORPUS_FILE_BYTES: u64 = 1 << 40;
/// Largest JSON record Keel reads back from its own folders (manifest, trainer state, job
/// state: 64 MiB); they are a few KiB.
pub const MAX_RECORD_BYTES: u64 = 64 << 20;

/// A bound was exceeded, or the file is not a regular file.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The path is a device, FIFO, socket or folder: its size means nothing, and reading it
    /// may never end (`/dev/zero`) or block forever (a FIFO).
    #[error("{path}: not a regular file ({kind}); give a plain file")]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// The file is larger than the limit for its kind.
    #[error("{path}: {size} bytes is more than the {limit}-byte limit for {what}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size in bytes (or the bytes read before stopping).
        size: u64,
        /// The limit in bytes.
        limit: u64,
        /// What the file is (e.g. "a model config").
        what: &'static str,
    },
    /// A line is longer than [`MAX_LINE_BYTES`] (or the limit given).
    #[error(
        "{path}: line {line} is longer than the {limit}-byte line limit (no newline within \
         {limit} bytes from byte offset {offset})"
    )]
    LineTooLong {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// Byte offset where the line starts.
        offset: u64,
        /// The limit in bytes.
        limit: u64,
    },
}

fn kind_of(file_type: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if file_type.is_dir() {
        "a folder"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }
}

/// Opens `path` for reading if it is a regular file (links followed), checked on the opened
/// handle so a swap between check and open cannot slip a device in. Returns the file and its
/// size in bytes. A FIFO is opened non-blocking so that the check itself cannot hang.
///
/// Errors: [`LimitError::Io`], [`LimitError::NotRegular`].
pub fn open_regular(path: &Path) -> Result<(File, u64), LimitError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| LimitError::Io {
        path: path.to_path_buf(),
        source,
    };
    // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer. It changes
    // nothing for regular files, which are the only ones read on.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_o_nonblock())
        .open(path)
        .map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(LimitError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_of(meta.file_type()),
        });
    }
    Ok((file, meta.len()))
}

/// `O_NONBLOCK` on Linux (all architectures Keel builds for use 0o4000).
const fn libc_o_nonblock() -> i32 {
    0o4000
}

/// Reads the whole regular file `path`, refusing one over `limit` bytes (checked on the size
/// before reading, and again while reading, since a file may grow).
///
/// Errors: [`LimitError::Io`], [`LimitError::NotRegular`], [`LimitError::TooLarge`] naming
/// `what`.
pub fn read_bounded(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>, LimitError> {
    let (file, size) = open_regular(path)?;
    let too_large = |size| LimitError::TooLarge {
        path: path.to_path_buf(),
        size,
        limit,
        what,
    };
    if size > limit {
        return Err(too_large(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| LimitError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
///
/// Errors: those of [`read_bounded`]; [`LimitError::Io`] with `InvalidData` for bad UTF-8.
pub fn read_bounded_to_string(
    path: &Path,
    limit: u64,
    what: &'static str,
) -> Result<String, LimitError> {
    let bytes = read_bounded(path, limit, what)?;
    String::from_utf8(bytes).map_err(|e| LimitError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("invalid UTF-8 at byte {}", e.utf8_error().valid_up_to()),
        ),
    })
}

/// Reads one line (up to and including `\n`) of `reader` into `buf` (cleared first), holding
/// at most `limit + 1` bytes. Returns the bytes read; 0 at the end. `line` (1-based) and
/// `offset` (where the line starts) only go into the error.
///
/// Errors: [`LimitError::LineTooLong`] when no newline comes within `limit` bytes (the line
/// is not read further: the reader is left in its middle), [`LimitError::Io`].
pub fn read_line_bounded(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    limit: u64,
    path: &Path,
    line: u64,
    offset: u64,
) -> Result<usize, LimitError> {
    buf.clear();
    let n = reader
        .take(limit)
        .read_until(b'\n', buf)
        .map_err(|source| LimitError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    if n as u64 == limit && buf.last() != Some(&b'\n') {
        // Exactly `limit` bytes and no newline: the line goes on (or the file ends right
        // here, which a one-byte peek tells apart).
        let more = reader.fill_buf().map_err(|source| LimitError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if !more.is_empty() {
            return Err(LimitError::LineTooLong {
                path: path.to_path_buf(),
                line,
                offset,
                limit,
            });
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_fifos_are_refused_and_sizes_bounded() {
        match open_regular(Path::new("/dev/zero")) {
            Err(LimitError::NotRegular { kind, .. }) => assert_eq!(kind, "a character device"),
            other => panic!("{other:?}"),
        }
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        match read_bounded(&fifo, 10, "a test file") {
            Err(LimitError::NotRegular { kind, .. }) => assert_eq!(kind, "a FIFO"),
            other => panic!("{other:?}"),
        }
        let file = dir.path().join("f");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_bounded(&file, 10, "x").unwrap().len(), 10);
        let e = read_bounded(&file, 9, "a test file")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("10 bytes") && e.contains("9-byte limit for a test file"),
            "{e}"
        );
    }

    #[test]
    fn lines_are_cut_at_the_limit() {
        let p = Path::new("t.txt");
        let mut r = std::io::Cursor::new(b"abc\nabcd\nabcde".to_vec());
        let mut buf = Vec::new();
        assert_eq!(read_line_bounded(&mut r, &mut buf, 4, p, 1, 0).unwrap(), 4);
        assert_eq!(buf, b"abc\n");
        // "abcd" then "\n": four bytes and no newline yet, but more follows.
        match read_line_bounded(&mut r, &mut buf, 4, p, 2, 4) {
            Err(LimitError::LineTooLong { line, offset, .. }) => assert_eq!((line, offset), (2, 4)),
            other => panic!("{other:?}"),
        }
        // A last line of exactly the limit is accepted.
        let mut r = std::io::Cursor::new(b"abcd".to_vec());
        assert_eq!(read_line_bounded(&mut r, &mut buf, 4, p, 1, 0).unwrap(), 4);
        assert_eq!(read_line_bounded(&mut r, &mut buf, 4, p, 2, 4).unwrap(), 0);
    }
}
