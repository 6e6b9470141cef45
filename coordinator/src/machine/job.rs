//! One job's record inside the machine: what it is ([`JobSpec`], folder), where it is in its
//! life ([`Phase`]) and what it has done (step, checkpoints, metrics). Only `machine/` changes
//! it; the rest of the coordinator reads it through the accessors.

use super::phase::{Outcome, Phase};
use crate::persist::{FORMAT_VERSION, JobRecord, LastMetrics};
use crate::prepare_job::PreparedJob;
use keel_proto::jobspec::JobSpec;
use keel_proto::precision::Precision;
use keel_proto::rpc::{EvalReport, JobState, JobStatus, StepReport};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Step progress alone is saved at most this often (2 s); changes of state, generation,
/// error or checkpoints are saved at once (`crate::persist`).
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

/// A job, from submission to its end.
#[derive(Debug)]
pub struct Job {
    /// `job-N`.
    pub(super) id: String,
    /// The validated spec, paths absolute.
    pub(super) spec: JobSpec,
    /// The job's folder: `data/`, `ranks/`, `checkpoints/`, `metrics.jsonl`, `job.toml`.
    pub(super) dir: PathBuf,
    /// Where the job is in its life, with the data of that phase.
    pub(super) phase: Phase,
    /// Membership generation (1 for the first ring; raised by every regroup).
    pub(super) generation: u64,
    /// Steps completed, as last reported.
    pub(super) step: u64,
    /// `w-2 (127.0.0.1:7072)` per rank of the current (or last) ring.
    pub(super) worker_names: Vec<String>,
    /// Steps of the stored checkpoints, increasing.
    pub(super) checkpoints: Vec<u64>,
    /// The latest step report (rank 0).
    pub(super) last_step: Option<StepReport>,
    /// The latest eval report.
    pub(super) last_eval: Option<EvalReport>,
    /// When it was submitted (machine time: for elapsed time).
    pub(super) submitted: Instant,
    /// When it ended (machine time; `None` while it runs): its elapsed time stops there.
    pub(super) finished: Option<Instant>,
    /// When it was submitted, wall clock (saved, so elapsed time survives a restart).
    pub(super) submitted_at: SystemTime,
    /// Set once preparation succeeded.
    pub(super) prepared: Option<Arc<PreparedJob>>,
    /// Files workers may fetch: name -> path (filled when a generation's files are built).
    pub(super) files: BTreeMap<String, PathBuf>,
    /// Sequences per step, fixed by the first generation (0 before it).
    pub(super) global_batch_size: u64,
    /// GEMM precision, decided once when the first generation starts (`None` before).
    pub(super) precision: Option<Precision>,
    /// Times the ring was re-formed after a loss.
    pub(super) recoveries: u64,
    /// Steps whose update was skipped (non-finite), as rank 0 last reported.
    pub(super) skipped_steps: u64,
    /// Checkpoint uploads that could not be stored.
    pub(super) checkpoint_failures: u64,
    /// The latest of them while no checkpoint has been stored since (`machine::storage`).
    pub(super) checkpoint_problem: Option<String>,
    /// Recoveries since the job last trained a step: each one after the first waits longer
    /// before its generation starts ([`super::recovery::recovery_backoff`]).
    pub(super) recovery_streak: u32,
    /// When `step` was last set from rank 0's step report, a launch or the saved record
    /// (machine time): how far a held-step claim may be ahead of it (`crate::claims`).
    pub(super) step_heard: Instant,
    /// Advertise addresses of the workers the progress watchdog singled out as stalling this
    /// job: never given it again, also after a coordinator restart (saved in the record).
    pub(super) excluded: BTreeSet<String>,
    /// What of it was last handed out to be saved, and when.
    pub(super) saved: Saved,
}

/// What was last handed to the driver to save for a job, and when: decides whether a change
/// is saved now or waits ([`PROGRESS_INTERVAL`]); and what the driver confirmed written,
/// which gates what must not happen before it is durable (a generation's `StartJob`s, the
/// removal of pruned checkpoints, a submission's answer).
#[derive(Debug, Default)]
pub(super) struct Saved {
    /// The record last handed out (or read back at start).
    pub(super) last: Option<JobRecord>,
    /// When (machine time).
    pub(super) at: Option<Instant>,
    /// A change (step progress) is not saved yet.
    pub(super) pending: bool,
    /// The number of the last save handed out (0: none yet in this process).
    pub(super) seq: u64,
    /// The generation named by the newest record known to be on disk; `None` while no
    /// record of the job has been written.
    pub(super) durable_generation: Option<u64>,
    /// Checkpoint folders pruned from the list, each with the first save number whose record
    /// no longer lists them: removed once that save (or a later one) is written, so that a
    /// restart never reads back a record listing a removed folder.
    pub(super) removals: Vec<(u64, Vec<PathBuf>)>,
    /// Why the last write failed, until one succeeds.
    pub(super) error: Option<SaveError>,
}

/// Why a job's record could not be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveError {
    /// The error, naming the file.
    pub message: String,
    /// The file system is full (the submit handler answers `ResourceExhausted`).
    pub storage_full: bool,
}

impl Job {
    /// A newly queued job submitted at `now` (wall clock `wall`).
    pub(super) fn new(
        id: String,
        spec: JobSpec,
        dir: PathBuf,
        now: Instant,
        wall: SystemTime,
    ) -> Self {
        Job {
            id,
            spec,
            dir,
            phase: Phase::Queued,
            generation: 0,
            step: 0,
            worker_names: Vec::new(),
            checkpoints: Vec::new(),
            last_step: None,
            last_eval: None,
            submitted: now,
            finished: None,
            submitted_at: wall,
            prepared: None,
            files: BTreeMap::new(),
            global_batch_size: 0,
            precision: None,
            recoveries: 0,
            skipped_steps: 0,
            checkpoint_failures: 0,
            checkpoint_problem: None,
            recovery_streak: 0,
            step_heard: now,
            excluded: BTreeSet::new(),
            saved: Saved::default(),
        }
    }

    /// `job-N`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The validated spec.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The job's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the job is in its life.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The state clients see.
    pub fn state(&self) -> JobState {
        self.phase.state()
    }

    /// The current membership generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Steps completed, as last reported.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Steps of the stored checkpoints, increasing.
    pub fn checkpoints(&self) -> &[u64] {
        &self.checkpoints
    }

    /// The file a worker may fetch under `name` in the current generation.
    pub fn file(&self, name: &str) -> Option<&PathBuf> {
        self.files.get(name)
    }

    /// The GEMM precision decided for the job, if decided.
    pub fn precision(&self) -> Option<Precision> {
        self.precision
    }

    /// The prepared data, once preparation succeeded.
    pub fn prepared(&self) -> Option<&Arc<PreparedJob>> {
        self.prepared.as_ref()
    }

    /// Whether the job has ended (completed, failed or cancelled).
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Finished(_))
    }

    /// Worker ids of the current ring or regroup, in rank order.
    pub(super) fn members(&self) -> Vec<String> {
        match &self.phase {
            Phase::Running(r) => r.workers.clone(),
            Phase::Recovering(r) => r.stage.members(),
            _ => Vec::new(),
        }
    }

    /// The job's status as clients see it, at `now`.
    pub fn status(&self, now: Instant) -> JobStatus {
        let step = self.last_step.as_ref();
        let error = match &self.phase {
            Phase::Finished(Outcome::Failed(e) | Outcome::Cancelled(e)) => e.clone(),
            _ => String::new(),
        };
        JobStatus {
            job_id: self.id.clone(),
            state: self.state() as i32,
            generation: self.generation,
            step: self.step,
            max_steps: self.spec.train.max_steps,
            loss: step.map_or(f64::NAN, |s| s.loss),
            learning_rate: step.map_or(f64::NAN, |s| s.learning_rate),
            tokens_per_second: step.map_or(f64::NAN, |s| s.tokens_per_second),
            step_seconds: step.map_or(f64::NAN, |s| s.step_seconds),
            workers: self.worker_names.clone(),
            checkpoints: self.checkpoints.clone(),
            error,
            eval_loss: self.last_eval.as_ref().map_or(f64::NAN, |e| e.mlm_loss),
            eval_accuracy: self.last_eval.as_ref().map_or(f64::NAN, |e| e.mlm_accuracy),
            elapsed_seconds: self
                .finished
                .unwrap_or(now)
                .saturating_duration_since(self.submitted)
                .as_secs_f64(),
            recoveries: self.recoveries,
            skipped_steps: self.skipped_steps,
            precision: self
                .precision
                .map_or_else(String::new, |p| p.as_str().to_string()),
            phase: match self.spec.phases.is_empty() {
                true => 0,
                false => (self.spec.phase_at(self.step) + 1) as u32,
            },
            phases: match self.spec.phases.is_empty() {
                true => 0,
                false => self.spec.phase_count() as u32,
            },
            checkpoint_failures: self.checkpoint_failures,
            checkpoint_problem: self.checkpoint_problem.clone().unwrap_or_default(),
        }
    }

    /// Machine time `at` as wall-clock milliseconds since the Unix epoch, through the
    /// submission (the one instant the job knows on both clocks).
    fn unix_ms(&self, at: Instant) -> u64 {
        let submitted = self
            .submitted_at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let after = at.saturating_duration_since(self.submitted).as_millis() as u64;
        let before = self.submitted.saturating_duration_since(at).as_millis() as u64;
        (submitted + after).saturating_sub(before)
    }

    /// The job's durable record as it is now (`crate::persist`).
    pub fn record(&self) -> JobRecord {
        let step = self.last_step.as_ref();
        let eval = self.last_eval.as_ref();
        let error = match &self.phase {
            Phase::Finished(Outcome::Failed(e) | Outcome::Cancelled(e)) => Some(e.clone()),
            _ => None,
        };
        JobRecord {
            version: FORMAT_VERSION,
            id: self.id.clone(),
            // A JobSpec is plain data; serialisation cannot fail, Null is only a fallback.
            spec: serde_json::to_value(&self.spec).unwrap_or(serde_json::Value::Null),
            state: self.state().as_str_name().to_string(),
            generation: self.generation,
            step: self.step,
            checkpoints: self.checkpoints.clone(),
            error,
            worker_names: self.worker_names.clone(),
            recoveries: self.recoveries,
            skipped_steps: self.skipped_steps,
            global_batch_size: (self.global_batch_size > 0).then_some(self.global_batch_size),
            precision: self.precision,
            submitted_unix_ms: self.unix_ms(self.submitted),
            step_heard_unix_ms: Some(self.unix_ms(self.step_heard)),
            finished_unix_ms: self.finished.map(|at| self.unix_ms(at)),
            excluded_workers: self.excluded.iter().cloned().collect(),
            metrics: LastMetrics {
                loss: step.map(|s| s.loss).filter(|v| v.is_finite()),
                learning_rate: step.map(|s| s.learning_rate).filter(|v| v.is_finite()),
                tokens_per_second: step.map(|s| s.tokens_per_second).filter(|v| v.is_finite()),
                step_seconds: step.map(|s| s.step_seconds).filter(|v| v.is_finite()),
                eval_loss: eval.map(|e| e.mlm_loss).filter(|v| v.is_finite()),
                eval_accuracy: eval.map(|e| e.mlm_accuracy).filter(|v| v.is_finite()),
            },
        }
    }

    /// The job a saved record describes, as it resumes after a restart (the caller sets the
    /// phase): no workers, nothing published. `now`/`wall` are the restart's clocks, so the
    /// elapsed time keeps counting from the real submission.
    pub(super) fn from_record(
        record: JobRecord,
        spec: JobSpec,
        dir: PathBuf,
        now: Instant,
        wall: SystemTime,
    ) -> Job {
        let submitted_at = UNIX_EPOCH + Duration::from_millis(record.submitted_unix_ms);
        let age = wall.duration_since(submitted_at).unwrap_or_default();
        let mut job = Job::new(record.id.clone(), spec, dir, now, submitted_at);
        job.submitted = now.checked_sub(age).unwrap_or(now);
        job.generation = record.generation;
        job.step = record.step;
        // The step was heard when the record says (records before this field: at the
        // restart, the most recent it can have been heard).
        job.step_heard = match record.step_heard_unix_ms {
            Some(ms) => {
                let heard = UNIX_EPOCH + Duration::from_millis(ms);
                now.checked_sub(wall.duration_since(heard).unwrap_or_default())
                    .unwrap_or(now)
            }
            None => now,
        };
        job.excluded = record.excluded_workers.iter().cloned().collect();
        // A finished job's clock stays stopped (records before this field: at the restart).
        job.finished = record.finished_unix_ms.map(|ms| {
            let at = UNIX_EPOCH + Duration::from_millis(ms);
            now.checked_sub(wall.duration_since(at).unwrap_or_default())
                .unwrap_or(now)
        });
        job.checkpoints = record.checkpoints.clone();
        job.worker_names = record.worker_names.clone();
        job.recoveries = record.recoveries;
        job.skipped_steps = record.skipped_steps;
        job.global_batch_size = record.global_batch_size.unwrap_or(0);
        job.precision = record.precision;
        let m = &record.metrics;
        if m.loss.is_some() {
            job.last_step = Some(StepReport {
                loss: m.loss.unwrap_or(f64::NAN),
                learning_rate: m.learning_rate.unwrap_or(f64::NAN),
                tokens_per_second: m.tokens_per_second.unwrap_or(f64::NAN),
                step_seconds: m.step_seconds.unwrap_or(f64::NAN),
                skipped_steps: record.skipped_steps,
                ..Default::default()
            });
        }
        if m.eval_loss.is_some() {
            job.last_eval = Some(EvalReport {
                mlm_loss: m.eval_loss.unwrap_or(f64::NAN),
                mlm_accuracy: m.eval_accuracy.unwrap_or(f64::NAN),
                ..Default::default()
            });
        }
        job.saved.durable_generation = Some(record.generation);
        job.saved.last = Some(record);
        job
    }

    /// The record to save now, if one is due: something that matters changed since the last
    /// one handed out, or only step progress changed and that was [`PROGRESS_INTERVAL`] ago
    /// (or `force`). Marks it handed out, with its save number.
    pub(super) fn record_due(&mut self, now: Instant, force: bool) -> Option<(JobRecord, u64)> {
        let record = self.record();
        if self.saved.last.as_ref() == Some(&record) {
            self.saved.pending = false;
            return None;
        }
        let only_progress = self
            .saved
            .last
            .as_ref()
            .is_some_and(|last| last.differs_only_in_progress(&record));
        let recent = self
            .saved
            .at
            .is_some_and(|at| now.saturating_duration_since(at) < PROGRESS_INTERVAL);
        if only_progress && recent && !force {
            self.saved.pending = true;
            return None;
        }
        self.saved.at = Some(now);
        self.saved.last = Some(record.clone());
        self.saved.pending = false;
        self.saved.seq += 1;
        Some((record, self.saved.seq))
    }

    /// The driver could not write the record last handed out (`error`): it is due again.
    pub(super) fn save_failed(&mut self, error: SaveError) {
        self.saved.last = None;
        self.saved.pending = true;
        self.saved.error = Some(error);
    }

    /// Why the last record handed out could not be written; `None` once one is written.
    pub fn save_error(&self) -> Option<&SaveError> {
        self.saved.error.as_ref()
    }

    /// Whether a change is waiting to be saved.
    pub(super) fn save_pending(&self) -> bool {
        self.saved.pending
    }

    /// The driver wrote the record of save `seq`, naming `generation`: the pruned folders
    /// that record no longer lists, to remove now.
    pub(super) fn save_written(&mut self, seq: u64, generation: u64) -> Vec<PathBuf> {
        let durable = self.saved.durable_generation.unwrap_or(0).max(generation);
        self.saved.durable_generation = Some(durable);
        self.saved.error = None;
        let (ready, waiting) = std::mem::take(&mut self.saved.removals)
            .into_iter()
            .partition(|(first, _)| *first <= seq);
        self.saved.removals = waiting;
        ready.into_iter().flat_map(|(_, dirs)| dirs).collect()
    }

    /// Removes `dirs` (checkpoints just pruned from the list) once a record without them is
    /// written: the next save handed out, or a later one.
    pub(super) fn remove_when_saved(&mut self, dirs: Vec<PathBuf>) {
        self.saved.removals.push((self.saved.seq + 1, dirs));
    }

    /// Whether a record of the job is on disk (read back at start, or written since).
    pub fn is_recorded(&self) -> bool {
        self.saved.durable_generation.is_some()
    }

    /// Whether the record on disk names the current generation: only then may its ranks be
    /// sent their `StartJob`s, so that a restart never launches the same generation number
    /// again.
    pub(super) fn generation_is_durable(&self) -> bool {
        self.saved
            .durable_generation
            .is_some_and(|g| g >= self.generation)
    }
}
