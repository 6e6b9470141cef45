//! The masked-LM head (Devlin et al. 2019, section 3.1 "Task #1"; HF: `BertOnlyMLMHead` /
//! `BertLMPredictionHead`), run only at the masked positions:
//!
//! ```text
//! x  = hidden[positions]                         [m, c]
//! z  = LN(act(x Wt^T + bt))                      [m, c]   (HF: BertPredictionHeadTransform)
//! logits = z E^T + bias                          [m, v]   (decoder tied to the word embeddings E)
//! ```

use keel_proto::config::{BertConfig, HiddenAct};
use keel_proto::params::{MlmHeadParams, ParamView};

use super::Element;
use super::activation;
use super::bf16_shared::{Flat, round_in_place};
use super::element::grow;
use super::gemm::{GemmSite, gemm, gemm_bias, mat, mat_mut};
use super::gemms::Gemms;
use super::layernorm::LayerNorm;
use super::linear::Linear;

/// Offsets of the head's parameters.
#[derive(Debug, Clone)]
pub(crate) struct MlmHead {
    dense: Linear,
    ln: LayerNorm,
    act: HiddenAct,
    /// `bert.embeddings.word_embeddings.weight` `[v, c]` (the tied decoder weight).
    word: usize,
    /// `cls.predictions.bias` `[v]`.
    bias: usize,
    /// `v`.
    pub vocab: usize,
    c: usize,
}

/// Activations of the head, saved for its backward.
#[derive(Debug, Default)]
pub(crate) struct MlmCache<A> {
    /// Gathered hidden states `[m, c]`.
    pub x: Vec<A>,
    /// Dense output (pre-activation) `[m, c]`.
    pub pre: Vec<A>,
    /// Activation output `[m, c]`.
    pub act: Vec<A>,
    /// LN normalised input `[m, c]`, inverse std `[m]`, output `[m, c]`.
    pub xhat: Vec<A>,
    pub rstd: Vec<A>,
    pub z: Vec<A>,
    /// Logits `[m, v]`, turned into their gradient by the loss.
    pub logits: Vec<A>,
    /// Backward scratch `[m, c]` x 2.
    pub d1: Vec<A>,
    pub d2: Vec<A>,
}

impl<A> MlmCache<A> {
    /// Bytes held (the backward scratch `d1`, `d2` included).
    pub fn bytes(&self) -> usize {
        [
            &self.x,
            &self.pre,
            &self.act,
            &self.xhat,
            &self.rstd,
            &self.z,
            &self.logits,
            &self.d1,
            &self.d2,
        ]
        .into_iter()
        .map(super::element::held)
        .sum()
    }
}

impl MlmHead {
    /// The MLM head of a model for `config`, over its tensors `params`; its decoder reads the
    /// word embeddings `word` (tied).
    pub fn new(config: &BertConfig, params: &MlmHeadParams, word: &ParamView) -> MlmHead {
        MlmHead {
            dense: Linear::new(&params.transform, GemmSite::MlmTransform),
            ln: LayerNorm::new(&params.layer_norm, config.layer_norm_eps),
            act: config.hidden_act,
            word: word.offset,
            bias: params.bias.offset,
            vocab: config.vocab_size,
            c: config.hidden_size,
        }
    }

    /// Fills `cache.logits[..m * v]` from `hidden` `[n, c]` at flat `positions` `[m]`, GEMMs
    /// on the route `gemms` says; `params` the flat parameters (with their bf16 copy on the
    /// native route).
    pub fn forward<A: Element>(
        &self,
        gemms: Gemms,
        cache: &mut MlmCache<A>,
        hidden: &[A],
        positions: &[usize],
        params: Flat<'_, A>,
    ) {
        let (m, c, v) = (positions.len(), self.c, self.vocab);
        let x = grow(&mut cache.x, m * c);
        for (row, &p) in x.chunks_exact_mut(c).zip(positions) {
            row.copy_from_slice(&hidden[p * c..(p + 1) * c]);
        }
        let pre = grow(&mut cache.pre, m * c);
        let x = Flat::plain(&cache.x[..m * c]);
        self.dense.forward(gemms, pre, x, params, m);
        let act = grow(&mut cache.act, m * c);
        activation::forward(self.act, act, &cache.pre[..m * c]);
        let z = grow(&mut cache.z, m * c);
        let xhat = grow(&mut cache.xhat, m * c);
        let rstd = grow(&mut cache.rstd, m);
        self.ln
            .forward(z, xhat, rstd, &cache.act[..m * c], None, params.f32, m);
        let logits = grow(&mut cache.logits, m * v);
        let bias = &params.f32[self.bias..self.bias + v];
        let e = params.mat(self.word, v, c);
        gemm_bias(
            gemms,
            GemmSite::Decoder,
            mat(&cache.z, m, c).into(),
            e.t(),
            bias,
            &mut mat_mut(logits, m, v),
        );
    }

    /// Given `cache.logits` holding `d loss / d logits`: accumulates the head's gradients (and
    /// the decoder's share of the word-embedding gradient) and adds `d loss / d hidden` into
    /// `dhidden` `[n, c]` at `positions`. On the native bf16 route `d logits` `[m, v]` is
    /// rounded once for its two GEMMs, in place (`cache.logits` then holds its bf16 patterns:
    /// after the bias gradient only those GEMMs read it, and a copy would be half as large
    /// again as the logits, the step's largest buffer).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<A: Element>(
        &self,
        gemms: Gemms,
        dhidden: &mut [A],
        cache: &mut MlmCache<A>,
        positions: &[usize],
        params: Flat<'_, A>,
        grads: &mut [A],
    ) {
        let (m, c, v) = (positions.len(), self.c, self.vocab);
        let dlogits = &mut cache.logits[..m * v];
        super::linear::bias_gradient(&mut grads[self.bias..self.bias + v], dlogits, m);
        // `d logits` feeds both GEMMs: round it once (in place, see above).
        let dlogits = round_in_place(gemms, dlogits).mat(0, m, v);
        gemm(
            gemms,
            GemmSite::Decoder,
            A::one(),
            dlogits.t(),
            mat(&cache.z, m, c).into(),
            A::one(),
            &mut mat_mut(&mut grads[self.word..self.word + v * c], v, c),
        );
        let dz = grow(&mut cache.d1, m * c);
        gemm(
            gemms,
            GemmSite::Decoder,
            A::one(),
            dlogits,
            params.mat(self.word, v, c),
            A::zero(),
            &mut mat_mut(dz, m, c),
        );
        let dact = grow(&mut cache.d2, m * c);
        self.ln.backward(
            dact,
            &cache.d1[..m * c],
            &cache.xhat,
            &cache.rstd,
            params.f32,
            grads,
            m,
        );
        activation::backward(self.act, dact, &cache.pre[..m * c]);
        let dx = grow(&mut cache.d1, m * c);
        self.dense.backward(
            gemms,
            Some((&mut *dx, false)),
            &mut cache.d2[..m * c],
            Flat::plain(&cache.x),
            params,
            grads,
            m,
        );
        for (row, &p) in cache.d1[..m * c].chunks_exact(c).zip(positions) {
            for (g, &d) in dhidden[p * c..(p + 1) * c].iter_mut().zip(row) {
                *g += d;
            }
        }
    }
}
