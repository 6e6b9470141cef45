//! One job's record on the coordinator and its `JobStatus` snapshot.

use keel_proto::jobspec::JobSpec;
use keel_proto::precision::Precision;
use keel_proto::rpc::{EvalReport, JobState, JobStatus, StepReport};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::sync::watch;

/// What preparation produced: everything needed to assign the job to workers.
#[derive(Debug, Clone)]
pub struct PreparedJob {
    /// The prepared data folder (vocab.txt, tokenizer.json, shard-*.keel, heldout.keel).
    pub data_dir: PathBuf,
    /// Training sequences in the whole set.
    pub total_sequences: u64,
    /// The model's HF `config.json` text.
    pub model_config_json: String,
    /// `(role, path)` of files every rank fetches (heldout, vocab, tokenizer, init weights).
    pub shared_files: Vec<(String, PathBuf)>,
    /// Estimated bytes to train the model on one rank (`keel_proto::memory::estimate`):
    /// only workers whose memory limit holds it are given the job.
    pub memory_bytes: u64,
}

/// A job, from submission to its end.
#[derive(Debug)]
pub struct Job {
    /// `job-N`.
    pub id: String,
    /// The validated spec, paths absolute.
    pub spec: JobSpec,
    /// The job's folder: `data/`, `ranks/`, `checkpoints/`, `metrics.jsonl`, `job.toml`.
    pub dir: PathBuf,
    /// Where the job is in its life.
    pub state: JobState,
    /// Membership generation (1 for the first ring).
    pub generation: u64,
    /// Steps completed, as last reported.
    pub step: u64,
    /// Worker ids in rank order (empty until assigned).
    pub workers: Vec<String>,
    /// `w-2 (127.0.0.1:7072)` per rank, for status and errors.
    pub worker_names: Vec<String>,
    /// Ranks that reported done.
    pub done: BTreeSet<u32>,
    /// Steps of the stored checkpoints, increasing.
    pub checkpoints: Vec<u64>,
    /// Why it failed or was cancelled.
    pub error: Option<String>,
    /// The latest step report (rank 0).
    pub last_step: Option<StepReport>,
    /// The latest eval report.
    pub last_eval: Option<EvalReport>,
    /// When it was submitted (for elapsed time).
    pub submitted: Instant,
    /// When it was submitted, wall clock (saved, so elapsed time survives a restart).
    pub submitted_at: SystemTime,
    /// Set once preparation succeeded.
    pub prepared: Option<Arc<PreparedJob>>,
    /// Files workers may fetch: name -> path (filled at assignment).
    pub files: BTreeMap<String, PathBuf>,
    /// Watchers of the job's status (WatchJob streams).
    pub watch: watch::Sender<JobStatus>,
    /// Sequences per step, fixed by the first generation (0 before it).
    pub global_batch_size: u64,
    /// GEMM precision, decided once when the first generation starts from `train.precision`
    /// and its workers' bf16 reports (`None` before); kept by every later generation.
    pub precision: Option<Precision>,
    /// Times the ring was re-formed after a loss.
    pub recoveries: u64,
    /// Steps whose update was skipped (non-finite), as rank 0 last reported.
    pub skipped_steps: u64,
    /// The new generation being formed, while the job is `RECOVERING`.
    pub regroup: Option<crate::recovery::Regroup>,
    /// What of it was last saved to `job-state.json`, and when.
    pub persisted: crate::persist::Persisted,
    /// When the current generation last made progress (`crate::watchdog`).
    pub progress: crate::watchdog::Progress,
    /// Workers the progress watchdog singled out as stalling this job: never given it again
    /// (a restarted worker registers under a new id and may be).
    pub excluded: BTreeSet<String>,
}

impl Job {
    /// A newly queued job, published (and saved to `dir/job-state.json`).
    pub fn new(id: String, spec: JobSpec, dir: PathBuf) -> Self {
        let mut job = Job::unpublished(id, spec, dir);
        job.publish();
        job
    }

    /// A queued job neither published nor saved yet: what a restore fills in first.
    pub fn unpublished(id: String, spec: JobSpec, dir: PathBuf) -> Self {
        let (watch, _) = watch::channel(JobStatus::default());
        Job {
            id,
            spec,
            dir,
            state: JobState::Queued,
            generation: 0,
            step: 0,
            workers: Vec::new(),
            worker_names: Vec::new(),
            done: BTreeSet::new(),
            checkpoints: Vec::new(),
            error: None,
            last_step: None,
            last_eval: None,
            submitted: Instant::now(),
            submitted_at: SystemTime::now(),
            prepared: None,
            files: BTreeMap::new(),
            watch,
            global_batch_size: 0,
            precision: None,
            recoveries: 0,
            skipped_steps: 0,
            regroup: None,
            persisted: Default::default(),
            progress: crate::watchdog::Progress::starting(0),
            excluded: BTreeSet::new(),
        }
    }

    /// Whether the job has ended (completed, failed or cancelled).
    pub fn is_finished(&self) -> bool {
        matches!(
            self.state,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        )
    }

    /// The job's status as the client sees it.
    pub fn status(&self) -> JobStatus {
        let step = self.last_step.as_ref();
        JobStatus {
            job_id: self.id.clone(),
            state: self.state as i32,
            generation: self.generation,
            step: self.step,
            max_steps: self.spec.train.max_steps,
            loss: step.map_or(f64::NAN, |s| s.loss),
            learning_rate: step.map_or(f64::NAN, |s| s.learning_rate),
            tokens_per_second: step.map_or(f64::NAN, |s| s.tokens_per_second),
            step_seconds: step.map_or(f64::NAN, |s| s.step_seconds),
            workers: self.worker_names.clone(),
            checkpoints: self.checkpoints.clone(),
            error: self.error.clone().unwrap_or_default(),
            eval_loss: self.last_eval.as_ref().map_or(f64::NAN, |e| e.mlm_loss),
            eval_accuracy: self.last_eval.as_ref().map_or(f64::NAN, |e| e.mlm_accuracy),
            elapsed_seconds: self.submitted.elapsed().as_secs_f64(),
            recoveries: self.recoveries,
            skipped_steps: self.skipped_steps,
            precision: self
                .precision
                .map_or_else(String::new, |p| p.as_str().to_string()),
        }
    }

    /// Sends the current status to watchers and saves the job's record when due
    /// (`crate::persist::save_if_due`).
    pub fn publish(&mut self) {
        let status = self.status();
        self.watch.send_replace(status);
        crate::persist::save_if_due(self);
    }
}
