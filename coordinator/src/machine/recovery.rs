//! A new generation after a loss (protocol step 14): a worker died or left, a ring link broke,
//! the coordinator restarted, or a new worker came to a job below `max_workers`.
//!
//! 1. **Suspend.** The job's generation goes up by one and it is `RECOVERING`. Every member
//!    (and, after a restart, every re-registered worker that says it holds the job) gets
//!    `Suspend{key(new generation)}`: it abandons the step in flight and keeps its replica —
//!    weights and optimizer state after its last completed step — in memory.
//! 2. **Collect.** Each answers `ReportHeld` with the step it holds. A member that does not
//!    answer within `peer_timeout_seconds` is dropped.
//! 3. **Form.** Once at least `min_workers` are available (members first, then idle workers,
//!    up to `max_workers`), the job restarts from the newest step any member holds: that
//!    member broadcasts its replica over the new ring to every rank that lacks it. With no
//!    replica left anywhere (every worker restarted), the job restarts from its newest intact
//!    stored checkpoint (the driver verifies them: [`Stage::Verifying`]), or from step 0
//!    without one. The data is re-split for the new world with the job's fixed global batch,
//!    so every step still trains on the same sequences with the same masks and dropout.
//!    Waiting for workers is bounded by `replacement_timeout_seconds`; recoveries by
//!    `max_recoveries`.
//!
//! With the world size of the uninterrupted run, the weights after resuming are bit for bit
//! those of the uninterrupted run (same data, same ring order of the sums). With a different
//! world size the ring sums the same gradients in another order, so they agree to rounding.

use super::phase::{Outcome, Phase, Regroup, Stage};
use super::{Effect, Launch, Machine};
use crate::layout;
use keel_proto::checkpoint::{MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE};
use keel_proto::metrics::{EventLine, MetricsLine, RegroupEvent};
use keel_proto::rpc::{StateSource, Suspend, TrainingKey, worker_command};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// After a coordinator restart, how long to wait for a job's workers to register again
/// (they retry at least every 2 s) before forming the ring with those that did.
pub(super) const GATHER_WINDOW: Duration = Duration::from_secs(5);

/// The longest wait before a recovery's generation starts.
pub(super) const MAX_RECOVERY_BACKOFF: Duration = Duration::from_secs(30);

/// How long the `streak`-th recovery in a row (with no step trained between them) waits
/// before its generation starts: none for the first, then 0.5 s doubling up to
/// [`MAX_RECOVERY_BACKOFF`]. Sixteen recoveries in a row then take over four minutes, not
/// one second.
pub(super) fn recovery_backoff(streak: u32) -> Duration {
    match streak {
        0 | 1 => Duration::ZERO,
        n => Duration::from_millis(500)
            .saturating_mul(1u32 << (n - 2).min(16))
            .min(MAX_RECOVERY_BACKOFF),
    }
}

/// Seconds to wait for `ReportHeld` answers (at least 2 s).
pub(super) fn collect_timeout(peer_timeout_seconds: f64) -> Duration {
    Duration::from_secs_f64(peer_timeout_seconds.max(2.0))
}

impl Machine {
    /// Starts a new generation of a running (or recovering) job: suspends its members, minus
    /// `lost`. `counts` says whether this is a recovery (bounded by `max_recoveries`) rather
    /// than growth; a job out of recoveries fails with `reason`.
    pub(super) fn begin_regroup(
        &mut self,
        now: Instant,
        job_id: &str,
        reason: String,
        lost: &[&str],
        counts: bool,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
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
                self.end_job(job_id, Outcome::Failed(message), now);
                return;
            }
            job.recoveries += 1;
            job.recovery_streak = job.recovery_streak.saturating_add(1);
        }
        let backoff = recovery_backoff(job.recovery_streak);
        let mut members = job.members();
        let started = match &job.phase {
            Phase::Recovering(r) => r.started,
            _ => now,
        };
        let last_world = match &job.phase {
            Phase::Running(r) => Some(r.workers.len()),
            Phase::Recovering(r) => r.last_world,
            _ => None,
        };
        job.generation += 1;
        let generation = job.generation;
        let step = job.step;
        let timeout = collect_timeout(job.spec.cluster.peer_timeout_seconds);
        // Re-registered workers that hold the job (after a restart or a broken session).
        for w in self.workers.values() {
            if w.job.is_none()
                && w.reachable()
                && w.holds.as_ref().is_some_and(|k| k.job_id == job_id)
                && !members.contains(&w.id)
            {
                members.push(w.id.clone());
            }
        }
        let asked = self.suspend(job_id, generation, step, &reason, &members, lost);
        if counts && !backoff.is_zero() {
            tracing::warn!(job = %job_id, generation, step, suspended = %asked.join(", "), "{reason}: forming a new generation in {backoff:?} (recovery back-off)");
        } else if counts {
            tracing::warn!(job = %job_id, generation, step, suspended = %asked.join(", "), "{reason}: forming a new generation");
        } else {
            tracing::info!(job = %job_id, generation, step, suspended = %asked.join(", "), "{reason}: forming a new generation");
        }
        let names = self.names_of(&asked);
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        job.worker_names = names;
        job.phase = Phase::Recovering(Regroup {
            generation,
            reason: reason.clone(),
            started,
            not_before: now + backoff,
            last_world,
            stage: Stage::Collecting {
                asked,
                held: BTreeMap::new(),
                until: now + timeout,
            },
        });
        self.publish(job_id, now);
        let event = RegroupEvent {
            generation,
            step,
            reason,
        };
        let event = if counts {
            EventLine::Recovery(event)
        } else {
            EventLine::Grow(event)
        };
        self.append_metrics(job_id, MetricsLine::Event(event));
    }

    /// Sends `Suspend` to `members` (minus `lost`) and reserves them for the job; returns
    /// those it reached.
    fn suspend(
        &mut self,
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
                if let Some(w) = self.workers.get_mut(id) {
                    w.job = None;
                }
                continue;
            }
            let command = worker_command::Command::Suspend(Suspend {
                key: Some(TrainingKey {
                    job_id: job_id.to_string(),
                    generation,
                    step,
                }),
                reason: reason.to_string(),
            });
            let sent = self.send(id, command);
            let Some(w) = self.workers.get_mut(id) else {
                continue;
            };
            if sent {
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

    /// A member of `job_id` is gone (`message` says who and why): the job recovers without
    /// it, or fails when it may not.
    pub(super) fn lost_worker(
        &mut self,
        now: Instant,
        job_id: &str,
        worker_id: &str,
        message: String,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        match &mut job.phase {
            Phase::Running(_) => self.begin_regroup(now, job_id, message, &[worker_id], true),
            Phase::Recovering(r) => {
                r.stage.remove(worker_id);
                let members = r.stage.members();
                tracing::warn!(job = %job_id, "{message}");
                let names = self.names_of(&members);
                if let Some(job) = self.jobs.get_mut(job_id) {
                    job.worker_names = names;
                }
                self.publish(job_id, now);
            }
            _ => {}
        }
        if let Some(w) = self.workers.get_mut(worker_id)
            && w.job.as_ref().is_some_and(|(j, _)| j == job_id)
        {
            w.job = None;
        }
    }

    /// Records `worker_id`'s answer to the Suspend of the generation being formed: the newest
    /// of `held_steps` the job can have (`crate::claims`). Whether it was asked.
    pub(super) fn record_held(
        &mut self,
        job_id: &str,
        generation: Option<u64>,
        worker_id: &str,
        held_steps: &[u64],
    ) -> bool {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return false;
        };
        let max_steps = job.spec.train.max_steps;
        if let Phase::Recovering(r) = &mut job.phase
            && generation.is_none_or(|g| g == r.generation)
            && let Stage::Collecting { asked, held, .. } = &mut r.stage
            && asked.iter().any(|w| w == worker_id)
        {
            let newest = crate::claims::within_last_step(worker_id, held_steps, max_steps);
            held.insert(worker_id.to_string(), newest);
            let shown = newest.map_or_else(|| "nothing".to_string(), |s| format!("step {s}"));
            tracing::info!(job = %job_id, worker = %worker_id, held = %shown, "held state reported");
            return true;
        }
        false
    }

    /// Advances every recovering job's regroup.
    pub(super) fn advance_regroups(&mut self, now: Instant) {
        for id in self.ids_where(|p| matches!(p, Phase::Recovering(_))) {
            self.advance(now, &id);
        }
    }

    /// One step of one recovering job's regroup.
    fn advance(&mut self, now: Instant, id: &str) {
        let Some(job) = self.jobs.get(id) else {
            return;
        };
        let Phase::Recovering(regroup) = &job.phase else {
            return;
        };
        let regroup = regroup.clone();
        let timeout = collect_timeout(job.spec.cluster.peer_timeout_seconds);
        match regroup.stage.clone() {
            Stage::Gathering { expected, until } => {
                let holders: Vec<String> = self
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
                let asked =
                    self.suspend(id, regroup.generation, step, &regroup.reason, &holders, &[]);
                self.set_stage(
                    id,
                    now,
                    Stage::Collecting {
                        asked,
                        held: BTreeMap::new(),
                        until: now + timeout,
                    },
                );
            }
            Stage::Collecting { asked, held, until } => {
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
                            if let Some(entry) = self.workers.get_mut(w) {
                                entry.job = None;
                            }
                        }
                    }
                }
                self.set_stage(
                    id,
                    now,
                    Stage::Forming {
                        members: members.clone(),
                    },
                );
                // Forming may start at once: no need to wait for the next tick.
                self.form(now, id, &regroup, members);
            }
            Stage::Forming { members } => self.form(now, id, &regroup, members),
            Stage::Verifying { .. } => {}
        }
    }

    /// Sets the stage of `id`'s regroup (and the worker names it shows).
    fn set_stage(&mut self, id: &str, now: Instant, stage: Stage) {
        let names = self.names_of(&stage.members());
        if let Some(job) = self.jobs.get_mut(id)
            && let Phase::Recovering(r) = &mut job.phase
        {
            r.stage = stage;
            job.worker_names = names;
        }
        self.publish(id, now);
    }

    /// Starts the new generation once enough workers are there, or fails the job once the
    /// wait for replacements is over.
    fn form(
        &mut self,
        now: Instant,
        id: &str,
        regroup: &Regroup,
        members: Vec<(String, Option<u64>)>,
    ) {
        if now < regroup.not_before {
            // The recovery back-off: the members wait, suspended, holding their state.
            return;
        }
        let members: Vec<(String, Option<u64>)> = members
            .into_iter()
            .filter(|(w, _)| self.workers.get(w).is_some_and(|w| w.reachable()))
            .collect();
        let idle = self.idle_workers(id);
        let Some(job) = self.jobs.get_mut(id) else {
            return;
        };
        if job.prepared.is_none() {
            return;
        }
        let cluster = &job.spec.cluster;
        let global_batch = if job.global_batch_size > 0 {
            job.global_batch_size
        } else {
            job.spec.global_batch(cluster.max_workers) as u64
        };
        // Every phase's global batch must leave each rank a row.
        let smallest = job.spec.smallest_global_batch(global_batch);
        let cap = cluster.max_workers.min(smallest as usize).max(1);
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
            let waited = now.saturating_duration_since(regroup.started).as_secs_f64();
            if waited > cluster.replacement_timeout_seconds {
                let message = format!(
                    "{}; {} worker(s) left, [cluster] min_workers = {}, and no replacement came \
                     within replacement_timeout_seconds = {}",
                    regroup.reason,
                    chosen.len(),
                    cluster.min_workers,
                    cluster.replacement_timeout_seconds
                );
                self.end_job(id, Outcome::Failed(message), now);
            }
            return;
        }
        job.global_batch_size = global_batch;
        // Members that answered the Suspend but do not fit under the cap (more holders came
        // back than the ring takes, e.g. after a restart gathered every holder) are let go:
        // `suspend` marked them as the job's, and nothing else would ever clear that, so they
        // stayed out of every ring, this job's and others', even after it ended.
        for (w, _) in &members {
            if !chosen.contains(w)
                && let Some(entry) = self.workers.get_mut(w)
                && entry.job.as_ref().is_some_and(|(j, _)| j == id)
            {
                entry.job = None;
            }
        }
        let Some(job) = self.jobs.get_mut(id) else {
            return;
        };
        let claims: Vec<(String, Option<u64>)> = members
            .iter()
            .filter(|(w, _)| chosen.contains(w))
            .cloned()
            .collect();
        let step_seconds = job.last_step.as_ref().map(|r| r.step_seconds);
        let lead = crate::claims::plausible_lead(
            now.saturating_duration_since(job.step_heard),
            step_seconds,
        );
        let mut newest = crate::claims::corroborated_newest(&claims, job.step, lead);
        // A sharded optimizer (`train.shard_optimizer`) left a share of its moments on each
        // rank of the last ring: memory holds the step only if every one of them does. With a
        // rank gone, go to the checkpoint at once (the ranks would find the share missing and
        // fail the generation, spending a recovery).
        if let (true, Some((step, _)), Some(world)) =
            (job.spec.train.shard_optimizer, &newest, regroup.last_world)
        {
            let holders = members.iter().filter(|(_, s)| *s == Some(*step)).count();
            if holders < world {
                tracing::info!(
                    job = %id,
                    step,
                    holders,
                    last_world = world,
                    "the sharded optimizer's shares of step {step} are held by {holders} of the \
                     last ring's {world} ranks: going on from the newest checkpoint"
                );
                newest = None;
            }
        }
        match newest {
            Some((step, root)) => {
                let root_rank = chosen.iter().position(|w| *w == root).unwrap_or(0) as u32;
                self.start_generation(
                    now,
                    id,
                    regroup.generation,
                    chosen,
                    StateSource::Memory,
                    step,
                    root_rank,
                );
            }
            None if !job.checkpoints.is_empty() => {
                // Reserve the chosen workers while the driver reads the checkpoints.
                for w in &chosen {
                    if let Some(entry) = self.workers.get_mut(w) {
                        let rank = entry.job.as_ref().map_or(0, |(_, r)| *r);
                        entry.job = Some((id.to_string(), rank));
                    }
                }
                let Some(job) = self.jobs.get_mut(id) else {
                    return;
                };
                self.effects.push(Effect::VerifyCheckpoints {
                    job_id: id.to_string(),
                    generation: regroup.generation,
                    dir: job.dir.clone(),
                    steps: job.checkpoints.clone(),
                });
                self.set_stage(id, now, Stage::Verifying { chosen });
            }
            None => {
                self.start_generation(now, id, regroup.generation, chosen, StateSource::Init, 0, 0)
            }
        }
    }

    /// The driver verified the stored checkpoints: the regroup starts from the newest intact
    /// one, or from step 0 without one.
    pub(super) fn checkpoints_verified(
        &mut self,
        now: Instant,
        id: &str,
        generation: u64,
        newest: Option<u64>,
    ) {
        let Some(job) = self.jobs.get(id) else {
            return;
        };
        let Phase::Recovering(Regroup {
            generation: g,
            stage: Stage::Verifying { chosen },
            ..
        }) = &job.phase
        else {
            return;
        };
        if *g != generation {
            return;
        }
        let chosen = chosen.clone();
        match newest {
            Some(step) => self.start_generation(
                now,
                id,
                generation,
                chosen,
                StateSource::Checkpoint,
                step,
                0,
            ),
            None => self.start_generation(now, id, generation, chosen, StateSource::Init, 0, 0),
        }
    }

    /// Launches generation `generation` of `id` on `chosen` from `source` at `start_step`.
    #[allow(clippy::too_many_arguments)]
    fn start_generation(
        &mut self,
        now: Instant,
        id: &str,
        generation: u64,
        chosen: Vec<String>,
        source: StateSource,
        start_step: u64,
        root_rank: u32,
    ) {
        let Some(job) = self.jobs.get(id) else {
            return;
        };
        let Some(prepared) = job.prepared.clone() else {
            return;
        };
        let t = &job.spec.train;
        let state_files = if source == StateSource::Checkpoint {
            let dir = layout::checkpoint_dir(&job.dir, start_step);
            vec![
                ("init_weights".to_string(), dir.join(MODEL_FILE)),
                ("init_optimizer".to_string(), dir.join(OPTIMIZER_FILE)),
                ("init_state".to_string(), dir.join(TRAINER_STATE_FILE)),
            ]
        } else {
            Vec::new()
        };
        let checkpoint_point = start_step == t.max_steps
            || (t.checkpoint_every > 0 && start_step.is_multiple_of(t.checkpoint_every));
        let checkpoint_first = source == StateSource::Memory
            && start_step > 0
            && checkpoint_point
            && !job.checkpoints.contains(&start_step);
        let launch = Launch {
            job_id: id.to_string(),
            spec: job.spec.clone(),
            dir: job.dir.clone(),
            generation,
            prepared,
            workers: chosen,
            start_step,
            source,
            root_rank,
            global_batch: job.global_batch_size,
            checkpoint_first,
            state_files,
        };
        self.launch_generation(now, launch);
    }
}
