//! The settings of the prepare pipeline (`super::prepare`): [`PrepareOptions`], and where the
//! vocabulary comes from ([`VocabSource`]).

use keel_proto::jobspec::Vocabulary;
use std::path::PathBuf;

use super::manifest::Objective;

/// Where the vocabulary comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VocabSource {
    /// Train a WordPiece vocabulary of `vocab_size` tokens on the corpus.
    Train {
        /// Target vocabulary size (special tokens included).
        vocab_size: usize,
        /// Lowercase + strip accents (uncased) or not.
        lowercase: bool,
    },
    /// Load `vocab.txt` (with `lowercase`) or a `tokenizer.json` (its own normaliser decides).
    File {
        /// The file; a name ending in `.json` is read as `tokenizer.json`.
        path: PathBuf,
        /// Lowercase for a `vocab.txt` (ignored for `tokenizer.json`).
        lowercase: bool,
    },
}

/// Settings of [`prepare`](super::prepare::prepare).
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareOptions {
    /// Corpus files, directories or globs.
    pub corpus: Vec<PathBuf>,
    /// Vocabulary to train or load.
    pub vocab: VocabSource,
    /// `mlm` (packing) or `mlm+nsp` (BERT pairs).
    pub objective: Objective,
    /// Sequence length in tokens, `[CLS]`/`[SEP]` included (at least 8).
    pub max_seq_length: usize,
    /// Number of training shards (at least 1).
    pub shards: usize,
    /// Seed of every random choice.
    pub seed: u64,
    /// Output folder (created if missing).
    pub out_dir: PathBuf,
    /// Fraction of sequences held out for evaluation, in `[0, 0.5]`.
    pub heldout_fraction: f64,
    /// Hold out that fraction of the documents, whole, instead of the instances (the same
    /// text at every `max_seq_length`: a job with phases; `super::build_instances`).
    pub heldout_by_document: bool,
    /// Tokeniser threads (at least 1; the reader and writer run beside them).
    pub threads: usize,
    /// Skip lines of invalid UTF-8 (counted) instead of failing.
    pub skip_invalid_lines: bool,
    /// Probability of a short NSP target length (BERT: 0.1).
    pub short_seq_prob: f64,
    /// The model's `vocab_size`, if known: a larger vocabulary is refused before training.
    pub model_vocab_size: Option<usize>,
    /// Show a progress bar on stderr (only drawn when stderr is a terminal).
    pub show_progress: bool,
}

impl PrepareOptions {
    /// Options with BERT's defaults: 128 tokens, 1 shard, seed 12345, 1% heldout, 1 thread,
    /// short_seq_prob 0.1, no progress bar.
    pub fn new(
        corpus: Vec<PathBuf>,
        vocab: VocabSource,
        objective: Objective,
        out_dir: PathBuf,
    ) -> Self {
        Self {
            corpus,
            vocab,
            objective,
            max_seq_length: 128,
            shards: 1,
            seed: 12345,
            out_dir,
            heldout_fraction: 0.01,
            heldout_by_document: false,
            threads: 1,
            skip_invalid_lines: false,
            short_seq_prob: 0.1,
            model_vocab_size: None,
            show_progress: false,
        }
    }
}

impl PrepareOptions {
    /// Options from a job file's `[data]` section: its corpus, vocabulary, objective, length,
    /// heldout fraction and shards (`0` = `world_size` shards), with `seed` and `threads`.
    pub fn from_spec(
        spec: &keel_proto::jobspec::DataSpec,
        out_dir: PathBuf,
        world_size: usize,
        seed: u64,
        threads: usize,
    ) -> Self {
        let vocab = match &spec.vocabulary {
            Vocabulary::File(path) => VocabSource::File {
                path: path.clone(),
                lowercase: spec.lowercase,
            },
            Vocabulary::Train { vocab_size } => VocabSource::Train {
                vocab_size: *vocab_size,
                lowercase: spec.lowercase,
            },
        };
        let mut o = PrepareOptions::new(
            spec.corpus.iter().map(PathBuf::from).collect(),
            vocab,
            spec.objective,
            out_dir,
        );
        o.max_seq_length = spec.max_seq_length;
        o.heldout_fraction = spec.heldout_fraction;
        o.shards = if spec.shards == 0 {
            world_size.max(1)
        } else {
            spec.shards
        };
        o.seed = seed;
        o.threads = threads.max(1);
        o
    }
}
