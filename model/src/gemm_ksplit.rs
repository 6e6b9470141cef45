//! A bf16 GEMM cut among threads along its sum: `C = beta C + alpha sum_p A[:, K_p] B[K_p, :]`,
//! each thread one block `K_p` of the inner dimension, the first into `C`, the others into
//! partial outputs then added to `C` in order.
//!
//! Why: a weight gradient `dW[o, i] = dy^T x` sums over the `n` tokens, and its `A = dy^T` is a
//! transposed (column-major) matrix. Cutting `C` by rows (`super::gemm::split_keeping_c_layout`)
//! hands each thread a block of `A`'s rows, which in memory is a block of `dy`'s columns: not
//! dense, so oneDNN runs it on `gemm:jit` instead of its AMX brgemm kernel, and the split made
//! BERT-tiny's weight gradients and the tied decoder's `[v, c]` gradient slower on 2 threads than
//! on 1 (`keel-worker bench`, AMX Xeon, 2026-12-05). A block of `k` is a block of `dy`'s rows and
//! of `x`'s rows: dense, and the partial outputs (`[o, i]`, at most the decoder's `[v, c]`) cost
//! one pass to add.
//!
//! The sum's order differs from one call's (the blocks' sums added last), so results with
//! different thread counts agree to fp32 rounding, not bit for bit; with one count they repeat.

use ndarray::{ArrayView2, ArrayViewMut2, Axis, s};

use super::onednn::{self, InputType};
use super::parallel;

/// Fewest rows of the sum per part: below this a part's GEMM is too short to pay for adding
/// its partial output.
const MIN_K_PER_PART: usize = 256;

/// True when cutting the sum keeps every part's operands dense and cutting `C` would not: `a`
/// `[m, k]` column-major (a transposed row-major matrix), `b` `[k, n]` row-major, and `k` long
/// enough for `parts` parts.
pub(crate) fn worth_cutting_k(
    a: &ArrayView2<'_, u16>,
    b: &ArrayView2<'_, u16>,
    parts: usize,
) -> bool {
    let (m, k) = a.dim();
    let a_column_major = m > 1 && a.strides()[0] == 1;
    let b_row_major = b.ncols() <= 1 || b.strides()[1] == 1;
    parts > 1 && a_column_major && b_row_major && k >= parts * MIN_K_PER_PART
}

/// `c = alpha * a b + beta * c` by oneDNN's bf16 matmul, `k` cut into `parts` blocks on the
/// model's threads: `a` `[m, k]`, `b` `[k, n]` bf16 bit patterns, `c` `[m, n]` f32 (any strides
/// oneDNN takes). No bias (a weight gradient has none).
///
/// Panics if oneDNN fails after the startup probe ran a bf16 matmul (an invariant, as
/// `super::bf16::native_gemm_f32`), or the shapes do not chain (a caller's bug).
pub(crate) fn gemm_cut_k(
    alpha: f32,
    a: &ArrayView2<'_, u16>,
    b: &ArrayView2<'_, u16>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
    parts: usize,
) {
    let (m, k) = a.dim();
    let n = b.ncols();
    assert_eq!(b.nrows(), k, "inner dimensions");
    assert_eq!(c.dim(), (m, n), "output shape");
    let blocks = parallel::split(k, parts);
    // The partial outputs are this thread's (`crate::thread_state`), reused call to call.
    crate::thread_state::with_partials(|partials| {
        let len = (blocks.len() - 1) * m * n;
        if partials.len() < len {
            partials.resize(len, 0.0);
        }
        let mut outputs: Vec<ArrayViewMut2<'_, f32>> = Vec::with_capacity(blocks.len());
        outputs.push(c.view_mut());
        for chunk in partials[..len].chunks_exact_mut(m * n) {
            outputs.push(
                ArrayViewMut2::from_shape((m, n), chunk).expect("a chunk of m * n fits [m, n]"),
            );
        }
        let work: Vec<_> = blocks.iter().cloned().zip(outputs).enumerate().collect();
        parallel::run_parts(work, |(p, (r, mut out))| {
            let a_block = a.slice(s![.., r.clone()]);
            let b_block = b.slice(s![r, ..]);
            let beta = if p == 0 { beta } else { 0.0 };
            if let Err(e) = onednn::matmul(
                InputType::Bf16,
                (alpha, &a_block, &b_block),
                None,
                beta,
                &mut out,
            ) {
                panic!("oneDNN bf16 matmul failed after the startup probe succeeded: {e}");
            }
        });
        add_partials(c, &partials[..len], m, n);
    });
}

/// `c += sum_p partials[p]` (each `[m, n]` row-major), in order of `p`, `c`'s rows cut among
/// the model's threads.
fn add_partials(c: &mut ArrayViewMut2<'_, f32>, partials: &[f32], m: usize, n: usize) {
    let parts = parallel::available_threads().min(m * n / (1 << 16)).max(1);
    let mut blocks = Vec::with_capacity(parts);
    let mut rest = c.view_mut();
    for r in parallel::split(m, parts) {
        let (block, tail) = rest.split_at(Axis(0), r.len());
        rest = tail;
        blocks.push((r, block));
    }
    parallel::run_parts(blocks, |(rows, mut block)| {
        for partial in partials.chunks_exact(m * n) {
            for (i, mut row) in rows.clone().zip(block.rows_mut()) {
                let src = &partial[i * n..(i + 1) * n];
                match row.as_slice_mut() {
                    Some(dst) => dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s),
                    None => row.iter_mut().zip(src).for_each(|(d, &s)| *d += s),
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, ShapeBuilder};

    use super::*;
    use crate::bf16;

    /// Cut along `k` into 2 and 3 parts, a weight gradient's layout (`a` column-major) gives
    /// the one-call result up to fp32 rounding of the sum, with `beta` 1 (gradients
    /// accumulate) and 0. Runs where this machine has native bf16 (oneDNN's bf16 matmul).
    #[test]
    fn cutting_k_gives_the_one_call_result() {
        if !bf16::support().native {
            eprintln!("no native bf16 here: oneDNN's bf16 matmul cannot run");
            return;
        }
        let (m, k, n) = (48, 1000, 40);
        let bits = |x: f32| bf16::bf16_bits(x);
        // `a` as a transposed row-major [k, m] (dy), `b` row-major [k, n] (x).
        let dy = Array2::from_shape_fn((k, m), |(i, j)| {
            bits(((i * 7 + j * 3) % 23) as f32 / 11.0 - 1.0)
        });
        let x = Array2::from_shape_fn((k, n), |(i, j)| {
            bits(((i * 5 + j * 13) % 19) as f32 / 9.0 - 1.0)
        });
        let a = dy.t();
        assert!(worth_cutting_k(&a, &x.view(), 2));
        assert!(
            !worth_cutting_k(&x.t(), &dy.t().t(), 1),
            "one part: nothing to cut"
        );
        for beta in [0.0f32, 1.0] {
            let c0 = Array2::from_shape_fn((m, n).f(), |(i, j)| (i as f32 - j as f32) / 7.0);
            let mut whole = Array2::from_shape_fn((m, n), |(i, j)| c0[[i, j]]);
            onednn::matmul(
                InputType::Bf16,
                (0.5, &a, &x.view()),
                None,
                beta,
                &mut whole.view_mut(),
            )
            .expect("oneDNN bf16 matmul");
            for parts in [2, 3] {
                let mut cut = Array2::from_shape_fn((m, n), |(i, j)| c0[[i, j]]);
                gemm_cut_k(0.5, &a, &x.view(), beta, &mut cut.view_mut(), parts);
                let scale = whole.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
                let d = cut
                    .iter()
                    .zip(whole.iter())
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    d <= 1e-5 * scale.max(1.0),
                    "parts {parts} beta {beta}: {d} (scale {scale})"
                );
                assert!(scale > 1.0, "a non-trivial product");
            }
        }
    }
}
