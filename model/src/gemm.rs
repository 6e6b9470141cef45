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
//! In bf16 precision (the caller's `Gemms` value) the same call rounds both inputs to bf16
//! and accumulates in fp32, natively (oneDNN, where faster than fp32) or emulated
//! (`super::bf16`); an input may come with its bf16 copy (`Operand`), made once for several
//! GEMMs. The flops of every call are also counted per GEMM class (`linear`, `attention`,
//! `mlm_head`, from the caller's `GemmSite`) and per backend, so the bench can say what ran
//! where.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

use super::Element;
use super::bf16;
pub(crate) use super::bf16_shared::Operand;
use super::element::{f32_slice, f32_slice_mut};
use super::gemm_split::multiply;
pub(crate) use super::gemms::Gemms;
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

/// The GEMM classes the stats are kept per (each call's site, `GemmSite`, counts in one).
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

/// Which GEMM of the model a call is: the key of the stats (each site counts in one of
/// [`CLASSES`]) and of the profile's GEMM passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmSite {
    /// An encoder layer's query, key and value projections.
    Qkv,
    /// An encoder layer's attention output projection.
    AttentionOut,
    /// An encoder layer's feed-forward intermediate projection.
    Intermediate,
    /// An encoder layer's feed-forward output projection.
    FeedForwardOut,
    /// The MLM head's transform (`cls.predictions.transform.dense`).
    MlmTransform,
    /// The NSP head's pooler and classifier.
    Nsp,
    /// Attention's scores `Q K^T` and their gradients `dQ`, `dK`.
    AttentionScores,
    /// Attention's context `P V` and its gradients `dP`, `dV`.
    AttentionContext,
    /// The tied MLM decoder `[m, c] x [c, v]` and its gradients.
    Decoder,
    /// Anything else (the tests' GEMMs).
    #[cfg_attr(not(test), allow(dead_code))]
    Other,
}

impl GemmSite {
    /// The site's class, an index into [`CLASSES`].
    fn class(self) -> usize {
        match self {
            GemmSite::Qkv
            | GemmSite::AttentionOut
            | GemmSite::Intermediate
            | GemmSite::FeedForwardOut
            | GemmSite::MlmTransform
            | GemmSite::Nsp => 0,
            GemmSite::AttentionScores | GemmSite::AttentionContext => 1,
            GemmSite::Decoder => 2,
            GemmSite::Other => 3,
        }
    }
}

/// `c = alpha * a b + beta * c`, `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` (any of them may be
/// a transposed or row-strided view), on the route `gemms` says: fp32 (the inputs as they
/// are), or bf16 inputs with fp32 accumulation (an input's bf16 copy read when it has one).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<A: Element>(
    gemms: Gemms,
    site: GemmSite,
    alpha: A,
    a: Operand<'_, A>,
    b: Operand<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
) {
    let (m, k) = a.dim();
    let n = b.dim().1;
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
    let class = site.class();
    let _region = profile_region::<A>(class, m, k, n, beta != A::zero());
    let backend = block(gemms, alpha, a, b, beta, c, parts);
    count(class, backend, flops, start);
}

/// `c = a b + bias`, the bias `[n]` added to every row of the product (a Linear's forward):
/// `a` `[m, k]`, `b` `[k, n]`, `c` `[m, n]` (views as for [`gemm`]), on the route `gemms`
/// says. Where bf16 GEMMs run natively, oneDNN adds the bias as it writes `c` (its matmul
/// bias, added once to the finished fp32 sum: the bits of the product plus the bias, on every
/// kernel oneDNN picks, `onednn::tests::bias_gives_the_bits_of_the_product_plus_the_bias`);
/// elsewhere `c` is first filled with the bias rows and the product added to it (`beta = 1`).
/// The two routes may differ by rounding (a kernel may fold `c` into its running sum), never
/// beyond the fp32 accumulation bound; a job runs one route on one machine, so its bits repeat.
/// The native route saves writing `c` once and reading it back (for the MLM decoder,
/// `[masked, vocab]`).
///
/// Panics if `bias` is not `n` long (a caller's bug).
pub(crate) fn gemm_bias<A: Element>(
    gemms: Gemms,
    site: GemmSite,
    a: Operand<'_, A>,
    b: Operand<'_, A>,
    bias: &[A],
    c: &mut ArrayViewMut2<'_, A>,
) {
    let (m, k) = a.dim();
    let n = b.dim().1;
    assert_eq!(bias.len(), n, "bias of a [{m}, {k}] x [{k}, {n}] product");
    if m == 0 || n == 0 {
        return;
    }
    let parts = parts_for(m, k, n);
    let class = site.class();
    let _region = profile_region::<A>(class, m, k, n, false);
    if k > 0 && gemms.native() {
        let start = Instant::now();
        if native(A::one(), a, b, Some(bias), A::zero(), c, parts) {
            count(class, 2, 2 * m * n * k, start);
            return;
        }
    }
    fill_rows(c, bias);
    if k == 0 {
        return;
    }
    let start = Instant::now();
    let backend = block(gemms, A::one(), a, b, A::one(), c, parts);
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

/// One product on the route `gemms` says, on `parts` threads, uncounted; returns the backend's
/// index in [`BACKENDS`].
pub(crate) fn block<A: Element>(
    gemms: Gemms,
    alpha: A,
    a: Operand<'_, A>,
    b: Operand<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
) -> usize {
    if !gemms.bf16() {
        multiply(alpha, a.values(), b.values(), beta, c, parts);
        0
    } else if gemms.native() && native(alpha, a, b, None, beta, c, parts) {
        2
    } else {
        bf16::emulated_gemm(alpha, a.values(), b.values(), beta, c, parts);
        1
    }
}

/// The native bf16 route (`super::bf16::native_gemm_f32`) when `A` is f32 (false, nothing
/// done, otherwise): `c = alpha * bf16(a) bf16(b) (+ bias) + beta * c`. Only for a native
/// [`Gemms`]. Scalars pass through f64, exact for f32.
fn native<A: Element>(
    alpha: A,
    a: Operand<'_, A>,
    b: Operand<'_, A>,
    bias: Option<&[A]>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
) -> bool {
    // `c` says whether `A` is f32; an operand may have only its bf16 copy (no values).
    let Some(mut c32) = A::as_f32_mut(c.view_mut()) else {
        return false;
    };
    let (a32, b32) = (a.f32.and_then(A::as_f32), b.f32.and_then(A::as_f32));
    let bias = match bias {
        Some(z) => match f32_slice(z) {
            Some(z) => Some(z),
            None => return false,
        },
        None => None,
    };
    let (alpha, beta) = (alpha.to64() as f32, beta.to64() as f32);
    bf16::native_gemm_f32(
        alpha,
        (a32.as_ref(), a.bf16),
        (b32.as_ref(), b.bf16),
        bias,
        beta,
        &mut c32,
        parts,
    );
    true
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
/// it per block). An operand may carry its bf16 bit patterns, made once for several GEMMs
/// (the whole slice rounded, `super::bf16_convert`); the native route then uses them (they must
/// be that operand's slice converted), the others ignore them. Counted in the stats as one
/// call of `site`.
///
/// Panics if an operand reaches past its slice or the shapes do not chain (a caller's bug).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_batched<A: Element>(
    gemms: Gemms,
    site: GemmSite,
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
    // An operand kept as its bf16 copy alone comes with empty values (native route only).
    let fits = |x: &[A], x16: Option<&[u16]>, s: Strided4| {
        s.extent() <= x.len() || (x.is_empty() && x16.is_some_and(|c| s.extent() <= c.len()))
    };
    assert!(
        fits(a, a16, sa) && fits(b, b16, sb) && sc.extent() <= c.len(),
        "batched GEMM operand past its slice"
    );
    if sc.extent() == 0 {
        return;
    }
    let start = Instant::now();
    let class = site.class();
    let flops = 2 * bb * h * m * n * k;
    let per = |d: [usize; 4]| d.iter().product::<usize>();
    let _region = pass_profile::gemm_region(
        class_pass(class),
        bytes::<A>(per(sa.dims) + per(sb.dims) + if beta != A::zero() { per(sc.dims) } else { 0 }),
        bytes::<A>(per(sc.dims)),
        flops,
    );
    if k > 0
        && gemms.native()
        && let (Some(a32), Some(b32), Some(c32)) =
            (f32_slice(a), f32_slice(b), f32_slice_mut(&mut *c))
    {
        let (alpha, beta) = (alpha.to64() as f32, beta.to64() as f32);
        bf16::native_batched_f32(alpha, (a32, a16, sa), (b32, b16, sb), beta, (c32, sc));
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
                backend = block(gemms, alpha, av.into(), bv.into(), beta, &mut cv, 1);
            }
        }
    }
    count(class, backend, flops, start);
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
