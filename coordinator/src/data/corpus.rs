//! Reading a text corpus as a stream of documents.
//!
//! Inputs are files, directories (walked recursively in name order, taking `*.txt`, `*.text`,
//! `*.jsonl` and their `.gz` forms) or glob patterns (matches in name order). Formats:
//! - text (BERT's layout): one sentence per line, a blank (whitespace-only) line ends a
//!   document, as does the end of a file;
//! - JSON Lines (`*.jsonl`): one document per line, an object with a string `text` field whose
//!   lines are the document's sentences.
//!
//! Either may be gzip-compressed (`*.gz`); byte offsets in errors then count decompressed bytes.
//! Memory: one document at a time. Bounds (see `keel_proto::limits` for why these numbers):
//! only regular files are read (never a device or FIFO), a line may not pass
//! [`MAX_LINE_BYTES`], a document [`MAX_DOCUMENT_BYTES`], a file [`MAX_CORPUS_FILE_BYTES`].
//!
//! # Layout
//! - [`resolve_inputs`]: paths/directories/globs to an ordered file list.
//! - [`DocumentReader`]: an iterator of [`Document`]s over those files.
//! - [`CorpusError`]: bad input, naming the file, line and byte offset.

use keel_proto::limits::{
    LimitError, MAX_CORPUS_FILE_BYTES, MAX_DOCUMENT_BYTES, MAX_LINE_BYTES, open_regular,
    read_line_bounded,
};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// Errors reading a corpus.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    /// An input path does not exist (and is not a glob matching something).
    #[error("{path}: no such file, directory, or matching glob")]
    NotFound {
        /// The argument as given.
        path: PathBuf,
    },
    /// A glob pattern is malformed.
    #[error("{pattern}: invalid glob pattern: {reason}")]
    BadGlob {
        /// The pattern.
        pattern: String,
        /// The parser's message.
        reason: String,
    },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line is not valid UTF-8.
    #[error(
        "{path}: invalid UTF-8 at byte offset {offset} (line {line}); fix the file or pass \
         --skip-invalid-lines to skip such lines"
    )]
    InvalidUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte (in the decompressed stream for `.gz`).
        offset: u64,
        /// 1-based line number.
        line: u64,
    },
    /// A JSON Lines line is not an object with a string `text` field.
    #[error("{path}: line {line}: {reason} (expected a JSON object with a string \"text\" field)")]
    BadJsonLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What was wrong.
        reason: String,
    },
    /// A bound was exceeded: not a regular file, a line longer than
    /// [`keel_proto::limits::MAX_LINE_BYTES`], a file longer than
    /// [`keel_proto::limits::MAX_CORPUS_FILE_BYTES`] (the error names the file and the limit).
    #[error(transparent)]
    Limit(#[from] keel_proto::limits::LimitError),
    /// A document (lines up to a blank line) is larger than
    /// [`keel_proto::limits::MAX_DOCUMENT_BYTES`]: it would be held in memory whole.
    #[error(
        "{path}: the document ending at line {line} is larger than the {limit}-byte document \
         limit; separate documents with blank lines"
    )]
    DocumentTooLarge {
        /// The file.
        path: PathBuf,
        /// 1-based line where the limit was passed.
        line: u64,
        /// The limit in bytes.
        limit: u64,
    },
    /// The inputs name no file at all.
    #[error("no corpus files found in {inputs}")]
    NoFiles {
        /// The arguments, joined.
        inputs: String,
    },
}

/// One document: its sentences (lines) in order, untokenised, never empty strings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Document {
    /// The sentences, each a non-blank line of the input.
    pub sentences: Vec<String>,
    /// Bytes of input text this document came from (sentences plus line ends and blank lines).
    pub bytes: u64,
}

/// Input file format, from the file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CorpusFormat {
    /// BERT's layout: a sentence per line, blank lines between documents.
    Text,
    /// JSON Lines with a `text` field, one document per line.
    JsonLines,
}

impl CorpusFormat {
    /// Format and gzip flag of `path`, from its name (`.jsonl`, `.jsonl.gz`, `.gz`, else text).
    pub fn of(path: &Path) -> (CorpusFormat, bool) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        let gz = name.ends_with(".gz");
        let base = name.strip_suffix(".gz").unwrap_or(&name);
        let format = if base.ends_with(".jsonl") {
            CorpusFormat::JsonLines
        } else {
            CorpusFormat::Text
        };
        (format, gz)
    }
}

fn is_corpus_name(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    if name.starts_with('.') {
        return false;
    }
    let base = name.strip_suffix(".gz").unwrap_or(&name);
    base.ends_with(".txt") || base.ends_with(".text") || base.ends_with(".jsonl")
}

fn walk_dir(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), CorpusError> {
    let io = |source| CorpusError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io)?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk_dir(&path, out)?;
        } else if path.is_file() && is_corpus_name(&path) {
            out.push(path);
        }
    }
    Ok(())
}

/// Expands the `--corpus` arguments to files, in a deterministic order: each argument in the
/// order given; a directory's corpus files (`*.txt`, `*.text`, `*.jsonl`, optionally `.gz`)
/// recursively in name order; a glob's matches in name order. A file named explicitly is taken
/// whatever its name. Duplicates are kept once (first occurrence).
///
/// Errors: `NotFound`, `BadGlob`, `Io`, `NoFiles`.
pub fn resolve_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, CorpusError> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_file() {
            files.push(input.clone());
        } else if input.is_dir() {
            walk_dir(input, &mut files)?;
        } else {
            let pattern = input.to_string_lossy().to_string();
            if !pattern.contains(['*', '?', '[']) {
                return Err(CorpusError::NotFound {
                    path: input.clone(),
                });
            }
            let paths = glob::glob(&pattern).map_err(|e| CorpusError::BadGlob {
                pattern: pattern.clone(),
                reason: e.to_string(),
            })?;
            let mut matched = Vec::new();
            for p in paths {
                let p = p.map_err(|e| CorpusError::Io {
                    path: e.path().to_path_buf(),
                    source: std::io::Error::new(e.error().kind(), e.error().to_string()),
                })?;
                if p.is_file() {
                    matched.push(p);
                } else if p.is_dir() {
                    walk_dir(&p, &mut matched)?;
                }
            }
            if matched.is_empty() {
                return Err(CorpusError::NotFound {
                    path: input.clone(),
                });
            }
            matched.sort();
            files.extend(matched);
        }
    }
    let mut seen = std::collections::HashSet::new();
    files.retain(|f| seen.insert(f.clone()));
    if files.is_empty() {
        return Err(CorpusError::NoFiles {
            inputs: inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" "),
        });
    }
    Ok(files)
}

/// Counters kept while reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes of text read (decompressed).
    pub bytes: u64,
    /// Lines skipped because they were not valid UTF-8 (only with `skip_invalid_lines`).
    pub skipped_invalid_lines: u64,
}

/// Iterates over the documents of a list of files, in order. Yields `Err` once on bad input
/// and then ends.
pub struct DocumentReader {
    /// Files still to open, in reverse (popped from the end).
    pending: Vec<PathBuf>,
    /// The file being read.
    current: Option<OpenFile>,
    /// Skip lines with invalid UTF-8 instead of failing.
    skip_invalid_lines: bool,
    /// Counters.
    stats: ReadStats,
    /// Set after an error: the iterator is finished.
    failed: bool,
}

struct OpenFile {
    path: PathBuf,
    format: CorpusFormat,
    reader: Box<dyn BufRead + Send>,
    /// Bytes consumed so far (decompressed).
    offset: u64,
    /// Lines consumed so far.
    line: u64,
}

impl DocumentReader {
    /// A reader over `files` (as [`resolve_inputs`] returns them).
    pub fn new(files: Vec<PathBuf>, skip_invalid_lines: bool) -> Self {
        let mut pending = files;
        pending.reverse();
        Self {
            pending,
            current: None,
            skip_invalid_lines,
            stats: ReadStats::default(),
            failed: false,
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> ReadStats {
        self.stats
    }

    fn open(path: &Path) -> Result<OpenFile, CorpusError> {
        let (file, _) = open_regular(path)?;
        let (format, gz) = CorpusFormat::of(path);
        let raw: Box<dyn Read + Send> = if gz {
            Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(file)))
        } else {
            Box::new(file)
        };
        Ok(OpenFile {
            path: path.to_path_buf(),
            format,
            reader: Box::new(BufReader::with_capacity(1 << 20, raw)),
            offset: 0,
            line: 0,
        })
    }

    /// Reads the next line of `f` as UTF-8 without its line end; `None` at end of file;
    /// `Some(None)` for a skipped invalid line.
    fn next_line(
        f: &mut OpenFile,
        skip_invalid: bool,
        stats: &mut ReadStats,
        buf: &mut Vec<u8>,
    ) -> Result<Option<Option<String>>, CorpusError> {
        let n = read_line_bounded(
            &mut f.reader,
            buf,
            MAX_LINE_BYTES,
            &f.path,
            f.line + 1,
            f.offset,
        )?;
        if n == 0 {
            return Ok(None);
        }
        if f.offset + n as u64 > MAX_CORPUS_FILE_BYTES {
            return Err(LimitError::TooLarge {
                path: f.path.clone(),
                size: f.offset + n as u64,
                limit: MAX_CORPUS_FILE_BYTES,
                what: "a corpus file (decompressed)",
            }
            .into());
        }
        let start = f.offset;
        f.offset += n as u64;
        f.line += 1;
        stats.bytes += n as u64;
        let mut end = buf.len();
        while end > 0 && (buf[end - 1] == b'\n' || buf[end - 1] == b'\r') {
            end -= 1;
        }
        buf.truncate(end);
        match String::from_utf8(std::mem::take(buf)) {
            Ok(s) => Ok(Some(Some(s))),
            Err(e) => {
                if skip_invalid {
                    stats.skipped_invalid_lines += 1;
                    Ok(Some(None))
                } else {
                    Err(CorpusError::InvalidUtf8 {
                        path: f.path.clone(),
                        offset: start + e.utf8_error().valid_up_to() as u64,
                        line: f.line,
                    })
                }
            }
        }
    }

    fn next_document(&mut self) -> Result<Option<Document>, CorpusError> {
        let mut buf = Vec::new();
        loop {
            if self.current.is_none() {
                let Some(path) = self.pending.pop() else {
                    return Ok(None);
                };
                self.current = Some(Self::open(&path)?);
            }
            let Some(f) = self.current.as_mut() else {
                continue;
            };
            let mut doc = Document::default();
            let start_bytes = self.stats.bytes;
            let done_file = match f.format {
                CorpusFormat::Text => loop {
                    match Self::next_line(f, self.skip_invalid_lines, &mut self.stats, &mut buf)? {
                        None => break true,
                        Some(None) => continue,
                        Some(Some(line)) => {
                            if line.trim().is_empty() {
                                if !doc.sentences.is_empty() {
                                    break false;
                                }
                            } else {
                                doc.sentences.push(line);
                                if self.stats.bytes - start_bytes > MAX_DOCUMENT_BYTES {
                                    return Err(CorpusError::DocumentTooLarge {
                                        path: f.path.clone(),
                                        line: f.line,
                                        limit: MAX_DOCUMENT_BYTES,
                                    });
                                }
                            }
                        }
                    }
                },
                CorpusFormat::JsonLines => loop {
                    match Self::next_line(f, self.skip_invalid_lines, &mut self.stats, &mut buf)? {
                        None => break true,
                        Some(None) => continue,
                        Some(Some(line)) => {
                            if line.trim().is_empty() {
                                continue;
                            }
                            let text =
                                json_text(&line).map_err(|reason| CorpusError::BadJsonLine {
                                    path: f.path.clone(),
                                    line: f.line,
                                    reason,
                                })?;
                            doc.sentences.extend(
                                text.lines()
                                    .filter(|l| !l.trim().is_empty())
                                    .map(str::to_string),
                            );
                            if !doc.sentences.is_empty() {
                                break false;
                            }
                        }
                    }
                },
            };
            if done_file {
                self.current = None;
            }
            doc.bytes = self.stats.bytes - start_bytes;
            if !doc.sentences.is_empty() {
                return Ok(Some(doc));
            }
        }
    }
}

fn json_text(line: &str) -> Result<String, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    match value.get("text") {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("\"text\" is not a string but {other}")),
        None => Err("no \"text\" field".to_string()),
    }
}

impl Iterator for DocumentReader {
    type Item = Result<Document, CorpusError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_document() {
            Ok(Some(doc)) => Some(Ok(doc)),
            Ok(None) => None,
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}
