//! Membership: registration, the `Attach` stream, heartbeats, and workers declared dead.

use super::{Machine, Registration, Reply};
use crate::CoordinatorError;
use keel_proto::protocol::HEARTBEAT_TIMEOUT;
use keel_proto::rpc::TrainingKey;
use std::time::{Duration, Instant};

/// Silence after which a registration no longer holds its advertise address against a new
/// one: three heartbeat intervals. A worker that restarts on the same address is refused at
/// most this long (it retries every <= 2 s).
pub const LIVE_SILENCE: Duration = Duration::from_secs(3);

/// A registered worker.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    /// `w-N`, in registration order.
    pub(super) id: String,
    /// Registration number: orders ranks.
    pub(super) number: u64,
    /// host:port its ring peers reach it at.
    pub(super) advertise_addr: String,
    /// Whether it has native bf16 GEMMs that pay (what it reported at registration).
    pub(super) bf16_native: bool,
    /// Its reason for `bf16_native`.
    pub(super) bf16_detail: String,
    /// Last heartbeat (or registration).
    pub(super) last_seen: Instant,
    /// The job it works on, with its rank.
    pub(super) job: Option<(String, u32)>,
    /// Steps completed in that job, as last heartbeated.
    pub(super) step: u64,
    /// The generation of that job its heartbeats last named (0: none since it was given the
    /// job): the progress watchdog tells a member that never started a generation by it.
    pub(super) generation: u64,
    /// The number of its open `Attach` stream; `None` until attached.
    pub(super) attach: Option<u64>,
    /// Set when its stream closed or a command could not be put on it: it is treated as dead
    /// at the next tick.
    pub(super) disconnected: bool,
    /// What it said at registration that it holds in memory: `(job, generation, step)`.
    pub(super) holds: Option<TrainingKey>,
    /// Bytes of memory it can use (`None` from workers older than the field).
    pub(super) memory_limit: Option<u64>,
    /// Its last training step's times, as last heartbeated (`None` before its first step).
    pub(super) step_times: Option<StepTimes>,
}

/// A worker's last training step, as its heartbeat tells it (the dashboard's ring table).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// The step's wall time, seconds.
    pub step_seconds: f64,
    /// The part of it spent waiting for the summed gradient after the backward pass, seconds.
    pub ring_wait_seconds: f64,
}

impl StepTimes {
    /// From a heartbeat's fields: `None` when the worker has not trained (0) or sent
    /// something that is not a time (negative, not finite).
    pub fn from_heartbeat(step_seconds: f64, ring_wait_seconds: f64) -> Option<StepTimes> {
        let ok = |s: f64| s.is_finite() && s >= 0.0;
        (step_seconds > 0.0 && ok(step_seconds) && ok(ring_wait_seconds)).then_some(StepTimes {
            step_seconds,
            ring_wait_seconds,
        })
    }
}

impl WorkerEntry {
    /// `w-2 (127.0.0.1:7072)`: how errors name a worker.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.id, self.advertise_addr)
    }

    /// host:port its ring peers reach it at.
    pub fn advertise_addr(&self) -> &str {
        &self.advertise_addr
    }

    /// Whether it can take a command now (attached, not known to be gone).
    pub fn reachable(&self) -> bool {
        self.attach.is_some() && !self.disconnected
    }

    /// `w-N`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The job it works on and its rank there.
    pub fn job(&self) -> Option<(&str, u32)> {
        self.job.as_ref().map(|(j, r)| (j.as_str(), *r))
    }

    /// Steps completed in its job and the generation, as last heartbeated.
    pub fn progress(&self) -> (u64, u64) {
        (self.step, self.generation)
    }

    /// When it was last heard from (machine time).
    pub fn last_seen(&self) -> Instant {
        self.last_seen
    }

    /// Its last training step's times (`None` before its first step).
    pub fn step_times(&self) -> Option<StepTimes> {
        self.step_times
    }
}

impl Machine {
    /// Registers a worker, after making way for it on its advertise address: a live
    /// registration there (attached or registering, not disconnected, heard from within
    /// [`LIVE_SILENCE`]) refuses it, a silent one is dropped (marked disconnected: the next
    /// tick handles it as lost).
    ///
    /// Errors: [`CoordinatorError::AddressInUse`] naming the address and the live worker.
    pub(super) fn register(
        &mut self,
        now: Instant,
        r: Registration,
    ) -> Result<Reply, CoordinatorError> {
        for w in self.workers.values_mut() {
            if w.advertise_addr != r.advertise_addr || w.disconnected {
                continue;
            }
            let silent = now.saturating_duration_since(w.last_seen);
            if silent < LIVE_SILENCE {
                return Err(CoordinatorError::AddressInUse {
                    addr: r.advertise_addr.clone(),
                    worker: w.describe(),
                });
            }
            tracing::warn!(worker = %w.describe(), silent_s = silent.as_secs_f64(), "a new registration takes over its advertise address: the old one is dropped");
            w.disconnected = true;
        }
        self.next_worker += 1;
        let number = self.next_worker;
        let id = format!("w-{number}");
        let entry = WorkerEntry {
            id: id.clone(),
            number,
            advertise_addr: r.advertise_addr,
            bf16_native: r.bf16_native,
            bf16_detail: r.bf16_detail,
            last_seen: now,
            job: None,
            step: 0,
            generation: 0,
            attach: None,
            disconnected: false,
            holds: r.holds.filter(|k| !k.job_id.is_empty()),
            memory_limit: r.memory_limit,
            step_times: None,
        };
        // Fields without a value (no host name sent, nothing held) are left out of the line.
        let host = (!r.hostname.is_empty()).then(|| tracing::field::debug(&r.hostname));
        let holds = entry.holds.as_ref().map(|k| {
            tracing::field::display(format!(
                "{} generation {} step {}",
                k.job_id, k.generation, k.step
            ))
        });
        tracing::info!(worker = %entry.describe(), threads = r.threads, bf16_native = entry.bf16_native, bf16 = ?entry.bf16_detail, host, holds, "worker registered");
        self.workers.insert(id.clone(), entry);
        Ok(Reply::Registered { worker_id: id })
    }

    /// A worker's `Attach` stream numbered `attach` opened.
    ///
    /// Errors: [`CoordinatorError::UnknownWorker`].
    pub(super) fn attached(
        &mut self,
        now: Instant,
        worker_id: &str,
        attach: u64,
    ) -> Result<Reply, CoordinatorError> {
        let w = self
            .workers
            .get_mut(worker_id)
            .ok_or_else(|| CoordinatorError::UnknownWorker {
                worker_id: worker_id.to_string(),
            })?;
        w.attach = Some(attach);
        w.last_seen = now;
        Ok(Reply::None)
    }

    /// A worker's stream numbered `attach` closed: the process died or its link broke. It is
    /// treated as dead at the next tick rather than after the heartbeat timeout. A stream
    /// replaced by a newer one is ignored.
    pub(super) fn detached(&mut self, worker_id: &str, attach: u64) {
        if let Some(w) = self.workers.get_mut(worker_id)
            && w.attach == Some(attach)
        {
            tracing::warn!(worker = %w.describe(), "command stream closed");
            w.disconnected = true;
        }
    }

    /// A command could not be put on the worker's stream: it is gone or stuck.
    pub(super) fn unreachable(&mut self, worker_id: &str) {
        if let Some(w) = self.workers.get_mut(worker_id)
            && !w.disconnected
        {
            tracing::warn!(worker = %w.describe(), "its command stream is full or closed");
            w.disconnected = true;
        }
    }

    /// A heartbeat: the worker is alive; a member's step counts as its job's progress (its
    /// step reports may be queued behind a checkpoint upload).
    pub(super) fn heartbeat(
        &mut self,
        now: Instant,
        worker_id: &str,
        key: Option<TrainingKey>,
        times: Option<StepTimes>,
    ) -> Reply {
        let Some(w) = self.workers.get_mut(worker_id) else {
            return Reply::Known(false);
        };
        w.last_seen = now;
        if times.is_some() {
            w.step_times = times;
        }
        if let Some(key) = key
            && w.job.as_ref().is_some_and(|(j, _)| *j == key.job_id)
        {
            w.step = key.step;
            w.generation = key.generation;
            if let Some(job) = self.jobs.get_mut(&key.job_id)
                && job.generation == key.generation
                && let super::Phase::Running(r) = &mut job.phase
            {
                r.progress.note_step(key.step, now);
            }
        }
        Reply::Known(true)
    }

    /// Removes workers whose heartbeat is older than their timeout (the job's
    /// `peer_timeout_seconds`, else [`HEARTBEAT_TIMEOUT`]) or whose stream closed; a job
    /// they were in recovers without them (or fails).
    pub(super) fn reap_dead_workers(&mut self, now: Instant) {
        let mut dead = Vec::new();
        for w in self.workers.values() {
            let timeout = match &w.job {
                Some((job_id, _)) => self.jobs.get(job_id).map_or(HEARTBEAT_TIMEOUT, |j| {
                    Duration::from_secs_f64(j.spec.cluster.peer_timeout_seconds.max(1.0))
                }),
                None => HEARTBEAT_TIMEOUT,
            };
            let silent = now.saturating_duration_since(w.last_seen);
            if silent > timeout || w.disconnected {
                let why = if w.disconnected {
                    "disconnected (its command stream closed)".to_string()
                } else {
                    format!("sent no heartbeat for {:.1} s", silent.as_secs_f64())
                };
                // The heartbeat's step lags; the job's (rank 0's reports) is fresher.
                let step = w
                    .job
                    .as_ref()
                    .and_then(|(j, _)| self.jobs.get(j))
                    .map_or(w.step, |j| j.step.max(w.step));
                dead.push((w.id.clone(), w.describe(), w.job.clone(), step, why));
            }
        }
        for (id, describe, job, step, why) in dead {
            tracing::warn!(worker = %describe, "{why}: removing it");
            self.workers.remove(&id);
            if let Some((job_id, rank)) = job {
                let message = format!(
                    "worker {describe}, rank {rank}, {why}; its last reported step was {step}"
                );
                self.lost_worker(now, &job_id, &id, message);
            }
        }
    }

    /// Workers free for `job_id`, by registration order: attached, in no job, holding no
    /// state of another job that is still going, with a memory limit that holds the job's
    /// estimate, and not singled out by the progress watchdog as stalling this job.
    pub(super) fn idle_workers(&self, job_id: &str) -> Vec<String> {
        let job = self.jobs.get(job_id);
        let needed = job
            .and_then(|j| j.prepared.as_ref())
            .map(|p| p.memory_bytes);
        let mut idle: Vec<(u64, String)> = self
            .workers
            .values()
            .filter(|w| w.job.is_none() && w.reachable())
            .filter(|w| crate::admission::fits(w.memory_limit, needed))
            .filter(|w| job.is_none_or(|j| !j.excluded.contains(&w.advertise_addr)))
            .filter(|w| {
                w.holds.as_ref().is_none_or(|k| {
                    k.job_id == job_id || self.jobs.get(&k.job_id).is_none_or(|j| j.is_finished())
                })
            })
            .map(|w| (w.number, w.id.clone()))
            .collect();
        idle.sort();
        idle.into_iter().map(|(_, id)| id).collect()
    }
}
