//! The scalar type the model is generic over: f32 (training) and f64 (exactness checks).

use std::fmt::{Debug, Display};
use std::iter::Sum;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

use ndarray::{LinalgScalar, ScalarOperand};
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
}

impl Element for f32 {
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
}

/// Grows `buf` to at least `len` elements (never shrinks, so steady-state steps do not
/// allocate) and returns its first `len` elements.
pub(crate) fn grow<A: Element>(buf: &mut Vec<A>, len: usize) -> &mut [A] {
    if buf.len() < len {
        buf.resize(len, A::zero());
    }
    &mut buf[..len]
}
