//! The one matrix-multiply entry point: `C = alpha * A B + beta * C` through ndarray, which
//! hands row-major, transposed (`.t()`) and row-strided views to OpenBLAS's `sgemm`/`dgemm`
//! without copies. Every call is counted (time and flops) so the bench can report the share
//! of a step spent in GEMM.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ndarray::{ArrayView2, ArrayViewMut2};

use super::Element;

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
    ndarray::linalg::general_mat_mul(alpha, a, b, beta, c);
    GEMM_NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    GEMM_FLOPS.fetch_add(2 * (m * n * k) as u64, Ordering::Relaxed);
    GEMM_CALLS.fetch_add(1, Ordering::Relaxed);
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
