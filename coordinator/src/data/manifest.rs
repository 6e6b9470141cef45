//! `manifest.json`: what `keel prepare` produced and with which settings.

use keel_proto::tokenizer::SpecialIds;
use serde::{Deserialize, Serialize};

/// Version of the prepared-folder layout.
pub const MANIFEST_VERSION: u32 = 1;

/// Training objective (shared with the job file: `mlm` or `mlm+nsp`).
pub use keel_proto::jobspec::Objective;

/// One shard file in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the prepared folder (`shard-00000.keel`, `heldout.keel`).
    pub file: String,
    /// Sequences in the shard.
    pub sequences: u64,
    /// Tokens in the shard (`[CLS]`/`[SEP]` included).
    pub tokens: u64,
    /// Global index of its first sequence (the shard holds a contiguous range).
    pub first_global_index: u64,
    /// CRC-32C of the shard's payload (as in its header).
    pub checksum: u32,
}

/// Counts over the corpus read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorpusStats {
    /// Input files, in reading order.
    pub files: Vec<String>,
    /// Bytes of text read (decompressed).
    pub bytes: u64,
    /// Documents with at least one non-empty sentence.
    pub documents: u64,
    /// Sentences (lines) with at least one token.
    pub sentences: u64,
    /// Tokens of the corpus (no special tokens added).
    pub tokens: u64,
    /// Non-blank lines dropped because they tokenise to nothing (e.g. a lone zero-width joiner).
    pub dropped_lines: u64,
    /// Lines skipped for invalid UTF-8 (`--skip-invalid-lines`).
    pub skipped_invalid_lines: u64,
}

/// Seconds spent in each phase of `prepare` (not stored in `manifest.json`, which stays
/// byte-identical across runs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrepareTimings {
    /// Vocabulary training (0 when a vocabulary was given).
    pub train_vocab_s: f64,
    /// Reading and tokenising the corpus.
    pub tokenize_s: f64,
    /// Building instances, shuffling and writing shards.
    pub write_s: f64,
    /// Whole run.
    pub total_s: f64,
}

/// The content of `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedManifest {
    /// Layout version ([`MANIFEST_VERSION`]).
    pub version: u32,
    /// The training objective.
    pub objective: Objective,
    /// Maximum sequence length in tokens (`[CLS]`/`[SEP]` included).
    pub max_seq_length: usize,
    /// Seed of instance building, shuffling and the heldout split.
    pub seed: u64,
    /// Probability of a short target length (NSP only).
    pub short_seq_prob: f64,
    /// Fraction of sequences held out for evaluation.
    pub heldout_fraction: f64,
    /// Whether the tokenizer lowercases (HF `do_lower_case`).
    pub lowercase: bool,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// SHA-256 of `vocab.txt`, hex.
    pub vocab_hash: String,
    /// Special token ids.
    pub special: SpecialIds,
    /// Counts over the corpus.
    pub corpus: CorpusStats,
    /// Training shards, in global-index order.
    pub shards: Vec<ShardEntry>,
    /// Training sequences `N` (global indices `0..N`).
    pub total_sequences: u64,
    /// Training tokens.
    pub total_tokens: u64,
    /// The heldout shard (global indices `0..H` of its own).
    pub heldout: ShardEntry,
    /// Phase timings of the run that produced this manifest (not serialised).
    #[serde(skip)]
    pub timings: PrepareTimings,
}
