//! Keel's contracts: what the coordinator, the workers and the client agree on.
//!
//! # Layout
//! - `rpc`, `ring_rpc`: gRPC code generated from `proto/keel.proto` (control plane) and
//!   `proto/ring.proto` (worker-to-worker data plane).
//! - `config`: the model config (HF `config.json`) and presets.
//! - `params`: the flat parameter layout with HF names, shared by weights, gradients, moments.
//! - `precision`: a job's GEMM precision (`train.precision`) and the once-per-job decision.
//! - `weights`: `model.safetensors` load/save in the layout `save_pretrained` writes.
//! - `tokenizer`, `shard`, `split`: WordPiece vocabulary, the binary shard format, and how
//!   sequences are split among workers.
//! - `jobspec`, `checkpoint`: the job file (TOML) and the checkpoint folder;
//!   `jobfile_reference`: the job file's reference tables (`docs/job-file.md`) made from them.
//! - `metrics`: the typed lines of a job's `metrics.jsonl` ([`metrics::MetricsLine`]).
//! - `tensorboard`: the same values as TensorBoard event files (record framing, the event
//!   messages, [`tensorboard::EventFile`]).
//! - `status`: state names and the JSON of a job's status (serde on the generated types).
//! - `transfer`: files as sha256-checked chunk streams, the one sender and receiver.
//! - `atomic`: the one atomic file write (temporary file, fsync, rename, fsync of the folder).
//! - `limits`, `memory`: bounds on the files a job names (regular files, sizes, line lengths)
//!   and the memory a model needs to train, checked against what a worker has.
//! - `protocol`: the control-plane protocol as numbered steps, and its timeouts.
//! - `quote`: at most a bounded prefix of untrusted input in error messages.
//! - `report`: how the binaries print an error and exit (one line, no backtrace).
//!
//! How processes serve and call (the token, TLS, the accept loop) is not a contract: it lives
//! in the `keel-net` crate.

/// gRPC messages and services generated from `proto/keel.proto` (control plane).
pub mod rpc {
    tonic::include_proto!("keel.v1");
}

/// gRPC messages and services generated from `proto/ring.proto` (worker-to-worker data plane).
pub mod ring_rpc {
    tonic::include_proto!("keel.ring.v1");
}

/// The encoded protobuf descriptors of `keel.proto` and `ring.proto`, for gRPC server
/// reflection (so `grpcurl` can list and call Keel's services without the .proto files).
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("keel_descriptor");

pub mod atomic;
pub mod checkpoint;
pub mod config;
pub mod diloco;
pub mod host;
pub mod jobfile_reference;
pub mod jobspec;
pub mod limits;
pub mod memory;
pub mod metrics;
pub mod params;
pub mod phases;
pub mod precision;
pub mod protocol;
pub mod quote;
pub mod report;
pub mod shard;
pub mod split;
pub mod status;
pub mod tensorboard;
pub mod tokenizer;
pub mod transfer;
pub mod weights;
