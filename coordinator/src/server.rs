//! Runs a coordinator: the gRPC service, the machine's driver and its timer, until shutdown.

use crate::CoordinatorError;
use crate::driver;
use crate::driver::Shared;
use crate::input_roots::InputRoots;
use crate::service::CoordinatorService;
use keel_net::security::ServerSecurity;
use keel_proto::protocol::MAX_MESSAGE_BYTES;
use keel_proto::rpc::coordinator_server::CoordinatorServer;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
use tokio::net::TcpListener;

/// Settings of a coordinator process.
#[derive(Debug)]
pub struct Config {
    /// Folder for jobs (`jobs/job-N/`: prepared data, shards, metrics, checkpoints).
    pub data_dir: PathBuf,
    /// The cluster token every call but health must carry, and TLS when configured.
    pub security: ServerSecurity,
    /// The folders a job's paths must lie in (`--input-root`); empty: any readable file.
    pub input_roots: InputRoots,
    /// The bound `--metrics-listen` port (metrics, dashboard, API: [`crate::http`]); `None`:
    /// off.
    pub metrics_listener: Option<TcpListener>,
    /// TLS for that port (the gRPC certificate, `keel_net::tls::ServerTlsArgs::load_http`);
    /// `None`: plain HTTP.
    pub metrics_tls: Option<std::sync::Arc<keel_net::rustls::ServerConfig>>,
}

/// Serves the coordinator on `listener` until `shutdown` resolves, then stops within ~2 s
/// (open watch and attach streams are closed rather than waited for) and saves every job's
/// state (`JOB_DIR/job-state.json`) before returning. Jobs saved in `config.data_dir` by an
/// earlier run come back first (`crate::persist`).
///
/// Errors: [`CoordinatorError::Io`] if the data folder cannot be created,
/// [`CoordinatorError::Transport`] if the server fails.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), CoordinatorError> {
    let jobs = config.data_dir.join("jobs");
    std::fs::create_dir_all(&jobs).map_err(CoordinatorError::io(&jobs))?;
    // No upload is in flight yet: any half-written one is left over from a coordinator that
    // stopped during it, and only takes space a checkpoint may need.
    let freed = crate::disk::remove_partial_uploads(&jobs);
    if freed > 0 {
        tracing::info!(bytes = freed, "removed half-written checkpoint uploads");
    }
    if config.input_roots.is_empty() {
        tracing::warn!(
            "no --input-root (KEEL_INPUT_ROOT) set: a job may name any file this process can \
             read as its corpus, vocabulary or model config; set the folders jobs may read"
        );
    } else {
        tracing::info!(roots = %config.input_roots.describe(), "jobs may read only inside the input roots");
    }
    let (shared, effects) = Shared::new(config.data_dir.clone(), config.input_roots.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let ticker = tokio::spawn(driver::tick(shared.clone(), async move {
        let _ = stop_rx.await;
    }));
    let (driver_stop_tx, driver_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let driver = tokio::spawn(driver::run(shared.clone(), effects, async move {
        let _ = driver_stop_rx.await;
    }));
    let (http_stop_tx, http_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let http = config.metrics_listener.map(|listener| {
        tokio::spawn(keel_net::http_port::serve(
            listener,
            config.security.token().clone(),
            config.security.limits(),
            config.metrics_tls.clone(),
            crate::http::routes(shared.clone()),
            async move {
                let _ = http_stop_rx.await;
            },
        ))
    });
    let service = CoordinatorServer::new(CoordinatorService::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let (health_reporter, health, reflection) =
        keel_net::admin::admin_services::<CoordinatorServer<CoordinatorService>>().await?;
    let (server_stop_tx, server_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = config
        .security
        .server()?
        .initial_stream_window_size(Some(16 << 20))
        .initial_connection_window_size(Some(32 << 20))
        .max_frame_size(Some(1 << 20))
        // Health stays open (probes cannot send a token; it reveals and does nothing).
        .add_service(health)
        .add_service(config.security.require(reflection))
        .add_service(config.security.require(service))
        .serve_with_incoming_shutdown(config.security.incoming(listener), async move {
            let _ = server_stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => {
            let _ = http_stop_tx.send(());
            let _ = stop_tx.send(());
            let _ = ticker.await;
            save_all(&shared, driver_stop_tx, driver).await;
            return result.map_err(CoordinatorError::from);
        }
        _ = shutdown => {}
    }
    keel_net::admin::mark_not_serving(&health_reporter).await;
    let _ = server_stop_tx.send(());
    let _ = http_stop_tx.send(());
    if let Some(http) = http {
        // Open dashboard polls end with the process; give in-flight ones a moment.
        let _ = tokio::time::timeout(Duration::from_secs(1), http).await;
    }
    let _ = stop_tx.send(());
    // Close every attach stream so graceful shutdown does not wait on them.
    shared.close_streams();
    let _ = ticker.await;
    let result = match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(result) => result.map_err(CoordinatorError::from),
        Err(_) => Ok(()),
    };
    save_all(&shared, driver_stop_tx, driver).await;
    result
}

/// Hands every job's record to the driver, stops it once it has written what was queued,
/// and says so (shutdown).
async fn save_all(
    shared: &Shared,
    stop: tokio::sync::oneshot::Sender<()>,
    driver: tokio::task::JoinHandle<driver::Drained>,
) {
    let jobs = shared.read(|m| m.jobs().count());
    shared.save_all();
    let _ = stop.send(());
    let drained = driver.await.unwrap_or_default();
    if drained.failed == 0 {
        tracing::info!(
            jobs,
            written = drained.written,
            "job state saved before exit"
        );
    } else {
        tracing::error!(
            jobs,
            written = drained.written,
            failed = drained.failed,
            "job state not saved for every job before exit"
        );
    }
}
