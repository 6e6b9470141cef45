//! Membership: registration, the `Attach` stream, heartbeats, and workers declared dead.

use super::{Machine, Registration, Reply, StepTimes, WorkerEntry};
use crate::CoordinatorError;
use keel_proto::protocol::HEARTBEAT_TIMEOUT;
use keel_proto::rpc::TrainingKey;
use std::time::{Duration, Instant};

/// Silence after which a registration no longer holds its advertise address against a new
/// one: three heartbeat intervals. A worker that restarts on the same address is refused at
/// most this long (it retries every <= 2 s).
pub const LIVE_SILENCE: Duration = Duration::from_secs(3);

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
