//! One job's generation on this worker, from start to the report of how it ended: the
//! replica is kept for the next generation (unless the job was cancelled), then the
//! coordinator hears done, failed, left (shutdown) or, on a suspend, what is held.

use super::state::WorkerState;
use crate::control::StopReason;
use crate::job::{self, JobContext};
use crate::replica::HeldReplica;
use keel_net::auth::AuthChannel;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{DoneReport, FailureReport, HeldReport, StartJob, TrainingKey};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Runs one job's generation and tells the coordinator how it ended; keeps the replica for
/// the next generation unless the job was cancelled.
pub(super) async fn run_and_report(
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
    let (job_id, generation) = (key.job_id.clone(), key.generation);
    // Hold the replica before saying anything: the coordinator may answer a report with the
    // next generation's StartJob at once. From here on a Suspend is answered by the command
    // loop (it finds the replica held here): the reason is read under the lock that
    // `stop_running` sets it under, with the job marked ended, so a stop is seen either here
    // or there, never lost. (It was lost when read earlier: a Suspend that came while the
    // failure report below was in flight went unanswered, and the coordinator waited its whole
    // peer timeout for this worker, then dropped it.)
    let (reason, worker_id, held_steps) = {
        let mut s = state.lock();
        let reason = control.reason();
        s.held = match (reason, replica) {
            (Some(StopReason::Cancel), _) | (_, None) => None,
            (_, Some(replica)) => Some(HeldReplica {
                job_id: job_id.clone(),
                generation,
                replica,
            }),
        };
        if let Some(r) = s
            .running
            .as_mut()
            .filter(|r| r.job_id == job_id && r.generation == generation)
        {
            r.ended = true;
        }
        (reason, s.worker_id.clone(), s.held_steps(&job_id))
    };
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
    state.lock().clear_running(&job_id, generation);
}

/// Sends `ReportHeld` for `job_id` at `generation` (protocol step 14): the steps this worker
/// holds of it (`held_steps`, empty if none). A failure to send is logged.
pub(super) async fn report_held(
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
