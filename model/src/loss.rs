//! Softmax cross-entropy over the rows of a logits matrix (HF: `nn.CrossEntropyLoss` with
//! `reduction="sum"` over the labelled rows).
//!
//! Shapes: `logits` `[r, k]` (k classes), `labels` `[r]`.

use super::Element;
use super::parallel;
use super::pass_profile::{Pass, bytes, region};

/// Loss summed over rows and the count of rows whose argmax equals the label.
pub(crate) struct CrossEntropy<A> {
    /// `sum_r -log softmax(logits_r)[label_r]` (nats).
    pub loss_sum: A,
    /// Rows with `argmax(logits_r) == label_r`.
    pub correct: usize,
}

/// Cross-entropy of each row against its label. The logits are overwritten: with
/// `grad_scale: Some(s)` by `d(s * loss_sum) / d logits = s * (softmax - onehot)`, otherwise
/// by unnormalised probabilities.
pub(crate) fn cross_entropy<A: Element>(
    logits: &mut [A],
    labels: &[u32],
    k: usize,
    grad_scale: Option<A>,
) -> CrossEntropy<A> {
    // Split the rows among the model's threads (at least ~64k logits each); the loss is
    // summed in row order within a part, then over parts.
    let rows = labels.len();
    let _region = region(
        Pass::Loss,
        bytes::<A>(rows * k),
        if grad_scale.is_some() {
            bytes::<A>(rows * k)
        } else {
            0
        },
    );
    let parts = parallel::zip_units(logits, k, labels, 1, rows, (1 << 16) / k.max(1), |z, l| {
        cross_entropy_serial(z, l, k, grad_scale)
    });
    let mut total = CrossEntropy {
        loss_sum: A::zero(),
        correct: 0,
    };
    for p in parts {
        total.loss_sum += p.loss_sum;
        total.correct += p.correct;
    }
    total
}

fn cross_entropy_serial<A: Element>(
    logits: &mut [A],
    labels: &[u32],
    k: usize,
    grad_scale: Option<A>,
) -> CrossEntropy<A> {
    let mut loss_sum = A::zero();
    let mut correct = 0;
    for (row, &label) in logits.chunks_exact_mut(k).zip(labels) {
        let label = label as usize;
        let max = A::max_of(row);
        if row.iter().position(|&z| z == max) == Some(label) {
            correct += 1;
        }
        let shifted_label = row[label] - max;
        // One exp per logit: the row becomes exp(z - max), then softmax * scale.
        let sum = A::exp_shifted_sum(row, max);
        loss_sum += sum.ln() - shifted_label;
        if let Some(s) = grad_scale {
            let inv = s / sum;
            for z in row.iter_mut() {
                *z *= inv;
            }
            row[label] -= s;
        }
    }
    CrossEntropy { loss_sum, correct }
}
