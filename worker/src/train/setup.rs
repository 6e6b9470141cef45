//! What the training loop of one rank is given ([`TrainSetup`], prepared by `job`) and what it
//! tells the reporter ([`Event`]).

use crate::faults::Faults;
use crate::replica::Replica;
use keel_proto::config::BertConfig;
use keel_proto::jobspec::JobSpec;
use keel_proto::precision::Precision;
use keel_proto::rpc::{EvalReport, StepReport};
use std::path::PathBuf;

/// Everything the loop needs, prepared by `job`.
#[derive(Debug)]
pub struct TrainSetup {
    /// The job.
    pub job_id: String,
    /// Membership generation.
    pub generation: u64,
    /// This rank.
    pub rank: u32,
    /// World size `W`.
    pub world_size: u32,
    /// The job spec.
    pub spec: JobSpec,
    /// The model config.
    pub config: BertConfig,
    /// Training sequences in the whole set.
    pub total_sequences: u64,
    /// This rank's shard.
    pub shard: PathBuf,
    /// The held-out shard.
    pub heldout: PathBuf,
    /// The tokenizer (tokenizer.json), for the special ids and vocabulary of masking.
    pub tokenizer: PathBuf,
    /// The inputs of the job's phases after the first (`[[phase]]`), in order.
    pub later_phases: Vec<PhaseInputs>,
    /// Where the starting weights and optimizer state come from.
    pub initial: InitialState,
    /// Steps already completed: the loop runs `start_step..max_steps`.
    pub start_step: u64,
    /// Sequences per step, fixed for the job's life (`B`; 0 = `W * b * k`).
    pub global_batch_size: u64,
    /// GEMM precision the coordinator decided for the job.
    pub precision: Precision,
    /// Stage a checkpoint of `start_step` before the first step (rank 0).
    pub checkpoint_first: bool,
    /// Fault injection for tests ([`Faults::none`] otherwise); the trainer keeps it.
    pub faults: Faults,
    /// Scratch folder for staging checkpoints.
    pub work_dir: PathBuf,
}

impl TrainSetup {
    /// Whether the word embeddings' gradient may travel in two parts: with several ranks,
    /// unless DiLoCo (which all-reduces no gradient) runs; one rank has nothing to overlap.
    pub fn splits_lookup(&self) -> bool {
        self.world_size > 1 && self.spec.diloco.is_none()
    }

    /// Elements per gradient bucket: `train.bucket_mib` MiB of f32 (validated: 1 to 1024).
    pub fn bucket_elems(&self) -> usize {
        self.spec.train.bucket_mib.clamp(1, 1024) << 18
    }

    /// Sequences per step `B`: `global_batch_size`, or `W * b * k` from the spec when it is 0.
    pub fn global_batch(&self) -> u64 {
        if self.global_batch_size > 0 {
            self.global_batch_size
        } else {
            self.spec.global_batch(self.world_size as usize) as u64
        }
    }
}

/// One later phase's inputs (`keel_proto::phases`).
#[derive(Debug, Clone)]
pub struct PhaseInputs {
    /// This rank's shard of the phase's data.
    pub shard: PathBuf,
    /// The held-out set of the phase's data folder; `None`: the phase's data are phase 1's
    /// (phase 1's `max_seq_length`), and so is its held-out set.
    pub heldout: Option<PathBuf>,
    /// Training sequences in the phase's whole set.
    pub total_sequences: u64,
}

impl TrainSetup {
    /// Phase `p`'s (0-based) shard, held-out set and training sequences.
    pub fn phase_inputs(&self, p: usize) -> (&PathBuf, &PathBuf, u64) {
        if p == 0 {
            return (&self.shard, &self.heldout, self.total_sequences);
        }
        let Some(phase) = self.later_phases.get(p - 1) else {
            return self.phase_inputs(0);
        };
        // Not the previous phase's: after 64 -> 128 -> 64 that set holds 128-token sequences
        // (a crash at phase 3's first eval, found by a fresh user's test).
        let heldout = phase.heldout.as_ref().unwrap_or(&self.heldout);
        (&phase.shard, heldout, phase.total_sequences)
    }
}

/// What the loop tells the reporter (in order).
#[derive(Debug)]
pub enum Event {
    /// A finished step's metrics (rank 0).
    Step(StepReport),
    /// An eval's results (rank 0).
    Eval(EvalReport),
    /// A checkpoint folder staged at `dir`, to upload (rank 0).
    Checkpoint {
        /// Steps completed.
        step: u64,
        /// The staged folder.
        dir: PathBuf,
    },
}

/// Where a generation's starting state comes from (`StartJob.state_source`).
#[derive(Debug)]
pub enum InitialState {
    /// Step 0: from the job seed, or from HF weights (`init_checkpoint`).
    Init {
        /// HF `model.safetensors`, or `None` for the seed.
        weights: Option<PathBuf>,
    },
    /// A stored checkpoint of `start_step`.
    Checkpoint {
        /// Its `model.safetensors`.
        weights: PathBuf,
        /// Its `optimizer.safetensors`.
        optimizer: PathBuf,
        /// Its `trainer_state.json` (skipped-step count), if sent.
        state: Option<PathBuf>,
    },
    /// Memory: this rank's held replica (if it has one), then a broadcast from `root_rank`.
    Memory {
        /// What this worker holds of the job, at any step.
        held: Option<Replica>,
        /// The rank whose replica everyone takes.
        root_rank: u32,
    },
}
