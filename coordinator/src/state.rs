//! The coordinator's registry: workers (membership) and jobs, behind one mutex that is never
//! held across an `.await`.

use crate::CoordinatorError;
use crate::input_roots::InputRoots;
use crate::job::Job;
use keel_proto::rpc::{CancelJob, JobState, TrainingKey, WorkerCommand, worker_command};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::{Notify, mpsc};
use tonic::Status;

/// Silence after which a registration no longer holds its advertise address against a new
/// one ([`Registry::claim_address`]): three heartbeat intervals. A worker that restarts on
/// the same address is refused at most this long (it retries every <= 2 s).
pub const LIVE_SILENCE: std::time::Duration = std::time::Duration::from_secs(3);

/// The sending half of a worker's `Attach` stream.
pub type CommandSender = mpsc::Sender<Result<WorkerCommand, Status>>;

/// A registered worker.
#[derive(Debug)]
pub struct WorkerEntry {
    /// `w-N`, in registration order.
    pub id: String,
    /// Registration number: orders ranks.
    pub number: u64,
    /// host:port its ring peers reach it at.
    pub advertise_addr: String,
    /// Compute threads it runs.
    pub threads: u32,
    /// Whether it has native bf16 GEMMs that pay (what it reported at registration).
    pub bf16_native: bool,
    /// Its reason for `bf16_native`, for logs and the precision decision's message.
    pub bf16_detail: String,
    /// Its host name, for people.
    pub hostname: String,
    /// Last heartbeat (or registration).
    pub last_seen: Instant,
    /// The job it works on, with its rank.
    pub job: Option<(String, u32)>,
    /// Steps completed in that job, as last heartbeated.
    pub step: u64,
    /// The generation of that job its heartbeats last named (0: none since it was given the
    /// job): the progress watchdog tells a member that never started a generation by it.
    pub generation: u64,
    /// Its open `Attach` stream; `None` until attached.
    pub commands: Option<CommandSender>,
    /// Set when its `Attach` stream closed (the process died or the link broke): it is
    /// treated as dead at the next scheduler tick.
    pub disconnected: bool,
    /// What it said at registration that it holds in memory: `(job, generation, step)`.
    pub holds: Option<TrainingKey>,
    /// Bytes of memory it advertised it can use (`None` from workers older than the field):
    /// it is given only jobs whose estimated training memory fits (`crate::admission`).
    pub memory_limit: Option<u64>,
}

impl WorkerEntry {
    /// `w-2 (127.0.0.1:7072)`: how errors name a worker.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.id, self.advertise_addr)
    }

    /// Whether it can take a command now (attached, not known to be gone).
    pub fn reachable(&self) -> bool {
        self.commands.is_some() && !self.disconnected
    }

    /// Sends it a command; false if its stream is full or closed.
    pub fn send(&self, command: worker_command::Command) -> bool {
        self.commands.as_ref().is_some_and(|tx| {
            tx.try_send(Ok(WorkerCommand {
                command: Some(command),
            }))
            .is_ok()
        })
    }
}

/// Workers and jobs.
#[derive(Debug, Default)]
pub struct Registry {
    /// Registered workers by id.
    pub workers: BTreeMap<String, WorkerEntry>,
    /// Jobs by id (`job-N` sorts by submission only within a width; `order` keeps FIFO).
    pub jobs: BTreeMap<String, Job>,
    /// Job ids in submission order.
    pub order: Vec<String>,
    /// Counter for worker ids.
    pub next_worker: u64,
    /// Counter for job ids.
    pub next_job: u64,
}

/// Shared state of a running coordinator.
#[derive(Debug)]
pub struct Shared {
    /// The registry.
    registry: Mutex<Registry>,
    /// Where jobs live.
    pub data_dir: PathBuf,
    /// The folders jobs may read from (`--input-root`; empty: anywhere).
    pub input_roots: InputRoots,
    /// Wakes the scheduler when something changed.
    pub wake: Notify,
}

impl Shared {
    /// The coordinator state over `data_dir`: the jobs saved there come back
    /// (`crate::persist::load_jobs`), and job numbers continue after the folders already there.
    /// A restored job that is not finished and names a path outside `input_roots` (they
    /// changed since it was submitted) is failed with the reason rather than prepared.
    pub fn new(data_dir: PathBuf, input_roots: InputRoots) -> Arc<Self> {
        let mut registry = Registry::default();
        if let Ok(entries) = std::fs::read_dir(data_dir.join("jobs")) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if let Some(n) = name
                    .strip_prefix("job-")
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    registry.next_job = registry.next_job.max(n);
                }
            }
        }
        for mut job in crate::persist::load_jobs(&data_dir.join("jobs")) {
            if !job.is_finished()
                && let Err(e) = input_roots.check_spec(&job.spec, &job.id)
            {
                tracing::error!(job = %job.id, "not restoring it: {e}");
                job.state = JobState::Failed;
                job.error = Some(format!("restored after a restart: {e}"));
                job.prepared = None;
                job.publish();
            }
            // Worker ids continue after those the restored jobs name (`w-3 (host:port)`), so
            // an old job's worker list never names a different, newer process.
            for name in &job.worker_names {
                if let Some(n) = name
                    .strip_prefix("w-")
                    .and_then(|rest| rest.split(' ').next())
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    registry.next_worker = registry.next_worker.max(n);
                }
            }
            registry.order.push(job.id.clone());
            registry.jobs.insert(job.id.clone(), job);
        }
        Arc::new(Shared {
            registry: Mutex::new(registry),
            data_dir,
            input_roots,
            wake: Notify::new(),
        })
    }

    /// Locks the registry. A panic while it was held poisons it; the state is still
    /// consistent field by field, so we carry on.
    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        match self.registry.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

impl Registry {
    /// The job `job_id`.
    ///
    /// Errors: [`CoordinatorError::UnknownJob`].
    pub fn job_mut(&mut self, job_id: &str) -> Result<&mut Job, CoordinatorError> {
        self.jobs
            .get_mut(job_id)
            .ok_or_else(|| CoordinatorError::UnknownJob {
                job_id: job_id.to_string(),
            })
    }

    /// Makes way for a worker registering with `addr`. Two live registrations with one
    /// address would be put in one ring, where each would take the other's frames, so one
    /// held by a live worker — attached or registering, not disconnected, heard from within
    /// [`LIVE_SILENCE`] — is refused. A registration that is no longer live (the worker's
    /// stream closed, or its heartbeats stopped: it crashed, or it restarts with the same
    /// address) is given up: marked disconnected, so the scheduler's next tick handles it
    /// as lost (recovery), and the new registration is accepted.
    ///
    /// Errors: [`CoordinatorError::AddressInUse`] naming the address and the live worker.
    pub fn claim_address(&mut self, addr: &str) -> Result<(), CoordinatorError> {
        for w in self.workers.values_mut() {
            if w.advertise_addr != addr || w.disconnected {
                continue;
            }
            if w.last_seen.elapsed() < LIVE_SILENCE {
                return Err(CoordinatorError::AddressInUse {
                    addr: addr.to_string(),
                    worker: w.describe(),
                });
            }
            tracing::warn!(worker = %w.describe(), silent_s = w.last_seen.elapsed().as_secs_f64(), "a new registration takes over its advertise address: the old one is dropped");
            w.disconnected = true;
        }
        Ok(())
    }

    /// Checks that a worker message is about the job's current generation.
    ///
    /// Errors: [`CoordinatorError::UnknownJob`], [`CoordinatorError::Stale`].
    pub fn check_key(&mut self, key: Option<&TrainingKey>) -> Result<&mut Job, CoordinatorError> {
        let key = key.ok_or_else(|| CoordinatorError::BadRequest("missing training key".into()))?;
        let job = self.job_mut(&key.job_id)?;
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

    /// Ends a job that is not finished yet: sets its state and error, tells its workers to
    /// drop it (CancelJob on their streams) and frees them.
    pub fn end_job(&mut self, job_id: &str, state: JobState, error: Option<String>) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if job.is_finished() {
            return;
        }
        job.state = state;
        if let Some(e) = &error {
            if state == JobState::Cancelled {
                tracing::warn!(job = job_id, "{e}");
            } else {
                tracing::error!(job = job_id, "{e}");
            }
        } else {
            tracing::info!(job = job_id, state = ?state, "job ended");
        }
        job.error = error.clone();
        job.publish();
        let key = TrainingKey {
            job_id: job.id.clone(),
            generation: job.generation,
            step: job.step,
        };
        let workers = job.workers.clone();
        for id in workers {
            if let Some(w) = self.workers.get_mut(&id) {
                if w.job.as_ref().is_some_and(|(j, _)| j == job_id) {
                    w.job = None;
                }
                if state != JobState::Completed
                    && let Some(tx) = &w.commands
                {
                    let cmd = WorkerCommand {
                        command: Some(worker_command::Command::Cancel(CancelJob {
                            key: Some(key.clone()),
                            reason: error.clone().unwrap_or_else(|| "job cancelled".into()),
                        })),
                    };
                    // A full or closed stream means the worker is gone or stuck; its heartbeat
                    // timeout deals with it.
                    let _ = tx.try_send(Ok(cmd));
                }
            }
        }
    }

    /// `rank 1 = w-2 (127.0.0.1:7072)` for every rank of a job: appended to failure messages
    /// so that a rank named by a ring error maps to a worker.
    pub fn describe_ranks(&self, job: &Job) -> String {
        job.workers
            .iter()
            .enumerate()
            .map(|(rank, id)| match self.workers.get(id) {
                Some(w) => format!("rank {rank} = {}", w.describe()),
                None => format!("rank {rank} = {id}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}
