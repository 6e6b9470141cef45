//! A new generation after a loss (protocol step 14): a worker died or left, a ring link broke,
//! the coordinator restarted, or a new worker came to a job below `max_workers`.
//!
//! 1. **Suspend.** The job's generation goes up by one and it is `RECOVERING`. Every member
//!    (and, after a restart, every re-registered worker that says it holds the job) gets
//!    `Suspend{key(new generation)}`: it abandons the step in flight (its pending all-reduce
//!    is aborted at once) and keeps its replica — weights and optimizer state after its last
//!    completed step — in memory.
//! 2. **Collect.** Each answers `ReportHeld` with the step it holds. A member that does not
//!    answer within `peer_timeout_seconds` is dropped.
//! 3. **Form.** Once at least `min_workers` are available (members first, then idle workers,
//!    up to `max_workers`), the job restarts from the newest step any member holds: that
//!    member broadcasts its replica over the new ring to every rank that lacks it (a new
//!    worker, or one a step behind because the ring broke during the last all-gather). Every
//!    replica that completed a step holds the same state, so nothing is rolled back further
//!    than the step in flight. With no replica left anywhere (every worker restarted), the
//!    job restarts from its last stored checkpoint, or from step 0 without one. The data is
//!    re-split for the new world with the job's fixed global batch
//!    (`WorkerPlan::with_global_batch`), so every step still trains on the same sequences
//!    with the same masks and dropout. Waiting for workers is bounded by
//!    `replacement_timeout_seconds`; recoveries by `max_recoveries`.
//!
//! With the world size of the uninterrupted run, the weights after resuming are bit for bit
//! those of the uninterrupted run (same data, same ring order of the sums). With a different
//! world size the ring sums the same gradients in another order, so they agree to rounding.

use crate::scheduler::{Launch, launch_generation, spawn_prepare};
use crate::state::{Registry, Shared};
use crate::store;
use keel_proto::checkpoint::{MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE};
use keel_proto::rpc::{HeldReport, JobState, StateSource, Suspend, TrainingKey, worker_command};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The generation being formed.
#[derive(Debug, Clone)]
pub struct Regroup {
    /// The new generation.
    pub generation: u64,
    /// Why (the first loss), for logs and the failure message.
    pub reason: String,
    /// When the job lost its ring (bounds the wait for replacements).
    pub started: Instant,
    /// Where it is.
    pub phase: Phase,
}

/// The phases of a regroup.
#[derive(Debug, Clone)]
pub enum Phase {
    /// After a coordinator restart: waiting until `expected` workers that hold the job have
    /// registered again, or until `until`.
    Gathering {
        /// Workers the job had.
        expected: usize,
        /// Give up waiting at.
        until: Instant,
    },
    /// `Suspend` sent to `asked`; their `ReportHeld` answers so far (`None`: holds nothing).
    Collecting {
        /// Workers suspended, in their old rank order.
        asked: Vec<String>,
        /// Answers: worker -> newest step held.
        held: BTreeMap<String, Option<u64>>,
        /// Stop waiting at.
        until: Instant,
    },
    /// Waiting for enough workers; `members` answered (worker, newest step held).
    Forming {
        /// The members, in their old rank order.
        members: Vec<(String, Option<u64>)>,
    },
}

/// After a coordinator restart, how long to wait for a job's workers to register again
/// (they retry at least every 2 s) before forming the ring with those that did.
const GATHER_WINDOW: Duration = Duration::from_secs(5);

/// Seconds to wait for `ReportHeld` answers (at least 2 s).
fn collect_timeout(peer_timeout_seconds: f64) -> Duration {
    Duration::from_secs_f64(peer_timeout_seconds.max(2.0))
}

/// Workers free for `job_id`, by registration order: attached, in no job, holding no state of
/// another job that is still going, with a memory limit that holds the job's estimate, and
/// not singled out by the progress watchdog as stalling this job.
pub fn idle_workers(reg: &Registry, job_id: &str) -> Vec<String> {
    let job = reg.jobs.get(job_id);
    let needed = job
        .and_then(|j| j.prepared.as_ref())
        .map(|p| p.memory_bytes);
    let mut idle: Vec<(u64, String)> = reg
        .workers
        .values()
        .filter(|w| w.job.is_none() && w.reachable())
        .filter(|w| crate::admission::fits(w, needed))
        .filter(|w| job.is_none_or(|j| !j.excluded.contains(&w.id)))
        .filter(|w| {
            w.holds.as_ref().is_none_or(|k| {
                k.job_id == job_id || reg.jobs.get(&k.job_id).is_none_or(|j| j.is_finished())
            })
        })
        .map(|w| (w.number, w.id.clone()))
        .collect();
    idle.sort();
    idle.into_iter().map(|(_, id)| id).collect()
}

/// Starts a new generation of a running (or recovering) job: suspends its members, minus
/// `lost`. `counts` says whether this is a recovery (bounded by `max_recoveries`) rather than
/// growth; a job out of recoveries fails with `reason`.
pub fn begin(reg: &mut Registry, job_id: &str, reason: String, lost: &[&str], counts: bool) {
    let Some(job) = reg.jobs.get_mut(job_id) else {
        return;
    };
    if job.is_finished() {
        return;
    }
    if counts {
        let max = job.spec.cluster.max_recoveries;
        if job.recoveries >= max {
            let message = if max == 0 {
                reason
            } else {
                format!("{reason}; giving up: [cluster] max_recoveries = {max} reached")
            };
            reg.end_job(job_id, JobState::Failed, Some(message));
            return;
        }
        job.recoveries += 1;
    }
    let mut members: Vec<String> = job.workers.clone();
    if let Some(Regroup {
        phase: Phase::Forming { members: m },
        ..
    }) = &job.regroup
    {
        members.extend(m.iter().map(|(w, _)| w.clone()));
    }
    let started = job
        .regroup
        .as_ref()
        .map_or_else(Instant::now, |r| r.started);
    job.generation += 1;
    let generation = job.generation;
    let step = job.step;
    let timeout = collect_timeout(job.spec.cluster.peer_timeout_seconds);
    // Re-registered workers that hold the job (after a restart or a broken session).
    for w in reg.workers.values() {
        if w.job.is_none()
            && w.reachable()
            && w.holds.as_ref().is_some_and(|k| k.job_id == job_id)
            && !members.contains(&w.id)
        {
            members.push(w.id.clone());
        }
    }
    let asked = suspend(reg, job_id, generation, step, &reason, &members, lost);
    if counts {
        tracing::warn!(job = %job_id, generation, step, suspended = %asked.join(", "), "{reason}: forming a new generation");
    } else {
        tracing::info!(job = %job_id, generation, step, suspended = %asked.join(", "), "{reason}: forming a new generation");
    }
    let names = names_of(reg, &asked);
    let Some(job) = reg.jobs.get_mut(job_id) else {
        return;
    };
    job.workers = asked.clone();
    job.worker_names = names;
    let Some(job) = reg.jobs.get_mut(job_id) else {
        return;
    };
    job.state = JobState::Recovering;
    job.regroup = Some(Regroup {
        generation,
        reason: reason.clone(),
        started,
        phase: Phase::Collecting {
            asked,
            held: BTreeMap::new(),
            until: Instant::now() + timeout,
        },
    });
    job.publish();
    crate::service::append_metrics(
        job,
        serde_json::json!({
            "event": if counts { "recovery" } else { "grow" },
            "generation": generation,
            "step": step,
            "reason": reason,
        }),
    );
}

/// Sends `Suspend` to `members` (minus `lost`) and reserves them for the job; returns those
/// it reached.
fn suspend(
    reg: &mut Registry,
    job_id: &str,
    generation: u64,
    step: u64,
    reason: &str,
    members: &[String],
    lost: &[&str],
) -> Vec<String> {
    let mut asked = Vec::new();
    for id in members {
        if lost.contains(&id.as_str()) {
            if let Some(w) = reg.workers.get_mut(id) {
                w.job = None;
            }
            continue;
        }
        let Some(w) = reg.workers.get_mut(id) else {
            continue;
        };
        let command = worker_command::Command::Suspend(Suspend {
            key: Some(TrainingKey {
                job_id: job_id.to_string(),
                generation,
                step,
            }),
            reason: reason.to_string(),
        });
        if w.reachable() && w.send(command) {
            let rank = w.job.as_ref().map_or(0, |(_, r)| *r);
            w.job = Some((job_id.to_string(), rank));
            if !asked.contains(id) {
                asked.push(id.clone());
            }
        } else {
            w.job = None;
        }
    }
    asked
}

/// A member of `job_id` is gone (`message` says who and why): the job recovers without it,
/// or fails when it may not.
pub fn lost_worker(reg: &mut Registry, job_id: &str, worker_id: &str, message: String) {
    let Some(job) = reg.jobs.get_mut(job_id) else {
        return;
    };
    match job.state {
        JobState::Running => begin(reg, job_id, message, &[worker_id], true),
        JobState::Recovering => {
            job.workers.retain(|w| w != worker_id);
            match job.regroup.as_mut().map(|r| &mut r.phase) {
                Some(Phase::Collecting { asked, held, .. }) => {
                    asked.retain(|w| w != worker_id);
                    held.remove(worker_id);
                }
                Some(Phase::Forming { members }) => members.retain(|(w, _)| w != worker_id),
                _ => {}
            }
            tracing::warn!(job = %job_id, "{message}");
        }
        _ => {}
    }
    if let Some(w) = reg.workers.get_mut(worker_id)
        && w.job.as_ref().is_some_and(|(j, _)| j == job_id)
    {
        w.job = None;
    }
}

/// Records a `ReportHeld` answer.
///
/// Errors: `UnknownJob`, `BadRequest` (no key), `Stale` (not the generation being formed).
pub fn held_reported(
    reg: &mut Registry,
    report: HeldReport,
) -> Result<(), crate::CoordinatorError> {
    let key = report
        .key
        .ok_or_else(|| crate::CoordinatorError::BadRequest("missing training key".into()))?;
    let job = reg.job_mut(&key.job_id)?;
    let stale = |message: String| crate::CoordinatorError::Stale {
        job_id: key.job_id.clone(),
        message,
    };
    match job.regroup.as_mut() {
        Some(r) if r.generation == key.generation => match &mut r.phase {
            Phase::Collecting { asked, held, .. } if asked.contains(&report.worker_id) => {
                let newest = crate::claims::trusted_newest(
                    &report.worker_id,
                    &report.held_steps,
                    job.spec.train.max_steps,
                );
                held.insert(report.worker_id.clone(), newest);
                let held = newest.map_or_else(|| "nothing".to_string(), |s| format!("step {s}"));
                tracing::info!(job = %key.job_id, worker = %report.worker_id, %held, "held state reported");
                Ok(())
            }
            _ => Err(stale(format!(
                "worker {} was not asked for its state in generation {}",
                report.worker_id, key.generation
            ))),
        },
        _ => Err(stale(format!(
            "generation {} is not being formed (current: {})",
            key.generation, job.generation
        ))),
    }
}

/// Records `held_steps`, sent by `worker_id` with its failure report, as its answer to the
/// Suspend of the generation being formed for `job_id` (if it was asked), so the new generation
/// need not wait for a worker that already said what it holds.
pub fn held_with_failure(reg: &mut Registry, job_id: &str, worker_id: &str, held_steps: &[u64]) {
    let Some(job) = reg.jobs.get_mut(job_id) else {
        return;
    };
    let max_steps = job.spec.train.max_steps;
    if let Some(Regroup {
        phase: Phase::Collecting { asked, held, .. },
        ..
    }) = job.regroup.as_mut()
        && asked.iter().any(|w| w == worker_id)
    {
        let newest = crate::claims::trusted_newest(worker_id, held_steps, max_steps);
        held.insert(worker_id.to_string(), newest);
        tracing::info!(job = %job_id, worker = %worker_id, held = ?newest, "held state reported with the failure");
    }
}

/// A job below `max_workers` with an idle worker about grows by a new generation (one job
/// per call, in submission order).
pub fn grow_running_jobs(reg: &mut Registry) {
    let running: Vec<String> = reg
        .order
        .iter()
        .filter(|id| {
            reg.jobs.get(*id).is_some_and(|j| {
                let cap = j
                    .spec
                    .cluster
                    .max_workers
                    .min(j.global_batch_size.max(1) as usize);
                j.state == JobState::Running && j.workers.len() < cap
            })
        })
        .cloned()
        .collect();
    for id in running {
        if let Some(newcomer) = idle_workers(reg, &id).first()
            && let Some(w) = reg.workers.get(newcomer)
        {
            let reason = format!("{} joined: growing the ring", w.describe());
            begin(reg, &id, reason, &[], false);
            return;
        }
    }
}

/// Advances every recovering job (called by the scheduler loop).
pub fn tick(shared: &Arc<Shared>) {
    let mut reg = shared.lock();
    let recovering: Vec<String> = reg
        .order
        .iter()
        .filter(|id| {
            reg.jobs
                .get(*id)
                .is_some_and(|j| j.state == JobState::Recovering)
        })
        .cloned()
        .collect();
    for id in recovering {
        advance(shared, &mut reg, &id);
    }
}

/// One step of one recovering job's regroup.
fn advance(shared: &Arc<Shared>, reg: &mut Registry, id: &str) {
    let Some(job) = reg.jobs.get_mut(id) else {
        return;
    };
    let now = Instant::now();
    let timeout = collect_timeout(job.spec.cluster.peer_timeout_seconds);
    let Some(regroup) = job.regroup.clone() else {
        // Restored after a coordinator restart.
        if job.generation == 0 {
            // It never had a ring: it was only waiting for workers.
            job.state = if job.prepared.is_some() {
                JobState::WaitingForWorkers
            } else {
                JobState::Queued
            };
            job.publish();
            return;
        }
        // Prepare the data again (the prepared folder is reused) and give the workers a few
        // seconds to register again (they retry every <= 2 s) and say what they hold.
        job.generation += 1;
        job.regroup = Some(Regroup {
            generation: job.generation,
            reason: "the coordinator restarted".into(),
            started: now,
            phase: Phase::Gathering {
                expected: job.worker_names.len().max(1),
                until: now + timeout.min(GATHER_WINDOW),
            },
        });
        job.publish();
        if job.prepared.is_none() {
            let (spec, dir) = (job.spec.clone(), job.dir.clone());
            spawn_prepare(shared, id.to_string(), spec, dir, JobState::Recovering);
        }
        return;
    };
    match regroup.phase.clone() {
        Phase::Gathering { expected, until } => {
            let holders: Vec<String> = reg
                .workers
                .values()
                .filter(|w| {
                    w.job.is_none()
                        && w.reachable()
                        && w.holds.as_ref().is_some_and(|k| k.job_id == id)
                })
                .map(|w| w.id.clone())
                .collect();
            if holders.len() < expected && now < until {
                return;
            }
            let step = job.step;
            let asked = suspend(
                reg,
                id,
                regroup.generation,
                step,
                &regroup.reason,
                &holders,
                &[],
            );
            if let Some(job) = reg.jobs.get_mut(id) {
                job.workers = asked.clone();
                if let Some(r) = job.regroup.as_mut() {
                    r.phase = Phase::Collecting {
                        asked,
                        held: BTreeMap::new(),
                        until: now + timeout,
                    };
                }
            }
        }
        Phase::Collecting { asked, held, until } => {
            let answered = asked.iter().all(|w| held.contains_key(w));
            if !answered && now < until {
                return;
            }
            let mut members = Vec::new();
            for w in &asked {
                match held.get(w) {
                    Some(step) => members.push((w.clone(), *step)),
                    None => {
                        tracing::warn!(job = %id, worker = %w, "no answer to Suspend: dropping it from the job");
                        if let Some(entry) = reg.workers.get_mut(w) {
                            entry.job = None;
                        }
                    }
                }
            }
            if let Some(job) = reg.jobs.get_mut(id) {
                job.workers = members.iter().map(|(w, _)| w.clone()).collect();
                if let Some(r) = job.regroup.as_mut() {
                    r.phase = Phase::Forming { members };
                }
            }
            shared.wake.notify_one();
        }
        Phase::Forming { members } => form(shared, reg, id, &regroup, members),
    }
}

/// Starts the new generation once enough workers are there, or fails the job once the wait
/// for replacements is over.
fn form(
    shared: &Arc<Shared>,
    reg: &mut Registry,
    id: &str,
    regroup: &Regroup,
    members: Vec<(String, Option<u64>)>,
) {
    let members: Vec<(String, Option<u64>)> = members
        .into_iter()
        .filter(|(w, _)| reg.workers.get(w).is_some_and(|w| w.reachable()))
        .collect();
    let idle = idle_workers(reg, id);
    let Some(job) = reg.jobs.get(id) else {
        return;
    };
    let Some(prepared) = job.prepared.clone() else {
        return;
    };
    let cluster = &job.spec.cluster;
    let global_batch = if job.global_batch_size > 0 {
        job.global_batch_size
    } else {
        job.spec.global_batch(cluster.max_workers) as u64
    };
    let cap = cluster.max_workers.min(global_batch as usize).max(1);
    let mut chosen: Vec<String> = members.iter().map(|(w, _)| w.clone()).take(cap).collect();
    for w in idle {
        if chosen.len() >= cap {
            break;
        }
        if !chosen.contains(&w) {
            chosen.push(w);
        }
    }
    if chosen.len() < cluster.min_workers.max(1) {
        let waited = regroup.started.elapsed().as_secs_f64();
        if waited > cluster.replacement_timeout_seconds {
            let message = format!(
                "{}; {} worker(s) left, [cluster] min_workers = {}, and no replacement came within \
                 replacement_timeout_seconds = {}",
                regroup.reason,
                chosen.len(),
                cluster.min_workers,
                cluster.replacement_timeout_seconds
            );
            reg.end_job(id, JobState::Failed, Some(message));
        }
        return;
    }
    let newest = members
        .iter()
        .filter(|(w, _)| chosen.contains(w))
        .filter_map(|(w, s)| s.map(|s| (s, w.clone())))
        .max_by_key(|(s, _)| *s);
    let t = &job.spec.train;
    let (source, start_step, root_rank, state_files) = match newest {
        Some((step, root)) => (
            StateSource::Memory,
            step,
            chosen.iter().position(|w| *w == root).unwrap_or(0) as u32,
            Vec::new(),
        ),
        None => match newest_intact_checkpoint(job) {
            Some(step) => {
                let dir = store::checkpoint_dir(&job.dir, step);
                (
                    StateSource::Checkpoint,
                    step,
                    0,
                    vec![
                        ("init_weights".to_string(), dir.join(MODEL_FILE)),
                        ("init_optimizer".to_string(), dir.join(OPTIMIZER_FILE)),
                        ("init_state".to_string(), dir.join(TRAINER_STATE_FILE)),
                    ],
                )
            }
            None => (StateSource::Init, 0, 0, Vec::new()),
        },
    };
    let checkpoint_point = start_step == t.max_steps
        || (t.checkpoint_every > 0 && start_step.is_multiple_of(t.checkpoint_every));
    let checkpoint_first = source == StateSource::Memory
        && start_step > 0
        && checkpoint_point
        && !job.checkpoints.contains(&start_step);
    let launch = Launch {
        job_id: id.to_string(),
        generation: regroup.generation,
        prepared,
        workers: chosen,
        start_step,
        source,
        root_rank,
        global_batch,
        checkpoint_first,
        state_files,
    };
    if let Some(job) = reg.jobs.get_mut(id) {
        job.global_batch_size = global_batch;
    }
    launch_generation(shared, reg, launch);
}

/// The newest stored checkpoint of `job` whose files match its manifest (a damaged one is
/// logged, naming the file, and passed over). Reads every file: only used when no worker holds
/// the job's state any more.
fn newest_intact_checkpoint(job: &crate::job::Job) -> Option<u64> {
    job.checkpoints.iter().rev().copied().find(|&step| {
        let dir = store::checkpoint_dir(&job.dir, step);
        match keel_proto::checkpoint::verify_dir(&dir) {
            Ok(Some(_)) => true,
            Ok(None) => {
                tracing::error!(job = %job.id, dir = %dir.display(), "checkpoint has no manifest.json: not resuming from it");
                false
            }
            Err(e) => {
                tracing::error!(job = %job.id, "checkpoint of step {step} is damaged, not resuming from it: {e}");
                false
            }
        }
    })
}

/// `w-2 (127.0.0.1:7072)` for each worker id (the id alone if it is gone).
fn names_of(reg: &Registry, ids: &[String]) -> Vec<String> {
    ids.iter()
        .map(|id| {
            reg.workers
                .get(id)
                .map_or_else(|| id.clone(), |w| w.describe())
        })
        .collect()
}
