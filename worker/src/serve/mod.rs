//! The worker process: serves the ring, registers with the coordinator, heartbeats, and runs
//! the jobs the coordinator assigns (protocol steps 1, 2, 5 in `keel_proto::protocol`).
//!
//! # Layout
//! - this file: settings ([`Args`]), start-up and [`run`]; `config`: what [`run`] needs
//!   ([`Config`]).
//! - `state`: what the worker is doing (its registration, the running job, the held
//!   replica): one state behind one lock.
//! - `session`: coordinator sessions: registration with retries, heartbeats, commands.
//! - `outcome`: one job's generation, run and reported to the coordinator.

mod config;
mod outcome;
mod session;
mod state;

pub use config::Config;

use crate::allreduce::{Mailbox, RingDataPlane, ring_service, tune_server};
use crate::faults::Faults;
use keel_net::client::coordinator_client;
use std::future::Future;
use std::path::PathBuf;
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
    /// Threads of the network runtime (the ring, calls to the coordinator, the metrics port),
    /// 1 to 64. With 1 they all run on one thread, which passes ring frames between tasks
    /// without waking other threads: the fastest measured on loopback and 1 Gbit/s links. Raise
    /// it only for links faster than one core can feed (25 Gbit/s and up; docs/performance.md,
    /// "The scale model's predictions").
    #[arg(long, env = "KEEL_IO_THREADS", default_value_t = crate::io_runtime::DEFAULT_IO_THREADS, value_parser = crate::io_runtime::parse_io_threads)]
    pub io_threads: usize,
    /// Folder caching shards and holding checkpoints before upload.
    #[arg(long, env = "KEEL_CACHE_DIR", default_value = "keel-cache")]
    pub cache_dir: PathBuf,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "KEEL_LOG", default_value = "info")]
    pub log: String,
    // The flattened groups below are documented where they are defined (their flags' help).
    #[allow(missing_docs)]
    #[command(flatten)]
    pub token: keel_net::auth::TokenArgs,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub server_tls: keel_net::tls::ServerTlsArgs,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub client_tls: keel_net::tls::ClientTlsArgs,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub connections: keel_net::incoming::ConnectionArgs,
    #[allow(missing_docs)]
    #[command(flatten)]
    pub metrics: keel_net::http_port::MetricsArgs,
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
    Admin(#[from] keel_net::admin::AdminError),
    /// The `--metrics-listen` address cannot be bound.
    #[error("--metrics-listen {addr}: {source}")]
    MetricsPort {
        /// The address as given.
        addr: String,
        /// The underlying error.
        source: std::io::Error,
    },
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
        keel_net::security::worker_security(&args.token, &args.server_tls, &args.client_tls)?;
    let server_security = server_security.with_connection_limits(args.connections.limits()?);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let runtime = crate::io_runtime::io_runtime(args.io_threads)?;
    runtime.block_on(async {
        let listener = TcpListener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
        tracing::info!(listen = %listener.local_addr()?, advertise = %advertise_addr, threads, io_threads = args.io_threads, memory_limit = ?args.memory_limit, "worker starting");
        let config = Config {
            coordinator: args.coordinator.clone(),
            advertise_addr,
            threads,
            cache_dir: args.cache_dir.clone(),
            server_security,
            client_security,
            // Made once here; every job of this process shares it (the ring fault fires once).
            faults: Faults::new(args.fault_nan_at_step, args.fault_bad_frame_at_step),
            memory_limit: args
                .memory_limit
                .or_else(keel_proto::memory::machine_memory_limit),
            metrics_listen: args.metrics.addr().map(str::to_string),
            metrics_tls: args.server_tls.load_http()?,
        };
        run(config, listener, keel_net::admin::shutdown_signal()).await?;
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
    let metrics = match &config.metrics_listen {
        Some(addr) => Some(metrics_port(addr, &config, stop_rx.clone()).await?),
        None => None,
    };
    let mut server_stop = stop_rx.clone();
    let (health_reporter, health, reflection) =
        keel_net::admin::admin_services::<RingDataPlane>().await?;
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
    // A malformed address is the same `TransferError::Connect` it always was.
    let client = coordinator_client(&config.coordinator, &config.client_security)
        .map_err(crate::client::TransferError::from)?;
    let sessions = tokio::spawn(session::sessions(config, client, mailbox, stop_rx.clone()));
    shutdown.await;
    keel_net::admin::mark_not_serving(&health_reporter).await;
    let _ = stop_tx.send(true);
    if let Some(metrics) = metrics {
        let _ = tokio::time::timeout(Duration::from_secs(1), metrics).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), sessions).await;
    match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(Ok(result)) => result.map_err(ServeError::from),
        _ => Ok(()),
    }
}

/// Binds `addr` and serves `/metrics` ([`crate::telemetry::encode`]) and `/healthz` there
/// until the worker stops; returns the server's task.
///
/// Errors: [`ServeError::MetricsPort`] when `addr` cannot be bound.
async fn metrics_port(
    addr: &str,
    config: &Config,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, ServeError> {
    use axum::routing::get;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::MetricsPort {
            addr: addr.to_string(),
            source,
        })?;
    let cache_dir = config.cache_dir.clone();
    let open = axum::Router::new()
        .route(
            "/metrics",
            get(move |headers: axum::http::HeaderMap| {
                let cache_dir = cache_dir.clone();
                async move {
                    keel_net::http_port::metrics_reply(
                        &headers,
                        crate::telemetry::encode(&cache_dir),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }));
    let routes = keel_net::http_port::Routes {
        open,
        protected: axum::Router::new(),
    };
    let token = config.server_security.token().clone();
    let limits = config.server_security.limits();
    let tls = config.metrics_tls.clone();
    Ok(tokio::spawn(async move {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) =
            keel_net::http_port::serve(listener, token, limits, tls, routes, stopped).await
        {
            tracing::error!("metrics port: {e}");
        }
    }))
}
