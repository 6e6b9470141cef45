//! `keel watch`: a live progress bar (step, loss, tokens/s, ETA) fed by the coordinator's
//! `WatchJob` stream.

use crate::client::state_name;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{GetJobRequest, JobState, JobStatus};

/// Follows `job` until it ends and returns its last status. With `bar`, draws a progress bar
/// on stderr (hidden when stderr is not a terminal); without, prints nothing.
///
/// Errors: the job is unknown or the stream breaks.
pub async fn watch(
    client: &mut CoordinatorClient<keel_proto::auth::AuthChannel>,
    job: &str,
    bar: bool,
) -> anyhow::Result<JobStatus> {
    let mut stream = client
        .watch_job(GetJobRequest {
            job_id: job.to_string(),
        })
        .await
        .with_context(|| format!("watching {job}"))?
        .into_inner();
    let pb = if bar {
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
    let mut last = None;
    while let Some(status) = stream
        .message()
        .await
        .with_context(|| format!("watching {job}"))?
    {
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
        pb.set_message(msg);
        let finished = matches!(
            state,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        );
        last = Some(status);
        if finished {
            break;
        }
    }
    pb.finish();
    let status =
        last.ok_or_else(|| anyhow::anyhow!("the coordinator closed the watch of {job}"))?;
    if bar {
        eprintln!(
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
