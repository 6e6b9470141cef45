//! The dimensions and dropout of one self-attention call ([`AttentionDims`]), shared by the
//! per-(sequence, head) route (`super::attention`) and the batched one
//! (`super::attention_batched`).

use super::Element;
use super::dropout::{DropoutKey, Mask, Site};
use super::gemms::Gemms;

/// Dimensions and dropout of one attention call.
pub(crate) struct AttentionDims<'a> {
    /// Sequences `b`.
    pub b: usize,
    /// Tokens per sequence `t`.
    pub t: usize,
    /// Heads `h`.
    pub h: usize,
    /// Head size `d`.
    pub d: usize,
    /// Padding mask `[b, t]`.
    pub mask: &'a [u8],
    /// Training-mode dropout: key, sample ids `[b]`, layer index, probability.
    pub dropout: Option<(DropoutKey, &'a [u64], usize, f64)>,
    /// Stride of the dropout element index (`max_position_embeddings`), so masks do not
    /// depend on the padded length.
    pub max_positions: usize,
    /// The route of attention's GEMMs; it also picks attention's route (`super::attention`).
    pub gemms: Gemms,
}

impl<'a> AttentionDims<'a> {
    /// The dimensions of sequences `r` alone.
    pub(super) fn part(&self, r: &std::ops::Range<usize>) -> AttentionDims<'a> {
        AttentionDims {
            b: r.len(),
            t: self.t,
            h: self.h,
            d: self.d,
            mask: &self.mask[r.start * self.t..r.end * self.t],
            dropout: self
                .dropout
                .map(|(key, ids, layer, p)| (key, &ids[r.start..r.end], layer, p)),
            max_positions: self.max_positions,
            gemms: self.gemms,
        }
    }

    pub(super) fn c(&self) -> usize {
        self.h * self.d
    }

    pub(super) fn mask_of(&self, bi: usize) -> Option<Mask> {
        self.dropout
            .map(|(key, ids, layer, p)| Mask::new(key, ids[bi], layer, Site::AttentionProbs, p))
    }

    /// Applies the attention-probs dropout of sequence `bi`, head `j` to a `[t, t]` block.
    pub(super) fn drop_block<A: Element>(&self, mask: &Mask, j: usize, block: &mut [A]) {
        let (t, pmax) = (self.t as u64, self.max_positions as u64);
        for (q, row) in block.chunks_exact_mut(self.t).enumerate() {
            mask.apply(row, (j as u64 * pmax + q as u64) * pmax);
            debug_assert!(t <= pmax);
        }
    }
}
