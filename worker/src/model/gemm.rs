//! The one matrix-multiply entry point: `C = alpha * A B + beta * C` through ndarray, which
//! hands row-major, transposed (`.t()`) and row-strided views to OpenBLAS's `sgemm`/`dgemm`
//! without copies. Every call is counted (time and flops) so the bench can report the share
//! of a step spent in GEMM.
//!
//! With several model threads, a large GEMM is cut into blocks of rows of `C` (or of columns,
//! when `C` is wider than tall), one single-threaded OpenBLAS call per thread. OpenBLAS's own
//! threads are never used: after each call they spin on `sched_yield` for ~2^28 cycles, and
//! that spinning took the core from the model's other threads (measured: tiny with 2 threads
//! 1.61x the 1-thread speed with OpenBLAS threading, 1.8x with this). Each element of `C` is
//! still one dot product over the whole `k`; only OpenBLAS's edge kernels may order its terms
//! differently, so results with different thread counts agree to rounding, not bit for bit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ndarray::{ArrayView2, ArrayViewMut2, Axis, s};

use super::Element;
use super::parallel;

/// Smallest GEMM worth cutting among threads (flops): below it, starting a thread (~20 us)
/// costs more than it saves.
const MIN_SPLIT_FLOPS: usize = 4 << 20;

/// Fewest rows (or columns) of `C` per thread: one OpenBLAS register block is 8 wide.
const MIN_SPLIT_EXTENT: usize = 32;

static GEMM_NANOS: AtomicU64 = AtomicU64::new(0);
static GEMM_FLOPS: AtomicU64 = AtomicU64::new(0);
static GEMM_CALLS: AtomicU64 = AtomicU64::new(0);

/// Totals of all GEMM calls in this process since the last [`reset_stats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmStats {
    /// Number of calls.
    pub calls: u64,
    /// Floating-point operations, `2 * m * n * k` per call.
    pub flops: u64,
    /// Wall time inside the calls (seconds).
    pub seconds: f64,
}

/// The totals so far.
pub fn stats() -> GemmStats {
    GemmStats {
        calls: GEMM_CALLS.load(Ordering::Relaxed),
        flops: GEMM_FLOPS.load(Ordering::Relaxed),
        seconds: GEMM_NANOS.load(Ordering::Relaxed) as f64 * 1e-9,
    }
}

/// Sets the totals back to zero.
pub fn reset_stats() {
    GEMM_NANOS.store(0, Ordering::Relaxed);
    GEMM_FLOPS.store(0, Ordering::Relaxed);
    GEMM_CALLS.store(0, Ordering::Relaxed);
}

/// `c = alpha * a b + beta * c`, `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` (any of them may be
/// a transposed or row-strided view).
pub(crate) fn gemm<A: Element>(
    alpha: A,
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
) {
    let (m, k) = a.dim();
    let n = b.ncols();
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: c = beta * c (and exactly 0 for beta = 0, whatever c held).
        if beta == A::zero() {
            c.fill(A::zero());
        } else {
            c.map_inplace(|x| *x *= beta);
        }
        return;
    }
    let start = Instant::now();
    let flops = 2 * m * n * k;
    let extent = m.max(n);
    let parts = parallel::available_threads()
        .min(flops / MIN_SPLIT_FLOPS)
        .min(extent / MIN_SPLIT_EXTENT)
        .max(1);
    multiply(alpha, a, b, beta, c, parts);
    GEMM_NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    GEMM_FLOPS.fetch_add(flops as u64, Ordering::Relaxed);
    GEMM_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// `c = alpha * a b + beta * c` on `parts` threads: `c` cut by rows, or by columns when it
/// is wider than tall.
fn multiply<A: Element>(
    alpha: A,
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
) {
    if parts <= 1 {
        ndarray::linalg::general_mat_mul(alpha, a, b, beta, c);
    } else if a.nrows() >= b.ncols() {
        split_rows(alpha, a, b, beta, c, parts);
    } else {
        // C^T = B^T A^T: the same call on transposed views cuts C by columns.
        split_rows(
            alpha,
            &b.t(),
            &a.t(),
            beta,
            &mut c.view_mut().reversed_axes(),
            parts,
        );
    }
}

/// `c = alpha * a b + beta * c` with the rows of `a` and `c` cut into `parts` contiguous
/// blocks, each multiplied on its own thread by single-threaded OpenBLAS.
fn split_rows<A: Element>(
    alpha: A,
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
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
        ndarray::linalg::general_mat_mul(alpha, &a_block, b, beta, &mut c_block);
    });
}

/// `[r, c]` row-major view of the first `r * c` elements of `s`.
pub(crate) fn mat<A>(s: &[A], r: usize, c: usize) -> ArrayView2<'_, A> {
    ArrayView2::from_shape((r, c), &s[..r * c])
        .expect("a slice of exactly r * c elements fits [r, c]")
}

/// `[r, c]` row-major mutable view of the first `r * c` elements of `s`.
pub(crate) fn mat_mut<A>(s: &mut [A], r: usize, c: usize) -> ArrayViewMut2<'_, A> {
    ArrayViewMut2::from_shape((r, c), &mut s[..r * c])
        .expect("a slice of exactly r * c elements fits [r, c]")
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, ShapeBuilder};

    use super::multiply;
    use crate::model::Element;

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
