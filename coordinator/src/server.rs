//! Runs a coordinator: the gRPC service plus the scheduler loop, until shutdown.

use crate::CoordinatorError;
use crate::input_roots::InputRoots;
use crate::persist;
use crate::scheduler;
use crate::service::CoordinatorService;
use crate::state::Shared;
use keel_proto::protocol::MAX_MESSAGE_BYTES;
use keel_proto::rpc::coordinator_server::CoordinatorServer;
use keel_proto::security::ServerSecurity;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Settings of a coordinator process.
#[derive(Debug, Clone)]
pub struct Config {
    /// Folder for jobs (`jobs/job-N/`: prepared data, shards, metrics, checkpoints).
    pub data_dir: PathBuf,
    /// The cluster token every call but health must carry, and TLS when configured.
    pub security: ServerSecurity,
    /// The folders a job's paths must lie in (`--input-root`); empty: any readable file.
    pub input_roots: InputRoots,
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
    if config.input_roots.is_empty() {
        tracing::warn!(
            "no --input-root (KEEL_INPUT_ROOT) set: a job may name any file this process can \
             read as its corpus, vocabulary or model config; set the folders jobs may read"
        );
    } else {
        tracing::info!(roots = %config.input_roots.describe(), "jobs may read only inside the input roots");
    }
    let shared = Shared::new(config.data_dir.clone(), config.input_roots.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let scheduler = tokio::spawn(scheduler::run(shared.clone(), async move {
        let _ = stop_rx.await;
    }));
    let progress = tokio::spawn(save_progress(shared.clone()));
    let service = CoordinatorServer::new(CoordinatorService::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let (health_reporter, health, reflection) =
        keel_proto::admin::admin_services::<CoordinatorServer<CoordinatorService>>().await?;
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
            let _ = stop_tx.send(());
            let _ = scheduler.await;
            progress.abort();
            save_all(&shared);
            return result.map_err(CoordinatorError::from);
        }
        _ = shutdown => {}
    }
    keel_proto::admin::mark_not_serving(&health_reporter).await;
    let _ = server_stop_tx.send(());
    let _ = stop_tx.send(());
    {
        // Close every attach stream so graceful shutdown does not wait on them.
        let mut reg = shared.lock();
        for w in reg.workers.values_mut() {
            w.commands = None;
        }
    }
    let _ = scheduler.await;
    let result = match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(result) => result.map_err(CoordinatorError::from),
        Err(_) => Ok(()),
    };
    progress.abort();
    save_all(&shared);
    result
}

/// Every [`persist::PROGRESS_INTERVAL`], writes the step progress that `Job::publish` held
/// back and any unpublished change of an active job, so that a job that stops reporting is
/// still saved.
async fn save_progress(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(persist::PROGRESS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut reg = shared.lock();
        persist::flush_due(reg.jobs.values_mut());
    }
}

/// Saves every job's state (shutdown) and says so.
fn save_all(shared: &Shared) {
    let mut reg = shared.lock();
    let s = persist::flush_all(reg.jobs.values_mut());
    if s.failed == 0 {
        tracing::info!(
            jobs = s.jobs,
            written = s.written,
            "job state saved before exit"
        );
    } else {
        tracing::error!(
            jobs = s.jobs,
            written = s.written,
            failed = s.failed,
            "job state not saved for every job before exit"
        );
    }
}
