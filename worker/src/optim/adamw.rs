//! AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2), computed
//! as `torch.optim.AdamW` does:
//!
//! ```text
//! p -= lr * wd * p                       (decay entries only)
//! m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//! p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```

use keel_proto::params::ParamLayout;

use super::{OptimError, Optimizer, decay_ranges, restore};
use crate::model::Element;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-6 in BERT).
    pub eps: f64,
    /// Decoupled weight decay, applied to entries with `decay` (0.01 in BERT).
    pub weight_decay: f64,
    /// Divide the moments by `1 - beta^t` (PyTorch does; BERT's TF optimizer did not).
    pub bias_correction: bool,
}

impl Default for AdamWConfig {
    fn default() -> AdamWConfig {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            bias_correction: true,
        }
    }
}

/// AdamW state: moments `[total_len]` in the parameter layout.
#[derive(Debug, Clone)]
pub struct AdamW<A = f32> {
    config: AdamWConfig,
    decay: Vec<(std::ops::Range<usize>, bool)>,
    /// First moment `m` (`exp_avg`).
    exp_avg: Vec<A>,
    /// Second moment `v` (`exp_avg_sq`).
    exp_avg_sq: Vec<A>,
    steps: u64,
}

impl<A: Element> AdamW<A> {
    /// Zero moments for `layout`.
    pub fn new(layout: &ParamLayout, config: AdamWConfig) -> AdamW<A> {
        AdamW {
            config,
            decay: decay_ranges(layout),
            exp_avg: vec![A::zero(); layout.total_len()],
            exp_avg_sq: vec![A::zero(); layout.total_len()],
            steps: 0,
        }
    }
}

impl<A: Element> Optimizer<A> for AdamW<A> {
    fn step(&mut self, params: &mut [A], grads: &[A], lr: A) {
        self.steps += 1;
        let cfg = self.config;
        let t = self.steps as i32;
        let (b1, b2) = (A::of(cfg.beta1), A::of(cfg.beta2));
        let (bc1, bc2) = if cfg.bias_correction {
            (A::one() - b1.powi(t), A::one() - b2.powi(t))
        } else {
            (A::one(), A::one())
        };
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let eps = A::of(cfg.eps);
        for (range, decay) in &self.decay {
            let shrink = if *decay {
                A::one() - lr * A::of(cfg.weight_decay)
            } else {
                A::one()
            };
            let p = &mut params[range.clone()];
            let g = &grads[range.clone()];
            let m = &mut self.exp_avg[range.clone()];
            let v = &mut self.exp_avg_sq[range.clone()];
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                *p *= shrink;
                *m = b1 * *m + (A::one() - b1) * g;
                *v = b2 * *v + (A::one() - b2) * g * g;
                *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
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
