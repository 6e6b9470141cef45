//! [`WorkerEntry`], one registered worker as the machine keeps it, and [`StepTimes`], its last
//! step's times. The membership transitions that change them are `workers`.

use keel_proto::rpc::TrainingKey;
use std::time::Instant;

/// A registered worker.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    /// `w-N`, in registration order.
    pub(super) id: String,
    /// Registration number: orders ranks.
    pub(super) number: u64,
    /// host:port its ring peers reach it at.
    pub(super) advertise_addr: String,
    /// Whether it has native bf16 GEMMs that pay (what it reported at registration).
    pub(super) bf16_native: bool,
    /// Its reason for `bf16_native`.
    pub(super) bf16_detail: String,
    /// Last heartbeat (or registration).
    pub(super) last_seen: Instant,
    /// The job it works on, with its rank.
    pub(super) job: Option<(String, u32)>,
    /// Steps completed in that job, as last heartbeated.
    pub(super) step: u64,
    /// The generation of that job its heartbeats last named (0: none since it was given the
    /// job): the progress watchdog tells a member that never started a generation by it.
    pub(super) generation: u64,
    /// The number of its open `Attach` stream; `None` until attached.
    pub(super) attach: Option<u64>,
    /// Set when its stream closed or a command could not be put on it: it is treated as dead
    /// at the next tick.
    pub(super) disconnected: bool,
    /// What it said at registration that it holds in memory: `(job, generation, step)`.
    pub(super) holds: Option<TrainingKey>,
    /// Bytes of memory it can use (`None` from workers older than the field).
    pub(super) memory_limit: Option<u64>,
    /// Its last training step's times, as last heartbeated (`None` before its first step).
    pub(super) step_times: Option<StepTimes>,
}

/// A worker's last training step, as its heartbeat tells it (the dashboard's ring table).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// The step's wall time, seconds.
    pub step_seconds: f64,
    /// The part of it spent waiting for the summed gradient after the backward pass, seconds.
    pub ring_wait_seconds: f64,
}

impl StepTimes {
    /// From a heartbeat's fields: `None` when the worker has not trained (0) or sent
    /// something that is not a time (negative, not finite).
    pub fn from_heartbeat(step_seconds: f64, ring_wait_seconds: f64) -> Option<StepTimes> {
        let ok = |s: f64| s.is_finite() && s >= 0.0;
        (step_seconds > 0.0 && ok(step_seconds) && ok(ring_wait_seconds)).then_some(StepTimes {
            step_seconds,
            ring_wait_seconds,
        })
    }
}

impl WorkerEntry {
    /// `w-2 (127.0.0.1:7072)`: how errors name a worker.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.id, self.advertise_addr)
    }

    /// host:port its ring peers reach it at.
    pub fn advertise_addr(&self) -> &str {
        &self.advertise_addr
    }

    /// Whether it can take a command now (attached, not known to be gone).
    pub fn reachable(&self) -> bool {
        self.attach.is_some() && !self.disconnected
    }

    /// `w-N`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The job it works on and its rank there.
    pub fn job(&self) -> Option<(&str, u32)> {
        self.job.as_ref().map(|(j, r)| (j.as_str(), *r))
    }

    /// Steps completed in its job and the generation, as last heartbeated.
    pub fn progress(&self) -> (u64, u64) {
        (self.step, self.generation)
    }

    /// When it was last heard from (machine time).
    pub fn last_seen(&self) -> Instant {
        self.last_seen
    }

    /// Its last training step's times (`None` before its first step).
    pub fn step_times(&self) -> Option<StepTimes> {
        self.step_times
    }
}
