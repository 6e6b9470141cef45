//! What workers and users report: steps, evaluations, ranks done, failures, held state,
//! checkpoint uploads; and the user's cancel.

use super::phase::{Outcome, Phase, Stage};
use super::{Machine, Reply};
use crate::CoordinatorError;
use crate::layout;
use keel_proto::metrics::{EvalLine, MetricsLine, StepLine};
use keel_proto::rpc::{DoneReport, EvalReport, FailureReport, HeldReport, StepReport, TrainingKey};
use std::time::Instant;

/// `18.2k` for 18200.
fn human(n: f64) -> String {
    if n >= 1e6 {
        format!("{:.1}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

/// Keeps the newest `keep` periodic checkpoints of `steps` (and the final one at
/// `max_steps`); returns the steps to remove.
pub(super) fn prune(keep: usize, max_steps: u64, steps: &mut Vec<u64>) -> Vec<u64> {
    let periodic: Vec<u64> = steps.iter().copied().filter(|&s| s != max_steps).collect();
    if periodic.len() <= keep.max(1) {
        return Vec::new();
    }
    let drop = periodic[..periodic.len() - keep.max(1)].to_vec();
    steps.retain(|s| !drop.contains(s));
    drop
}

impl Machine {
    /// The user cancels `job_id` (a finished job stays as it ended).
    ///
    /// Errors: [`CoordinatorError::UnknownJob`].
    pub(super) fn cancel(&mut self, now: Instant, job_id: &str) -> Result<Reply, CoordinatorError> {
        self.job(job_id)?;
        self.end_job(
            job_id,
            Outcome::Cancelled("cancelled by the user".into()),
            now,
        );
        Ok(Reply::Status(Box::new(self.job(job_id)?.status(now))))
    }

    /// A step report. Rank 0's drive the job's step, metrics and status.
    ///
    /// Errors: `UnknownJob`, `Stale` (another generation, or a rank 0 report at or before the
    /// step already reported), `BadRequest` (a rank outside the ring, a step outside
    /// `1..=max_steps`).
    pub(super) fn step_reported(
        &mut self,
        now: Instant,
        r: StepReport,
    ) -> Result<Reply, CoordinatorError> {
        let job = self.current(r.key.as_ref())?;
        let step = r.key.as_ref().map_or(0, |k| k.step);
        // The ring's size; a finished job keeps its last ring's (late reports are refused
        // for what they are, not for naming a rank).
        let ranks = match &job.phase {
            Phase::Running(run) => run.workers.len(),
            _ => job.worker_names.len(),
        };
        if r.rank as usize >= ranks {
            return Err(CoordinatorError::BadRequest(format!(
                "step report: rank {} is not in job {} ({ranks} ranks)",
                r.rank, job.id
            )));
        }
        if step == 0 || step > job.spec.train.max_steps {
            return Err(CoordinatorError::BadRequest(format!(
                "step report: step {step} is outside 1..={} of job {}",
                job.spec.train.max_steps, job.id
            )));
        }
        if r.rank == 0 && step <= job.step {
            return Err(CoordinatorError::Stale {
                job_id: job.id.clone(),
                message: format!(
                    "step report for step {step} arrives after step {}: reports must come in order",
                    job.step
                ),
            });
        }
        if r.rank != 0 {
            return Ok(Reply::None);
        }
        let id = job.id.clone();
        let line = MetricsLine::Step(StepLine {
            step,
            loss: r.loss,
            mlm_loss: r.mlm_loss,
            nsp_loss: r.nsp_loss,
            mlm_accuracy: r.mlm_accuracy,
            lr: r.learning_rate,
            grad_norm: r.grad_norm,
            tokens_per_s: r.tokens_per_second,
            step_seconds: r.step_seconds,
            allreduce_seconds: r.allreduce_seconds,
            tokens: r.tokens,
            skipped: r.skipped,
            phase: r.phase,
        });
        self.append_metrics(&id, line);
        tracing::info!(
            job = %id,
            "step {step} | loss {:.4} | lr {:.1e} | {:.0} ms | {} tok/s | allreduce {:.0} ms",
            r.loss,
            r.learning_rate,
            r.step_seconds * 1e3,
            human(r.tokens_per_second),
            r.allreduce_seconds * 1e3
        );
        if r.skipped {
            tracing::warn!(job = %id, step, "non-finite loss or gradient: the update was skipped ({} so far)", r.skipped_steps);
        }
        if let Some(job) = self.jobs.get_mut(&id) {
            job.step = step;
            job.step_heard = now;
            if let Phase::Running(run) = &mut job.phase {
                run.progress.note_step(step, now);
            }
            // It trains again: the next recovery starts without waiting.
            job.recovery_streak = 0;
            job.skipped_steps = job.skipped_steps.max(r.skipped_steps);
            job.last_step = Some(r);
        }
        self.publish(&id, now);
        Ok(Reply::None)
    }

    /// An evaluation report: a metrics line, and progress.
    ///
    /// Errors: `UnknownJob`, `Stale`.
    pub(super) fn eval_reported(
        &mut self,
        now: Instant,
        r: EvalReport,
    ) -> Result<Reply, CoordinatorError> {
        let id = self.current(r.key.as_ref())?.id.clone();
        let step = r.key.as_ref().map_or(0, |k| k.step);
        self.append_metrics(
            &id,
            MetricsLine::Eval(EvalLine {
                step,
                eval_loss: r.mlm_loss,
                eval_accuracy: r.mlm_accuracy,
                eval_perplexity: r.perplexity,
                eval_masked_tokens: r.masked_tokens,
            }),
        );
        tracing::info!(
            job = %id,
            "eval at step {step} | mlm loss {:.4} | accuracy {:.3} | perplexity {:.2}",
            r.mlm_loss,
            r.mlm_accuracy,
            r.perplexity
        );
        if let Some(job) = self.jobs.get_mut(&id) {
            if let Phase::Running(run) = &mut job.phase {
                run.progress.touch(now);
            }
            job.last_eval = Some(r);
        }
        self.publish(&id, now);
        Ok(Reply::None)
    }

    /// A rank finished every step. When every rank has, the job completes if its final
    /// checkpoint is stored, else fails saying so.
    ///
    /// Errors: `UnknownJob`, `Stale`.
    pub(super) fn done_reported(
        &mut self,
        now: Instant,
        r: DoneReport,
    ) -> Result<Reply, CoordinatorError> {
        let id = self.current(r.key.as_ref())?.id.clone();
        let Some(job) = self.jobs.get_mut(&id) else {
            return Ok(Reply::None);
        };
        let Phase::Running(run) = &mut job.phase else {
            return Ok(Reply::None);
        };
        run.done.insert(r.rank);
        if run.done.len() < run.workers.len() {
            return Ok(Reply::None);
        }
        let max_steps = job.spec.train.max_steps;
        if job.checkpoints.contains(&max_steps) {
            job.step = max_steps;
            self.end_job(&id, Outcome::Completed, now);
        } else {
            self.end_job(
                &id,
                Outcome::Failed("all ranks finished but no final checkpoint was stored".into()),
                now,
            );
        }
        Ok(Reply::None)
    }

    /// A rank's step failed: a recoverable failure starts a new generation (the failed
    /// worker's held steps are its answer to the Suspend just sent), another fails the job.
    ///
    /// Errors: `UnknownJob`, `Stale`.
    pub(super) fn failure_reported(
        &mut self,
        now: Instant,
        r: FailureReport,
    ) -> Result<Reply, CoordinatorError> {
        let job = self.current(r.key.as_ref())?;
        let id = job.id.clone();
        let step = r.key.as_ref().map_or(0, |k| k.step);
        let ranks = self.describe_ranks(job);
        let who = self
            .workers
            .get(&r.worker_id)
            .map_or(r.worker_id.clone(), |w| w.describe());
        let message = format!(
            "rank {} {who} failed at step {step}: {} [ring: {ranks}]",
            r.rank, r.error
        );
        if r.recoverable {
            self.begin_regroup(now, &id, message, &[], true);
            // The failed worker said what it holds: that is its answer to the Suspend just
            // sent (which it may also answer; the later answer wins, both say the same).
            self.record_held(&id, None, &r.worker_id, &r.held_steps);
        } else {
            self.end_job(&id, Outcome::Failed(message), now);
        }
        Ok(Reply::None)
    }

    /// A worker's answer to `Suspend`.
    ///
    /// Errors: `BadRequest` (no key), `UnknownJob`, `Stale` (not the generation being formed,
    /// or the worker was not asked).
    pub(super) fn held_reported(&mut self, report: HeldReport) -> Result<Reply, CoordinatorError> {
        let key = report
            .key
            .ok_or_else(|| CoordinatorError::BadRequest("missing training key".into()))?;
        let job = self.job(&key.job_id)?;
        let stale = |message: String| CoordinatorError::Stale {
            job_id: key.job_id.clone(),
            message,
        };
        match &job.phase {
            Phase::Recovering(r) if r.generation == key.generation => {
                let asked = matches!(&r.stage, Stage::Collecting { asked, .. } if asked.contains(&report.worker_id));
                if !asked {
                    return Err(stale(format!(
                        "worker {} was not asked for its state in generation {}",
                        report.worker_id, key.generation
                    )));
                }
            }
            _ => {
                return Err(stale(format!(
                    "generation {} is not being formed (current: {})",
                    key.generation, job.generation
                )));
            }
        }
        self.record_held(
            &key.job_id,
            Some(key.generation),
            &report.worker_id,
            &report.held_steps,
        );
        Ok(Reply::None)
    }

    /// A checkpoint upload starts: its key must be current and the job not finished.
    ///
    /// Errors: `UnknownJob`, `Stale`.
    pub(super) fn upload_begins(&mut self, key: &TrainingKey) -> Result<Reply, CoordinatorError> {
        let job = self.current(Some(key))?;
        if job.is_finished() {
            // A finished job's checkpoints are final: nothing may replace them.
            return Err(CoordinatorError::Stale {
                job_id: key.job_id.clone(),
                message: "the job has ended: it takes no more checkpoints".into(),
            });
        }
        Ok(Reply::JobDir(job.dir.clone()))
    }

    /// A chunk of an upload arrived: a long upload (the final checkpoint of a big model) is
    /// progress, since no step follows it.
    pub(super) fn upload_progress(&mut self, now: Instant, key: &TrainingKey) {
        if let Some(job) = self.jobs.get_mut(&key.job_id)
            && job.generation == key.generation
            && let Phase::Running(run) = &mut job.phase
        {
            run.progress.touch(now);
        }
    }

    /// A checkpoint was stored: it joins the list, and old periodic ones beyond
    /// `keep_checkpoints` are removed.
    ///
    /// Errors: `UnknownJob`.
    pub(super) fn checkpoint_stored(
        &mut self,
        now: Instant,
        key: &TrainingKey,
    ) -> Result<Reply, CoordinatorError> {
        self.job(&key.job_id)?;
        let Some(job) = self.jobs.get_mut(&key.job_id) else {
            return Ok(Reply::None);
        };
        // Stored again: an earlier failure is history (still counted).
        job.checkpoint_problem = None;
        if !job.checkpoints.contains(&key.step) {
            job.checkpoints.push(key.step);
            job.checkpoints.sort_unstable();
        }
        let t = &job.spec.train;
        let dropped = prune(t.keep_checkpoints, t.max_steps, &mut job.checkpoints);
        if !dropped.is_empty() {
            let dirs = dropped
                .iter()
                .map(|&s| layout::checkpoint_dir(&job.dir, s))
                .collect();
            job.remove_when_saved(dirs);
        }
        self.publish(&key.job_id, now);
        tracing::info!(job = %key.job_id, step = key.step, "checkpoint stored");
        Ok(Reply::None)
    }
}
