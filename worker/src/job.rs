//! One job on one worker (protocol steps 6-11 in `keel_proto::protocol`): fetch the files,
//! join the ring, run the training loop on a blocking thread (`train`), and forward its reports
//! and checkpoints to the coordinator in order.

use crate::allreduce::{Mailbox, Ring, RingConfig};
use crate::client::{
    TransferError, UPLOAD_FIRST_PAUSE, fetch_cached, upload_dir_retrying, upload_final,
};
use crate::control::JobControl;
use crate::faults::Faults;
use crate::replica::Replica;
use crate::ringlink::RingLink;
use crate::train::{Event, InitialState, PhaseInputs, TrainError, TrainSetup};
use keel_net::auth::AuthChannel;
use keel_proto::config::BertConfig;
use keel_proto::jobspec::JobSpec;
use keel_proto::precision::Precision;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{StartJob, StateSource, TrainingKey};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
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
    /// Stops the job from outside (cancel, suspend, shutdown).
    pub control: Arc<JobControl>,
    /// Steps completed (read by heartbeats).
    pub progress: Arc<AtomicU64>,
    /// Fault injection for tests ([`Faults::none`] otherwise): for the training step and the
    /// ring task of the job.
    pub faults: Faults,
    /// Bytes of memory a job may use on this worker; an assignment estimated to need more is
    /// refused before anything is allocated. `None`: not checked.
    pub memory_limit: Option<u64>,
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

impl JobError {
    /// Whether a new generation of the job could go on after this error on this worker: a
    /// lost peer, an unreachable coordinator, or a stop from outside, as opposed to a broken
    /// job (bad data, a non-finite loss past the limit).
    pub fn is_recoverable(&self) -> bool {
        match self {
            JobError::Transfer(TransferError::Io { .. } | TransferError::NoRoom { .. }) => false,
            JobError::Transfer(_) | JobError::Ring(_) => true,
            JobError::Train(e) => e.is_recoverable(),
            JobError::Assignment(_) | JobError::Panic(_) => false,
        }
    }
}

/// Runs the job `start` to its end on this worker. `held` is what this worker holds of the job
/// from an earlier generation (used with `STATE_SOURCE_MEMORY`).
///
/// Returns how it ended and the replica (weights + optimizer state) the training loop ended
/// with, if it got that far: the worker keeps it for the next generation.
///
/// Errors: [`JobError`] naming what failed; a ring failure names the peer and the step.
pub async fn run_job(
    ctx: JobContext,
    start: StartJob,
    held: Option<Replica>,
) -> (Result<(), JobError>, Option<Replica>) {
    match prepare_and_train(ctx, start, held).await {
        Ok((result, replica)) => (result, replica),
        Err((e, held)) => (Err(e), held),
    }
}

/// Checks an assignment's model against this worker's memory: the config must pass
/// [`BertConfig::validate`] (its size caps included) and [`keel_proto::memory::estimate`] for
/// the job's micro-batch at `max_seq_length` must not exceed `memory_limit` bytes.
///
/// Errors: [`JobError::Assignment`] naming the field, or the estimate and the limit.
fn check_fits(
    config: &BertConfig,
    spec: &JobSpec,
    world_size: u32,
    memory_limit: Option<u64>,
) -> Result<(), JobError> {
    config
        .validate()
        .map_err(|e| JobError::Assignment(format!("model config: {e}")))?;
    // Every phase (`[[phase]]`) must fit: a later one may have longer sequences.
    for spec in spec.phase_views() {
        check_phase_fits(config, &spec, world_size, memory_limit)?;
    }
    Ok(())
}

/// [`check_fits`] for one phase's view of the job.
fn check_phase_fits(
    config: &BertConfig,
    spec: &JobSpec,
    world_size: u32,
    memory_limit: Option<u64>,
) -> Result<(), JobError> {
    let estimate = keel_proto::memory::estimate(
        config,
        spec.train.micro_batch_size,
        spec.data.max_seq_length,
    )
    .map_err(|e| JobError::Assignment(format!("model config: {e}")))?;
    // With `train.shard_optimizer` this rank keeps 1/W of the moments.
    let estimate = if spec.train.shard_optimizer {
        estimate.with_moments_over(u64::from(world_size))
    } else {
        estimate
    };
    if let Some(limit) = memory_limit
        && estimate.total_bytes > limit
    {
        use keel_proto::memory::format_bytes;
        return Err(JobError::Assignment(format!(
            "this worker cannot hold the model: training it needs an estimated {} ({} parameters, \
             micro_batch_size {} at max_seq_length {}{}) but this worker's memory limit is {}",
            format_bytes(estimate.total_bytes),
            estimate.params,
            spec.train.micro_batch_size,
            spec.data.max_seq_length,
            if spec.train.shard_optimizer && world_size > 1 {
                format!(", optimizer moments shared by {world_size} ranks")
            } else {
                String::new()
            },
            format_bytes(limit)
        )));
    }
    Ok(())
}

/// The files and sequence counts of the job's phases after the first, from the assignment:
/// each phase's shard (`shard_phaseN`), its held-out set where it has its own
/// (`heldout_phaseN`) and its training sequences (`StartJob.phase_sequences`).
///
/// Errors: [`JobError::Assignment`] naming a missing shard or count.
fn later_phases(
    spec: &JobSpec,
    start: &StartJob,
    paths: &std::collections::HashMap<String, PathBuf>,
) -> Result<Vec<PhaseInputs>, JobError> {
    use keel_proto::phases::{HELDOUT_PHASE_ROLE, SHARD_PHASE_ROLE};
    if start.phase_sequences.len() != spec.phases.len() {
        return Err(JobError::Assignment(format!(
            "StartJob.phase_sequences has {} entries but the job has {} later phases",
            start.phase_sequences.len(),
            spec.phases.len()
        )));
    }
    (2..=spec.phase_count())
        .zip(&start.phase_sequences)
        .map(|(n, &total_sequences)| {
            let shard = paths
                .get(&format!("{SHARD_PHASE_ROLE}{n}"))
                .cloned()
                .ok_or_else(|| {
                    JobError::Assignment(format!("no {SHARD_PHASE_ROLE}{n} file in the assignment"))
                })?;
            Ok(PhaseInputs {
                shard,
                heldout: paths.get(&format!("{HELDOUT_PHASE_ROLE}{n}")).cloned(),
                total_sequences,
            })
        })
        .collect()
}

/// [`run_job`]'s body; errors before training starts hand the held replica back.
async fn prepare_and_train(
    ctx: JobContext,
    start: StartJob,
    held: Option<Replica>,
) -> Result<(Result<(), JobError>, Option<Replica>), (JobError, Option<Replica>)> {
    let mut held = held;
    macro_rules! early {
        ($e:expr) => {
            match $e {
                Ok(v) => v,
                Err(e) => return Err((JobError::from(e), held.take())),
            }
        };
    }
    let key = early!(
        start
            .key
            .clone()
            .ok_or_else(|| JobError::Assignment("no training key".into()))
    );
    let spec: JobSpec = early!(
        serde_json::from_str(&start.spec_json)
            .map_err(|e| JobError::Assignment(format!("job spec: {e}")))
    );
    let config: BertConfig = early!(
        serde_json::from_str(&start.model_config_json)
            .map_err(|e| JobError::Assignment(format!("model config: {e}")))
    );
    // Before any allocation: a config that is out of bounds, or a model this worker cannot
    // hold, is refused with a message for the coordinator, never an abort on allocation.
    early!(check_fits(
        &config,
        &spec,
        start.world_size,
        ctx.memory_limit
    ));
    let max_steps = spec.train.max_steps;
    let precision = early!(
        Precision::from_wire(&start.precision)
            .map_err(|e| JobError::Assignment(format!("StartJob.precision: {e}")))
    );

    // Step 6: files, verified and cached.
    let mut client = ctx.client.clone();
    let mut paths = std::collections::HashMap::new();
    for file in &start.files {
        let path = early!(
            fetch_cached(&mut client, &key, &ctx.worker_id, file, &ctx.cache_dir)
                .await
                .map_err(JobError::from)
        );
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
    early!(
        std::fs::create_dir_all(&work_dir).map_err(|source| JobError::from(TransferError::Io {
            path: work_dir.clone(),
            source,
        }))
    );
    let initial = match StateSource::try_from(start.state_source) {
        Ok(StateSource::Init) => InitialState::Init {
            weights: paths.get("init_weights").cloned(),
        },
        Ok(StateSource::Checkpoint) => InitialState::Checkpoint {
            weights: early!(role("init_weights")),
            optimizer: early!(role("init_optimizer")),
            state: paths.get("init_state").cloned(),
        },
        Ok(StateSource::Memory) => InitialState::Memory {
            held: held.take(),
            root_rank: start.state_root_rank,
        },
        Err(_) => {
            return Err((
                JobError::Assignment(format!("unknown state_source {}", start.state_source)),
                held.take(),
            ));
        }
    };
    let inputs = (|| {
        let later = later_phases(&spec, &start, &paths)?;
        Ok::<_, JobError>((role("shard")?, role("heldout")?, role("tokenizer")?, later))
    })();
    let (shard, heldout, tokenizer, later_phases) = match inputs {
        Ok(inputs) => inputs,
        Err(e) => {
            let back = match initial {
                InitialState::Memory { held, .. } => held,
                _ => None,
            };
            return Err((e, back));
        }
    };
    let setup = TrainSetup {
        job_id: key.job_id.clone(),
        generation: key.generation,
        rank: start.rank,
        world_size: start.world_size,
        spec,
        config,
        total_sequences: start.total_sequences,
        shard,
        heldout,
        tokenizer,
        later_phases,
        initial,
        start_step: start.start_step,
        global_batch_size: start.global_batch_size,
        precision,
        checkpoint_first: start.checkpoint_first,
        faults: ctx.faults.clone(),
        work_dir,
    };
    // From here on the held replica lives in `setup.initial` and comes back from the
    // training thread; a failure to join the ring gives it back unchanged.
    let give_back = |setup: TrainSetup| match setup.initial {
        InitialState::Memory { held, .. } => held,
        _ => None,
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
    );
    let ring = tokio::select! {
        r = ring => r,
        () = ctx.control.stopped() => {
            return Err((JobError::Train(TrainError::Stopped { step: start.start_step }), give_back(setup)));
        }
    };
    let ring = match ring {
        Ok(r) => r,
        Err(e) => return Err((JobError::Ring(e), give_back(setup))),
    };
    tracing::info!(job = %key.job_id, generation = key.generation, rank = start.rank, start_step = start.start_step, "joined the ring");
    let busy = Arc::new(AtomicU64::new(0));
    let link = RingLink::spawn(
        Arc::new(ring),
        busy.clone(),
        ctx.control.clone(),
        ctx.faults.clone(),
    );

    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let reporter = tokio::spawn(report_events(
        client.clone(),
        key.clone(),
        max_steps,
        ctx.control.clone(),
        events_rx,
    ));
    let (control, progress) = (ctx.control.clone(), ctx.progress.clone());
    let math = tokio::task::spawn_blocking(move || {
        crate::train::train(setup, link, events_tx, &control, &progress, &busy)
    });
    let trained = math.await;
    // The events channel is closed now: the reporter drains it (final upload) and ends.
    let reported = reporter
        .await
        .map_err(|e| JobError::Panic(format!("reporter: {e}")))
        .and_then(|r| r);
    Ok(match trained {
        Ok((Ok(()), replica)) => (reported, replica),
        Ok((Err(e), replica)) => (Err(e.into()), replica),
        Err(e) => (Err(JobError::Panic(e.to_string())), None),
    })
}

/// Sends step and eval reports and uploads checkpoints, in the order the training loop made
/// them. Report failures are logged (the coordinator may have ended the job, or be
/// restarting); an upload that fails transiently (the coordinator restarting or out of file
/// descriptors) is tried again, with pauses, up to `client::UPLOAD_ATTEMPTS` times; a failed
/// upload is logged and training goes on. The final checkpoint (step `max_steps`) is tried
/// again while its failure may pass (the coordinator's disk full: the job waits, holding it,
/// until there is room or `control` stops the job, [`upload_final`]); if it still could not
/// be uploaded, that is the job's error: the next generation uploads it again
/// (`StartJob.checkpoint_first`).
async fn report_events(
    mut client: CoordinatorClient<AuthChannel>,
    key: TrainingKey,
    max_steps: u64,
    control: Arc<JobControl>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Result<(), JobError> {
    let mut last_upload = Ok(());
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
                last_upload = if step == max_steps {
                    upload_final(
                        &mut client,
                        &key,
                        &dir,
                        UPLOAD_FIRST_PAUSE,
                        control.stopped(),
                    )
                    .await
                } else {
                    upload_dir_retrying(&mut client, &key, &dir, UPLOAD_FIRST_PAUSE).await
                };
                match &last_upload {
                    Ok(()) => tracing::info!(step, "checkpoint uploaded"),
                    Err(e) => tracing::warn!(step, "checkpoint upload failed: {e}"),
                }
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), "cannot remove staged checkpoint: {e}");
                }
            }
        }
    }
    last_upload.map_err(JobError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = r#"
[data]
corpus = ["/corpus.txt"]
vocab_size = 1000
max_seq_length = 128
[model]
preset = "tiny"
[train]
micro_batch_size = 8
max_steps = 10
"#;

    #[test]
    fn an_assignment_this_worker_cannot_hold_is_refused_before_allocating() {
        let spec = JobSpec::from_toml_str(SPEC, "job.toml").unwrap();
        let tiny = BertConfig::preset("tiny", 1000).unwrap();
        let needed = keel_proto::memory::estimate(&tiny, 8, 128)
            .unwrap()
            .total_bytes;
        assert!(check_fits(&tiny, &spec, 1, Some(needed)).is_ok());
        assert!(check_fits(&tiny, &spec, 1, None).is_ok());
        let err = check_fits(&tiny, &spec, 1, Some(needed - 1)).unwrap_err();
        assert!(!err.is_recoverable());
        assert!(err.to_string().contains("cannot hold"), "{err}");
        // With the moments sharded over 2 ranks, half of them (4 bytes a parameter) less.
        let sharded = JobSpec::from_toml_str(
            &SPEC.replace("max_steps = 10", "max_steps = 10\nshard_optimizer = true"),
            "job.toml",
        )
        .unwrap();
        let params = keel_proto::memory::estimate(&tiny, 8, 128).unwrap().params;
        let half = needed - 4 * params;
        assert!(check_fits(&tiny, &sharded, 2, Some(half)).is_ok());
        assert!(check_fits(&tiny, &sharded, 2, Some(half - 1)).is_err());
        assert!(check_fits(&tiny, &sharded, 1, Some(half)).is_err());
        // The issue's config (from a coordinator that does not check) is refused by field,
        // before the 22 TB allocation.
        let mut huge = tiny.clone();
        huge.hidden_size = 1 << 20;
        let err = check_fits(&huge, &spec, 1, None).unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");
        let mut wrapping = tiny;
        wrapping.num_hidden_layers = 1 << 40;
        let err = check_fits(&wrapping, &spec, 1, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_hidden_layers"), "{err}");
    }
}
