//! Attention's softmax over the keys of one sequence, forward and backward, on `[t, t]`
//! blocks: shared by the per-(sequence, head) route (`super::attention`) and the batched one
//! (`super::attention_batched`).

use super::Element;

/// The key mask one sequence's softmax rows use: `None` when every key counts (no padding, or
/// no real key at all, where HF's additive mask shifts every score alike). Decided once per
/// sequence rather than once per row.
pub(crate) fn softmax_keys(keys: &[u8]) -> Option<&[u8]> {
    let all_real = keys.iter().all(|&m| m != 0);
    let any_real = keys.iter().any(|&m| m != 0);
    if all_real || !any_real {
        None
    } else {
        Some(keys)
    }
}

/// Softmax over the keys with `keys[k] != 0` (all keys for `None`, see [`softmax_keys`]);
/// padded keys get exactly 0 (HF adds `finfo.min`, whose `exp` underflows to 0).
pub(crate) fn masked_softmax<A: Element>(row: &mut [A], keys: Option<&[u8]>) {
    let Some(keys) = keys else {
        let max = A::max_of(row);
        let inv = A::one() / A::exp_shifted_sum(row, max);
        row.iter_mut().for_each(|s| *s *= inv);
        return;
    };
    let mut max = A::neg_infinity();
    for (&s, &m) in row.iter().zip(keys) {
        if m != 0 && s > max {
            max = s;
        }
    }
    A::exp_shifted_sum(row, max);
    let mut sum = A::zero();
    for (s, &m) in row.iter_mut().zip(keys) {
        if m == 0 {
            *s = A::zero();
        }
        sum += *s;
    }
    let inv = A::one() / sum;
    row.iter_mut().for_each(|s| *s *= inv);
}

/// Softmax backward on `[t, t]` blocks, in place: `dp` (the gradient of the probabilities)
/// becomes `dS = P * (dP - sum_k dP * P)` row by row, `p` the probabilities.
pub(crate) fn softmax_backward<A: Element>(dp: &mut [A], p: &[A], t: usize) {
    for (dp_row, p_row) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
        let dot: A = dp_row.iter().zip(p_row).map(|(&a, &b)| a * b).sum();
        for (g, &pv) in dp_row.iter_mut().zip(p_row) {
            *g = pv * (*g - dot);
        }
    }
}
