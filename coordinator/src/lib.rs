//! Keel coordinator library: jobs, corpus preparation, membership, step orchestration, checkpoints.
//!
//! The coordinator is the control plane of a Keel cluster (protocol: `keel_proto::protocol`).
//! It never carries gradients: workers all-reduce them among themselves.
//!
//! # Layout
//! - `server`: [`run`] — binds the gRPC service, the driver and its timer until shutdown.
//! - `http`: the HTTP port (`--metrics-listen`): Prometheus metrics, the dashboard, its API;
//!   reads the machine through the driver, like `service`.
//! - `service`: translates `keel.v1.Coordinator` RPCs to the machine's inputs and its errors to
//!   `Status`.
//! - `machine`: a job's whole life and the membership it runs on, as a pure state machine
//!   (no tokio, files or clock): inputs in, effects out.
//! - `driver`: feeds the machine (one lock), carries out its effects outside the lock, ticks it.
//! - `claims`: a worker's held-step claims, checked against the job (recovery).
//! - `admission`: whether a job's model fits the registered workers' memory (submit, assign).
//! - `prepare_job`: a job's data (via `data`), its model config and each rank's files.
//! - `persist`: each job's record in `job-state.json`, read back on start.
//! - `store`: the checkpoint store (upload, list, pull) in the job's folder.
//! - `disk`: free space before an upload is accepted; half-written uploads removed at start.
//! - `layout`: where a job's files live in its folder.
//! - `input_roots`: `--input-root`: the folders a job's paths must lie in.
//! - `submit_check`: a submitted job's paths (corpus, vocab, config, init_checkpoint) exist.
//! - `event_log`: each job's TensorBoard event file, written beside its `metrics.jsonl`.
//! - `log_writer`: the log writer that keeps one record on one line (client strings escaped).
//! - `files`: streams a file as checksummed chunks.
//! - `error`: [`CoordinatorError`].
//! - `data`: corpus preparation and worker shards.
//!
//! Imports go one way: `server` -> (`service`, `http`) -> `driver` -> `machine` -> (`admission`,
//! `claims`, `persist`, `prepare_job`, `layout`) -> `data`, `input_roots`, `error`; the driver
//! also writes through `event_log`; `store`
//! sits beside `service` and feeds the driver. A test (`tests/module_graph.rs`) keeps it so.

#![warn(missing_docs)]

pub mod admission;
pub mod claims;
pub mod data;
pub mod disk;
pub mod driver;
pub mod error;
pub mod event_log;
pub mod files;
pub mod http;
pub mod input_roots;
pub mod layout;
pub mod log_writer;
pub mod machine;
pub mod persist;
pub mod prepare_job;
pub mod server;
pub mod service;
pub mod store;
pub mod submit_check;

pub use error::CoordinatorError;
pub use server::{Config, run};
