//! Multi-head scaled dot-product self-attention (Vaswani et al. 2017, section 3.2.1-3.2.2;
//! HF: `BertSelfAttention`), from already projected `q`, `k`, `v`.
//!
//! Shapes: `q`, `k`, `v`, `ctx` `[n, c]` with head `j` in columns `j*d..(j+1)*d`; `mask` `[b, t]`
//! (1 = real token); `probs` `[b, h, t, t]`.
//!
//! Per sequence and head: `S = Q K^T / sqrt(d)`, keys at padding get HF's additive
//! `finfo.min`, i.e. probability exactly 0; `P = softmax(S)`; `P' = dropout(P)`;
//! `ctx = P' V`. Each (sequence, head) GEMM works on row-strided views of `q`, `k`, `v`,
//! `ctx`: no reshapes, no copies.

// The dimensions are attention's parameter (`attention::AttentionDims` to its callers).
pub(crate) use super::attention_dims::AttentionDims;

use super::Element;
use super::attention_batched::{KeptOperands, KeptPart};
use super::element::grow;
use super::gemm::{gemm, mat_mut};
use super::parallel;
use super::pass_profile::{Pass, bytes, region};
use super::softmax::{masked_softmax, softmax_backward, softmax_keys};
use ndarray::{ArrayView2, ArrayViewMut2, s};

fn head<'a, A>(x: &'a [A], dims: &AttentionDims<'_>, bi: usize, j: usize) -> ArrayView2<'a, A> {
    let (t, c, d) = (dims.t, dims.c(), dims.d);
    ArrayView2::from_shape((dims.b * t, c), &x[..dims.b * t * c])
        .expect("[n, c] buffer")
        .slice_move(s![bi * t..(bi + 1) * t, j * d..(j + 1) * d])
}

fn head_mut<'a, A>(
    x: &'a mut [A],
    dims: &AttentionDims<'_>,
    bi: usize,
    j: usize,
) -> ArrayViewMut2<'a, A> {
    let (t, c, d) = (dims.t, dims.c(), dims.d);
    ArrayViewMut2::from_shape((dims.b * t, c), &mut x[..dims.b * t * c])
        .expect("[n, c] buffer")
        .slice_move(s![bi * t..(bi + 1) * t, j * d..(j + 1) * d])
}

/// Whether this thread's GEMMs take the batched route (`super::attention_batched`): bf16
/// precision with native bf16 GEMMs, in f32.
fn batched<A: Element>() -> bool {
    std::any::TypeId::of::<A>() == std::any::TypeId::of::<f32>()
        && super::bf16::current() == keel_proto::precision::Precision::Bf16
        && super::bf16::support().native
}

/// Scratch elements per part of at most `seqs` sequences: `blocks` `[t, t]` blocks for the
/// per-(sequence, head) loop, or as many per (sequence, head) for the batched route.
fn scratch_per_part(dims: &AttentionDims<'_>, seqs: usize, blocks: usize, batched: bool) -> usize {
    let tt = dims.t * dims.t;
    if batched {
        blocks * seqs * dims.h * tt
    } else {
        blocks * tt
    }
}

/// Fills `probs` `[b, h, t, t]` (before dropout) and `ctx` `[n, c]`, the sequences split
/// among the model's threads. `scratch` grows to `threads * t * t` (the batched route:
/// `b * h * t * t`). On the batched route `kept` receives the bf16 copies of the operands
/// for [`backward`]; elsewhere it is left empty.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<A: Element>(
    ctx: &mut [A],
    probs: &mut [A],
    scratch: &mut Vec<A>,
    q: &[A],
    k: &[A],
    v: &[A],
    kept: &mut KeptOperands,
    dims: &AttentionDims<'_>,
) {
    let (t, c, h) = (dims.t, dims.c(), dims.h);
    let (rows, scores) = (dims.b * t * c, dims.b * h * t * t);
    let _region = region(
        Pass::AttentionElementwise,
        bytes::<A>(3 * rows),
        bytes::<A>(rows + scores),
    );
    let parts = parallel::split(dims.b, parallel::available_threads());
    let batched = batched::<A>();
    let (n, tt) = (dims.b * t * c, dims.b * h * t * t);
    kept.keep_inputs(&q[..n], &k[..n], &v[..n], tt);
    let most = parts.iter().map(|r| r.len()).max().unwrap_or(0);
    let per_part = scratch_per_part(dims, most, 1, batched);
    let scratch = grow(scratch, parts.len() * per_part);
    let mut work = Vec::with_capacity(parts.len());
    let (mut ctx, mut probs, mut scratch, mut kept_probs) = (
        &mut ctx[..n],
        &mut probs[..tt],
        scratch,
        &mut kept.probs[..],
    );
    for r in parts {
        let (ctx_part, ctx_rest) = ctx.split_at_mut(r.len() * t * c);
        let (probs_part, probs_rest) = probs.split_at_mut(r.len() * h * t * t);
        let (scratch_part, scratch_rest) = scratch.split_at_mut(per_part);
        let kept_len = if kept_probs.is_empty() {
            0
        } else {
            probs_part.len()
        };
        let (kept_part, kept_rest) = kept_probs.split_at_mut(kept_len);
        (ctx, probs, scratch, kept_probs) = (ctx_rest, probs_rest, scratch_rest, kept_rest);
        work.push((r, ctx_part, probs_part, scratch_part, kept_part));
    }
    let (kq, kk, kv) = (&kept.q[..], &kept.k[..], &kept.v[..]);
    parallel::run_parts(work, |(r, ctx, probs, scratch, kept_probs)| {
        let rows = r.start * t * c..r.end * t * c;
        let local = dims.part(&r);
        let (q, k, v) = (&q[rows.clone()], &k[rows.clone()], &v[rows.clone()]);
        if batched {
            let kept = KeptPart {
                q: kept_rows(kq, &rows),
                k: kept_rows(kk, &rows),
                v: kept_rows(kv, &rows),
                probs: kept_probs,
            };
            super::attention_batched::forward_seqs(ctx, probs, scratch, q, k, v, kept, &local);
        } else {
            forward_seqs(ctx, probs, scratch, q, k, v, &local);
        }
    });
}

/// The rows `rows` of a kept copy, or nothing when nothing was kept.
fn kept_rows<'k>(kept: &'k [u16], rows: &std::ops::Range<usize>) -> &'k [u16] {
    kept.get(rows.clone()).unwrap_or(&[])
}

pub(super) fn forward_seqs<A: Element>(
    ctx: &mut [A],
    probs: &mut [A],
    scratch: &mut [A],
    q: &[A],
    k: &[A],
    v: &[A],
    dims: &AttentionDims<'_>,
) {
    let (b, t, h, d) = (dims.b, dims.t, dims.h, dims.d);
    let n = b * t;
    let ctx = &mut ctx[..n * dims.c()];
    let scale = A::one() / A::of(d as f64).sqrt();
    for bi in 0..b {
        let keys = softmax_keys(&dims.mask[bi * t..(bi + 1) * t]);
        let mask = dims.mask_of(bi);
        for j in 0..h {
            let block = &mut probs[(bi * h + j) * t * t..(bi * h + j + 1) * t * t];
            let qh = head(q, dims, bi, j);
            let kh = head(k, dims, bi, j);
            gemm(scale, &qh, &kh.t(), A::zero(), &mut mat_mut(block, t, t));
            for row in block.chunks_exact_mut(t) {
                masked_softmax(row, keys);
            }
            let vh = head(v, dims, bi, j);
            let mut out = head_mut(ctx, dims, bi, j);
            match &mask {
                Some(m) => {
                    let dropped = &mut scratch[..t * t];
                    dropped.copy_from_slice(block);
                    dims.drop_block(m, j, dropped);
                    gemm(
                        A::one(),
                        &super::gemm::mat(dropped, t, t),
                        &vh,
                        A::zero(),
                        &mut out,
                    );
                }
                None => gemm(
                    A::one(),
                    &super::gemm::mat(block, t, t),
                    &vh,
                    A::zero(),
                    &mut out,
                ),
            }
        }
    }
}

/// Given `dctx` `[n, c]`: writes `dq`, `dk`, `dv` `[n, c]`, the sequences split among the
/// model's threads. `scratch` grows to `threads * 2 * t * t` (the batched route:
/// `2 * b * h * t * t`). `kept` is what [`forward`] kept from the same `probs`, `q`, `k`, `v`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<A: Element>(
    dq: &mut [A],
    dk: &mut [A],
    dv: &mut [A],
    scratch: &mut Vec<A>,
    dctx: &[A],
    probs: &[A],
    q: &[A],
    k: &[A],
    v: &[A],
    kept: &KeptOperands,
    dims: &AttentionDims<'_>,
) {
    let (t, c, h) = (dims.t, dims.c(), dims.h);
    let (rows, scores) = (dims.b * t * c, dims.b * h * t * t);
    let _region = region(
        Pass::AttentionElementwise,
        bytes::<A>(4 * rows + scores),
        bytes::<A>(3 * rows),
    );
    let parts = parallel::split(dims.b, parallel::available_threads());
    let batched = batched::<A>();
    let most = parts.iter().map(|r| r.len()).max().unwrap_or(0);
    let per_part = scratch_per_part(dims, most, 2, batched);
    let scratch = grow(scratch, parts.len() * per_part);
    let mut work = Vec::with_capacity(parts.len());
    let n = dims.b * t * c;
    let (mut dq, mut dk, mut dv, mut scratch) = (&mut dq[..n], &mut dk[..n], &mut dv[..n], scratch);
    for r in parts {
        let len = r.len() * t * c;
        let (dq_part, dq_rest) = dq.split_at_mut(len);
        let (dk_part, dk_rest) = dk.split_at_mut(len);
        let (dv_part, dv_rest) = dv.split_at_mut(len);
        let (scratch_part, scratch_rest) = scratch.split_at_mut(per_part);
        (dq, dk, dv, scratch) = (dq_rest, dk_rest, dv_rest, scratch_rest);
        work.push((r, dq_part, dk_part, dv_part, scratch_part));
    }
    parallel::run_parts(work, |(r, dq, dk, dv, scratch)| {
        let rows = r.start * t * c..r.end * t * c;
        let local = dims.part(&r);
        let prows = r.start * h * t * t..r.end * h * t * t;
        let p = &probs[prows.clone()];
        let (dctx, q, k, v) = (
            &dctx[rows.clone()],
            &q[rows.clone()],
            &k[rows.clone()],
            &v[rows.clone()],
        );
        if batched {
            let kept = KeptPart {
                q: kept_rows(&kept.q, &rows),
                k: kept_rows(&kept.k, &rows),
                v: kept_rows(&kept.v, &rows),
                probs: kept_rows(&kept.probs, &prows),
            };
            super::attention_batched::backward_seqs(
                dq, dk, dv, scratch, dctx, p, q, k, v, kept, &local,
            );
        } else {
            backward_seqs(dq, dk, dv, scratch, dctx, p, q, k, v, &local);
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward_seqs<A: Element>(
    dq: &mut [A],
    dk: &mut [A],
    dv: &mut [A],
    scratch: &mut [A],
    dctx: &[A],
    probs: &[A],
    q: &[A],
    k: &[A],
    v: &[A],
    dims: &AttentionDims<'_>,
) {
    let (b, t, h, d) = (dims.b, dims.t, dims.h, dims.d);
    let scale = A::one() / A::of(d as f64).sqrt();
    let (dropped, dp) = scratch[..2 * t * t].split_at_mut(t * t);
    for bi in 0..b {
        let mask = dims.mask_of(bi);
        for j in 0..h {
            let p = &probs[(bi * h + j) * t * t..(bi * h + j + 1) * t * t];
            let dctx_h = head(dctx, dims, bi, j);
            // dV = P'^T dctx
            let p_used = match &mask {
                Some(m) => {
                    dropped.copy_from_slice(p);
                    dims.drop_block(m, j, dropped);
                    &*dropped
                }
                None => p,
            };
            gemm(
                A::one(),
                &super::gemm::mat(p_used, t, t).t(),
                &dctx_h,
                A::zero(),
                &mut head_mut(dv, dims, bi, j),
            );
            // dP' = dctx V^T, then dP through the same dropout mask.
            let vh = head(v, dims, bi, j);
            gemm(
                A::one(),
                &dctx_h,
                &vh.t(),
                A::zero(),
                &mut mat_mut(dp, t, t),
            );
            if let Some(m) = &mask {
                dims.drop_block(m, j, dp);
            }
            softmax_backward(dp, p, t);
            let ds = super::gemm::mat(dp, t, t);
            // dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)
            gemm(
                scale,
                &ds,
                &head(k, dims, bi, j),
                A::zero(),
                &mut head_mut(dq, dims, bi, j),
            );
            gemm(
                scale,
                &ds.t(),
                &head(q, dims, bi, j),
                A::zero(),
                &mut head_mut(dk, dims, bi, j),
            );
        }
    }
}
