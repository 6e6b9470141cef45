//! Softmax cross-entropy over the rows of a logits matrix (HF: `nn.CrossEntropyLoss` with
//! `reduction="sum"` over the labelled rows).
//!
//! Shapes: `logits` `[r, k]` (k classes), `labels` `[r]`.

use super::Element;

/// Loss summed over rows and the count of rows whose argmax equals the label.
pub(crate) struct CrossEntropy<A> {
    /// `sum_r -log softmax(logits_r)[label_r]` (nats).
    pub loss_sum: A,
    /// Rows with `argmax(logits_r) == label_r`.
    pub correct: usize,
}

/// Cross-entropy of each row against its label. With `grad_scale: Some(s)` the logits are
/// replaced by `d(s * loss_sum) / d logits = s * (softmax - onehot)`.
pub(crate) fn cross_entropy<A: Element>(
    logits: &mut [A],
    labels: &[u32],
    k: usize,
    grad_scale: Option<A>,
) -> CrossEntropy<A> {
    let mut loss_sum = A::zero();
    let mut correct = 0;
    for (row, &label) in logits.chunks_exact_mut(k).zip(labels) {
        let label = label as usize;
        let mut max = A::neg_infinity();
        let mut argmax = 0;
        for (i, &z) in row.iter().enumerate() {
            if z > max {
                max = z;
                argmax = i;
            }
        }
        if argmax == label {
            correct += 1;
        }
        let sum: A = row.iter().map(|&z| (z - max).exp()).sum();
        let log_sum = sum.ln();
        loss_sum += log_sum - (row[label] - max);
        if let Some(s) = grad_scale {
            let inv = s / sum;
            for z in row.iter_mut() {
                *z = (*z - max).exp() * inv;
            }
            row[label] -= s;
        }
    }
    CrossEntropy { loss_sum, correct }
}
