//! Global-norm gradient clipping (Pascanu et al. 2013, section 3.2), as
//! `torch.nn.utils.clip_grad_norm_`: scale by `max_norm / (norm + 1e-6)` when that is below 1.

use crate::model::Element;
use crate::model::{parallel, pass_profile};

/// The L2 norm of the whole flat buffer (accumulated in f64).
pub fn global_norm<A: Element>(grads: &[A]) -> A {
    A::of(sum_of_squares(grads).sqrt())
}

/// Elements per block of [`sum_of_squares`]: its result depends on this, never on the threads.
const SUM_BLOCK: usize = 1 << 16;

/// `sum(x[i]^2)` in f64: each block of `SUM_BLOCK` (65,536) elements summed over 8 running sums (one
/// sum would be a chain of dependent additions, 4 cycles an element; BERT-mini's 11 M
/// gradients took 5% of a bf16 step that way: perf, 2026-12-04), the blocks cut among the
/// model's threads, and the block sums added in order. The order is fixed by the blocks alone,
/// so the result is the same on any number of threads.
pub fn sum_of_squares<A: Element>(x: &[A]) -> f64 {
    let whole = x.len() / SUM_BLOCK;
    let mut blocks = vec![0.0f64; whole];
    parallel::zip_units(&mut blocks, 1, x, SUM_BLOCK, whole, 1, |sums, x| {
        for (s, block) in sums.iter_mut().zip(x.chunks_exact(SUM_BLOCK)) {
            *s = lanes_of_squares(block);
        }
    });
    blocks.iter().sum::<f64>() + lanes_of_squares(&x[whole * SUM_BLOCK..])
}

/// `sum(x[i]^2)` in f64 over 8 running sums, added in a fixed order.
fn lanes_of_squares<A: Element>(x: &[A]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            let v = v.to64();
            *a += v * v;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|v| v.to64() * v.to64()).sum();
    acc.iter().sum::<f64>() + tail
}

/// Clips `grads` `[total_len]` in place to global L2 norm `max_norm`; returns the norm
/// before clipping.
pub fn clip_grad_norm<A: Element>(grads: &mut [A], max_norm: A) -> A {
    let len = grads.len();
    let mut region = pass_profile::region(
        pass_profile::Pass::ClipGradients,
        pass_profile::bytes::<A>(len),
        0,
    );
    let norm = global_norm(grads);
    let coef = max_norm / (norm + A::of(1e-6));
    if coef < A::one() {
        // The scaling pass reads and writes every gradient once more.
        drop(region);
        region = pass_profile::region(
            pass_profile::Pass::ClipGradients,
            pass_profile::bytes::<A>(len),
            pass_profile::bytes::<A>(len),
        );
        parallel::for_each_part(grads, |part| {
            for g in part {
                *g *= coef;
            }
        });
    }
    drop(region);
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_of_squares_matches_the_plain_sum_at_every_length() {
        for len in [0usize, 1, 7, 8, 9, 17, 1000] {
            let x: Vec<f32> = (0..len).map(|i| ((i as f32) * 0.7).sin() * 3.0).collect();
            let plain: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got = sum_of_squares(&x);
            assert!(
                (got - plain).abs() <= 1e-12 * plain.max(1.0),
                "len {len}: {got} vs {plain}"
            );
        }
        let mut g = vec![3.0f32, 4.0];
        assert_eq!(global_norm(&g), 5.0);
        assert_eq!(clip_grad_norm(&mut g, 1.0), 5.0);
        assert!(
            (g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6,
            "{g:?}"
        );
    }
}
