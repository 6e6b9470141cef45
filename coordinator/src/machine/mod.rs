//! A job's whole life, and the membership it runs on, as a pure state machine.
//!
//! [`Machine`] owns the registry of workers and jobs. It has no async runtime, no file system and no
//! clock inside: every change comes in as an [`Input`] with the time it happened
//! ([`Machine::step`]), and everything the outside world must do because of it — commands
//! to send to workers, statuses to publish, records to save, metrics lines to append, a
//! preparation or a generation's files to build, checkpoints to verify or remove — comes
//! out as [`Effect`]s ([`Machine::take_effects`]), in order. The driver (`crate::driver`)
//! carries them out outside the lock and feeds their results back as inputs
//! ([`Input::Prepared`], [`Input::FilesBuilt`], [`Input::CheckpointsVerified`], ...). This is
//! the shape of raft-rs's `RawNode` (`step`, `ready`, `advance`), so that every transition is
//! a unit test with injected time (`machine/tests.rs`).
//!
//! # Layout
//! - `messages`: [`Input`], [`Reply`], [`Effect`] and what they carry ([`Launch`], ...).
//! - `worker_entry`: [`WorkerEntry`], one registered worker.
//! - [`phase`]: [`Phase`], the job's phase with the data of each.
//! - [`job`]: [`Job`], one job's record (private fields; accessors).
//! - `workers`: membership: registration, attach, heartbeats, dead workers.
//! - `launch`: preparing queued jobs, forming the first ring, growth, a generation's start.
//! - `recovery`: a new generation after a loss or a restart (protocol step 14).
//! - `watchdog`: a running job without progress for `progress_timeout_seconds` is stalled.
//! - `reports`: step, eval, done, failure and held reports; checkpoints stored; cancel.
//! - `restore`: jobs read back after a coordinator restart.
//! - `durability`: what waits until a job's record is on disk (a generation's start, the
//!   removal of pruned checkpoints, a submission's answer).
//! - `storage`: checkpoint uploads that could not be stored; the final one is waited for.

mod durability;
pub mod job;
mod launch;
mod messages;
pub mod phase;
mod recovery;
mod reports;
pub mod restore;
mod storage;
#[cfg(test)]
mod tests;
pub mod watchdog;
mod worker_entry;
mod workers;

pub use job::{Job, SaveError};
pub use messages::{Effect, Input, Launch, RankFiles, Registration, Reply, UploadFailure};
pub use phase::{Outcome, Phase};
pub use worker_entry::{StepTimes, WorkerEntry};

use crate::CoordinatorError;
use keel_proto::jobspec::JobSpec;
use keel_proto::metrics::MetricsLine;
use keel_proto::rpc::{TrainingKey, worker_command};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Instant, SystemTime};

/// Workers and jobs, and the effects not yet taken.
#[derive(Debug, Default)]
pub struct Machine {
    /// Where jobs live (`DATA_DIR/jobs/job-N`).
    jobs_dir: PathBuf,
    /// Registered workers by id.
    workers: BTreeMap<String, WorkerEntry>,
    /// Jobs by id.
    jobs: BTreeMap<String, Job>,
    /// Job ids in submission order (FIFO scheduling).
    order: Vec<String>,
    /// Counter for worker ids (`w-N`).
    next_worker: u64,
    /// Counter for job ids (`job-N`).
    next_job: u64,
    /// Effects produced and not yet taken by the driver.
    effects: Vec<Effect>,
}

impl Machine {
    /// An empty machine whose jobs live in `jobs_dir`.
    pub fn new(jobs_dir: PathBuf) -> Self {
        Machine {
            jobs_dir,
            ..Default::default()
        }
    }

    /// Applies `input`, which happened at `now`. Effects accumulate until
    /// [`take_effects`](Self::take_effects).
    ///
    /// Errors: what the RPC that carried the input must answer: `UnknownJob`,
    /// `UnknownWorker`, `Stale` (a report of another generation, or out of order),
    /// `BadRequest` (a rank or step that cannot be), `AddressInUse` (registration).
    pub fn step(&mut self, now: Instant, input: Input) -> Result<Reply, CoordinatorError> {
        match input {
            Input::Tick => {
                self.tick(now);
                Ok(Reply::None)
            }
            Input::Reserve { spec } => self.reserve(&spec),
            Input::Submitted {
                id,
                spec,
                dir,
                wall,
            } => {
                self.submitted(now, id, spec, dir, wall);
                Ok(Reply::None)
            }
            Input::Cancel { job_id } => self.cancel(now, &job_id),
            Input::Register(r) => self.register(now, r),
            Input::Attached { worker_id, attach } => self.attached(now, &worker_id, attach),
            Input::Detached { worker_id, attach } => {
                self.detached(&worker_id, attach);
                Ok(Reply::None)
            }
            Input::Unreachable { worker_id } => {
                self.unreachable(&worker_id);
                Ok(Reply::None)
            }
            Input::Heartbeat {
                worker_id,
                key,
                times,
            } => Ok(self.heartbeat(now, &worker_id, key, times)),
            Input::Prepared { job_id, result } => {
                self.prepared(now, &job_id, result);
                Ok(Reply::None)
            }
            Input::FilesBuilt {
                job_id,
                generation,
                result,
            } => {
                self.files_built(now, &job_id, generation, result);
                Ok(Reply::None)
            }
            Input::CheckpointsVerified {
                job_id,
                generation,
                newest,
            } => {
                self.checkpoints_verified(now, &job_id, generation, newest);
                Ok(Reply::None)
            }
            Input::Step(r) => self.step_reported(now, r),
            Input::Eval(r) => self.eval_reported(now, r),
            Input::Done(r) => self.done_reported(now, r),
            Input::Failure(r) => self.failure_reported(now, r),
            Input::Held(r) => self.held_reported(r),
            Input::UploadBegins(key) => self.upload_begins(&key),
            Input::UploadProgress(key) => {
                self.upload_progress(now, &key);
                Ok(Reply::None)
            }
            Input::CheckpointStored(key) => self.checkpoint_stored(now, &key),
            Input::UploadFailed(failure) => Ok(self.upload_failed(now, failure)),
            Input::SaveFailed {
                job_id,
                error,
                storage_full,
            } => {
                if let Some(job) = self.jobs.get_mut(&job_id) {
                    job.save_failed(SaveError {
                        message: error,
                        storage_full,
                    });
                }
                Ok(Reply::None)
            }
            Input::Saved {
                job_id,
                seq,
                generation,
            } => {
                self.saved(now, &job_id, seq, generation);
                Ok(Reply::None)
            }
            Input::Withdraw { job_id } => self.withdraw(&job_id),
        }
    }

    /// The effects produced since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// The job `job_id`.
    ///
    /// Errors: [`CoordinatorError::UnknownJob`].
    pub fn job(&self, job_id: &str) -> Result<&Job, CoordinatorError> {
        self.jobs
            .get(job_id)
            .ok_or_else(|| CoordinatorError::UnknownJob {
                job_id: job_id.to_string(),
            })
    }

    /// Every job, in submission order.
    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.order.iter().filter_map(|id| self.jobs.get(id))
    }

    /// The worker `worker_id`, if registered.
    pub fn worker(&self, worker_id: &str) -> Option<&WorkerEntry> {
        self.workers.get(worker_id)
    }

    /// Every registered worker, in registration order.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerEntry> {
        let mut all: Vec<&WorkerEntry> = self.workers.values().collect();
        all.sort_by_key(|w| w.number);
        all.into_iter()
    }

    /// Every registered worker's advertised memory limit (`None`: it advertised none).
    pub fn memory_limits(&self) -> impl Iterator<Item = Option<u64>> + Clone + '_ {
        self.workers.values().map(|w| w.memory_limit)
    }

    /// The job a worker message names, checked to be about its current generation.
    ///
    /// Errors: `BadRequest` (no key), [`CoordinatorError::UnknownJob`],
    /// [`CoordinatorError::Stale`].
    pub fn current(&self, key: Option<&TrainingKey>) -> Result<&Job, CoordinatorError> {
        let key = key.ok_or_else(|| CoordinatorError::BadRequest("missing training key".into()))?;
        let job = self.job(&key.job_id)?;
        if job.generation != key.generation {
            return Err(CoordinatorError::Stale {
                job_id: key.job_id.clone(),
                message: format!(
                    "generation {} is not the current one ({})",
                    key.generation, job.generation
                ),
            });
        }
        Ok(job)
    }

    /// A record due for every job (`force`: even if only step progress changed recently):
    /// the shutdown's last save. Returns how many records it handed out.
    pub fn save_all(&mut self, now: Instant) -> usize {
        let ids: Vec<String> = self.order.clone();
        ids.iter().filter(|id| self.save(id, now, true)).count()
    }

    /// Publishes `job_id`'s status and hands out its record when due.
    fn publish(&mut self, job_id: &str, now: Instant) {
        if let Some(job) = self.jobs.get(job_id) {
            let status = job.status(now);
            self.effects.push(Effect::Publish(Box::new(status)));
        }
        self.save(job_id, now, false);
    }

    /// Hands out `job_id`'s record if due; whether it did.
    fn save(&mut self, job_id: &str, now: Instant, force: bool) -> bool {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return false;
        };
        match job.record_due(now, force) {
            Some((record, seq)) => {
                self.effects.push(Effect::Save {
                    job_id: job.id.clone(),
                    dir: job.dir.clone(),
                    record: Box::new(record),
                    seq,
                });
                true
            }
            None => false,
        }
    }

    /// Appends `line` to `job_id`'s `metrics.jsonl`.
    fn append_metrics(&mut self, job_id: &str, line: MetricsLine) {
        if let Some(job) = self.jobs.get(job_id) {
            self.effects.push(Effect::AppendMetrics {
                dir: job.dir.clone(),
                line: Box::new(line),
            });
        }
    }

    /// Sends `command` to `worker_id`, if it can take commands now; whether it could.
    fn send(&mut self, worker_id: &str, command: worker_command::Command) -> bool {
        match self.workers.get(worker_id) {
            Some(w) if w.reachable() => {
                self.effects.push(Effect::Send {
                    worker_id: worker_id.to_string(),
                    command,
                });
                true
            }
            _ => false,
        }
    }

    /// Job ids in submission order whose job is in a phase `keep` accepts.
    fn ids_where(&self, keep: impl Fn(&Phase) -> bool) -> Vec<String> {
        self.order
            .iter()
            .filter(|id| self.jobs.get(*id).is_some_and(|j| keep(&j.phase)))
            .cloned()
            .collect()
    }

    /// One tick: dead workers, stalled jobs, queued jobs, regroups, waiting jobs, saves.
    fn tick(&mut self, now: Instant) {
        self.reap_dead_workers(now);
        self.check_stalls(now);
        self.start_preparing(now);
        self.advance_regroups(now);
        self.assign_workers(now);
        let due: Vec<String> = self
            .jobs
            .values()
            .filter(|j| j.save_pending() || !j.is_finished())
            .map(|j| j.id.clone())
            .collect();
        for id in due {
            self.save(&id, now, false);
        }
    }

    /// Reserves the next job number for `spec`, after checking that some registered worker
    /// can hold its model (`crate::admission`).
    fn reserve(&mut self, spec: &JobSpec) -> Result<Reply, CoordinatorError> {
        crate::admission::check_submission(spec, self.memory_limits())?;
        self.next_job += 1;
        let id = format!("job-{}", self.next_job);
        let dir = self.jobs_dir.join(&id);
        Ok(Reply::Reserved { id, dir })
    }

    /// Queues a submitted job.
    fn submitted(
        &mut self,
        now: Instant,
        id: String,
        spec: JobSpec,
        dir: PathBuf,
        wall: SystemTime,
    ) {
        self.jobs
            .insert(id.clone(), Job::new(id.clone(), spec, dir, now, wall));
        self.order.push(id.clone());
        self.publish(&id, now);
    }

    /// Ends a job that is not finished yet: sets its outcome, tells its workers to drop it
    /// (`CancelJob`, unless it completed) and frees them.
    fn end_job(&mut self, job_id: &str, outcome: Outcome, now: Instant) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if job.is_finished() {
            return;
        }
        let members = job.members();
        let reason = match &outcome {
            Outcome::Completed => {
                tracing::info!(job = job_id, state = ?keel_proto::rpc::JobState::Completed, "job ended");
                None
            }
            Outcome::Cancelled(e) => {
                tracing::warn!(job = job_id, "{e}");
                Some(e.clone())
            }
            Outcome::Failed(e) => {
                tracing::error!(job = job_id, "{e}");
                Some(e.clone())
            }
        };
        job.phase = Phase::Finished(outcome);
        job.finished = Some(now);
        let key = TrainingKey {
            job_id: job.id.clone(),
            generation: job.generation,
            step: job.step,
        };
        self.publish(job_id, now);
        for id in members {
            if let Some(w) = self.workers.get_mut(&id)
                && w.job.as_ref().is_some_and(|(j, _)| j == job_id)
            {
                w.job = None;
            }
            if let Some(reason) = &reason {
                self.send(
                    &id,
                    worker_command::Command::Cancel(keel_proto::rpc::CancelJob {
                        key: Some(key.clone()),
                        reason: reason.clone(),
                    }),
                );
            }
        }
    }

    /// `rank 1 = w-2 (127.0.0.1:7072)` for every rank of a job: appended to failure messages
    /// so that a rank named by a ring error maps to a worker.
    fn describe_ranks(&self, job: &Job) -> String {
        job.members()
            .iter()
            .enumerate()
            .map(|(rank, id)| match self.workers.get(id) {
                Some(w) => format!("rank {rank} = {}", w.describe()),
                None => format!("rank {rank} = {id}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `w-2 (127.0.0.1:7072)` for each worker id (the id alone if it is gone).
    fn names_of(&self, ids: &[String]) -> Vec<String> {
        ids.iter()
            .map(|id| {
                self.workers
                    .get(id)
                    .map_or_else(|| id.clone(), |w| w.describe())
            })
            .collect()
    }
}
