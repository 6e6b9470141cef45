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

/// The counts a step's losses are averaged over: each loss's gradient is taken with the
/// factor `1 / count` (`StepOptions::mlm_scale`, `nsp_scale`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossCounts {
    /// Masked tokens (MLM predictions).
    pub masked: f32,
    /// NSP labels (0 for the `mlm` objective).
    pub nsp: f32,
}

impl LossCounts {
    /// The global batch's, from the all-reduced `counts`.
    pub fn global(counts: &StepCounts) -> LossCounts {
        LossCounts {
            masked: counts.masked(),
            nsp: counts.nsp(),
        }
    }

    /// This rank's own, of its micro-batches `batches` (NSP labels counted when `nsp`).
    pub fn local(batches: &[Batch], nsp: bool) -> LossCounts {
        let local = local_counts(batches, nsp, None);
        LossCounts {
            masked: local[0],
            nsp: local[1],
        }
    }
}

/// A step's loss sums: this rank's, accumulated over its micro-batches in f64 ([`add`]), or
/// all ranks' ([`LossSums::all_reduce`]: each sum travels as f32, so a summed value is an f32
/// held in an f64).
///
/// [`add`]: LossSums::add
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    /// Sum of the MLM loss over masked tokens (nats).
    pub mlm_loss: f64,
    /// Masked tokens predicted right.
    pub mlm_correct: f64,
    /// Sum of the NSP loss over sequences (nats).
    pub nsp_loss: f64,
    /// NSP labels predicted right.
    pub nsp_correct: f64,
}

impl LossSums {
    /// Adds one micro-batch's sums (the model's, f32 losses and counts).
    pub fn add(&mut self, batch: &crate::model::LossSums<f32>) {
        self.mlm_loss += f64::from(batch.mlm_loss_sum);
        self.mlm_correct += batch.mlm_correct as f64;
        self.nsp_loss += f64::from(batch.nsp_loss_sum);
        self.nsp_correct += batch.nsp_correct as f64;
    }

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

    /// Sums these sums over ranks ([`SpecialBucket::Loss`]).
    ///
    /// Errors: the ring's [`RingLinkError`].
    pub fn all_reduce(&self, ring: &RingLink, step: u64) -> Result<LossSums, RingLinkError> {
        let summed = ring.all_reduce(step, SpecialBucket::Loss.id(), self.to_wire().to_vec())?;
        Ok(LossSums::from_wire(&summed))
    }

    /// The four sums as they travel: `[mlm loss, mlm correct, nsp loss, nsp correct]`, each
    /// rounded to f32.
    fn to_wire(self) -> [f32; 4] {
        [
            self.mlm_loss as f32,
            self.mlm_correct as f32,
            self.nsp_loss as f32,
            self.nsp_correct as f32,
        ]
    }

    /// The sums of what [`LossSums::to_wire`] sent. The ring gives back as many elements as
    /// it was given; anything else reads as NaN sums, which skip the step's update rather
    /// than take one from wrong numbers.
    fn from_wire(wire: &[f32]) -> LossSums {
        let [mlm_loss, mlm_correct, nsp_loss, nsp_correct] = match wire {
            [a, b, c, d] => [*a, *b, *c, *d].map(f64::from),
            _ => [f64::NAN; 4],
        };
        LossSums {
            mlm_loss,
            mlm_correct,
            nsp_loss,
            nsp_correct,
        }
    }
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

    #[test]
    fn loss_sums_travel_in_their_order_as_f32() {
        let mut local = LossSums::default();
        for (loss, correct) in [(1.25f32, 3usize), (0.5, 1)] {
            local.add(&crate::model::LossSums {
                mlm_loss_sum: loss,
                mlm_correct: correct,
                nsp_loss_sum: 2.0 * loss,
                nsp_correct: 1,
                ..Default::default()
            });
        }
        assert_eq!(local.to_wire(), [1.75, 4.0, 3.5, 2.0]);
        assert_eq!(LossSums::from_wire(&local.to_wire()), local);
        assert!(local.is_finite());
        // A reply of another length is no step's sums: NaN, so the update is skipped.
        assert!(!LossSums::from_wire(&[1.0, 2.0]).is_finite());
        let counts = LossCounts::local(&[batch(&[2, 7, 7, 0], &[1, 1, 1, 0], 2)], true);
        assert_eq!((counts.masked, counts.nsp), (2.0, 1.0));
    }
}
