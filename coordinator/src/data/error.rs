//! [`PrepareError`]: what can go wrong preparing a corpus or opening a prepared folder.

use super::corpus::CorpusError;
use super::spill::SpillError;
use super::tokenize::TokenizeError;
use keel_proto::shard::ShardError;
use keel_proto::tokenizer::TokenizerError;
use std::path::PathBuf;

/// Errors of the prepare pipeline and of opening a prepared folder.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// Bad corpus input (file, line, offset named).
    #[error(transparent)]
    Corpus(#[from] CorpusError),
    /// Vocabulary training/loading/saving failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// Writing or reading a shard failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A spill file failed.
    #[error(transparent)]
    Spill(#[from] SpillError),
    /// A file of the prepared folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// An option is out of range.
    #[error("invalid option {field}: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// What was expected.
        reason: String,
    },
    /// The corpus holds no text, or none of it tokenises to anything.
    #[error("empty corpus: {reason}")]
    EmptyCorpus {
        /// Which case.
        reason: String,
    },
    /// Too few sequences for the requested shards/heldout split.
    #[error("corpus too small: {reason}")]
    TooSmall {
        /// What did not fit.
        reason: String,
    },
    /// `manifest.json` is missing or malformed.
    #[error("{path}: bad manifest: {reason}")]
    BadManifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A shard does not belong with this manifest (vocabulary or checksum differ).
    #[error("{path}: {reason}")]
    ShardMismatch {
        /// The shard file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A pipeline thread panicked.
    #[error("a prepare thread panicked")]
    ThreadPanicked,
}

impl From<TokenizeError> for PrepareError {
    fn from(e: TokenizeError) -> Self {
        match e {
            TokenizeError::Corpus(c) => PrepareError::Corpus(c),
            TokenizeError::Spill(s) => PrepareError::Spill(s),
            TokenizeError::ThreadPanicked => PrepareError::ThreadPanicked,
        }
    }
}
