//! `keel watch`: a live progress bar (step, loss, tokens/s, ETA) fed by the coordinator's
//! `WatchJob` stream.

use crate::client::state_name;
use crate::output::errln;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{GetJobRequest, JobState, JobStatus};

/// How long `keel watch` keeps trying to reconnect when the coordinator goes away (it may be
/// restarting: jobs survive a restart).
const RECONNECT_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// Seconds between plain progress lines when stderr is not a terminal.
const PLAIN_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Follows `job` until it ends and returns its last status. With `bar`, draws a progress bar
/// on stderr, or, when stderr is not a terminal, prints a plain line on every change of state
/// and at most every 5 s otherwise; without, prints nothing. When the stream breaks (the
/// coordinator restarting, say), it reconnects for up to 60 s.
///
/// Errors: the job is unknown, or the coordinator stays unreachable for 60 s.
pub async fn watch(
    client: &mut CoordinatorClient<keel_proto::auth::AuthChannel>,
    job: &str,
    bar: bool,
) -> anyhow::Result<JobStatus> {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let pb = if bar && terminal {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps | {msg} | ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(job.to_string());
    let plain = bar && !terminal;
    let mut last: Option<JobStatus> = None;
    let mut last_line = std::time::Instant::now() - PLAIN_EVERY;
    let mut broken_since: Option<std::time::Instant> = None;
    'reconnect: loop {
        let opened = client
            .watch_job(GetJobRequest {
                job_id: job.to_string(),
            })
            .await;
        let mut stream = match opened {
            Ok(s) => s.into_inner(),
            Err(e) if retryable(&e) => {
                let since = *broken_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > RECONNECT_FOR {
                    return Err(e).with_context(|| format!("watching {job}"));
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue 'reconnect;
            }
            Err(e) => return Err(e).with_context(|| format!("watching {job}")),
        };
        loop {
            let status = match stream.message().await {
                Ok(Some(status)) => status,
                Ok(None) => break 'reconnect,
                Err(e) if retryable(&e) => {
                    if plain {
                        errln!(
                            "{job}: lost the coordinator ({}); reconnecting",
                            e.message()
                        );
                    }
                    broken_since = Some(std::time::Instant::now());
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue 'reconnect;
                }
                Err(e) => return Err(e).with_context(|| format!("watching {job}")),
            };
            pb.set_length(status.max_steps);
            pb.set_position(status.step);
            let state = JobState::try_from(status.state).unwrap_or(JobState::Unspecified);
            let msg = if state == JobState::Running && status.loss.is_finite() {
                let mut m = format!(
                    "loss {:.4} | {:.1}k tok/s | {:.0} ms/step",
                    status.loss,
                    status.tokens_per_second / 1e3,
                    status.step_seconds * 1e3
                );
                if status.eval_loss.is_finite() {
                    m.push_str(&format!(" | eval {:.4}", status.eval_loss));
                }
                m
            } else {
                state_name(status.state).to_string()
            };
            let changed = last.as_ref().is_none_or(|l| l.state != status.state);
            if plain && (changed || last_line.elapsed() >= PLAIN_EVERY) {
                errln!("{job}: step {}/{} | {msg}", status.step, status.max_steps);
                last_line = std::time::Instant::now();
            }
            pb.set_message(msg);
            let finished = matches!(
                state,
                JobState::Completed | JobState::Failed | JobState::Cancelled
            );
            last = Some(status);
            if finished {
                break 'reconnect;
            }
        }
    }
    pb.finish();
    let status =
        last.ok_or_else(|| anyhow::anyhow!("the coordinator closed the watch of {job}"))?;
    if bar {
        errln!(
            "{job}: {} at step {}/{}{}",
            state_name(status.state),
            status.step,
            status.max_steps,
            if status.loss.is_finite() {
                format!(", loss {:.4}", status.loss)
            } else {
                String::new()
            }
        );
    }
    Ok(status)
}

/// Whether a broken watch is worth reopening: the coordinator went away or restarted.
fn retryable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled
    )
}
