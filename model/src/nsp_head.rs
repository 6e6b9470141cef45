//! The next-sentence-prediction head (Devlin et al. 2019, section 3.1 "Task #2"; HF:
//! `BertPooler` + `cls.seq_relationship`):
//!
//! ```text
//! x      = hidden[:, 0]                  [b, c]  (the [CLS] token)
//! pooled = tanh(x Wp^T + bp)             [b, c]
//! logits = pooled Ws^T + bs              [b, 2]
//! ```

use keel_proto::params::NspHeadParams;

use super::Element;
use super::activation::{tanh_backward, tanh_forward};
use super::bf16_shared::Flat;
use super::element::grow;
use super::gemm::GemmSite;
use super::gemms::Gemms;
use super::linear::Linear;

/// Offsets of the pooler and classifier.
#[derive(Debug, Clone)]
pub(crate) struct NspHead {
    pooler: Linear,
    classifier: Linear,
}

/// Activations of the head, saved for its backward.
#[derive(Debug, Default)]
pub(crate) struct NspCache<A> {
    /// `[CLS]` hidden states `[b, c]`.
    pub x: Vec<A>,
    /// Pooler dense output `[b, c]`, then reused as its gradient.
    pub pre: Vec<A>,
    /// `tanh` output `[b, c]`.
    pub pooled: Vec<A>,
    /// Logits `[b, 2]`, turned into their gradient by the loss.
    pub logits: Vec<A>,
    /// Backward scratch `[b, c]`.
    pub d: Vec<A>,
}

impl NspHead {
    /// The pooler and classifier over their tensors `params`.
    pub fn new(params: &NspHeadParams) -> NspHead {
        NspHead {
            pooler: Linear::new(&params.pooler, GemmSite::Nsp),
            classifier: Linear::new(&params.classifier, GemmSite::Nsp),
        }
    }

    /// Fills `cache.logits[..b * 2]` from `hidden` `[n, c]`, whose `[CLS]` rows are `cls` `[b]`.
    pub fn forward<A: Element>(
        &self,
        gemms: Gemms,
        cache: &mut NspCache<A>,
        hidden: &[A],
        cls: &[usize],
        params: Flat<'_, A>,
    ) {
        let (b, c) = (cls.len(), self.pooler.inp);
        let x = grow(&mut cache.x, b * c);
        for (row, &r) in x.chunks_exact_mut(c).zip(cls) {
            row.copy_from_slice(&hidden[r * c..(r + 1) * c]);
        }
        let pre = grow(&mut cache.pre, b * c);
        let x = Flat::plain(&cache.x[..b * c]);
        self.pooler.forward(gemms, pre, x, params, b);
        let pooled = grow(&mut cache.pooled, b * c);
        tanh_forward(pooled, &cache.pre[..b * c]);
        let logits = grow(&mut cache.logits, b * 2);
        let pooled = Flat::plain(&cache.pooled[..b * c]);
        self.classifier.forward(gemms, logits, pooled, params, b);
    }

    /// Given `cache.logits` holding `d loss / d logits`: accumulates the head's gradients and
    /// adds `d loss / d hidden` into the `[CLS]` rows `cls` `[b]` of `dhidden` `[n, c]`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<A: Element>(
        &self,
        gemms: Gemms,
        dhidden: &mut [A],
        cache: &mut NspCache<A>,
        cls: &[usize],
        params: Flat<'_, A>,
        grads: &mut [A],
    ) {
        let (b, c) = (cls.len(), self.pooler.inp);
        let dpooled = grow(&mut cache.d, b * c);
        self.classifier.backward(
            gemms,
            Some((&mut *dpooled, false)),
            &mut cache.logits[..b * 2],
            Flat::plain(&cache.pooled),
            params,
            grads,
            b,
        );
        tanh_backward(dpooled, &cache.pooled[..b * c]);
        let dx = grow(&mut cache.pre, b * c);
        self.pooler.backward(
            gemms,
            Some((&mut *dx, false)),
            &mut cache.d[..b * c],
            Flat::plain(&cache.x),
            params,
            grads,
            b,
        );
        for (row, &r) in cache.pre[..b * c].chunks_exact(c).zip(cls) {
            for (g, &d) in dhidden[r * c..(r + 1) * c].iter_mut().zip(row) {
                *g += d;
            }
        }
    }
}
