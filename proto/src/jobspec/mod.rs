//! The job file: what a user submits (`keel submit JOB.toml`, `keel local JOB.toml`).
//!
//! A job file is TOML with four tables, `[data]`, `[model]`, `[train]` and `[cluster]` (and an
//! optional `[diloco]`); names
//! follow BERT's `run_pretraining.py` / `create_pretraining_data.py` and Hugging Face. Unknown
//! keys and bad values are errors that name the key and say what is allowed. Paths in the job
//! are paths on the coordinator's machine; `keel submit` makes relative ones absolute against
//! its own working directory before sending the job ([`JobSpec::resolve_paths`]).
//!
//! # Layout
//! One file per section, each with its types and its own checks (`validate`): `data`
//! ([`DataSpec`], the vocabulary as a [`Vocabulary`]), `model` ([`ModelSpec`], its source as a
//! [`ModelSource`]), `train` ([`TrainSpec`]), `cluster` ([`ClusterSpec`]), `phase`
//! ([`PhaseSpec`]; what phases mean is [`crate::phases`]), and [`crate::diloco`] for
//! `[diloco]`. `spec` is the whole job ([`JobSpec`]) and how a file becomes one; `rules` is
//! [`JobSpec::validate`] and the rules across sections ([`JobSpec::check_across_sections`]);
//! `error` the errors.
//!
//! Where a section offers a choice (`vocab_size` or `vocab`; `preset`, `config` or
//! `init_checkpoint`), the file's keys are read into the section as written ([`DataTable`],
//! [`ModelTable`]) and the choice made once, into an enum: both or neither is refused naming
//! the key, and the rest of Keel matches on the enum. Serialized, a section is its table
//! again, so job files and stored specs keep their shape.
//!
//! ```toml
//! [data]
//! corpus = ["corpora/en-kjv"]           # files, dirs or globs
//! vocab_size = 8000                       # train WordPiece; or: vocab = "vocab.txt"
//! lowercase = true
//! objective = "mlm"                       # or "mlm+nsp"
//! max_seq_length = 128
//! masked_lm_prob = 0.15
//! max_predictions_per_seq = 20
//! heldout_fraction = 0.01
//! [model]
//! preset = "tiny"                         # or config = "config.json", or init_checkpoint = "DIR"
//! [train]
//! micro_batch_size = 16
//! max_steps = 300
//! precision = "auto"                      # or "bf16", "fp32" (see crate::precision)
//! allreduce_dtype = "fp32"                # or "bf16": gradients on the wire
//! bucket_mib = 4                          # gradient bucket, MiB (larger for large worlds)
//! shard_optimizer = false                 # ZeRO stage 1: each rank keeps 1/W of the moments
//! [cluster]
//! min_workers = 2
//! max_workers = 2
//! [diloco]                                # optional: low-communication training
//! inner_steps = 50                        # see crate::diloco
//! [[phase]]                               # optional, repeatable: BERT's phase 2
//! start_step = 900                        # see crate::phases
//! max_seq_length = 512
//! ```

mod cluster;
mod data;
mod error;
mod model;
mod phase;
mod rules;
mod spec;
#[cfg(test)]
mod tests;
mod train;

pub use cluster::ClusterSpec;
pub use data::{DataSpec, DataTable, Objective, Vocabulary};
pub use error::{JobSpecError, SpecError};
pub use model::{ModelSource, ModelSpec, ModelTable, PRESETS};
pub use phase::PhaseSpec;
pub use spec::{JobFile, JobSpec};
pub use train::{OptimizerKind, ScheduleKind, TrainSpec};
