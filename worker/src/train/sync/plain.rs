//! Plain synchronous data parallelism ([`PlainSync`]): the gradient buckets are all-reduced
//! as backward finishes them, and every rank applies the same full update to the same summed
//! gradient. [`BucketReducer`], the buckets' side of a step, serves ZeRO stage 1 too.

use super::super::collectives::{LossCounts, LossSums, StepCounts, submit_lookup_rows};
use super::super::error::{TrainError, model_err, ring_err};
use super::gradient_sync::{GradientSync, Update, UpdateRule, local_update};
use crate::batch::Batch;
use crate::buckets::Buckets;
use crate::model::LookupGrads;
use crate::replica::Replica;
use crate::ringlink::RingLink;
use std::ops::Range;

/// The gradient buckets of a step and where the word embeddings' lookup rows go back.
#[derive(Debug)]
pub struct BucketReducer {
    buckets: Buckets,
    /// The word embeddings' range `[v * c]` of the flat buffers.
    word_range: Range<usize>,
}

impl BucketReducer {
    /// `buckets` (all-reduces or reduce-scatters) over a gradient whose word embeddings are
    /// `word_range`.
    pub fn new(buckets: Buckets, word_range: Range<usize>) -> BucketReducer {
        BucketReducer {
            buckets,
            word_range,
        }
    }

    /// The buckets, for backward to fill.
    pub fn buckets(&mut self) -> &mut Buckets {
        &mut self.buckets
    }

    /// Waits for the summed gradient `grads` `[P]`: sends the lookup rows, then what backward
    /// did not report (nothing, normally), in the same order on every rank, and adds the
    /// summed rows into the word embeddings' gradient.
    ///
    /// Errors: [`TrainError::AllReduce`]; [`TrainError::Model`] for rows of another shape.
    pub fn reduce(
        &mut self,
        grads: &mut [f32],
        mut lookup: Option<&mut LookupGrads<f32>>,
        ring: &RingLink,
        step: u64,
    ) -> Result<(), TrainError> {
        let lookup_sum = lookup
            .as_deref_mut()
            .map(|l| submit_lookup_rows(ring, step, l, self.buckets.dtype()));
        self.buckets.flush(grads, ring, step);
        self.buckets.finish(grads).map_err(ring_err(step))?;
        if let (Some(lookup), Some(sum)) = (lookup, lookup_sum) {
            lookup
                .set_grads(sum.wait().map_err(ring_err(step))?)
                .map_err(model_err(step))?;
            lookup
                .add_into(&mut grads[self.word_range.clone()])
                .map_err(model_err(step))?;
        }
        Ok(())
    }
}

/// Synchronous data parallelism: the loss averaged over the global batch, the gradient
/// all-reduced, the full update on every rank.
#[derive(Debug)]
pub struct PlainSync {
    reducer: BucketReducer,
}

impl PlainSync {
    /// Over `reducer`, whose buckets all-reduce.
    pub fn new(reducer: BucketReducer) -> PlainSync {
        PlainSync { reducer }
    }
}

impl GradientSync for PlainSync {
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

    fn update(
        &mut self,
        replica: &mut Replica,
        grads: &mut [f32],
        loss: &LossSums,
        rule: &UpdateRule,
        _ring: &RingLink,
        step: u64,
    ) -> Result<Update, TrainError> {
        local_update(replica, grads, loss, rule, step)
    }
}
