//! The feed-forward activations (`hidden_act`), elementwise on any shape.
//!
//! - `gelu`: `x * Phi(x)`, `Phi(x) = (1 + erf(x / sqrt 2)) / 2` (Hendrycks & Gimpel 2016, eq. 1;
//!   HF/PyTorch `gelu`, exact).
//! - `gelu_new`: `x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (same paper, section 2).
//! - `relu`: `max(0, x)`.

use super::pass_profile::{Pass, bytes, region};
use keel_proto::config::HiddenAct;

use super::Element;
use super::parallel;

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// Elements per thread below which splitting is not worth a thread.
const MIN_PER_THREAD: usize = 1 << 15;

/// `y = act(x)`, split among the model's threads.
pub(crate) fn forward<A: Element>(act: HiddenAct, y: &mut [A], x: &[A]) {
    let n = y.len().min(x.len());
    let _region = region(Pass::ActivationForward, bytes::<A>(n), bytes::<A>(n));
    parallel::zip_units(y, 1, x, 1, n, MIN_PER_THREAD, |y, x| {
        forward_serial(act, y, x)
    });
}

/// `d *= act'(x)`: turns the gradient w.r.t. the output into the gradient w.r.t. the input.
pub(crate) fn backward<A: Element>(act: HiddenAct, d: &mut [A], x: &[A]) {
    let n = d.len().min(x.len());
    let _region = region(Pass::ActivationBackward, bytes::<A>(2 * n), bytes::<A>(n));
    parallel::zip_units(d, 1, x, 1, n, MIN_PER_THREAD, |d, x| {
        backward_serial(act, d, x)
    });
}

fn forward_serial<A: Element>(act: HiddenAct, y: &mut [A], x: &[A]) {
    let half = A::of(0.5);
    match act {
        HiddenAct::Gelu => A::gelu_forward(y, x),
        HiddenAct::GeluNew => {
            let (k, a) = (A::of(SQRT_2_OVER_PI), A::of(0.044715));
            for (o, &v) in y.iter_mut().zip(x) {
                *o = half * v * (A::one() + (k * (v + a * v * v * v)).tanh());
            }
        }
        HiddenAct::Relu => {
            for (o, &v) in y.iter_mut().zip(x) {
                *o = if v > A::zero() { v } else { A::zero() };
            }
        }
    }
}

fn backward_serial<A: Element>(act: HiddenAct, d: &mut [A], x: &[A]) {
    let half = A::of(0.5);
    match act {
        HiddenAct::Gelu => A::gelu_backward(d, x),
        HiddenAct::GeluNew => {
            let (k, a) = (A::of(SQRT_2_OVER_PI), A::of(0.044715));
            let three_a = A::of(3.0 * 0.044715);
            for (g, &v) in d.iter_mut().zip(x) {
                let th = (k * (v + a * v * v * v)).tanh();
                let du = k * (A::one() + three_a * v * v);
                *g *= half * (A::one() + th) + half * v * (A::one() - th * th) * du;
            }
        }
        HiddenAct::Relu => {
            for (g, &v) in d.iter_mut().zip(x) {
                if v <= A::zero() {
                    *g = A::zero();
                }
            }
        }
    }
}

/// `y = tanh(x)` (the pooler's activation).
pub(crate) fn tanh_forward<A: Element>(y: &mut [A], x: &[A]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v.tanh();
    }
}

/// `d *= 1 - y^2` where `y = tanh(x)`.
pub(crate) fn tanh_backward<A: Element>(d: &mut [A], y: &[A]) {
    for (g, &v) in d.iter_mut().zip(y) {
        *g *= A::one() - v * v;
    }
}
