//! [`Trainer`]: one rank's training loop, a step at a time (protocol step 8).
//!
//! A step: this rank's micro-batches; all-reduce the counts; forward/backward every
//! micro-batch, the losses averaged over the counts the training mode says, gradient buckets
//! going to the ring as backward finishes them (when the mode sends any); the mode's sync of
//! the gradient; all-reduce the loss sums; the mode's update (every rank holds the same sums,
//! so every rank takes the same decision); report; evaluate and stage a checkpoint when due.
//!
//! The mode (plain data parallelism, ZeRO stage 1 with `train.shard_optimizer`, DiLoCo with
//! `[diloco]`) is a [`GradientSync`] (`super::sync`), chosen once in [`Trainer::new`]; the
//! step names none of them.
//!
//! Shape legend: `b` micro-batch size (sequences), `k` gradient accumulation steps, `W` world
//! size, `P` parameters (flat buffer length), `v` vocabulary, `c` hidden size.

use super::checkpoint::stage_checkpoint;
use super::collectives::{
    LossCounts, LossSums, StepCounts, all_reduce_counts, lookup_rows, split_pays,
};
use super::error::{TrainError, model_err, ring_err};
use super::phase::PhaseState;
use super::setup::{Event, TrainSetup};
use super::summary::RankTotals;
use super::sync::{GradientSync, Update, UpdateRule};
use crate::batch::Batch;
use crate::control::JobControl;
use crate::faults::Faults;
use crate::model::{Bert, DropoutKey, LookupGrads, StepOptions};
use crate::replica::Replica;
use crate::ringlink::RingLink;
use keel_proto::jobspec::Objective;
use keel_proto::params::ParamLayout;
use keel_proto::rpc::{EvalReport, StepReport, TrainingKey};
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
    /// The training mode: how the gradient is synchronised and the update applied.
    sync: Box<dyn GradientSync>,
    /// Test-only fault injection ([`Faults::none`] otherwise).
    faults: Faults,
    /// The objective has NSP.
    nsp: bool,
    /// Several ranks: the word embeddings' gradient may travel in two parts.
    split_lookup: bool,
    /// Whether the last step sent the word embeddings' gradient in two parts (logged on change).
    last_split: Option<bool>,
    /// Step and optimizer times of this generation, logged when its steps end.
    totals: RankTotals,
    links: Links<'a>,
}

/// When a step's parts began and ended, for its report.
struct Clock {
    started: Instant,
    /// The ring's busy time (µs) when the step began.
    busy_before: u64,
    compute_started: Instant,
    compute_done: Instant,
    /// The gradient and the loss sums synchronised.
    synced: Instant,
    /// The update applied.
    updated: Instant,
}

impl Clock {
    /// A step beginning now, the ring busy `busy_before` µs so far.
    fn start(busy_before: u64) -> Clock {
        let now = Instant::now();
        Clock {
            started: now,
            busy_before,
            compute_started: now,
            compute_done: now,
            synced: now,
            updated: now,
        }
    }
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
        let split_lookup = setup.splits_lookup();
        let sync = super::sync::for_job(
            &setup,
            &model.ready_ranges(split_lookup),
            model.word_embeddings_range(),
        );
        Ok(Self {
            grads: vec![0f32; layout.total_len()],
            phase,
            sync,
            faults: setup.faults.clone(),
            nsp: setup.spec.data.objective == Objective::MlmNsp,
            setup,
            layout,
            model,
            split_lookup,
            last_split: None,
            totals: RankTotals::default(),
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
        let sharded = self.sync.shards_optimizer();
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
        let mut clock = Clock::start(self.ring_busy());
        let batches = self.phase.pipeline.micro_batches(step)?;
        let (counts, mut lookup) = self.count(step, &batches)?;
        clock.compute_started = Instant::now();
        let local = self.forward_backward(replica, step, &batches, &counts, lookup.as_mut())?;
        clock.compute_done = Instant::now();
        let loss = self.synchronise(step, &local, lookup.as_mut())?;
        clock.synced = Instant::now();
        let update = self.update(replica, step, &loss)?;
        clock.updated = Instant::now();
        self.count_step(replica, &clock, &update);
        let mean_loss = self.report(replica, &counts, &loss, &update, &clock);
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

    /// The step's counts summed over ranks, and its lookup-gradient rows when the word
    /// embeddings' gradient travels in two parts (see [`lookup_rows`]; that decision is
    /// logged when it changes).
    ///
    /// Errors: [`TrainError::AllReduce`].
    fn count(
        &mut self,
        step: u64,
        batches: &[Batch],
    ) -> Result<(StepCounts, Option<LookupGrads<f32>>), TrainError> {
        let presence = self.split_lookup.then_some(self.setup.config.vocab_size);
        let counts = all_reduce_counts(&self.links.ring, step, batches, self.nsp, presence)
            .map_err(ring_err(step))?;
        let vocab = self.setup.config.vocab_size;
        let Some(rows) = lookup_rows(&counts, self.setup.config.hidden_size) else {
            return Ok((counts, None));
        };
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
        Ok((counts, split.then_some(rows)))
    }

    /// Zeroes the gradient and runs forward/backward over `batches`, the losses averaged over
    /// the counts the mode says (of the global batch, `counts`, or this rank's), each finished
    /// gradient range going to the mode's buckets (if it has any); returns this rank's loss
    /// sums (NaN when the fault injection says so).
    ///
    /// Errors: [`TrainError::Model`] for a batch the model refuses.
    fn forward_backward(
        &mut self,
        replica: &Replica,
        step: u64,
        batches: &[Batch],
        counts: &StepCounts,
        mut lookup: Option<&mut LookupGrads<f32>>,
    ) -> Result<LossSums, TrainError> {
        // The helpers stay hot for the forward and backward (`parallel::hot`).
        let _hot = crate::model::parallel::hot();
        let LossCounts { masked, nsp } = self.sync.loss_counts(counts, batches, self.nsp);
        {
            let _zero = crate::model::pass_profile::region(
                crate::model::pass_profile::Pass::ZeroGradients,
                0,
                std::mem::size_of_val(&self.grads[..]),
            );
            crate::model::parallel::fill(&mut self.grads, 0.0);
        }
        let mut buckets = self.sync.buckets();
        if let Some(b) = buckets.as_deref_mut() {
            b.begin();
        }
        // Only the last micro-batch finishes gradient ranges, and only a mode that sends them
        // wants to hear of it.
        let sends = buckets.is_some();
        let opts_for = |last: bool| StepOptions {
            mlm_scale: if masked > 0.0 { 1.0 / masked } else { 0.0 },
            nsp_scale: if nsp > 0.0 { 1.0 / nsp } else { 0.0 },
            dropout: Some(DropoutKey {
                seed: self.setup.spec.train.seed,
                step,
            }),
            report_ready: last && sends,
        };
        let mut sums = LossSums::default();
        for (j, batch) in batches.iter().enumerate() {
            let opts = opts_for(j + 1 == batches.len());
            let ring = &self.links.ring;
            let mut on_ready = |range, data: &[f32]| {
                if let Some(b) = buckets.as_deref_mut() {
                    b.ready(range, data, ring, step);
                }
            };
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
        self.faults.poison_loss(step, &mut sums.mlm_loss);
        Ok(sums)
    }

    /// The mode's sync of the gradient (see [`GradientSync::reduce`]), then this rank's loss
    /// sums `local` summed over ranks (every mode: the report and the skip decision use them).
    ///
    /// Errors: [`TrainError::AllReduce`]; [`TrainError::Model`] for lookup rows of another
    /// shape.
    fn synchronise(
        &mut self,
        step: u64,
        local: &LossSums,
        lookup: Option<&mut LookupGrads<f32>>,
    ) -> Result<LossSums, TrainError> {
        let ring = &self.links.ring;
        self.sync.reduce(&mut self.grads, lookup, ring, step)?;
        local.all_reduce(ring, step).map_err(ring_err(step))
    }

    /// The mode's update of `replica` from the synchronised gradient, at the phase's learning
    /// rate (see [`GradientSync::update`]).
    ///
    /// Errors: [`TrainError::NonFinite`] past `[train] max_skipped_steps`; a ring error.
    fn update(
        &mut self,
        replica: &mut Replica,
        step: u64,
        loss: &LossSums,
    ) -> Result<Update, TrainError> {
        let t = &self.setup.spec.train;
        let rule = UpdateRule {
            lr: self.phase.lr(step),
            max_grad_norm: t.max_grad_norm as f32,
            max_skipped_steps: t.max_skipped_steps,
        };
        let ring = &self.links.ring;
        self.sync
            .update(replica, &mut self.grads, loss, &rule, ring, step)
    }

    /// Counts the step done on `replica` (for heartbeats too) and records its times.
    fn count_step(&mut self, replica: &mut Replica, clock: &Clock, update: &Update) {
        let optimizer = clock.updated - clock.synced;
        self.totals
            .add(clock.started.elapsed(), optimizer, update.gather);
        replica.step += 1;
        self.links.progress.store(replica.step, Ordering::SeqCst);
        crate::telemetry::record_step(
            &self.setup.job_id,
            self.setup.rank,
            replica.step,
            crate::telemetry::StepTimes {
                total: clock.started.elapsed().as_secs_f64(),
                compute: (clock.compute_done - clock.compute_started).as_secs_f64(),
                ring_wait: (clock.synced - clock.compute_done).as_secs_f64(),
                optimizer: optimizer.as_secs_f64(),
            },
        );
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
    ) -> f64 {
        let allreduce_wait = clock.synced - clock.compute_done;
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
        let gathered =
            self.sync
                .gather_optimizer_state(replica, is_root, &self.links.ring, step)?;
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
        self.sync.is_torn()
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
