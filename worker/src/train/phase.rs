//! [`PhaseState`]: what a rank's loop keeps for the training phase it is in
//! (`keel_proto::phases`): the phase's data pipeline, held-out set, learning-rate schedule and
//! global batch. The loop opens the next phase's at its first step, on every rank at the same
//! step, so a switch needs no restart; weights and optimizer moments go on unchanged.

use super::error::{TrainError, data_err};
use super::eval::Evaluator;
use super::optimizer::schedule_for;
use super::pipeline::Pipeline;
use super::setup::TrainSetup;
use crate::optim::LrSchedule;
use keel_proto::shard::ShardReader;

/// One phase's inputs, open.
pub struct PhaseState {
    /// The phase (0-based).
    pub index: usize,
    /// Its first step (0-based).
    pub start: u64,
    /// Its micro-batches.
    pub pipeline: Pipeline,
    /// Its held-out evaluation.
    pub eval: Evaluator,
    /// Its schedule, over its own steps (warmup from its first step).
    pub schedule: LrSchedule,
    /// Its sequences per step `B_p`.
    pub global_batch: u64,
}

impl PhaseState {
    /// Opens the phase that step `step` (0-based) belongs to.
    ///
    /// Errors: [`TrainError::Data`] for an unreadable tokenizer, shard or held-out shard, or a
    /// plan that does not fit.
    pub fn open(setup: &TrainSetup, step: u64) -> Result<Self, TrainError> {
        let spec = &setup.spec;
        let index = spec.phase_at(step);
        let view = spec.phase_view(index);
        let global_batch = spec.phase_global_batch(index, setup.global_batch());
        let pipeline = Pipeline::open(setup, index, global_batch, step)?;
        let (_, heldout, _) = setup.phase_inputs(index);
        let heldout = ShardReader::open(heldout)
            .map_err(|e| data_err(step)(format!("{}: {e}", heldout.display())))?;
        let t = &view.train;
        Ok(Self {
            index,
            start: spec.phase_steps(index).start,
            eval: Evaluator::new(heldout, setup.rank, setup.world_size, t.micro_batch_size),
            schedule: schedule_for(t),
            pipeline,
            global_batch,
        })
    }

    /// The learning rate of the job's step `step` (0-based, inside this phase).
    pub fn lr(&self, step: u64) -> f32 {
        self.schedule.lr(step.saturating_sub(self.start))
    }

    /// The phase's 1-based number for reports in a job with `[[phase]]`; 0 in a job of one
    /// phase (the field stays out of its metrics lines).
    pub fn reported(&self, setup: &TrainSetup) -> u32 {
        if setup.spec.phases.is_empty() {
            0
        } else {
            self.index as u32 + 1
        }
    }
}
