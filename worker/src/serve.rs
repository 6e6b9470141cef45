//! The worker process: serves the ring, registers with the coordinator, heartbeats, and runs
//! the jobs the coordinator assigns (protocol steps 1, 2, 5 in `keel_proto::protocol`).

use crate::allreduce::{Mailbox, RingService, ring_service, tune_server};
use crate::client::coordinator_client;
use crate::trainer::{self, JobContext};
use keel_proto::auth::AuthChannel;
use keel_proto::ring_rpc::ring_server::RingServer;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{
    AttachRequest, DoneReport, FailureReport, HeartbeatRequest, RegisterRequest, TrainingKey,
    worker_command,
};
use keel_proto::security::{ClientSecurity, ServerSecurity};
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// Settings of a worker process.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// The coordinator, host:port.
    #[arg(long, env = "KEEL_COORDINATOR", default_value = "127.0.0.1:7070")]
    pub coordinator: String,
    /// Address to listen on for ring peers.
    #[arg(long, env = "KEEL_LISTEN", default_value = "0.0.0.0:7071")]
    pub listen: String,
    /// host:port at which the other workers reach this one (required: never guessed).
    #[arg(long, env = "KEEL_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// Compute (BLAS) threads; default: all cores.
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
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
        tracing::info!(listen = %listener.local_addr()?, advertise = %advertise_addr, threads, "worker starting");
        let config = Config {
            coordinator: args.coordinator.clone(),
            advertise_addr,
            threads,
            cache_dir: args.cache_dir.clone(),
            server_security,
            client_security,
        };
        run(config, listener, keel_proto::admin::shutdown_signal()).await?;
        Ok(())
    })
}

/// The job the worker is in, for heartbeats; `step` is advanced by the trainer.
#[derive(Debug, Default)]
struct Current {
    /// Job id and generation, when in a job.
    job: Mutex<Option<(String, u64)>>,
    /// Steps completed in it.
    step: Arc<AtomicU64>,
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
        keel_proto::admin::admin_services::<RingServer<RingService>>().await?;
    let security = &config.server_security;
    let server = tune_server(security.server()?)
        // Health stays open (probes cannot send a token; it reveals and does nothing).
        .add_service(health)
        .add_service(security.require(reflection))
        .add_service(security.require(ring_service(mailbox.clone())))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
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

/// Registers and serves one coordinator session after another until stopped.
async fn sessions(
    config: Config,
    client: CoordinatorClient<AuthChannel>,
    mailbox: Arc<Mailbox>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let jobs: RunningJobs = Arc::default();
    let shutting_down = Arc::new(AtomicBool::new(false));
    let mut backoff = Duration::from_millis(100);
    loop {
        if *stop.borrow() {
            break;
        }
        tokio::select! {
            result = session(&config, client.clone(), mailbox.clone(), jobs.clone(), shutting_down.clone()) => {
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
            _ = stop.wait_for(|s| *s) => break,
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    // Stop running jobs: their next step sees the flag, and each tells the coordinator that
    // this worker is going away (run_and_report). Wait a bounded while for those reports.
    shutting_down.store(true, Ordering::SeqCst);
    if let Ok(jobs) = jobs.lock() {
        for flag in jobs.values() {
            flag.store(true, Ordering::SeqCst);
        }
    }
    for _ in 0..25 {
        if jobs.lock().map_or(true, |j| j.is_empty()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Jobs running on this worker: job id -> its cancel flag.
type RunningJobs = Arc<Mutex<HashMap<String, Arc<AtomicBool>>>>;

/// One registration: heartbeats plus the attach stream, until either fails.
async fn session(
    config: &Config,
    mut client: CoordinatorClient<AuthChannel>,
    mailbox: Arc<Mailbox>,
    jobs: RunningJobs,
    shutting_down: Arc<AtomicBool>,
) -> Result<(), tonic::Status> {
    let hostname = std::env::var("HOSTNAME").unwrap_or_default();
    let reply = client
        .register(RegisterRequest {
            advertise_addr: config.advertise_addr.clone(),
            threads: config.threads as u32,
            hostname,
            ..Default::default()
        })
        .await?
        .into_inner();
    let worker_id = reply.worker_id;
    tracing::info!(worker = %worker_id, coordinator = %config.coordinator, "registered");
    let current = Arc::new(Current::default());
    let interval = Duration::from_millis(reply.heartbeat_interval_ms.max(100));
    let heartbeat = heartbeat_loop(client.clone(), worker_id.clone(), current.clone(), interval);
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
                    let Some(key) = start.key.clone() else {
                        continue;
                    };
                    let cancel = Arc::new(AtomicBool::new(false));
                    if let Ok(mut map) = jobs.lock() {
                        map.insert(key.job_id.clone(), cancel.clone());
                    }
                    if let Ok(mut job) = current.job.lock() {
                        *job = Some((key.job_id.clone(), key.generation));
                    }
                    current.step.store(0, Ordering::SeqCst);
                    let ctx = JobContext {
                        client: client.clone(),
                        worker_id: worker_id.clone(),
                        cache_dir: config.cache_dir.clone(),
                        mailbox: mailbox.clone(),
                        cancel,
                        progress: current.step.clone(),
                    };
                    let (jobs, current) = (jobs.clone(), current.clone());
                    let shutting_down = shutting_down.clone();
                    tokio::spawn(async move {
                        run_and_report(ctx, start, &shutting_down).await;
                        if let Ok(mut map) = jobs.lock() {
                            map.remove(&key.job_id);
                        }
                        if let Ok(mut job) = current.job.lock()
                            && job
                                .as_ref()
                                .is_some_and(|(j, g)| *j == key.job_id && *g == key.generation)
                        {
                            *job = None;
                        }
                    });
                }
                Some(worker_command::Command::Cancel(cancel)) => {
                    let Some(key) = cancel.key else { continue };
                    tracing::warn!(job = %key.job_id, reason = %cancel.reason, "job cancelled by the coordinator");
                    if let Ok(map) = jobs.lock()
                        && let Some(flag) = map.get(&key.job_id)
                    {
                        flag.store(true, Ordering::SeqCst);
                    }
                }
                Some(worker_command::Command::Suspend(_)) | None => {}
            }
        }
        Ok::<(), tonic::Status>(())
    };
    tokio::select! {
        r = attach => r,
        r = heartbeat => r,
    }
}

/// Heartbeats every `interval`; returns when the coordinator no longer knows this worker.
async fn heartbeat_loop(
    mut client: CoordinatorClient<AuthChannel>,
    worker_id: String,
    current: Arc<Current>,
    interval: Duration,
) -> Result<(), tonic::Status> {
    let mut failures = 0u32;
    loop {
        tokio::time::sleep(interval).await;
        let key = current
            .job
            .lock()
            .ok()
            .and_then(|j| j.clone())
            .map(|(job_id, generation)| TrainingKey {
                job_id,
                generation,
                step: current.step.load(Ordering::SeqCst),
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

/// Runs one job and tells the coordinator how it ended.
async fn run_and_report(
    ctx: JobContext,
    start: keel_proto::rpc::StartJob,
    shutting_down: &AtomicBool,
) {
    let mut client = ctx.client.clone();
    let worker_id = ctx.worker_id.clone();
    let rank = start.rank;
    let Some(key) = start.key.clone() else { return };
    let progress = ctx.progress.clone();
    let cancel = ctx.cancel.clone();
    tracing::info!(job = %key.job_id, generation = key.generation, rank, world_size = start.world_size, "starting job");
    let result = trainer::run_job(ctx, start).await;
    let key = TrainingKey {
        step: progress.load(Ordering::SeqCst),
        ..key
    };
    match result {
        Ok(()) => {
            tracing::info!(job = %key.job_id, step = key.step, "job finished");
            let report = DoneReport {
                key: Some(key),
                rank,
                worker_id,
            };
            if let Err(e) = client.report_done(report).await {
                tracing::error!("reporting done: {e}");
            }
        }
        Err(e) if cancel.load(Ordering::SeqCst) && !shutting_down.load(Ordering::SeqCst) => {
            tracing::warn!(job = %key.job_id, "job stopped: {e}");
        }
        Err(_) if shutting_down.load(Ordering::SeqCst) => {
            // SIGTERM/SIGINT: the step in flight is abandoned; say so rather than go silent.
            tracing::warn!(job = %key.job_id, step = key.step, "shutting down: leaving the job");
            let report = FailureReport {
                key: Some(key.clone()),
                rank,
                worker_id: worker_id.clone(),
                error: format!(
                    "worker {worker_id} (rank {rank}) was shut down by a signal after step {}",
                    key.step
                ),
                ..Default::default()
            };
            if let Err(e) = client.report_failure(report).await {
                tracing::error!("reporting shutdown: {e}");
            }
        }
        Err(e) => {
            tracing::error!(job = %key.job_id, step = key.step, "job failed: {e}");
            let report = FailureReport {
                key: Some(key),
                rank,
                worker_id,
                error: e.to_string(),
                ..Default::default()
            };
            if let Err(e) = client.report_failure(report).await {
                tracing::error!("reporting failure: {e}");
            }
        }
    }
}
