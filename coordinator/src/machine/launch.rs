//! Preparing queued jobs, forming a job's first ring, growing a running job, and starting a
//! generation: the machine asks the driver for the generation's files ([`Launch`]), then
//! sends every rank its `StartJob` once they are built ([`Input::FilesBuilt`]).
//!
//! [`Input::FilesBuilt`]: super::Input::FilesBuilt

use super::phase::{LaunchInfo, Outcome, Phase, Progress, Running};
use super::{Effect, Launch, Machine, RankFiles};
use crate::prepare_job::PreparedJob;
use keel_proto::metrics::{EventLine, MetricsLine, ResumeEvent};
use keel_proto::precision::WorkerBf16;
use keel_proto::protocol::FILE_CHUNK_BYTES;
use keel_proto::rpc::{StartJob, StateSource, TrainingKey, worker_command};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

/// Ring connections per link that workers open (several streams beat one on loopback).
const STREAMS_PER_LINK: u32 = 2;

impl Machine {
    /// Starts preparing every queued job.
    pub(super) fn start_preparing(&mut self, now: Instant) {
        for id in self.ids_where(|p| matches!(p, Phase::Queued)) {
            let Some(job) = self.jobs.get_mut(&id) else {
                continue;
            };
            if !job.is_recorded() {
                // Its submission is answered once its record is on disk, or withdrawn:
                // nothing starts for a job a restart would not know.
                continue;
            }
            job.phase = Phase::Preparing;
            let effect = Effect::Prepare {
                job_id: id.clone(),
                spec: Box::new(job.spec.clone()),
                dir: job.dir.clone(),
            };
            self.publish(&id, now);
            self.effects.push(effect);
        }
    }

    /// A preparation ended: a preparing job waits for workers; a recovering one (restored
    /// after a restart) keeps recovering with its data; a failure fails the job.
    pub(super) fn prepared(
        &mut self,
        now: Instant,
        job_id: &str,
        result: Result<Arc<PreparedJob>, String>,
    ) {
        match result {
            Ok(prepared) => {
                let Some(job) = self.jobs.get_mut(job_id) else {
                    return;
                };
                if !matches!(job.phase, Phase::Preparing | Phase::Recovering(_)) {
                    return;
                }
                tracing::info!(job = %job_id, sequences = prepared.total_sequences, "prepared");
                job.prepared = Some(prepared);
                if matches!(job.phase, Phase::Preparing) {
                    job.phase = Phase::Waiting;
                }
                self.publish(job_id, now);
            }
            Err(e) => self.end_job(job_id, Outcome::Failed(e), now),
        }
    }

    /// Gives waiting jobs (in submission order) idle, attached workers once `min_workers` are
    /// free; with no job waiting, a running job below `max_workers` grows by a new generation.
    pub(super) fn assign_workers(&mut self, now: Instant) {
        let waiting = self.ids_where(|p| matches!(p, Phase::Waiting));
        if waiting.is_empty() {
            self.grow_running_jobs(now);
            return;
        }
        for id in waiting {
            let needed = self
                .jobs
                .get(&id)
                .and_then(|j| j.prepared.as_ref())
                .map(|p| p.memory_bytes);
            if let Some(reason) =
                needed.and_then(|n| crate::admission::no_worker_can_hold(self.memory_limits(), n))
            {
                // Assigning it would only make every worker fail (or abort) on it, again and again.
                self.end_job(&id, Outcome::Failed(reason), now);
                continue;
            }
            let idle = self.idle_workers(&id);
            let Some(job) = self.jobs.get_mut(&id) else {
                continue;
            };
            let (min, max) = (job.spec.cluster.min_workers, job.spec.cluster.max_workers);
            if idle.len() < min.max(1) {
                continue;
            }
            let Some(prepared) = job.prepared.clone() else {
                continue;
            };
            let chosen: Vec<String> = idle.into_iter().take(max.max(1)).collect();
            job.generation += 1;
            job.global_batch_size = job.spec.global_batch(chosen.len()) as u64;
            let launch = Launch {
                job_id: id.clone(),
                spec: job.spec.clone(),
                dir: job.dir.clone(),
                generation: job.generation,
                prepared,
                workers: chosen,
                start_step: 0,
                source: StateSource::Init,
                root_rank: 0,
                global_batch: job.global_batch_size,
                checkpoint_first: false,
                state_files: Vec::new(),
            };
            self.launch_generation(now, launch);
        }
    }

    /// A running job below `max_workers` (and its global batch) with an idle worker about
    /// grows by a new generation (one job per call, in submission order).
    fn grow_running_jobs(&mut self, now: Instant) {
        let running: Vec<String> = self
            .order
            .iter()
            .filter(|id| {
                self.jobs.get(*id).is_some_and(|j| {
                    // Every phase's global batch must leave each rank a row.
                    let batch = j.spec.smallest_global_batch(j.global_batch_size.max(1));
                    let cap = j.spec.cluster.max_workers.min(batch as usize);
                    matches!(&j.phase, Phase::Running(r) if r.workers.len() < cap)
                })
            })
            .cloned()
            .collect();
        for id in running {
            if let Some(newcomer) = self.idle_workers(&id).first()
                && let Some(w) = self.workers.get(newcomer)
            {
                let reason = format!("{} joined: growing the ring", w.describe());
                self.begin_regroup(now, &id, reason, &[], false);
                return;
            }
        }
    }

    /// Marks the job running with `launch.workers` and asks the driver to build their files.
    pub(super) fn launch_generation(&mut self, now: Instant, launch: Launch) {
        let id = launch.job_id.clone();
        let mut names = Vec::new();
        for (rank, wid) in launch.workers.iter().enumerate() {
            if let Some(w) = self.workers.get_mut(wid) {
                w.job = Some((id.clone(), rank as u32));
                w.step = launch.start_step;
                w.generation = 0;
                w.holds = None;
                names.push(w.describe());
            }
        }
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.worker_names = names.clone();
        job.step = launch.start_step;
        job.step_heard = now;
        job.phase = Phase::Running(Running {
            workers: launch.workers.clone(),
            done: BTreeSet::new(),
            progress: Progress::starting(launch.start_step, now),
            starting: Some(LaunchInfo {
                source: launch.source,
                root_rank: launch.root_rank,
                checkpoint_first: launch.checkpoint_first,
            }),
            built: None,
        });
        self.publish(&id, now);
        if launch.source != StateSource::Init || launch.generation > 1 {
            // Readers of metrics.jsonl: lines after this one continue from `step` (after a
            // resume from a checkpoint, steps after it appear again; the later lines count).
            self.append_metrics(
                &id,
                MetricsLine::Event(EventLine::Resume(ResumeEvent {
                    generation: launch.generation,
                    step: launch.start_step,
                    source: launch.source.as_str_name().to_string(),
                    world_size: launch.workers.len() as u64,
                })),
            );
        }
        tracing::info!(
            job = %id,
            generation = launch.generation,
            world_size = launch.workers.len(),
            start_step = launch.start_step,
            source = ?launch.source,
            workers = ?names,
            "forming the ring"
        );
        self.effects.push(Effect::BuildFiles(Box::new(launch)));
    }

    /// A generation's files are built: they wait until the record naming the generation is
    /// on disk, then every rank is sent its `StartJob` ([`Self::send_assignments`]).
    pub(super) fn files_built(
        &mut self,
        now: Instant,
        job_id: &str,
        generation: u64,
        result: Result<RankFiles, String>,
    ) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if job.generation != generation {
            return;
        }
        let Phase::Running(running) = &mut job.phase else {
            return;
        };
        if running.starting.is_none() {
            return;
        }
        match result {
            Ok(files) => running.built = Some(files),
            Err(e) => return self.end_job(job_id, Outcome::Failed(e), now),
        }
        self.send_assignments(now, job_id);
    }

    /// Once a generation's files are built and the record naming it is on disk: decides the
    /// job's precision (once), records the files workers may fetch, and sends every rank its
    /// `StartJob`. A rank that cannot be sent it is lost (a new generation without it).
    pub(super) fn send_assignments(&mut self, now: Instant, job_id: &str) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if !job.generation_is_durable() {
            return;
        }
        let generation = job.generation;
        let Phase::Running(running) = &mut job.phase else {
            return;
        };
        let (Some(info), Some(per_rank)) = (running.starting, running.built.take()) else {
            return;
        };
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        let Phase::Running(running) = &job.phase else {
            return;
        };
        let spec_json = match serde_json::to_string(&job.spec) {
            Ok(s) => s,
            Err(e) => return self.end_job(job_id, Outcome::Failed(format!("spec: {e}")), now),
        };
        let workers = running.workers.clone();
        let peers: Vec<String> = workers
            .iter()
            .map(|w| {
                self.workers
                    .get(w)
                    .map(|w| w.advertise_addr.clone())
                    .unwrap_or_default()
            })
            .collect();
        let bf16_reports: Vec<WorkerBf16> = workers
            .iter()
            .map(|w| WorkerBf16 {
                worker: w.clone(),
                native: self.workers.get(w).is_some_and(|e| e.bf16_native),
                detail: self
                    .workers
                    .get(w)
                    .map_or_else(String::new, |e| e.bf16_detail.clone()),
            })
            .collect();
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        // Decided once per job, by the first generation's workers; later generations (growth,
        // recovery, a restart: the record keeps it) run in the same precision, so a resumed
        // job does not change its arithmetic midway.
        let precision = match job.precision {
            Some(p) => p,
            None => {
                let (p, why) = job.spec.train.precision.decide(&bf16_reports);
                tracing::info!(job = %job_id, precision = %p, reason = %why, "GEMM precision decided");
                job.precision = Some(p);
                p
            }
        };
        for files in &per_rank {
            for (name, path, _) in files {
                job.files.insert(name.clone(), path.clone());
            }
        }
        let start_step = job.step;
        let ring_timeout_ms = (job.spec.cluster.peer_timeout_seconds * 1000.0) as u64;
        let (model_config_json, total_sequences, phase_sequences) = match &job.prepared {
            Some(p) => (
                p.model_config_json.clone(),
                p.total_sequences,
                p.later_phases.iter().map(|d| d.total_sequences).collect(),
            ),
            None => (String::new(), 0, Vec::new()),
        };
        let global_batch = job.global_batch_size;
        let world = workers.len();
        let mut failed = None;
        for (rank, (wid, files)) in workers.iter().zip(per_rank).enumerate() {
            let start = StartJob {
                key: Some(TrainingKey {
                    job_id: job_id.to_string(),
                    generation,
                    step: start_step,
                }),
                rank: rank as u32,
                world_size: world as u32,
                peers: peers.clone(),
                spec_json: spec_json.clone(),
                model_config_json: model_config_json.clone(),
                total_sequences,
                files: files.into_iter().map(|(_, _, f)| f).collect(),
                streams_per_link: STREAMS_PER_LINK,
                frame_bytes: FILE_CHUNK_BYTES as u64,
                ring_timeout_ms,
                start_step,
                state_source: info.source as i32,
                state_root_rank: info.root_rank,
                global_batch_size: global_batch,
                checkpoint_first: info.checkpoint_first && rank == 0,
                precision: precision.as_str().to_string(),
                phase_sequences: phase_sequences.clone(),
            };
            if !self.send(wid, worker_command::Command::Start(start)) {
                failed = Some((
                    wid.clone(),
                    format!("worker {wid} (rank {rank}) could not be sent its assignment"),
                ));
                break;
            }
        }
        if let Some((wid, message)) = failed {
            self.publish(job_id, now);
            return self.lost_worker(now, job_id, &wid, message);
        }
        if let Some(job) = self.jobs.get_mut(job_id)
            && let Phase::Running(r) = &mut job.phase
        {
            // The watchdog's clock starts when the workers have their assignments, not
            // while the coordinator was still building their shards.
            r.progress = Progress::starting(start_step, now);
            r.starting = None;
        }
        self.publish(job_id, now);
        tracing::info!(job = %job_id, generation, "assignments sent");
    }
}
