//! Job state that survives a coordinator restart: `JOB_DIR/job-state.json`.
//!
//! Every job's record (spec, state, generation, step, checkpoints, error, ring, recoveries,
//! submission time, global batch) is handed out by the machine (`crate::machine`) whenever a
//! change matters for recovery, and at most every `machine::job::PROGRESS_INTERVAL` for mere
//! step progress; the driver writes it atomically (temp file, fsync, rename). On start the
//! coordinator reads every `jobs/*/job-state.json` back ([`load_jobs`]) and the machine
//! decides the phase each resumes in (`machine/restore.rs`).
//!
//! A file that cannot be read or parsed is logged (naming it) and skipped; it never stops the
//! coordinator.

use crate::input_roots::InputRoots;
use crate::prepare_job::{self, PreparedJob};
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::JobState;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// File name of a job's record, in its folder.
pub const JOB_STATE_FILE: &str = "job-state.json";

/// Version of the record's layout; a file with another version is refused (and skipped).
pub const FORMAT_VERSION: u32 = 1;

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

impl PersistError {
    /// Whether the error is a full file system (ENOSPC, or a quota).
    pub fn is_storage_full(&self) -> bool {
        let io = match self {
            PersistError::Io { source, .. } => Some(source),
            PersistError::Write(keel_proto::checkpoint::CheckpointError::Io { source, .. }) => {
                Some(source)
            }
            _ => None,
        };
        io.is_some_and(|e| {
            matches!(
                e.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            )
        })
    }
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
    /// Steps completed, as last reported (may lag the truth by `PROGRESS_INTERVAL`).
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
    /// When `step` was heard (rank 0's step report, or the generation's start), milliseconds
    /// since the Unix epoch: bounds how far a worker's held-step claim may be ahead of it after a
    /// restart (`crate::claims`). `None` in records written before it existed.
    #[serde(default)]
    pub step_heard_unix_ms: Option<u64>,
    /// Advertise addresses (`host:port`) of the workers the progress watchdog singled out as
    /// stalling this job: they are not given it again, also after a restart.
    #[serde(default)]
    pub excluded_workers: Vec<String>,
    /// When the job ended, milliseconds since the Unix epoch (`None` while it runs, and in
    /// records written before it existed): its elapsed time stops there.
    #[serde(default)]
    pub finished_unix_ms: Option<u64>,
    /// The latest step and eval metrics.
    pub metrics: LastMetrics,
}

impl JobRecord {
    /// Whether `self` and `other` differ only in step progress (step, skipped steps, metrics),
    /// which may wait a little to be written.
    pub fn differs_only_in_progress(&self, other: &JobRecord) -> bool {
        let strip = |r: &JobRecord| JobRecord {
            step: 0,
            step_heard_unix_ms: None,
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

    /// The record's spec; if it no longer parses, the folder's `job.toml`.
    ///
    /// Errors: [`PersistError::Invalid`] naming `path` when neither parses.
    pub fn spec(&self, dir: &Path, path: &Path) -> Result<JobSpec, PersistError> {
        match serde_json::from_value::<JobSpec>(self.spec.clone()) {
            Ok(spec) => Ok(spec),
            Err(json_error) => {
                let toml_path = dir.join("job.toml");
                std::fs::read_to_string(&toml_path)
                    .ok()
                    .and_then(|text| {
                        JobSpec::from_toml_str(&text, &toml_path.display().to_string()).ok()
                    })
                    .ok_or_else(|| PersistError::Invalid {
                        path: path.to_path_buf(),
                        reason: format!(
                            "spec: {json_error} (and {} does not parse either)",
                            toml_path.display()
                        ),
                    })
            }
        }
    }
}

/// A job as read back from its folder, with what the reader found out about it.
#[derive(Debug)]
pub struct Restored {
    /// Its saved record.
    pub record: JobRecord,
    /// Its spec (from the record, or the folder's `job.toml`).
    pub spec: JobSpec,
    /// Its folder.
    pub dir: PathBuf,
    /// Its prepared data, when the folder holds a complete one.
    pub prepared: Option<Arc<PreparedJob>>,
    /// Preparations of it that were interrupted (the coordinator died while preparing).
    pub interrupted_preparations: u32,
    /// Why it may not run any more (a path outside the input roots), if so.
    pub refused: Option<String>,
}

/// Reads every `jobs_dir/job-N/job-state.json`, in job-number order, for the machine to take
/// back (`Machine::restore`). A job that is not finished gets its prepared data back when its
/// data folder is complete, the count of its interrupted preparations, and, when it names a
/// path outside `roots` (they changed since it was submitted), the reason it may not run. A
/// file that cannot be read, parsed or restored is logged as an error naming it and skipped;
/// a folder without the file is skipped with a warning.
pub fn load_jobs(jobs_dir: &Path, roots: &InputRoots) -> Vec<Restored> {
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
        let read = JobRecord::read(&path).and_then(|record| {
            if record.id != name {
                return Err(PersistError::Invalid {
                    path: path.clone(),
                    reason: format!("id {:?} does not match its folder {name}", record.id),
                });
            }
            if JobState::from_str_name(&record.state).is_none() {
                return Err(PersistError::Invalid {
                    path: path.clone(),
                    reason: format!("state: unknown state {:?}", record.state),
                });
            }
            let spec = record.spec(&dir, &path)?;
            Ok((record, spec))
        });
        let (record, spec) = match read {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(file = %path.display(), "cannot restore job {name}, skipping it: {e}");
                continue;
            }
        };
        let finished = matches!(
            record.state.as_str(),
            "JOB_STATE_COMPLETED" | "JOB_STATE_FAILED" | "JOB_STATE_CANCELLED"
        );
        let active = matches!(
            record.state.as_str(),
            "JOB_STATE_WAITING_FOR_WORKERS" | "JOB_STATE_RUNNING" | "JOB_STATE_RECOVERING"
        );
        let mut prepared = None;
        if active {
            match prepare_job::reuse(&record.id, &spec, &dir) {
                Ok(Some(p)) => prepared = Some(Arc::new(p)),
                Ok(None) => {
                    tracing::warn!(job = %record.id, "its prepared data is incomplete: it must be prepared again")
                }
                Err(e) => {
                    tracing::warn!(job = %record.id, "its prepared data cannot be reused: {e}")
                }
            }
        }
        let refused = if finished {
            None
        } else {
            roots
                .check_spec(&spec, &record.id)
                .err()
                .map(|e| e.to_string())
        };
        jobs.push(Restored {
            interrupted_preparations: prepare_job::interrupted_preparations(&dir),
            record,
            spec,
            dir,
            prepared,
            refused,
        });
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, state: JobState) -> JobRecord {
        let spec = JobSpec::from_toml_str(
            "[data]\ncorpus = [\"/nonexistent/corpus.txt\"]\nvocab_size = 100\n[model]\npreset = \"tiny\"\n[train]\nmicro_batch_size = 2\nmax_steps = 10\n",
            "test",
        )
        .unwrap();
        JobRecord {
            version: FORMAT_VERSION,
            id: id.into(),
            spec: serde_json::to_value(&spec).unwrap(),
            state: state.as_str_name().into(),
            generation: 3,
            step: 42,
            checkpoints: vec![20, 40],
            error: None,
            worker_names: vec!["w-1 (127.0.0.1:1)".into()],
            recoveries: 2,
            skipped_steps: 1,
            global_batch_size: Some(16),
            precision: None,
            submitted_unix_ms: 1,
            step_heard_unix_ms: None,
            excluded_workers: Vec::new(),
            finished_unix_ms: None,
            metrics: LastMetrics::default(),
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let root = tempfile::tempdir().unwrap();
        let r = record("job-1", JobState::Running);
        r.write(root.path()).unwrap();
        assert_eq!(
            JobRecord::read(&root.path().join(JOB_STATE_FILE)).unwrap(),
            r
        );
        let mut progressed = r.clone();
        progressed.step = 43;
        assert!(progressed.differs_only_in_progress(&r));
        progressed.generation = 4;
        assert!(!progressed.differs_only_in_progress(&r));
    }

    #[test]
    fn a_corrupt_or_foreign_record_is_skipped() {
        let root = tempfile::tempdir().unwrap();
        let good = root.path().join("job-1");
        std::fs::create_dir_all(&good).unwrap();
        record("job-1", JobState::Completed).write(&good).unwrap();
        let bad = root.path().join("job-2");
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(bad.join(JOB_STATE_FILE), b"{\"version\": 1, \"id\": ").unwrap();
        let moved = root.path().join("job-3");
        std::fs::create_dir_all(&moved).unwrap();
        std::fs::copy(good.join(JOB_STATE_FILE), moved.join(JOB_STATE_FILE)).unwrap();
        let unknown = root.path().join("job-4");
        std::fs::create_dir_all(&unknown).unwrap();
        let mut r = record("job-4", JobState::Completed);
        r.state = "JOB_STATE_DANCING".into();
        r.write(&unknown).unwrap();
        // Not a job folder, and a folder without a record: both ignored.
        std::fs::create_dir_all(root.path().join("scratch")).unwrap();
        std::fs::create_dir_all(root.path().join("job-99")).unwrap();
        let err = JobRecord::read(&bad.join(JOB_STATE_FILE)).unwrap_err();
        assert!(err.to_string().contains("job-2/job-state.json"), "{err}");
        let jobs = load_jobs(root.path(), &InputRoots::default());
        let ids: Vec<&str> = jobs.iter().map(|j| j.record.id.as_str()).collect();
        assert_eq!(ids, ["job-1"]);
    }
}
