//! Global-norm gradient clipping (Pascanu et al. 2013, section 3.2), as
//! `torch.nn.utils.clip_grad_norm_`: scale by `max_norm / (norm + 1e-6)` when that is below 1.

use crate::model::Element;

/// The L2 norm of the whole flat buffer (accumulated in f64).
pub fn global_norm<A: Element>(grads: &[A]) -> A {
    A::of(
        grads
            .iter()
            .map(|g| g.to64() * g.to64())
            .sum::<f64>()
            .sqrt(),
    )
}

/// Clips `grads` `[total_len]` in place to global L2 norm `max_norm`; returns the norm
/// before clipping.
pub fn clip_grad_norm<A: Element>(grads: &mut [A], max_norm: A) -> A {
    let norm = global_norm(grads);
    let coef = max_norm / (norm + A::of(1e-6));
    if coef < A::one() {
        for g in grads.iter_mut() {
            *g *= coef;
        }
    }
    norm
}
