//! DiLoCo ([`DilocoSync`], jobs with `[diloco]`; the outer optimizer's math is
//! `crate::optim::Diloco`): every step is local, the loss this rank's mean, no gradient
//! all-reduced, the update this rank's own; only the counts and loss sums (a few floats, for
//! the report) cross the ring. At the end of every round of `[diloco] inner_steps` steps the
//! workers average their outer gradients `anchor - params` with one ring all-reduce and all
//! apply the same outer step. That all-reduce travels under the gradient buckets' ids of that
//! step, which DiLoCo's local steps leave unused, in pieces of [`BUCKET_ELEMS`], as `dtype`
//! like gradients.
//!
//! A step that ends a round is all or nothing, as every step is: its inner update is taken on
//! the replica, and if the all-reduce then fails the replica is put back as it was before the
//! step ([`Snapshot`]), so that the next generation runs the whole step again.

use super::super::collectives::{LossCounts, LossSums, StepCounts};
use super::super::error::{TrainError, ring_err};
use super::gradient_sync::{GradientSync, Update, UpdateRule, local_update};
use crate::allreduce::WireDtype;
use crate::batch::Batch;
use crate::buckets::{BUCKET_ELEMS, Buckets};
use crate::model::LookupGrads;
use crate::replica::Replica;
use crate::ringlink::{RingLink, RingLinkError};
use keel_proto::diloco::DilocoSpec;

/// DiLoCo: local steps, and an outer step at the end of every round.
#[derive(Debug)]
pub struct DilocoSync {
    /// Local steps per round and the outer step's settings.
    spec: DilocoSpec,
    /// How the outer gradient travels (`train.allreduce_dtype`, as gradients would).
    dtype: WireDtype,
    /// Ranks whose outer gradients are averaged.
    world_size: u32,
}

impl DilocoSync {
    /// Rounds of `spec`, the outer gradient averaged over `world_size` ranks, travelling as
    /// `dtype`.
    pub fn new(spec: DilocoSpec, dtype: WireDtype, world_size: u32) -> DilocoSync {
        DilocoSync {
            spec,
            dtype,
            world_size,
        }
    }
}

impl GradientSync for DilocoSync {
    /// This rank's own counts: its step is its own.
    fn loss_counts(&self, _counts: &StepCounts, batches: &[Batch], nsp: bool) -> LossCounts {
        LossCounts::local(batches, nsp)
    }

    fn buckets(&mut self) -> Option<&mut Buckets> {
        None
    }

    /// Nothing travels: the update uses this rank's gradient (and the lookup rows never
    /// travel apart: `TrainSetup::splits_lookup`).
    fn reduce(
        &mut self,
        _grads: &mut [f32],
        _lookup: Option<&mut LookupGrads<f32>>,
        _ring: &RingLink,
        _step: u64,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    /// The inner update on this rank's gradient; at a round's end the outer step after it,
    /// or, when that fails, the replica put back as it was before the step.
    fn update(
        &mut self,
        replica: &mut Replica,
        grads: &mut [f32],
        loss: &LossSums,
        rule: &UpdateRule,
        ring: &RingLink,
        step: u64,
    ) -> Result<Update, TrainError> {
        let before = self
            .spec
            .ends_round(step + 1)
            .then(|| Snapshot::of(replica));
        // A round starts from the weights every worker holds now. Set at every round's start,
        // not only after an outer step: a fresh job, or one resumed from a synchronous
        // checkpoint, has no anchor yet (a zero anchor made the first outer step scale the
        // weights by `outer_learning_rate * (1 + outer_momentum)`).
        if self.spec.ends_round(step)
            && let Some(outer) = replica.optimizer.outer()
        {
            outer.begin_round(&replica.params);
        }
        let update = local_update(replica, grads, loss, rule, step)?;
        if let Some(before) = before
            && let Err(e) = outer_step(ring, step, self.world_size, self.dtype, replica)
        {
            before.restore(replica);
            return Err(ring_err(step)(e));
        }
        Ok(update)
    }
}

/// The replica before a round's last step: weights, optimizer buffers and counters.
pub struct Snapshot {
    params: Vec<f32>,
    steps_taken: u64,
    state: Vec<(&'static str, Vec<f32>)>,
    skipped_steps: u64,
}

impl Snapshot {
    /// Copies `replica`'s state (`[P]` weights and each `[P]` optimizer buffer).
    pub fn of(replica: &Replica) -> Snapshot {
        Snapshot {
            params: replica.params.clone(),
            steps_taken: replica.optimizer.steps_taken(),
            state: replica
                .optimizer
                .state()
                .into_iter()
                .map(|(name, data)| (name, data.to_vec()))
                .collect(),
            skipped_steps: replica.skipped_steps,
        }
    }

    /// Puts `replica` back as it was when the snapshot was taken.
    pub fn restore(self, replica: &mut Replica) {
        replica.params = self.params;
        replica.skipped_steps = self.skipped_steps;
        let views: Vec<(&str, &[f32])> = self
            .state
            .iter()
            .map(|(name, data)| (*name, data.as_slice()))
            .collect();
        // The buffers came from this very optimizer: same names and lengths.
        if let Err(e) = replica.optimizer.load_state(self.steps_taken, &views) {
            tracing::error!("restoring the optimizer's own snapshot failed: {e}");
        }
    }
}

/// The outer step at `step` over `world_size` ranks: all-reduces this rank's outer gradient,
/// averages it and applies it to `replica` (weights and outer state). Nothing changes unless
/// the all-reduce succeeds. Does nothing when the replica's optimizer is not DiLoCo's.
///
/// Errors: the ring's [`RingLinkError`].
pub fn outer_step(
    ring: &RingLink,
    step: u64,
    world_size: u32,
    dtype: WireDtype,
    replica: &mut Replica,
) -> Result<(), RingLinkError> {
    let Some(diloco) = replica.optimizer.outer() else {
        return Ok(());
    };
    let delta = diloco.outer_gradient(&replica.params);
    let replies: Vec<_> = delta
        .chunks(BUCKET_ELEMS)
        .enumerate()
        .map(|(bucket, piece)| ring.submit_as(step, bucket as u32, piece.to_vec(), dtype))
        .collect();
    let mut mean = Vec::with_capacity(delta.len());
    for reply in replies {
        mean.extend(reply.wait()?);
    }
    let inv = 1.0 / world_size.max(1) as f32;
    mean.iter_mut().for_each(|d| *d *= inv);
    diloco.outer_step(&mut replica.params, &mean);
    Ok(())
}
