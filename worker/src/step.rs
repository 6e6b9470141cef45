//! The training loop of one rank, run on a blocking thread (protocol step 8).
//!
//! Each step: build this rank's micro-batches from its shard; all-reduce the masked-token
//! and NSP counts (and, with several ranks, which token ids each rank's batches use);
//! forward/backward every micro-batch with `mlm_scale = 1 / global masked count` (so the
//! summed gradient across ranks is exactly that of one big batch); gradient buckets go to the
//! ring as backward finishes them; all-reduce the loss sums; clip by global norm; optimizer
//! step. Every rank holds the same sums, so every rank applies the same update.
//!
//! With several ranks the word embeddings' gradient travels in two parts (see
//! `model::LookupGrads`): the tied decoder's dense share as soon as the MLM head's backward is
//! done, and the embedding lookup's share, only the rows of tokens some rank used, at the end
//! (when those rows are at most half the vocabulary; else in one piece at the end).
//!
//! Shape legend: `b` micro-batch size (sequences), `k` gradient accumulation steps, `W` world
//! size, `P` parameters (flat buffer length).

use crate::batch::Batch;
use crate::buckets::{BUCKET_ELEMS, Buckets, FIRST_SPECIAL_BUCKET};
use crate::control::JobControl;
use crate::data::{MaskingConfig, MaskingMode, MaskingVocab, collate, mask_sequence};
use crate::model::{Bert, DropoutKey, LookupGrads, ModelError, StepOptions, init_params};
use crate::optim::{
    AdamW, AdamWConfig, Lamb, LambConfig, LrSchedule, Optimizer, ScheduleKind, clip_grad_norm,
    global_norm,
};
use crate::replica::{BroadcastError, Replica, broadcast};
use crate::ringlink::{RingLink, RingLinkError};
use keel_proto::checkpoint::{OPTIMIZER_FILE, TRAINER_STATE_FILE, TrainerState, write_file_atomic};
use keel_proto::config::BertConfig;
use keel_proto::jobspec::{JobSpec, Objective, OptimizerKind, TrainSpec};
use keel_proto::params::ParamLayout;
use keel_proto::precision::Precision;
use keel_proto::rpc::{EvalReport, StepReport, TrainingKey};
use keel_proto::shard::ShardReader;
use keel_proto::split::WorkerPlan;
use keel_proto::tokenizer::KeelTokenizer;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Bucket id of the per-step counts all-reduce: `[masked tokens, NSP labels, real tokens]`,
/// then, with several ranks, `[v]` presence flags (how many ranks use each token id).
pub const COUNTS_BUCKET: u32 = FIRST_SPECIAL_BUCKET;
/// Bucket id of the per-step loss all-reduce: `[mlm loss sum, mlm correct, nsp loss sum, nsp correct]`.
pub const LOSS_BUCKET: u32 = FIRST_SPECIAL_BUCKET + 1;
/// Bucket id of the eval all-reduce: `[mlm loss sum, masked tokens, correct]`.
pub const EVAL_BUCKET: u32 = FIRST_SPECIAL_BUCKET + 2;
/// Bucket id of the word embeddings' lookup-gradient rows `[u, c]` (several ranks only).
pub const LOOKUP_BUCKET: u32 = FIRST_SPECIAL_BUCKET + 3;
/// Held-out sequences evaluated at most (across all ranks), to bound eval time.
pub const EVAL_MAX_SEQUENCES: usize = 1024;
/// Mixed into the job seed for the held-out masks, so they differ from training masks.
pub const EVAL_SEED_SALT: u64 = 0x5eed_e7a1;

/// Where a generation's starting state comes from (`StartJob.state_source`).
#[derive(Debug)]
pub enum InitialState {
    /// Step 0: from the job seed, or from HF weights (`init_checkpoint`).
    Init {
        /// HF `model.safetensors`, or `None` for the seed.
        weights: Option<PathBuf>,
    },
    /// A stored checkpoint of `start_step`.
    Checkpoint {
        /// Its `model.safetensors`.
        weights: PathBuf,
        /// Its `optimizer.safetensors`.
        optimizer: PathBuf,
        /// Its `trainer_state.json` (skipped-step count), if sent.
        state: Option<PathBuf>,
    },
    /// Memory: this rank's held replica (if it has one), then a broadcast from `root_rank`.
    Memory {
        /// What this worker holds of the job, at any step.
        held: Option<Replica>,
        /// The rank whose replica everyone takes.
        root_rank: u32,
    },
}

/// Everything the loop needs, prepared by `trainer`.
#[derive(Debug)]
pub struct TrainSetup {
    /// The job.
    pub job_id: String,
    /// Membership generation.
    pub generation: u64,
    /// This rank.
    pub rank: u32,
    /// World size `W`.
    pub world_size: u32,
    /// The job spec.
    pub spec: JobSpec,
    /// The model config.
    pub config: BertConfig,
    /// Training sequences in the whole set.
    pub total_sequences: u64,
    /// This rank's shard.
    pub shard: PathBuf,
    /// The held-out shard.
    pub heldout: PathBuf,
    /// The tokenizer (tokenizer.json), for the special ids and vocabulary of masking.
    pub tokenizer: PathBuf,
    /// Where the starting weights and optimizer state come from.
    pub initial: InitialState,
    /// Steps already completed: the loop runs `start_step..max_steps`.
    pub start_step: u64,
    /// Sequences per step, fixed for the job's life (`B`; 0 = `W * b * k`).
    pub global_batch_size: u64,
    /// GEMM precision the coordinator decided for the job.
    pub precision: Precision,
    /// Stage a checkpoint of `start_step` before the first step (rank 0).
    pub checkpoint_first: bool,
    /// Fault injection for tests: make this rank's loss at this 0-based step NaN.
    pub fault_nan_at_step: Option<u64>,
    /// Scratch folder for staging checkpoints.
    pub work_dir: PathBuf,
}

/// What the loop tells the reporter (in order).
#[derive(Debug)]
pub enum Event {
    /// A finished step's metrics (rank 0).
    Step(StepReport),
    /// An eval's results (rank 0).
    Eval(EvalReport),
    /// A checkpoint folder staged at `dir`, to upload (rank 0).
    Checkpoint {
        /// Steps completed.
        step: u64,
        /// The staged folder.
        dir: PathBuf,
    },
}

/// Why the loop stopped, with the step it was at.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The ring all-reduce failed (the error names the peer).
    #[error("step {step}: all-reduce: {source}")]
    AllReduce {
        /// 0-based step.
        step: u64,
        /// What the ring said.
        source: RingLinkError,
    },
    /// The model rejected a batch or buffer.
    #[error("step {step}: model: {source}")]
    Model {
        /// 0-based step.
        step: u64,
        /// The model's error.
        source: ModelError,
    },
    /// Data (shard, plan, vocabulary, masking) could not be used.
    #[error("step {step}: data: {message}")]
    Data {
        /// 0-based step.
        step: u64,
        /// What failed.
        message: String,
    },
    /// A checkpoint could not be written or weights read.
    #[error("step {step}: {message}")]
    Io {
        /// 0-based step.
        step: u64,
        /// What failed.
        message: String,
    },
    /// The job was stopped from outside (cancelled, suspended, shutting down).
    #[error("stopped at step {step}")]
    Stopped {
        /// 0-based step.
        step: u64,
    },
    /// Too many steps had a non-finite loss or gradient.
    #[error(
        "step {step}: the loss or gradient was not finite in {skipped} steps, more than \
         [train] max_skipped_steps = {max}: lower the learning rate or check the data"
    )]
    NonFinite {
        /// 0-based step.
        step: u64,
        /// Steps skipped so far, this one included.
        skipped: u64,
        /// The limit.
        max: u64,
    },
    /// The state broadcast that starts a generation failed.
    #[error("step {step}: receiving the state from rank {root}: {source}")]
    Broadcast {
        /// The step being resumed.
        step: u64,
        /// The broadcasting rank.
        root: u32,
        /// What failed.
        source: BroadcastError,
    },
}

impl TrainError {
    /// Whether a new generation can go on after this error (a ring peer was lost or the job
    /// was stopped from outside) rather than the job itself being broken.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            TrainError::AllReduce { .. }
                | TrainError::Stopped { .. }
                | TrainError::Broadcast {
                    source: BroadcastError::Ring(_),
                    ..
                }
        )
    }
}

fn data_err(step: u64) -> impl Fn(String) -> TrainError {
    move |message| TrainError::Data { step, message }
}

/// The per-rank data pipeline: shard + plan + masking -> micro-batches.
struct Pipeline {
    shard: ShardReader,
    plan: WorkerPlan,
    masking: MaskingConfig,
    vocab: MaskingVocab,
    seed: u64,
    /// Every batch is padded to `max_seq_length`: shapes then do not depend on how the global
    /// batch is split, which keeps 1 worker and N workers equal.
    pad_to: usize,
}

impl Pipeline {
    /// Micro-batch `j` of this rank at `step`.
    fn micro_batch(&self, step: u64, j: u32) -> Result<Batch, TrainError> {
        let err = data_err(step);
        let mb = self
            .plan
            .micro_batch(step, j)
            .map_err(|e| err(e.to_string()))?;
        let mut masked = Vec::with_capacity(mb.sequence_indices.len());
        for &g in &mb.sequence_indices {
            let seq = self
                .shard
                .find_global(g)
                .ok_or_else(|| err(format!("sequence {g} is not in this rank's shard")))?;
            let m = mask_sequence(&seq, self.seed, mb.epoch, &self.masking, &self.vocab);
            masked.push((seq, m));
        }
        collate(&masked, &mb.sample_ids, self.pad_to).map_err(|e| err(e.to_string()))
    }
}

/// Builds this rank's starting replica (protocol steps 7 and 14): from the seed or HF weights,
/// from a checkpoint, or from memory plus a broadcast from the root rank.
///
/// Errors: [`TrainError::Io`] for unreadable weights or optimizer state,
/// [`TrainError::Broadcast`], [`TrainError::Data`] when no rank can be the root.
fn starting_replica(
    setup: &mut TrainSetup,
    layout: &ParamLayout,
    ring: &RingLink,
) -> Result<Replica, TrainError> {
    let t = &setup.spec.train;
    let step = setup.start_step;
    let io = |message: String| TrainError::Io { step, message };
    let fresh_optimizer = || optimizer_for(t, layout);
    match std::mem::replace(&mut setup.initial, InitialState::Init { weights: None }) {
        InitialState::Init { weights } => {
            let params = match &weights {
                Some(path) => keel_proto::weights::load_safetensors(path, layout)
                    .map_err(|e| io(format!("{}: {e}", path.display())))?,
                None => init_params(&setup.config, layout, t.seed),
            };
            Ok(Replica {
                step: 0,
                params,
                optimizer: fresh_optimizer(),
                skipped_steps: 0,
            })
        }
        InitialState::Checkpoint {
            weights,
            optimizer,
            state,
        } => {
            let params = keel_proto::weights::load_safetensors(&weights, layout)
                .map_err(|e| io(format!("{}: {e}", weights.display())))?;
            let mut opt = fresh_optimizer();
            crate::optim_state::load(&optimizer, opt.as_mut(), &t.optimizer)
                .map_err(|e| io(e.to_string()))?;
            let skipped_steps = match &state {
                Some(path) => {
                    let text = std::fs::read_to_string(path)
                        .map_err(|e| io(format!("{}: {e}", path.display())))?;
                    serde_json::from_str::<TrainerState>(&text)
                        .map_err(|e| io(format!("{}: {e}", path.display())))?
                        .skipped_steps
                }
                None => 0,
            };
            Ok(Replica {
                step,
                params,
                optimizer: opt,
                skipped_steps,
            })
        }
        InitialState::Memory { held, root_rank } => {
            let is_root = setup.rank == root_rank;
            let mut replica = match held {
                Some(r) if r.step == step => r,
                other => {
                    if is_root {
                        return Err(TrainError::Data {
                            step,
                            message: format!(
                                "this rank was named to broadcast step {step} but holds {}",
                                other.map_or("nothing".to_string(), |r| format!("step {}", r.step))
                            ),
                        });
                    }
                    Replica {
                        step,
                        params: vec![0.0; layout.total_len()],
                        optimizer: fresh_optimizer(),
                        skipped_steps: 0,
                    }
                }
            };
            if setup.world_size > 1 {
                broadcast(ring, step, is_root, &mut replica).map_err(|source| {
                    TrainError::Broadcast {
                        step,
                        root: root_rank,
                        source,
                    }
                })?;
            }
            Ok(replica)
        }
    }
}

/// Runs the job's steps `start_step..max_steps` on this rank. Returns how it ended and the
/// rank's replica, which is always consistent (a whole number of steps) when it exists: the
/// optimizer update is the last thing a step does before counting it, and nothing after it
/// can fail half-way.
///
/// Errors: [`TrainError`] with the step it happened at; see [`TrainError::is_recoverable`].
pub fn train(
    mut setup: TrainSetup,
    ring: RingLink,
    events: UnboundedSender<Event>,
    control: &JobControl,
    progress: &AtomicU64,
    ring_busy_us: &AtomicU64,
) -> (Result<(), TrainError>, Option<Replica>) {
    let config = setup.config.clone();
    let layout = ParamLayout::bert(&config, config.heads());
    let mut replica = match starting_replica(&mut setup, &layout, &ring) {
        Ok(r) => r,
        Err(e) => return (Err(e), None),
    };
    progress.store(replica.step, Ordering::SeqCst);
    let result = run_steps(
        &setup,
        &layout,
        &mut replica,
        &ring,
        &events,
        control,
        progress,
        ring_busy_us,
    );
    (result, Some(replica))
}

/// The loop of [`train`] over an initialised replica.
#[allow(clippy::too_many_arguments)]
fn run_steps(
    setup: &TrainSetup,
    layout: &ParamLayout,
    replica: &mut Replica,
    ring: &RingLink,
    events: &UnboundedSender<Event>,
    control: &JobControl,
    progress: &AtomicU64,
    ring_busy_us: &AtomicU64,
) -> Result<(), TrainError> {
    let spec = &setup.spec;
    let t = &spec.train;
    let err0 = data_err(replica.step);
    let config = &setup.config;
    let mut model =
        Bert::<f32>::new(config, config.heads()).map_err(|source| TrainError::Model {
            step: replica.step,
            source,
        })?;
    model.set_precision(setup.precision);
    tracing::info!(
        job = %setup.job_id,
        rank = setup.rank,
        precision = %setup.precision,
        backend = crate::model::bf16_backend_name(setup.precision),
        "training GEMMs in {}",
        setup.precision
    );
    let mut grads = vec![0f32; layout.total_len()];
    let schedule = schedule_for(t);

    let tokenizer = KeelTokenizer::from_tokenizer_json(&setup.tokenizer)
        .map_err(|e| err0(format!("{}: {e}", setup.tokenizer.display())))?;
    let nsp = spec.data.objective == Objective::MlmNsp;
    let global_batch = if setup.global_batch_size > 0 {
        setup.global_batch_size
    } else {
        spec.global_batch(setup.world_size as usize) as u64
    };
    let pipeline = Pipeline {
        shard: ShardReader::open(&setup.shard)
            .map_err(|e| err0(format!("{}: {e}", setup.shard.display())))?,
        plan: WorkerPlan::with_global_batch(
            setup.total_sequences,
            global_batch,
            setup.world_size,
            setup.rank,
            t.micro_batch_size as u32,
        )
        .map_err(|e| err0(e.to_string()))?,
        masking: MaskingConfig {
            masked_lm_prob: spec.data.masked_lm_prob,
            max_predictions_per_seq: spec.data.max_predictions_per_seq,
            whole_word: spec.data.whole_word_masking,
            mode: match spec.data.dupe_factor {
                0 => MaskingMode::Dynamic,
                d => MaskingMode::Static {
                    dupe_factor: u64::from(d),
                },
            },
        },
        vocab: MaskingVocab::from_tokenizer(&tokenizer),
        seed: t.seed,
        pad_to: spec.data.max_seq_length,
    };
    let heldout = ShardReader::open(&setup.heldout)
        .map_err(|e| err0(format!("{}: {e}", setup.heldout.display())))?;
    // One rank has nothing to overlap: the word embeddings keep their whole gradient.
    let split_lookup = setup.world_size > 1;
    let mut buckets = Buckets::new(&model.ready_ranges(split_lookup), BUCKET_ELEMS);
    let word_range = layout
        .find("bert.embeddings.word_embeddings.weight")
        .map(|e| e.range())
        .ok_or_else(|| err0("the parameter layout has no word embeddings".into()))?;
    let k = pipeline.plan.grad_accum();
    // Whether the last step sent the word embeddings' gradient in two parts (logged on change).
    let mut last_split: Option<bool> = None;

    if setup.rank == 0 && setup.checkpoint_first {
        let dir = stage_checkpoint(setup, layout, replica, f64::NAN, global_batch)?;
        let _ = events.send(Event::Checkpoint {
            step: replica.step,
            dir,
        });
    }

    while replica.step < t.max_steps {
        let step = replica.step;
        if control.is_stopped() {
            return Err(TrainError::Stopped { step });
        }
        let ring_err = |source| TrainError::AllReduce { step, source };
        let model_err = |source| TrainError::Model { step, source };
        let started = Instant::now();
        let busy_before = ring_busy_us.load(Ordering::Relaxed);

        let batches = (0..k)
            .map(|j| pipeline.micro_batch(step, j))
            .collect::<Result<Vec<_>, _>>()?;
        let local_masked: usize = batches.iter().map(|b| b.masked_positions.len()).sum();
        let local_nsp: usize = if nsp {
            batches.iter().map(Batch::batch_size).sum()
        } else {
            0
        };
        let local_tokens: usize = batches.iter().map(Batch::real_tokens).sum();
        let mut counts = vec![local_masked as f32, local_nsp as f32, local_tokens as f32];
        if split_lookup {
            counts.extend(token_presence(&batches, config.vocab_size));
        }
        let counts = ring
            .all_reduce(step, COUNTS_BUCKET, counts)
            .map_err(ring_err)?;
        let (global_masked, global_nsp, global_tokens) = (counts[0], counts[1], counts[2]);
        // Split only while the rows are at most half the vocabulary: beyond that the extra
        // `[u, c]` all-reduce would cost more than the overlap saves. Every rank holds the
        // same presence sums, so every rank decides the same way.
        let mut lookup = split_lookup
            .then(|| LookupGrads::<f32>::from_presence(&counts[3..], config.hidden_size));
        if let Some(l) = &lookup {
            let (rows, split) = (l.ids().len(), 2 * l.ids().len() <= config.vocab_size);
            if last_split != Some(split) {
                tracing::info!(
                    step,
                    rows,
                    vocab = config.vocab_size,
                    "word embeddings' gradient: {}",
                    if split {
                        "in two parts (decoder share early, the lookup's rows at the end)"
                    } else {
                        "in one piece at the end (the lookup's rows exceed half the vocabulary)"
                    }
                );
                last_split = Some(split);
            }
            if !split {
                lookup = None;
            }
        }
        let opts_for = |last: bool| StepOptions {
            mlm_scale: if global_masked > 0.0 {
                1.0 / global_masked
            } else {
                0.0
            },
            nsp_scale: if global_nsp > 0.0 {
                1.0 / global_nsp
            } else {
                0.0
            },
            dropout: Some(DropoutKey { seed: t.seed, step }),
            report_ready: last,
        };

        let compute_started = Instant::now();
        grads.fill(0.0);
        buckets.begin();
        let mut sums = [0f64; 4];
        for (j, batch) in batches.iter().enumerate() {
            let opts = opts_for(j + 1 == batches.len());
            let mut on_ready = |range, data: &[f32]| buckets.ready(range, data, ring, step);
            let s = match lookup.as_mut() {
                Some(lookup) => model.forward_backward_split_lookup(
                    &replica.params,
                    &mut grads,
                    lookup,
                    batch,
                    &opts,
                    &mut on_ready,
                ),
                None => {
                    model.forward_backward(&replica.params, &mut grads, batch, &opts, &mut on_ready)
                }
            }
            .map_err(model_err)?;
            sums[0] += f64::from(s.mlm_loss_sum);
            sums[1] += s.mlm_correct as f64;
            sums[2] += f64::from(s.nsp_loss_sum);
            sums[3] += s.nsp_correct as f64;
        }
        if setup.fault_nan_at_step == Some(step) {
            tracing::warn!(step, "fault injection: this rank's loss is NaN");
            sums[0] = f64::NAN;
        }
        let compute_done = Instant::now();
        // Submitted in the same order on every rank: the lookup rows, then what backward did
        // not report (nothing, normally).
        let lookup_sum = lookup
            .as_mut()
            .map(|l| ring.submit(step, LOOKUP_BUCKET, l.take_grads()));
        buckets.flush(&grads, ring, step);
        buckets.finish(&mut grads).map_err(ring_err)?;
        if let (Some(lookup), Some(sum)) = (lookup.as_mut(), lookup_sum) {
            lookup
                .set_grads(sum.wait().map_err(ring_err)?)
                .map_err(model_err)?;
            lookup
                .add_into(&mut grads[word_range.clone()])
                .map_err(model_err)?;
        }
        let loss = ring
            .all_reduce(step, LOSS_BUCKET, sums.iter().map(|&x| x as f32).collect())
            .map_err(ring_err)?;
        let allreduce_wait = compute_done.elapsed();

        // Every rank holds the same sums, so every rank takes the same decision here.
        let grad_norm = global_norm(&grads);
        let finite = grad_norm.is_finite() && loss.iter().all(|x| x.is_finite());
        let lr = schedule.lr(step);
        if finite {
            if t.max_grad_norm > 0.0 {
                clip_grad_norm(&mut grads, t.max_grad_norm as f32);
            }
            replica.optimizer.step(&mut replica.params, &grads, lr);
        } else {
            replica.skipped_steps += 1;
            tracing::warn!(
                step,
                skipped = replica.skipped_steps,
                "non-finite loss or gradient: update skipped"
            );
            if replica.skipped_steps > t.max_skipped_steps {
                return Err(TrainError::NonFinite {
                    step,
                    skipped: replica.skipped_steps,
                    max: t.max_skipped_steps,
                });
            }
        }
        let done = step + 1;
        replica.step = done;
        progress.store(done, Ordering::SeqCst);

        let step_seconds = started.elapsed().as_secs_f64();
        let mlm_loss = f64::from(loss[0]) / f64::from(global_masked.max(1.0));
        let nsp_loss = if nsp {
            f64::from(loss[2]) / f64::from(global_nsp.max(1.0))
        } else {
            0.0
        };
        let ring_seconds = (ring_busy_us.load(Ordering::Relaxed) - busy_before) as f64 * 1e-6;
        let key = TrainingKey {
            job_id: setup.job_id.clone(),
            generation: setup.generation,
            step: done,
        };
        if setup.rank == 0 {
            let report = StepReport {
                key: Some(key.clone()),
                rank: setup.rank,
                loss: mlm_loss + nsp_loss,
                mlm_loss,
                nsp_loss,
                mlm_accuracy: f64::from(loss[1]) / f64::from(global_masked.max(1.0)),
                learning_rate: f64::from(lr),
                grad_norm: f64::from(grad_norm),
                tokens_per_second: f64::from(global_tokens) / step_seconds.max(1e-9),
                step_seconds,
                allreduce_seconds: ring_seconds,
                tokens: global_tokens as u64,
                skipped: !finite,
                skipped_steps: replica.skipped_steps,
            };
            tracing::info!(
                "step {done} | loss {:.4} | lr {:.1e} | {:.0} ms | {:.1}k tok/s | setup {:.0} ms | compute {:.0} ms | allreduce {:.0} ms (waited {:.0} ms)",
                report.loss,
                lr,
                step_seconds * 1e3,
                report.tokens_per_second / 1e3,
                (compute_started - started).as_secs_f64() * 1e3,
                (compute_done - compute_started).as_secs_f64() * 1e3,
                ring_seconds * 1e3,
                allreduce_wait.as_secs_f64() * 1e3
            );
            let _ = events.send(Event::Step(report));
        }
        let last = done == t.max_steps;
        if (t.eval_every > 0 && done.is_multiple_of(t.eval_every)) || last {
            let report = evaluate(
                setup,
                &mut model,
                &replica.params,
                &heldout,
                &pipeline,
                ring,
                done,
            )?;
            if setup.rank == 0 {
                tracing::info!(
                    "eval at step {done} | mlm loss {:.4} | accuracy {:.3} | perplexity {:.2}",
                    report.mlm_loss,
                    report.mlm_accuracy,
                    report.perplexity
                );
                let _ = events.send(Event::Eval(EvalReport {
                    key: Some(key.clone()),
                    ..report
                }));
            }
        }
        if setup.rank == 0
            && ((t.checkpoint_every > 0 && done.is_multiple_of(t.checkpoint_every)) || last)
        {
            let dir = stage_checkpoint(setup, layout, replica, mlm_loss + nsp_loss, global_batch)?;
            let _ = events.send(Event::Checkpoint { step: done, dir });
        }
    }
    Ok(())
}

/// The job's optimizer over `layout` (hyper-parameters from `[train]`).
pub fn optimizer_for(t: &TrainSpec, layout: &ParamLayout) -> Box<dyn Optimizer> {
    match t.optimizer {
        OptimizerKind::Adamw => Box::new(AdamW::<f32>::new(
            layout,
            AdamWConfig {
                beta1: t.adam_beta1,
                beta2: t.adam_beta2,
                eps: t.adam_epsilon,
                weight_decay: t.weight_decay,
                bias_correction: true,
            },
        )),
        OptimizerKind::Lamb => Box::new(Lamb::<f32>::new(
            layout,
            LambConfig {
                beta1: t.adam_beta1,
                beta2: t.adam_beta2,
                eps: t.adam_epsilon,
                weight_decay: t.weight_decay,
            },
        )),
    }
}

/// The job's learning-rate schedule (warmup, then `[train] schedule` to 0 at `max_steps`).
pub fn schedule_for(t: &TrainSpec) -> LrSchedule {
    LrSchedule {
        kind: match t.schedule {
            keel_proto::jobspec::ScheduleKind::Linear => ScheduleKind::Linear,
            keel_proto::jobspec::ScheduleKind::Poly => ScheduleKind::Poly {
                power: t.poly_power,
            },
            keel_proto::jobspec::ScheduleKind::Constant => ScheduleKind::Constant,
        },
        peak_lr: t.learning_rate,
        warmup_steps: t.warmup_steps,
        total_steps: t.max_steps,
    }
}

/// Evaluates the held-out set: rank r takes sequences `r, r + W, ...` (at most
/// [`EVAL_MAX_SEQUENCES`] in all), masked with a fixed seed; the sums are all-reduced.
/// Every rank takes part, even one with no sequences.
///
/// Errors: [`TrainError`] at `step`.
fn evaluate(
    setup: &TrainSetup,
    model: &mut Bert<f32>,
    params: &[f32],
    heldout: &ShardReader,
    pipeline: &Pipeline,
    ring: &RingLink,
    step: u64,
) -> Result<EvalReport, TrainError> {
    let err = data_err(step);
    let n = heldout.len().min(EVAL_MAX_SEQUENCES);
    let mine: Vec<usize> = (setup.rank as usize..n)
        .step_by(setup.world_size.max(1) as usize)
        .collect();
    let mut sums = [0f64; 3];
    for chunk in mine.chunks(setup.spec.train.micro_batch_size.max(1)) {
        let mut masked = Vec::with_capacity(chunk.len());
        let mut ids = Vec::with_capacity(chunk.len());
        for &i in chunk {
            let seq = heldout.get(i).map_err(|e| err(e.to_string()))?;
            ids.push(seq.global_index);
            let m = mask_sequence(
                &seq,
                pipeline.seed ^ EVAL_SEED_SALT,
                0,
                &pipeline.masking,
                &pipeline.vocab,
            );
            masked.push((seq, m));
        }
        let batch = collate(&masked, &ids, pipeline.pad_to).map_err(|e| err(e.to_string()))?;
        let s = model
            .forward_loss(params, &batch)
            .map_err(|source| TrainError::Model { step, source })?;
        sums[0] += f64::from(s.mlm_loss_sum);
        sums[1] += s.mlm_count as f64;
        sums[2] += s.mlm_correct as f64;
    }
    let total = ring
        .all_reduce(step, EVAL_BUCKET, sums.iter().map(|&x| x as f32).collect())
        .map_err(|source| TrainError::AllReduce { step, source })?;
    let count = f64::from(total[1]).max(1.0);
    let mlm_loss = f64::from(total[0]) / count;
    Ok(EvalReport {
        key: None,
        rank: setup.rank,
        mlm_loss,
        mlm_accuracy: f64::from(total[2]) / count,
        perplexity: mlm_loss.exp(),
        masked_tokens: total[1] as u64,
    })
}

/// Writes `model.safetensors`, the optimizer state and `trainer_state.json` into a fresh
/// folder under the work dir; returns it.
///
/// Errors: [`TrainError::Io`].
fn stage_checkpoint(
    setup: &TrainSetup,
    layout: &ParamLayout,
    replica: &Replica,
    loss: f64,
    global_batch: u64,
) -> Result<PathBuf, TrainError> {
    let step = replica.step;
    if let Some(name) = first_non_finite(layout, &replica.params) {
        return Err(TrainError::Io {
            step,
            message: format!("refusing to checkpoint: {name} holds a non-finite value"),
        });
    }
    let io = |message: String| TrainError::Io { step, message };
    let dir = setup.work_dir.join(format!("checkpoint-{step}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| io(format!("{}: {e}", dir.display())))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| io(format!("{}: {e}", dir.display())))?;
    keel_proto::weights::save_safetensors(
        dir.join(keel_proto::checkpoint::MODEL_FILE),
        layout,
        &replica.params,
    )
    .map_err(|e| io(format!("saving weights: {e}")))?;
    crate::optim_state::save(
        &dir.join(OPTIMIZER_FILE),
        replica.optimizer.as_ref(),
        &setup.spec.train.optimizer,
    )
    .map_err(|e| io(format!("saving optimizer state: {e}")))?;
    let state = TrainerState {
        step,
        job_id: setup.job_id.clone(),
        generation: setup.generation,
        seed: setup.spec.train.seed,
        world_size: setup.world_size,
        global_batch_size: global_batch,
        sequences_seen: step * global_batch,
        loss,
        optimizer: match setup.spec.train.optimizer {
            OptimizerKind::Adamw => "adamw".into(),
            OptimizerKind::Lamb => "lamb".into(),
        },
        skipped_steps: replica.skipped_steps,
        precision: setup.precision,
    };
    let text = serde_json::to_string_pretty(&state).map_err(|e| io(e.to_string()))?;
    write_file_atomic(&dir.join(TRAINER_STATE_FILE), text.as_bytes())
        .map_err(|e| io(e.to_string()))?;
    Ok(dir)
}

/// The name of the first parameter tensor holding a NaN or an infinity, if any.
fn first_non_finite(layout: &ParamLayout, params: &[f32]) -> Option<String> {
    layout
        .entries()
        .iter()
        .find(|e| params[e.range()].iter().any(|x| !x.is_finite()))
        .map(|e| e.name.clone())
}

/// `[v]` flags, 1 for every token id that occurs in `batches` (padding included: its lookup
/// adds a gradient row too), else 0. Summed over ranks, positive entries are the word
/// embeddings' lookup-gradient rows of the step.
fn token_presence(batches: &[Batch], vocab_size: usize) -> Vec<f32> {
    let mut presence = vec![0.0f32; vocab_size];
    for id in batches.iter().flat_map(|b| b.input_ids.iter()) {
        // The model refuses out-of-range ids with a clear error; skip them here.
        if let Some(p) = presence.get_mut(*id as usize) {
            *p = 1.0;
        }
    }
    presence
}
