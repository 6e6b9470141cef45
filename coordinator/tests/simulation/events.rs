//! The messages and events of the simulation: RPCs from workers, their answers, the driver's
//! results, and the scheduled events of the queue. In events, `w` is a simulated worker's
//! index, `inc` its incarnation (events of a process that has since died are dropped),
//! `epoch` the coordinator process's (likewise), and `ring` an index into the rings.

use super::FaultKind;
use keel_proto::rpc::{
    DoneReport, EvalReport, FailureReport, HeldReport, StepReport, TrainingKey, worker_command,
};

/// Messages from a worker to the coordinator (each one unary RPC).
#[derive(Debug, Clone)]
pub(super) enum Up {
    /// `Register`, naming what it holds (then `Attach`, done with it).
    Register { holds: Option<TrainingKey> },
    /// `Heartbeat`, naming the running job's key.
    Heartbeat { key: Option<TrainingKey> },
    /// Rank 0's step report.
    Step(StepReport),
    /// Rank 0's evaluation report.
    Eval(EvalReport),
    /// A rank finished every step.
    Done(DoneReport),
    /// A rank's generation failed.
    Failure(FailureReport),
    /// The answer to a `Suspend`.
    Held(HeldReport),
    /// A checkpoint upload's first message (its key is checked).
    UploadBegins(TrainingKey),
    /// The upload's data: the weights of that step.
    UploadData { key: TrainingKey, weights: u64 },
}

/// What a worker does with the answer to one of its RPCs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Call {
    /// Its registration: a session starts, or it tries again.
    Register,
    /// A heartbeat: unknown or failing 5 times in a row ends the session.
    Heartbeat,
    /// The reporter of run `serial`: a step or eval report.
    Report { serial: u64 },
    /// The reporter of run `serial`: an upload's start.
    UploadBegins { serial: u64 },
    /// The reporter of run `serial`: an upload's data.
    UploadData { serial: u64 },
    /// A run's last word (done, failure, held): nothing follows.
    Last,
}

/// An RPC's answer as the worker sees it.
#[derive(Debug, Clone)]
pub(super) enum Answer {
    /// Registered as `worker_id`, its attach stream numbered `attach`, by coordinator
    /// process `epoch`.
    Registered {
        worker_id: String,
        attach: u64,
        epoch: u64,
    },
    /// A heartbeat's answer: whether the coordinator knows the worker.
    Known(bool),
    /// Accepted.
    Ok,
    /// Refused, lost or unanswered, and why.
    Err(String),
}

/// Results the driver model feeds back to the machine.
#[derive(Debug, Clone)]
pub(super) enum DriverInput {
    /// A preparation ended (always well: the data are not simulated).
    Prepared { job_id: String },
    /// A generation's files are built, for `ranks` ranks.
    FilesBuilt {
        job_id: String,
        generation: u64,
        ranks: usize,
    },
    /// The newest stored checkpoint among those asked about.
    Verified {
        job_id: String,
        generation: u64,
        newest: Option<u64>,
    },
    /// A record could not be written.
    SaveFailed { job_id: String },
    /// A record was written (save `seq`, naming `generation`).
    Saved {
        job_id: String,
        seq: u64,
        generation: u64,
    },
    /// A worker's attach stream closed (its process died).
    Detached { worker_id: String, attach: u64 },
}

/// One scheduled event.
#[derive(Debug, Clone)]
pub(super) enum Ev {
    /// The driver's timer, every 250 ms.
    Tick { epoch: u64 },
    /// The user submits the `job`th job.
    Submit { job: usize },
    /// The submit handler looks again whether the record of `id` (the `job`th job's
    /// submission, since `since` ms, to the process `epoch`) is written.
    SubmitPoll {
        job: usize,
        id: String,
        epoch: u64,
        since: u64,
    },
    /// The coordinator process starts again.
    CoordinatorRestart,
    /// An RPC reaches the coordinator.
    Deliver {
        w: usize,
        inc: u64,
        epoch: u64,
        call: Call,
        msg: Up,
    },
    /// An RPC's answer reaches the worker.
    Answer {
        w: usize,
        inc: u64,
        call: Call,
        answer: Answer,
    },
    /// A command on a worker's attach stream of session `worker_id`, sent by coordinator
    /// process `epoch` (lost if that process has died: its streams broke).
    Command {
        w: usize,
        inc: u64,
        epoch: u64,
        worker_id: String,
        command: worker_command::Command,
    },
    /// A driver's result comes back.
    Driver { epoch: u64, input: DriverInput },
    /// A worker's heartbeat timer.
    Heartbeat { w: usize, inc: u64 },
    /// A worker (re)tries to register.
    Register { w: usize, inc: u64 },
    /// A worker notices that its session `worker_id` broke.
    SessionLost {
        w: usize,
        inc: u64,
        worker_id: String,
    },
    /// A crashed worker's process starts again.
    WorkerRestart { w: usize },
    /// A ring's connect timeout.
    RingDeadline { ring: usize },
    /// A ring's next lockstep.
    RingStep { ring: usize },
    /// A ring's generation fails on its members, for `why`.
    RingFail { ring: usize, why: String },
    /// The reporter of run `serial` tries its final upload again.
    UploadRetry { w: usize, inc: u64, serial: u64 },
    /// A fault of this kind strikes (its target and length drawn then).
    Fault(FaultKind),
    /// A partition heals.
    Heal { what: Heal },
    /// The fault window closes.
    EndOfFaults,
}

/// A fault's end.
#[derive(Debug, Clone, Copy)]
pub(super) enum Heal {
    /// Worker `i` reaches the coordinator again.
    CoordinatorCut(usize),
    /// Worker `i` reaches its ring peers again.
    RingCut(usize),
}
