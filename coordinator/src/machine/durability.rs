//! What waits until a job's record is on disk.
//!
//! The driver writes records after the machine hands them out ([`Effect::Save`]) and says
//! which it wrote ([`Input::Saved`]). Three things must not happen before the record that
//! makes them safe is durable, or a coordinator that dies in between and reads back the
//! older record would act on a past that did not happen:
//! - a generation's `StartJob`s: a restart would launch the same generation number again,
//!   with other members, while the old ring still trains and reports under that number;
//! - the removal of pruned checkpoints: a restart would list folders that are gone;
//! - the answer to a submission: a restart would not know the accepted job (the submit
//!   handler waits for [`Job::is_recorded`], or withdraws the job, [`Input::Withdraw`]).

use super::phase::Phase;
use super::{Effect, Machine, Reply};
use crate::CoordinatorError;
use std::time::Instant;

impl Machine {
    /// The driver wrote save `seq` of `job_id` (naming `generation`): removes the pruned
    /// folders it no longer lists, and sends a generation's assignments that waited for it.
    pub(super) fn saved(&mut self, now: Instant, job_id: &str, seq: u64, generation: u64) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let dirs = job.save_written(seq, generation);
        if !dirs.is_empty() {
            self.effects.push(Effect::RemoveCheckpoints { dirs });
        }
        self.send_assignments(now, job_id);
    }

    /// Forgets a queued job whose first record could not be written (its submission is
    /// refused).
    ///
    /// Errors: `UnknownJob`; `BadRequest` when its record was written or it left the queue
    /// (preparation starts only once the record is written, so a queued job has nothing
    /// under way).
    pub(super) fn withdraw(&mut self, job_id: &str) -> Result<Reply, CoordinatorError> {
        let job = self.job(job_id)?;
        if job.is_recorded() || !matches!(job.phase, Phase::Queued) {
            return Err(CoordinatorError::BadRequest(format!(
                "{job_id} cannot be withdrawn: its record is written or it has started"
            )));
        }
        self.jobs.remove(job_id);
        self.order.retain(|id| id != job_id);
        tracing::warn!(
            job = job_id,
            "submission withdrawn: its record could not be written"
        );
        Ok(Reply::None)
    }
}
