//! DiLoCo's outer optimizer around the job's own (Douillard et al. 2023, "DiLoCo: Distributed
//! Low-Communication Training of Language Models", Algorithm 1).
//!
//! Each worker takes H steps of the inner optimizer (AdamW or LAMB) on its own gradient, with
//! no all-reduce; then every worker sends its change since the round began, the *outer
//! gradient* `delta_i = anchor - params_i`, to be averaged, and all apply the same outer step,
//! SGD with Nesterov momentum as `torch.optim.SGD(nesterov=True)` computes it:
//!
//! ```text
//! delta = mean_i (anchor - params_i)
//! v = mu v + delta
//! params = anchor - lr_outer (delta + mu v)        (the same on every worker)
//! ```
//!
//! Shapes: `anchor`, `v`, `params`, `delta` are `[P]` in the flat parameter layout.
//!
//! The state beyond the inner optimizer's, `diloco_anchor` and `diloco_velocity`, travels
//! with it in checkpoints and in the recovery broadcast (it is part of [`Optimizer::state`]).
//! Each worker's inner moments are its own; a checkpoint holds rank 0's, and a resume or a
//! newcomer starts from those.
//!
//! DiLoCo is never sharded (a job with both `[diloco]` and `shard_optimizer` is refused before
//! it gets here): its plan is the inner optimizer's, the full one.

use super::{OptimError, Optimizer, OuterOptimizer, ShardPlan, restore};

/// The outer step's settings (the job's `[diloco]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DilocoConfig {
    /// Outer learning rate (0.7 in the paper).
    pub outer_lr: f32,
    /// Nesterov momentum `mu` (0.9 in the paper).
    pub outer_momentum: f32,
}

/// The inner optimizer plus the outer state, `[P]` each.
pub struct Diloco {
    inner: Box<dyn Optimizer>,
    config: DilocoConfig,
    /// The weights every worker agreed on at the start of this round.
    anchor: Vec<f32>,
    /// Outer momentum buffer `v`.
    velocity: Vec<f32>,
}

impl Diloco {
    /// Wraps `inner` for parameters of `len` elements; zero outer momentum.
    pub fn new(inner: Box<dyn Optimizer>, len: usize, config: DilocoConfig) -> Diloco {
        Diloco {
            inner,
            config,
            anchor: vec![0.0; len],
            velocity: vec![0.0; len],
        }
    }
}

impl OuterOptimizer for Diloco {
    /// Starts a round from `params` `[P]` (the weights all workers hold after an outer step,
    /// or at the job's start).
    ///
    /// Panics if `params` is not `[P]` (a caller's bug: the layout is fixed per job).
    fn begin_round(&mut self, params: &[f32]) {
        self.anchor.copy_from_slice(params);
    }

    /// This worker's outer gradient `anchor - params` `[P]`.
    fn outer_gradient(&self, params: &[f32]) -> Vec<f32> {
        self.anchor.iter().zip(params).map(|(a, p)| a - p).collect()
    }

    /// The outer step from the averaged outer gradient `delta` `[P]`: writes the round's
    /// result into `params` and makes it the next round's anchor.
    fn outer_step(&mut self, params: &mut [f32], delta: &[f32]) {
        let DilocoConfig {
            outer_lr: lr,
            outer_momentum: mu,
        } = self.config;
        for (((p, a), v), &d) in params
            .iter_mut()
            .zip(self.anchor.iter_mut())
            .zip(self.velocity.iter_mut())
            .zip(delta)
        {
            *v = mu * *v + d;
            *p = *a - lr * (d + mu * *v);
            *a = *p;
        }
    }
}

impl Optimizer for Diloco {
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        self.inner.step(params, grads, lr);
    }

    /// Delegates to the inner optimizer (whose plan is full).
    fn step_sharded(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        sum_across_ranks: &mut dyn FnMut(Vec<f32>) -> Option<Vec<f32>>,
    ) -> bool {
        self.inner.step_sharded(params, grads, lr, sum_across_ranks)
    }

    fn plan(&self) -> &ShardPlan {
        self.inner.plan()
    }

    fn steps_taken(&self) -> u64 {
        self.inner.steps_taken()
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        let mut state = self.inner.state();
        state.push(("diloco_anchor", &self.anchor));
        state.push(("diloco_velocity", &self.velocity));
        state
    }

    /// The inner optimizer's buffers, then the outer ones; a state without the outer ones (a
    /// checkpoint of synchronous training) starts DiLoCo with zero momentum (the anchor is
    /// set at the start of every round: `crate::train::sync::diloco`).
    fn load_state(&mut self, steps_taken: u64, state: &[(&str, &[f32])]) -> Result<(), OptimError> {
        self.inner.load_state(steps_taken, state)?;
        let has = |name: &str| state.iter().any(|(n, _)| *n == name);
        if has("diloco_anchor") || has("diloco_velocity") {
            restore(&mut self.anchor, "diloco_anchor", state)?;
            restore(&mut self.velocity, "diloco_velocity", state)?;
        } else {
            self.velocity.fill(0.0);
        }
        Ok(())
    }

    fn outer(&mut self) -> Option<&mut dyn OuterOptimizer> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, AdamWConfig};
    use keel_proto::config::BertConfig;
    use keel_proto::params::ParamLayout;

    fn layout() -> ParamLayout {
        let config = BertConfig::preset("tiny", 100).expect("tiny");
        ParamLayout::bert(&config, config.heads())
    }

    fn diloco(len: usize) -> Diloco {
        let inner = Box::new(AdamW::<f32>::new(&layout(), AdamWConfig::default()));
        Diloco::new(
            inner,
            len,
            DilocoConfig {
                outer_lr: 0.7,
                outer_momentum: 0.9,
            },
        )
    }

    /// Two outer steps against the formula worked by hand (torch.optim.SGD, nesterov=True:
    /// `v = mu v + g; p -= lr (g + mu v)`).
    #[test]
    fn the_outer_step_is_nesterov_sgd_on_the_averaged_change() {
        let len = layout().total_len();
        let mut d = diloco(len);
        let mut params = vec![1.0f32; len];
        d.begin_round(&params);
        params.iter_mut().for_each(|p| *p = 0.8); // the local steps moved every weight by -0.2
        let g = d.outer_gradient(&params);
        assert!(g.iter().all(|&x| (x - 0.2).abs() < 1e-7));
        d.outer_step(&mut params, &g);
        // v = 0.2; p = 1 - 0.7 (0.2 + 0.9 * 0.2) = 0.734
        assert!((params[0] - 0.734).abs() < 1e-6, "{}", params[0]);
        params.iter_mut().for_each(|p| *p -= 0.1);
        let g = d.outer_gradient(&params);
        d.outer_step(&mut params, &g);
        // g = 0.1; v = 0.9 * 0.2 + 0.1 = 0.28; p = 0.734 - 0.7 (0.1 + 0.9 * 0.28) = 0.4876
        assert!((params[7] - 0.4876).abs() < 1e-6, "{}", params[7]);
        assert_eq!(d.anchor[7], params[7], "the result is the next anchor");
    }

    /// The outer buffers round-trip through `state`/`load_state`, and a state without them
    /// (synchronous training's) loads with zero momentum.
    #[test]
    fn outer_state_travels_with_the_inner_one() {
        let len = layout().total_len();
        let mut a = diloco(len);
        let mut params = vec![0.5f32; len];
        a.begin_round(&params);
        params[3] = 0.25;
        let g = a.outer_gradient(&params);
        a.outer_step(&mut params, &g);
        let names: Vec<&str> = a.state().iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            ["exp_avg", "exp_avg_sq", "diloco_anchor", "diloco_velocity"]
        );
        let mut b = diloco(len);
        b.load_state(0, &a.state()).expect("loads");
        assert_eq!(b.velocity, a.velocity);
        assert_eq!(b.anchor, a.anchor);
        let inner_only: Vec<(&str, &[f32])> = a.state().into_iter().take(2).collect();
        b.load_state(0, &inner_only)
            .expect("a synchronous state loads");
        assert!(b.velocity.iter().all(|&v| v == 0.0));
        let short = vec![0f32; 3];
        let mut bad = a.state();
        bad[3] = ("diloco_velocity", &short);
        assert!(b.load_state(0, &bad).is_err());
    }
}
