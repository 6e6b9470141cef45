//! One micro-batch of masked-LM training data, ready for the model.
//!
//! Shape legend: `b` sequences in the micro-batch, `t` sequence length (padded), `m` masked
//! positions in the whole micro-batch.

use ndarray::Array2;

/// A padded micro-batch. Built by `data::collate` (from shard sequences and their masks) and
/// consumed by `model` (forward and backward). HF equivalent: the dict a `DataCollatorForLanguageModeling`
/// returns, with `labels` stored sparsely (only the masked positions) because the MLM head runs
/// only there.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Token ids after masking, `[b, t]`; padding positions hold the `[PAD]` id.
    pub input_ids: Array2<u32>,
    /// Segment ids (0 = sentence A, 1 = sentence B), `[b, t]`; 0 at padding.
    pub token_type_ids: Array2<u32>,
    /// 1 for real tokens, 0 for padding, `[b, t]` (HF's `attention_mask`).
    pub attention_mask: Array2<u8>,
    /// Flat positions `row * t + col` of the masked tokens, `[m]`, in increasing order.
    pub masked_positions: Vec<usize>,
    /// The original token id at each masked position, `[m]` (HF's `labels` where != -100).
    pub masked_labels: Vec<u32>,
    /// NSP labels (0 = B follows A, 1 = B is random), `[b]`; `None` for the `mlm` objective.
    pub next_sentence_labels: Option<Vec<u32>>,
    /// Global sample index of each row, `[b]`: keys the row's dropout stream so that the same
    /// sample gets the same dropout whatever the world size or micro-batch split.
    pub sample_ids: Vec<u64>,
}

impl Batch {
    /// Number of sequences `b`.
    pub fn batch_size(&self) -> usize {
        self.input_ids.nrows()
    }

    /// Padded sequence length `t` (tokens).
    pub fn seq_len(&self) -> usize {
        self.input_ids.ncols()
    }

    /// Number of real (non-padding) tokens in the batch.
    pub fn real_tokens(&self) -> usize {
        self.attention_mask.iter().filter(|&&m| m != 0).count()
    }
}
