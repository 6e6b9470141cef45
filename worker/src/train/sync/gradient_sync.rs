//! [`GradientSync`]: what a training mode decides in a step, after the forward/backward that
//! every mode runs alike; and the update rule the modes share ([`apply_or_skip`],
//! [`local_update`]).

use super::super::collectives::{LossCounts, LossSums, StepCounts};
use super::super::error::TrainError;
use super::super::sharding::GatheredState;
use crate::batch::Batch;
use crate::buckets::Buckets;
use crate::model::LookupGrads;
use crate::optim::{clip_grad_norm, global_norm};
use crate::replica::Replica;
use crate::ringlink::RingLink;
use std::time::Duration;

/// How a training mode turns each rank's gradient into an update: plain data parallelism,
/// ZeRO stage 1, or DiLoCo (see `super` for the three). Every rank of a job runs the same
/// mode and calls these in the same order, so their collectives meet on the ring.
///
/// A trait rather than an enum: each mode owns state the others lack (buckets, a sharding, a
/// torn flag, DiLoCo's spec), and its three answers sit together in its own file, next to that
/// state; the trainer holds one `Box<dyn GradientSync>` and names no mode.
pub trait GradientSync {
    /// The counts the step's losses are averaged over: the global batch's (`counts`, summed
    /// over ranks), or this rank's own `batches`' (NSP labels counted when `nsp`) when every
    /// rank steps alone.
    fn loss_counts(&self, counts: &StepCounts, batches: &[Batch], nsp: bool) -> LossCounts;

    /// The buckets backward gives every finished gradient range to, so that they travel
    /// while backward goes on; `None` when no gradient travels.
    fn buckets(&mut self) -> Option<&mut Buckets>;

    /// After backward: makes `grads` `[P]` the gradient the update reads (summed over ranks,
    /// all of it or this rank's chunks, or left as this rank's), the word embeddings' lookup
    /// rows `lookup` (when they travel apart) added in.
    ///
    /// Errors: [`TrainError::AllReduce`], [`TrainError::Model`] at `step`.
    fn reduce(
        &mut self,
        grads: &mut [f32],
        lookup: Option<&mut LookupGrads<f32>>,
        ring: &RingLink,
        step: u64,
    ) -> Result<(), TrainError>;

    /// Clips `grads` `[P]` and updates `replica` by `rule`, or skips the update when `loss`
    /// (summed over ranks) or the gradient is not finite; the whole update of this mode, any
    /// collectives it needs included.
    ///
    /// Errors: [`TrainError::NonFinite`] past `rule.max_skipped_steps`; a ring error, after
    /// which the replica is as before the step unless [`GradientSync::is_torn`] says so.
    fn update(
        &mut self,
        replica: &mut Replica,
        grads: &mut [f32],
        loss: &LossSums,
        rule: &UpdateRule,
        ring: &RingLink,
        step: u64,
    ) -> Result<Update, TrainError>;

    /// The optimizer's state buffers gathered to `[P]` on the root rank for a checkpoint after
    /// `step` steps (every rank calls it; `None` on the others, and in modes where the root
    /// holds them whole already).
    ///
    /// Errors: [`TrainError::AllReduce`] while gathering.
    fn gather_optimizer_state(
        &self,
        _replica: &Replica,
        _is_root: bool,
        _ring: &RingLink,
        _step: u64,
    ) -> Result<Option<GatheredState>, TrainError> {
        Ok(None)
    }

    /// Whether each rank keeps only its share of the optimizer's state (ZeRO stage 1).
    fn shards_optimizer(&self) -> bool {
        false
    }

    /// Whether an update failed half-way, leaving the replica no whole step (it must not be
    /// kept).
    fn is_torn(&self) -> bool {
        false
    }
}

/// The step's update rule, from `[train]` and the schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateRule {
    /// Learning rate of the step.
    pub lr: f32,
    /// Global gradient norm clipped to (`train.max_grad_norm`; 0 = no clipping).
    pub max_grad_norm: f32,
    /// Non-finite steps skipped before the job fails (`train.max_skipped_steps`).
    pub max_skipped_steps: u64,
}

/// What the optimizer did in a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// Learning rate used.
    pub lr: f32,
    /// Global L2 norm of the gradient before clipping.
    pub grad_norm: f32,
    /// Whether the loss and gradient were finite (false: the update was skipped).
    pub finite: bool,
    /// Time the weights' all-gather took (ZeRO stage 1; zero otherwise).
    pub gather: Duration,
}

/// Runs `apply` (the clipping and optimizer step, returning its all-gather time) on `replica`
/// when `grad_norm` and `loss` are finite; else counts a skipped step. Every rank holds the
/// same sums, so every rank takes the same decision.
///
/// Errors: [`TrainError::NonFinite`] past `rule.max_skipped_steps`; what `apply` returns.
pub fn apply_or_skip(
    replica: &mut Replica,
    step: u64,
    grad_norm: f32,
    loss: &LossSums,
    rule: &UpdateRule,
    apply: impl FnOnce(&mut Replica) -> Result<Duration, TrainError>,
) -> Result<Update, TrainError> {
    let finite = grad_norm.is_finite() && loss.is_finite();
    let mut gather = Duration::ZERO;
    if finite {
        // The helpers stay hot for the clipping and the update (`parallel::hot`).
        let _hot = crate::model::parallel::hot();
        gather = apply(replica)?;
    } else {
        replica.skipped_steps += 1;
        tracing::warn!(
            step,
            skipped = replica.skipped_steps,
            "non-finite loss or gradient: update skipped"
        );
        if replica.skipped_steps > rule.max_skipped_steps {
            return Err(TrainError::NonFinite {
                step,
                skipped: replica.skipped_steps,
                max: rule.max_skipped_steps,
            });
        }
    }
    Ok(Update {
        lr: rule.lr,
        grad_norm,
        finite,
        gather,
    })
}

/// The update of a rank that holds the whole gradient `grads` `[P]` and the whole optimizer:
/// clip to the global norm, then the optimizer's step (plain data parallelism on the summed
/// gradient; DiLoCo's inner step on this rank's own).
///
/// Errors: as [`apply_or_skip`].
pub fn local_update(
    replica: &mut Replica,
    grads: &mut [f32],
    loss: &LossSums,
    rule: &UpdateRule,
    step: u64,
) -> Result<Update, TrainError> {
    let grad_norm = global_norm(grads);
    apply_or_skip(replica, step, grad_norm, loss, rule, |replica| {
        if rule.max_grad_norm > 0.0 {
            clip_grad_norm(grads, rule.max_grad_norm);
        }
        replica.optimizer.step(&mut replica.params, grads, rule.lr);
        Ok(Duration::ZERO)
    })
}
