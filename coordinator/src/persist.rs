//! Job state that survives a coordinator restart: `JOB_DIR/job-state.json`.
//!
//! Every job's record (spec, state, generation, step, checkpoints, error, ring, recoveries,
//! submission time, global batch) is written atomically (temp file, fsync, rename) whenever
//! [`Job::publish`] sees a change that matters for recovery — state, generation, error,
//! checkpoint list, workers, recoveries, global batch — and at most every
//! [`PROGRESS_INTERVAL`] for mere step progress. On start the coordinator reads every
//! `jobs/*/job-state.json` back ([`load_jobs`]):
//!
//! | state on disk | state after restart |
//! |---|---|
//! | completed, failed, cancelled | unchanged |
//! | queued, preparing | queued (preparation runs again and reuses a complete data folder), or failed after [`prepare_job::MAX_INTERRUPTED_PREPARATIONS`] interrupted preparations |
//! | waiting for workers, running, recovering | recovering, with no workers attached |
//!
//! A file that cannot be read or parsed is logged (naming it) and skipped; it never stops the
//! coordinator.
//!
//! # Layout
//! - [`JobRecord`]: the file's contents (serde), built from and restored into a [`Job`].
//! - [`Persisted`]: per job, what was last written and when (decides whether to write).
//! - [`save_if_due`] (called by `Job::publish`), [`flush_due`] (progress timer), [`flush`] /
//!   [`flush_all`] (shutdown), [`load_jobs`] (start).

use crate::job::Job;
use crate::prepare_job;
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::{EvalReport, JobState, StepReport};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// File name of a job's record, in its folder.
pub const JOB_STATE_FILE: &str = "job-state.json";

/// Version of the record's layout; a file with another version is refused (and skipped).
pub const FORMAT_VERSION: u32 = 1;

/// Step progress alone is written at most this often (seconds: 2). Changes of state,
/// generation, error or checkpoints are written at once.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

/// Why a job record could not be written or read back.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// `JOB_DIR/job-state.json`.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The atomic write failed.
    #[error(transparent)]
    Write(#[from] keel_proto::checkpoint::CheckpointError),
    /// The file is not a valid record (bad JSON, unknown version or state, bad spec).
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the field.
        reason: String,
    },
}

/// The latest metrics shown by `keel status` / `keel jobs`; `None` before the first report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LastMetrics {
    /// Training loss at the last reported step (nats).
    pub loss: Option<f64>,
    /// Learning rate at that step.
    pub learning_rate: Option<f64>,
    /// Global throughput at that step (tokens/s).
    pub tokens_per_second: Option<f64>,
    /// Wall time of that step (seconds).
    pub step_seconds: Option<f64>,
    /// Held-out MLM loss at the last evaluation (nats).
    pub eval_loss: Option<f64>,
    /// Held-out MLM accuracy at the last evaluation (0..1).
    pub eval_accuracy: Option<f64>,
}

/// One job's durable record: the contents of `JOB_DIR/job-state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// `job-N`.
    pub id: String,
    /// The validated spec (JSON of [`JobSpec`], paths absolute).
    pub spec: serde_json::Value,
    /// Proto name of the state, e.g. `JOB_STATE_RUNNING`.
    pub state: String,
    /// Membership generation (0 before the first ring).
    pub generation: u64,
    /// Steps completed, as last reported (may lag the truth by [`PROGRESS_INTERVAL`]).
    pub step: u64,
    /// Steps of the stored checkpoints, increasing.
    pub checkpoints: Vec<u64>,
    /// Why it failed or was cancelled.
    pub error: Option<String>,
    /// `w-2 (127.0.0.1:7072)` per rank of the last ring.
    pub worker_names: Vec<String>,
    /// Times the ring was re-formed after a loss.
    pub recoveries: u64,
    /// Steps whose update was skipped (non-finite loss or gradient).
    pub skipped_steps: u64,
    /// Sequences per optimizer step, fixed by the first generation; `None` before it.
    pub global_batch_size: Option<u64>,
    /// GEMM precision decided for the job; `None` before its first generation (and in records
    /// written before precisions existed).
    #[serde(default)]
    pub precision: Option<keel_proto::precision::Precision>,
    /// Submission time, milliseconds since the Unix epoch (wall clock).
    pub submitted_unix_ms: u64,
    /// The latest step and eval metrics.
    pub metrics: LastMetrics,
}

impl JobRecord {
    /// The record of `job` as it is now.
    pub fn of(job: &Job) -> JobRecord {
        let step = job.last_step.as_ref();
        let eval = job.last_eval.as_ref();
        JobRecord {
            version: FORMAT_VERSION,
            id: job.id.clone(),
            // A JobSpec is plain data; serialisation cannot fail, Null is only a fallback.
            spec: serde_json::to_value(&job.spec).unwrap_or(serde_json::Value::Null),
            state: job.state.as_str_name().to_string(),
            generation: job.generation,
            step: job.step,
            checkpoints: job.checkpoints.clone(),
            error: job.error.clone(),
            worker_names: job.worker_names.clone(),
            recoveries: job.recoveries,
            skipped_steps: job.skipped_steps,
            global_batch_size: (job.global_batch_size > 0).then_some(job.global_batch_size),
            precision: job.precision,
            submitted_unix_ms: job
                .submitted_at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
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

    /// Whether `self` and `other` differ only in step progress (step, skipped steps, metrics),
    /// which may wait [`PROGRESS_INTERVAL`] to be written.
    fn differs_only_in_progress(&self, other: &JobRecord) -> bool {
        let strip = |r: &JobRecord| JobRecord {
            step: 0,
            skipped_steps: 0,
            metrics: LastMetrics::default(),
            ..r.clone()
        };
        strip(self) == strip(other)
    }

    /// Reads and checks `path`.
    ///
    /// Errors: [`PersistError::Io`], [`PersistError::Invalid`] (bad JSON, another version).
    pub fn read(path: &Path) -> Result<JobRecord, PersistError> {
        let text = std::fs::read_to_string(path).map_err(|source| PersistError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let record: JobRecord = serde_json::from_str(&text).map_err(|e| PersistError::Invalid {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        if record.version != FORMAT_VERSION {
            return Err(PersistError::Invalid {
                path: path.to_path_buf(),
                reason: format!(
                    "version {} (this coordinator reads version {FORMAT_VERSION})",
                    record.version
                ),
            });
        }
        Ok(record)
    }

    /// Writes the record to `job_dir/job-state.json` atomically (temp file, fsync, rename).
    ///
    /// Errors: [`PersistError::Write`].
    pub fn write(&self, job_dir: &Path) -> Result<(), PersistError> {
        let path = job_dir.join(JOB_STATE_FILE);
        let text = serde_json::to_vec_pretty(self).map_err(|e| PersistError::Invalid {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        keel_proto::checkpoint::write_file_atomic(&path, &text)?;
        Ok(())
    }

    /// The job this record describes, in the state it resumes in after a restart (see the
    /// module docs), with no workers attached and nothing published yet. `dir` is the job's
    /// folder. The spec is the record's; if it no longer parses, the folder's `job.toml`.
    ///
    /// Errors: [`PersistError::Invalid`] naming `path` for an unknown state or an unreadable
    /// spec.
    pub fn into_job(self, dir: PathBuf, path: &Path) -> Result<Job, PersistError> {
        let invalid = |reason: String| PersistError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let state = JobState::from_str_name(&self.state)
            .ok_or_else(|| invalid(format!("state: unknown state {:?}", self.state)))?;
        let spec = match serde_json::from_value::<JobSpec>(self.spec.clone()) {
            Ok(spec) => spec,
            Err(json_error) => {
                let toml_path = dir.join("job.toml");
                std::fs::read_to_string(&toml_path)
                    .ok()
                    .and_then(|text| {
                        JobSpec::from_toml_str(&text, &toml_path.display().to_string()).ok()
                    })
                    .ok_or_else(|| {
                        invalid(format!(
                            "spec: {json_error} (and {} does not parse either)",
                            toml_path.display()
                        ))
                    })?
            }
        };
        let mut job = Job::unpublished(self.id, spec, dir);
        job.state = match state {
            JobState::Completed | JobState::Failed | JobState::Cancelled => state,
            JobState::Queued | JobState::Preparing | JobState::Unspecified => JobState::Queued,
            JobState::WaitingForWorkers | JobState::Running | JobState::Recovering => {
                JobState::Recovering
            }
        };
        job.generation = self.generation;
        job.step = self.step;
        job.checkpoints = self.checkpoints;
        job.error = self.error;
        job.worker_names = self.worker_names;
        job.recoveries = self.recoveries;
        job.skipped_steps = self.skipped_steps;
        job.global_batch_size = self.global_batch_size.unwrap_or(0);
        job.precision = self.precision;
        job.submitted_at = UNIX_EPOCH + Duration::from_millis(self.submitted_unix_ms);
        // Keep elapsed time counting from the real submission.
        let age = SystemTime::now()
            .duration_since(job.submitted_at)
            .unwrap_or_default();
        job.submitted = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
        let m = &self.metrics;
        if m.loss.is_some() {
            job.last_step = Some(StepReport {
                loss: m.loss.unwrap_or(f64::NAN),
                learning_rate: m.learning_rate.unwrap_or(f64::NAN),
                tokens_per_second: m.tokens_per_second.unwrap_or(f64::NAN),
                step_seconds: m.step_seconds.unwrap_or(f64::NAN),
                skipped_steps: self.skipped_steps,
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
        Ok(job)
    }
}

/// What was last written for a job, and when: decides whether a publish writes.
#[derive(Debug, Default)]
pub struct Persisted {
    /// The record last written (or read back at start).
    last: Option<JobRecord>,
    /// When it was written.
    at: Option<Instant>,
    /// A change (step progress) is not on disk yet.
    pending: bool,
}

/// Writes `job`'s record if something that matters changed since the last write, or if only
/// step progress changed and the last write is [`PROGRESS_INTERVAL`] old. A failed write is
/// logged (naming the file) and retried at the next change; it never fails the caller.
pub fn save_if_due(job: &mut Job) {
    save(job, false);
}

/// Writes `job`'s record if it differs from the one on disk (progress included). Returns
/// whether it wrote.
pub fn flush(job: &mut Job) -> bool {
    save(job, true)
}

/// [`flush`] for every job whose step progress waits to be written, and every job not
/// finished yet (which catches a change made without a publish); returns how many were
/// written. The progress timer calls it every [`PROGRESS_INTERVAL`]; finished jobs with
/// nothing pending cost nothing.
pub fn flush_due<'a>(jobs: impl IntoIterator<Item = &'a mut Job>) -> usize {
    jobs.into_iter()
        .filter(|j| j.persisted.pending || !j.is_finished())
        .map(flush)
        .filter(|&wrote| wrote)
        .count()
}

/// What [`flush_all`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushSummary {
    /// Jobs looked at.
    pub jobs: usize,
    /// Records written (the others were already on disk, or failed).
    pub written: usize,
    /// Records that could not be written (each logged with its file).
    pub failed: usize,
}

/// [`flush`] for every job (shutdown).
pub fn flush_all<'a>(jobs: impl IntoIterator<Item = &'a mut Job>) -> FlushSummary {
    let mut summary = FlushSummary {
        jobs: 0,
        written: 0,
        failed: 0,
    };
    for job in jobs {
        summary.jobs += 1;
        if flush(job) {
            summary.written += 1;
        } else if job.persisted.pending {
            summary.failed += 1;
        }
    }
    summary
}

fn save(job: &mut Job, force_progress: bool) -> bool {
    let record = JobRecord::of(job);
    let p = &job.persisted;
    if p.last.as_ref() == Some(&record) {
        job.persisted.pending = false;
        return false;
    }
    let only_progress = p
        .last
        .as_ref()
        .is_some_and(|last| last.differs_only_in_progress(&record));
    let recent = p.at.is_some_and(|at| at.elapsed() < PROGRESS_INTERVAL);
    if only_progress && recent && !force_progress {
        job.persisted.pending = true;
        return false;
    }
    job.persisted.at = Some(Instant::now());
    match record.write(&job.dir) {
        Ok(()) => {
            job.persisted.last = Some(record);
            job.persisted.pending = false;
            true
        }
        Err(e) => {
            tracing::error!(job = %job.id, "cannot save the job's state: {e}");
            job.persisted.pending = true;
            false
        }
    }
}

/// Reads every `jobs_dir/job-N/job-state.json`, in job-number order, as jobs ready to be
/// registered (see the module docs for the states they come back in). Jobs that come back
/// recovering get their prepared data back when their data folder is complete. A file that
/// cannot be read, parsed or restored is logged as an error naming it and skipped; a folder
/// without the file (a job submitted before this format existed) is skipped with a warning.
pub fn load_jobs(jobs_dir: &Path) -> Vec<Job> {
    let Ok(entries) = std::fs::read_dir(jobs_dir) else {
        return Vec::new();
    };
    let mut dirs: Vec<(u64, String, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("job-")?.parse::<u64>().ok()?;
            entry.path().is_dir().then(|| (n, name, entry.path()))
        })
        .collect();
    dirs.sort();
    let mut jobs = Vec::new();
    for (_, name, dir) in dirs {
        let path = dir.join(JOB_STATE_FILE);
        if !path.exists() {
            tracing::warn!(file = %path.display(), "no job state saved: job {name} is not restored");
            continue;
        }
        let restored = JobRecord::read(&path).and_then(|record| {
            if record.id != name {
                return Err(PersistError::Invalid {
                    path: path.clone(),
                    reason: format!("id {:?} does not match its folder {name}", record.id),
                });
            }
            let last = record.clone();
            let mut job = record.into_job(dir.clone(), &path)?;
            job.persisted.last = Some(last);
            Ok(job)
        });
        let mut job = match restored {
            Ok(job) => job,
            Err(e) => {
                tracing::error!(file = %path.display(), "cannot restore job {name}, skipping it: {e}");
                continue;
            }
        };
        let interrupted = prepare_job::interrupted_preparations(&job.dir);
        if interrupted >= prepare_job::MAX_INTERRUPTED_PREPARATIONS && !job.is_finished() {
            // It is restored failed (saved below), so it is never prepared again.
            job.state = JobState::Failed;
            job.error = Some(format!(
                "its preparation was interrupted {interrupted} times (the coordinator stopped \
                 or was killed while preparing it, perhaps for memory): not retried; fix the \
                 inputs and submit it again"
            ));
            tracing::error!(job = %job.id, interrupted, "not preparing it again");
        }
        if job.state == JobState::Recovering {
            match prepare_job::reuse(&job.id, &job.spec, &job.dir) {
                Ok(Some(prepared)) => job.prepared = Some(Arc::new(prepared)),
                Ok(None) => {
                    tracing::warn!(job = %job.id, "its prepared data is incomplete: it must be prepared again")
                }
                Err(e) => tracing::warn!(job = %job.id, "its prepared data cannot be reused: {e}"),
            }
        }
        tracing::info!(
            job = %job.id,
            state = job.state.as_str_name(),
            generation = job.generation,
            step = job.step,
            checkpoints = ?job.checkpoints,
            "job restored"
        );
        // Saves the state it resumes in (recovering, queued) and starts its watch channel.
        job.publish();
        jobs.push(job);
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec::from_toml_str(
            r#"[data]
corpus = ["/nonexistent/corpus.txt"]
vocab_size = 100
[model]
preset = "tiny"
[train]
micro_batch_size = 2
max_steps = 10
"#,
            "test",
        )
        .unwrap()
    }

    fn job_in(root: &Path, n: u64) -> Job {
        let id = format!("job-{n}");
        let dir = root.join(&id);
        std::fs::create_dir_all(&dir).unwrap();
        Job::new(id, spec(), dir)
    }

    fn read(job: &Job) -> JobRecord {
        JobRecord::read(&job.dir.join(JOB_STATE_FILE)).unwrap()
    }

    #[test]
    fn a_new_job_is_saved_and_state_changes_are_written_at_once() {
        let root = tempfile::tempdir().unwrap();
        let mut job = job_in(root.path(), 1);
        assert_eq!(read(&job).state, "JOB_STATE_QUEUED");
        job.state = JobState::Running;
        job.generation = 1;
        job.worker_names = vec!["w-1 (127.0.0.1:1)".into()];
        job.publish();
        let r = read(&job);
        assert_eq!(r.state, "JOB_STATE_RUNNING");
        assert_eq!(r.generation, 1);
        assert_eq!(r.worker_names, job.worker_names);
        // Step progress right after a write waits; a checkpoint does not.
        job.step = 5;
        job.publish();
        assert_eq!(read(&job).step, 0);
        assert!(job.persisted.pending);
        job.checkpoints.push(5);
        job.publish();
        let r = read(&job);
        assert_eq!((r.step, r.checkpoints.clone()), (5, vec![5]));
        job.step = 7;
        job.publish();
        assert_eq!(flush_due([&mut job]), 1);
        assert_eq!(read(&job).step, 7);
        assert_eq!(flush_due([&mut job]), 0);
        // A change made without a publish is caught by the timer too.
        job.generation = 2;
        assert_eq!(flush_due([&mut job]), 1);
        assert_eq!(read(&job).generation, 2);
    }

    #[test]
    fn a_failed_write_is_counted_and_retried() {
        let root = tempfile::tempdir().unwrap();
        // The folder does not exist yet: the save at submission fails (and is logged).
        let mut job = Job::new("job-1".into(), spec(), root.path().join("job-1"));
        assert!(job.persisted.pending);
        let summary = flush_all([&mut job]);
        assert_eq!((summary.written, summary.failed), (0, 1));
        std::fs::create_dir_all(&job.dir).unwrap();
        let summary = flush_all([&mut job]);
        assert_eq!((summary.jobs, summary.written, summary.failed), (1, 1, 0));
        assert_eq!(read(&job).state, "JOB_STATE_QUEUED");
        let summary = flush_all([&mut job]);
        assert_eq!((summary.written, summary.failed), (0, 0));
    }

    #[test]
    fn restored_jobs_resume_in_the_documented_states() {
        let root = tempfile::tempdir().unwrap();
        let cases = [
            (JobState::Queued, JobState::Queued),
            (JobState::Preparing, JobState::Queued),
            (JobState::WaitingForWorkers, JobState::Recovering),
            (JobState::Running, JobState::Recovering),
            (JobState::Recovering, JobState::Recovering),
            (JobState::Completed, JobState::Completed),
            (JobState::Failed, JobState::Failed),
            (JobState::Cancelled, JobState::Cancelled),
        ];
        for (i, (state, _)) in cases.iter().enumerate() {
            let mut job = job_in(root.path(), i as u64 + 1);
            job.state = *state;
            job.generation = 3;
            job.step = 42;
            job.checkpoints = vec![20, 40];
            job.error = Some(format!("error {i}"));
            job.workers = vec!["w-1".into()];
            job.worker_names = vec!["w-1 (127.0.0.1:1)".into()];
            job.recoveries = 2;
            job.global_batch_size = 16;
            job.precision = Some(keel_proto::precision::Precision::Bf16);
            job.skipped_steps = 1;
            job.last_step = Some(StepReport {
                loss: 3.5,
                learning_rate: 1e-3,
                skipped_steps: 1,
                ..Default::default()
            });
            job.publish();
            flush(&mut job);
        }
        // Not a job folder, and a folder without a record: both ignored.
        std::fs::create_dir_all(root.path().join("scratch")).unwrap();
        std::fs::create_dir_all(root.path().join("job-99")).unwrap();
        let jobs = load_jobs(root.path());
        assert_eq!(jobs.len(), cases.len());
        for (job, (_, expected)) in jobs.iter().zip(cases) {
            assert_eq!(job.state, expected, "{}", job.id);
            assert_eq!(job.generation, 3);
            assert_eq!(job.step, 42);
            assert_eq!(job.checkpoints, vec![20, 40]);
            assert!(job.workers.is_empty());
            assert_eq!(job.worker_names, vec!["w-1 (127.0.0.1:1)".to_string()]);
            assert_eq!(job.recoveries, 2);
            assert_eq!(job.global_batch_size, 16);
            assert_eq!(job.precision, Some(keel_proto::precision::Precision::Bf16));
            let status = job.status();
            assert_eq!(status.loss, 3.5);
            assert!(status.eval_loss.is_nan());
            assert_eq!(job.skipped_steps, 1);
            assert_eq!(status.skipped_steps, 1);
            // The state it resumes in is what the file says now.
            assert_eq!(read(job).state, expected.as_str_name());
        }
    }

    #[test]
    fn a_corrupt_or_foreign_record_is_skipped() {
        let root = tempfile::tempdir().unwrap();
        let good = job_in(root.path(), 1);
        let bad = root.path().join("job-2");
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(bad.join(JOB_STATE_FILE), b"{\"version\": 1, \"id\": ").unwrap();
        let moved = root.path().join("job-3");
        std::fs::create_dir_all(&moved).unwrap();
        std::fs::copy(good.dir.join(JOB_STATE_FILE), moved.join(JOB_STATE_FILE)).unwrap();
        let err = JobRecord::read(&bad.join(JOB_STATE_FILE)).unwrap_err();
        assert!(err.to_string().contains("job-2/job-state.json"), "{err}");
        let jobs = load_jobs(root.path());
        let ids: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
        assert_eq!(ids, ["job-1"]);
    }
}
