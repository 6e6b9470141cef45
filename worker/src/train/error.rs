//! Why the training loop of one rank stopped ([`TrainError`]), with the step it was at.

use crate::model::ModelError;
use crate::replica::BroadcastError;
use crate::ringlink::RingLinkError;

/// Why the loop stopped, with the step it was at.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The ring all-reduce failed (the error names the peer).
    #[error("step {step}: all-reduce: {source}")]
    AllReduce {
        /// 0-based step.
        step: u64,
        /// What the ring said.
        source: RingLinkError,
    },
    /// The model rejected a batch or buffer.
    #[error("step {step}: model: {source}")]
    Model {
        /// 0-based step.
        step: u64,
        /// The model's error.
        source: ModelError,
    },
    /// Data (shard, plan, vocabulary, masking) could not be used.
    #[error("step {step}: data: {message}")]
    Data {
        /// 0-based step.
        step: u64,
        /// What failed.
        message: String,
    },
    /// A checkpoint could not be written or weights read.
    #[error("step {step}: {message}")]
    Io {
        /// 0-based step.
        step: u64,
        /// What failed.
        message: String,
    },
    /// The job was stopped from outside (cancelled, suspended, shutting down).
    #[error("stopped at step {step}")]
    Stopped {
        /// 0-based step.
        step: u64,
    },
    /// Too many steps had a non-finite loss or gradient.
    #[error(
        "step {step}: the loss or gradient was not finite in {skipped} steps, more than \
         [train] max_skipped_steps = {max}: lower the learning rate or check the data"
    )]
    NonFinite {
        /// 0-based step.
        step: u64,
        /// Steps skipped so far, this one included.
        skipped: u64,
        /// The limit.
        max: u64,
    },
    /// The state broadcast that starts a generation failed.
    #[error("step {step}: receiving the state from rank {root}: {source}")]
    Broadcast {
        /// The step being resumed.
        step: u64,
        /// The broadcasting rank.
        root: u32,
        /// What failed.
        source: BroadcastError,
    },
    /// Gathering a sharded optimizer's shares from the ranks' memory failed
    /// (`train::regather`).
    #[error("step {step}: gathering the sharded optimizer state from the ranks' memory: {source}")]
    Regather {
        /// The step being resumed.
        step: u64,
        /// What failed.
        source: BroadcastError,
    },
}

impl TrainError {
    /// Whether a new generation can go on after this error (a ring peer was lost or the job
    /// was stopped from outside) rather than the job itself being broken.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            TrainError::AllReduce { .. }
                | TrainError::Stopped { .. }
                | TrainError::Broadcast {
                    source: BroadcastError::Ring(_),
                    ..
                }
                | TrainError::Regather {
                    source: BroadcastError::Ring(_) | BroadcastError::Incomplete(_),
                    ..
                }
        )
    }
}

/// A maker of [`TrainError::Data`] at `step`.
pub(crate) fn data_err(step: u64) -> impl Fn(String) -> TrainError {
    move |message| TrainError::Data { step, message }
}

/// A maker of [`TrainError::Io`] at `step`.
pub(crate) fn io_err(step: u64) -> impl Fn(String) -> TrainError {
    move |message| TrainError::Io { step, message }
}

/// A maker of [`TrainError::AllReduce`] at `step`.
pub(crate) fn ring_err(step: u64) -> impl Fn(RingLinkError) -> TrainError {
    move |source| TrainError::AllReduce { step, source }
}

/// A maker of [`TrainError::Model`] at `step`.
pub(crate) fn model_err(step: u64) -> impl Fn(ModelError) -> TrainError {
    move |source| TrainError::Model { step, source }
}
