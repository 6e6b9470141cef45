//! Keel worker library: the BERT math, the optimizers, the masked-batch pipeline, the ring
//! all-reduce and the worker process that ties them to the coordinator.
//!
//! # Layout
//! - `batch`, `model`: re-exported from the `keel-model` crate (the micro-batch type and BERT's
//!   forward and backward), so that `keel_worker::model` paths still work.
//! - `blas_core`: OpenBLAS kernels on CPUs newer than the library (re-exec with a known core).
//! - `optim/`: AdamW, LAMB, learning-rate schedules, gradient clipping.
//! - `data/`: masking (static, dynamic, whole-word) and collation of shard sequences into batches.
//! - `allreduce/`: ring reduce-scatter + all-gather between workers over gRPC.
//! - `serve`: the worker process (registration, heartbeats, commands); `job`: one job's life
//!   on this worker (files, ring, training thread, reports).
//! - `client`: file transfers with the coordinator (shards in, checkpoints out).
//! - `train/`: the training loop of one rank in parts: starting state (`start`), data
//!   pipeline, the step's collectives, checkpoint staging, eval, optimizer from the spec, and
//!   `Trainer`, whose `step()` is the step.
//! - `buckets`: gradient buckets overlapped with backward, and the ids of every other
//!   all-reduce (`SpecialBucket`); `ringlink`: the bridge from the math thread to the async ring.
//! - `bench`: `keel-worker bench`, the training-step benchmark.
//! - `control`: stopping a job from outside (cancel, suspend, shutdown).
//! - `faults`: the test-only fault injection of a worker process, one value made at start-up.
//! - `allocator`: glibc settings that keep the ring's freed frame buffers for reuse.
//! - `startup`: settings read only at start-up (OpenBLAS kernels, huge pages), applied by
//!   executing the worker again.
//! - `replica`: one rank's weights and optimizer state, held across generations, and the
//!   broadcast that gives them to ranks that lack them.

#![warn(missing_docs)]

pub mod allocator;
pub mod allreduce;
pub use keel_model::batch;
pub mod bench;
pub mod bench_roofline;
pub mod blas_core;
pub mod buckets;
pub mod client;
pub mod control;
pub mod data;
pub mod faults;
pub mod io_runtime;
pub mod job;
pub use keel_model as model;
pub mod optim;
pub mod optim_state;
pub mod replica;
pub mod ringlink;
pub mod serve;
pub mod startup;
pub mod telemetry;
pub mod train;
