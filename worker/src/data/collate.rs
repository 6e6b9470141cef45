//! Collation: masked sequences -> a padded [`Batch`].
//!
//! Shape legend: `b` rows, `t` padded length, `m` masked positions in the batch.

use keel_proto::shard::Sequence;
use ndarray::Array2;

use super::masking::MaskedSequence;
use crate::batch::Batch;

/// The `[PAD]` id [`collate`] pads with: 0 in Keel-trained vocabularies and in BERT's.
pub const DEFAULT_PAD_ID: u32 = 0;

/// Errors of [`collate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollateError {
    /// No sequences.
    #[error("cannot collate an empty micro-batch")]
    Empty,
    /// `sample_ids` does not have one id per row.
    #[error("{got} sample ids for {expected} sequences")]
    SampleIdsMismatch {
        /// Rows.
        expected: usize,
        /// Ids given.
        got: usize,
    },
    /// A sequence is longer than `pad_to`.
    #[error("row {row}: sequence of {len} tokens does not fit pad_to {pad_to}")]
    TooLong {
        /// The row.
        row: usize,
        /// Its length.
        len: usize,
        /// The padded length asked for.
        pad_to: usize,
    },
    /// A sequence's parts disagree (ids vs token types vs masked ids, or a masked position
    /// past the end, or positions not increasing).
    #[error("row {row}: {reason}")]
    Inconsistent {
        /// The row.
        row: usize,
        /// What disagrees.
        reason: String,
    },
    /// Some rows have NSP labels and some do not.
    #[error("rows mix sequences with and without NSP labels")]
    MixedNsp,
}

/// Builds a [`Batch`] padded with [`DEFAULT_PAD_ID`]; see [`collate_with_pad`].
pub fn collate(
    seqs: &[(Sequence, MaskedSequence)],
    sample_ids: &[u64],
    pad_to: usize,
) -> Result<Batch, CollateError> {
    collate_with_pad(seqs, sample_ids, pad_to, DEFAULT_PAD_ID)
}

/// Builds a [`Batch`] of `b = seqs.len()` rows padded to `t = pad_to` tokens (`pad_to == 0`:
/// the longest sequence) with `pad_id`: `input_ids` `[b, t]` after masking, `token_type_ids`
/// `[b, t]` (0 at padding), `attention_mask` `[b, t]`, masked positions as flat `row * t + col`
/// increasing `[m]` with their original ids `[m]`, NSP labels `[b]` when the sequences have
/// them, and `sample_ids` `[b]`.
///
/// Errors: `Empty`, `SampleIdsMismatch`, `TooLong`, `Inconsistent`, `MixedNsp`.
pub fn collate_with_pad(
    seqs: &[(Sequence, MaskedSequence)],
    sample_ids: &[u64],
    pad_to: usize,
    pad_id: u32,
) -> Result<Batch, CollateError> {
    if seqs.is_empty() {
        return Err(CollateError::Empty);
    }
    if sample_ids.len() != seqs.len() {
        return Err(CollateError::SampleIdsMismatch {
            expected: seqs.len(),
            got: sample_ids.len(),
        });
    }
    let longest = seqs.iter().map(|(s, _)| s.ids.len()).max().unwrap_or(0);
    let t = if pad_to == 0 { longest } else { pad_to };
    let b = seqs.len();
    let with_nsp = seqs[0].0.nsp_label.is_some();
    let mut input_ids = Array2::from_elem((b, t), pad_id);
    let mut token_type_ids = Array2::<u32>::zeros((b, t));
    let mut attention_mask = Array2::<u8>::zeros((b, t));
    let mut masked_positions = Vec::new();
    let mut masked_labels = Vec::new();
    let mut nsp = Vec::with_capacity(b);
    for (row, (seq, masked)) in seqs.iter().enumerate() {
        let len = seq.ids.len();
        let inconsistent = |reason: String| CollateError::Inconsistent { row, reason };
        if len > t {
            return Err(CollateError::TooLong {
                row,
                len,
                pad_to: t,
            });
        }
        if seq.token_type_ids.len() != len || masked.input_ids.len() != len {
            return Err(inconsistent(format!(
                "{len} ids, {} token_type_ids, {} masked input_ids",
                seq.token_type_ids.len(),
                masked.input_ids.len()
            )));
        }
        if masked.masked_positions.len() != masked.masked_labels.len() {
            return Err(inconsistent(format!(
                "{} masked positions but {} labels",
                masked.masked_positions.len(),
                masked.masked_labels.len()
            )));
        }
        if masked.masked_positions.windows(2).any(|w| w[0] >= w[1]) {
            return Err(inconsistent("masked positions are not increasing".into()));
        }
        if let Some(&last) = masked.masked_positions.last()
            && last >= len
        {
            return Err(inconsistent(format!(
                "masked position {last} is past the sequence's {len} tokens"
            )));
        }
        if seq.nsp_label.is_some() != with_nsp {
            return Err(CollateError::MixedNsp);
        }
        for col in 0..len {
            input_ids[[row, col]] = masked.input_ids[col];
            token_type_ids[[row, col]] = seq.token_type_ids[col];
            attention_mask[[row, col]] = 1;
        }
        masked_positions.extend(masked.masked_positions.iter().map(|&c| row * t + c));
        masked_labels.extend_from_slice(&masked.masked_labels);
        if let Some(label) = seq.nsp_label {
            nsp.push(label);
        }
    }
    Ok(Batch {
        input_ids,
        token_type_ids,
        attention_mask,
        masked_positions,
        masked_labels,
        next_sentence_labels: with_nsp.then_some(nsp),
        sample_ids: sample_ids.to_vec(),
    })
}
