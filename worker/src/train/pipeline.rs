//! The per-rank data pipeline: this rank's shard + its plan of the global batch + masking
//! (built from the spec's `[data]` section by [`MaskingConfig::from_spec`]) -> micro-batches
//! `[b, max_seq_length]`, padded to `max_seq_length` so shapes do not depend on how the global
//! batch is split (which keeps 1 worker and N workers equal).

use super::error::{TrainError, data_err};
use super::setup::TrainSetup;
use crate::batch::Batch;
use crate::data::{MaskingConfig, MaskingVocab, collate, mask_sequence};
use keel_proto::jobspec::JobSpec;
use keel_proto::shard::ShardReader;
use keel_proto::split::WorkerPlan;
use keel_proto::tokenizer::KeelTokenizer;

/// Mixed into the job seed for the held-out masks, so they differ from training masks.
pub const EVAL_SEED_SALT: u64 = 0x5eed_e7a1;

/// Shard + plan + masking -> micro-batches.
pub struct Pipeline {
    shard: ShardReader,
    plan: WorkerPlan,
    masking: MaskingConfig,
    vocab: MaskingVocab,
    seed: u64,
    /// Every batch is padded to `max_seq_length`: shapes then do not depend on how the global
    /// batch is split, which keeps 1 worker and N workers equal.
    pad_to: usize,
}

impl Pipeline {
    /// Opens the tokenizer of `setup`, then this rank's shard of phase `p` (0-based;
    /// `keel_proto::phases`), and plans this rank's share of `global_batch` sequences per
    /// step, masked and padded as the phase's view of the job says. `step` names the step in
    /// errors.
    ///
    /// Errors: [`TrainError::Data`] naming an unreadable tokenizer or shard, or a plan that
    /// does not fit (`global_batch` not divisible by `W * b`, ...).
    pub fn open(
        setup: &TrainSetup,
        p: usize,
        global_batch: u64,
        step: u64,
    ) -> Result<Self, TrainError> {
        let err = data_err(step);
        let view = setup.spec.phase_view(p);
        let (shard_path, _, total_sequences) = setup.phase_inputs(p);
        let tokenizer = KeelTokenizer::from_tokenizer_json(&setup.tokenizer)
            .map_err(|e| err(format!("{}: {e}", setup.tokenizer.display())))?;
        let shard = ShardReader::open(shard_path)
            .map_err(|e| err(format!("{}: {e}", shard_path.display())))?;
        let plan = WorkerPlan::with_global_batch(
            total_sequences,
            global_batch,
            setup.world_size,
            setup.rank,
            view.train.micro_batch_size as u32,
        )
        .map_err(|e| err(e.to_string()))?;
        Ok(Self::new(
            &view,
            shard,
            plan,
            MaskingVocab::from_tokenizer(&tokenizer),
        ))
    }

    /// The pipeline over an open shard and plan: masking from `spec.data` through
    /// [`MaskingConfig::from_spec`], the seed from `spec.train.seed`, padding to
    /// `spec.data.max_seq_length`.
    pub fn new(spec: &JobSpec, shard: ShardReader, plan: WorkerPlan, vocab: MaskingVocab) -> Self {
        Self {
            shard,
            plan,
            masking: MaskingConfig::from_spec(&spec.data),
            vocab,
            seed: spec.train.seed,
            pad_to: spec.data.max_seq_length,
        }
    }

    /// The masking settings every batch is masked with.
    pub fn masking(&self) -> &MaskingConfig {
        &self.masking
    }

    /// Micro-batches per step on this rank (`k`, gradient accumulation).
    pub fn grad_accum(&self) -> u32 {
        self.plan.grad_accum()
    }

    /// This rank's `k` micro-batches of `step`, each `[b, max_seq_length]`.
    ///
    /// Errors: [`TrainError::Data`] when the plan refuses the step or a sequence of the plan
    /// is not in this rank's shard.
    pub fn micro_batches(&self, step: u64) -> Result<Vec<Batch>, TrainError> {
        (0..self.grad_accum())
            .map(|j| self.micro_batch(step, j))
            .collect()
    }

    /// Micro-batch `j` of this rank at `step`.
    fn micro_batch(&self, step: u64, j: u32) -> Result<Batch, TrainError> {
        let err = data_err(step);
        let mb = self
            .plan
            .micro_batch(step, j)
            .map_err(|e| err(e.to_string()))?;
        let mut masked = Vec::with_capacity(mb.sequence_indices.len());
        for &g in &mb.sequence_indices {
            let seq = self
                .shard
                .find_global(g)
                .ok_or_else(|| err(format!("sequence {g} is not in this rank's shard")))?;
            let m = mask_sequence(&seq, self.seed, mb.epoch, &self.masking, &self.vocab);
            masked.push((seq, m));
        }
        collate(&masked, &mb.sample_ids, self.pad_to).map_err(|e| err(e.to_string()))
    }

    /// The held-out sequences `indices` of `heldout` as one batch `[indices.len(),
    /// max_seq_length]`, masked with the job seed xor [`EVAL_SEED_SALT`] at epoch 0 (the same
    /// masks at every eval).
    ///
    /// Errors: [`TrainError::Data`] at `step` for an unreadable sequence.
    pub fn heldout_batch(
        &self,
        heldout: &ShardReader,
        indices: &[usize],
        step: u64,
    ) -> Result<Batch, TrainError> {
        let err = data_err(step);
        let mut masked = Vec::with_capacity(indices.len());
        let mut ids = Vec::with_capacity(indices.len());
        for &i in indices {
            let seq = heldout.get(i).map_err(|e| err(e.to_string()))?;
            ids.push(seq.global_index);
            let m = mask_sequence(
                &seq,
                self.seed ^ EVAL_SEED_SALT,
                0,
                &self.masking,
                &self.vocab,
            );
            masked.push((seq, m));
        }
        collate(&masked, &ids, self.pad_to).map_err(|e| err(e.to_string()))
    }
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
mod tests;
