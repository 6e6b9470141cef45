//! LAMB: layer-wise adaptive moments for large-batch training (You et al. 2019, "Large Batch
//! Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2), per tensor of
//! the layout:
//!
//! ```text
//! m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//! r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * p
//! p -= lr * (||p|| / ||r||) * r
//! ```
//!
//! Entries without `decay` (biases, LayerNorm) get no weight decay and trust ratio 1; the
//! ratio is also 1 where either norm is 0.

use keel_proto::params::ParamLayout;

use super::{OptimError, Optimizer, decay_ranges, restore};
use crate::model::Element;

/// LAMB hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambConfig {
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-6).
    pub eps: f64,
    /// Weight decay added to the update of `decay` entries (0.01).
    pub weight_decay: f64,
}

impl Default for LambConfig {
    fn default() -> LambConfig {
        LambConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
        }
    }
}

/// LAMB state: moments `[total_len]` in the parameter layout, plus one update buffer.
#[derive(Debug, Clone)]
pub struct Lamb<A = f32> {
    config: LambConfig,
    decay: Vec<(std::ops::Range<usize>, bool)>,
    exp_avg: Vec<A>,
    exp_avg_sq: Vec<A>,
    /// The update `r` of the tensor being stepped (scratch, largest tensor size).
    update: Vec<A>,
    steps: u64,
    /// Trust ratio of each layout entry at the last step (for logs and tests).
    last_trust_ratios: Vec<f64>,
}

impl<A: Element> Lamb<A> {
    /// Zero moments for `layout`.
    pub fn new(layout: &ParamLayout, config: LambConfig) -> Lamb<A> {
        let largest = layout.entries().iter().map(|e| e.len).max().unwrap_or(0);
        Lamb {
            config,
            decay: decay_ranges(layout),
            exp_avg: vec![A::zero(); layout.total_len()],
            exp_avg_sq: vec![A::zero(); layout.total_len()],
            update: vec![A::zero(); largest],
            steps: 0,
            last_trust_ratios: vec![1.0; layout.entries().len()],
        }
    }

    /// The trust ratio `||p|| / ||r||` each layout entry got at the last step (1 for excluded
    /// entries), in layout order.
    pub fn last_trust_ratios(&self) -> &[f64] {
        &self.last_trust_ratios
    }
}

impl<A: Element> Optimizer<A> for Lamb<A> {
    fn step(&mut self, params: &mut [A], grads: &[A], lr: A) {
        self.steps += 1;
        let cfg = self.config;
        let t = self.steps as i32;
        let (b1, b2) = (A::of(cfg.beta1), A::of(cfg.beta2));
        let (bc1, bc2) = (A::one() - b1.powi(t), A::one() - b2.powi(t));
        let eps = A::of(cfg.eps);
        for (i, (range, decay)) in self.decay.iter().enumerate() {
            let wd = if *decay {
                A::of(cfg.weight_decay)
            } else {
                A::zero()
            };
            let p = &mut params[range.clone()];
            let g = &grads[range.clone()];
            let m = &mut self.exp_avg[range.clone()];
            let v = &mut self.exp_avg_sq[range.clone()];
            let r = &mut self.update[..range.len()];
            let (mut p_sq, mut r_sq) = (0.0f64, 0.0f64);
            for ((((r, &p), &g), m), v) in r
                .iter_mut()
                .zip(p.iter())
                .zip(g)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                *m = b1 * *m + (A::one() - b1) * g;
                *v = b2 * *v + (A::one() - b2) * g * g;
                *r = (*m / bc1) / ((*v / bc2).sqrt() + eps) + wd * p;
                p_sq += p.to64() * p.to64();
                r_sq += r.to64() * r.to64();
            }
            let (p_norm, r_norm) = (p_sq.sqrt(), r_sq.sqrt());
            let ratio = if *decay && p_norm > 0.0 && r_norm > 0.0 {
                p_norm / r_norm
            } else {
                1.0
            };
            self.last_trust_ratios[i] = ratio;
            let scale = lr * A::of(ratio);
            for (p, &r) in p.iter_mut().zip(r.iter()) {
                *p -= scale * r;
            }
        }
    }

    fn steps_taken(&self) -> u64 {
        self.steps
    }

    fn state(&self) -> Vec<(&'static str, &[A])> {
        vec![("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)]
    }

    fn load_state(&mut self, steps_taken: u64, state: &[(&str, &[A])]) -> Result<(), OptimError> {
        restore(&mut self.exp_avg, "exp_avg", state)?;
        restore(&mut self.exp_avg_sq, "exp_avg_sq", state)?;
        self.steps = steps_taken;
        Ok(())
    }
}
