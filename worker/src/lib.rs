//! Keel worker library: the BERT math, the optimizers, the masked-batch pipeline, the ring
//! all-reduce and the worker process that ties them to the coordinator.
//!
//! # Layout
//! - `batch`: the micro-batch type shared by the data pipeline and the model.
//! - `model/`: BERT forward and backward, one file per layer (HF `BertForMaskedLM`, `BertForPreTraining`).
//! - `optim/`: AdamW, LAMB, learning-rate schedules, gradient clipping.
//! - `data/`: masking (static, dynamic, whole-word) and collation of shard sequences into batches.
//! - `allreduce/`: ring reduce-scatter + all-gather between workers over gRPC.
//! - `serve`, `trainer`: the worker process (registration, shard download, training steps).
//! - `bench`: `keel-worker bench`, the training-step benchmark.

// Link OpenBLAS (Debian's system library) as ndarray's BLAS backend.
extern crate blas_src;

pub mod allreduce;
pub mod batch;
pub mod bench;
pub mod data;
pub mod model;
pub mod optim;
pub mod serve;
pub mod trainer;
