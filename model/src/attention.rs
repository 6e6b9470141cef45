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
//!
//! Two routes behind [`forward`] and [`backward`], the same math: where bf16 GEMMs run
//! natively, every (sequence, head) product of a thread's sequences in one batched call
//! (`super::attention_batched`); elsewhere one call per (sequence, head). The choice is made
//! from the caller's GEMM route (`AttentionDims::gemms`), a value the model made once
//! ([`Route::of`]), never from state of the thread.

// The dimensions are attention's parameter (`attention::AttentionDims` to its callers).
pub(crate) use super::attention_dims::AttentionDims;

use super::Element;
use super::attention_batched::{Copies16, KeptOperands, KeptPart};
use super::element::grow;
use super::gemm::{GemmSite, gemm, mat_mut};
use super::gemms::Gemms;
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

/// Which implementation of attention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// One GEMM call per (sequence, head): keeps each `[t, t]` block in cache between its GEMM
    /// and its softmax.
    PerPair,
    /// One batched GEMM call per phase over a thread's sequences (`super::attention_batched`):
    /// a native bf16 call costs about as much overhead as a small block's work.
    Batched,
}

impl Route {
    /// The route for GEMMs that run as `gemms` says: batched exactly where they are native bf16.
    pub(crate) fn of(gemms: Gemms) -> Route {
        if gemms.native() {
            Route::Batched
        } else {
            Route::PerPair
        }
    }
}

/// Attention's scratch, owned by the model and reused from step to step.
#[derive(Debug, Default)]
pub(crate) struct AttentionScratch<A> {
    /// Probabilities after dropout and their gradient: [`scratch_per_part`] elements a part.
    pub values: Vec<A>,
    /// bf16 copies of the operands a part's batched GEMMs share (one set a part).
    pub copies: Vec<Copies16>,
}

/// `copies` grown to `parts` sets; its first `parts`.
fn copies_for(copies: &mut Vec<Copies16>, parts: usize) -> &mut [Copies16] {
    if copies.len() < parts {
        copies.resize_with(parts, Default::default);
    }
    &mut copies[..parts]
}

/// Scratch elements per part of at most `seqs` sequences: `blocks` `[t, t]` blocks for the
/// per-(sequence, head) loop, or as many per (sequence, head) for the batched route. Where the
/// bf16 copy of the probabilities after dropout is kept, the batched route needs one block
/// less (its forward makes the copy a block at a time, its backward reads it: no f32
/// probabilities after dropout are held).
fn scratch_per_part(dims: &AttentionDims<'_>, seqs: usize, blocks: usize, batched: bool) -> usize {
    let tt = dims.t * dims.t;
    match (batched, dims.gemms.keeps()) {
        (true, true) if blocks == 1 => tt,
        (true, true) => (blocks - 1) * seqs * dims.h * tt,
        (true, false) => blocks * seqs * dims.h * tt,
        (false, _) => blocks * tt,
    }
}

/// Fills `probs` `[b, h, t, t]` (before dropout) and `ctx` `[n, c]`, the sequences split
/// among the model's threads. `scratch.values` grows to `threads * t * t` (the batched route:
/// `b * h * t * t`). Where `dims.gemms` keeps copies (the batched route), `kept` comes with
/// the bf16 copies of `q`, `k`, `v` (made by the layer, which then keeps no f32 values: `q`,
/// `k`, `v` are empty) and receives that of the probabilities after dropout for [`backward`];
/// elsewhere `kept` is empty and `q`, `k`, `v` are `[n, c]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<A: Element>(
    ctx: &mut [A],
    probs: &mut [A],
    scratch: &mut AttentionScratch<A>,
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
    let batched = Route::of(dims.gemms) == Route::Batched;
    let (n, tt) = (dims.b * t * c, dims.b * h * t * t);
    kept.size_probs(tt);
    let most = parts.iter().map(|r| r.len()).max().unwrap_or(0);
    let per_part = scratch_per_part(dims, most, 1, batched);
    let values = grow(&mut scratch.values, parts.len() * per_part);
    let mut copies = copies_for(&mut scratch.copies, parts.len()).iter_mut();
    let mut work = Vec::with_capacity(parts.len());
    let (mut ctx, mut probs, mut scratch, mut kept_probs) =
        (&mut ctx[..n], &mut probs[..tt], values, &mut kept.probs[..]);
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
        let part_copies = copies.next().expect("one set of copies a part");
        work.push((
            r,
            ctx_part,
            probs_part,
            scratch_part,
            kept_part,
            part_copies,
        ));
    }
    let (kq, kk, kv) = (&kept.q[..], &kept.k[..], &kept.v[..]);
    parallel::run_parts(work, |(r, ctx, probs, scratch, kept_probs, copies)| {
        let rows = r.start * t * c..r.end * t * c;
        let local = dims.part(&r);
        let (q, k, v) = (
            value_rows(q, &rows),
            value_rows(k, &rows),
            value_rows(v, &rows),
        );
        if batched {
            let kept = KeptPart {
                q: kept_rows(kq, &rows),
                k: kept_rows(kk, &rows),
                v: kept_rows(kv, &rows),
                probs: kept_probs,
            };
            super::attention_batched::forward_seqs(
                ctx, probs, scratch, copies, q, k, v, kept, &local,
            );
        } else {
            forward_seqs(ctx, probs, scratch, q, k, v, &local);
        }
    });
}

/// The rows `rows` of a kept copy, or nothing when nothing was kept.
fn kept_rows<'k>(kept: &'k [u16], rows: &std::ops::Range<usize>) -> &'k [u16] {
    kept.get(rows.clone()).unwrap_or(&[])
}

/// The rows `rows` of `q`, `k` or `v`, or nothing when only their copy was kept (empty).
fn value_rows<'x, A>(x: &'x [A], rows: &std::ops::Range<usize>) -> &'x [A] {
    if x.is_empty() { x } else { &x[rows.clone()] }
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
            let g = dims.gemms;
            let (scores, context) = (GemmSite::AttentionScores, GemmSite::AttentionContext);
            let block_mat = &mut mat_mut(block, t, t);
            gemm(
                g,
                scores,
                scale,
                qh.into(),
                kh.t().into(),
                A::zero(),
                block_mat,
            );
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
                        g,
                        context,
                        A::one(),
                        super::gemm::mat(dropped, t, t).into(),
                        vh.into(),
                        A::zero(),
                        &mut out,
                    );
                }
                None => gemm(
                    g,
                    context,
                    A::one(),
                    super::gemm::mat(block, t, t).into(),
                    vh.into(),
                    A::zero(),
                    &mut out,
                ),
            }
        }
    }
}

/// Given `dctx` `[n, c]`: writes `dq`, `dk`, `dv` `[n, c]`, the sequences split among the
/// model's threads. `scratch.values` grows to `threads * 2 * t * t` (the batched route:
/// `2 * b * h * t * t`). `kept` is what [`forward`] kept from the same `probs`, `q`, `k`, `v`
/// (`q`, `k`, `v` empty where only their copies were kept, as for [`forward`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<A: Element>(
    dq: &mut [A],
    dk: &mut [A],
    dv: &mut [A],
    scratch: &mut AttentionScratch<A>,
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
    let batched = Route::of(dims.gemms) == Route::Batched;
    let most = parts.iter().map(|r| r.len()).max().unwrap_or(0);
    let per_part = scratch_per_part(dims, most, 2, batched);
    let mut copies = copies_for(&mut scratch.copies, parts.len()).iter_mut();
    let scratch = grow(&mut scratch.values, parts.len() * per_part);
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
        let part_copies = copies.next().expect("one set of copies a part");
        work.push((r, dq_part, dk_part, dv_part, scratch_part, part_copies));
    }
    parallel::run_parts(work, |(r, dq, dk, dv, scratch, copies)| {
        let rows = r.start * t * c..r.end * t * c;
        let local = dims.part(&r);
        let prows = r.start * h * t * t..r.end * h * t * t;
        let p = &probs[prows.clone()];
        let (dctx, q, k, v) = (
            &dctx[rows.clone()],
            value_rows(q, &rows),
            value_rows(k, &rows),
            value_rows(v, &rows),
        );
        if batched {
            let kept = KeptPart {
                q: kept_rows(&kept.q, &rows),
                k: kept_rows(&kept.k, &rows),
                v: kept_rows(&kept.v, &rows),
                probs: kept_rows(&kept.probs, &prows),
            };
            super::attention_batched::backward_seqs(
                dq, dk, dv, scratch, copies, dctx, p, q, k, v, kept, &local,
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
    let g = dims.gemms;
    let (scores, context) = (GemmSite::AttentionScores, GemmSite::AttentionContext);
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
                g,
                context,
                A::one(),
                super::gemm::mat(p_used, t, t).t().into(),
                dctx_h.into(),
                A::zero(),
                &mut head_mut(dv, dims, bi, j),
            );
            // dP' = dctx V^T, then dP through the same dropout mask.
            let vh = head(v, dims, bi, j);
            gemm(
                g,
                context,
                A::one(),
                dctx_h.into(),
                vh.t().into(),
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
                g,
                scores,
                scale,
                ds.into(),
                head(k, dims, bi, j).into(),
                A::zero(),
                &mut head_mut(dq, dims, bi, j),
            );
            gemm(
                g,
                scores,
                scale,
                ds.t().into(),
                head(q, dims, bi, j).into(),
                A::zero(),
                &mut head_mut(dk, dims, bi, j),
            );
        }
    }
}
