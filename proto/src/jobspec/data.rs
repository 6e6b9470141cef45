//! `[data]`: where the text is, which vocabulary, and how sequences are built and masked.
//!
//! The vocabulary is either trained on the corpus (`vocab_size`) or read from a file
//! (`vocab`): two optional keys in the file, one [`Vocabulary`] in the code. [`DataTable`] is
//! the section as written; [`DataSpec`] is the section once the choice is made.

use super::error::SpecError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Training objective (BERT paper, section 3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Objective {
    /// Masked LM only, RoBERTa-style full-sentence packing.
    #[serde(rename = "mlm")]
    Mlm,
    /// Masked LM plus next-sentence prediction, the original BERT instances.
    #[serde(rename = "mlm+nsp")]
    MlmNsp,
}

impl Objective {
    /// The name used in job files and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Mlm => "mlm",
            Objective::MlmNsp => "mlm+nsp",
        }
    }
}

/// Where the job's WordPiece vocabulary comes from: `data.vocab_size` or `data.vocab`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Vocabulary {
    /// `vocab_size = N`: train a vocabulary of `N` entries (tokens) on the corpus.
    Train {
        /// Entries to train, 100 to 1,000,000.
        vocab_size: usize,
    },
    /// `vocab = "PATH"`: this `vocab.txt` or `tokenizer.json`.
    File(PathBuf),
}

/// `[data]`: where the text is and how it becomes masked sequences.
///
/// In TOML and JSON it is the [`DataTable`] it was read from: the same keys, so job files and
/// stored specs read as before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DataTable", into = "DataTable")]
pub struct DataSpec {
    /// Files, directories or globs of UTF-8 text (BERT layout), `.gz`, or `.jsonl` with `text`.
    pub corpus: Vec<String>,
    /// `vocab_size` or `vocab`.
    pub vocabulary: Vocabulary,
    /// Lowercase and strip accents (BERT "uncased").
    pub lowercase: bool,
    /// `mlm` or `mlm+nsp`.
    pub objective: Objective,
    /// Tokens per sequence, `[CLS]` and `[SEP]` included.
    pub max_seq_length: usize,
    /// Fraction of tokens predicted per sequence (BERT: 0.15).
    pub masked_lm_prob: f64,
    /// Upper bound on predicted tokens per sequence (BERT: 20 at length 128).
    pub max_predictions_per_seq: usize,
    /// Mask all word-pieces of a word together.
    pub whole_word_masking: bool,
    /// Static masking with this many masks per sequence; 0 = dynamic masking (a fresh mask
    /// each epoch).
    pub dupe_factor: u32,
    /// Fraction of sequences held out for evaluation.
    pub heldout_fraction: f64,
    /// How many shards the prepared corpus is split into (0 = one per worker).
    pub shards: usize,
}

/// `[data]` as written in a job file: the keys of [`DataSpec`], the vocabulary as its two
/// optional keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataTable {
    /// See [`DataSpec::corpus`].
    pub corpus: Vec<String>,
    /// Train a WordPiece vocabulary of this many entries (tokens). Exclusive with `vocab`.
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// Use this `vocab.txt` or `tokenizer.json` instead of training one.
    #[serde(default)]
    pub vocab: Option<PathBuf>,
    /// See [`DataSpec::lowercase`].
    #[serde(default = "default_true")]
    pub lowercase: bool,
    /// See [`DataSpec::objective`].
    #[serde(default = "default_objective")]
    pub objective: Objective,
    /// See [`DataSpec::max_seq_length`].
    #[serde(default = "default_max_seq_length")]
    pub max_seq_length: usize,
    /// See [`DataSpec::masked_lm_prob`].
    #[serde(default = "default_masked_lm_prob")]
    pub masked_lm_prob: f64,
    /// See [`DataSpec::max_predictions_per_seq`].
    #[serde(default = "default_max_predictions_per_seq")]
    pub max_predictions_per_seq: usize,
    /// See [`DataSpec::whole_word_masking`].
    #[serde(default)]
    pub whole_word_masking: bool,
    /// See [`DataSpec::dupe_factor`].
    #[serde(default)]
    pub dupe_factor: u32,
    /// See [`DataSpec::heldout_fraction`].
    #[serde(default = "default_heldout_fraction")]
    pub heldout_fraction: f64,
    /// See [`DataSpec::shards`].
    #[serde(default)]
    pub shards: usize,
}

fn default_true() -> bool {
    true
}
fn default_objective() -> Objective {
    Objective::Mlm
}
fn default_max_seq_length() -> usize {
    128
}
fn default_masked_lm_prob() -> f64 {
    0.15
}
fn default_max_predictions_per_seq() -> usize {
    20
}
fn default_heldout_fraction() -> f64 {
    0.01
}

impl TryFrom<DataTable> for DataSpec {
    type Error = SpecError;

    /// The section with its vocabulary chosen.
    ///
    /// Errors: both `vocab_size` and `vocab`, or neither.
    fn try_from(t: DataTable) -> Result<Self, SpecError> {
        let vocabulary = match (t.vocab_size, t.vocab) {
            (Some(_), Some(path)) => {
                return Err(SpecError::new(
                    "data.vocab",
                    format!("{:?}", Some(path)),
                    "give either data.vocab_size (train a vocabulary) or data.vocab (use a \
                     file), not both",
                ));
            }
            (None, None) => {
                return Err(SpecError::new(
                    "data.vocab_size",
                    "(missing)",
                    "give data.vocab_size (train a vocabulary) or data.vocab (a vocab.txt or \
                     tokenizer.json)",
                ));
            }
            (Some(vocab_size), None) => Vocabulary::Train { vocab_size },
            (None, Some(path)) => Vocabulary::File(path),
        };
        Ok(DataSpec {
            corpus: t.corpus,
            vocabulary,
            lowercase: t.lowercase,
            objective: t.objective,
            max_seq_length: t.max_seq_length,
            masked_lm_prob: t.masked_lm_prob,
            max_predictions_per_seq: t.max_predictions_per_seq,
            whole_word_masking: t.whole_word_masking,
            dupe_factor: t.dupe_factor,
            heldout_fraction: t.heldout_fraction,
            shards: t.shards,
        })
    }
}

impl From<DataSpec> for DataTable {
    fn from(d: DataSpec) -> Self {
        let (vocab_size, vocab) = match d.vocabulary {
            Vocabulary::Train { vocab_size } => (Some(vocab_size), None),
            Vocabulary::File(path) => (None, Some(path)),
        };
        DataTable {
            corpus: d.corpus,
            vocab_size,
            vocab,
            lowercase: d.lowercase,
            objective: d.objective,
            max_seq_length: d.max_seq_length,
            masked_lm_prob: d.masked_lm_prob,
            max_predictions_per_seq: d.max_predictions_per_seq,
            whole_word_masking: d.whole_word_masking,
            dupe_factor: d.dupe_factor,
            heldout_fraction: d.heldout_fraction,
            shards: d.shards,
        }
    }
}

impl DataSpec {
    /// The vocabulary file, when the job gives one (`data.vocab`).
    pub fn vocab_file(&self) -> Option<&PathBuf> {
        match &self.vocabulary {
            Vocabulary::File(path) => Some(path),
            Vocabulary::Train { .. } => None,
        }
    }

    /// Checks every `[data]` value on its own. The limit that depends on the model (512
    /// tokens with a preset) is a rule across sections (`JobSpec::validate`).
    ///
    /// Errors: the first [`SpecError`], naming the key.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.corpus.is_empty() {
            return Err(SpecError::new(
                "data.corpus",
                "[]",
                "at least one file, directory or glob",
            ));
        }
        if let Vocabulary::Train { vocab_size } = self.vocabulary
            && !(100..=1_000_000).contains(&vocab_size)
        {
            return Err(SpecError::new(
                "data.vocab_size",
                vocab_size.to_string(),
                "between 100 and 1000000",
            ));
        }
        if !(8..=8192).contains(&self.max_seq_length) {
            return Err(SpecError::new(
                "data.max_seq_length",
                self.max_seq_length.to_string(),
                "between 8 and 8192 tokens",
            ));
        }
        if !(self.masked_lm_prob > 0.0 && self.masked_lm_prob < 1.0) {
            return Err(SpecError::new(
                "data.masked_lm_prob",
                self.masked_lm_prob.to_string(),
                "a probability strictly between 0 and 1 (BERT: 0.15)",
            ));
        }
        if self.max_predictions_per_seq == 0 || self.max_predictions_per_seq > self.max_seq_length {
            return Err(SpecError::new(
                "data.max_predictions_per_seq",
                self.max_predictions_per_seq.to_string(),
                "between 1 and data.max_seq_length",
            ));
        }
        if !(0.0..0.5).contains(&self.heldout_fraction) {
            return Err(SpecError::new(
                "data.heldout_fraction",
                self.heldout_fraction.to_string(),
                "a fraction in [0, 0.5)",
            ));
        }
        Ok(())
    }
}
