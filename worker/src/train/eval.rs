//! Evaluation on the held-out set: rank `r` takes sequences `r, r + W, ...` (at most
//! [`EVAL_MAX_SEQUENCES`] in all), masked with a fixed seed; the sums are all-reduced, so
//! every rank gets the same report.

use super::collectives::all_reduce_sums;
use super::error::{TrainError, model_err, ring_err};
use super::pipeline::Pipeline;
use crate::buckets::SpecialBucket;
use crate::model::Bert;
use keel_proto::rpc::EvalReport;
use keel_proto::shard::ShardReader;

/// Held-out sequences evaluated at most (across all ranks), to bound eval time.
pub const EVAL_MAX_SEQUENCES: usize = 1024;

/// The held-out set and this rank's share of it.
pub struct Evaluator {
    heldout: ShardReader,
    rank: u32,
    world_size: u32,
    /// Sequences per forward pass (the job's micro-batch size `b`).
    micro_batch: usize,
}

impl Evaluator {
    /// An evaluator of `heldout` for `rank` of `world_size`, `micro_batch` sequences per
    /// forward pass.
    pub fn new(heldout: ShardReader, rank: u32, world_size: u32, micro_batch: usize) -> Self {
        Self {
            heldout,
            rank,
            world_size,
            micro_batch,
        }
    }

    /// The held-out indices this rank evaluates: `rank, rank + W, ...` below
    /// `min(len, EVAL_MAX_SEQUENCES)` (possibly none).
    pub fn my_indices(&self) -> Vec<usize> {
        let n = self.heldout.len().min(EVAL_MAX_SEQUENCES);
        (self.rank as usize..n)
            .step_by(self.world_size.max(1) as usize)
            .collect()
    }

    /// Evaluates `params` (`[P]`) after `step` steps: MLM loss (nats per masked token),
    /// accuracy and perplexity over every rank's share. Every rank takes part in the
    /// all-reduce ([`SpecialBucket::Eval`]), even one with no sequences. The report's `key` is
    /// left `None`.
    ///
    /// Errors: [`TrainError::Data`], [`TrainError::Model`], [`TrainError::AllReduce`] at `step`.
    pub fn evaluate(
        &self,
        model: &mut Bert<f32>,
        params: &[f32],
        pipeline: &Pipeline,
        ring: &crate::ringlink::RingLink,
        step: u64,
    ) -> Result<EvalReport, TrainError> {
        let mine = self.my_indices();
        let mut sums = [0f64; 3];
        for chunk in mine.chunks(self.micro_batch.max(1)) {
            let batch = pipeline.heldout_batch(&self.heldout, chunk, step)?;
            let s = model
                .forward_loss(params, &batch)
                .map_err(model_err(step))?;
            sums[0] += f64::from(s.mlm_loss_sum);
            sums[1] += s.mlm_count as f64;
            sums[2] += s.mlm_correct as f64;
        }
        let total =
            all_reduce_sums(ring, step, SpecialBucket::Eval, &sums).map_err(ring_err(step))?;
        let count = f64::from(total[1]).max(1.0);
        let mlm_loss = f64::from(total[0]) / count;
        Ok(EvalReport {
            key: None,
            rank: self.rank,
            mlm_loss,
            mlm_accuracy: f64::from(total[2]) / count,
            perplexity: mlm_loss.exp(),
            masked_tokens: total[1] as u64,
        })
    }
}
