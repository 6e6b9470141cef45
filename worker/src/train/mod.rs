//! The training loop of one rank, run on a blocking thread (protocol step 8), in parts:
//!
//! - `start`: the generation's starting state from its source ([`InitialState`], in `setup`): the seed,
//!   HF weights, a checkpoint, or the held replica plus a broadcast (`regather` for a sharded
//!   optimizer's shares).
//! - `pipeline`: this rank's micro-batches, masked as the spec says
//!   (`MaskingConfig::from_spec`).
//! - `collectives`: the step's all-reduces besides the gradient buckets (counts, loss,
//!   lookup rows), under the ids of [`crate::buckets::SpecialBucket`].
//! - `checkpoint`: staging a checkpoint folder for upload.
//! - `eval`: the held-out evaluation.
//! - `optimizer`: the optimizer and learning-rate schedule from the spec.
//! - `sharding`: ZeRO stage 1 (`train.shard_optimizer`): reduce-scatter, update of this
//!   rank's chunks, all-gather of the weights, moments gathered for checkpoints.
//! - `sync`: the training modes, each a `GradientSync` (plain data parallelism, ZeRO stage 1,
//!   DiLoCo with its outer step at the end of each round): what the loss is averaged over, how
//!   the gradient is synchronised after backward, and how the update is applied.
//! - `summary`: a rank's mean step and optimizer times and peak memory, logged at the end.
//! - `trainer`: [`Trainer`], whose `step()` is the step, a few calls long.
//! - `setup`, `error`: what the loop is given ([`TrainSetup`]), tells ([`Event`]) and fails
//!   with ([`TrainError`]).
//!
//! With several ranks the word embeddings' gradient travels in two parts (see
//! `model::LookupGrads`): the tied decoder's dense share as soon as the MLM head's backward is
//! done, and the embedding lookup's share, only the rows of tokens some rank used, at the end
//! (when those rows are at most half the vocabulary; else in one piece at the end).

pub mod checkpoint;
pub mod collectives;
pub mod error;
pub mod eval;
pub mod optimizer;

pub mod phase;
pub mod pipeline;
pub mod regather;
pub mod setup;
pub mod sharding;
pub mod start;
pub mod summary;
pub mod sync;
pub mod trainer;

pub use error::TrainError;
pub use optimizer::{optimizer_for, schedule_for};
pub use setup::{Event, InitialState, PhaseInputs, TrainSetup};
pub use trainer::{Links, Trainer};

use crate::control::JobControl;
use crate::replica::Replica;
use crate::ringlink::RingLink;
use keel_proto::params::ParamLayout;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc::UnboundedSender;

/// Runs the job's steps `start_step..max_steps` on this rank. Returns how it ended and the
/// rank's replica, which is always consistent (a whole number of steps) when it exists: the
/// optimizer update is the last thing a step does before counting it, and nothing after it
/// can fail half-way.
///
/// Errors: [`TrainError`] with the step it happened at; see [`TrainError::is_recoverable`].
pub fn train(
    mut setup: TrainSetup,
    ring: RingLink,
    events: UnboundedSender<Event>,
    control: &JobControl,
    progress: &AtomicU64,
    ring_busy_us: &AtomicU64,
) -> (Result<(), TrainError>, Option<Replica>) {
    let config = setup.config.clone();
    let layout = ParamLayout::bert(&config, config.heads());
    let initial = std::mem::replace(&mut setup.initial, InitialState::Init { weights: None });
    let plan = match sharding::Sharding::for_job(&setup) {
        Ok(s) => s.map(|s| s.plan(&layout)),
        Err(e) => {
            let held = match initial {
                InitialState::Memory { held, .. } => held,
                _ => None,
            };
            return (Err(error::model_err(setup.start_step)(e)), held);
        }
    };
    // A failed start hands back what this rank held (a failed broadcast leaves it as it was).
    let mut replica = match start::starting_replica(initial, &setup, &layout, plan, &ring) {
        Ok(r) => r,
        Err(refused) => {
            let (e, held) = *refused;
            return (Err(e), held);
        }
    };
    progress.store(replica.step, Ordering::SeqCst);
    let links = Links {
        ring,
        events,
        control,
        progress,
        ring_busy_us,
    };
    let mut torn = false;
    let result = Trainer::new(setup, layout, replica.step, links).and_then(|mut trainer| {
        let result = trainer.run(&mut replica);
        torn = trainer.is_torn();
        result
    });
    if torn {
        // A sharded update stopped half-way (a peer gone): this replica is no step at all.
        tracing::warn!(
            step = replica.step,
            "not keeping this rank's state: its sharded update stopped half-way"
        );
        return (result, None);
    }
    (result, Some(replica))
}
