//! Reading and tokenising the corpus in parallel, keeping document order, into a spill file.
//!
//! A reader thread cuts the document stream into chunks of about [`CHUNK_BYTES`]; `threads`
//! workers tokenise chunks; the calling thread puts results back in order and appends them to
//! the spill. Channels are bounded, so memory is a few chunks per thread whatever the corpus
//! size. The result does not depend on the thread count (documents are independent).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

use indicatif::ProgressBar;
use keel_proto::tokenizer::KeelTokenizer;

use super::corpus::{CorpusError, Document, DocumentReader, ReadStats};
use super::spill::{Spill, SpillError, SpillWriter, TokenizedDoc, doc_to_words};

/// Text per work item, in bytes.
pub const CHUNK_BYTES: u64 = 256 * 1024;

/// Lines joined into one tokenizer call (see `KeelTokenizer::encode_lines`).
const LINES_PER_CALL: usize = 64;

/// Errors of the tokenising pass.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// Bad input.
    #[error(transparent)]
    Corpus(#[from] CorpusError),
    /// The spill file could not be written.
    #[error(transparent)]
    Spill(#[from] SpillError),
    /// A pipeline thread panicked.
    #[error("a tokenizer thread panicked")]
    ThreadPanicked,
}

/// Counts from the tokenising pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenizeStats {
    /// Reader counters (bytes, skipped invalid lines).
    pub read: ReadStats,
    /// Documents kept (at least one sentence with tokens).
    pub documents: u64,
    /// Sentences kept.
    pub sentences: u64,
    /// Tokens kept.
    pub tokens: u64,
    /// Lines that tokenised to nothing.
    pub dropped_lines: u64,
    /// Non-blank lines seen in total.
    pub lines: u64,
}

struct Tokenized {
    docs: Vec<TokenizedDoc>,
    bytes: u64,
    dropped_lines: u64,
    lines: u64,
}

fn tokenize_chunk(tokenizer: &KeelTokenizer, docs: Vec<Document>) -> Tokenized {
    let mut out = Tokenized {
        docs: Vec::with_capacity(docs.len()),
        bytes: 0,
        dropped_lines: 0,
        lines: 0,
    };
    // Encode all lines of the chunk in groups (fewer, larger tokenizer calls), then hand the
    // ids back to their documents.
    let lines: Vec<&str> = docs
        .iter()
        .flat_map(|d| d.sentences.iter().map(String::as_str))
        .collect();
    let mut ids = Vec::with_capacity(lines.len());
    for group in lines.chunks(LINES_PER_CALL) {
        ids.extend(tokenizer.encode_lines(group));
    }
    let mut ids = ids.into_iter();
    for doc in &docs {
        out.bytes += doc.bytes;
        let mut sentences = Vec::with_capacity(doc.sentences.len());
        for sentence_ids in ids.by_ref().take(doc.sentences.len()) {
            out.lines += 1;
            if sentence_ids.is_empty() {
                out.dropped_lines += 1;
            } else {
                sentences.push(sentence_ids);
            }
        }
        if !sentences.is_empty() {
            out.docs.push(sentences);
        }
    }
    out
}

/// Tokenises `files` with `threads` worker threads (at least 1) into a document spill in
/// `spill_dir`, advancing `progress` by bytes read.
///
/// Errors: `Corpus` (bad input, naming file/line/offset), `Spill`, `ThreadPanicked`.
pub fn tokenize_corpus(
    files: Vec<PathBuf>,
    skip_invalid_lines: bool,
    tokenizer: &KeelTokenizer,
    threads: usize,
    spill_dir: &Path,
    progress: &ProgressBar,
) -> Result<(Spill, TokenizeStats), TokenizeError> {
    let threads = threads.max(1);
    let mut spill = SpillWriter::new(spill_dir)?;
    let mut stats = TokenizeStats::default();
    let read_stats = std::thread::scope(|scope| -> Result<ReadStats, TokenizeError> {
        let (chunk_tx, chunk_rx) = sync_channel::<(u64, Vec<Document>)>(threads * 2);
        let chunk_rx = Arc::new(Mutex::new(chunk_rx));
        let (res_tx, res_rx) = sync_channel::<(u64, Tokenized)>(threads * 2);
        let reader = scope.spawn(move || -> Result<ReadStats, CorpusError> {
            let mut docs = DocumentReader::new(files, skip_invalid_lines);
            let mut chunk = Vec::new();
            let mut bytes = 0u64;
            let mut index = 0u64;
            for doc in docs.by_ref() {
                let doc = doc?;
                bytes += doc.bytes;
                chunk.push(doc);
                if bytes >= CHUNK_BYTES {
                    if chunk_tx.send((index, std::mem::take(&mut chunk))).is_err() {
                        return Ok(docs.stats());
                    }
                    index += 1;
                    bytes = 0;
                }
            }
            if !chunk.is_empty() {
                let _ = chunk_tx.send((index, chunk));
            }
            Ok(docs.stats())
        });
        for _ in 0..threads {
            let rx = Arc::clone(&chunk_rx);
            let tx = res_tx.clone();
            scope.spawn(move || {
                loop {
                    let next = match rx.lock() {
                        Ok(guard) => guard.recv(),
                        Err(_) => return,
                    };
                    let Ok((index, docs)) = next else { return };
                    if tx.send((index, tokenize_chunk(tokenizer, docs))).is_err() {
                        return;
                    }
                }
            });
        }
        drop(res_tx);
        drop(chunk_rx);
        let mut pending: BTreeMap<u64, Tokenized> = BTreeMap::new();
        let mut next = 0u64;
        for (index, result) in res_rx {
            pending.insert(index, result);
            while let Some(t) = pending.remove(&next) {
                next += 1;
                progress.inc(t.bytes);
                stats.dropped_lines += t.dropped_lines;
                stats.lines += t.lines;
                for doc in &t.docs {
                    stats.documents += 1;
                    stats.sentences += doc.len() as u64;
                    stats.tokens += doc.iter().map(|s| s.len() as u64).sum::<u64>();
                    spill.push(&doc_to_words(doc))?;
                }
            }
        }
        match reader.join() {
            Ok(r) => Ok(r?),
            Err(_) => Err(TokenizeError::ThreadPanicked),
        }
    })?;
    stats.read = read_stats;
    Ok((spill.finish()?, stats))
}
