//! Vectorised f32 kernels for the elementwise hot spots (GELU, softmax exponentials, row
//! maxima), written as plain branch-free loops that LLVM turns into AVX-512 or AVX2 code inside
//! `#[target_feature]` wrappers picked at run time (the portable build targets baseline
//! x86-64).
//!
//! `erf` is Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), the formula PyTorch's own
//! vectorised CPU `erf` uses; `exp` is Cephes' `expf` (range reduction by ln 2, degree-6
//! polynomial, ~1 ulp).

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `e^x` for `x` in `[-87.3, 88.3]` (clamped outside: tiny or huge, never inf or 0).
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.3);
    let n = (x * LOG2E + 0.5).floor(); // in [-126, 127]
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_2e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the exponent bits. The integer n + 127 in [1, 254] is read off the mantissa of
    // (n + 127) + 2^23 (an exact float add), which vectorises, unlike a saturating `as i32`.
    let biased = (n + 127.0 + 8_388_608.0)
        .to_bits()
        .wrapping_sub(0x4b00_0000);
    y * f32::from_bits(biased << 23)
}

/// `(Phi(x), phi(x))`: the standard normal CDF (via erf, A&S 7.1.26) and density.
#[inline(always)]
fn cdf_pdf(x: f32) -> (f32, f32) {
    let z = x * FRAC_1_SQRT_2;
    let az = z.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * az);
    let poly = ((((1.061_405_4 * t - 1.453_152_1) * t + 1.421_413_8) * t - 0.284_496_74) * t
        + 0.254_829_6)
        * t;
    let e = exp(-az * az); // = exp(-x^2 / 2)
    let erf_abs = 1.0 - poly * e;
    let erf = if z < 0.0 { -erf_abs } else { erf_abs };
    (0.5 * (1.0 + erf), INV_SQRT_2PI * e)
}

#[inline(always)]
fn gelu_forward_body(y: &mut [f32], x: &[f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * cdf_pdf(v).0;
    }
}

#[inline(always)]
fn gelu_backward_body(d: &mut [f32], x: &[f32]) {
    for (g, &v) in d.iter_mut().zip(x) {
        let (cdf, pdf) = cdf_pdf(v);
        *g *= cdf + v * pdf;
    }
}

#[inline(always)]
fn exp_shifted_sum_body(row: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp(*v - shift);
            *a += *v;
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp(*v - shift);
        sum += *v;
    }
    sum
}

#[inline(always)]
fn max_body(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(chunks.remainder()) {
        if v > m {
            m = v;
        }
    }
    m
}

macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $avx:ident, $avx512:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn $avx($($arg: $ty),*) -> $ret {
            $body($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        fn $avx512($($arg: $ty),*) -> $ret {
            $body($($arg),*)
        }

        $(#[$doc])*
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            match width() {
                Width::Avx512 => {
                    // SAFETY: the CPU has the features the function was compiled for.
                    return unsafe { $avx512($($arg),*) };
                }
                Width::Avx2 => {
                    // SAFETY: the CPU has the features the function was compiled for.
                    return unsafe { $avx($($arg),*) };
                }
                Width::Baseline => {}
            }
            $body($($arg),*)
        }
    };
}

/// The widest vectors this CPU runs the kernels with. Each lane computes the same operations in
/// the same order whatever the width (no contraction into FMA: Rust does not allow it), so the
/// results do not depend on it.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Width {
    Avx512,
    Avx2,
    Baseline,
}

#[cfg(target_arch = "x86_64")]
fn width() -> Width {
    static WIDTH: std::sync::OnceLock<Width> = std::sync::OnceLock::new();
    *WIDTH.get_or_init(|| {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            Width::Avx512
        } else if avx2 {
            Width::Avx2
        } else {
            Width::Baseline
        }
    })
}

dispatch!(
    /// `y = x * Phi(x)` (exact-form GELU with the A&S erf).
    gelu_forward, gelu_forward_avx2, gelu_forward_avx512, gelu_forward_body, (y: &mut [f32], x: &[f32]) -> ()
);
dispatch!(
    /// `d *= Phi(x) + x * phi(x)`.
    gelu_backward, gelu_backward_avx2, gelu_backward_avx512, gelu_backward_body, (d: &mut [f32], x: &[f32]) -> ()
);
dispatch!(
    /// `row = exp(row - shift)`; returns the sum of the new row.
    exp_shifted_sum, exp_shifted_sum_avx2, exp_shifted_sum_avx512, exp_shifted_sum_body, (row: &mut [f32], shift: f32) -> f32
);
dispatch!(
    /// The largest element (`-inf` for an empty row).
    max, max_avx2, max_avx512, max_body, (row: &[f32]) -> f32
);

#[cfg(test)]
mod tests {
    #[test]
    fn exp_and_gelu_are_accurate() {
        let mut worst_exp = 0.0f64;
        for i in -8000..=8000 {
            let x = i as f32 * 0.01;
            let got = super::exp(x) as f64;
            let want = (x as f64).exp();
            worst_exp = worst_exp.max((got - want).abs() / want);
        }
        assert!(worst_exp < 3e-7, "exp rel err {worst_exp:e}");
        let xs: Vec<f32> = (-1000..=1000).map(|i| i as f32 * 0.008).collect();
        let mut y = vec![0.0f32; xs.len()];
        super::gelu_forward(&mut y, &xs);
        let mut d = vec![1.0f32; xs.len()];
        super::gelu_backward(&mut d, &xs);
        for ((&x, &y), &d) in xs.iter().zip(&y).zip(&d) {
            let x64 = x as f64;
            let erf = unsafe_erf(x64 / std::f64::consts::SQRT_2);
            let cdf = 0.5 * (1.0 + erf);
            let pdf = (-0.5 * x64 * x64).exp() / (2.0 * std::f64::consts::PI).sqrt();
            assert!(
                (y as f64 - x64 * cdf).abs() < 1e-6 * (1.0 + x64.abs()),
                "gelu({x})"
            );
            assert!((d as f64 - (cdf + x64 * pdf)).abs() < 1e-6, "gelu'({x})");
        }
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let m = super::max(&row);
        assert_eq!(m, row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let want: f64 = row.iter().map(|&v| ((v - m) as f64).exp()).sum();
        let got = super::exp_shifted_sum(&mut row, m) as f64;
        assert!((got - want).abs() / want < 1e-6);
    }

    fn unsafe_erf(x: f64) -> f64 {
        use crate::model::Element;
        Element::erf(x)
    }
}
