//! Spill files: tokenised documents and built instances kept on disk (unnamed temporary files,
//! deleted when dropped) so that memory does not grow with the corpus. Only an offset per
//! record (8 bytes) stays in memory, which also gives random access (NSP's random documents,
//! the shuffled write-out).
//!
//! Record layouts (little-endian u32 words):
//! - document: `n_sentences`, then per sentence `len, ids...`;
//! - instance: `len, segment_b, nsp (u32::MAX = none), ids...`.
//!
//! # Layout
//! - [`SpillWriter`] / [`Spill`]: append records, then read record `i`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Errors of a spill file (always I/O; the spill lives in the output folder).
#[derive(Debug, thiserror::Error)]
#[error("spill file in {dir}: {source}")]
pub struct SpillError {
    /// The folder holding the temporary file.
    pub dir: PathBuf,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// Appends u32-word records to an unnamed temporary file.
pub struct SpillWriter {
    /// Folder of the temporary file (for errors).
    dir: PathBuf,
    /// Buffered temporary file.
    out: BufWriter<File>,
    /// Byte offset of each record, plus the end.
    offsets: Vec<u64>,
    /// Bytes written.
    pos: u64,
}

impl SpillWriter {
    /// A new spill in `dir`. Errors: `SpillError`.
    pub fn new(dir: &Path) -> Result<Self, SpillError> {
        let file = tempfile::tempfile_in(dir).map_err(|source| SpillError {
            dir: dir.to_path_buf(),
            source,
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, file),
            offsets: vec![0],
            pos: 0,
        })
    }

    /// Appends one record made of `words`. Errors: `SpillError`.
    pub fn push(&mut self, words: &[u32]) -> Result<(), SpillError> {
        let mut bytes = Vec::with_capacity(words.len() * 4);
        for w in words {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        self.out.write_all(&bytes).map_err(|source| SpillError {
            dir: self.dir.clone(),
            source,
        })?;
        self.pos += bytes.len() as u64;
        self.offsets.push(self.pos);
        Ok(())
    }

    /// Records written.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Flushes and switches to reading. Errors: `SpillError`.
    pub fn finish(self) -> Result<Spill, SpillError> {
        let dir = self.dir.clone();
        let file = self.out.into_inner().map_err(|e| SpillError {
            dir: dir.clone(),
            source: e.into_error(),
        })?;
        Ok(Spill {
            dir,
            file,
            offsets: self.offsets,
        })
    }
}

/// A finished spill: random access to its records.
pub struct Spill {
    /// Folder of the temporary file (for errors).
    dir: PathBuf,
    /// The temporary file.
    file: File,
    /// Byte offset of each record, plus the end.
    offsets: Vec<u64>,
}

impl Spill {
    /// Records held.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of record `i` in u32 words (0 past the end), without reading it: for a document,
    /// its tokens plus one word per sentence and one for the count.
    pub fn words(&self, i: usize) -> u64 {
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&start), Some(&end)) => (end - start) / 4,
            _ => 0,
        }
    }

    /// Record `i` as u32 words (`i < len()`, else an empty record). Errors: `SpillError`.
    pub fn read(&self, i: usize) -> Result<Vec<u32>, SpillError> {
        let (Some(&start), Some(&end)) = (self.offsets.get(i), self.offsets.get(i + 1)) else {
            return Ok(Vec::new());
        };
        let mut bytes = vec![0u8; (end - start) as usize];
        self.file
            .read_exact_at(&mut bytes, start)
            .map_err(|source| SpillError {
                dir: self.dir.clone(),
                source,
            })?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// A tokenised document: its sentences' token ids, none empty.
pub type TokenizedDoc = Vec<Vec<u32>>;

/// Encodes a document as spill words.
pub fn doc_to_words(doc: &[Vec<u32>]) -> Vec<u32> {
    let mut words = Vec::with_capacity(1 + doc.iter().map(|s| s.len() + 1).sum::<usize>());
    words.push(doc.len() as u32);
    for s in doc {
        words.push(s.len() as u32);
        words.extend_from_slice(s);
    }
    words
}

/// Decodes spill words into a document (malformed words give what could be read).
pub fn words_to_doc(words: &[u32]) -> TokenizedDoc {
    let mut doc = Vec::new();
    let Some((&n, mut rest)) = words.split_first() else {
        return doc;
    };
    for _ in 0..n {
        let Some((&len, tail)) = rest.split_first() else {
            break;
        };
        let len = (len as usize).min(tail.len());
        doc.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    doc
}
