//! Coordinator sessions: register (retrying with backoff while the coordinator is down or
//! refuses), heartbeat, and carry out the commands of the attach stream (start, cancel,
//! suspend), one session after another until the worker stops.

use super::config::Config;
use super::outcome::{report_held, run_and_report};
use super::state::{Running, WorkerState};
use crate::allreduce::Mailbox;
use crate::control::{JobControl, StopReason};
use crate::job::JobContext;
use backon::{BackoffBuilder, ConstantBuilder, ExponentialBackoff, ExponentialBuilder, Retryable};
use keel_net::auth::AuthChannel;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{AttachRequest, HeartbeatRequest, RegisterRequest, StartJob, worker_command};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Pause before the next session after one that ended without an error.
const RESTART_PAUSE: Duration = Duration::from_millis(100);
/// First pause after a failed session; doubled after each failure in a row.
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(200);
/// Longest pause after a session that failed (the coordinator unreachable, say).
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);
/// Longest pause after the coordinator refused this worker's token: it will not fix itself
/// quickly, so retry, but rarely.
const MAX_REFUSED_PAUSE: Duration = Duration::from_secs(30);
/// Heartbeats in a row that may fail before the session is given up.
const HEARTBEAT_ATTEMPTS: usize = 5;
/// How long a leaving worker waits for its running job to report that it leaves.
const LEAVE_POLL: Duration = Duration::from_millis(100);
/// Polls of [`LEAVE_POLL`] (2.5 s in all).
const LEAVE_POLLS: usize = 25;

/// The pauses between failed sessions in a row: `200 ms, 400 ms, ...` up to `max`.
fn retry_pauses(max: Duration) -> ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(FIRST_RETRY_PAUSE)
        .with_factor(2.0)
        .with_max_delay(max)
        .without_max_times()
        .build()
}

/// Registers and serves one coordinator session after another until `stop` turns true.
pub(super) async fn sessions(
    config: Config,
    client: CoordinatorClient<AuthChannel>,
    mailbox: Arc<Mailbox>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let state = Arc::new(WorkerState::default());
    let (mut failed, mut refused) = (
        retry_pauses(MAX_RETRY_PAUSE),
        retry_pauses(MAX_REFUSED_PAUSE),
    );
    loop {
        if *stop.borrow() {
            break;
        }
        // The session lives until the end of this iteration: on a stop, the running job
        // reports that it leaves while the command stream is still open, so the coordinator
        // hears why before it sees the stream close.
        let current = session(&config, client.clone(), mailbox.clone(), state.clone());
        tokio::pin!(current);
        let pause = tokio::select! {
            result = &mut current => Some(match result {
                Ok(()) => {
                    (failed, refused) = (retry_pauses(MAX_RETRY_PAUSE), retry_pauses(MAX_REFUSED_PAUSE));
                    RESTART_PAUSE
                }
                Err(e) if e.code() == tonic::Code::Unauthenticated => {
                    let pause = refused.next().unwrap_or(MAX_REFUSED_PAUSE);
                    tracing::error!(
                        "coordinator {} refused this worker: {}; check --token-file (KEEL_TOKEN_FILE); retrying in {:?}",
                        config.coordinator, e.message(), pause
                    );
                    pause
                }
                Err(e) => {
                    tracing::warn!("coordinator {}: {e}; retrying", config.coordinator);
                    failed.next().unwrap_or(MAX_RETRY_PAUSE)
                }
            }),
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(pause) = pause else {
            leave_running_job(&state).await;
            break;
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    leave_running_job(&state).await;
}

/// Stops the running job: its ring calls are abandoned at once, and it tells the coordinator
/// that this worker is going away (`run_and_report`). Waits a bounded while
/// ([`LEAVE_POLLS`] x [`LEAVE_POLL`]) for it to say so.
async fn leave_running_job(state: &WorkerState) {
    state.stop_running(None, StopReason::Shutdown);
    let gone = || async { if state.is_running() { Err(()) } else { Ok(()) } };
    // Still running after the last poll: leave anyway.
    let _ = gone
        .retry(
            ConstantBuilder::new()
                .with_delay(LEAVE_POLL)
                .with_max_times(LEAVE_POLLS),
        )
        .sleep(tokio::time::sleep)
        .await;
}

/// One registration: heartbeats plus the attach stream, until either fails.
///
/// Errors: the coordinator's [`tonic::Status`] (registration refused, the stream broken,
/// heartbeats failing or the coordinator forgetting this worker).
async fn session(
    config: &Config,
    mut client: CoordinatorClient<AuthChannel>,
    mailbox: Arc<Mailbox>,
    state: Arc<WorkerState>,
) -> Result<(), tonic::Status> {
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
    let (held, held_steps) = {
        let s = state.lock();
        let held = s.held_key();
        let steps = held
            .as_ref()
            .map(|k| s.held_steps(&k.job_id))
            .unwrap_or_default();
        (held, steps)
    };
    let reply = client
        .register(RegisterRequest {
            advertise_addr: config.advertise_addr.clone(),
            threads: config.threads as u32,
            hostname: keel_proto::host::hostname(),
            held,
            held_steps,
            bf16_native: bf16.native,
            bf16_detail: bf16.detail.clone(),
            memory_limit_bytes: config.memory_limit,
        })
        .await?
        .into_inner();
    let worker_id = reply.worker_id;
    state.lock().worker_id = worker_id.clone();
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
                    let mut s = state.lock();
                    s.stop_running(Some(&key.job_id), StopReason::Cancel);
                    if s.held.as_ref().is_some_and(|h| h.job_id == key.job_id) {
                        s.held = None;
                    }
                }
                Some(worker_command::Command::Suspend(suspend)) => {
                    let Some(key) = suspend.key else { continue };
                    tracing::warn!(job = %key.job_id, generation = key.generation, reason = %suspend.reason, "suspending: a new generation is forming");
                    let not_training = {
                        let s = state.lock();
                        let reason = StopReason::Suspend {
                            generation: key.generation,
                        };
                        // Not training it: answer now with what is held.
                        (!s.stop_running(Some(&key.job_id), reason))
                            .then(|| s.held_steps(&key.job_id))
                    };
                    if let Some(steps) = not_training {
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
    let control = Arc::new(JobControl::new());
    let progress = Arc::new(AtomicU64::new(start.start_step));
    let (held, worker_id) = {
        let mut s = state.lock();
        s.stop_running(None, StopReason::Cancel);
        let held = s.take_held(&key.job_id);
        s.running = Some(Running {
            job_id: key.job_id.clone(),
            generation: key.generation,
            control: control.clone(),
            progress: progress.clone(),
            ended: false,
        });
        (held, s.worker_id.clone())
    };
    let ctx = JobContext {
        client: client.clone(),
        worker_id,
        cache_dir: config.cache_dir.clone(),
        mailbox: mailbox.clone(),
        control,
        progress,
        faults: config.faults.clone(),
        memory_limit: config.memory_limit,
    };
    tokio::spawn(run_and_report(ctx, start, held, state.clone()));
}

/// Heartbeats every `interval`; a heartbeat that fails is tried again every `interval`, up to
/// [`HEARTBEAT_ATTEMPTS`] in a row. Returns when the coordinator no longer knows this worker.
///
/// Errors: `NotFound` when the coordinator forgot this worker; the last heartbeat's error
/// after [`HEARTBEAT_ATTEMPTS`] failures in a row.
async fn heartbeat_loop(
    client: CoordinatorClient<AuthChannel>,
    worker_id: String,
    state: Arc<WorkerState>,
    interval: Duration,
) -> Result<(), tonic::Status> {
    let beat = || {
        let last = crate::telemetry::last_step();
        let mut client = client.clone();
        let request = HeartbeatRequest {
            worker_id: worker_id.clone(),
            key: state.lock().running_key(),
            last_step_seconds: last.map_or(0.0, |t| t.total),
            last_ring_wait_seconds: last.map_or(0.0, |t| t.ring_wait),
        };
        async move { client.heartbeat(request).await }
    };
    let retries = ConstantBuilder::new()
        .with_delay(interval)
        .with_max_times(HEARTBEAT_ATTEMPTS - 1);
    loop {
        tokio::time::sleep(interval).await;
        let reply = (&beat).retry(retries).sleep(tokio::time::sleep).await?;
        if !reply.get_ref().known {
            return Err(tonic::Status::not_found(
                "the coordinator forgot this worker",
            ));
        }
    }
}
