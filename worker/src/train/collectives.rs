//! The all-reduces of a step besides the gradient buckets, each under its
//! [`SpecialBucket`] id: the counts (masked tokens, NSP labels, real tokens and, with several
//! ranks, which token ids each rank's batches use), the loss sums, and the word embeddings'
//! lookup-gradient rows. Every rank calls them in the same order with the same ids.

use crate::allreduce::WireDtype;
use crate::batch::Batch;
use crate::buckets::SpecialBucket;
use crate::model::LookupGrads;
use crate::ringlink::{RingLink, RingLinkError, RingReply};

/// The step's counts summed over ranks: `[masked tokens, NSP labels, real tokens]`, then,
/// with several ranks, `[v]` presence counts (how many ranks use each token id).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCounts(Vec<f32>);

impl StepCounts {
    /// Masked tokens of the global batch (MLM predictions).
    pub fn masked(&self) -> f32 {
        self.0[0]
    }

    /// NSP labels of the global batch (0 for the `mlm` objective).
    pub fn nsp(&self) -> f32 {
        self.0[1]
    }

    /// Real (non-padding) tokens of the global batch.
    pub fn tokens(&self) -> f32 {
        self.0[2]
    }

    /// `[v]` presence counts, or empty when they were not counted (one rank).
    pub fn presence(&self) -> &[f32] {
        &self.0[3..]
    }
}

/// This rank's counts of `batches`: `[masked tokens, NSP labels (0 unless nsp), real
/// tokens]`, then `[presence_vocab]` presence flags when `presence_vocab` is given.
pub fn local_counts(batches: &[Batch], nsp: bool, presence_vocab: Option<usize>) -> Vec<f32> {
    let local_masked: usize = batches.iter().map(|b| b.masked_positions.len()).sum();
    let local_nsp: usize = if nsp {
        batches.iter().map(Batch::batch_size).sum()
    } else {
        0
    };
    let local_tokens: usize = batches.iter().map(Batch::real_tokens).sum();
    let mut counts = vec![local_masked as f32, local_nsp as f32, local_tokens as f32];
    if let Some(v) = presence_vocab {
        counts.extend(token_presence(batches, v));
    }
    counts
}

/// Sums [`local_counts`] of `batches` over ranks ([`SpecialBucket::Counts`]).
///
/// Errors: the ring's [`RingLinkError`].
pub fn all_reduce_counts(
    ring: &RingLink,
    step: u64,
    batches: &[Batch],
    nsp: bool,
    presence_vocab: Option<usize>,
) -> Result<StepCounts, RingLinkError> {
    let counts = local_counts(batches, nsp, presence_vocab);
    ring.all_reduce(step, SpecialBucket::Counts.id(), counts)
        .map(StepCounts)
}

/// The step's loss sums over all micro-batches of all ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct LossSums {
    /// Sum of the MLM loss over masked tokens (nats).
    pub mlm_loss: f32,
    /// Masked tokens predicted right.
    pub mlm_correct: f32,
    /// Sum of the NSP loss over sequences (nats).
    pub nsp_loss: f32,
    /// NSP labels predicted right.
    pub nsp_correct: f32,
}

impl LossSums {
    /// Whether every sum is finite.
    pub fn is_finite(&self) -> bool {
        [
            self.mlm_loss,
            self.mlm_correct,
            self.nsp_loss,
            self.nsp_correct,
        ]
        .iter()
        .all(|x| x.is_finite())
    }
}

/// Sums this rank's `[mlm loss sum, mlm correct, nsp loss sum, nsp correct]` (accumulated in
/// f64, sent as f32) over ranks ([`SpecialBucket::Loss`]).
///
/// Errors: the ring's [`RingLinkError`].
pub fn all_reduce_loss(
    ring: &RingLink,
    step: u64,
    sums: [f64; 4],
) -> Result<LossSums, RingLinkError> {
    let s = all_reduce_sums(ring, step, SpecialBucket::Loss, &sums)?;
    Ok(LossSums {
        mlm_loss: s[0],
        mlm_correct: s[1],
        nsp_loss: s[2],
        nsp_correct: s[3],
    })
}

/// Sums `sums` (f64, sent as f32) over ranks under `bucket`; the result has `sums.len()`
/// entries.
///
/// Errors: the ring's [`RingLinkError`].
pub fn all_reduce_sums(
    ring: &RingLink,
    step: u64,
    bucket: SpecialBucket,
    sums: &[f64],
) -> Result<Vec<f32>, RingLinkError> {
    ring.all_reduce(step, bucket.id(), sums.iter().map(|&x| x as f32).collect())
}

/// The word embeddings' lookup-gradient rows `[u, c]` of the step (the token ids some rank
/// used) from the summed presence counts; `None` when they were not counted (one rank).
pub fn lookup_rows(counts: &StepCounts, hidden_size: usize) -> Option<LookupGrads<f32>> {
    (!counts.presence().is_empty())
        .then(|| LookupGrads::<f32>::from_presence(counts.presence(), hidden_size))
}

/// Whether the word embeddings' gradient travels in two parts this step: only while the
/// `rows` are at most half the vocabulary (`vocab_size` tokens); beyond that the extra
/// `[u, c]` all-reduce would cost more than the overlap saves. Every rank holds the same
/// counts, so every rank decides the same way.
pub fn split_pays(rows: &LookupGrads<f32>, vocab_size: usize) -> bool {
    2 * rows.ids().len() <= vocab_size
}

/// Sends the lookup rows' gradient `[u, c]` to be summed ([`SpecialBucket::LookupRows`]),
/// its elements as `dtype` like the other gradient buckets.
pub fn submit_lookup_rows(
    ring: &RingLink,
    step: u64,
    lookup: &mut LookupGrads<f32>,
    dtype: WireDtype,
) -> RingReply {
    ring.submit_as(
        step,
        SpecialBucket::LookupRows.id(),
        lookup.take_grads(),
        dtype,
    )
}

/// `[v]` flags, 1 for every token id that occurs in `batches` (padding included: its lookup
/// adds a gradient row too), else 0. Summed over ranks, positive entries are the word
/// embeddings' lookup-gradient rows of the step.
pub fn token_presence(batches: &[Batch], vocab_size: usize) -> Vec<f32> {
    let mut presence = vec![0.0f32; vocab_size];
    for id in batches.iter().flat_map(|b| b.input_ids.iter()) {
        // The model refuses out-of-range ids with a clear error; skip them here.
        if let Some(p) = presence.get_mut(*id as usize) {
            *p = 1.0;
        }
    }
    presence
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn batch(ids: &[u32], mask: &[u8], masked: usize) -> Batch {
        let n = ids.len();
        Batch {
            input_ids: Array2::from_shape_vec((1, n), ids.to_vec()).unwrap(),
            token_type_ids: Array2::zeros((1, n)),
            attention_mask: Array2::from_shape_vec((1, n), mask.to_vec()).unwrap(),
            masked_positions: (0..masked).collect(),
            masked_labels: vec![5; masked],
            next_sentence_labels: None,
            sample_ids: vec![0],
        }
    }

    #[test]
    fn local_counts_are_masked_nsp_tokens_then_presence() {
        let batches = [
            batch(&[2, 7, 7, 0], &[1, 1, 1, 0], 2),
            batch(&[2, 9, 99, 0], &[1, 1, 1, 0], 1),
        ];
        assert_eq!(local_counts(&batches, false, None), vec![3.0, 0.0, 6.0]);
        assert_eq!(local_counts(&batches, true, None), vec![3.0, 2.0, 6.0]);
        let with = local_counts(&batches, false, Some(10));
        // Out-of-range id 99 is skipped; padding id 0 counts.
        assert_eq!(
            &with[3..],
            &[1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
        );
    }

    #[test]
    fn lookup_rows_split_only_up_to_half_the_vocabulary() {
        let counts = |presence: &[f32]| {
            let mut c = vec![1.0, 0.0, 4.0];
            c.extend_from_slice(presence);
            StepCounts(c)
        };
        assert!(lookup_rows(&counts(&[]), 8).is_none());
        let rows = lookup_rows(&counts(&[2.0, 0.0, 1.0, 0.0]), 8).unwrap();
        assert_eq!(rows.ids(), &[0, 2]);
        assert!(split_pays(&rows, 4));
        let rows = lookup_rows(&counts(&[2.0, 1.0, 1.0, 0.0]), 8).unwrap();
        assert_eq!(rows.ids().len(), 3);
        assert!(!split_pays(&rows, 4));
    }
}
