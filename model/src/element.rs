//! The scalar type the model is generic over: f32 (training) and f64 (exactness checks).

use std::fmt::{Debug, Display};
use std::iter::Sum;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

use ndarray::{ArrayView, ArrayViewMut, Dimension, LinalgScalar, ScalarOperand};
use num_traits::Float;

unsafe extern "C" {
    // The C library's error functions (glibc libm, linked by std on Linux).
    fn erf(x: f64) -> f64;
    fn erff(x: f32) -> f32;
}

/// A float the BERT math runs in: f32 or f64.
pub trait Element:
    Float
    + LinalgScalar
    + ScalarOperand
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
    + Default
    + Debug
    + Display
    + Send
    + Sync
    + 'static
{
    /// The error function `erf(x)` (C99 `erf`/`erff`).
    fn erf(self) -> Self;
    /// A constant from an f64 (rounded for f32).
    fn of(v: f64) -> Self;
    /// Widened to f64.
    fn to64(self) -> f64;
    /// Rounded to bfloat16 (8 significant bits, nearest even), kept in this type
    /// (`super::bf16::round_bf16_f32` / `round_bf16_f64`).
    fn round_bf16(self) -> Self;

    /// `v` as f32 when this type is f32, `None` otherwise: the one way the model asks what its
    /// element type is (the bf16 routes need f32 operands; f64 runs the emulated route). A
    /// safe identity for f32, so no `TypeId` and no pointer cast. Any dimension: a slice is
    /// asked as `ndarray::aview1(x)`.
    fn as_f32<D: Dimension>(v: ArrayView<'_, Self, D>) -> Option<ArrayView<'_, f32, D>>;

    /// [`Element::as_f32`] for a mutable view (a GEMM's output).
    fn as_f32_mut<D: Dimension>(v: ArrayViewMut<'_, Self, D>) -> Option<ArrayViewMut<'_, f32, D>>;

    /// `y = x * Phi(x)`, exact GELU (Hendrycks & Gimpel 2016, eq. 1).
    fn gelu_forward(y: &mut [Self], x: &[Self]) {
        let (half, s) = (Self::of(0.5), Self::of(std::f64::consts::FRAC_1_SQRT_2));
        for (o, &v) in y.iter_mut().zip(x) {
            *o = half * v * (Self::one() + (v * s).erf());
        }
    }

    /// `d *= Phi(x) + x * phi(x)`, the GELU derivative.
    fn gelu_backward(d: &mut [Self], x: &[Self]) {
        let (half, s) = (Self::of(0.5), Self::of(std::f64::consts::FRAC_1_SQRT_2));
        let p = Self::of(0.398_942_280_401_432_7); // 1 / sqrt(2 pi)
        for (g, &v) in d.iter_mut().zip(x) {
            let cdf = half * (Self::one() + (v * s).erf());
            let pdf = p * (-half * v * v).exp();
            *g *= cdf + v * pdf;
        }
    }

    /// `row = exp(row - shift)`; returns the sum of the new row.
    fn exp_shifted_sum(row: &mut [Self], shift: Self) -> Self {
        let mut sum = Self::zero();
        for v in row.iter_mut() {
            *v = (*v - shift).exp();
            sum += *v;
        }
        sum
    }

    /// The largest element (`-inf` for an empty row; NaNs ignored).
    fn max_of(row: &[Self]) -> Self {
        row.iter()
            .fold(Self::neg_infinity(), |m, &v| if v > m { v } else { m })
    }
}

/// f32 takes the vectorised kernels of `vmath` for the elementwise hot spots.
impl Element for f32 {
    fn gelu_forward(y: &mut [f32], x: &[f32]) {
        super::vmath::gelu_forward(y, x)
    }
    fn gelu_backward(d: &mut [f32], x: &[f32]) {
        super::vmath::gelu_backward(d, x)
    }
    fn exp_shifted_sum(row: &mut [f32], shift: f32) -> f32 {
        super::vmath::exp_shifted_sum(row, shift)
    }
    fn max_of(row: &[f32]) -> f32 {
        super::vmath::max(row)
    }
    fn erf(self) -> f32 {
        // SAFETY: pure libm function.
        unsafe { erff(self) }
    }
    fn of(v: f64) -> f32 {
        v as f32
    }
    fn to64(self) -> f64 {
        self as f64
    }
    fn round_bf16(self) -> f32 {
        super::bf16_convert::round_bf16_f32(self)
    }
    fn as_f32<D: Dimension>(v: ArrayView<'_, f32, D>) -> Option<ArrayView<'_, f32, D>> {
        Some(v)
    }
    fn as_f32_mut<D: Dimension>(v: ArrayViewMut<'_, f32, D>) -> Option<ArrayViewMut<'_, f32, D>> {
        Some(v)
    }
}

impl Element for f64 {
    fn erf(self) -> f64 {
        // SAFETY: pure libm function.
        unsafe { erf(self) }
    }
    fn of(v: f64) -> f64 {
        v
    }
    fn to64(self) -> f64 {
        self
    }
    fn round_bf16(self) -> f64 {
        super::bf16_convert::round_bf16_f64(self)
    }
    fn as_f32<D: Dimension>(_: ArrayView<'_, f64, D>) -> Option<ArrayView<'_, f32, D>> {
        None
    }
    fn as_f32_mut<D: Dimension>(_: ArrayViewMut<'_, f64, D>) -> Option<ArrayViewMut<'_, f32, D>> {
        None
    }
}

/// `x` as f32 when `A` is f32 ([`Element::as_f32`] of the slice).
pub(crate) fn f32_slice<A: Element>(x: &[A]) -> Option<&[f32]> {
    A::as_f32(ndarray::aview1(x)).and_then(|v| v.to_slice())
}

/// `x` as f32 when `A` is f32 ([`Element::as_f32_mut`] of the slice).
pub(crate) fn f32_slice_mut<A: Element>(x: &mut [A]) -> Option<&mut [f32]> {
    A::as_f32_mut(ndarray::aview_mut1(x)).and_then(|v| v.into_slice())
}

/// Grows `buf` to at least `len` elements (never shrinks, so steady-state steps do not
/// allocate) and returns its first `len` elements.
pub(crate) fn grow<A: Element>(buf: &mut Vec<A>, len: usize) -> &mut [A] {
    if buf.len() < len {
        buf.resize(len, A::zero());
    }
    &mut buf[..len]
}

/// Bytes a buffer holds (its capacity: what it keeps allocated between steps).
pub(crate) fn held<T>(buf: &Vec<T>) -> usize {
    buf.capacity() * std::mem::size_of::<T>()
}
