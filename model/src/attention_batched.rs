//! The same attention as `super::attention` (same math, masks and dropout), with each of its
//! GEMMs issued as one batched call over all (sequence, head) pairs of a thread's sequences
//! rather than one call per pair ([`super::gemm::gemm_batched`]).
//!
//! Used where bf16 GEMMs run natively (oneDNN): a `[128, 64] x [64, 128]` block is ~2 MFLOP,
//! which AMX finishes in a few microseconds, about what each oneDNN call costs in overhead, so
//! per-pair calls ran attention's GEMMs at 14-56 GFLOP/s against 110-300 for the
//! projections (mini, oneDNN verbose timings, Intel Xeon with AMX, 2026-12-02). Elsewhere the
//! per-pair loop stays: it keeps each `[t, t]` block in cache between its GEMM and its softmax,
//! which the phases below do not.
//!
//! Shapes as in `super::attention`: `q`, `k`, `v`, `ctx`, `dq`, `dk`, `dv`, `dctx` `[b * t, c]`
//! for this thread's `b` sequences (head `j` in columns `j*d..(j+1)*d`); `probs` `[b, h, t, t]`.
//! `scratch` holds `2 * b * h * t * t` elements.

use super::Element;
use super::attention_dims::AttentionDims;
use super::bf16_shared::{round_in_place, round_once};
use super::element::f32_slice;
use super::gemm::{GemmSite, gemm_batched};
use super::gemms::Gemms;
use super::onednn::Strided4;
use super::softmax::{masked_softmax, softmax_backward, softmax_keys};

/// One part's buffers for the bf16 copies of the operands on the native route, each made once
/// per call and shared by the GEMMs that read it; owned by the model's attention scratch
/// (`super::attention::AttentionScratch`), so no allocation once grown.
pub(crate) type Copies16 = [Vec<u16>; 5];

/// The bf16 copy of `x` in `buf` on the native route (`None` elsewhere: each GEMM then takes
/// `x` as it is).
fn copy<'c, A: Element>(gemms: Gemms, x: &'c [A], buf: &'c mut Vec<u16>) -> Option<&'c [u16]> {
    round_once(gemms, x, buf).bf16
}

/// `kept` (the bf16 copy of `x` kept by the forward) when there is one, else [`copy`].
fn kept_or_copy<'c, A: Element>(
    gemms: Gemms,
    kept: &'c [u16],
    x: &'c [A],
    buf: &'c mut Vec<u16>,
) -> Option<&'c [u16]> {
    if kept.is_empty() {
        copy(gemms, x, buf)
    } else {
        Some(kept)
    }
}

/// The bf16 copies of attention's GEMM operands that the forward keeps for the backward: `q`,
/// `k`, `v` `[n, c]` (made by the encoder layer as it projects them, `super::bf16_shared::keep`;
/// their f32 values are then not kept: only GEMMs read them) and the probabilities after
/// dropout `[b, h, t, t]` (their f32 values before dropout are kept too: the softmax backward
/// reads them), each rounded once instead of once in forward and again in backward. All
/// empty off the native bf16 route.
#[derive(Debug, Default)]
pub(crate) struct KeptOperands {
    pub q: Vec<u16>,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
    pub probs: Vec<u16>,
}

impl KeptOperands {
    /// Sizes `probs` to `probs_len` for the forward to fill where `q` was kept, or empties it
    /// where nothing was.
    pub fn size_probs(&mut self, probs_len: usize) {
        self.probs.clear();
        if !self.q.is_empty() {
            self.probs.resize(probs_len, 0);
        }
    }
}

/// One thread's share of [`KeptOperands`]: its sequences' rows (all empty when nothing is
/// kept). `probs` is written by the forward and read by the backward.
pub(crate) struct KeptPart<'a, P> {
    pub q: &'a [u16],
    pub k: &'a [u16],
    pub v: &'a [u16],
    pub probs: P,
}

/// The heads of a `[b * t, c]` buffer as `[b, h, t, d]`.
fn heads(dims: &AttentionDims<'_>) -> Strided4 {
    let (t, c, d) = (dims.t, dims.h * dims.d, dims.d);
    Strided4 {
        dims: [dims.b, dims.h, t, d],
        strides: [t * c, d, c, 1],
    }
}

/// `[b, h, t, t]` dense.
fn blocks(dims: &AttentionDims<'_>) -> Strided4 {
    Strided4::dense([dims.b, dims.h, dims.t, dims.t])
}

/// `probs` with this thread's attention-probs dropout applied, in `out` (the probabilities
/// themselves when there is no dropout).
fn dropped<'p, A: Element>(probs: &'p [A], out: &'p mut [A], dims: &AttentionDims<'_>) -> &'p [A] {
    let tt = dims.t * dims.t;
    let n = dims.b * dims.h * tt;
    if dims.dropout.is_none() {
        return &probs[..n];
    }
    out[..n].copy_from_slice(&probs[..n]);
    for bi in 0..dims.b {
        if let Some(m) = dims.mask_of(bi) {
            for j in 0..dims.h {
                let at = (bi * dims.h + j) * tt;
                dims.drop_block(&m, j, &mut out[at..at + tt]);
            }
        }
    }
    &out[..n]
}

/// The bf16 patterns of the probabilities after this thread's attention-probs dropout, in
/// `out` `[b, h, t, t]`: the bits of rounding [`dropped`]'s output, made one `[t, t]` block at
/// a time through `block` (f32, at least `t * t`) instead of a `[b, h, t, t]` f32 buffer.
/// Only for f32 (copies are kept only there).
fn round_dropped<A: Element>(
    probs: &[A],
    out: &mut [u16],
    block: &mut [A],
    dims: &AttentionDims<'_>,
) {
    let tt = dims.t * dims.t;
    let block = &mut block[..tt];
    for bi in 0..dims.b {
        let mask = dims.mask_of(bi);
        for j in 0..dims.h {
            let at = (bi * dims.h + j) * tt;
            let p = &probs[at..at + tt];
            let p = match &mask {
                Some(m) => {
                    block.copy_from_slice(p);
                    dims.drop_block(m, j, block);
                    &*block
                }
                None => p,
            };
            let p = f32_slice(p).expect("bf16 copies are kept only for f32");
            super::bf16_convert::convert_slice(&mut out[at..at + tt], p);
        }
    }
}

/// Forward for this thread's sequences: fills `probs` (before dropout) and `ctx`, and
/// `kept.probs` (when not empty) with the bf16 copy of the probabilities after dropout.
/// `q`, `k`, `v` may be empty where `kept` has their copies. `scratch` holds `t * t` elements
/// where `kept.probs` is not empty, else `b * h * t * t`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_seqs<A: Element>(
    ctx: &mut [A],
    probs: &mut [A],
    scratch: &mut [A],
    copies: &mut Copies16,
    q: &[A],
    k: &[A],
    v: &[A],
    kept: KeptPart<'_, &mut [u16]>,
    dims: &AttentionDims<'_>,
) {
    let (b, t, h) = (dims.b, dims.t, dims.h);
    let scale = A::one() / A::of(dims.d as f64).sqrt();
    let (hv, bl) = (heads(dims), blocks(dims));
    let (g, scores, context) = (
        dims.gemms,
        GemmSite::AttentionScores,
        GemmSite::AttentionContext,
    );
    {
        let [q16, k16, v16, p16, ..] = copies;
        let q16 = kept_or_copy(g, kept.q, q, q16);
        let k16 = kept_or_copy(g, kept.k, k, k16);
        let v16 = kept_or_copy(g, kept.v, v, v16);
        // S = Q K^T / sqrt(d), every (sequence, head) at once.
        gemm_batched(
            g,
            scores,
            scale,
            (q, q16, hv),
            (k, k16, hv.t()),
            A::zero(),
            (&mut *probs, bl),
        );
        for bi in 0..b {
            let keys = softmax_keys(&dims.mask[bi * t..(bi + 1) * t]);
            for row in probs[bi * h * t * t..(bi + 1) * h * t * t].chunks_exact_mut(t) {
                masked_softmax(row, keys);
            }
        }
        // ctx = P' V: where the copy of P' is kept, the GEMM reads only it.
        let (p, p16): (&[A], _) = if kept.probs.is_empty() {
            let p = dropped(probs, scratch, dims);
            (p, copy(g, p, p16))
        } else {
            round_dropped(probs, kept.probs, scratch, dims);
            (&[], Some(&*kept.probs))
        };
        let (p_op, v_op) = ((p, p16, bl), (v, v16, hv));
        gemm_batched(g, context, A::one(), p_op, v_op, A::zero(), (ctx, hv));
    }
}

/// Backward for this thread's sequences: writes `dq`, `dk`, `dv` from `dctx`. `q`, `k`, `v`
/// may be empty where `kept` has their copies. `scratch` holds `b * h * t * t` elements where
/// `kept.probs` is not empty (the probabilities after dropout are then read from it alone),
/// else twice that. On the native route the gradient of the scores is rounded in place
/// (`super::bf16_convert::round_in_place`): only the two GEMMs after it read it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_seqs<A: Element>(
    dq: &mut [A],
    dk: &mut [A],
    dv: &mut [A],
    scratch: &mut [A],
    copies: &mut Copies16,
    dctx: &[A],
    probs: &[A],
    q: &[A],
    k: &[A],
    v: &[A],
    kept: KeptPart<'_, &[u16]>,
    dims: &AttentionDims<'_>,
) {
    let (b, t, h) = (dims.b, dims.t, dims.h);
    let tt = t * t;
    let scale = A::one() / A::of(dims.d as f64).sqrt();
    let (hv, bl) = (heads(dims), blocks(dims));
    let drop_len = if kept.probs.is_empty() { b * h * tt } else { 0 };
    let (drop_buf, dp) = scratch[..drop_len + b * h * tt].split_at_mut(drop_len);
    let (g, scores, context) = (
        dims.gemms,
        GemmSite::AttentionScores,
        GemmSite::AttentionContext,
    );
    {
        let [dctx16, v16, k16, q16, p16] = copies;
        let (dctx16, v16) = (copy(g, dctx, dctx16), kept_or_copy(g, kept.v, v, v16));
        // dV = P'^T dctx (P' as the forward kept it, or again).
        let (p_used, p16): (&[A], _) = if kept.probs.is_empty() {
            let p = dropped(probs, drop_buf, dims);
            (p, copy(g, p, p16))
        } else {
            (&[], Some(kept.probs))
        };
        gemm_batched(
            g,
            context,
            A::one(),
            (p_used, p16, bl.t()),
            (dctx, dctx16, hv),
            A::zero(),
            (dv, hv),
        );
        // dP' = dctx V^T, then dP through the same dropout mask, then the softmax backward.
        gemm_batched(
            g,
            context,
            A::one(),
            (dctx, dctx16, hv),
            (v, v16, hv.t()),
            A::zero(),
            (&mut *dp, bl),
        );
        for bi in 0..b {
            let mask = dims.mask_of(bi);
            for j in 0..h {
                let at = (bi * h + j) * tt;
                let block = &mut dp[at..at + tt];
                if let Some(m) = &mask {
                    dims.drop_block(m, j, block);
                }
                softmax_backward(block, &probs[at..at + tt], t);
            }
        }
        // dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d); dS rounded once, in place.
        let ds = round_in_place(g, dp);
        let (ds, ds16) = (ds.f32, ds.bf16);
        let (k16, q16) = (
            kept_or_copy(g, kept.k, k, k16),
            kept_or_copy(g, kept.q, q, q16),
        );
        let (ds_op, k_op) = ((ds, ds16, bl), (k, k16, hv));
        gemm_batched(g, scores, scale, ds_op, k_op, A::zero(), (dq, hv));
        gemm_batched(
            g,
            scores,
            scale,
            (ds, ds16, bl.t()),
            (q, q16, hv),
            A::zero(),
            (dk, hv),
        );
    }
}

#[cfg(test)]
mod tests {
    use keel_proto::precision::Precision;

    use super::super::attention::{self, AttentionDims};
    use super::super::bf16::support;
    use super::super::dropout::DropoutKey;
    use super::super::gemms::Gemms;
    use super::super::{Element, gemm};

    /// 3 sequences, 2 heads of 8, 6 tokens; sequence 1 has 2 padded keys, sequence 2 is all
    /// padding (every key masked: HF then attends uniformly).
    const B: usize = 3;
    const T: usize = 6;
    const H: usize = 2;
    const D: usize = 8;

    fn data<A: Element>(n: usize, seed: u32) -> Vec<A> {
        (0..n)
            .map(|i| {
                let x = (i as f64 * 12.9898 + f64::from(seed) * 78.233).sin() * 43_758.547;
                A::of((x - x.floor()) * 2.0 - 1.0)
            })
            .collect()
    }

    /// Forward (`ctx`, `probs`) and backward (`dq`, `dk`, `dv`) of one route.
    fn run<A: Element>(gemms: Gemms, batched: bool, dropout: bool) -> Vec<Vec<A>> {
        let n = B * T * H * D;
        let (q, k, v, dctx) = (
            data::<A>(n, 1),
            data::<A>(n, 2),
            data::<A>(n, 3),
            data::<A>(n, 4),
        );
        let mut mask = vec![1u8; B * T];
        mask[T + 4..2 * T].fill(0);
        mask[2 * T..].fill(0);
        let ids = [5u64, 9, 13];
        let dims = AttentionDims {
            b: B,
            t: T,
            h: H,
            d: D,
            mask: &mask,
            dropout: dropout.then_some((DropoutKey { seed: 3, step: 1 }, &ids[..], 1, 0.25)),
            max_positions: 16,
            gemms,
        };
        let mut copies = super::Copies16::default();
        let (mut ctx, mut probs) = (vec![A::zero(); n], vec![A::zero(); B * H * T * T]);
        let mut scratch = vec![A::zero(); 2 * B * H * T * T];
        let (mut dq, mut dk, mut dv) = (vec![A::zero(); n], vec![A::zero(); n], vec![A::zero(); n]);
        if batched {
            let kept = || super::KeptPart {
                q: &[],
                k: &[],
                v: &[],
                probs: &mut [][..],
            };
            super::forward_seqs(
                &mut ctx,
                &mut probs,
                &mut scratch,
                &mut copies,
                &q,
                &k,
                &v,
                kept(),
                &dims,
            );
            let none = super::KeptPart {
                q: &[],
                k: &[],
                v: &[],
                probs: &[][..],
            };
            super::backward_seqs(
                &mut dq,
                &mut dk,
                &mut dv,
                &mut scratch,
                &mut copies,
                &dctx,
                &probs,
                &q,
                &k,
                &v,
                none,
                &dims,
            );
        } else {
            attention::forward_seqs(&mut ctx, &mut probs, &mut scratch, &q, &k, &v, &dims);
            attention::backward_seqs(
                &mut dq,
                &mut dk,
                &mut dv,
                &mut scratch,
                &dctx,
                &probs,
                &q,
                &k,
                &v,
                &dims,
            );
        }
        vec![ctx, probs, dq, dk, dv]
    }

    fn worst<A: Element>(x: &[Vec<A>], y: &[Vec<A>]) -> f64 {
        x.iter()
            .flatten()
            .zip(y.iter().flatten())
            .map(|(a, b)| (a.to64() - b.to64()).abs())
            .fold(0.0, f64::max)
    }

    /// On every machine: where GEMMs are not native bf16, the batched route runs the same
    /// per-(sequence, head) products as the loop, so with padding, an all-padding sequence
    /// and dropout its outputs and gradients are the loop's (f64 and f32, fp32 precision).
    #[test]
    fn batched_route_gives_the_loops_results() {
        for dropout in [false, true] {
            let (b, l) = (
                run::<f64>(Gemms::FP32, true, dropout),
                run::<f64>(Gemms::FP32, false, dropout),
            );
            assert!(
                worst(&b, &l) <= 1e-15,
                "f64, dropout {dropout}: {:e}",
                worst(&b, &l)
            );
            assert!(b[2].iter().any(|x| x.abs() > 1e-3), "dq is not all zero");
            let (b, l) = (
                run::<f32>(Gemms::FP32, true, dropout),
                run::<f32>(Gemms::FP32, false, dropout),
            );
            assert!(
                worst(&b, &l) <= 1e-6,
                "f32, dropout {dropout}: {:e}",
                worst(&b, &l)
            );
        }
    }

    /// Where bf16 GEMMs run natively (AMX, or AVX512_BF16 that won the race), the batched
    /// oneDNN calls agree with the per-pair native calls: both round the same f32 inputs to
    /// bf16 and accumulate in fp32, so only the order of the fp32 sums may differ (values
    /// here are below 4 in magnitude and sums have at most 8 terms: 1e-5 is ~40 fp32 ulps of
    /// the largest). And the batched calls ran natively (counted in the GEMM stats).
    #[test]
    fn batched_native_bf16_agrees_with_per_pair_native_calls() {
        if !support().native {
            println!("SKIPPED: no native bf16 GEMM here ({})", support().detail);
            return;
        }
        let native = || gemm::stats().class_flops[1][2];
        let before = native();
        let bf16 = Gemms::new::<f32>(Precision::Bf16);
        let b = run::<f32>(bf16, true, true);
        assert!(native() > before, "the batched calls ran natively");
        let l = run::<f32>(bf16, false, true);
        assert!(worst(&b, &l) <= 1e-5, "{:e}", worst(&b, &l));
        // And both differ from fp32 (the inputs were rounded).
        let f = run::<f32>(Gemms::FP32, false, true);
        assert!(worst(&b, &f) > 1e-5, "bf16 rounding happened");
    }
}
