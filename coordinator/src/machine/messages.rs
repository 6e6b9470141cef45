//! What goes into the machine and comes out of it: [`Input`]s (with [`Registration`] and
//! [`UploadFailure`]), the [`Reply`] to the caller, and the [`Effect`]s the driver carries out
//! (with [`Launch`], one generation to start). Its own file so that the files extending
//! `Machine` name these types without naming each other.

use super::worker_entry::StepTimes;
use crate::persist::JobRecord;
use crate::prepare_job::PreparedJob;
use keel_proto::jobspec::JobSpec;
use keel_proto::metrics::MetricsLine;
use keel_proto::rpc::{
    DoneReport, EvalReport, FailureReport, HeldReport, JobFile, JobStatus, StateSource, StepReport,
    TrainingKey, worker_command,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

/// What a worker said about itself at registration.
#[derive(Debug, Clone, Default)]
pub struct Registration {
    /// host:port its ring peers reach it at (not empty).
    pub advertise_addr: String,
    /// Compute threads it runs.
    pub threads: u32,
    /// Whether it has native bf16 GEMMs that pay.
    pub bf16_native: bool,
    /// Its reason for `bf16_native`.
    pub bf16_detail: String,
    /// Its host name, for people.
    pub hostname: String,
    /// What it holds in memory: `(job, generation, step)`.
    pub holds: Option<TrainingKey>,
    /// Bytes of memory it can use (`None` from workers older than the field).
    pub memory_limit: Option<u64>,
}

/// Each rank's files of a generation, as `(name, path, JobFile)`.
pub type RankFiles = Vec<Vec<(String, PathBuf, JobFile)>>;

/// Something that happened, with everything the machine needs to know about it.
#[derive(Debug)]
pub enum Input {
    /// Time passed (the driver's timer, ~4 per second, and after every wake-up).
    Tick,
    /// A submission: reserve a job number for `spec` (its folder is then made by the caller).
    /// Replies [`Reply::Reserved`]. Refused when no registered worker could hold the model.
    Reserve {
        /// The validated spec.
        spec: JobSpec,
    },
    /// The reserved job's folder is ready: queue it.
    Submitted {
        /// `job-N`, from [`Reply::Reserved`].
        id: String,
        /// The validated spec.
        spec: JobSpec,
        /// Its folder (exists, holds `job.toml`).
        dir: PathBuf,
        /// Submission time, wall clock (saved).
        wall: SystemTime,
    },
    /// The user cancels a job. Replies [`Reply::Status`].
    Cancel {
        /// `job-N`.
        job_id: String,
    },
    /// A worker registers. Replies [`Reply::Registered`].
    Register(Registration),
    /// A worker's `Attach` stream opened (numbered `attach` by the driver).
    Attached {
        /// `w-N`.
        worker_id: String,
        /// The stream's number.
        attach: u64,
    },
    /// A worker's `Attach` stream numbered `attach` closed.
    Detached {
        /// `w-N`.
        worker_id: String,
        /// The stream's number.
        attach: u64,
    },
    /// A command could not be put on a worker's stream (full or closed).
    Unreachable {
        /// `w-N`.
        worker_id: String,
    },
    /// A heartbeat. Replies [`Reply::Known`].
    Heartbeat {
        /// `w-N`.
        worker_id: String,
        /// The job, generation and step it is at, if any.
        key: Option<TrainingKey>,
        /// Its last step's times, once it has trained.
        times: Option<StepTimes>,
    },
    /// A preparation the machine asked for ended.
    Prepared {
        /// `job-N`.
        job_id: String,
        /// The prepared job, or why it failed.
        result: Result<Arc<PreparedJob>, String>,
    },
    /// The files of a generation the machine launched are built.
    FilesBuilt {
        /// `job-N`.
        job_id: String,
        /// The generation.
        generation: u64,
        /// Each rank's files, or why they could not be built.
        result: Result<RankFiles, String>,
    },
    /// The newest intact stored checkpoint among those the machine asked about.
    CheckpointsVerified {
        /// `job-N`.
        job_id: String,
        /// The generation being formed.
        generation: u64,
        /// Its step, `None` when none is intact.
        newest: Option<u64>,
    },
    /// Rank `rank` completed a step.
    Step(StepReport),
    /// An evaluation ended.
    Eval(EvalReport),
    /// A rank finished every step.
    Done(DoneReport),
    /// A rank's step failed.
    Failure(FailureReport),
    /// A worker answers `Suspend` with what it holds.
    Held(HeldReport),
    /// A checkpoint upload starts. Replies [`Reply::JobDir`].
    UploadBegins(TrainingKey),
    /// A chunk of a checkpoint upload arrived (progress).
    UploadProgress(TrainingKey),
    /// A checkpoint was stored in the job's folder.
    CheckpointStored(TrainingKey),
    /// A checkpoint upload failed after its key was accepted (no room, a broken stream).
    UploadFailed(UploadFailure),
    /// The driver could not write a job's record: it is due again.
    SaveFailed {
        /// `job-N`.
        job_id: String,
        /// Why, naming the file (what the submit handler answers when the job's first
        /// record cannot be written).
        error: String,
        /// The file system is full.
        storage_full: bool,
    },
    /// The driver wrote a job's record (the [`Effect::Save`] numbered `seq`): what it says is
    /// durable, so the generation it names may start and the checkpoints it no longer lists
    /// may be removed.
    Saved {
        /// `job-N`.
        job_id: String,
        /// The save's number ([`Effect::Save`]'s `seq`).
        seq: u64,
        /// The generation the record names.
        generation: u64,
    },
    /// A submission is taken back because its first record could not be written: the job is
    /// forgotten (its folder is the caller's to remove). Only a queued job whose record was
    /// never written can be withdrawn.
    ///
    /// Errors: `UnknownJob`; `BadRequest` when the job's record was written or it has left
    /// the queue.
    Withdraw {
        /// `job-N`.
        job_id: String,
    },
}

/// The machine's answer to an input, for the caller (an RPC handler).
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Nothing to say.
    None,
    /// A job number and folder reserved for a submission.
    Reserved {
        /// `job-N`.
        id: String,
        /// `DATA_DIR/jobs/job-N`.
        dir: PathBuf,
    },
    /// The job's status now.
    Status(Box<JobStatus>),
    /// The id and timing of a registered worker.
    Registered {
        /// `w-N`.
        worker_id: String,
    },
    /// Whether the worker is known (false: it must register again).
    Known(bool),
    /// The job's folder (an upload may proceed).
    JobDir(PathBuf),
}

/// What the outside world must do, in this order.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Put a command on a worker's `Attach` stream (in memory; a failure comes back as
    /// [`Input::Unreachable`]).
    Send {
        /// `w-N`.
        worker_id: String,
        /// The command.
        command: worker_command::Command,
    },
    /// Show a job's new status to its watchers (in memory).
    Publish(Box<JobStatus>),
    /// Write a job's record (`JOB_DIR/job-state.json`, atomically); success comes back as
    /// [`Input::Saved`], a failure as [`Input::SaveFailed`].
    Save {
        /// `job-N`.
        job_id: String,
        /// Its folder.
        dir: PathBuf,
        /// The record.
        record: Box<JobRecord>,
        /// This save's number among the job's saves in this process (from 1, increasing).
        seq: u64,
    },
    /// Append one line to `JOB_DIR/metrics.jsonl`.
    AppendMetrics {
        /// The job's folder.
        dir: PathBuf,
        /// The line.
        line: Box<MetricsLine>,
    },
    /// Prepare a job's data (blocking work); the result comes back as [`Input::Prepared`].
    Prepare {
        /// `job-N`.
        job_id: String,
        /// Its spec.
        spec: Box<JobSpec>,
        /// Its folder.
        dir: PathBuf,
    },
    /// Build every rank's files of a generation; they come back as [`Input::FilesBuilt`].
    BuildFiles(Box<Launch>),
    /// Verify the stored checkpoints `steps` (newest last) and say which is the newest intact
    /// one ([`Input::CheckpointsVerified`]).
    VerifyCheckpoints {
        /// `job-N`.
        job_id: String,
        /// The generation being formed.
        generation: u64,
        /// The job's folder.
        dir: PathBuf,
        /// Steps to check, increasing.
        steps: Vec<u64>,
    },
    /// Remove old checkpoint folders (pruned by `train.keep_checkpoints`), once a record
    /// that no longer lists them is durable.
    RemoveCheckpoints {
        /// The folders.
        dirs: Vec<PathBuf>,
    },
}

/// A checkpoint upload that failed after the coordinator accepted its key.
#[derive(Debug, Clone, PartialEq)]
pub struct UploadFailure {
    /// The upload's key (job, generation, the checkpoint's step).
    pub key: TrainingKey,
    /// The folder it was to be stored in (`JOB_DIR/checkpoints`).
    pub path: PathBuf,
    /// Bytes it needs, when the folder had no room for it.
    pub needed_bytes: Option<u64>,
    /// Bytes that were free there, when the folder had no room for it.
    pub free_bytes: Option<u64>,
    /// Why, as the worker was told.
    pub error: String,
}

/// One generation of a job to start: who, from which state, with which data split.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The job.
    pub job_id: String,
    /// The job's spec.
    pub spec: keel_proto::jobspec::JobSpec,
    /// The job's folder.
    pub dir: PathBuf,
    /// The generation being started.
    pub generation: u64,
    /// The job's prepared data.
    pub prepared: Arc<PreparedJob>,
    /// Worker ids in rank order.
    pub workers: Vec<String>,
    /// Steps already completed.
    pub start_step: u64,
    /// Where the ranks take the state from.
    pub source: StateSource,
    /// With `Memory`: the rank that broadcasts it.
    pub root_rank: u32,
    /// Sequences per step (the job's fixed `B`).
    pub global_batch: u64,
    /// Rank 0 uploads a checkpoint of `start_step` first.
    pub checkpoint_first: bool,
    /// `(role, path)` of state files (with `Checkpoint`), replacing a prepared file of the
    /// same role.
    pub state_files: Vec<(String, PathBuf)>,
}
