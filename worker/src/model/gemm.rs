//! The matrix-multiply entry points: `C = alpha * A B + beta * C` (`gemm`) and a Linear's
//! `C = A B + bias` (`gemm_bias`), through ndarray, which
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
//!
//! In bf16 precision (`super::bf16::with_precision`) the same call rounds both inputs to bf16
//! and accumulates in fp32, natively (oneDNN, where faster than fp32) or emulated (`super::bf16`). The flops of
//! every call are also counted per GEMM class (the calling file: `linear`, `attention`,
//! `mlm_head`) and per backend, so the bench can say what ran where.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ndarray::{ArrayView2, ArrayViewMut2, Axis, ShapeBuilder, s};

use keel_proto::precision::Precision;

use super::Element;
use super::bf16::{self, Bf16Backend};
use super::onednn::Strided4;
use super::parallel;
use super::pass_profile::{self, Pass, Region, bytes};

/// Smallest GEMM worth cutting among threads (flops): below it, starting a thread (~20 us)
/// costs more than it saves.
const MIN_SPLIT_FLOPS: usize = 4 << 20;

/// Fewest rows (or columns) of `C` per thread: one OpenBLAS register block is 8 wide.
const MIN_SPLIT_EXTENT: usize = 32;

static GEMM_NANOS: AtomicU64 = AtomicU64::new(0);
static GEMM_FLOPS: AtomicU64 = AtomicU64::new(0);
static GEMM_CALLS: AtomicU64 = AtomicU64::new(0);

/// The GEMM classes the stats are kept per: named after the file that calls `gemm`.
pub const CLASSES: [&str; 4] = ["linear", "attention", "mlm_head", "other"];

/// The backends the stats are kept per.
pub const BACKENDS: [&str; 3] = ["fp32", "bf16-emulated", "bf16-native"];

#[allow(clippy::declare_interior_mutable_const)] // only used to initialise the array below
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)] // only used to initialise the array below
const ROW: [AtomicU64; 3] = [ZERO; 3];
/// Flops per `[class][backend]`.
static CLASS_FLOPS: [[AtomicU64; 3]; 4] = [ROW; 4];
/// Wall time inside the calls per class (nanoseconds).
static CLASS_NANOS: [AtomicU64; 4] = [ZERO; 4];

/// Totals of all GEMM calls in this process since the last [`reset_stats`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmStats {
    /// Number of calls.
    pub calls: u64,
    /// Floating-point operations, `2 * m * n * k` per call.
    pub flops: u64,
    /// Wall time inside the calls (seconds).
    pub seconds: f64,
    /// Flops per class ([`CLASSES`]) and backend ([`BACKENDS`]).
    pub class_flops: [[u64; 3]; 4],
    /// Wall time inside the calls per class (seconds; calls on the model's helper threads
    /// overlap, so these can add up to more than the step).
    pub class_seconds: [f64; 4],
}

impl GemmStats {
    /// Flops that ran at the bf16 rate (the native backend) over all flops (0 with none).
    pub fn bf16_native_share(&self) -> f64 {
        let native: u64 = self.class_flops.iter().map(|c| c[2]).sum();
        if self.flops == 0 {
            0.0
        } else {
            native as f64 / self.flops as f64
        }
    }
}

/// The totals so far.
pub fn stats() -> GemmStats {
    let mut class_flops = [[0; 3]; 4];
    for (out, counters) in class_flops.iter_mut().zip(&CLASS_FLOPS) {
        for (o, c) in out.iter_mut().zip(counters) {
            *o = c.load(Ordering::Relaxed);
        }
    }
    GemmStats {
        calls: GEMM_CALLS.load(Ordering::Relaxed),
        flops: GEMM_FLOPS.load(Ordering::Relaxed),
        seconds: GEMM_NANOS.load(Ordering::Relaxed) as f64 * 1e-9,
        class_flops,
        class_seconds: std::array::from_fn(|c| {
            CLASS_NANOS[c].load(Ordering::Relaxed) as f64 * 1e-9
        }),
    }
}

/// Sets the totals back to zero.
pub fn reset_stats() {
    GEMM_NANOS.store(0, Ordering::Relaxed);
    GEMM_FLOPS.store(0, Ordering::Relaxed);
    GEMM_CALLS.store(0, Ordering::Relaxed);
    for c in &CLASS_NANOS {
        c.store(0, Ordering::Relaxed);
    }
    for counters in &CLASS_FLOPS {
        for c in counters {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// The class of a call from `file` (a path ending in `linear.rs`, ...).
fn class_of(file: &str) -> usize {
    let stem = file
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or(file)
        .trim_end_matches(".rs")
        .trim_end_matches("_batched");
    CLASSES[..3].iter().position(|c| *c == stem).unwrap_or(3)
}

/// `c = alpha * a b + beta * c`, `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` (any of them may be
/// a transposed or row-strided view), in this thread's precision (`super::bf16::current`):
/// fp32 (the inputs as they are), or bf16 inputs with fp32 accumulation.
#[track_caller]
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
    let parts = parts_for(m, k, n);
    let class = class_of(std::panic::Location::caller().file());
    let _region = profile_region::<A>(class, m, k, n, beta != A::zero());
    let backend = block(alpha, a, b, beta, c, parts);
    count(class, backend, flops, start);
}

/// `c = a b + bias`, the bias `[n]` added to every row of the product (a Linear's forward):
/// `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` (views as for [`gemm`]), in this thread's
/// precision. Where bf16 GEMMs run natively, oneDNN adds the bias as it writes `c` (its matmul
/// bias, added once to the finished fp32 sum: the bits of the product plus the bias, on every
/// kernel oneDNN picks, `onednn::tests::bias_gives_the_bits_of_the_product_plus_the_bias`);
/// elsewhere `c` is first filled with the bias rows and the product added to it (`beta = 1`).
/// The two routes may differ by rounding (a kernel may fold `c` into its running sum), never
/// beyond the fp32 accumulation bound; a job runs one route on one machine, so its bits repeat.
/// The native route saves writing `c` once and reading it back (for the MLM decoder,
/// `[masked, vocab]`).
///
/// Panics if `bias` is not `n` long (a caller's bug).
#[track_caller]
pub(crate) fn gemm_bias<A: Element>(
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    bias: &[A],
    c: &mut ArrayViewMut2<'_, A>,
) {
    let (m, k) = a.dim();
    let n = b.ncols();
    assert_eq!(bias.len(), n, "bias of a [{m}, {k}] x [{k}, {n}] product");
    if m == 0 || n == 0 {
        return;
    }
    let parts = parts_for(m, k, n);
    let class = class_of(std::panic::Location::caller().file());
    let _region = profile_region::<A>(class, m, k, n, false);
    if k > 0 && bf16::current() == Precision::Bf16 {
        let start = Instant::now();
        if A::gemm_bf16_native(A::one(), a, b, Some(bias), A::zero(), c, parts) {
            count(class, 2, 2 * m * n * k, start);
            return;
        }
    }
    fill_rows(c, bias);
    if k == 0 {
        return;
    }
    let start = Instant::now();
    let backend = block(A::one(), a, b, A::one(), c, parts);
    count(class, backend, 2 * m * n * k, start);
}

/// The profile region of an `[m, k] x [k, n]` product of class `class` (its output read too
/// when `reads_c`).
fn profile_region<A>(class: usize, m: usize, k: usize, n: usize, reads_c: bool) -> Region {
    let pass = class_pass(class);
    let read = m * k + k * n + if reads_c { m * n } else { 0 };
    pass_profile::gemm_region(pass, bytes::<A>(read), bytes::<A>(m * n), 2 * m * n * k)
}

/// The profile pass of GEMM class `class` ([`CLASSES`]).
fn class_pass(class: usize) -> Pass {
    [
        Pass::GemmLinear,
        Pass::GemmAttention,
        Pass::GemmMlmHead,
        Pass::GemmOther,
    ][class.min(3)]
}

/// Every row of `c` set to `bias`, cut among the model's threads when `c` is one dense block.
fn fill_rows<A: Element>(c: &mut ArrayViewMut2<'_, A>, bias: &[A]) {
    /// Fewest rows per thread: a row is a few hundred bytes to a few KiB.
    const MIN_ROWS_PER_THREAD: usize = 64;
    let (m, n) = c.dim();
    if let Some(all) = c.as_slice_mut() {
        let none: &[A] = &[];
        parallel::zip_units(all, n, none, 0, m, MIN_ROWS_PER_THREAD, |rows, _| {
            for row in rows.chunks_exact_mut(n) {
                row.copy_from_slice(bias);
            }
        });
    } else {
        for mut row in c.rows_mut() {
            row.assign(&ndarray::aview1(bias));
        }
    }
}

/// Threads to cut an `[m, k] x [k, n]` product among: none below [`MIN_SPLIT_FLOPS`] or
/// [`MIN_SPLIT_EXTENT`] rows (or columns) a part.
fn parts_for(m: usize, k: usize, n: usize) -> usize {
    parallel::available_threads()
        .min(2 * m * n * k / MIN_SPLIT_FLOPS)
        .min(m.max(n) / MIN_SPLIT_EXTENT)
        .max(1)
}

/// One product in this thread's precision on `parts` threads; returns the backend's index in
/// [`BACKENDS`].
fn block<A: Element>(
    alpha: A,
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
) -> usize {
    match bf16::current() {
        Precision::Fp32 => {
            multiply(alpha, a, b, beta, c, parts);
            0
        }
        Precision::Bf16 => match bf16::gemm(alpha, a, b, beta, c, parts) {
            Bf16Backend::Emulated => 1,
            Bf16Backend::Native => 2,
        },
    }
}

/// Adds one call of `flops` started at `start` to the stats.
fn count(class: usize, backend: usize, flops: usize, start: Instant) {
    CLASS_FLOPS[class][backend].fetch_add(flops as u64, Ordering::Relaxed);
    let nanos = start.elapsed().as_nanos() as u64;
    CLASS_NANOS[class].fetch_add(nanos, Ordering::Relaxed);
    GEMM_NANOS.fetch_add(nanos, Ordering::Relaxed);
    GEMM_FLOPS.fetch_add(flops as u64, Ordering::Relaxed);
    GEMM_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// `c = alpha * a b + beta * c` for each matrix of a batch on this thread: `a` `[b, h, m, k]`,
/// `b` `[b, h, k, n]`, `c` `[b, h, m, n]`, each a [`Strided4`] over its slice (attention's
/// per-(sequence, head) blocks). Where bf16 GEMMs run natively, one oneDNN call for the whole
/// batch; elsewhere one [`gemm`]-equivalent call per matrix (the same arithmetic as calling
/// it per block). An operand may carry its bf16 bit patterns, made once by
/// `super::bf16::native_copy` for several GEMMs; the native route then uses them (they must
/// be that operand's slice converted), the others ignore them. Counted in the stats as one
/// call of the caller's class.
///
/// Panics if an operand reaches past its slice or the shapes do not chain (a caller's bug).
#[track_caller]
pub(crate) fn gemm_batched<A: Element>(
    alpha: A,
    (a, a16, sa): (&[A], Option<&[u16]>, Strided4),
    (b, b16, sb): (&[A], Option<&[u16]>, Strided4),
    beta: A,
    (c, sc): (&mut [A], Strided4),
) {
    let [bb, h, m, k] = sa.dims;
    let n = sb.dims[3];
    assert!(
        sb.dims == [bb, h, k, n] && sc.dims == [bb, h, m, n],
        "batched GEMM shapes {:?} x {:?} -> {:?}",
        sa.dims,
        sb.dims,
        sc.dims
    );
    assert!(
        sa.extent() <= a.len() && sb.extent() <= b.len() && sc.extent() <= c.len(),
        "batched GEMM operand past its slice"
    );
    if sc.extent() == 0 {
        return;
    }
    let start = Instant::now();
    let class = class_of(std::panic::Location::caller().file());
    let flops = 2 * bb * h * m * n * k;
    let per = |d: [usize; 4]| d.iter().product::<usize>();
    let _region = pass_profile::gemm_region(
        class_pass(class),
        bytes::<A>(per(sa.dims) + per(sb.dims) + if beta != A::zero() { per(sc.dims) } else { 0 }),
        bytes::<A>(per(sc.dims)),
        flops,
    );
    if k > 0
        && bf16::current() == Precision::Bf16
        && A::gemm_batched_bf16_native(alpha, (a, a16, sa), (b, b16, sb), beta, (&mut *c, sc))
    {
        count(class, 2, flops, start);
        return;
    }
    fn view<A>(x: &[A], s: Strided4, i: usize, j: usize) -> ArrayView2<'_, A> {
        ArrayView2::from_shape(
            (s.dims[2], s.dims[3]).strides((s.strides[2], s.strides[3])),
            &x[s.offset(i, j)..],
        )
        .expect("a Strided4 within its slice (checked above)")
    }
    let mut backend = 0;
    for i in 0..bb {
        for j in 0..h {
            let (av, bv) = (view(a, sa, i, j), view(b, sb, i, j));
            let mut cv = ArrayViewMut2::from_shape(
                (m, n).strides((sc.strides[2], sc.strides[3])),
                &mut c[sc.offset(i, j)..],
            )
            .expect("a Strided4 within its slice (checked above)");
            if k == 0 {
                cv.map_inplace(|x| {
                    *x = if beta == A::zero() {
                        A::zero()
                    } else {
                        *x * beta
                    }
                });
            } else {
                backend = block(alpha, &av, &bv, beta, &mut cv, 1);
            }
        }
    }
    count(class, backend, flops, start);
}

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
