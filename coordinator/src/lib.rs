//! Keel coordinator library: jobs, corpus preparation, membership, step orchestration, checkpoints.
//!
//! The coordinator is the control plane of a Keel cluster (protocol: `keel_proto::protocol`).
//! It never carries gradients: workers all-reduce them among themselves.
//!
//! # Layout
//! - `server`: [`run`] — binds the gRPC service and the scheduler to a listener until shutdown.
//! - `service`: translates `keel.v1.Coordinator` RPCs to the state below and errors to `Status`.
//! - `state`: the registry of workers (membership) and jobs, behind one mutex.
//! - `job`: one job's record and its `JobStatus` snapshot.
//! - `scheduler`: the background loop: heartbeat timeouts, the watchdog, preparing queued jobs, forming rings.
//! - `recovery`: a new generation after a lost worker or a restart (protocol step 14).
//! - `watchdog`: a running job whose step does not advance in time is stalled (re-form or fail).
//! - `claims`: a worker's held-step claims, checked against the job (recovery).
//! - `admission`: whether a job's model fits the registered workers' memory (submit, assign).
//! - `prepare_job`: a job's data (via `data`), its model config and each rank's files.
//! - `persist`: each job's record in `job-state.json`, saved on change, restored on start.
//! - `store`: the checkpoint store (upload, list, pull) in the job's folder.
//! - `input_roots`: `--input-root`: the folders a job's paths must lie in.
//! - `submit_check`: a submitted job's paths (corpus, vocab, config, init_checkpoint) exist.
//! - `log_writer`: the log writer that keeps one record on one line (client strings escaped).
//! - `files`: streams a file as checksummed chunks.
//! - `error`: [`CoordinatorError`].
//! - `data`: corpus preparation and worker shards.

pub mod admission;
pub mod claims;
pub mod data;
pub mod error;
pub mod files;
pub mod input_roots;
pub mod job;
pub mod log_writer;
pub mod persist;
pub mod prepare_job;
pub mod recovery;
pub mod scheduler;
pub mod server;
pub mod service;
pub mod state;
pub mod store;
pub mod submit_check;
pub mod watchdog;

pub use error::CoordinatorError;
pub use server::{Config, run};
