//! [`Trainer`]: one rank's training loop, a step at a time (protocol step 8).
//!
//! A step: this rank's micro-batches; all-reduce the counts; forward/backward every
//! micro-batch with `mlm_scale = 1 / global masked count`, gradient buckets going to the ring
//! as backward finishes them; wait for the summed gradient; all-reduce the loss sums; clip and
//! update (every rank holds the same sums, so every rank applies the same update); report;
//! evaluate and stage a checkpoint when due.
//!
//! With `train.shard_optimizer` (ZeRO stage 1, `super::sharding`) the buckets go as
//! reduce-scatters, the clipping norm and LAMB's norms are summed across ranks, each rank
//! updates its own chunks, and the weights are all-gathered; checkpoints gather the moments.
//!
//! With `[diloco]` a step is local: the loss is this rank's mean, no gradient is all-reduced,
//! the update uses this rank's gradient, and every `inner_steps` steps the round ends with
//! DiLoCo's outer step (`super::outer`). Only the counts and loss sums (a few floats, for the
//! report) cross the ring on the other steps.
//!
//! Shape legend: `b` micro-batch size (sequences), `k` gradient accumulation steps, `W` world
//! size, `P` parameters (flat buffer length), `v` vocabulary, `c` hidden size.

use super::checkpoint::stage_checkpoint;
use super::collectives::{
    LossCounts, LossSums, StepCounts, all_reduce_counts, lookup_rows, split_pays,
    submit_lookup_rows,
};
use super::error::{TrainError, model_err, ring_err};
use super::outer::{Snapshot, outer_step};
use super::phase::PhaseState;
use super::setup::{Event, TrainSetup};
use super::sharding::Sharding;
use super::summary::RankTotals;
use crate::batch::Batch;
use crate::buckets::Buckets;
use crate::control::JobControl;
use crate::model::{Bert, DropoutKey, LookupGrads, StepOptions};
use crate::optim::{clip_grad_norm, global_norm};
use crate::replica::Replica;
use crate::ringlink::RingLink;
use keel_proto::diloco::DilocoSpec;
use keel_proto::jobspec::Objective;
use keel_proto::params::ParamLayout;
use keel_proto::rpc::{EvalReport, StepReport, TrainingKey};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What the loop talks to outside its own math.
pub struct Links<'a> {
    /// The ring all-reduce.
    pub ring: RingLink,
    /// Reports and checkpoints for the reporter, in order.
    pub events: UnboundedSender<Event>,
    /// Stops the job from outside.
    pub control: &'a JobControl,
    /// Steps completed (read by heartbeats).
    pub progress: &'a AtomicU64,
    /// Microseconds the ring has been busy (for the step's all-reduce time).
    pub ring_busy_us: &'a AtomicU64,
}

/// One rank's training loop over a replica, with everything a step reuses.
pub struct Trainer<'a> {
    setup: TrainSetup,
    layout: ParamLayout,
    model: Bert<f32>,
    /// The step's gradient, `[P]`.
    grads: Vec<f32>,
    /// The training phase the loop is in: its data, held-out set, schedule, global batch.
    phase: PhaseState,
    buckets: Buckets,
    /// The word embeddings' range `[v * c]` of the flat buffers.
    word_range: Range<usize>,
    /// The objective has NSP.
    nsp: bool,
    /// Several ranks: the word embeddings' gradient may travel in two parts.
    split_lookup: bool,
    /// Whether the last step sent the word embeddings' gradient in two parts (logged on change).
    last_split: Option<bool>,
    /// DiLoCo's settings: local steps, an outer step every `inner_steps` (`None`: synchronous).
    diloco: Option<DilocoSpec>,
    /// ZeRO stage 1 (`train.shard_optimizer`): the chunks this rank updates.
    sharding: Option<Sharding>,
    /// Step and optimizer times of this generation, logged when its steps end.
    totals: RankTotals,
    /// A sharded update failed half-way: the replica holds no whole step.
    torn: bool,
    links: Links<'a>,
}

/// What the optimizer did in a step.
struct Update {
    lr: f32,
    grad_norm: f32,
    finite: bool,
    /// Time the weights' all-gather took (`train.shard_optimizer`; zero without).
    gather: std::time::Duration,
}

/// When a step's phases began, for its report.
struct Clock {
    started: Instant,
    busy_before: u64,
    compute_started: Instant,
    compute_done: Instant,
}

impl<'a> Trainer<'a> {
    /// Builds the model, the pipeline and the evaluator of `setup` over `layout`, to go on
    /// from a replica at `step` (which names the step in errors).
    ///
    /// Errors: [`TrainError::Model`] for a config the model refuses; [`TrainError::Data`] for
    /// an unreadable tokenizer, shard or held-out shard, or a plan that does not fit.
    pub fn new(
        setup: TrainSetup,
        layout: ParamLayout,
        step: u64,
        links: Links<'a>,
    ) -> Result<Self, TrainError> {
        let config = &setup.config;
        let mut model = Bert::<f32>::new(config, config.heads()).map_err(model_err(step))?;
        model.set_precision(setup.precision);
        tracing::info!(
            job = %setup.job_id,
            rank = setup.rank,
            precision = %setup.precision,
            backend = crate::model::bf16_backend_name(setup.precision),
            "training GEMMs in {}",
            setup.precision
        );
        let phase = PhaseState::open(&setup, step)?;
        let diloco = setup.spec.diloco.clone();
        let split_lookup = setup.splits_lookup();
        let wire = setup.spec.train.allreduce_dtype.wire();
        let buckets = Buckets::new(
            &model.ready_ranges(split_lookup),
            setup.bucket_elems(),
            wire,
        );
        // ZeRO stage 1: the buckets go as reduce-scatters, each rank keeping its chunks.
        let (buckets, sharding) = if setup.spec.train.shard_optimizer {
            let (world, rank) = (setup.world_size as usize, setup.rank as usize);
            let buckets = buckets.reduce_scatter(world, rank);
            let sharding = Sharding::new(buckets.ranges().to_vec(), world, rank);
            (buckets, Some(sharding))
        } else {
            (buckets, None)
        };
        let word_range = model.word_embeddings_range();
        Ok(Self {
            grads: vec![0f32; layout.total_len()],
            phase,
            nsp: setup.spec.data.objective == Objective::MlmNsp,
            setup,
            layout,
            model,
            buckets,
            word_range,
            split_lookup,
            last_split: None,
            diloco,
            sharding,
            totals: RankTotals::default(),
            torn: false,
            links,
        })
    }

    /// Runs steps `replica.step..max_steps` (after staging a checkpoint of the start when
    /// asked). The replica stays consistent (a whole number of steps) whatever happens: the
    /// optimizer update is the last thing a step does before counting it.
    ///
    /// Errors: [`TrainError`] with the step it happened at; [`TrainError::Stopped`] when the
    /// job is stopped from outside between steps.
    pub fn run(&mut self, replica: &mut Replica) -> Result<(), TrainError> {
        if self.setup.checkpoint_first {
            self.checkpoint(replica, f64::NAN)?;
        }
        while replica.step < self.setup.spec.train.max_steps {
            if self.links.control.is_stopped() {
                return Err(TrainError::Stopped { step: replica.step });
            }
            self.step(replica)?;
        }
        let state_bytes: usize = replica
            .optimizer
            .state()
            .iter()
            .map(|(_, s)| std::mem::size_of_val(*s))
            .sum();
        let sharded = self.sharding.is_some();
        let (job, rank) = (&self.setup.job_id, self.setup.rank);
        self.totals.log(job, rank, sharded, state_bytes);
        Ok(())
    }

    /// One optimizer step of `replica`, then its report, eval and checkpoint when due.
    ///
    /// Errors: [`TrainError`] at this step; the replica is updated only if none occurred
    /// before the update.
    pub fn step(&mut self, replica: &mut Replica) -> Result<(), TrainError> {
        let step = replica.step;
        self.enter_phase(step)?;
        let (started, busy_before) = (Instant::now(), self.ring_busy());
        let batches = self.phase.pipeline.micro_batches(step)?;
        let presence = self.split_lookup.then_some(self.setup.config.vocab_size);
        let counts = all_reduce_counts(&self.links.ring, step, &batches, self.nsp, presence)
            .map_err(ring_err(step))?;
        let mut lookup = self.lookup_rows(step, &counts);
        let compute_started = Instant::now();
        // The loss is averaged over the global batch, or over this rank's with DiLoCo.
        let LossCounts { masked, nsp } = match self.diloco {
            None => LossCounts::global(&counts),
            Some(_) => LossCounts::local(&batches, self.nsp),
        };
        let sums = self.forward_backward(replica, step, &batches, masked, nsp, lookup.as_mut())?;
        let compute_done = Instant::now();
        if self.diloco.is_none() {
            self.reduce_gradients(step, lookup.as_mut())?;
        }
        let loss = sums.all_reduce(&self.links.ring, step).map_err(ring_err(step))?;
        let allreduce_wait = compute_done.elapsed();
        let update_started = Instant::now();
        let ends_round = self.diloco.as_ref().is_some_and(|d| d.ends_round(step + 1));
        let before = ends_round.then(|| Snapshot::of(replica));
        let update = self.update(replica, step, &loss)?;
        if let Some(before) = before {
            let dtype = self.buckets.dtype();
            let world = self.setup.world_size;
            if let Err(e) = outer_step(&self.links.ring, step, world, dtype, replica) {
                before.restore(replica);
                return Err(ring_err(step)(e));
            }
        }
        let optimizer = update_started.elapsed();
        self.totals.add(started.elapsed(), optimizer, update.gather);
        replica.step = step + 1;
        self.links.progress.store(replica.step, Ordering::SeqCst);
        let clock = Clock {
            started,
            busy_before,
            compute_started,
            compute_done,
        };
        crate::telemetry::record_step(
            &self.setup.job_id,
            self.setup.rank,
            replica.step,
            crate::telemetry::StepTimes {
                total: started.elapsed().as_secs_f64(),
                compute: (compute_done - compute_started).as_secs_f64(),
                ring_wait: allreduce_wait.as_secs_f64(),
                optimizer: optimizer.as_secs_f64(),
            },
        );
        let mean_loss = self.report(replica, &counts, &loss, &update, &clock, allreduce_wait);
        self.evaluate_and_checkpoint(replica, mean_loss)
    }

    /// Opens the phase of `step` when the loop is not in it yet: on every rank at the same
    /// step, the phase's first (`keel_proto::phases`).
    ///
    /// Errors: as [`PhaseState::open`].
    fn enter_phase(&mut self, step: u64) -> Result<(), TrainError> {
        if self.setup.spec.phase_at(step) == self.phase.index {
            return Ok(());
        }
        self.phase = PhaseState::open(&self.setup, step)?;
        let view = self.setup.spec.phase_view(self.phase.index);
        tracing::info!(
            job = %self.setup.job_id,
            rank = self.setup.rank,
            step,
            "phase {} of {} begins: max_seq_length {}, max_predictions_per_seq {}, global batch {}, \
             learning_rate {} after {} warmup steps",
            self.phase.index + 1,
            self.setup.spec.phase_count(),
            view.data.max_seq_length,
            view.data.max_predictions_per_seq,
            self.phase.global_batch,
            view.train.learning_rate,
            view.train.warmup_steps
        );
        Ok(())
    }

    fn ring_busy(&self) -> u64 {
        self.links.ring_busy_us.load(Ordering::Relaxed)
    }

    /// The step's lookup-gradient rows when the word embeddings' gradient travels in two
    /// parts (see [`lookup_rows`]); logs when that decision changes.
    fn lookup_rows(&mut self, step: u64, counts: &StepCounts) -> Option<LookupGrads<f32>> {
        let vocab = self.setup.config.vocab_size;
        let rows = lookup_rows(counts, self.setup.config.hidden_size)?;
        let split = split_pays(&rows, vocab);
        if self.last_split != Some(split) {
            tracing::info!(
                step,
                rows = rows.ids().len(),
                vocab,
                "word embeddings' gradient: {}",
                if split {
                    "in two parts (decoder share early, the lookup's rows at the end)"
                } else {
                    "in one piece at the end (the lookup's rows exceed half the vocabulary)"
                }
            );
            self.last_split = Some(split);
        }
        split.then_some(rows)
    }

    /// Zeroes the gradient and runs forward/backward over `batches`, the losses scaled by
    /// `1 / masked` and `1 / nsp` (the masked tokens and NSP labels they are averaged over),
    /// each finished gradient range going to its bucket (none with DiLoCo); returns this
    /// rank's loss sums.
    fn forward_backward(
        &mut self,
        replica: &Replica,
        step: u64,
        batches: &[Batch],
        masked: f32,
        nsp: f32,
        mut lookup: Option<&mut LookupGrads<f32>>,
    ) -> Result<LossSums, TrainError> {
        // The helpers stay hot for the forward and backward (`parallel::hot`).
        let _hot = crate::model::parallel::hot();
        let synchronous = self.diloco.is_none();
        let opts_for = |last: bool| StepOptions {
            mlm_scale: if masked > 0.0 { 1.0 / masked } else { 0.0 },
            nsp_scale: if nsp > 0.0 { 1.0 / nsp } else { 0.0 },
            dropout: Some(DropoutKey {
                seed: self.setup.spec.train.seed,
                step,
            }),
            report_ready: last && synchronous,
        };
        {
            let _zero = crate::model::pass_profile::region(
                crate::model::pass_profile::Pass::ZeroGradients,
                0,
                std::mem::size_of_val(&self.grads[..]),
            );
            crate::model::parallel::fill(&mut self.grads, 0.0);
        }
        self.buckets.begin();
        let mut sums = LossSums::default();
        for (j, batch) in batches.iter().enumerate() {
            let opts = opts_for(j + 1 == batches.len());
            let (buckets, ring) = (&mut self.buckets, &self.links.ring);
            let mut on_ready = |range, data: &[f32]| buckets.ready(range, data, ring, step);
            let (model, grads) = (&mut self.model, &mut self.grads);
            let s = match lookup.as_deref_mut() {
                Some(lookup) => model.forward_backward_split_lookup(
                    &replica.params,
                    grads,
                    lookup,
                    batch,
                    &opts,
                    &mut on_ready,
                ),
                None => model.forward_backward(&replica.params, grads, batch, &opts, &mut on_ready),
            }
            .map_err(model_err(step))?;
            sums.add(&s);
        }
        self.setup.faults.poison_loss(step, &mut sums.mlm_loss);
        Ok(sums)
    }

    /// Waits for the summed gradient `[P]`: sends the lookup rows, then what backward did not
    /// report (nothing, normally), in the same order on every rank, and adds the summed rows
    /// into the word embeddings' gradient.
    fn reduce_gradients(
        &mut self,
        step: u64,
        mut lookup: Option<&mut LookupGrads<f32>>,
    ) -> Result<(), TrainError> {
        let ring = &self.links.ring;
        let lookup_sum = lookup
            .as_deref_mut()
            .map(|l| submit_lookup_rows(ring, step, l, self.buckets.dtype()));
        self.buckets.flush(&self.grads, ring, step);
        self.buckets
            .finish(&mut self.grads)
            .map_err(ring_err(step))?;
        if let (Some(lookup), Some(sum)) = (lookup, lookup_sum) {
            lookup
                .set_grads(sum.wait().map_err(ring_err(step))?)
                .map_err(model_err(step))?;
            lookup
                .add_into(&mut self.grads[self.word_range.clone()])
                .map_err(model_err(step))?;
        }
        Ok(())
    }

    /// Clips the summed gradient and applies the optimizer, or skips the update when the
    /// loss or gradient is not finite (every rank holds the same sums, so every rank takes
    /// the same decision).
    ///
    /// Errors: [`TrainError::NonFinite`] past `[train] max_skipped_steps`.
    fn update(
        &mut self,
        replica: &mut Replica,
        step: u64,
        loss: &LossSums,
    ) -> Result<Update, TrainError> {
        let t = &self.setup.spec.train;
        let ring = &self.links.ring;
        let grad_norm = match &self.sharding {
            None => global_norm(&self.grads),
            Some(s) => s
                .grad_norm(&self.grads, ring, step)
                .map_err(ring_err(step))?,
        };
        let finite = grad_norm.is_finite() && loss.is_finite();
        let lr = self.phase.lr(step);
        let mut gather = std::time::Duration::ZERO;
        if finite {
            let max_norm = t.max_grad_norm as f32;
            let _hot = crate::model::parallel::hot();
            match &self.sharding {
                None => {
                    if max_norm > 0.0 {
                        clip_grad_norm(&mut self.grads, max_norm);
                    }
                    replica.optimizer.step(&mut replica.params, &self.grads, lr);
                }
                Some(s) => {
                    if max_norm > 0.0 {
                        s.clip(&mut self.grads, grad_norm, max_norm);
                    }
                    gather = s
                        .update(replica, &self.grads, lr, ring, step)
                        .map_err(|e| {
                            self.torn = true;
                            ring_err(step)(e)
                        })?;
                }
            }
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
        Ok(Update {
            lr,
            grad_norm,
            finite,
            gather,
        })
    }

    /// Logs and (rank 0) reports the finished step `replica.step`; returns its mean loss
    /// (MLM + NSP, nats).
    fn report(
        &self,
        replica: &Replica,
        counts: &StepCounts,
        loss: &LossSums,
        update: &Update,
        clock: &Clock,
        allreduce_wait: std::time::Duration,
    ) -> f64 {
        let step_seconds = clock.started.elapsed().as_secs_f64();
        let masked = f64::from(counts.masked().max(1.0));
        let mlm_loss = loss.mlm_loss / masked;
        let nsp_loss = if self.nsp {
            loss.nsp_loss / f64::from(counts.nsp().max(1.0))
        } else {
            0.0
        };
        if self.setup.rank != 0 {
            return mlm_loss + nsp_loss;
        }
        let ring_seconds = (self.ring_busy() - clock.busy_before) as f64 * 1e-6;
        let report = StepReport {
            key: Some(self.key(replica.step)),
            rank: self.setup.rank,
            loss: mlm_loss + nsp_loss,
            mlm_loss,
            nsp_loss,
            mlm_accuracy: loss.mlm_correct / masked,
            learning_rate: f64::from(update.lr),
            grad_norm: f64::from(update.grad_norm),
            tokens_per_second: f64::from(counts.tokens()) / step_seconds.max(1e-9),
            step_seconds,
            allreduce_seconds: ring_seconds,
            tokens: counts.tokens() as u64,
            skipped: !update.finite,
            skipped_steps: replica.skipped_steps,
            phase: self.phase.reported(&self.setup),
        };
        tracing::info!(
            "step {} | loss {:.4} | lr {:.1e} | {:.0} ms | {:.1}k tok/s | setup {:.0} ms | compute {:.0} ms | allreduce {:.0} ms (waited {:.0} ms)",
            replica.step,
            report.loss,
            update.lr,
            step_seconds * 1e3,
            report.tokens_per_second / 1e3,
            (clock.compute_started - clock.started).as_secs_f64() * 1e3,
            (clock.compute_done - clock.compute_started).as_secs_f64() * 1e3,
            ring_seconds * 1e3,
            allreduce_wait.as_secs_f64() * 1e3
        );
        let _ = self.links.events.send(Event::Step(report));
        mlm_loss + nsp_loss
    }

    /// Evaluates (every `eval_every` steps and at the end, all ranks, when the job has a
    /// held-out set) and stages a checkpoint
    /// (every `checkpoint_every` steps and at the end, rank 0) after `replica.step` steps.
    fn evaluate_and_checkpoint(
        &mut self,
        replica: &Replica,
        mean_loss: f64,
    ) -> Result<(), TrainError> {
        let t = &self.setup.spec.train;
        let done = replica.step;
        let last = done == t.max_steps;
        // Without a held-out set (`data.heldout_fraction = 0`) there is nothing to evaluate.
        let heldout = self.setup.spec.data.heldout_fraction > 0.0;
        if heldout && ((t.eval_every > 0 && done.is_multiple_of(t.eval_every)) || last) {
            let report = self.phase.eval.evaluate(
                &mut self.model,
                &replica.params,
                &self.phase.pipeline,
                &self.links.ring,
                done,
            )?;
            if self.setup.rank == 0 {
                tracing::info!(
                    "eval at step {done} | mlm loss {:.4} | accuracy {:.3} | perplexity {:.2}",
                    report.mlm_loss,
                    report.mlm_accuracy,
                    report.perplexity
                );
                let _ = self.links.events.send(Event::Eval(EvalReport {
                    key: Some(self.key(done)),
                    ..report
                }));
            }
        }
        if (t.checkpoint_every > 0 && done.is_multiple_of(t.checkpoint_every)) || last {
            self.checkpoint(replica, mean_loss)?;
        }
        Ok(())
    }

    /// Stages a checkpoint of `replica` (rank 0) whose step's mean loss was `loss`. Every rank
    /// calls it: with a sharded optimizer all take part in gathering the moments first.
    ///
    /// Errors: [`TrainError::Io`] from staging; a ring error while gathering.
    fn checkpoint(&mut self, replica: &Replica, loss: f64) -> Result<(), TrainError> {
        let step = replica.step;
        let is_root = self.setup.rank == 0;
        let gathered = match &self.sharding {
            Some(s) if !replica.optimizer.plan().is_full() => s
                .gather_optimizer_state(replica, is_root, &self.links.ring, step)
                .map_err(ring_err(step))?,
            _ => None,
        };
        if self.setup.rank != 0 {
            return Ok(());
        }
        let dir = stage_checkpoint(
            &self.setup,
            &self.layout,
            replica,
            gathered.as_deref(),
            loss,
            self.phase.global_batch,
        )?;
        let _ = self.links.events.send(Event::Checkpoint { step, dir });
        Ok(())
    }

    /// Whether a sharded update failed half-way, leaving the replica no whole step (it must
    /// not be kept).
    pub fn is_torn(&self) -> bool {
        self.torn
    }

    /// The training key of this generation after `step` steps.
    fn key(&self, step: u64) -> TrainingKey {
        TrainingKey {
            job_id: self.setup.job_id.clone(),
            generation: self.setup.generation,
            step,
        }
    }
}
