//! One post-LN Transformer encoder layer (Vaswani et al. 2017, section 3.1; Devlin et al.
//! 2019, section 3; HF: `BertLayer` = `BertAttention` + `BertIntermediate` + `BertOutput`):
//!
//! ```text
//! q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv
//! a  = attention(q, k, v)                      (attention.rs)
//! h1 = LN1(dropout(a Wo^T + bo) + x)
//! g  = act(h1 Wi^T + bi)
//! y  = LN2(dropout(g Wf^T + bf) + h1)
//! ```
//!
//! Shapes: `x`, `y`, `a`, `ctx`, `h1` `[n, c]`; `g` `[n, f]`; `probs` `[b, h, t, t]`. The `n`
//! rows are those of the batch's [`Packing`]: `b * t`, or only the real tokens when padding is
//! left out; then attention's `q`, `k`, `v` (and in backward `dctx`, `dq`, `dk`, `dv`) are
//! scattered into the padded `[b * t, c]` layout attention works in, and its output gathered.

use keel_proto::config::{BertConfig, HiddenAct};
use keel_proto::params::EncoderLayerParams;

use super::Element;
use super::activation;
use super::attention::{self, AttentionDims, AttentionScratch};
use super::attention_batched::KeptOperands;
use super::bf16_shared::{Flat, keep};
use super::dropout::{self, DropoutKey, Site};
use super::element::{grow, held};
use super::gemm::GemmSite;
use super::gemms::Gemms;
use super::layernorm::LayerNorm;
use super::linear::Linear;
use super::packing::Packing;

/// Offsets and sizes of one encoder layer.
#[derive(Debug, Clone)]
pub(crate) struct EncoderLayer {
    /// Layer index `l` (keys the dropout masks).
    index: usize,
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    ln1: LayerNorm,
    intermediate: Linear,
    output: Linear,
    ln2: LayerNorm,
    heads: usize,
    act: HiddenAct,
    p_hidden: f64,
    p_attn: f64,
    max_positions: usize,
}

/// What the backward of one layer needs, saved by its forward. Buffers grow once and are reused.
///
/// Where the GEMMs keep bf16 copies (`Gemms::keeps`, the native bf16 route), an activation the
/// backward reads only as a GEMM operand is kept once, as its copy: `q`, `k`, `v`, `ctx`, `h1`
/// and `act` (and the layer's input `x`, the caller's) are then empty. The f32 values the
/// backward reads outside GEMMs stay: `probs` (the softmax backward), `pre` (the activation's
/// derivative), `xhat*` and `rstd*` (the LayerNorms').
#[derive(Debug, Default)]
pub(crate) struct LayerCache<A> {
    /// `[b * t, c]` each (attention's padded layout); empty where only copies are kept.
    pub q: Vec<A>,
    pub k: Vec<A>,
    pub v: Vec<A>,
    /// Softmax output before dropout, `[b, h, t, t]`.
    pub probs: Vec<A>,
    /// Attention context (input of the output projection), `[n, c]`; empty where only copies
    /// are kept.
    pub ctx: Vec<A>,
    /// LN1 normalised input `[n, c]` and inverse std `[n]`.
    pub xhat1: Vec<A>,
    pub rstd1: Vec<A>,
    /// LN1 output `[n, c]`; empty where only copies are kept.
    pub h1: Vec<A>,
    /// Intermediate pre-activation and activation, `[n, f]` (`act` empty where only copies
    /// are kept).
    pub pre: Vec<A>,
    pub act: Vec<A>,
    /// LN2 normalised input `[n, c]` and inverse std `[n]`.
    pub xhat2: Vec<A>,
    pub rstd2: Vec<A>,
    /// bf16 copies of the Linears' inputs (the layer's input `x`, `ctx`, `h1` `[n, c]`; `act`
    /// `[n, f]`), rounded once for the forward's GEMMs and read again by the backward's weight
    /// gradients (`super::bf16_shared::keep`); empty off the native bf16 route.
    pub x_bf16: Vec<u16>,
    pub ctx_bf16: Vec<u16>,
    pub h1_bf16: Vec<u16>,
    pub act_bf16: Vec<u16>,
    /// bf16 copies of attention's operands (`q`, `k`, `v`, the probabilities after dropout).
    pub attention_bf16: KeptOperands,
}

impl<A> LayerCache<A> {
    /// Bytes held, bf16 copies included.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.q,
            &self.k,
            &self.v,
            &self.probs,
            &self.ctx,
            &self.xhat1,
            &self.rstd1,
            &self.h1,
            &self.pre,
            &self.act,
            &self.xhat2,
            &self.rstd2,
        ];
        let kept = &self.attention_bf16;
        let h = [
            &self.x_bf16,
            &self.ctx_bf16,
            &self.h1_bf16,
            &self.act_bf16,
            &kept.q,
            &kept.k,
            &kept.v,
            &kept.probs,
        ];
        f.into_iter().map(held).sum::<usize>() + h.into_iter().map(held).sum::<usize>()
    }
}

/// Backward scratch shared by all layers. Where only bf16 copies of activations are kept,
/// the forward makes their f32 values here first (`EncoderLayer::forward`): no extra buffer.
#[derive(Debug, Default)]
pub(crate) struct LayerScratch<A> {
    /// `[n, c]` each; `da`, `dq`, `dk`, `dv` grow to `[b * t, c]` when padding is left out.
    pub da: Vec<A>,
    pub dh1: Vec<A>,
    pub dq: Vec<A>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
    /// `[n, f]`.
    pub dg: Vec<A>,
    /// Attention's backward scratch (`2 * t * t` a thread, more on the batched route).
    pub attn: AttentionScratch<A>,
}

/// The batch-level inputs every layer sees.
pub(crate) struct LayerInputs<'a> {
    pub b: usize,
    pub t: usize,
    /// `[b, t]`, 1 = real token.
    pub mask: &'a [u8],
    /// Training-mode dropout: key and sample ids `[b]`.
    pub dropout: Option<(DropoutKey, &'a [u64])>,
    /// The `n` rows computed.
    pub packing: &'a Packing,
    /// How the layer's GEMMs run (the model's value, made once).
    pub gemms: Gemms,
}

impl EncoderLayer {
    /// Layer `index` of a model for `config`, over its tensors `params`.
    pub fn new(config: &BertConfig, params: &EncoderLayerParams, index: usize) -> EncoderLayer {
        let eps = config.layer_norm_eps;
        EncoderLayer {
            index,
            query: Linear::new(&params.query, GemmSite::Qkv),
            key: Linear::new(&params.key, GemmSite::Qkv),
            value: Linear::new(&params.value, GemmSite::Qkv),
            attn_out: Linear::new(&params.attention_output, GemmSite::AttentionOut),
            ln1: LayerNorm::new(&params.attention_layer_norm, eps),
            intermediate: Linear::new(&params.intermediate, GemmSite::Intermediate),
            output: Linear::new(&params.output, GemmSite::FeedForwardOut),
            ln2: LayerNorm::new(&params.output_layer_norm, eps),
            heads: config.num_attention_heads,
            act: config.hidden_act,
            p_hidden: config.hidden_dropout_prob,
            p_attn: config.attention_probs_dropout_prob,
            max_positions: config.max_position_embeddings,
        }
    }

    fn dims<'a>(&self, inputs: &LayerInputs<'a>) -> AttentionDims<'a> {
        let c = self.query.out;
        AttentionDims {
            b: inputs.b,
            t: inputs.t,
            h: self.heads,
            d: c / self.heads,
            mask: inputs.mask,
            dropout: inputs
                .dropout
                .map(|(key, ids)| (key, ids, self.index, self.p_attn)),
            max_positions: self.max_positions,
            gemms: inputs.gemms,
        }
    }

    /// Hidden-state dropout of every sequence at `site`, in place on `[n, c]`.
    fn hidden_dropout<A: Element>(&self, x: &mut [A], inputs: &LayerInputs<'_>, site: Site) {
        if let Some((key, ids)) = inputs.dropout {
            dropout::apply_sequences(
                x,
                self.query.out,
                inputs.packing,
                key,
                &ids[..inputs.b],
                self.index,
                site,
                self.p_hidden,
            );
        }
    }

    /// `y[n, c]` from `x[n, c]`; fills `cache`. `tmp` is `[n, c]` scratch, `attn_scratch`
    /// attention's. `params` is the flat parameter buffer (with its bf16 copy on the native
    /// route).
    ///
    /// Where `inputs.gemms` keeps bf16 copies, the activations the backward reads only through
    /// GEMMs (`q`, `k`, `v`, `ctx`, `h1`, `act`, and `x`, the caller's) are kept as their copies
    /// alone: their f32 values are made in `stage` (the backward's scratch, idle during the
    /// forward: `dq` `[b * t, c]` for each of `q`, `k`, `v` in turn, `dh1` `[n, c]` for `ctx`
    /// then `h1`, `dg` `[n, f]` for `act`), rounded, and overwritten by the next layer.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<A: Element>(
        &self,
        y: &mut [A],
        cache: &mut LayerCache<A>,
        tmp: &mut Vec<A>,
        stage: &mut LayerScratch<A>,
        attn_scratch: &mut AttentionScratch<A>,
        x: &[A],
        inputs: &LayerInputs<'_>,
        params: Flat<'_, A>,
    ) {
        let (b, t, packing) = (inputs.b, inputs.t, inputs.packing);
        let (n, c, f, h) = (
            packing.rows(),
            self.query.out,
            self.intermediate.out,
            self.heads,
        );
        let padded = b * t * c;
        let g = inputs.gemms;
        // Only the bf16 copies of the GEMM-only activations are kept (see above).
        let copies_only = g.keeps();
        let x = &x[..n * c];
        // `x` feeds the query, key and value projections here and their weight gradients in
        // the backward: rounded once, kept in the cache.
        keep(g, x, &mut cache.x_bf16);
        let x16 = Flat::kept(x, &cache.x_bf16);
        let kept = &mut cache.attention_bf16;
        for (linear, values, copy) in [
            (&self.query, &mut cache.q, &mut kept.q),
            (&self.key, &mut cache.k, &mut kept.k),
            (&self.value, &mut cache.v, &mut kept.v),
        ] {
            let values = values_in(copies_only, values, &mut stage.dq);
            let out = if packing.is_identity() {
                let out = grow(values, n * c);
                linear.forward(g, out, x16, params, n);
                out
            } else {
                let rows = grow(tmp, n * c);
                linear.forward(g, rows, x16, params, n);
                let out = grow(values, padded);
                packing.scatter(rows, out, c);
                out
            };
            // Attention reads it in its GEMMs, forward and backward: rounded once.
            keep(g, out, copy);
        }
        let probs = grow(&mut cache.probs, b * h * t * t);
        let ctx_values = values_in(copies_only, &mut cache.ctx, &mut stage.dh1);
        let ctx_padded = if packing.is_identity() {
            grow(ctx_values, n * c)
        } else {
            grow(tmp, padded)
        };
        let (q, k, v): (&[A], &[A], &[A]) = if copies_only {
            (&[], &[], &[])
        } else {
            (&cache.q[..padded], &cache.k[..padded], &cache.v[..padded])
        };
        attention::forward(
            ctx_padded,
            probs,
            attn_scratch,
            q,
            k,
            v,
            &mut cache.attention_bf16,
            &self.dims(inputs),
        );
        if !packing.is_identity() {
            packing.gather(&tmp[..padded], grow(ctx_values, n * c), c);
        }

        let a = grow(tmp, n * c);
        {
            let ctx = &ctx_values[..n * c];
            keep(g, ctx, &mut cache.ctx_bf16);
            let ctx = Flat::kept(ctx, &cache.ctx_bf16);
            self.attn_out.forward(g, a, ctx, params, n);
        }
        self.hidden_dropout(a, inputs, Site::AttentionOutput);
        // `ctx` is read no more: `h1` may take its place.
        let h1 = grow(values_in(copies_only, &mut cache.h1, &mut stage.dh1), n * c);
        let xhat1 = grow(&mut cache.xhat1, n * c);
        let rstd1 = grow(&mut cache.rstd1, n);
        self.ln1
            .forward(h1, xhat1, rstd1, a, Some(x), params.f32, n);

        let pre = grow(&mut cache.pre, n * f);
        keep(g, h1, &mut cache.h1_bf16);
        self.intermediate
            .forward(g, pre, Flat::kept(h1, &cache.h1_bf16), params, n);
        let act = grow(values_in(copies_only, &mut cache.act, &mut stage.dg), n * f);
        activation::forward(self.act, act, &cache.pre[..n * f]);

        let o = grow(tmp, n * c);
        keep(g, act, &mut cache.act_bf16);
        self.output
            .forward(g, o, Flat::kept(act, &cache.act_bf16), params, n);
        self.hidden_dropout(o, inputs, Site::FeedForwardOutput);
        let xhat2 = grow(&mut cache.xhat2, n * c);
        let rstd2 = grow(&mut cache.rstd2, n);
        self.ln2
            .forward(&mut y[..n * c], xhat2, rstd2, o, Some(&*h1), params.f32, n);
    }

    /// Given `dy[n, c]` (used as scratch): writes `dx[n, c]` and accumulates this layer's
    /// parameter gradients. `x` is the layer's input `[n, c]`, read only where the forward
    /// kept no bf16 copies (else it may be empty: its copy in `cache` is read).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<A: Element>(
        &self,
        dx: &mut [A],
        dy: &[A],
        cache: &LayerCache<A>,
        s: &mut LayerScratch<A>,
        x: &[A],
        inputs: &LayerInputs<'_>,
        params: Flat<'_, A>,
        grads: &mut [A],
    ) {
        let (b, t, packing) = (inputs.b, inputs.t, inputs.packing);
        let (n, c, f) = (packing.rows(), self.query.out, self.intermediate.out);
        let padded = b * t * c;
        let g = inputs.gemms;
        let dx = &mut dx[..n * c];

        // LN2: d(o_dropped + h1)
        let da = grow(&mut s.da, n * c);
        self.ln2.backward(
            da,
            &dy[..n * c],
            &cache.xhat2,
            &cache.rstd2,
            params.f32,
            grads,
            n,
        );
        let dh1 = grow(&mut s.dh1, n * c);
        dh1.copy_from_slice(da);
        self.hidden_dropout(da, inputs, Site::FeedForwardOutput);
        // Output projection, activation, intermediate projection.
        let dg = grow(&mut s.dg, n * f);
        {
            let act = Flat::activation(g, &cache.act, &cache.act_bf16, n * f);
            let dx = Some((&mut *dg, false));
            self.output.backward(g, dx, da, act, params, grads, n);
        }
        activation::backward(self.act, dg, &cache.pre[..n * f]);
        {
            let h1 = Flat::activation(g, &cache.h1, &cache.h1_bf16, n * c);
            let dx = Some((&mut *dh1, true));
            self.intermediate.backward(g, dx, dg, h1, params, grads, n);
        }
        // LN1: d(a_dropped + x)
        self.ln1
            .backward(da, dh1, &cache.xhat1, &cache.rstd1, params.f32, grads, n);
        dx.copy_from_slice(da);
        self.hidden_dropout(da, inputs, Site::AttentionOutput);
        // Attention output projection; reuse dh1 for d ctx.
        let dctx = &mut *dh1;
        {
            let ctx = Flat::activation(g, &cache.ctx, &cache.ctx_bf16, n * c);
            let dx = Some((&mut *dctx, false));
            self.attn_out.backward(g, dx, da, ctx, params, grads, n);
        }
        let dctx_padded: &[A] = if packing.is_identity() {
            dctx
        } else {
            let out = grow(&mut s.da, padded);
            packing.scatter(dctx, out, c);
            out
        };
        let dq = grow(&mut s.dq, padded);
        let dk = grow(&mut s.dk, padded);
        let dv = grow(&mut s.dv, padded);
        attention::backward(
            dq,
            dk,
            dv,
            &mut s.attn,
            dctx_padded,
            &cache.probs,
            &cache.q[..],
            &cache.k[..],
            &cache.v[..],
            &cache.attention_bf16,
            &self.dims(inputs),
        );
        let x16 = Flat::activation(g, x, &cache.x_bf16, n * c);
        for (linear, d) in [
            (&self.query, &mut s.dq),
            (&self.key, &mut s.dk),
            (&self.value, &mut s.dv),
        ] {
            let d_rows = if packing.is_identity() {
                &mut d[..n * c]
            } else {
                let rows = grow(&mut s.dh1, n * c);
                packing.gather(&d[..padded], rows, c);
                rows
            };
            let dx = Some((&mut *dx, true));
            linear.backward(g, dx, d_rows, x16, params, grads, n);
        }
    }
}

/// Where a forward writes the f32 values of an activation read in the backward only by GEMMs:
/// `stage` (scratch the next layer overwrites) when only its bf16 copy is kept
/// (`copies_only`; the cache's buffer, which a step of another precision may have filled, is
/// let go), else `cached`, kept for the backward.
fn values_in<'v, A>(
    copies_only: bool,
    cached: &'v mut Vec<A>,
    stage: &'v mut Vec<A>,
) -> &'v mut Vec<A> {
    if copies_only {
        *cached = Vec::new();
        stage
    } else {
        cached
    }
}
