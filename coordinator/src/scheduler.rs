//! The coordinator's background loop: declares silent or disconnected workers dead, notices
//! stalled jobs (`watchdog`), prepares queued jobs, forms idle workers into a job's ring, and
//! drives recoveries (`recovery`).

use crate::job::PreparedJob;
use crate::prepare_job;
use crate::recovery;
use crate::state::Shared;
use keel_proto::precision::WorkerBf16;
use keel_proto::protocol::{FILE_CHUNK_BYTES, HEARTBEAT_TIMEOUT};
use keel_proto::rpc::{JobState, StartJob, StateSource, TrainingKey, worker_command};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How often the loop looks at the registry even when nothing woke it.
const TICK: Duration = Duration::from_millis(250);

/// Ring connections per link that workers open (several streams beat one on loopback).
const STREAMS_PER_LINK: u32 = 2;

/// Runs the loop until `stop` resolves.
pub async fn run(shared: Arc<Shared>, stop: impl std::future::Future<Output = ()>) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = shared.wake.notified() => {}
            _ = tokio::time::sleep(TICK) => {}
        }
        reap_dead_workers(&shared);
        crate::watchdog::tick(&shared);
        start_preparing(&shared);
        recovery::tick(&shared);
        assign_workers(&shared);
    }
}

/// Removes workers whose heartbeat is older than their timeout, or whose command stream
/// closed; a job they were in recovers without them (or fails, see `recovery::begin`).
fn reap_dead_workers(shared: &Arc<Shared>) {
    let mut reg = shared.lock();
    let mut dead = Vec::new();
    for w in reg.workers.values() {
        let timeout = match &w.job {
            Some((job_id, _)) => reg.jobs.get(job_id).map_or(HEARTBEAT_TIMEOUT, |j| {
                Duration::from_secs_f64(j.spec.cluster.peer_timeout_seconds.max(1.0))
            }),
            None => HEARTBEAT_TIMEOUT,
        };
        let silent = w.last_seen.elapsed();
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
                .and_then(|(j, _)| reg.jobs.get(j))
                .map_or(w.step, |j| j.step.max(w.step));
            dead.push((w.id.clone(), w.describe(), w.job.clone(), step, why));
        }
    }
    for (id, describe, job, step, why) in dead {
        tracing::warn!(worker = %describe, "{why}: removing it");
        reg.workers.remove(&id);
        if let Some((job_id, rank)) = job {
            let message =
                format!("worker {describe}, rank {rank}, {why}; its last reported step was {step}");
            recovery::lost_worker(&mut reg, &job_id, &id, message);
        }
    }
}

/// Starts preparing every queued job (on blocking threads).
fn start_preparing(shared: &Arc<Shared>) {
    let mut reg = shared.lock();
    let queued: Vec<String> = reg
        .order
        .iter()
        .filter(|id| {
            reg.jobs
                .get(*id)
                .is_some_and(|j| j.state == JobState::Queued)
        })
        .cloned()
        .collect();
    for id in queued {
        let Ok(job) = reg.job_mut(&id) else { continue };
        job.state = JobState::Preparing;
        job.publish();
        let (spec, dir) = (job.spec.clone(), job.dir.clone());
        spawn_prepare(shared, id, spec, dir, JobState::WaitingForWorkers);
    }
}

/// Prepares a job's data on a blocking thread; on success the job goes to `then` (from
/// `PREPARING`, or stays `RECOVERING` for a job restored after a restart). Call it with the
/// registry locked or not: it locks only from the spawned task.
pub fn spawn_prepare(
    shared: &Arc<Shared>,
    id: String,
    spec: keel_proto::jobspec::JobSpec,
    dir: PathBuf,
    then: JobState,
) {
    let shared = shared.clone();
    tokio::spawn(async move {
        tracing::info!(job = %id, "preparing data and model");
        let id2 = id.clone();
        let roots = shared.input_roots.clone();
        let result = tokio::task::spawn_blocking(move || {
            prepare_job::begin_attempt(&dir)?;
            let result = prepare_job::prepare_within(&id2, &spec, &dir, &roots);
            prepare_job::end_attempt(&dir);
            result
        })
        .await;
        let mut reg = shared.lock();
        match result {
            Ok(Ok(prepared)) => {
                if let Ok(job) = reg.job_mut(&id)
                    && matches!(job.state, JobState::Preparing | JobState::Recovering)
                {
                    tracing::info!(job = %id, sequences = prepared.total_sequences, "prepared");
                    job.prepared = Some(Arc::new(prepared));
                    if job.state == JobState::Preparing {
                        job.state = then;
                    }
                    job.publish();
                }
            }
            Ok(Err(e)) => reg.end_job(&id, JobState::Failed, Some(e.to_string())),
            Err(e) => reg.end_job(
                &id,
                JobState::Failed,
                Some(format!("preparation panicked: {e}")),
            ),
        }
        drop(reg);
        shared.wake.notify_one();
    });
}

/// Gives waiting jobs (in submission order) idle, attached workers once `min_workers` are
/// free; with no job waiting, a running job below `max_workers` grows by a new generation.
fn assign_workers(shared: &Arc<Shared>) {
    let mut reg = shared.lock();
    let waiting: Vec<String> = reg
        .order
        .iter()
        .filter(|id| {
            reg.jobs
                .get(*id)
                .is_some_and(|j| j.state == JobState::WaitingForWorkers)
        })
        .cloned()
        .collect();
    if waiting.is_empty() {
        recovery::grow_running_jobs(&mut reg);
        return;
    }
    for id in waiting {
        let needed = reg
            .jobs
            .get(&id)
            .and_then(|j| j.prepared.as_ref())
            .map(|p| p.memory_bytes);
        if let Some(reason) = needed.and_then(|n| crate::admission::no_worker_can_hold(&reg, n)) {
            // Assigning it would only make every worker fail (or abort) on it, again and again.
            reg.end_job(&id, JobState::Failed, Some(reason));
            continue;
        }
        let idle = recovery::idle_workers(&reg, &id);
        let Ok(job) = reg.job_mut(&id) else { continue };
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
        launch_generation(shared, &mut reg, launch);
    }
}

/// One generation of a job to start: who, from which state, with which data split.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The job.
    pub job_id: String,
    /// The generation being started.
    pub generation: u64,
    /// The job's prepared data.
    pub prepared: Arc<PreparedJob>,
    /// Worker ids in rank order.
    pub workers: Vec<String>,
    /// Steps already completed.
    pub start_step: u64,
    /// Where the ranks take the state from.
    pub source: StateSource,
    /// With `Memory`: the rank that broadcasts it.
    pub root_rank: u32,
    /// Sequences per step (the job's fixed `B`).
    pub global_batch: u64,
    /// Rank 0 uploads a checkpoint of `start_step` first.
    pub checkpoint_first: bool,
    /// `(role, path)` of state files (with `Checkpoint`), replacing a prepared file of the
    /// same role.
    pub state_files: Vec<(String, PathBuf)>,
}

/// Marks the job `RUNNING` with `launch.workers` and spawns the task that builds their files
/// and sends each its `StartJob`. Call with the registry locked.
pub fn launch_generation(shared: &Arc<Shared>, reg: &mut crate::state::Registry, launch: Launch) {
    let id = launch.job_id.clone();
    let mut names = Vec::new();
    for (rank, wid) in launch.workers.iter().enumerate() {
        if let Some(w) = reg.workers.get_mut(wid) {
            w.job = Some((id.clone(), rank as u32));
            w.step = launch.start_step;
            w.generation = 0;
            w.holds = None;
            names.push(w.describe());
        }
    }
    let Ok(job) = reg.job_mut(&id) else { return };
    job.workers = launch.workers.clone();
    job.worker_names = names.clone();
    job.done.clear();
    job.regroup = None;
    job.state = JobState::Running;
    job.step = launch.start_step;
    job.progress = crate::watchdog::Progress::starting(launch.start_step);
    job.publish();
    if launch.source != StateSource::Init || launch.generation > 1 {
        // Readers of metrics.jsonl: lines after this one continue from `step` (after a resume
        // from a checkpoint, steps after it appear again; the later lines are the ones kept).
        crate::service::append_metrics(
            job,
            serde_json::json!({
                "event": "resume",
                "generation": launch.generation,
                "step": launch.start_step,
                "source": launch.source.as_str_name(),
                "world_size": launch.workers.len(),
            }),
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
    tokio::spawn(start_ranks(shared.clone(), launch));
}

/// Builds every rank's files, then sends each worker its `StartJob`.
async fn start_ranks(shared: Arc<Shared>, launch: Launch) {
    let Some((spec, dir)) = shared
        .lock()
        .jobs
        .get(&launch.job_id)
        .map(|j| (j.spec.clone(), j.dir.clone()))
    else {
        return;
    };
    let world = launch.workers.len();
    let (l2, spec2, dir2) = (launch.clone(), spec.clone(), dir.clone());
    let built = tokio::task::spawn_blocking(move || {
        let state_files = l2
            .state_files
            .iter()
            .map(|(role, path)| prepare_job::job_file(role.clone(), path.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        (0..world)
            .map(|rank| {
                let mut files = prepare_job::rank_files(
                    &l2.job_id,
                    &spec2,
                    &l2.prepared,
                    &dir2,
                    world,
                    rank,
                    l2.global_batch,
                )?;
                files.retain(|(_, _, f)| !state_files.iter().any(|(_, _, s)| s.role == f.role));
                files.extend(state_files.iter().cloned());
                Ok(files)
            })
            .collect::<Result<Vec<_>, crate::CoordinatorError>>()
    })
    .await;
    let mut reg = shared.lock();
    let job_id = &launch.job_id;
    let per_rank = match built {
        Ok(Ok(files)) => files,
        Ok(Err(e)) => return reg.end_job(job_id, JobState::Failed, Some(e.to_string())),
        Err(e) => {
            return reg.end_job(
                job_id,
                JobState::Failed,
                Some(format!("shard task panicked: {e}")),
            );
        }
    };
    let spec_json = match serde_json::to_string(&spec) {
        Ok(s) => s,
        Err(e) => return reg.end_job(job_id, JobState::Failed, Some(format!("spec: {e}"))),
    };
    let peers: Vec<String> = launch
        .workers
        .iter()
        .map(|w| {
            reg.workers
                .get(w)
                .map(|w| w.advertise_addr.clone())
                .unwrap_or_default()
        })
        .collect();
    let bf16_reports: Vec<WorkerBf16> = launch
        .workers
        .iter()
        .map(|w| WorkerBf16 {
            worker: w.clone(),
            native: reg.workers.get(w).is_some_and(|e| e.bf16_native),
            detail: reg
                .workers
                .get(w)
                .map_or_else(String::new, |e| e.bf16_detail.clone()),
        })
        .collect();
    let Ok(job) = reg.job_mut(job_id) else {
        return;
    };
    if job.generation != launch.generation || job.state != JobState::Running {
        return;
    }
    // Decided once per job, by the first generation's workers; later generations (growth,
    // recovery, a coordinator restart: the record keeps it) run in the same precision, so a
    // resumed job does not change its arithmetic midway.
    let precision = match job.precision {
        Some(p) => p,
        None => {
            let (p, why) = job.spec.train.precision.decide(&bf16_reports);
            tracing::info!(job = %job_id, precision = %p, reason = %why, "GEMM precision decided");
            job.precision = Some(p);
            job.publish();
            p
        }
    };
    for files in &per_rank {
        for (name, path, _) in files {
            job.files.insert(name.clone(), path.clone());
        }
    }
    let ring_timeout_ms = (spec.cluster.peer_timeout_seconds * 1000.0) as u64;
    let mut failed = None;
    for (rank, (wid, files)) in launch.workers.iter().zip(per_rank).enumerate() {
        let start = StartJob {
            key: Some(TrainingKey {
                job_id: job_id.clone(),
                generation: launch.generation,
                step: launch.start_step,
            }),
            rank: rank as u32,
            world_size: world as u32,
            peers: peers.clone(),
            spec_json: spec_json.clone(),
            model_config_json: launch.prepared.model_config_json.clone(),
            total_sequences: launch.prepared.total_sequences,
            files: files.into_iter().map(|(_, _, f)| f).collect(),
            streams_per_link: STREAMS_PER_LINK,
            frame_bytes: FILE_CHUNK_BYTES as u64,
            ring_timeout_ms,
            start_step: launch.start_step,
            state_source: launch.source as i32,
            state_root_rank: launch.root_rank,
            global_batch_size: launch.global_batch,
            checkpoint_first: launch.checkpoint_first && rank == 0,
            precision: precision.as_str().to_string(),
        };
        let sent = reg
            .workers
            .get(wid)
            .is_some_and(|w| w.send(worker_command::Command::Start(start)));
        if !sent {
            failed = Some((
                wid.clone(),
                format!("worker {wid} (rank {rank}) could not be sent its assignment"),
            ));
            break;
        }
    }
    match failed {
        Some((wid, message)) => recovery::lost_worker(&mut reg, job_id, &wid, message),
        None => {
            // The watchdog's clock starts when the workers have their assignments, not while
            // the coordinator was still building their shards.
            if let Some(job) = reg.jobs.get_mut(job_id) {
                job.progress = crate::watchdog::Progress::starting(launch.start_step);
            }
            tracing::info!(job = %job_id, generation = launch.generation, "assignments sent");
        }
    }
}
