//! Checkpoint uploads the coordinator could not store (a full data folder, a broken stream):
//! each is an event of the job, not a warning lost in a worker's log. It is counted, shown in
//! the job's status until a checkpoint is stored again, logged and written to
//! `metrics.jsonl`. A final checkpoint that cannot be stored does not end the job: rank 0
//! keeps it and tries again until there is room (or the job is cancelled), and each try
//! counts as progress for the watchdog.

use super::phase::Phase;
use super::{Machine, Reply, UploadFailure};
use keel_proto::memory::format_bytes;
use keel_proto::metrics::{CheckpointFailedEvent, EventLine, MetricsLine};
use std::time::Instant;

/// What the job's status says about a failed upload: the folder and the space, and for the
/// final checkpoint that the job waits.
pub(super) fn describe(failure: &UploadFailure, is_final: bool) -> String {
    let step = failure.key.step;
    let mut text = match (failure.needed_bytes, failure.free_bytes) {
        (Some(needed), Some(free)) => format!(
            "the checkpoint of step {step} could not be stored in {}: it needs about {} and {} \
             is free",
            failure.path.display(),
            format_bytes(needed),
            format_bytes(free)
        ),
        _ => format!(
            "the checkpoint of step {step} could not be stored in {}: {}",
            failure.path.display(),
            failure.error
        ),
    };
    if is_final {
        text.push_str(
            "; the job waits, rank 0 holding its final state and trying again every few \
             seconds, until there is room (free space there) or it is cancelled",
        );
    }
    text
}

impl Machine {
    /// A checkpoint upload of the current generation failed: counted, shown, logged and
    /// written to `metrics.jsonl`; progress for the watchdog (the worker is alive and
    /// trying). Late failures (another generation, an ended job) are ignored.
    pub(super) fn upload_failed(&mut self, now: Instant, failure: UploadFailure) -> Reply {
        let Some(job) = self.jobs.get_mut(&failure.key.job_id) else {
            return Reply::None;
        };
        if job.generation != failure.key.generation || job.is_finished() {
            return Reply::None;
        }
        let is_final = failure.key.step == job.spec.train.max_steps;
        let message = describe(&failure, is_final);
        job.checkpoint_failures += 1;
        job.checkpoint_problem = Some(message.clone());
        if let Phase::Running(run) = &mut job.phase {
            run.progress.touch(now);
        }
        let id = job.id.clone();
        let failures = job.checkpoint_failures;
        tracing::error!(job = %id, step = failure.key.step, failures, "{message}");
        self.append_metrics(
            &id,
            MetricsLine::Event(EventLine::CheckpointFailed(CheckpointFailedEvent {
                step: failure.key.step,
                path: failure.path.display().to_string(),
                needed_bytes: failure.needed_bytes,
                free_bytes: failure.free_bytes,
                error: failure.error,
                waiting: is_final,
            })),
        );
        self.publish(&id, now);
        Reply::None
    }
}
