//! The worker process: serves the ring, registers with the coordinator, heartbeats, and runs
//! the jobs the coordinator assigns (protocol steps 1, 2, 5 in `keel_proto::protocol`).

use crate::allreduce::{Mailbox, RingDataPlane, ring_service, tune_server};
use crate::client::coordinator_client;
use crate::control::{JobControl, StopReason};
use crate::job::{self, JobContext};
use crate::replica::HeldReplica;
use keel_proto::auth::AuthChannel;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{
    AttachRequest, DoneReport, FailureReport, HeartbeatRequest, HeldReport, RegisterRequest,
    StartJob, TrainingKey, worker_command,
};
use keel_proto::security::{ClientSecurity, ServerSecurity};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// Settings of a worker process.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// The coordinator, host:port (a host alone means port 7070).
    #[arg(long, env = "KEEL_COORDINATOR", default_value = "127.0.0.1:7070")]
    pub coordinator: String,
    /// Address to listen on for ring peers.
    #[arg(long, env = "KEEL_LISTEN", default_value = "0.0.0.0:7071")]
    pub listen: String,
    /// host:port at which the other workers reach this one (required: never guessed).
    #[arg(long, env = "KEEL_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// Compute threads (GEMMs are cut among them; OpenBLAS itself runs single-threaded);
    /// default: all cores.
    #[arg(long, env = "KEEL_THREADS")]
    pub threads: Option<usize>,
    /// Folder caching shards and holding checkpoints before upload.
    #[arg(long, env = "KEEL_CACHE_DIR", default_value = "keel-cache")]
    pub cache_dir: PathBuf,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "KEEL_LOG", default_value = "info")]
    pub log: String,
    #[command(flatten)]
    pub token: keel_proto::auth::TokenArgs,
    #[command(flatten)]
    pub server_tls: keel_proto::tls::ServerTlsArgs,
    #[command(flatten)]
    pub client_tls: keel_proto::tls::ClientTlsArgs,
    #[command(flatten)]
    pub connections: keel_proto::incoming::ConnectionArgs,
    /// Fault injection for tests: this worker's loss is NaN at this 0-based step of every job.
    #[arg(long, hide = true)]
    pub fault_nan_at_step: Option<u64>,
    /// Fault injection for tests: at this 0-based step (once per process) this worker's first
    /// all-reduce fails as when its left neighbour sends a malformed ring frame.
    #[arg(long, hide = true)]
    pub fault_bad_frame_at_step: Option<u64>,
    /// Memory this worker may use for a job, in bytes (suffixes K, M, G, T: powers of 1024),
    /// advertised to the coordinator, which assigns only jobs estimated to fit; default:
    /// MemTotal of /proc/meminfo, or the cgroup's memory limit if lower.
    #[arg(long, env = "KEEL_MEMORY_LIMIT", value_parser = parse_bytes)]
    pub memory_limit: Option<u64>,
}

/// `--memory-limit`'s value: a byte count with an optional K/M/G/T suffix (powers of 1024).
///
/// Errors: a message naming the value when it is not a number or overflows 64 bits.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        Some((i, 'T' | 't')) => (&t[..i], 40),
        _ => (t, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count such as 8G or 1073741824"))?;
    n.checked_mul(1u64 << shift)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{text:?} is zero or more than 2^64 bytes"))
}

/// What [`run`] needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The coordinator, host:port.
    pub coordinator: String,
    /// host:port peers reach this worker at.
    pub advertise_addr: String,
    /// Compute threads.
    pub threads: usize,
    /// Cache folder.
    pub cache_dir: PathBuf,
    /// What the ring server requires (token, TLS).
    pub server_security: ServerSecurity,
    /// How this worker calls the coordinator and its ring peers (token, TLS).
    pub client_security: ClientSecurity,
    /// Fault injection for tests (see [`Args::fault_nan_at_step`]).
    pub fault_nan_at_step: Option<u64>,
    /// Fault injection for tests (see [`Args::fault_bad_frame_at_step`]).
    pub fault_bad_frame_at_step: Option<u64>,
    /// Bytes of memory a job may use here (see [`Args::memory_limit`]); `None`: unknown, not
    /// checked.
    pub memory_limit: Option<u64>,
}

/// Errors that stop a worker process.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The ring server failed.
    #[error("ring server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The coordinator address is malformed.
    #[error(transparent)]
    Client(#[from] crate::client::TransferError),
    /// The health or reflection service could not be built.
    #[error(transparent)]
    Admin(#[from] keel_proto::admin::AdminError),
    /// The cache folder cannot be created.
    #[error("{path}: {source}")]
    Io {
        /// The folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Parses nothing more, sets up logging and the runtime, and runs a worker until Ctrl-C.
pub fn main(args: Args) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&args.log))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let Some(advertise_addr) = args.advertise_addr.clone() else {
        anyhow::bail!(
            "--advertise-addr (or KEEL_ADVERTISE_ADDR) is required: the host:port other workers reach this one at"
        );
    };
    let (server_security, client_security) =
        keel_proto::security::worker_security(&args.token, &args.server_tls, &args.client_tls)?;
    let server_security = server_security.with_connection_limits(args.connections.limits()?);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
        tracing::info!(listen = %listener.local_addr()?, advertise = %advertise_addr, threads, memory_limit = ?args.memory_limit, "worker starting");
        let config = Config {
            coordinator: args.coordinator.clone(),
            advertise_addr,
            threads,
            cache_dir: args.cache_dir.clone(),
            server_security,
            client_security,
            fault_nan_at_step: args.fault_nan_at_step,
            fault_bad_frame_at_step: args.fault_bad_frame_at_step,
            memory_limit: args
                .memory_limit
                .or_else(keel_proto::memory::machine_memory_limit),
        };
        run(config, listener, keel_proto::admin::shutdown_signal()).await?;
        Ok(())
    })
}

/// Runs a worker on `listener` until `shutdown` resolves: serves the ring, registers with the
/// coordinator (retrying while it is down), heartbeats and runs assigned jobs.
///
/// Errors: [`ServeError`] when the ring server cannot run or the cache folder cannot be made.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    std::fs::create_dir_all(&config.cache_dir).map_err(|source| ServeError::Io {
        path: config.cache_dir.clone(),
        source,
    })?;
    crate::model::set_blas_threads(config.threads);
    let mailbox = Mailbox::with_peer_security(config.client_security.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut server_stop = stop_rx.clone();
    let (health_reporter, health, reflection) =
        keel_proto::admin::admin_services::<RingDataPlane>().await?;
    let security = &config.server_security;
    let server = tune_server(security.server()?)
        // Health stays open (probes cannot send a token; it reveals and does nothing).
        .add_service(health)
        .add_service(security.require(reflection))
        .add_service(security.require(ring_service(mailbox.clone())))
        .serve_with_incoming_shutdown(security.incoming(listener), async move {
            let _ = server_stop.wait_for(|s| *s).await;
        });
    let server = tokio::spawn(server);
    let client = coordinator_client(&config.coordinator, &config.client_security)?;
    let sessions = tokio::spawn(sessions(config, client, mailbox, stop_rx));
    shutdown.await;
    keel_proto::admin::mark_not_serving(&health_reporter).await;
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(3), sessions).await;
    match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(Ok(result)) => result.map_err(ServeError::from),
        _ => Ok(()),
    }
}

/// The job running on this worker now.
#[derive(Debug)]
struct Running {
    job_id: String,
    generation: u64,
    control: Arc<JobControl>,
    /// Steps completed (advanced by the training loop).
    progress: Arc<AtomicU64>,
    /// The training task has returned and is reporting how it ended: a stop asked now would
    /// never be seen by it, so [`WorkerState::stop_running`] leaves the answer to its caller.
    ended: bool,
}

/// What this worker process is doing, across coordinator sessions (a coordinator restart
/// ends a session; the job and the held replica outlive it).
#[derive(Debug, Default)]
struct WorkerState {
    /// The worker id of the current registration (reports are sent under it).
    worker_id: Mutex<String>,
    /// The job running now (one at a time).
    running: Mutex<Option<Running>>,
    /// What the worker holds of a job between generations (protocol step 14).
    held: Mutex<Option<HeldReplica>>,
}

impl WorkerState {
    fn worker_id(&self) -> String {
        self.worker_id.lock().map(|w| w.clone()).unwrap_or_default()
    }

    /// `(job, generation, step)` of the job running or held, for registration.
    fn held_key(&self) -> Option<TrainingKey> {
        if let Ok(r) = self.running.lock()
            && let Some(r) = r.as_ref()
        {
            return Some(TrainingKey {
                job_id: r.job_id.clone(),
                generation: r.generation,
                step: r.progress.load(Ordering::SeqCst),
            });
        }
        let held = self.held.lock().ok()?;
        held.as_ref().map(|h| TrainingKey {
            job_id: h.job_id.clone(),
            generation: h.generation,
            step: h.replica.step,
        })
    }

    /// The steps held of `job_id` (empty if none).
    fn held_steps(&self, job_id: &str) -> Vec<u64> {
        self.held
            .lock()
            .ok()
            .and_then(|h| {
                h.as_ref()
                    .filter(|h| h.job_id == job_id)
                    .map(|h| vec![h.replica.step])
            })
            .unwrap_or_default()
    }

    /// Stops the running job if it is `job_id` (any job if `None`); whether one was running.
    fn stop_running(&self, job_id: Option<&str>, reason: StopReason) -> bool {
        let Ok(r) = self.running.lock() else {
            return false;
        };
        match r.as_ref() {
            Some(run) if !run.ended && job_id.is_none_or(|j| j == run.job_id) => {
                run.control.stop(reason);
                true
            }
            _ => false,
        }
    }

    fn is_running(&self) -> bool {
        self.running.lock().is_ok_and(|r| r.is_some())
    }
}

/// Registers and serves one coordinator session after another until stopped.
async fn sessions(
    config: Config,
    client: CoordinatorClient<AuthChannel>,
    mailbox: Arc<Mailbox>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let state = Arc::new(WorkerState::default());
    let mut backoff = Duration::from_millis(100);
    loop {
        if *stop.borrow() {
            break;
        }
        // The session lives until the end of this iteration: on a stop, the running job
        // reports that it leaves while the command stream is still open, so the coordinator
        // hears why before it sees the stream close.
        let current = session(&config, client.clone(), mailbox.clone(), state.clone());
        tokio::pin!(current);
        let mut stopping = false;
        tokio::select! {
            result = &mut current => {
                match result {
                    Ok(()) => backoff = Duration::from_millis(100),
                    Err(e) if e.code() == tonic::Code::Unauthenticated => {
                        // A wrong token will not fix itself quickly: retry, but rarely.
                        tracing::error!(
                            "coordinator {} refused this worker: {}; check --token-file (KEEL_TOKEN_FILE); retrying in {:?}",
                            config.coordinator, e.message(), backoff
                        );
                        backoff = (backoff * 2).min(Duration::from_secs(30));
                    }
                    Err(e) => {
                        tracing::warn!("coordinator {}: {e}; retrying", config.coordinator);
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
            _ = stop.wait_for(|s| *s) => stopping = true,
        }
        if stopping {
            leave_running_job(&state).await;
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    leave_running_job(&state).await;
}

/// Stops the running job: its ring calls are abandoned at once, and it tells the coordinator
/// that this worker is going away (run_and_report). Waits a bounded while (2.5 s).
async fn leave_running_job(state: &WorkerState) {
    state.stop_running(None, StopReason::Shutdown);
    for _ in 0..25 {
        if !state.is_running() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One registration: heartbeats plus the attach stream, until either fails.
async fn session(
    config: &Config,
    mut client: CoordinatorClient<AuthChannel>,
    mailbox: Arc<Mailbox>,
    state: Arc<WorkerState>,
) -> Result<(), tonic::Status> {
    // $HOSTNAME is a shell variable that is seldom exported; the kernel's name is the fallback
    // (empty only when neither exists: the coordinator then leaves the field out of its log).
    let hostname = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    // Probed once per process (CPUID, the kernel's AMX permission, a oneDNN bf16 matmul, with
    // AVX512_BF16 alone a race against fp32: well under a second), then cached; the coordinator's `auto` precision needs it.
    let bf16 = crate::model::bf16::support();
    tracing::info!(native = bf16.native, detail = %bf16.detail, "bf16 GEMMs");
    match crate::blas_core::replaced_core() {
        Some((detected, now)) => {
            tracing::info!(detected = %detected, using = %now, "OpenBLAS did not know this CPU: OPENBLAS_CORETYPE set")
        }
        None => tracing::info!(core = %crate::blas_core::core_name(), "OpenBLAS kernels"),
    }
    let held = state.held_key();
    let held_steps = held
        .as_ref()
        .map(|k| state.held_steps(&k.job_id))
        .unwrap_or_default();
    let reply = client
        .register(RegisterRequest {
            advertise_addr: config.advertise_addr.clone(),
            threads: config.threads as u32,
            hostname,
            held,
            held_steps,
            bf16_native: bf16.native,
            bf16_detail: bf16.detail.clone(),
            memory_limit_bytes: config.memory_limit,
        })
        .await?
        .into_inner();
    let worker_id = reply.worker_id;
    if let Ok(mut w) = state.worker_id.lock() {
        *w = worker_id.clone();
    }
    tracing::info!(worker = %worker_id, coordinator = %config.coordinator, "registered");
    let interval = Duration::from_millis(reply.heartbeat_interval_ms.max(100));
    let heartbeat = heartbeat_loop(client.clone(), worker_id.clone(), state.clone(), interval);
    let mut commands = client
        .attach(AttachRequest {
            worker_id: worker_id.clone(),
        })
        .await?
        .into_inner();
    let attach = async {
        while let Some(cmd) = commands.message().await? {
            match cmd.command {
                Some(worker_command::Command::Start(start)) => {
                    start_job(config, &client, &mailbox, &state, start);
                }
                Some(worker_command::Command::Cancel(cancel)) => {
                    let Some(key) = cancel.key else { continue };
                    tracing::warn!(job = %key.job_id, reason = %cancel.reason, "job cancelled by the coordinator");
                    state.stop_running(Some(&key.job_id), StopReason::Cancel);
                    if let Ok(mut held) = state.held.lock()
                        && held.as_ref().is_some_and(|h| h.job_id == key.job_id)
                    {
                        *held = None;
                    }
                }
                Some(worker_command::Command::Suspend(suspend)) => {
                    let Some(key) = suspend.key else { continue };
                    tracing::warn!(job = %key.job_id, generation = key.generation, reason = %suspend.reason, "suspending: a new generation is forming");
                    let stopping = state.stop_running(
                        Some(&key.job_id),
                        StopReason::Suspend {
                            generation: key.generation,
                        },
                    );
                    if !stopping {
                        // Not training it: answer now with what is held.
                        let steps = state.held_steps(&key.job_id);
                        report_held(
                            &mut client.clone(),
                            &state,
                            &key.job_id,
                            key.generation,
                            steps,
                        )
                        .await;
                    }
                }
                None => {}
            }
        }
        Ok::<(), tonic::Status>(())
    };
    tokio::select! {
        r = attach => r,
        r = heartbeat => r,
    }
}

/// Starts the job of `start` on its own task (stopping any other job first: one at a time).
fn start_job(
    config: &Config,
    client: &CoordinatorClient<AuthChannel>,
    mailbox: &Arc<Mailbox>,
    state: &Arc<WorkerState>,
    start: StartJob,
) {
    let Some(key) = start.key.clone() else {
        return;
    };
    state.stop_running(None, StopReason::Cancel);
    let held = match state.held.lock() {
        Ok(mut h) => match h.take() {
            Some(h) if h.job_id == key.job_id => Some(h.replica),
            // A different job: the coordinator moved on; free the memory.
            _ => None,
        },
        Err(_) => None,
    };
    let control = Arc::new(JobControl::new());
    let progress = Arc::new(AtomicU64::new(start.start_step));
    if let Ok(mut running) = state.running.lock() {
        *running = Some(Running {
            job_id: key.job_id.clone(),
            generation: key.generation,
            control: control.clone(),
            progress: progress.clone(),
            ended: false,
        });
    }
    let ctx = JobContext {
        client: client.clone(),
        worker_id: state.worker_id(),
        cache_dir: config.cache_dir.clone(),
        mailbox: mailbox.clone(),
        control,
        progress,
        fault_nan_at_step: config.fault_nan_at_step,
        fault_bad_frame_at_step: config.fault_bad_frame_at_step,
        memory_limit: config.memory_limit,
    };
    tokio::spawn(run_and_report(ctx, start, held, state.clone()));
}

/// Sends `ReportHeld` for `job_id` at `generation` (protocol step 14).
async fn report_held(
    client: &mut CoordinatorClient<AuthChannel>,
    state: &WorkerState,
    job_id: &str,
    generation: u64,
    held_steps: Vec<u64>,
) {
    let report = HeldReport {
        key: Some(TrainingKey {
            job_id: job_id.to_string(),
            generation,
            step: held_steps.iter().copied().max().unwrap_or(0),
        }),
        worker_id: state.worker_id(),
        held_steps,
    };
    tracing::info!(job = %job_id, generation, held = ?report.held_steps, "reporting what this worker holds");
    if let Err(e) = client.report_held(report).await {
        tracing::warn!("reporting held state: {e}");
    }
}

/// Heartbeats every `interval`; returns when the coordinator no longer knows this worker.
async fn heartbeat_loop(
    mut client: CoordinatorClient<AuthChannel>,
    worker_id: String,
    state: Arc<WorkerState>,
    interval: Duration,
) -> Result<(), tonic::Status> {
    let mut failures = 0u32;
    loop {
        tokio::time::sleep(interval).await;
        let key = state.running.lock().ok().and_then(|r| {
            r.as_ref().map(|r| TrainingKey {
                job_id: r.job_id.clone(),
                generation: r.generation,
                step: r.progress.load(Ordering::SeqCst),
            })
        });
        match client
            .heartbeat(HeartbeatRequest {
                worker_id: worker_id.clone(),
                key,
            })
            .await
        {
            Ok(reply) if !reply.get_ref().known => {
                return Err(tonic::Status::not_found(
                    "the coordinator forgot this worker",
                ));
            }
            Ok(_) => failures = 0,
            Err(e) => {
                failures += 1;
                if failures >= 5 {
                    return Err(e);
                }
            }
        }
    }
}

/// Runs one job's generation and tells the coordinator how it ended; keeps the replica for
/// the next generation unless the job was cancelled.
async fn run_and_report(
    ctx: JobContext,
    start: StartJob,
    held: Option<crate::replica::Replica>,
    state: Arc<WorkerState>,
) {
    let mut client = ctx.client.clone();
    let rank = start.rank;
    let Some(key) = start.key.clone() else { return };
    let control = ctx.control.clone();
    let progress = ctx.progress.clone();
    tracing::info!(job = %key.job_id, generation = key.generation, rank, world_size = start.world_size, start_step = start.start_step, "starting job");
    let (result, replica) = job::run_job(ctx, start, held).await;
    let step = replica
        .as_ref()
        .map_or_else(|| progress.load(Ordering::SeqCst), |r| r.step);
    // Hold the replica before saying anything: the coordinator may answer a report with the
    // next generation's StartJob at once.
    if let Ok(mut h) = state.held.lock() {
        *h = match (control.reason(), replica) {
            (Some(StopReason::Cancel), _) | (_, None) => None,
            (_, Some(replica)) => Some(HeldReplica {
                job_id: key.job_id.clone(),
                generation: key.generation,
                replica,
            }),
        };
    }
    let (job_id, generation) = (key.job_id.clone(), key.generation);
    // From here on a Suspend is answered by the command loop (it finds the replica held above):
    // the reason is read under the same lock that `stop_running` sets it under, so a stop is
    // seen either here or there, never lost. (It was lost when read earlier: a Suspend that
    // came while the failure report below was in flight went unanswered, and the coordinator
    // waited its whole peer timeout for this worker, then dropped it.)
    let reason = match state.running.lock() {
        Ok(mut running) => {
            if let Some(r) = running
                .as_mut()
                .filter(|r| r.job_id == job_id && r.generation == generation)
            {
                r.ended = true;
            }
            control.reason()
        }
        Err(_) => control.reason(),
    };
    let worker_id = state.worker_id();
    let held_steps = state.held_steps(&key.job_id);
    let key = TrainingKey { step, ..key };
    match (result, reason) {
        (_, Some(StopReason::Suspend { generation })) => {
            report_held(&mut client, &state, &key.job_id, generation, held_steps).await;
        }
        (_, Some(StopReason::Cancel)) => {
            tracing::warn!(job = %key.job_id, step, "job stopped: cancelled");
        }
        (Ok(()), _) => {
            tracing::info!(job = %key.job_id, step, "job finished");
            let report = DoneReport {
                key: Some(key),
                rank,
                worker_id,
            };
            if let Err(e) = client.report_done(report).await {
                tracing::error!("reporting done: {e}");
            }
        }
        (Err(_), Some(StopReason::Shutdown)) => {
            // SIGTERM/SIGINT: the step in flight is abandoned; say so rather than go silent.
            tracing::warn!(job = %key.job_id, step, "shutting down: leaving the job");
            let report = FailureReport {
                key: Some(key),
                rank,
                error: format!(
                    "worker {worker_id} (rank {rank}) was shut down by a signal after step {step}"
                ),
                worker_id,
                recoverable: true,
                held_steps: Vec::new(),
            };
            if let Err(e) = client.report_failure(report).await {
                tracing::error!("reporting shutdown: {e}");
            }
        }
        (Err(e), None) => {
            let recoverable = e.is_recoverable();
            tracing::error!(job = %key.job_id, step, recoverable, "job failed: {e}");
            let report = FailureReport {
                key: Some(key),
                rank,
                worker_id,
                error: e.to_string(),
                recoverable,
                held_steps,
            };
            if let Err(e) = client.report_failure(report).await {
                tracing::error!("reporting failure: {e}");
            }
        }
    }
    // Only now, after the report: a shutdown waits for this before closing the session.
    if let Ok(mut running) = state.running.lock()
        && running
            .as_ref()
            .is_some_and(|r| r.job_id == job_id && r.generation == generation)
    {
        *running = None;
    }
}
