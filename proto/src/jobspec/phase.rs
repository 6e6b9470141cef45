//! `[[phase]]`: one later training phase, as written. What phases mean and how they are
//! checked against the rest of the job is [`crate::phases`].

use serde::{Deserialize, Serialize};

/// A phase after the first: what changes at `start_step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    /// The phase's first step (0-based; steps `start_step..` the next phase's start or
    /// `train.max_steps`).
    pub start_step: u64,
    /// Tokens per sequence (`data.max_seq_length` of the phase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_length: Option<usize>,
    /// Masked positions per sequence at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_predictions_per_seq: Option<usize>,
    /// Sequences per micro-batch on each worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<usize>,
    /// Micro-batches per step on each worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
    /// Peak learning rate of the phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    /// Steps of linear warmup at the phase's start, from 0 to its learning rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
}
