//! f32 to bf16 bit patterns, many at a time: the conversion every native bf16 GEMM's operands
//! go through. Round to nearest even, NaN to a quiet NaN, exactly [`super::bf16::bf16_bits`]
//! element by element: subnormals are rounded like any other value (the hardware's
//! `VCVTNEPS2BF16` flushes them to zero, so it is not used: the emulated route, which the tests
//! check on every machine, must give the same bits as the native one).
//!
//! Why a loop of our own: the generic `Vec::extend(map(bf16_bits))`, even compiled for AVX-512,
//! took 13% of a BERT-mini bf16 step on an AMX Xeon (2026-12-04, perf), about 1 ns an element;
//! this one does 16 elements in a handful of instructions.

use super::bf16::bf16_bits;

/// Appends the bf16 bit patterns of `x` to `out`: 16 at a time with AVX-512F where the CPU has
/// it, else one by one.
pub(crate) fn extend_bits(out: &mut Vec<u16>, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        out.reserve(x.len());
        let start = out.len();
        let spare = &mut out.spare_capacity_mut()[..x.len()];
        // SAFETY: the CPU has AVX-512F (checked); `spare` has room for `x.len()` elements.
        unsafe { convert_avx512(x, spare.as_mut_ptr().cast::<u16>()) };
        // SAFETY: `convert_avx512` initialised all `x.len()` elements after `start`.
        unsafe { out.set_len(start + x.len()) };
        return;
    }
    out.extend(x.iter().map(|&v| bf16_bits(v)));
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
            let mut wide = vec![7u16]; // appended after what is there
            extend_bits(&mut wide, &x[..len]);
            let scalar: Vec<u16> = std::iter::once(7)
                .chain(x[..len].iter().map(|&v| bf16_bits(v)))
                .collect();
            assert_eq!(wide, scalar, "len {len}");
        }
    }
}
