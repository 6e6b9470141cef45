//! The coordinator's errors and how they map to gRPC status codes.

use std::path::PathBuf;

/// Everything the coordinator can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// No job with this id.
    #[error("no job {job_id}")]
    UnknownJob {
        /// The id asked for.
        job_id: String,
    },
    /// No registered worker with this id (it timed out or the coordinator restarted).
    #[error("unknown worker {worker_id}: register again")]
    UnknownWorker {
        /// The id given.
        worker_id: String,
    },
    /// The job spec is not valid.
    #[error("invalid job: {0}")]
    InvalidJob(#[from] keel_proto::jobspec::JobSpecError),
    /// A message names a job generation or state that is no longer current.
    #[error("job {job_id}: {message}")]
    Stale {
        /// The job.
        job_id: String,
        /// What does not match.
        message: String,
    },
    /// A worker registers with the advertise address of another live registered worker.
    #[error(
        "advertise address {addr} is already registered by live worker {worker}: give each \
         worker its own --advertise-addr (a restarted worker is accepted once the old \
         registration is gone: its stream closed or its heartbeats stopped)"
    )]
    AddressInUse {
        /// The address asked for.
        addr: String,
        /// The live worker holding it (`w-2 (host:port)`).
        worker: String,
    },
    /// A request is malformed (bad file name, missing key).
    #[error("{0}")]
    BadRequest(String),
    /// No such checkpoint or file.
    #[error("{0}")]
    NotFound(String),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The data folder has no room for a checkpoint upload (checked before it is accepted,
    /// or the disk filled up during it).
    #[error(
        "{path}: no room for the checkpoint of step {step}: it needs about {} ({needed} bytes) \
         and {} ({free} bytes) is free (free space there; a job's final checkpoint is tried again until it is stored)",
        keel_proto::memory::format_bytes(*needed),
        keel_proto::memory::format_bytes(*free)
    )]
    DiskFull {
        /// The folder the checkpoint goes to (`JOB_DIR/checkpoints`).
        path: PathBuf,
        /// The checkpoint's step.
        step: u64,
        /// Bytes it needs (an estimate until its files have arrived).
        needed: u64,
        /// Bytes free there when it was refused.
        free: u64,
    },
    /// A checkpoint or transferred file failed verification.
    #[error(transparent)]
    Checkpoint(#[from] keel_proto::checkpoint::CheckpointError),
    /// Uploaded or referenced weights are unusable (non-finite values, wrong shapes, not
    /// safetensors).
    #[error("{0}")]
    Weights(#[from] keel_proto::weights::WeightsError),
    /// Preparing the job's data or model failed.
    #[error("preparing job {job_id}: {message}")]
    Prepare {
        /// The job.
        job_id: String,
        /// What went wrong.
        message: String,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The health or reflection service could not be built.
    #[error(transparent)]
    Admin(#[from] keel_net::admin::AdminError),
}

impl CoordinatorError {
    /// Whether a client may retry the same request later and expect success.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            CoordinatorError::Io { .. } | CoordinatorError::DiskFull { .. }
        )
    }

    /// An `Io` error for `path`.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> CoordinatorError {
        let path = path.into();
        move |source| CoordinatorError::Io { path, source }
    }
}

impl From<CoordinatorError> for tonic::Status {
    fn from(e: CoordinatorError) -> Self {
        use tonic::Status;
        // The one place every refusal passes: an error quoting client input (a job's TOML, a
        // path, its origin) carries at most a bounded prefix of it.
        let msg = keel_proto::quote::bounded(&e.to_string(), keel_proto::quote::MAX_MESSAGE_BYTES);
        match e {
            CoordinatorError::UnknownJob { .. } | CoordinatorError::NotFound(_) => {
                Status::not_found(msg)
            }
            CoordinatorError::UnknownWorker { .. } => Status::failed_precondition(msg),
            CoordinatorError::AddressInUse { .. } => Status::already_exists(msg),
            CoordinatorError::InvalidJob(_)
            | CoordinatorError::BadRequest(_)
            | CoordinatorError::Weights(_) => Status::invalid_argument(msg),
            CoordinatorError::Stale { .. } => Status::failed_precondition(msg),
            // A file name with a directory part is a malformed request, not lost data.
            CoordinatorError::Checkpoint(keel_proto::checkpoint::CheckpointError::BadName {
                ..
            }) => Status::invalid_argument(msg),
            CoordinatorError::Checkpoint(_) => Status::data_loss(msg),
            // A full data folder: the worker holds the checkpoint (a final one is tried
            // again until it is stored); the metadata tells it from a passing exhaustion.
            CoordinatorError::DiskFull { .. } => {
                let mut status = Status::resource_exhausted(msg);
                status.metadata_mut().insert(
                    keel_proto::transfer::DISK_FULL_METADATA,
                    tonic::metadata::MetadataValue::from_static("1"),
                );
                status
            }
            // Out of file descriptors or memory: passes (the worker tries its upload again).
            CoordinatorError::Io { ref source, .. } if is_exhaustion(source) => {
                Status::resource_exhausted(msg)
            }
            CoordinatorError::Io { .. }
            | CoordinatorError::Prepare { .. }
            | CoordinatorError::Transport(_)
            | CoordinatorError::Admin(_) => Status::internal(msg),
        }
    }
}

/// Whether `e` says the process or system ran out of file descriptors or memory (EMFILE,
/// ENFILE, ENOMEM): transient, unlike a missing file or a full disk.
fn is_exhaustion(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(24 | 23 | 12))
}
