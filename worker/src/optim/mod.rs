//! Optimizers, learning-rate schedules and gradient clipping over the flat parameter buffer.
//!
//! Moments share the parameter layout (`keel_proto::params`), so they checkpoint and restore
//! as flat slices. Everything is generic over f32 (training) and f64 (exactness checks).
//!
//! With optimizer-state sharding (ZeRO stage 1, Rajbhandari et al. 2020, section 5.1) each
//! rank's optimizer holds moments only for the elements its [`ShardPlan`] owns, in compact
//! buffers `[L]`, and updates only those parameters ([`Optimizer::step_sharded`]); an
//! unsharded optimizer has the full plan, `L = P`, and behaves exactly as before.
//!
//! # Layout
//! - [`Optimizer`]: the trait the trainer drives (step, state for checkpoints).
//! - [`OuterOptimizer`]: the outer step at the end of a round of local steps (DiLoCo).
//! - `adamw`: AdamW (Loshchilov & Hutter 2019), as `torch.optim.AdamW`.
//! - `lamb`: LAMB (You et al. 2019, Algorithm 2).
//! - `schedule`: warmup then linear / polynomial / constant learning rate.
//! - `clip`: global-norm gradient clipping, as `torch.nn.utils.clip_grad_norm_`.
//! - `diloco`: DiLoCo's outer step around either (Douillard et al. 2023).
//! - `shard`: [`ShardPlan`], the elements a rank's optimizer owns.

mod adamw;
mod clip;
mod diloco;
mod lamb;
mod schedule;
mod shard;
#[cfg(test)]
mod shard_tests;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, global_norm, sum_of_squares};
pub use diloco::{Diloco, DilocoConfig};
pub use lamb::{Lamb, LambConfig};
pub use schedule::{LrSchedule, ScheduleKind};
pub use shard::{Segment, ShardPlan};

/// Errors of restoring optimizer state.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A state buffer is missing.
    #[error("optimizer state `{name}` is missing")]
    MissingState {
        /// The state name (e.g. `exp_avg`).
        name: String,
    },
    /// A state buffer has neither accepted length.
    #[error(
        "optimizer state `{name}` has {got} elements, expected {total_len} (the parameter \
         layout) or {local_len} (this rank's shard)"
    )]
    LengthMismatch {
        /// The state name.
        name: String,
        /// `ParamLayout::total_len()`: a full buffer (a checkpoint's), whose owned elements are
        /// taken.
        total_len: usize,
        /// [`ShardPlan::local_len`]: the optimizer's own compact buffer (equal to `total_len`
        /// when unsharded).
        local_len: usize,
        /// Length given.
        got: usize,
    },
}

/// An optimizer over the flat parameter buffer `[P]`, owning the elements of its
/// [`ShardPlan`] (all of them when unsharded).
pub trait Optimizer<A = f32>: Send {
    /// One update of `params` `[P]` from `grads` `[P]` with learning rate `lr`.
    ///
    /// For an unsharded optimizer this is the whole update. A sharded one updates only its
    /// plan's elements; for an optimizer whose update needs cross-rank sums (LAMB) that is
    /// right only when this rank is alone (see [`Optimizer::step_sharded`]).
    fn step(&mut self, params: &mut [A], grads: &[A], lr: A);
    /// One update of this rank's elements: `params` and `grads` are `[P]`, but only the
    /// elements of [`Optimizer::plan`] are read or written (the others may hold anything).
    ///
    /// `sum_across_ranks` takes this rank's partial sums and returns the element-wise sums
    /// over all ranks (the same bits on every rank; in f32, as the ring sums), or `None` when
    /// the exchange failed. Optimizers that need sums over the whole buffer (LAMB's per-tensor
    /// norms) call it exactly once per step, with the same length on every rank, even on a
    /// rank that owns nothing; element-wise ones (AdamW) never call it. Returns false when it
    /// returned `None` (or a vector of another length): the step stopped part-way (the
    /// moments and step count may be updated, the parameters not) and the caller must discard
    /// this replica.
    fn step_sharded(
        &mut self,
        params: &mut [A],
        grads: &[A],
        lr: A,
        sum_across_ranks: &mut dyn FnMut(Vec<f32>) -> Option<Vec<f32>>,
    ) -> bool;
    /// The elements this optimizer owns (the full plan when unsharded).
    fn plan(&self) -> &ShardPlan;
    /// Updates taken so far (the `t` of the bias corrections).
    fn steps_taken(&self) -> u64;
    /// Named state buffers, each `[L]` in the plan's compact order (for an unsharded optimizer
    /// `[P]` in the parameter layout, for checkpoints).
    fn state(&self) -> Vec<(&'static str, &[A])>;
    /// Restores what [`Optimizer::state`] and [`Optimizer::steps_taken`] returned. Each buffer
    /// may be `[L]` (this optimizer's own, copied) or `[P]` (a full checkpoint's: the plan's
    /// elements are taken).
    ///
    /// Errors: [`OptimError::MissingState`], [`OptimError::LengthMismatch`].
    fn load_state(&mut self, steps_taken: u64, state: &[(&str, &[A])]) -> Result<(), OptimError>;
    /// The outer optimizer when this is one (DiLoCo's, `diloco::Diloco`; the trainer drives
    /// its outer steps at the end of every round).
    fn outer(&mut self) -> Option<&mut dyn OuterOptimizer> {
        None
    }
}

/// An optimizer of rounds of local steps (DiLoCo's outer step): what the trainer needs at the
/// end of a round. A trait of its own, so that [`Optimizer`] names no implementation of it
/// (`diloco.rs` builds on this file; this file does not build on `diloco.rs`).
pub trait OuterOptimizer {
    /// Starts a round from `params` `[P]`, the weights every worker holds at the round's
    /// start: they become the anchor the round's outer gradient is measured from.
    fn begin_round(&mut self, params: &[f32]);
    /// This worker's outer gradient `anchor - params`, `[P]` like `params`.
    fn outer_gradient(&self, params: &[f32]) -> Vec<f32>;
    /// The outer step from the outer gradient averaged over workers, `delta` `[P]`: writes
    /// the round's result into `params` `[P]` and makes it the next round's anchor.
    fn outer_step(&mut self, params: &mut [f32], delta: &[f32]);
}

/// The buffer named `name` in `state`.
fn find<'s, A>(name: &str, state: &[(&str, &'s [A])]) -> Result<&'s [A], OptimError> {
    state
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, src)| *src)
        .ok_or_else(|| OptimError::MissingState {
            name: name.to_string(),
        })
}

/// Copies state buffer `name` from `state` into `dst`, which it must match in length.
fn restore<A: Copy>(dst: &mut [A], name: &str, state: &[(&str, &[A])]) -> Result<(), OptimError> {
    let src = find(name, state)?;
    if src.len() != dst.len() {
        return Err(OptimError::LengthMismatch {
            name: name.to_string(),
            total_len: dst.len(),
            local_len: dst.len(),
            got: src.len(),
        });
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Restores compact buffer `dst` `[L]` of `plan` from state buffer `name`, which is either
/// `[L]` (copied) or `[P]` (the plan's elements are taken).
fn restore_shard<A: Copy>(
    dst: &mut [A],
    plan: &ShardPlan,
    name: &str,
    state: &[(&str, &[A])],
) -> Result<(), OptimError> {
    let src = find(name, state)?;
    if src.len() == dst.len() {
        dst.copy_from_slice(src);
    } else if src.len() == plan.total_len() {
        for s in plan.segments() {
            dst[s.local_range()].copy_from_slice(&src[s.global.clone()]);
        }
    } else {
        return Err(OptimError::LengthMismatch {
            name: name.to_string(),
            total_len: plan.total_len(),
            local_len: dst.len(),
            got: src.len(),
        });
    }
    Ok(())
}
