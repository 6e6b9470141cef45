//! Jobs read back after a coordinator restart (`crate::persist` reads the files; this decides
//! the phase each resumes in):
//!
//! | state on disk | phase after restart |
//! |---|---|
//! | completed, failed, cancelled | unchanged |
//! | queued, preparing | queued (preparation runs again and reuses a complete data folder), or failed after `MAX_INTERRUPTED_PREPARATIONS` interrupted preparations |
//! | waiting for workers, running, recovering, never had a ring | waiting for workers (prepared data found) or queued |
//! | running, recovering (had a ring) | recovering: the next generation gathers the workers that hold it |

use super::job::Job;
use super::phase::{Outcome, Phase, Regroup, Stage};
use super::recovery::{GATHER_WINDOW, collect_timeout};
use super::{Effect, Machine};
use crate::persist::Restored;
use keel_proto::rpc::JobState;
use std::time::{Instant, SystemTime};

impl Machine {
    /// Takes back the jobs of an earlier run, in job-number order, at `now` (wall clock
    /// `wall`); job and worker numbers continue after the highest they name and after
    /// `highest_job_folder`.
    pub fn restore(
        &mut self,
        now: Instant,
        wall: SystemTime,
        jobs: Vec<Restored>,
        highest_job_folder: u64,
    ) {
        self.next_job = self.next_job.max(highest_job_folder);
        for r in jobs {
            let state = JobState::from_str_name(&r.record.state).unwrap_or(JobState::Unspecified);
            let error = r.record.error.clone().unwrap_or_default();
            // Worker ids continue after those the restored jobs name (`w-3 (host:port)`), so
            // an old job's worker list never names a different, newer process.
            for name in &r.record.worker_names {
                if let Some(n) = name
                    .strip_prefix("w-")
                    .and_then(|rest| rest.split(' ').next())
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    self.next_worker = self.next_worker.max(n);
                }
            }
            let mut job = Job::from_record(r.record, r.spec, r.dir, now, wall);
            job.prepared = r.prepared;
            job.phase = match state {
                JobState::Completed => Phase::Finished(Outcome::Completed),
                JobState::Failed => Phase::Finished(Outcome::Failed(error)),
                JobState::Cancelled => Phase::Finished(Outcome::Cancelled(error)),
                JobState::Queued | JobState::Preparing | JobState::Unspecified => Phase::Queued,
                JobState::WaitingForWorkers | JobState::Running | JobState::Recovering => {
                    Phase::Recovering(Regroup {
                        last_world: None,
                        generation: job.generation,
                        reason: "the coordinator restarted".into(),
                        started: now,
                        not_before: now,
                        stage: Stage::Gathering {
                            expected: job.worker_names.len().max(1),
                            until: now,
                        },
                    })
                }
            };
            if job.is_finished() && job.finished.is_none() {
                // A record from before finish times were saved: the restart is the latest
                // it can have ended.
                job.finished = Some(now);
            }
            let n = r.interrupted_preparations;
            if n >= crate::prepare_job::MAX_INTERRUPTED_PREPARATIONS && !job.is_finished() {
                // It stays failed (and is saved so), so it is never prepared again.
                tracing::error!(job = %job.id, interrupted = n, "not preparing it again");
                job.finished = Some(now);
                job.phase = Phase::Finished(Outcome::Failed(format!(
                    "its preparation was interrupted {n} times (the coordinator stopped or was \
                     killed while preparing it, perhaps for memory): not retried; fix the \
                     inputs and submit it again"
                )));
            }
            if let Some(e) = r.refused
                && !job.is_finished()
            {
                tracing::error!(job = %job.id, "not restoring it: {e}");
                job.finished = Some(now);
                job.phase =
                    Phase::Finished(Outcome::Failed(format!("restored after a restart: {e}")));
                job.prepared = None;
            }
            tracing::info!(
                job = %job.id,
                state = job.state().as_str_name(),
                generation = job.generation,
                step = job.step,
                checkpoints = ?job.checkpoints,
                "job restored"
            );
            let id = job.id.clone();
            self.order.push(id.clone());
            self.jobs.insert(id.clone(), job);
            self.resume(now, &id);
            self.publish(&id, now);
        }
    }

    /// Sets a restored recovering job going: one that never had a ring waits for workers
    /// again (or is prepared first); one that had a ring gathers the workers that hold it for
    /// its next generation, its data prepared again meanwhile if the folder was incomplete.
    fn resume(&mut self, now: Instant, id: &str) {
        let Some(job) = self.jobs.get_mut(id) else {
            return;
        };
        if !matches!(job.phase, Phase::Recovering(_)) {
            return;
        }
        if job.generation == 0 {
            job.phase = if job.prepared.is_some() {
                Phase::Waiting
            } else {
                Phase::Queued
            };
            return;
        }
        let timeout = collect_timeout(job.spec.cluster.peer_timeout_seconds);
        job.generation += 1;
        job.phase = Phase::Recovering(Regroup {
            last_world: None,
            generation: job.generation,
            reason: "the coordinator restarted".into(),
            started: now,
            not_before: now,
            stage: Stage::Gathering {
                expected: job.worker_names.len().max(1),
                until: now + timeout.min(GATHER_WINDOW),
            },
        });
        if job.prepared.is_none() {
            self.effects.push(Effect::Prepare {
                job_id: id.to_string(),
                spec: Box::new(job.spec.clone()),
                dir: job.dir.clone(),
            });
        }
    }
}
