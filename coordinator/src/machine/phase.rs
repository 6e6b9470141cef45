//! Where a job is in its life: one [`Phase`] whose variants carry the data of that phase
//! only, so that no combination that means nothing can be written down.
//!
//! ```text
//! Queued -> Preparing -> Waiting -> Running -> Finished(Completed)
//!                                    |  ^
//!                      loss / growth v  | new generation formed
//!                                  Recovering -> Finished(Failed)
//! (any phase) -- cancel --> Finished(Cancelled);  (a restart) Restored -> Recovering
//! ```

use keel_proto::rpc::JobState;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// A job's phase.
#[derive(Debug, Clone)]
pub enum Phase {
    /// Submitted; its data is not being prepared yet.
    Queued,
    /// Its data and model config are being prepared (on the driver's blocking threads).
    Preparing,
    /// Prepared; waiting until `min_workers` idle workers can form its first ring.
    Waiting,
    /// A generation is training.
    Running(Running),
    /// A new generation is being formed after a loss, a growth or a restart.
    Recovering(Regroup),
    /// It has ended.
    Finished(Outcome),
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank finished and the final checkpoint is stored.
    Completed,
    /// It failed; the reason.
    Failed(String),
    /// It was cancelled; the reason.
    Cancelled(String),
}

/// A generation that trains.
#[derive(Debug, Clone)]
pub struct Running {
    /// Worker ids in rank order.
    pub workers: Vec<String>,
    /// Ranks that reported done.
    pub done: BTreeSet<u32>,
    /// When it last made progress (the progress watchdog).
    pub progress: Progress,
    /// Until its workers are sent their assignments (once their files are built): how
    /// they start. `None` once sent.
    pub starting: Option<LaunchInfo>,
    /// Each rank's files, built, while the record naming this generation is not on disk yet
    /// (the assignments wait for it: `machine::durability`).
    pub built: Option<super::RankFiles>,
}

/// How a generation's ranks start (what their `StartJob` says beyond the files).
#[derive(Debug, Clone, Copy)]
pub struct LaunchInfo {
    /// Where the ranks take the state from.
    pub source: keel_proto::rpc::StateSource,
    /// With `Memory`: the rank that broadcasts it.
    pub root_rank: u32,
    /// Rank 0 uploads a checkpoint of the start step first.
    pub checkpoint_first: bool,
}

/// The generation being formed.
#[derive(Debug, Clone)]
pub struct Regroup {
    /// The new generation.
    pub generation: u64,
    /// Why (the first loss), for logs and the failure message.
    pub reason: String,
    /// When the job lost its ring (bounds the wait for replacements).
    pub started: Instant,
    /// The new generation starts no earlier (the recovery back-off: a fault that persists
    /// cannot spend `max_recoveries` in a second).
    pub not_before: Instant,
    /// Where it is.
    pub stage: Stage,
    /// Ranks of the last ring that trained, when known (not after a coordinator restart): a
    /// job with `train.shard_optimizer` can go on from memory only if that many hold its step
    /// (each held a share of the moments).
    pub last_world: Option<usize>,
}

/// The stages of a regroup (protocol step 14).
#[derive(Debug, Clone)]
pub enum Stage {
    /// After a coordinator restart: waiting until `expected` workers that hold the job have
    /// registered again, or until `until`.
    Gathering {
        /// Workers the job had.
        expected: usize,
        /// Give up waiting at.
        until: Instant,
    },
    /// `Suspend` sent to `asked`; their `ReportHeld` answers so far (`None`: holds nothing).
    Collecting {
        /// Workers suspended, in their old rank order.
        asked: Vec<String>,
        /// Answers: worker -> newest step held.
        held: BTreeMap<String, Option<u64>>,
        /// Stop waiting at.
        until: Instant,
    },
    /// Waiting for enough workers; `members` answered (worker, newest step held).
    Forming {
        /// The members, in their old rank order.
        members: Vec<(String, Option<u64>)>,
    },
    /// No member holds the job's state: its stored checkpoints are being verified (by the
    /// driver, which reads them) before the ring starts from the newest intact one.
    Verifying {
        /// The workers of the new ring, in rank order.
        chosen: Vec<String>,
    },
}

impl Stage {
    /// The workers this stage reserves for the job, in rank order.
    pub fn members(&self) -> Vec<String> {
        match self {
            Stage::Gathering { .. } => Vec::new(),
            Stage::Collecting { asked, .. } => asked.clone(),
            Stage::Forming { members } => members.iter().map(|(w, _)| w.clone()).collect(),
            Stage::Verifying { chosen } => chosen.clone(),
        }
    }

    /// Drops `worker` from the stage (it is gone).
    pub fn remove(&mut self, worker: &str) {
        match self {
            Stage::Gathering { .. } => {}
            Stage::Collecting { asked, held, .. } => {
                asked.retain(|w| w != worker);
                held.remove(worker);
            }
            Stage::Forming { members } => members.retain(|(w, _)| w != worker),
            Stage::Verifying { chosen } => chosen.retain(|w| w != worker),
        }
    }
}

impl Phase {
    /// The state clients see.
    pub fn state(&self) -> JobState {
        match self {
            Phase::Queued => JobState::Queued,
            Phase::Preparing => JobState::Preparing,
            Phase::Waiting => JobState::WaitingForWorkers,
            Phase::Running(_) => JobState::Running,
            Phase::Recovering(_) => JobState::Recovering,
            Phase::Finished(Outcome::Completed) => JobState::Completed,
            Phase::Finished(Outcome::Failed(_)) => JobState::Failed,
            Phase::Finished(Outcome::Cancelled(_)) => JobState::Cancelled,
        }
    }
}

/// When a generation last made progress, and how far it had got.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// The newest step seen for the current generation.
    pub step: u64,
    /// When it (or other progress) was last seen.
    pub at: Instant,
}

impl Progress {
    /// A clock that starts at `now` at `step` (a generation starting from `step`).
    pub fn starting(step: u64, now: Instant) -> Self {
        Progress { step, at: now }
    }

    /// Records `step` at `now` if it is past the newest one seen; whether it was.
    pub fn note_step(&mut self, step: u64, now: Instant) -> bool {
        if step > self.step {
            self.step = step;
            self.at = now;
            true
        } else {
            false
        }
    }

    /// Records progress that is not a step (an evaluation, a checkpoint chunk) at `now`.
    pub fn touch(&mut self, now: Instant) {
        self.at = now;
    }
}
