//! GEMMs cut among the model's threads: `C` by blocks of rows (or of columns, when it is wider
//! than tall), one single-threaded kernel call (OpenBLAS, oneDNN) per part. Shared by the
//! fp32 route (`super::gemm`) and the bf16 routes (`super::bf16`).
//!
//! Each element of `C` is still one dot product over the whole `k`; only OpenBLAS's edge
//! kernels may order its terms differently, so results with different thread counts agree to
//! rounding, not bit for bit.

use std::ops::Range;

use ndarray::{ArrayView2, ArrayViewMut2, Axis, s};

use super::Element;
use super::parallel;

/// `c = alpha * a b + beta * c` by OpenBLAS on `parts` threads (see [`split_among`]).
pub(crate) fn multiply<A: Element>(
    alpha: A,
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
) {
    split_among(a, b, c, parts, &|a, b, c| {
        ndarray::linalg::general_mat_mul(alpha, a, b, beta, c)
    });
}

/// A single-threaded GEMM kernel `c (op)= a b` on views (OpenBLAS, oneDNN).
pub(crate) type Kernel<'k, T, C> =
    dyn Fn(&ArrayView2<'_, T>, &ArrayView2<'_, T>, &mut ArrayViewMut2<'_, C>) + Sync + 'k;

/// A [`Kernel`] that is also told which columns of the whole `C` its part holds (to take
/// the matching part of a bias).
pub(crate) type ColumnKernel<'k, T, C> = dyn Fn(&ArrayView2<'_, T>, &ArrayView2<'_, T>, &mut ArrayViewMut2<'_, C>, Range<usize>)
    + Sync
    + 'k;

/// Runs `kernel(a, b, c)` on `parts` threads: `c` cut by rows, or by columns when it is wider
/// than tall (`C^T = B^T A^T`: the same call on transposed views).
pub(crate) fn split_among<T: Sync, C: Send>(
    a: &ArrayView2<'_, T>,
    b: &ArrayView2<'_, T>,
    c: &mut ArrayViewMut2<'_, C>,
    parts: usize,
    kernel: &Kernel<'_, T, C>,
) {
    if parts <= 1 || a.nrows() >= b.ncols() {
        // One call, or cut by rows: the same as keeping C's layout.
        split_keeping_c_layout(a, b, c, parts, &|a, b, c, _| kernel(a, b, c));
    } else {
        split_rows(
            &b.t(),
            &a.t(),
            &mut c.view_mut().reversed_axes(),
            parts,
            kernel,
        );
    }
}

/// Fewest rows of `C` per part for [`split_keeping_c_layout`] to cut a wide `C` by rows.
const MIN_ROWS_PER_PART: usize = 64;

/// Like [`split_among`], but `c` keeps its memory layout in every part: cut by rows (when it
/// is taller than wide, or has at least [`MIN_ROWS_PER_PART`] rows a part), else by blocks of
/// columns (no transposed `C`). Rows first: a block of columns of a row-major `C` is not
/// dense, and oneDNN runs such a part on `gemm:jit` instead of its AMX brgemm kernel (the MLM
/// decoder's `[masked, vocab]` logits cut by columns took 32-43 ms on 2 threads against 20-21
/// on 1: BERT-tiny, AMX Xeon, 2026-12-05). oneDNN's fast bf16
/// kernels take only a row-major `C`; handed the transposed one that [`split_among`] makes
/// of a wide `C` (the MLM decoder's `[masked, vocab]`), oneDNN 2.6.3 falls back to its
/// reference kernel, ~200x slower (measured: 0.9 GFLOP/s on the Zen 5 EPYC with 2 threads).
/// Each call is told its part's columns of `C`.
pub(crate) fn split_keeping_c_layout<T: Sync, C: Send>(
    a: &ArrayView2<'_, T>,
    b: &ArrayView2<'_, T>,
    c: &mut ArrayViewMut2<'_, C>,
    parts: usize,
    kernel: &ColumnKernel<'_, T, C>,
) {
    let n = b.ncols();
    if parts <= 1 {
        kernel(a, b, c, 0..n);
    } else if a.nrows() >= n || a.nrows() >= parts * MIN_ROWS_PER_PART {
        split_rows(a, b, c, parts, &|a, b, c| kernel(a, b, c, 0..n));
    } else {
        let mut blocks = Vec::with_capacity(parts);
        let mut rest = c.view_mut();
        for r in parallel::split(n, parts) {
            let (block, tail) = rest.split_at(Axis(1), r.len());
            rest = tail;
            blocks.push((b.slice(s![.., r.clone()]), block, r));
        }
        parallel::run_parts(blocks, |(b_block, mut c_block, cols)| {
            kernel(a, &b_block, &mut c_block, cols);
        });
    }
}

/// `kernel` with the rows of `a` and `c` cut into `parts` contiguous blocks, each on its own
/// thread.
fn split_rows<T: Sync, C: Send>(
    a: &ArrayView2<'_, T>,
    b: &ArrayView2<'_, T>,
    c: &mut ArrayViewMut2<'_, C>,
    parts: usize,
    kernel: &Kernel<'_, T, C>,
) {
    let m = a.nrows();
    let mut blocks = Vec::with_capacity(parts);
    let mut rest = c.view_mut();
    for r in parallel::split(m, parts) {
        let (block, tail) = rest.split_at(Axis(0), r.len());
        rest = tail;
        blocks.push((a.slice(s![r, ..]), block));
    }
    parallel::run_parts(blocks, |(a_block, mut c_block)| {
        kernel(&a_block, b, &mut c_block);
    });
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, ShapeBuilder};

    use super::multiply;
    use crate::Element;

    fn filled<A: Element>(r: usize, c: usize, seed: usize, column_major: bool) -> Array2<A> {
        let f = move |(i, j): (usize, usize)| {
            A::of((((i * 131 + j * 71 + seed * 17) % 97) as f64 - 48.0) / 37.0)
        };
        if column_major {
            Array2::from_shape_fn((r, c).f(), f)
        } else {
            Array2::from_shape_fn((r, c), f)
        }
    }

    /// Cutting `C` among threads, by rows or by columns, with plain, transposed and
    /// column-major operands and `beta != 0`, gives the one-call result up to rounding
    /// (OpenBLAS's edge kernels may order a dot product's terms differently).
    fn same_result_cut_or_not<A: Element>(tolerance: f64) {
        for &(m, k, n) in &[(100, 37, 50), (7, 300, 90), (64, 64, 3), (33, 1, 65)] {
            for layout in 0..4 {
                let (ta, tb) = (layout & 1 == 1, layout & 2 == 2);
                let a = filled::<A>(m, k, 1, ta);
                let b = filled::<A>(k, n, 2, tb);
                let c0 = filled::<A>(m, n, 3, false);
                let (alpha, beta) = (A::of(0.75), A::of(0.5));
                let mut whole = c0.clone();
                multiply(alpha, &a.view(), &b.view(), beta, &mut whole.view_mut(), 1);
                for parts in [2, 3, 5] {
                    let mut cut = c0.clone();
                    multiply(
                        alpha,
                        &a.view(),
                        &b.view(),
                        beta,
                        &mut cut.view_mut(),
                        parts,
                    );
                    let d = cut
                        .iter()
                        .zip(whole.iter())
                        .map(|(x, y)| (x.to64() - y.to64()).abs())
                        .fold(0.0, f64::max);
                    let scale = whole.iter().map(|x| x.to64().abs()).fold(0.0, f64::max);
                    assert!(
                        d <= tolerance * scale,
                        "{m}x{k}x{n} layout {layout}: {parts} parts differ from one call by {d:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn cutting_among_threads_agrees_with_one_call_f64() {
        same_result_cut_or_not::<f64>(1e-14);
    }

    #[test]
    fn cutting_among_threads_agrees_with_one_call_f32() {
        same_result_cut_or_not::<f32>(4e-6);
    }
}
