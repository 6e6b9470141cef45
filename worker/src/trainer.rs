//! One job on one worker (protocol steps 6-11 in `keel_proto::protocol`): fetch the files,
//! join the ring, run the training loop on a blocking thread (`step`), and forward its reports
//! and checkpoints to the coordinator in order.

use crate::allreduce::{Mailbox, Ring, RingConfig};
use crate::client::{TransferError, fetch_cached, upload_dir};
use crate::ringlink::RingLink;
use crate::step::{Event, TrainError, TrainSetup};
use keel_proto::auth::AuthChannel;
use keel_proto::config::BertConfig;
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{StartJob, TrainingKey};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

/// What a job needs from the worker process.
#[derive(Clone)]
pub struct JobContext {
    /// The coordinator.
    pub client: CoordinatorClient<AuthChannel>,
    /// This worker's id.
    pub worker_id: String,
    /// Where files are cached and checkpoints staged.
    pub cache_dir: PathBuf,
    /// The ring service's mailbox (shared with the worker's server).
    pub mailbox: Arc<Mailbox>,
    /// Set when the coordinator cancels the job or the worker stops.
    pub cancel: Arc<AtomicBool>,
    /// Steps completed (read by heartbeats).
    pub progress: Arc<AtomicU64>,
}

/// Why a job stopped on this worker.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The assignment is malformed.
    #[error("bad assignment: {0}")]
    Assignment(String),
    /// A file could not be fetched or a checkpoint uploaded.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Joining the ring failed.
    #[error("joining the ring: {0}")]
    Ring(#[from] crate::allreduce::AllReduceError),
    /// Training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The training thread panicked.
    #[error("training thread: {0}")]
    Panic(String),
}

/// Runs the job `start` to its end on this worker.
///
/// Errors: [`JobError`] naming what failed; a ring failure names the peer and the step.
pub async fn run_job(ctx: JobContext, start: StartJob) -> Result<(), JobError> {
    let key = start
        .key
        .clone()
        .ok_or_else(|| JobError::Assignment("no training key".into()))?;
    let spec: JobSpec = serde_json::from_str(&start.spec_json)
        .map_err(|e| JobError::Assignment(format!("job spec: {e}")))?;
    let config: BertConfig = serde_json::from_str(&start.model_config_json)
        .map_err(|e| JobError::Assignment(format!("model config: {e}")))?;

    // Step 6: files, verified and cached.
    let mut client = ctx.client.clone();
    let mut paths = std::collections::HashMap::new();
    for file in &start.files {
        let path = fetch_cached(&mut client, &key, &ctx.worker_id, file, &ctx.cache_dir).await?;
        paths.insert(file.role.clone(), path);
    }
    let role = |r: &str| {
        paths
            .get(r)
            .cloned()
            .ok_or_else(|| JobError::Assignment(format!("no {r} file in the assignment")))
    };
    let work_dir = ctx.cache_dir.join("jobs").join(format!(
        "{}-g{}-r{}",
        key.job_id, key.generation, start.rank
    ));
    std::fs::create_dir_all(&work_dir).map_err(|source| TransferError::Io {
        path: work_dir.clone(),
        source,
    })?;
    let setup = TrainSetup {
        job_id: key.job_id.clone(),
        generation: key.generation,
        rank: start.rank,
        world_size: start.world_size,
        spec,
        config,
        total_sequences: start.total_sequences,
        shard: role("shard")?,
        heldout: role("heldout")?,
        tokenizer: role("tokenizer")?,
        init_weights: paths.get("init_weights").cloned(),
        work_dir,
    };

    // Step 8: the ring.
    let ring = Ring::connect(
        RingConfig {
            job_id: key.job_id.clone(),
            generation: key.generation,
            rank: start.rank,
            world_size: start.world_size,
            peers: start.peers.clone(),
            streams_per_link: start.streams_per_link.max(1) as usize,
            frame_bytes: (start.frame_bytes as usize).clamp(64 << 10, 1 << 20),
            timeout: Duration::from_millis(start.ring_timeout_ms.max(1000)),
        },
        ctx.mailbox.clone(),
    )
    .await?;
    tracing::info!(job = %key.job_id, rank = start.rank, "joined the ring");
    let busy = Arc::new(AtomicU64::new(0));
    let link = RingLink::spawn(Arc::new(ring), busy.clone());

    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let reporter = tokio::spawn(report_events(client.clone(), key.clone(), events_rx));
    let (cancel, progress) = (ctx.cancel.clone(), ctx.progress.clone());
    let math = tokio::task::spawn_blocking(move || {
        crate::step::train(setup, link, events_tx, &cancel, &progress, &busy)
    });
    let trained = math.await;
    // The events channel is closed now: the reporter drains it (final upload) and ends.
    let reported = reporter
        .await
        .map_err(|e| JobError::Panic(format!("reporter: {e}")))?;
    match trained {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.into()),
        Err(e) => return Err(JobError::Panic(e.to_string())),
    }
    reported?;
    Ok(())
}

/// Sends step and eval reports and uploads checkpoints, in the order the training loop made
/// them. Report failures are logged (the coordinator may have ended the job); a failed
/// checkpoint upload ends the job.
async fn report_events(
    mut client: CoordinatorClient<AuthChannel>,
    key: TrainingKey,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Result<(), JobError> {
    while let Some(event) = events.recv().await {
        match event {
            Event::Step(report) => {
                if let Err(e) = client.report_step(report).await {
                    tracing::warn!("step report: {e}");
                }
            }
            Event::Eval(report) => {
                if let Err(e) = client.report_eval(report).await {
                    tracing::warn!("eval report: {e}");
                }
            }
            Event::Checkpoint { step, dir } => {
                let key = TrainingKey {
                    step,
                    ..key.clone()
                };
                upload_dir(&mut client, &key, &dir).await?;
                tracing::info!(step, "checkpoint uploaded");
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), "cannot remove staged checkpoint: {e}");
                }
            }
        }
    }
    Ok(())
}
