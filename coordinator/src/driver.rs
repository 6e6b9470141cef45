//! The driver of the machine (`crate::machine`): the only place that feeds it inputs and
//! carries out its effects.
//!
//! [`Shared::apply`] steps the machine under its lock and, still under the lock, puts the
//! commands it sends on the workers' streams (memory only). Every other effect goes, in order,
//! to the one driver task ([`run`]), which carries it out outside the lock: saving a record,
//! appending metrics (to `metrics.jsonl` and the TensorBoard event file), showing a status to
//! watchers, and spawning what takes long (preparing data, building a generation's files,
//! verifying checkpoints), whose results come back as inputs. A status is shown only after the records handed out before it are written, and the
//! RPCs that read wait for the queue ([`Shared::flushed`]): what a client sees is on disk. A
//! timer ([`tick`]) gives the machine the time.

use crate::CoordinatorError;
use crate::event_log::EventLogs;
use crate::input_roots::InputRoots;
use crate::machine::{Effect, Input, Launch, Machine, RankFiles, Reply};
use crate::prepare_job;
use keel_proto::metrics::MetricsLine;
use keel_proto::rpc::{JobStatus, WorkerCommand, worker_command};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{Notify, mpsc, watch};
use tonic::Status;

/// How often the machine is given the time even when nothing woke the timer.
const TICK: Duration = Duration::from_millis(250);

/// The sending half of a worker's `Attach` stream.
pub type CommandSender = mpsc::Sender<Result<WorkerCommand, Status>>;

/// The machine and the workers' command streams, behind one lock.
#[derive(Debug)]
pub struct Core {
    /// The state machine.
    pub machine: Machine,
    /// Each attached worker's command stream, with its number.
    commands: HashMap<String, (u64, CommandSender)>,
    /// Numbers `Attach` streams.
    next_attach: u64,
}

/// What the driver task is given, in order.
// Each item is moved through the channel once: boxing the larger variant would only add an
// allocation per effect.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Work {
    /// An effect of the machine.
    Effect(Effect),
    /// Answer once everything queued before is done ([`Shared::flushed`]).
    Barrier(tokio::sync::oneshot::Sender<()>),
}

/// Shared state of a running coordinator.
#[derive(Debug)]
pub struct Shared {
    /// The machine and its in-memory links.
    core: Mutex<Core>,
    /// Work for the driver task, in order.
    io: mpsc::UnboundedSender<Work>,
    /// Each job's status channel (WatchJob streams subscribe to it), fed by the driver.
    watches: Mutex<HashMap<String, watch::Sender<JobStatus>>>,
    /// Where jobs live (`DATA_DIR/jobs/job-N`).
    pub data_dir: PathBuf,
    /// The folders jobs may read from (`--input-root`; empty: anywhere).
    pub input_roots: InputRoots,
    /// Wakes the timer when something changed.
    pub wake: Notify,
    /// Each job's TensorBoard event file, written with its metrics lines.
    event_logs: EventLogs,
}

impl Shared {
    /// The coordinator's state over `data_dir`, with the jobs saved there taken back
    /// (`crate::persist::load_jobs`, `Machine::restore`), and the receiving end of the
    /// driver's effects (give it to [`run`]).
    pub fn new(
        data_dir: PathBuf,
        input_roots: InputRoots,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<Work>) {
        let jobs_dir = data_dir.join("jobs");
        let highest = std::fs::read_dir(&jobs_dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .strip_prefix("job-")
                            .and_then(|n| n.parse::<u64>().ok())
                    })
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        let restored = crate::persist::load_jobs(&jobs_dir, &input_roots);
        let mut machine = Machine::new(jobs_dir);
        machine.restore(Instant::now(), SystemTime::now(), restored, highest);
        let (io, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                machine,
                commands: HashMap::new(),
                next_attach: 0,
            }),
            io,
            watches: Mutex::new(HashMap::new()),
            data_dir,
            input_roots,
            wake: Notify::new(),
            event_logs: EventLogs::new(),
        });
        shared.carry_out(&mut shared.lock());
        (shared, rx)
    }

    /// Locks the core. A panic while it was held poisons it: that is logged, and the state,
    /// which the machine changes only through whole transitions, is used as it is.
    fn lock(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// Gives the machine `input` (now), carries out its effects and wakes the timer when the
    /// input may let a job move on.
    ///
    /// Errors: the machine's, for the RPC to answer.
    pub fn apply(&self, input: Input) -> Result<Reply, CoordinatorError> {
        let wakes = !matches!(
            input,
            Input::Tick | Input::Heartbeat { .. } | Input::UploadProgress(_) | Input::Step(_)
        );
        let reply = {
            let mut core = self.lock();
            let reply = core.machine.step(Instant::now(), input);
            self.carry_out(&mut core);
            reply
        };
        if wakes {
            self.wake.notify_one();
        }
        reply
    }

    /// Reads the machine.
    pub fn read<R>(&self, f: impl FnOnce(&Machine) -> R) -> R {
        f(&self.lock().machine)
    }

    /// Opens a worker's `Attach` stream: returns its receiving end.
    ///
    /// Errors: `UnknownWorker`.
    pub fn attach(
        &self,
        worker_id: &str,
    ) -> Result<(u64, mpsc::Receiver<Result<WorkerCommand, Status>>), CoordinatorError> {
        let (tx, rx) = mpsc::channel(16);
        let attach = {
            let mut core = self.lock();
            core.next_attach += 1;
            let attach = core.next_attach;
            core.machine.step(
                Instant::now(),
                Input::Attached {
                    worker_id: worker_id.to_string(),
                    attach,
                },
            )?;
            core.commands.insert(worker_id.to_string(), (attach, tx));
            self.carry_out(&mut core);
            attach
        };
        self.wake.notify_one();
        Ok((attach, rx))
    }

    /// Waits until the `Attach` stream numbered `attach` of `worker_id` closes, then tells the
    /// machine.
    pub async fn watch_attach(self: Arc<Self>, worker_id: String, attach: u64) {
        let tx = {
            let core = self.lock();
            match core.commands.get(&worker_id) {
                Some((n, tx)) if *n == attach => tx.clone(),
                _ => return,
            }
        };
        tx.closed().await;
        drop(tx);
        {
            let mut core = self.lock();
            if core
                .commands
                .get(&worker_id)
                .is_some_and(|(n, _)| *n == attach)
            {
                core.commands.remove(&worker_id);
            }
        }
        let _ = self.apply(Input::Detached { worker_id, attach });
    }

    /// Waits until the driver has done everything queued so far (records written, statuses
    /// shown, metrics appended): a read after it sees only what is on disk.
    pub async fn flushed(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.io.send(Work::Barrier(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// A receiver of `job_id`'s status, starting with the current one (call after
    /// [`flushed`](Self::flushed)).
    ///
    /// Errors: `UnknownJob`.
    pub fn subscribe(&self, job_id: &str) -> Result<watch::Receiver<JobStatus>, CoordinatorError> {
        let status = self.read(|m| m.job(job_id).map(|j| j.status(Instant::now())))?;
        let mut watches = lock(&self.watches);
        let tx = watches
            .entry(job_id.to_string())
            .or_insert_with(|| watch::channel(status).0);
        Ok(tx.subscribe())
    }

    /// Shows `status` to the watchers of its job.
    fn show(&self, status: JobStatus) {
        let mut watches = lock(&self.watches);
        match watches.get(&status.job_id) {
            Some(tx) => {
                tx.send_replace(status);
            }
            None => {
                let id = status.job_id.clone();
                watches.insert(id, watch::channel(status).0);
            }
        }
    }

    /// Closes every worker's command stream (shutdown: graceful shutdown does not wait on
    /// them).
    pub fn close_streams(&self) {
        self.lock().commands.clear();
    }

    /// Hands a record of every job to the driver (shutdown); how many.
    pub fn save_all(&self) -> usize {
        let mut core = self.lock();
        let n = core.machine.save_all(Instant::now());
        self.carry_out(&mut core);
        n
    }

    /// Carries out the machine's pending effects: commands now, the others by the driver
    /// task, in order. A command that cannot be put on a stream makes the worker unreachable
    /// (an input, whose effects are carried out in turn).
    fn carry_out(&self, core: &mut Core) {
        loop {
            let effects = core.machine.take_effects();
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                match effect {
                    Effect::Send { worker_id, command } => {
                        if !send(&core.commands, &worker_id, command) {
                            let _ = core
                                .machine
                                .step(Instant::now(), Input::Unreachable { worker_id });
                        }
                    }
                    other => {
                        // The driver task ends only after the server; a send can fail only
                        // during shutdown, when nothing more needs doing.
                        let _ = self.io.send(Work::Effect(other));
                    }
                }
            }
        }
    }
}

/// Locks `m`; a poisoned lock (a panic while held) is logged and used as it is: what it guards
/// is replaced whole, never left half-changed.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| {
        tracing::error!("a coordinator lock was poisoned by a panic; carrying on");
        poisoned.into_inner()
    })
}

/// Puts `command` on `worker_id`'s stream; false if it has none, or it is full or closed.
fn send(
    commands: &HashMap<String, (u64, CommandSender)>,
    worker_id: &str,
    command: worker_command::Command,
) -> bool {
    commands.get(worker_id).is_some_and(|(_, tx)| {
        tx.try_send(Ok(WorkerCommand {
            command: Some(command),
        }))
        .is_ok()
    })
}

/// Gives the machine the time every `TICK` and whenever woken, until `stop` resolves.
pub async fn tick(shared: Arc<Shared>, stop: impl std::future::Future<Output = ()>) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = shared.wake.notified() => {}
            _ = tokio::time::sleep(TICK) => {}
        }
        let _ = shared.apply(Input::Tick);
    }
}

/// What the driver task did before it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drained {
    /// Records written after the stop was asked.
    pub written: usize,
    /// Records that could not be written (each logged with its file).
    pub failed: usize,
}

/// The driver task: carries out the machine's effects that touch the disk or take long, in
/// order, until `stop` resolves; then carries out those still queued (saves and metrics
/// lines) and returns what it wrote.
pub async fn run(
    shared: Arc<Shared>,
    mut effects: mpsc::UnboundedReceiver<Work>,
    stop: impl std::future::Future<Output = ()>,
) -> Drained {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            work = effects.recv() => match work {
                Some(Work::Barrier(done)) => {
                    let _ = done.send(());
                }
                Some(Work::Effect(Effect::Publish(status))) => shared.show(*status),
                Some(Work::Effect(effect)) => {
                    let s = shared.clone();
                    // Saves and appends run on a blocking thread, one at a time, in order.
                    let _ = tokio::task::spawn_blocking(move || carry_out(&s, effect)).await;
                }
                None => return Drained::default(),
            },
            _ = &mut stop => break,
        }
    }
    let mut drained = Drained::default();
    while let Ok(work) = effects.try_recv() {
        let Work::Effect(effect) = work else {
            continue;
        };
        if let Effect::Save { .. } = effect {
            if carry_out(&shared, effect) {
                drained.written += 1;
            } else {
                drained.failed += 1;
            }
        } else if let Effect::AppendMetrics { .. } = effect {
            carry_out(&shared, effect);
        }
    }
    drained
}

/// Carries out one effect that touches the disk (on a blocking thread); long ones are
/// spawned and come back as inputs. Returns false when a save failed.
fn carry_out(shared: &Arc<Shared>, effect: Effect) -> bool {
    match effect {
        Effect::Save {
            job_id,
            dir,
            record,
            seq,
        } => match record.write(&dir) {
            Ok(()) => {
                let generation = record.generation;
                let _ = shared.apply(Input::Saved {
                    job_id,
                    seq,
                    generation,
                });
                return true;
            }
            Err(e) => {
                tracing::error!(job = %job_id, "cannot save the job's state: {e}");
                let _ = shared.apply(Input::SaveFailed {
                    job_id,
                    error: e.to_string(),
                    storage_full: e.is_storage_full(),
                });
                return false;
            }
        },
        Effect::AppendMetrics { dir, line } => append_metrics(shared, &dir, &line),
        Effect::RemoveCheckpoints { dirs } => {
            for dir in dirs {
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(dir = %dir.display(), "cannot remove old checkpoint: {e}");
                }
            }
        }
        Effect::Prepare { job_id, spec, dir } => {
            let shared = shared.clone();
            std::thread::spawn(move || {
                tracing::info!(job = %job_id, "preparing data and model");
                let result = prepare_job::begin_attempt(&dir).and_then(|()| {
                    let result =
                        prepare_job::prepare_within(&job_id, &spec, &dir, &shared.input_roots);
                    prepare_job::end_attempt(&dir);
                    result
                });
                let result = result.map(Arc::new).map_err(|e| e.to_string());
                let _ = shared.apply(Input::Prepared { job_id, result });
            });
        }
        Effect::BuildFiles(launch) => {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let result = build_files(&launch).map_err(|e| e.to_string());
                let _ = shared.apply(Input::FilesBuilt {
                    job_id: launch.job_id.clone(),
                    generation: launch.generation,
                    result,
                });
            });
        }
        Effect::VerifyCheckpoints {
            job_id,
            generation,
            dir,
            steps,
        } => {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let newest = newest_intact_checkpoint(&job_id, &dir, &steps);
                let _ = shared.apply(Input::CheckpointsVerified {
                    job_id,
                    generation,
                    newest,
                });
            });
        }
        Effect::Publish(status) => shared.show(*status),
        // Commands are put on the streams under the lock (`Shared::carry_out`).
        Effect::Send { .. } => {}
    }
    true
}

/// Appends `line` to `dir/metrics.jsonl` and its scalars to the job's TensorBoard event file
/// (a failure is logged, naming the file).
fn append_metrics(shared: &Shared, dir: &std::path::Path, line: &MetricsLine) {
    let path = dir.join("metrics.jsonl");
    if let Err(e) = keel_proto::metrics::append(&path, line) {
        tracing::warn!(path = %path.display(), "cannot append metrics: {e}");
    }
    shared.event_logs.append(dir, line);
}

/// Builds every rank's shard and lists its files (state files of a checkpoint replace the
/// prepared files of the same role).
///
/// Errors: as `prepare_job::rank_files` and `prepare_job::job_file`.
fn build_files(launch: &Launch) -> Result<RankFiles, CoordinatorError> {
    let world = launch.workers.len();
    let state_files = launch
        .state_files
        .iter()
        .map(|(role, path)| prepare_job::job_file(role.clone(), path.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    (0..world)
        .map(|rank| {
            let mut files = prepare_job::rank_files(
                &launch.job_id,
                &launch.spec,
                &launch.prepared,
                &launch.dir,
                world,
                rank,
                launch.global_batch,
            )?;
            files.retain(|(_, _, f)| !state_files.iter().any(|(_, _, s)| s.role == f.role));
            files.extend(state_files.iter().cloned());
            Ok(files)
        })
        .collect()
}

/// The newest of the stored checkpoints `steps` of the job in `job_dir` whose files match
/// its manifest (a damaged one is logged, naming the file, and passed over).
fn newest_intact_checkpoint(job_id: &str, job_dir: &std::path::Path, steps: &[u64]) -> Option<u64> {
    steps.iter().rev().copied().find(|&step| {
        let dir = crate::layout::checkpoint_dir(job_dir, step);
        match keel_proto::checkpoint::verify_dir(&dir) {
            Ok(Some(_)) => true,
            Ok(None) => {
                tracing::error!(job = %job_id, dir = %dir.display(), "checkpoint has no manifest.json: not resuming from it");
                false
            }
            Err(e) => {
                tracing::error!(job = %job_id, "checkpoint of step {step} is damaged, not resuming from it: {e}");
                false
            }
        }
    })
}
