//! ZeRO stage 1 (`train.shard_optimizer`, [`Zero1Sync`]; the collectives are in
//! `super::super::sharding`): the buckets go as reduce-scatters, the clipping norm and LAMB's
//! norms are summed across ranks, each rank updates its own chunks, and the weights are
//! all-gathered; checkpoints gather the moments.

use super::super::collectives::{LossCounts, LossSums, StepCounts};
use super::super::error::{TrainError, ring_err};
use super::super::sharding::{GatheredState, Sharding};
use super::gradient_sync::{GradientSync, Update, UpdateRule, apply_or_skip};
use super::plain::BucketReducer;
use crate::batch::Batch;
use crate::buckets::Buckets;
use crate::model::LookupGrads;
use crate::replica::Replica;
use crate::ringlink::RingLink;

/// ZeRO stage 1: the loss averaged over the global batch, the gradient reduce-scattered, a
/// sharded update then an all-gather of the weights.
#[derive(Debug)]
pub struct Zero1Sync {
    /// Buckets that reduce-scatter.
    reducer: BucketReducer,
    /// The chunks this rank updates.
    sharding: Sharding,
    /// A sharded update failed half-way: the replica holds no whole step.
    torn: bool,
}

impl Zero1Sync {
    /// Over `reducer`, whose buckets reduce-scatter into `sharding`'s chunks.
    pub fn new(reducer: BucketReducer, sharding: Sharding) -> Zero1Sync {
        Zero1Sync {
            reducer,
            sharding,
            torn: false,
        }
    }
}

impl GradientSync for Zero1Sync {
    fn loss_counts(&self, counts: &StepCounts, _batches: &[Batch], _nsp: bool) -> LossCounts {
        LossCounts::global(counts)
    }

    fn buckets(&mut self) -> Option<&mut Buckets> {
        Some(self.reducer.buckets())
    }

    fn reduce(
        &mut self,
        grads: &mut [f32],
        lookup: Option<&mut LookupGrads<f32>>,
        ring: &RingLink,
        step: u64,
    ) -> Result<(), TrainError> {
        self.reducer.reduce(grads, lookup, ring, step)
    }

    /// The norm summed over ranks' chunks, this rank's chunks clipped and updated (LAMB's
    /// norms summed across ranks), then the weights all-gathered. A failure inside the
    /// sharded update leaves the replica torn.
    fn update(
        &mut self,
        replica: &mut Replica,
        grads: &mut [f32],
        loss: &LossSums,
        rule: &UpdateRule,
        ring: &RingLink,
        step: u64,
    ) -> Result<Update, TrainError> {
        let sharding = &self.sharding;
        let grad_norm = sharding
            .grad_norm(grads, ring, step)
            .map_err(ring_err(step))?;
        let torn = &mut self.torn;
        apply_or_skip(replica, step, grad_norm, loss, rule, |replica| {
            if rule.max_grad_norm > 0.0 {
                sharding.clip(grads, grad_norm, rule.max_grad_norm);
            }
            sharding
                .update(replica, grads, rule.lr, ring, step)
                .map_err(|e| {
                    *torn = true;
                    ring_err(step)(e)
                })
        })
    }

    fn gather_optimizer_state(
        &self,
        replica: &Replica,
        is_root: bool,
        ring: &RingLink,
        step: u64,
    ) -> Result<Option<GatheredState>, TrainError> {
        // One rank owns every element: its optimizer's state is whole already.
        if replica.optimizer.plan().is_full() {
            return Ok(None);
        }
        self.sharding
            .gather_optimizer_state(replica, is_root, ring, step)
            .map_err(ring_err(step))
    }

    fn shards_optimizer(&self) -> bool {
        true
    }

    fn is_torn(&self) -> bool {
        self.torn
    }
}
