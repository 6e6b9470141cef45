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
//! ratio is also 1 where either norm is 0. The squared norms accumulate in f64, per entry, in
//! element order.
//!
//! Sharded (ZeRO stage 1, Rajbhandari et al. 2020, section 5.1), a rank owns pieces of the
//! entries ([`ShardPlan`]), so the norms need every rank's part. [`Optimizer::step_sharded`]
//! runs in three phases:
//! 1. for each owned segment: m, v and r into a scratch buffer `[L]`, and this rank's partial
//!    sums of `p^2` and `r^2` per entry (f64, over its segments of that entry in buffer order);
//! 2. one cross-rank sum of the `2 E` partials, sent as f32: `[p_sq of entries 0..E, then
//!    r_sq of entries 0..E]`;
//! 3. every entry's trust ratio from the summed norms (the rule above), then `p -= lr ratio r`
//!    over the owned segments.
//!
//! Unsharded, [`Optimizer::step`] does the same per entry in one fused pass with a scratch
//! of the largest entry's size, and never rounds a norm to f32.

use crate::model::pass_profile;
use keel_proto::params::ParamLayout;

use super::{OptimError, Optimizer, ShardPlan, restore_shard};
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

/// LAMB state: moments `[L]` in the compact order of its [`ShardPlan`] (`[P]` in the
/// parameter layout when unsharded), plus the update scratch.
#[derive(Debug, Clone)]
pub struct Lamb<A = f32> {
    config: LambConfig,
    /// The elements this optimizer owns and updates.
    plan: ShardPlan,
    /// First moment `m` (`exp_avg`), `[L]`.
    exp_avg: Vec<A>,
    /// Second moment `v` (`exp_avg_sq`), `[L]`.
    exp_avg_sq: Vec<A>,
    /// The update `r` of the segment being stepped (the largest segment's size).
    update: Vec<A>,
    steps: u64,
    /// Trust ratio of each layout entry at the last step (for logs and tests), `[E]`.
    last_trust_ratios: Vec<f64>,
}

/// The step's constants, shared by the fused pass and the phases.
#[derive(Clone, Copy)]
struct Coefs<A> {
    b1: A,
    b2: A,
    bc1: A,
    bc2: A,
    eps: A,
    wd: A,
}

impl<A: Element> Coefs<A> {
    /// The coefficients of step `t` (1-based).
    fn new(cfg: &LambConfig, t: u64) -> Coefs<A> {
        let t = t as i32;
        let (b1, b2) = (A::of(cfg.beta1), A::of(cfg.beta2));
        Coefs {
            b1,
            b2,
            bc1: A::one() - b1.powi(t),
            bc2: A::one() - b2.powi(t),
            eps: A::of(cfg.eps),
            wd: A::of(cfg.weight_decay),
        }
    }

    /// Updates `m`, `v` and writes `r` for one run of elements, adding `p^2` and `r^2` to the
    /// running sums (f64, in element order). All slices have one length.
    #[allow(clippy::too_many_arguments)]
    fn moments(
        &self,
        decay: bool,
        p: &[A],
        g: &[A],
        m: &mut [A],
        v: &mut [A],
        r: &mut [A],
        p_sq: &mut f64,
        r_sq: &mut f64,
    ) {
        let Coefs {
            b1,
            b2,
            bc1,
            bc2,
            eps,
            ..
        } = *self;
        let wd = self.decay_of(decay);
        for ((((r, &p), &g), m), v) in r
            .iter_mut()
            .zip(p)
            .zip(g)
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            *m = b1 * *m + (A::one() - b1) * g;
            *v = b2 * *v + (A::one() - b2) * g * g;
            *r = Self::r_of(bc1, bc2, eps, wd, p, *m, *v);
            *p_sq += p.to64() * p.to64();
            *r_sq += r.to64() * r.to64();
        }
    }
}

impl<A: Element> Coefs<A> {
    /// The weight decay of an entry with or without `decay`.
    fn decay_of(&self, decay: bool) -> A {
        if decay { self.wd } else { A::zero() }
    }

    /// One element's update `r = (m / bc1) / (sqrt(v / bc2) + eps) + wd p` from its updated
    /// moments: the one expression both passes use, so the sharded step's second pass
    /// recomputes exactly the `r` its first pass summed.
    #[inline]
    fn r_of(bc1: A, bc2: A, eps: A, wd: A, p: A, m: A, v: A) -> A {
        (m / bc1) / ((v / bc2).sqrt() + eps) + wd * p
    }

    /// `p -= lr * ratio * r` over one run of elements, `r` recomputed from `p`, `m`, `v`.
    fn apply_recomputed(&self, decay: bool, p: &mut [A], m: &[A], v: &[A], lr: A, ratio: f64) {
        let (bc1, bc2, eps, wd) = (self.bc1, self.bc2, self.eps, self.decay_of(decay));
        let scale = lr * A::of(ratio);
        for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
            let r = Self::r_of(bc1, bc2, eps, wd, *p, m, v);
            *p -= scale * r;
        }
    }
}

/// The trust ratio `||p|| / ||r||` of an entry from its squared norms (1 without decay or
/// where either norm is 0).
fn trust_ratio(decay: bool, p_sq: f64, r_sq: f64) -> f64 {
    let (p_norm, r_norm) = (p_sq.sqrt(), r_sq.sqrt());
    if decay && p_norm > 0.0 && r_norm > 0.0 {
        p_norm / r_norm
    } else {
        1.0
    }
}

/// `p -= lr * ratio * r`.
fn apply<A: Element>(p: &mut [A], r: &[A], lr: A, ratio: f64) {
    let scale = lr * A::of(ratio);
    for (p, &r) in p.iter_mut().zip(r) {
        *p -= scale * r;
    }
}

impl<A: Element> Lamb<A> {
    /// Zero moments `[P]` for the whole of `layout` (unsharded).
    pub fn new(layout: &ParamLayout, config: LambConfig) -> Lamb<A> {
        Lamb::with_plan(ShardPlan::full(layout), config)
    }

    /// Zero moments `[L]` for the elements of `plan` (a rank's shard).
    pub fn with_plan(plan: ShardPlan, config: LambConfig) -> Lamb<A> {
        // The update `r` of one segment at a time (the sharded step recomputes it rather
        // than keep `[L]` of it: that would cost half a moment's memory).
        let scratch = plan
            .segments()
            .iter()
            .map(|s| s.global.len())
            .max()
            .unwrap_or(0);
        Lamb {
            config,
            exp_avg: vec![A::zero(); plan.local_len()],
            exp_avg_sq: vec![A::zero(); plan.local_len()],
            update: vec![A::zero(); scratch],
            steps: 0,
            last_trust_ratios: vec![1.0; plan.entries()],
            plan,
        }
    }

    /// The trust ratio `||p|| / ||r||` each layout entry got at the last step (1 for excluded
    /// entries), in layout order; sharded, every rank has every entry's (from the summed norms).
    pub fn last_trust_ratios(&self) -> &[f64] {
        &self.last_trust_ratios
    }

    /// The unsharded step: per segment (= per entry, the plan being full) m, v, r, the norms,
    /// then the update, in one pass with an entry-sized scratch.
    fn step_fused(&mut self, params: &mut [A], grads: &[A], lr: A) {
        let c = Coefs::new(&self.config, self.steps);
        for seg in self.plan.segments() {
            let range = seg.global.clone();
            let local = seg.local_range();
            let r = &mut self.update[..range.len()];
            let (mut p_sq, mut r_sq) = (0.0f64, 0.0f64);
            c.moments(
                seg.decay,
                &params[range.clone()],
                &grads[range.clone()],
                &mut self.exp_avg[local.clone()],
                &mut self.exp_avg_sq[local],
                r,
                &mut p_sq,
                &mut r_sq,
            );
            let ratio = trust_ratio(seg.decay, p_sq, r_sq);
            self.last_trust_ratios[seg.entry] = ratio;
            apply(&mut params[range], r, lr, ratio);
        }
    }

    /// Phase 1 of the sharded step: m and v of every owned segment, and this rank's partial
    /// squared norms `[p_sq of entries 0..E, r_sq of entries 0..E]` (`r` a segment at a time).
    fn partial_norms(&mut self, params: &[A], grads: &[A]) -> Vec<f64> {
        let c = Coefs::new(&self.config, self.steps);
        let entries = self.plan.entries();
        let mut sums = vec![0.0f64; 2 * entries];
        for seg in self.plan.segments() {
            let (range, local) = (seg.global.clone(), seg.local_range());
            let (mut p_sq, mut r_sq) = (sums[seg.entry], sums[entries + seg.entry]);
            c.moments(
                seg.decay,
                &params[range.clone()],
                &grads[range.clone()],
                &mut self.exp_avg[local.clone()],
                &mut self.exp_avg_sq[local],
                &mut self.update[..range.len()],
                &mut p_sq,
                &mut r_sq,
            );
            sums[seg.entry] = p_sq;
            sums[entries + seg.entry] = r_sq;
        }
        sums
    }

    /// Phase 3 of the sharded step: every entry's trust ratio from the squared norms `sums`
    /// `[2 E]` (as [`Lamb::partial_norms`] lays them out), then the update of the owned
    /// segments, `r` recomputed from the weights (not yet changed) and the updated moments:
    /// the same bits phase 1 summed.
    fn apply_ratios(&mut self, params: &mut [A], lr: A, sums: &[f64]) {
        let c = Coefs::new(&self.config, self.steps);
        let entries = self.plan.entries();
        for (i, ratio) in self.last_trust_ratios.iter_mut().enumerate() {
            *ratio = trust_ratio(self.plan.entry_decay(i), sums[i], sums[entries + i]);
        }
        for seg in self.plan.segments() {
            let local = seg.local_range();
            c.apply_recomputed(
                seg.decay,
                &mut params[seg.global.clone()],
                &self.exp_avg[local.clone()],
                &self.exp_avg_sq[local],
                lr,
                self.last_trust_ratios[seg.entry],
            );
        }
    }
}

impl<A: Element> Optimizer<A> for Lamb<A> {
    /// Unsharded, the whole LAMB step. On a sharded plan the trust ratios come from this
    /// rank's elements alone, as if it were the only rank: calling this on one of several
    /// ranks is a caller's bug (the norms would be partial); use [`Optimizer::step_sharded`].
    fn step(&mut self, params: &mut [A], grads: &[A], lr: A) {
        let len = params.len();
        let _region = pass_profile::region(
            pass_profile::Pass::Optimizer,
            pass_profile::bytes::<A>(4 * len),
            pass_profile::bytes::<A>(3 * len),
        );
        self.steps += 1;
        if self.plan.is_full() {
            self.step_fused(params, grads, lr);
        } else {
            let sums = self.partial_norms(params, grads);
            self.apply_ratios(params, lr, &sums);
        }
    }

    /// The three phases in the module docs; calls `sum_across_ranks` once with `2 E` values
    /// (also on a full plan, so that every rank takes part in the exchange; the norms then
    /// pass through f32, so a full plan's `step_sharded` may differ from `step` in the last
    /// bits).
    fn step_sharded(
        &mut self,
        params: &mut [A],
        grads: &[A],
        lr: A,
        sum_across_ranks: &mut dyn FnMut(Vec<f32>) -> Option<Vec<f32>>,
    ) -> bool {
        self.steps += 1;
        let partial = self.partial_norms(params, grads);
        let Some(total) = sum_across_ranks(partial.iter().map(|&x| x as f32).collect()) else {
            return false;
        };
        if total.len() != partial.len() {
            return false;
        }
        let total: Vec<f64> = total.into_iter().map(f64::from).collect();
        self.apply_ratios(params, lr, &total);
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
