//! The coordinator's background loop: declares silent workers dead, prepares queued jobs,
//! and forms idle workers into a job's ring.

use crate::job::PreparedJob;
use crate::prepare_job;
use crate::state::Shared;
use keel_proto::protocol::{FILE_CHUNK_BYTES, HEARTBEAT_TIMEOUT};
use keel_proto::rpc::{JobState, StartJob, TrainingKey, WorkerCommand, worker_command};
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
        start_preparing(&shared);
        assign_workers(&shared);
    }
}

/// Removes workers whose heartbeat is older than their timeout; fails the jobs they were in.
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
        if silent > timeout {
            dead.push((w.id.clone(), w.describe(), w.job.clone(), w.step, silent));
        }
    }
    for (id, describe, job, step, silent) in dead {
        tracing::warn!(worker = %describe, "no heartbeat for {:.1} s: removing it", silent.as_secs_f64());
        reg.workers.remove(&id);
        if let Some((job_id, rank)) = job {
            let message = format!(
                "worker {describe}, rank {rank}, sent no heartbeat for {:.1} s; its last reported step was {step}",
                silent.as_secs_f64()
            );
            reg.end_job(&job_id, JobState::Failed, Some(message));
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
        let spec = job.spec.clone();
        let dir = job.dir.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            tracing::info!(job = %id, "preparing data and model");
            let id2 = id.clone();
            let result =
                tokio::task::spawn_blocking(move || prepare_job::prepare(&id2, &spec, &dir)).await;
            let mut reg = shared.lock();
            match result {
                Ok(Ok(prepared)) => {
                    if let Ok(job) = reg.job_mut(&id)
                        && job.state == JobState::Preparing
                    {
                        tracing::info!(job = %id, sequences = prepared.total_sequences, "prepared");
                        job.prepared = Some(Arc::new(prepared));
                        job.state = JobState::WaitingForWorkers;
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
}

/// Gives waiting jobs (in submission order) idle, attached workers once `min_workers` are free.
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
    for id in waiting {
        let mut idle: Vec<(u64, String)> = reg
            .workers
            .values()
            .filter(|w| w.job.is_none() && w.commands.is_some())
            .map(|w| (w.number, w.id.clone()))
            .collect();
        idle.sort();
        let Ok(job) = reg.job_mut(&id) else { continue };
        let (min, max) = (job.spec.cluster.min_workers, job.spec.cluster.max_workers);
        if idle.len() < min.max(1) {
            continue;
        }
        let chosen: Vec<String> = idle.into_iter().take(max.max(1)).map(|(_, w)| w).collect();
        job.generation += 1;
        job.workers = chosen.clone();
        job.done.clear();
        job.state = JobState::Running;
        let generation = job.generation;
        let Some(prepared) = job.prepared.clone() else {
            continue;
        };
        let spec = job.spec.clone();
        let dir = job.dir.clone();
        let mut names = Vec::new();
        let mut peers = Vec::new();
        for (rank, wid) in chosen.iter().enumerate() {
            if let Some(w) = reg.workers.get_mut(wid) {
                w.job = Some((id.clone(), rank as u32));
                w.step = 0;
                names.push(w.describe());
                peers.push(w.advertise_addr.clone());
            }
        }
        if let Ok(job) = reg.job_mut(&id) {
            job.worker_names = names.clone();
            job.publish();
        }
        tracing::info!(job = %id, generation, world_size = chosen.len(), workers = ?names, "forming the ring");
        let shared = shared.clone();
        tokio::spawn(start_ranks(
            shared, id, generation, spec, prepared, dir, chosen, peers,
        ));
    }
}

/// Builds every rank's files, then sends each worker its `StartJob`.
#[allow(clippy::too_many_arguments)]
async fn start_ranks(
    shared: Arc<Shared>,
    job_id: String,
    generation: u64,
    spec: keel_proto::jobspec::JobSpec,
    prepared: Arc<PreparedJob>,
    dir: std::path::PathBuf,
    workers: Vec<String>,
    peers: Vec<String>,
) {
    let world = workers.len();
    let (id2, spec2, prep2, dir2) = (job_id.clone(), spec.clone(), prepared.clone(), dir.clone());
    let built = tokio::task::spawn_blocking(move || {
        (0..world)
            .map(|rank| prepare_job::rank_files(&id2, &spec2, &prep2, &dir2, world, rank))
            .collect::<Result<Vec<_>, _>>()
    })
    .await;
    let mut reg = shared.lock();
    let per_rank = match built {
        Ok(Ok(files)) => files,
        Ok(Err(e)) => return reg.end_job(&job_id, JobState::Failed, Some(e.to_string())),
        Err(e) => {
            return reg.end_job(
                &job_id,
                JobState::Failed,
                Some(format!("shard task panicked: {e}")),
            );
        }
    };
    let spec_json = match serde_json::to_string(&spec) {
        Ok(s) => s,
        Err(e) => return reg.end_job(&job_id, JobState::Failed, Some(format!("spec: {e}"))),
    };
    let Ok(job) = reg.job_mut(&job_id) else {
        return;
    };
    if job.generation != generation || job.state != JobState::Running {
        return;
    }
    for files in &per_rank {
        for (name, path, _) in files {
            job.files.insert(name.clone(), path.clone());
        }
    }
    let ring_timeout_ms = (spec.cluster.peer_timeout_seconds * 1000.0) as u64;
    let mut failed = None;
    for (rank, (wid, files)) in workers.iter().zip(per_rank).enumerate() {
        let start = StartJob {
            key: Some(TrainingKey {
                job_id: job_id.clone(),
                generation,
                step: 0,
            }),
            rank: rank as u32,
            world_size: world as u32,
            peers: peers.clone(),
            spec_json: spec_json.clone(),
            model_config_json: prepared.model_config_json.clone(),
            total_sequences: prepared.total_sequences,
            files: files.into_iter().map(|(_, _, f)| f).collect(),
            streams_per_link: STREAMS_PER_LINK,
            frame_bytes: FILE_CHUNK_BYTES as u64,
            ring_timeout_ms,
            ..Default::default()
        };
        let cmd = WorkerCommand {
            command: Some(worker_command::Command::Start(start)),
        };
        let sent = reg
            .workers
            .get(wid)
            .and_then(|w| w.commands.as_ref())
            .is_some_and(|tx| tx.try_send(Ok(cmd)).is_ok());
        if !sent {
            failed = Some(format!(
                "worker {wid} (rank {rank}) could not be sent its assignment"
            ));
            break;
        }
    }
    if let Some(message) = failed {
        reg.end_job(&job_id, JobState::Failed, Some(message));
    } else {
        tracing::info!(job = %job_id, generation, "assignments sent");
    }
}
