//! bf16 GEMMs: inputs rounded to bfloat16 (round to nearest even), products accumulated and
//! written in fp32, as a TPU's matrix unit or a Xeon's AMX does (Kalamkar et al. 2019, "A
//! Study of BFLOAT16 for Deep Learning Training"; Intel AMX `TDPBF16PS`).
//!
//! Two routes, chosen once per process ([`support`]):
//! - **native**: oneDNN's bf16 matmul (`super::onednn`), used where it is faster than fp32:
//!   with AMX-BF16 (when the kernel lets this process use the tiles), or with AVX512_BF16 alone
//!   when a startup race at BERT shapes measures it at least 1.2x OpenBLAS's fp32
//!   (`super::bf16_cpu`). That race is needed: on a Sapphire Rapids Xeon capped to
//!   AVX512_CORE_BF16 oneDNN 2.6.3's bf16 matmul ran at 36-41 GFLOP/s against 55-103 for f32,
//!   while on a 2-core AMD EPYC of family 26 (Zen 5) it ran at 224-378 against 63-122. On AVX2
//!   oneDNN cannot create a bf16 matmul at all.
//! - **emulated** everywhere else: both inputs rounded to bf16 and kept as f32 (low 16 bits
//!   zero), then the fp32 GEMM (OpenBLAS). A product of two bf16 values (8 significant bits
//!   each) has at most 16 significant bits, so it is exact in f32, and the accumulation is
//!   fp32: the same arithmetic as the hardware up to the order of the sum. Slower than fp32
//!   (the rounding pass), so `auto` never picks it; it is what `bf16` runs without hardware,
//!   and what the tests check the numerics with on every machine.
//!
//! Which route a GEMM takes is the caller's value (`super::gemms::Gemms`, made once per model);
//! this file only runs the routes.
//!
//! Conversions: an operand is rounded on every call (on the native route into a buffer reused
//! per thread, `crate::thread_state`), unless it comes with its bf16 copy, made once for
//! several GEMMs (`super::bf16_shared`: the parameters once per micro-batch, a layer's input
//! for its query, key and value projections, a `dy` for both of its Linear's gradients,
//! attention's operands).

use std::sync::OnceLock;

use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

use super::Element;
use super::bf16_convert;
use super::onednn::{self, InputType, Strided4};

pub use super::bf16_convert::{bf16_bits, round_bf16_f32, round_bf16_f64};

/// Which backend ran a bf16 GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Backend {
    /// oneDNN's bf16 matmul (AMX, or AVX512_BF16 where it beat fp32).
    Native,
    /// Inputs rounded to bf16, multiplied by the fp32 GEMM.
    Emulated,
}

pub use super::bf16_cpu::Bf16Support;

/// What this process can do (probed on first use: CPUID, the kernel's AMX permission, a
/// oneDNN bf16 matmul created and run once and, with AVX512_BF16 alone, a race against fp32;
/// see `super::bf16_cpu`). `KEEL_BF16_BACKEND=emulated` in the environment forces the
/// emulated route, `KEEL_BF16_BACKEND=native` oneDNN wherever it has a bf16 kernel (to compare
/// the routes on one machine).
pub fn support() -> &'static Bf16Support {
    static SUPPORT: OnceLock<Bf16Support> = OnceLock::new();
    SUPPORT.get_or_init(super::bf16_cpu::detect)
}

/// The backend bf16 GEMMs take in this process.
pub fn backend() -> Bf16Backend {
    if support().native {
        Bf16Backend::Native
    } else {
        Bf16Backend::Emulated
    }
}

/// How many native bf16 GEMM calls (or parts of one) ran on a slow oneDNN reference kernel in
/// this process; 0 on the emulated route.
pub fn reference_kernel_calls() -> u64 {
    onednn::reference_bf16_calls()
}

/// How many native bf16 GEMMs (or parts of one) in this process ran on oneDNN's `gemm:jit`
/// instead of a brgemm kernel (AMX or AVX512_BF16): an operand that was not dense (a
/// row-strided view, a column block of a wider matrix) reached oneDNN.
pub fn gemm_jit_kernel_calls() -> u64 {
    onednn::gemm_jit_bf16_calls()
}

/// `v` converted elementwise by `f` into `buf`, kept in `v`'s memory order when it is
/// row-major or column-major (so BLAS/oneDNN see the same transposes), else row-major.
/// A row-strided view (an attention head's columns of `[tokens, hidden]`, or its transpose)
/// is converted a contiguous run at a time by `extend_run` (the same `f`, vectorised).
fn converted<'b, S: Copy, T: Clone>(
    v: &ArrayView2<'_, S>,
    buf: &'b mut Vec<T>,
    f: impl Fn(S) -> T + Copy,
    extend_run: impl Fn(&mut Vec<T>, &[S]),
) -> ArrayView2<'b, T> {
    let (r, c) = v.dim();
    buf.clear();
    buf.reserve(r * c);
    // Column-major when its columns are the contiguous runs (the transpose of a row-major or
    // row-strided matrix), else row-major.
    let column_major = r > 1 && v.strides()[0] == 1 && v.strides()[1] != 1;
    let lanes = if column_major { v.t() } else { v.view() };
    for lane in lanes.rows() {
        match lane.as_slice() {
            Some(run) => extend_run(buf, run),
            None => buf.extend(lane.iter().map(|&x| f(x))),
        }
    }
    if column_major {
        ArrayView2::from_shape((r, c).f(), &buf[..])
    } else {
        ArrayView2::from_shape((r, c), &buf[..])
    }
    .expect("a buffer of exactly r * c elements fits [r, c]")
}

/// [`converted`] to bf16 bit patterns (the native route's operands), runs through
/// [`bf16_convert::extend_bits`].
fn converted_bits<'b>(v: &ArrayView2<'_, f32>, buf: &'b mut Vec<u16>) -> ArrayView2<'b, u16> {
    converted(v, buf, bf16_bits, bf16_convert::extend_bits)
}

/// Appends `f` of every element of `run` to `buf`: with AVX-512 where the CPU has it (the
/// build targets baseline x86-64), else with what the build targets. For the emulated route
/// (bf16-rounded f32 or f64); bit patterns go through [`bf16_convert::extend_bits`].
fn extend_converted<S: Copy, T>(buf: &mut Vec<T>, run: &[S], f: impl Fn(S) -> T + Copy) {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX512: OnceLock<bool> = OnceLock::new();
        let avx512 = *AVX512.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
        });
        if avx512 {
            /// The same loop, compiled for AVX-512.
            #[target_feature(enable = "avx512f,avx512bw")]
            fn wide<S: Copy, T>(buf: &mut Vec<T>, run: &[S], f: impl Fn(S) -> T) {
                buf.extend(run.iter().map(|&x| f(x)));
            }
            // SAFETY: the CPU has AVX-512F and AVX-512BW (checked above).
            unsafe { wide(buf, run, f) };
            return;
        }
    }
    buf.extend(run.iter().map(|&x| f(x)));
}

/// `c = alpha * bf16(a) bf16(b) + beta * c` on `parts` threads, emulated: both inputs rounded
/// to bf16 and kept in `A`, then the fp32 (or f64) GEMM. The rounded operands are fresh
/// buffers each call: this route runs where bf16 has no hardware, slower than fp32 anyway.
pub(crate) fn emulated_gemm<A: Element>(
    alpha: A,
    a: &ArrayView2<'_, A>,
    b: &ArrayView2<'_, A>,
    beta: A,
    c: &mut ArrayViewMut2<'_, A>,
    parts: usize,
) {
    let (mut ba, mut bb) = (Vec::new(), Vec::new());
    let round_run = |buf: &mut Vec<A>, run: &[A]| extend_converted(buf, run, A::round_bf16);
    let ar = converted(a, &mut ba, A::round_bf16, round_run);
    let br = converted(b, &mut bb, A::round_bf16, round_run);
    super::gemm_split::multiply(alpha, &ar, &br, beta, c, parts);
}

/// One f32 GEMM operand on the native route: its values and, when its caller made it, their
/// bf16 copy with the same shape and strides (`super::bf16_shared::Operand`); at least one of
/// the two (the values may be left out where the copy is given).
pub(crate) type NativeOperand<'v, 'a> =
    (Option<&'v ArrayView2<'a, f32>>, Option<ArrayView2<'a, u16>>);

/// The native route: `c = alpha * bf16(a) bf16(b) (+ bias) + beta * c`, each operand's bf16
/// copy read when given, else rounded here, then oneDNN per part (each part given its columns
/// of `bias` `[n]`; a bias only with `alpha = 1`, as `super::onednn::matmul` requires). Only
/// for a process whose [`support`] is native (the caller's `super::gemms::Gemms` says so).
///
/// Panics if oneDNN fails to create or run a bf16 matmul after the startup probe created and
/// ran one (an invariant: it fails on bad arguments or no memory, not on data).
pub(crate) fn native_gemm_f32(
    alpha: f32,
    (a, a16): NativeOperand<'_, '_>,
    (b, b16): NativeOperand<'_, '_>,
    bias: Option<&[f32]>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
    parts: usize,
) {
    crate::thread_state::with_u16_pair(|ba, bb| {
        let missing = "a native operand has its values or its bf16 copy";
        let a16 = match a16 {
            Some(v) => v.reborrow(),
            None => converted_bits(a.expect(missing), ba),
        };
        let b16 = match b16 {
            Some(v) => v.reborrow(),
            None => converted_bits(b.expect(missing), bb),
        };
        if bias.is_none() && super::gemm_ksplit::worth_cutting_k(&a16, &b16, parts) {
            super::gemm_ksplit::gemm_cut_k(alpha, &a16, &b16, beta, c, parts);
            return;
        }
        super::gemm_split::split_keeping_c_layout(&a16, &b16, c, parts, &|a, b, c, cols| {
            let bias = bias.map(|z| &z[cols]);
            if let Err(e) = onednn::matmul(InputType::Bf16, (alpha, a, b), bias, beta, c) {
                panic!("oneDNN bf16 matmul failed after the startup probe succeeded: {e}");
            }
        });
    });
}

/// The native route for a batch of f32 products (see `super::gemm::gemm_batched`): both
/// operands' slices to bf16 bit patterns, whole (unless their copies are given), then one
/// oneDNN call. Only for a process whose [`support`] is native.
///
/// Panics if oneDNN fails after the startup probe succeeded (as [`native_gemm_f32`]) or the
/// operands do not fit their slices (a caller's bug).
pub(crate) fn native_batched_f32(
    alpha: f32,
    (a, a16, sa): (&[f32], Option<&[u16]>, Strided4),
    (b, b16, sb): (&[f32], Option<&[u16]>, Strided4),
    beta: f32,
    (c, sc): (&mut [f32], Strided4),
) {
    crate::thread_state::with_u16_pair(|ba, bb| {
        let a16 = a16.unwrap_or_else(|| {
            ba.clear();
            bf16_convert::extend_bits(ba, &a[..sa.extent().min(a.len())]);
            ba
        });
        let b16 = b16.unwrap_or_else(|| {
            bb.clear();
            bf16_convert::extend_bits(bb, &b[..sb.extent().min(b.len())]);
            bb
        });
        if let Err(e) =
            onednn::batched_matmul(InputType::Bf16, alpha, (a16, sa), (b16, sb), beta, (c, sc))
        {
            panic!("oneDNN batched bf16 matmul failed after the startup probe succeeded: {e}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, s};

    /// Every layout the model hands a GEMM (row-major, its transpose, an attention head's
    /// row-strided columns, their transpose, a single column) converts to the same values
    /// in the same logical order, and a NaN stays a quiet NaN.
    #[test]
    fn conversion_keeps_values_and_order_in_every_layout() {
        let mut m = Array2::from_shape_fn((6, 12), |(i, j)| (i * 12 + j) as f32 * 0.37 - 9.0);
        m[[2, 5]] = f32::NAN;
        let head = m.slice(s![.., 4..8]);
        let column = m.slice(s![.., 3..4]);
        for (what, v) in [
            ("row-major", m.view()),
            ("transposed", m.t()),
            ("row-strided head", head),
            ("transposed head", head.t()),
            ("one column", column),
        ] {
            let mut buf = Vec::new();
            let got = converted_bits(&v, &mut buf);
            assert_eq!(got.dim(), v.dim(), "{what}");
            for (g, &x) in got.iter().zip(v.iter()) {
                if x.is_nan() {
                    assert_eq!(*g & 0x7fc0, 0x7fc0, "{what}: NaN stays a quiet NaN");
                } else {
                    assert_eq!(*g, bf16_bits(x), "{what}");
                    assert_eq!(f32::from_bits(u32::from(*g) << 16), round_bf16_f32(x));
                }
            }
        }
        // A long run takes the wide (AVX-512) loop where the CPU has it: same bits as one by one.
        let long: Vec<f32> = (0..1000).map(|i| (i as f32).sin() * 1e3).collect();
        let mut wide = Vec::new();
        extend_converted(&mut wide, &long, bf16_bits);
        let one_by_one: Vec<u16> = long.iter().map(|&x| bf16_bits(x)).collect();
        assert_eq!(wide, one_by_one);
    }

    #[test]
    fn rounding_is_to_nearest_even_at_8_significant_bits() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(round_bf16_f32(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(
            round_bf16_f32(1.0 + 3.0 * 2f32.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        // Just above a tie rounds up.
        assert_eq!(
            round_bf16_f32(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(round_bf16_f32(-3.0), -3.0);
        assert!(round_bf16_f32(f32::NAN).is_nan());
        assert_eq!(round_bf16_f32(f32::MAX), f32::INFINITY);
        assert_eq!(bf16_bits(1.0), 0x3f80);
        for i in 0..10_000 {
            let x = (i as f32 * 0.7311).sin() * 1e3;
            let r = round_bf16_f32(x);
            assert_eq!(r.to_bits() & 0xffff, 0);
            // Half a unit in the 8th significant bit: at most 2^-8 of |x|.
            assert!((r - x).abs() <= 2f32.powi(-8) * x.abs(), "{x} -> {r}");
            assert_eq!(round_bf16_f64(f64::from(x)), f64::from(r), "{x}");
        }
    }
}
