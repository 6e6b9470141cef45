//! AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2), computed
//! as `torch.optim.AdamW` does:
//!
//! ```text
//! p -= lr * wd * p                       (decay entries only)
//! m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//! p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! The update is element-wise, so a sharded AdamW (ZeRO stage 1, Rajbhandari et al. 2020,
//! section 5.1) is the same loop over its [`ShardPlan`]'s segments and needs no cross-rank
//! sums. Shapes: params and grads `[P]`, moments `[L]` (`L = P` unsharded).

use crate::model::pass_profile;
use keel_proto::params::ParamLayout;

use super::{OptimError, Optimizer, ShardPlan, restore_shard};
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

/// AdamW state: moments `[L]` in the compact order of its [`ShardPlan`] (`[P]` in the
/// parameter layout when unsharded).
#[derive(Debug, Clone)]
pub struct AdamW<A = f32> {
    config: AdamWConfig,
    /// The elements this optimizer owns and updates.
    plan: ShardPlan,
    /// First moment `m` (`exp_avg`).
    exp_avg: Vec<A>,
    /// Second moment `v` (`exp_avg_sq`).
    exp_avg_sq: Vec<A>,
    steps: u64,
}

impl<A: Element> AdamW<A> {
    /// Zero moments `[P]` for the whole of `layout` (unsharded).
    pub fn new(layout: &ParamLayout, config: AdamWConfig) -> AdamW<A> {
        AdamW::with_plan(ShardPlan::full(layout), config)
    }

    /// Zero moments `[L]` for the elements of `plan` (a rank's shard).
    pub fn with_plan(plan: ShardPlan, config: AdamWConfig) -> AdamW<A> {
        AdamW {
            config,
            exp_avg: vec![A::zero(); plan.local_len()],
            exp_avg_sq: vec![A::zero(); plan.local_len()],
            plan,
            steps: 0,
        }
    }
}

impl<A: Element> Optimizer<A> for AdamW<A> {
    /// Updates the plan's elements only; right for a sharded AdamW too.
    fn step(&mut self, params: &mut [A], grads: &[A], lr: A) {
        // Reads parameters, gradients and both moments; writes parameters and moments.
        let len = params.len();
        let _region = pass_profile::region(
            pass_profile::Pass::Optimizer,
            pass_profile::bytes::<A>(4 * len),
            pass_profile::bytes::<A>(3 * len),
        );
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
        let lr_wd = lr * A::of(cfg.weight_decay);
        // The update is elementwise: split each tensor among the model's threads.
        let threads = crate::model::threads();
        for seg in self.plan.segments() {
            let shrink = if seg.decay {
                A::one() - lr_wd
            } else {
                A::one()
            };
            let update = |p: &mut [A], g: &[A], m: &mut [A], v: &mut [A]| {
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    *p *= shrink;
                    *m = b1 * *m + (A::one() - b1) * g;
                    *v = b2 * *v + (A::one() - b2) * g * g;
                    *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
                }
            };
            let (range, local) = (seg.global.clone(), seg.local_range());
            let p = &mut params[range.clone()];
            let g = &grads[range.clone()];
            let m = &mut self.exp_avg[local.clone()];
            let v = &mut self.exp_avg_sq[local];
            let parts = if range.len() >= 1 << 16 { threads } else { 1 };
            if parts <= 1 {
                update(p, g, m, v);
                continue;
            }
            // On the model's helper pool (a fresh thread per tensor cost its start-up on
            // every step).
            let chunk = range.len().div_ceil(parts);
            let pieces: Vec<_> = p
                .chunks_mut(chunk)
                .zip(g.chunks(chunk))
                .zip(m.chunks_mut(chunk))
                .zip(v.chunks_mut(chunk))
                .collect();
            crate::model::parallel::run_parts(pieces, |(((p, g), m), v)| update(p, g, m, v));
        }
    }

    /// Element-wise: [`Optimizer::step`] over the plan; never calls `sum_across_ranks`.
    fn step_sharded(
        &mut self,
        params: &mut [A],
        grads: &[A],
        lr: A,
        _sum_across_ranks: &mut dyn FnMut(Vec<f32>) -> Option<Vec<f32>>,
    ) -> bool {
        self.step(params, grads, lr);
        true
    }

    fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    fn steps_taken(&self) -> u64 {
        self.steps
    }

    fn state(&self) -> Vec<(&'static str, &[A])> {
        vec![("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)]
    }

    fn load_state(&mut self, steps_taken: u64, state: &[(&str, &[A])]) -> Result<(), OptimError> {
        restore_shard(&mut self.exp_avg, &self.plan, "exp_avg", state)?;
        restore_shard(&mut self.exp_avg_sq, &self.plan, "exp_avg_sq", state)?;
        self.steps = steps_taken;
        Ok(())
    }
}
