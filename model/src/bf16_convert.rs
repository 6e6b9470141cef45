//! f32 to bf16 bit patterns, many at a time: the conversion every native bf16 GEMM's operands
//! go through. Round to nearest even, NaN to a quiet NaN, exactly [`bf16_bits`]
//! element by element: subnormals are rounded like any other value (the hardware's
//! `VCVTNEPS2BF16` flushes them to zero, so it is not used: the emulated route, which the tests
//! check on every machine, must give the same bits as the native one).
//!
//! Why a loop of our own: the generic `Vec::extend(map(bf16_bits))`, even compiled for AVX-512,
//! took 13% of a BERT-mini bf16 step on an AMX Xeon (2026-12-04, perf), about 1 ns an element;
//! this one does 16 elements in a handful of instructions.

use super::pass_profile::{Pass, bytes, region};

/// `x` rounded to bf16 (round to nearest, ties to even), as an f32 whose low 16 bits are 0.
/// NaN stays NaN (quiet); values past bf16's largest finite value round to infinity.
pub fn round_bf16_f32(x: f32) -> f32 {
    f32::from_bits(u32::from(bf16_bits(x)) << 16)
}

/// The bf16 bit pattern of `x` rounded to nearest even (the high half of an f32).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let quiet_nan = ((bits >> 16) | 0x0040) as u16;
    let rounding = 0x7fff + ((bits >> 16) & 1);
    let rounded = (bits.wrapping_add(rounding) >> 16) as u16;
    // A select, not a branch, so that loops over slices vectorise.
    if x.is_nan() { quiet_nan } else { rounded }
}

/// `x` rounded to 8 significant bits, nearest even, directly from f64 (no double rounding
/// through f32). The exponent range is f64's, wider than bf16's: only for the f64 checks.
pub fn round_bf16_f64(x: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    let bits = x.to_bits();
    let drop = 52 - 7;
    let rounding = (1u64 << (drop - 1)) - 1 + ((bits >> drop) & 1);
    f64::from_bits((bits.wrapping_add(rounding) >> drop) << drop)
}

/// Appends the bf16 bit patterns of `x` to `out`: 16 at a time with AVX-512F where the CPU has
/// it, else one by one; a long `x` is cut among the model's threads (`super::parallel`), since
/// the conversion is a pass over memory that one thread does not saturate (at 2 threads it was
/// most of the work left on the first one: perf, BERT-mini bf16, 2026-12-04). Each element is
/// converted alone, so the result does not depend on the cut.
pub(crate) fn extend_bits(out: &mut Vec<u16>, x: &[f32]) {
    let _region = region(Pass::Bf16Cast, bytes::<f32>(x.len()), bytes::<u16>(x.len()));
    out.reserve(x.len());
    let start = out.len();
    let spare = &mut out.spare_capacity_mut()[..x.len()];
    super::parallel::zip_units(spare, 1, x, 1, x.len(), MIN_PER_THREAD, convert_into);
    // SAFETY: `convert_into` initialised every one of the `x.len()` elements after `start`
    // (`zip_units` hands each element to exactly one part).
    unsafe { out.set_len(start + x.len()) };
}

/// Writes the bf16 bit patterns of `x` into `out` (`out.len() == x.len()`) on this thread: for
/// a caller that is already one of the model's threads.
///
/// Panics if the lengths differ (a caller's bug).
pub(crate) fn convert_slice(out: &mut [u16], x: &[f32]) {
    assert_eq!(out.len(), x.len(), "one output per input");
    let _region = region(Pass::Bf16Cast, bytes::<f32>(x.len()), bytes::<u16>(x.len()));
    // SAFETY: u16 and MaybeUninit<u16> have the same layout; every element is written.
    let out = unsafe {
        std::slice::from_raw_parts_mut(
            out.as_mut_ptr().cast::<std::mem::MaybeUninit<u16>>(),
            out.len(),
        )
    };
    convert_into(out, x);
}

/// Fewest elements worth a thread of their own (a few microseconds of work).
const MIN_PER_THREAD: usize = 1 << 16;

/// Elements rounded first, through a buffer of their own: after them, each further run's
/// bf16 patterns land on f32 values already read.
const IN_PLACE_FIRST: usize = 1 << 12;

/// Rounds the f32 values of `x` `[len]` to bf16 bit patterns in place and returns them,
/// `[len]`: the first half of `x`'s memory (its f32 values are lost). The same bits as
/// [`extend_bits`]. For a large buffer read after this only as a GEMM's bf16 operand (the MLM
/// decoder's `d logits` `[m, v]`), so that no second buffer holds its copy.
///
/// Value `i`'s pattern goes to bytes `2i..2i + 2`, under the values `i / 2` and before. The
/// first [`IN_PLACE_FIRST`] go through a buffer; then runs `r..2r` (`r` doubling), each read
/// at bytes `4r..8r` and written at `2r..4r`, where the values of `r / 2..r` were, rounded by
/// the run before: within a run the two do not overlap, so it is cut among the model's threads
/// as [`extend_bits`] is.
pub(crate) fn round_in_place(x: &mut [f32]) -> &mut [u16] {
    let len = x.len();
    let _region = region(Pass::Bf16Cast, bytes::<f32>(len), bytes::<u16>(len));
    let first = len.min(IN_PLACE_FIRST);
    let head: Vec<u16> = x[..first].iter().map(|&v| bf16_bits(v)).collect();
    let base = x.as_mut_ptr();
    // SAFETY: `x` is borrowed mutably for the lifetime of the result and not read through
    // again: every access below goes through `base`. The patterns of values `0..first` are
    // written over values `0..first / 2`, already read into `head`. Each run then reads values
    // `r..r + n` (bytes `4r..4r + 4n`) and writes patterns `r..r + n` (bytes `2r..2r + 2n`,
    // `n <= r`, so below `4r`): disjoint slices, both inside `x`. u16 has a smaller alignment
    // than f32, and every bit pattern is a valid u16.
    unsafe {
        let out = base.cast::<u16>();
        std::ptr::copy_nonoverlapping(head.as_ptr(), out, first);
        let mut r = first;
        while r < len {
            let n = r.min(len - r);
            let src = std::slice::from_raw_parts(base.add(r).cast_const(), n);
            let dst =
                std::slice::from_raw_parts_mut(out.add(r).cast::<std::mem::MaybeUninit<u16>>(), n);
            super::parallel::zip_units(dst, 1, src, 1, n, MIN_PER_THREAD, convert_into);
            r += n;
        }
        std::slice::from_raw_parts_mut(out, len)
    }
}

/// Writes `bf16_bits(x[i])` to `out[i]` for every `i` (`out.len() == x.len()`).
fn convert_into(out: &mut [std::mem::MaybeUninit<u16>], x: &[f32]) {
    assert_eq!(out.len(), x.len(), "one output per input");
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512F (checked); `out` has room for `x.len()` elements.
        unsafe { convert_avx512(x, out.as_mut_ptr().cast::<u16>()) };
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        o.write(bf16_bits(v));
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX512.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
}

/// Writes `bf16_bits(x[i])` to `out[i]` for every `i`.
///
/// # Safety
/// The CPU has AVX-512F, and `out` is valid for `x.len()` writes of u16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn convert_avx512(x: &[f32], out: *mut u16) {
    use std::arch::x86_64::*;
    let whole = x.len() / 16 * 16;
    let one = _mm512_set1_epi32(1);
    let half_minus_one = _mm512_set1_epi32(0x7fff);
    let quiet = _mm512_set1_epi32(0x0040);
    let mut i = 0;
    while i < whole {
        // SAFETY: i + 16 <= x.len(), and `out` has room for x.len() (the caller's promise).
        unsafe {
            let v = _mm512_loadu_ps(x.as_ptr().add(i));
            let bits = _mm512_castps_si512(v);
            let high = _mm512_srli_epi32::<16>(bits);
            // bits + 0x7fff + (lowest kept bit), then the high half: nearest, ties to even.
            let rounding = _mm512_add_epi32(half_minus_one, _mm512_and_si512(high, one));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, rounding));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let picked = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, quiet));
            _mm256_storeu_si256(out.add(i).cast::<__m256i>(), _mm512_cvtepi32_epi16(picked));
        }
        i += 16;
    }
    for (k, &v) in x.iter().enumerate().skip(whole) {
        // SAFETY: k < x.len(): `out` has room (the caller's promise).
        unsafe { out.add(k).write(bf16_bits(v)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every special case and a spread of ordinary values, in a run long enough for the wide
    /// loop and with a tail: the same bits as one by one.
    #[test]
    fn wide_loop_gives_the_scalar_bits() {
        let mut x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        x.extend([
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            f32::MIN_POSITIVE / 3.0, // subnormal: rounded, not flushed
            -1e-40,
            f32::MAX, // rounds up to infinity, as the scalar rule does
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN: quieted
            1.0 + 1.0 / 256.0,           // a tie: to even
            1.0 + 3.0 / 256.0,           // a tie: to even, upwards
        ]);
        for len in [0, 1, 15, 16, 17, x.len()] {
            // Above MIN_PER_THREAD the work is cut among threads: covered below.
            let mut wide = vec![7u16]; // appended after what is there
            extend_bits(&mut wide, &x[..len]);
            let scalar: Vec<u16> = std::iter::once(7)
                .chain(x[..len].iter().map(|&v| bf16_bits(v)))
                .collect();
            assert_eq!(wide, scalar, "len {len}");
        }
    }

    /// Rounding in place gives the bits of rounding into a buffer of their own, for lengths
    /// around each run's edge (the first run, and doubling runs long enough to be cut among
    /// threads).
    #[test]
    fn rounding_in_place_gives_the_scalar_bits() {
        let long = 5 * MIN_PER_THREAD + 3;
        for len in [
            0,
            1,
            IN_PLACE_FIRST,
            IN_PLACE_FIRST + 1,
            3 * IN_PLACE_FIRST - 1,
            long,
        ] {
            let x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.071).sin() * 300.0).collect();
            let scalar: Vec<u16> = x.iter().map(|&v| bf16_bits(v)).collect();
            let mut buf = x.clone();
            assert_eq!(round_in_place(&mut buf), &scalar[..], "len {len}");
        }
    }

    /// A run cut in 3 parts (as among 3 threads) gives the same bits as one by one.
    #[test]
    fn a_cut_run_gives_the_scalar_bits() {
        let x: Vec<f32> = (0..3 * MIN_PER_THREAD + 5)
            .map(|i| (i as f32 * 0.013).cos() * 7.0)
            .collect();
        let scalar: Vec<u16> = x.iter().map(|&v| bf16_bits(v)).collect();
        let mut cut: Vec<u16> = vec![9];
        cut.reserve(x.len());
        let spare = &mut cut.spare_capacity_mut()[..x.len()];
        let parts = crate::parallel::zip_parts(3, spare, 1, &x, 1, x.len(), |o, i| {
            convert_into(o, i);
            o.len()
        });
        assert_eq!(parts.len(), 3, "cut in 3");
        // SAFETY: the 3 parts wrote all x.len() elements after the first.
        unsafe { cut.set_len(1 + x.len()) };
        assert_eq!(cut[0], 9);
        assert_eq!(&cut[1..], &scalar[..]);
    }
}
