//! The worker's data pipeline: masking shard sequences and collating them into batches.
//!
//! # Layout
//! - `masking_vocab`: [`MaskingVocab`], per-id facts (special, `##` piece, CJK, replacements).
//! - `masking`: [`mask_sequence`] (static/dynamic, whole-word), [`MaskingConfig`].
//! - `collate`: [`collate`](fn@collate), sequences + masks -> [`crate::batch::Batch`].

pub mod collate;
pub mod masking;
pub mod masking_vocab;

pub use collate::{CollateError, collate, collate_with_pad};
pub use masking::{MaskedSequence, MaskingConfig, MaskingError, MaskingMode, mask_sequence};
pub use masking_vocab::MaskingVocab;
