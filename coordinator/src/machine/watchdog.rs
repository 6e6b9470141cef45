//! The progress watchdog: a running job whose step does not advance for
//! `[cluster] progress_timeout_seconds` is stalled.
//!
//! The liveness checks (heartbeats, the `Attach` stream, ring timeouts) catch a worker that is
//! dead or silent. They do not catch one that heartbeats but never steps: a worker whose
//! training is stuck before its ring calls (say, fetching its files), or a fake worker that
//! registers and heartbeats but ignores `StartJob`. Such a job stayed `running, step 0` for
//! ever. The watchdog notices it, names the workers that have not reported the next step, and
//! re-forms the ring (a regroup, counted against `max_recoveries`) without those it
//! can single out; out of recoveries, the job fails with that message.
//!
//! Progress is any of: the job's step advancing (rank 0's `ReportStep`, or a member's
//! heartbeat naming a later step of the current generation: heartbeats keep coming while
//! step reports queue behind a checkpoint upload), an evaluation report, or a checkpoint
//! upload chunk arriving. The clock restarts whenever a generation starts, and does not run
//! before its workers are sent it (`machine::durability`).

use super::Machine;
use super::phase::Phase;
use keel_proto::metrics::{EventLine, MetricsLine, StallEvent, StallWorker};
use keel_proto::rpc::{CancelJob, TrainingKey, worker_command};
use std::time::{Duration, Instant};

/// How long past `timeout` the job has been without progress at `now`, if it has been
/// without progress for longer than `timeout` since `last`.
pub fn overdue(last: Instant, now: Instant, timeout: Duration) -> Option<Duration> {
    let silent = now.saturating_duration_since(last);
    (silent > timeout).then_some(silent)
}

/// One member of a stalled job, as its heartbeats describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its worker id (`w-2`).
    pub id: String,
    /// `w-2 (127.0.0.1:7072)`.
    pub name: String,
    /// The step its heartbeats last named for the current generation; `None` if they never
    /// named that generation (it never started it).
    pub step: Option<u64>,
}

/// The members of a stalled job at `step` that can be singled out as holding it up: those
/// that never started the generation, and those behind `step` (in a synchronous ring every
/// member finishes a step with the others, so one still behind after the timeout is stuck).
/// Empty when every member started and reached `step`: the whole ring is stuck at one step
/// and no member is to blame more than another.
pub fn culprits(members: &[Member], step: u64) -> Vec<&Member> {
    members
        .iter()
        .filter(|m| m.step.is_none_or(|s| s < step))
        .collect()
}

/// The message for a job stalled for `silent` at `step` of `generation`.
pub fn message(
    job_id: &str,
    generation: u64,
    step: u64,
    silent: Duration,
    timeout_seconds: f64,
    members: &[Member],
) -> String {
    let described = |m: &Member| match m.step {
        None => format!("{} (never started generation {generation})", m.name),
        Some(s) => format!("{} (at step {s})", m.name),
    };
    let blamed = culprits(members, step);
    let who = if blamed.is_empty() {
        let all: Vec<String> = members.iter().map(described).collect();
        format!("none of its workers has reported it: {}", all.join(", "))
    } else {
        let some: Vec<String> = blamed.iter().map(|m| described(m)).collect();
        format!(
            "these workers have not reported it and are dropped from the job: {}",
            some.join(", ")
        )
    };
    format!(
        "job {job_id} made no progress for {:.1} s ([cluster] progress_timeout_seconds = \
         {timeout_seconds}): generation {generation} is at step {step}, step {} never came; {who}",
        silent.as_secs_f64(),
        step + 1
    )
}

impl Machine {
    /// Handles every running job without progress for its timeout at `now`: logs and records
    /// a `stall` event in its `metrics.jsonl`, cancels the generation on the workers it
    /// singles out and keeps them out of the job, and starts a recovery (which fails the job
    /// when `max_recoveries` is spent).
    pub(super) fn check_stalls(&mut self, now: Instant) {
        for id in self.ids_where(|p| matches!(p, Phase::Running(_))) {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            let Phase::Running(run) = &job.phase else {
                continue;
            };
            if run.starting.is_some() {
                // Its workers have not been sent the generation yet (its files are being
                // built, or its record is not on disk: a full data folder): none of them can
                // be holding it up. The clock starts again when they are sent it.
                continue;
            }
            let timeout_seconds = job.spec.cluster.progress_timeout_seconds;
            let Some(silent) = overdue(
                run.progress.at,
                now,
                Duration::from_secs_f64(timeout_seconds),
            ) else {
                continue;
            };
            let (generation, step) = (job.generation, run.progress.step);
            let max_steps = job.spec.train.max_steps;
            let members: Vec<Member> = run
                .workers
                .iter()
                .enumerate()
                .map(|(rank, w)| match self.workers.get(w) {
                    // A rank that reported done has trained every step: it holds nothing up.
                    // (Its heartbeats name no generation once it has finished, so it looked
                    // as if it never started, and a job whose last rank's done report was lost
                    // dropped and excluded all the others that had finished.)
                    Some(e) if run.done.contains(&(rank as u32)) => Member {
                        id: w.clone(),
                        name: e.describe(),
                        step: Some(max_steps),
                    },
                    Some(e) => Member {
                        id: w.clone(),
                        name: e.describe(),
                        step: (e.generation == generation).then_some(e.step),
                    },
                    None => Member {
                        id: w.clone(),
                        name: w.clone(),
                        step: None,
                    },
                })
                .collect();
            let text = message(&id, generation, step, silent, timeout_seconds, &members);
            let lost: Vec<String> = culprits(&members, step)
                .into_iter()
                .map(|m| m.id.clone())
                .collect();
            tracing::warn!(job = %id, generation, step, stalled = %lost.join(", "), "{text}");
            let event = StallEvent {
                generation,
                step,
                silent_seconds: silent.as_secs_f64(),
                workers: members
                    .iter()
                    .map(|m| StallWorker {
                        worker: m.name.clone(),
                        step: m.step,
                    })
                    .collect(),
                dropped: lost.clone(),
            };
            self.append_metrics(&id, MetricsLine::Event(EventLine::Stall(event)));
            let key = TrainingKey {
                job_id: id.clone(),
                generation,
                step,
            };
            for w in &lost {
                // A real worker stuck in this generation abandons it and becomes idle.
                self.send(
                    w,
                    worker_command::Command::Cancel(CancelJob {
                        key: Some(key.clone()),
                        reason: text.clone(),
                    }),
                );
            }
            // By advertise address: the same machine registering again (after a coordinator
            // restart, say) gets a new worker id and must stay excluded.
            let addrs: Vec<String> = lost
                .iter()
                .filter_map(|w| self.workers.get(w).map(|w| w.advertise_addr.clone()))
                .collect();
            if let Some(job) = self.jobs.get_mut(&id) {
                job.excluded.extend(addrs);
            }
            let lost: Vec<&str> = lost.iter().map(String::as_str).collect();
            self.begin_regroup(now, &id, text, &lost, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, step: Option<u64>) -> Member {
        Member {
            id: id.into(),
            name: format!("{id} (127.0.0.1:9)"),
            step,
        }
    }

    #[test]
    fn overdue_only_past_the_timeout() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(3);
        assert_eq!(overdue(t0, t0, timeout), None);
        assert_eq!(overdue(t0, t0 + timeout, timeout), None);
        let late = t0 + Duration::from_millis(3001);
        assert_eq!(
            overdue(t0, late, timeout),
            Some(Duration::from_millis(3001))
        );
        // A clock that reads earlier than the mark (a touch after `now` was taken) is not late.
        assert_eq!(overdue(late, t0, timeout), None);
    }

    #[test]
    fn a_step_moves_the_clock_only_forward() {
        let t0 = Instant::now();
        let mut p = super::super::phase::Progress::starting(5, t0);
        let t1 = t0 + Duration::from_secs(1);
        assert!(!p.note_step(5, t1));
        assert!(!p.note_step(4, t1));
        assert_eq!((p.step, p.at), (5, t0));
        assert!(p.note_step(6, t1));
        assert_eq!((p.step, p.at), (6, t1));
    }

    #[test]
    fn culprits_are_those_that_never_started_or_lag() {
        let members = [
            member("w-1", Some(7)),
            member("w-2", None),
            member("w-3", Some(6)),
        ];
        let ids: Vec<&str> = culprits(&members, 7)
            .iter()
            .map(|m| m.id.as_str())
            .collect();
        assert_eq!(ids, ["w-2", "w-3"]);
        // A whole ring stuck at one step: nobody is singled out.
        let stuck = [member("w-1", Some(7)), member("w-2", Some(7))];
        assert!(culprits(&stuck, 7).is_empty());
    }

    #[test]
    fn the_message_names_the_job_generation_step_and_workers() {
        let members = [member("w-1", Some(0)), member("w-2", None)];
        let m = message("job-4", 2, 0, Duration::from_secs_f64(3.3), 3.0, &members);
        for needle in [
            "job job-4",
            "for 3.3 s",
            "progress_timeout_seconds = 3",
            "generation 2 is at step 0",
            "step 1 never came",
            "w-2 (127.0.0.1:9) (never started generation 2)",
            "dropped from the job",
        ] {
            assert!(m.contains(needle), "{needle:?} not in {m}");
        }
        assert!(!m.contains("w-1"), "{m}");
        let stuck = [member("w-1", Some(4)), member("w-2", Some(4))];
        let m = message("job-4", 2, 4, Duration::from_secs(9), 3.0, &stuck);
        assert!(
            m.contains("none of its workers has reported it: w-1 (127.0.0.1:9) (at step 4), w-2"),
            "{m}"
        );
    }
}
