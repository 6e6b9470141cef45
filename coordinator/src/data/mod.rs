//! Corpus preparation: from text files to verified binary shards, and per-rank shards for
//! workers (BERT's `create_pretraining_data.py`, plus RoBERTa's full-sentence packing).
//!
//! # Layout
//! - `corpus`: input files (text, JSON Lines, gzip) as a stream of documents.
//! - `tokenize`: parallel, order-keeping tokenisation into a spill file.
//! - `spill`: on-disk temporary records (bounded memory).
//! - `instance`, `instances_mlm`, `instances_nsp`: building training sequences.
//! - `prepare`: the pipeline; `prepare_options`: its options; `error`: its errors; `manifest`:
//!   `manifest.json`.
//! - `prepared`: [`PreparedData`], a prepared folder opened for training.
//! - `worker_shard`: [`build_worker_shard`], one rank's sequences as a shard.

pub mod build_instances;
pub mod corpus;
pub mod error;
pub mod instance;
pub mod instances_mlm;
pub mod instances_nsp;
pub mod manifest;
pub mod prepare;
pub mod prepare_options;
pub mod prepared;
pub mod spill;
pub mod tokenize;
pub mod worker_shard;

pub use manifest::{CorpusStats, Objective, PrepareTimings, PreparedManifest, ShardEntry};
pub use prepare::{PrepareError, PrepareOptions, VocabSource, prepare};
pub use prepared::PreparedData;
pub use worker_shard::{build_worker_heldout_shard, build_worker_shard};
