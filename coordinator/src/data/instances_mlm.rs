//! MLM instances by full-sentence packing (RoBERTa, Liu et al. 2019, section 4.2
//! "FULL-SENTENCES"): each sequence of `max_seq_length` tokens is filled with consecutive
//! sentences, crossing document boundaries with an extra `[SEP]`; no NSP.
//!
//! No token is dropped: a sentence that does not fit the space left starts the next sequence,
//! and a sentence longer than a whole sequence fills the space left and continues in the next
//! ones. So the sequences' tokens, without `[CLS]`, the final `[SEP]` and the document-boundary
//! `[SEP]`s, concatenated, are exactly the corpus's tokens in order.

use super::instance::Instance;

/// Packs sentences into sequences `[CLS] tokens... [SEP]` of at most `max_seq_length` tokens.
#[derive(Debug, Clone)]
pub struct MlmPacker {
    /// Room for content per sequence (`max_seq_length - 2`).
    capacity: usize,
    /// `[CLS]` id.
    cls: u32,
    /// `[SEP]` id.
    sep: u32,
    /// Content of the sequence being filled (no `[CLS]`/final `[SEP]`).
    current: Vec<u32>,
}

impl MlmPacker {
    /// A packer for sequences of `max_seq_length` tokens (at least 3).
    pub fn new(max_seq_length: usize, cls: u32, sep: u32) -> Self {
        Self {
            capacity: max_seq_length.saturating_sub(2).max(1),
            cls,
            sep,
            current: Vec::new(),
        }
    }

    fn flush(&mut self, out: &mut Vec<Instance>) {
        if self.current.is_empty() {
            return;
        }
        let mut ids = Vec::with_capacity(self.current.len() + 2);
        ids.push(self.cls);
        ids.append(&mut self.current);
        ids.push(self.sep);
        let len = ids.len();
        out.push(Instance {
            ids,
            segment_b: len,
            nsp_label: None,
        });
    }

    /// Adds one document's sentences; returns the sequences completed meanwhile.
    pub fn push_document(&mut self, doc: &[Vec<u32>]) -> Vec<Instance> {
        let mut out = Vec::new();
        for (k, sentence) in doc.iter().enumerate() {
            if sentence.is_empty() {
                continue;
            }
            // A new document inside a non-empty sequence is marked by a [SEP].
            let boundary = k == 0 && !self.current.is_empty();
            let need = sentence.len() + usize::from(boundary);
            if self.current.len() + need <= self.capacity {
                if boundary {
                    self.current.push(self.sep);
                }
                self.current.extend_from_slice(sentence);
                continue;
            }
            if sentence.len() <= self.capacity {
                // Fits a fresh sequence: start one rather than split the sentence.
                self.flush(&mut out);
                self.current.extend_from_slice(sentence);
                continue;
            }
            // Longer than a whole sequence: fill what is left, continue in the next ones.
            if boundary {
                if self.current.len() + 2 <= self.capacity {
                    self.current.push(self.sep);
                } else {
                    self.flush(&mut out);
                }
            }
            let mut rest: &[u32] = sentence;
            while !rest.is_empty() {
                let room = self.capacity - self.current.len();
                if room == 0 {
                    self.flush(&mut out);
                    continue;
                }
                let take = room.min(rest.len());
                self.current.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
            }
        }
        out
    }

    /// Emits the last, partly filled sequence (if any).
    pub fn finish(mut self) -> Vec<Instance> {
        let mut out = Vec::new();
        self.flush(&mut out);
        out
    }
}
