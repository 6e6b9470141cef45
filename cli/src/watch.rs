//! `keel watch`: a job's progress (state, step, loss, tokens/s, ETA, and the held-out loss and
//! accuracy once the job has evaluated) fed by the coordinator's `WatchJob` stream, on stderr;
//! the caller prints the outcome ([`outcome_line`]) on stdout.
//!
//! On a terminal it is an indicatif bar: a spinner and the state until the job runs and its
//! step count is known (never a full bar at "0/0"), then the bar. When stderr is not a
//! terminal (`2> file`, CI logs) it prints plain lines instead, on each change of state and at
//! most every [`PLAIN_EVERY`] otherwise. The ETA comes from [`crate::eta`].

use crate::eta::{Eta, eta_text};
use crate::output::errln;
use anyhow::Context;
use backon::{ConstantBuilder, Retryable};
use indicatif::{ProgressBar, ProgressStyle};
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{GetJobRequest, JobState, JobStatus};
use keel_proto::status::state_name;
use std::time::{Duration, Instant};

/// How long `keel watch` keeps trying to reconnect when the coordinator goes away (it may be
/// restarting: jobs survive a restart).
const RECONNECT_FOR: Duration = Duration::from_secs(60);

/// The pause before each try to reopen a broken watch.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Seconds between plain progress lines when stderr is not a terminal.
pub const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// Follows `job` until it ends and returns its last status. With `show`, shows progress on
/// stderr (a bar on a terminal, plain lines otherwise); without, prints nothing. When the
/// stream breaks (the coordinator restarting, say), it reconnects for up to 60 s.
///
/// Errors: the job is unknown, or the coordinator stays unreachable for 60 s.
pub async fn watch(
    client: &mut CoordinatorClient<keel_net::auth::AuthChannel>,
    job: &str,
    show: bool,
) -> anyhow::Result<JobStatus> {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut view = View::new(job, show && terminal, show && !terminal);
    let mut last: Option<JobStatus> = None;
    let mut broken_since: Option<Instant> = None;
    'reconnect: loop {
        let mut stream = open(client, job, broken_since).await?;
        loop {
            let status = match stream.message().await {
                Ok(Some(status)) => status,
                Ok(None) => break 'reconnect,
                Err(e) if retryable(&e) => {
                    view.note(&format!(
                        "{job}: lost the coordinator ({}); reconnecting",
                        e.message()
                    ));
                    broken_since = Some(Instant::now());
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    continue 'reconnect;
                }
                Err(e) => return Err(e).with_context(|| format!("watching {job}")),
            };
            view.show(&status, last.as_ref());
            let finished = matches!(
                JobState::try_from(status.state),
                Ok(JobState::Completed | JobState::Failed | JobState::Cancelled)
            );
            last = Some(status);
            if finished {
                break 'reconnect;
            }
        }
    }
    view.finish();
    last.ok_or_else(|| anyhow::anyhow!("the coordinator closed the watch of {job}"))
}

/// Opens the watch of `job`, trying again every [`RECONNECT_PAUSE`] while the coordinator is
/// unreachable ([`retryable`]), for up to [`RECONNECT_FOR`] since `broken_since` (the stream
/// broke then), or since the first failed try.
///
/// Errors: the coordinator's refusal (an unknown job), or the last failure once the time is up.
async fn open(
    client: &mut CoordinatorClient<keel_net::auth::AuthChannel>,
    job: &str,
    broken_since: Option<Instant>,
) -> anyhow::Result<tonic::Streaming<JobStatus>> {
    let mut since = broken_since;
    let watch = || {
        let mut client = client.clone();
        let request = GetJobRequest {
            job_id: job.to_string(),
        };
        async move { client.watch_job(request).await }
    };
    let opened = watch
        .retry(
            ConstantBuilder::new()
                .with_delay(RECONNECT_PAUSE)
                .without_max_times(),
        )
        .when(|e| retryable(e) && since.get_or_insert_with(Instant::now).elapsed() <= RECONNECT_FOR)
        .await;
    match opened {
        Ok(stream) => Ok(stream.into_inner()),
        Err(e) if retryable(&e) => Err(e).with_context(|| format!("watching {job}")),
        Err(e) => Err(e.into()),
    }
}

/// `job-1: completed at step 200/200, loss 5.1234, held-out 4.5678 (acc 31.9%)`: how a
/// watched job ended (the held-out part only when the job evaluated, see [`heldout_text`]).
pub fn outcome_line(status: &JobStatus) -> String {
    let mut line = format!(
        "{}: {} at step {}/{}",
        status.job_id,
        state_name(status.state),
        status.step,
        status.max_steps,
    );
    if status.loss.is_finite() {
        line.push_str(&format!(", loss {:.4}", status.loss));
    }
    if let Some(heldout) = heldout_text(status) {
        line.push_str(", ");
        line.push_str(&heldout);
    }
    line
}

/// `held-out 4.5678 (acc 31.9%)`: the latest held-out evaluation's MLM loss (nats) and
/// accuracy (as a percentage; left out when not finite); `None` while the job has no
/// evaluation (`eval_loss` not finite).
pub fn heldout_text(status: &JobStatus) -> Option<String> {
    if !status.eval_loss.is_finite() {
        return None;
    }
    let mut text = format!("held-out {:.4}", status.eval_loss);
    if status.eval_accuracy.is_finite() {
        text.push_str(&format!(" (acc {:.1}%)", status.eval_accuracy * 100.0));
    }
    Some(text)
}

/// `loss 5.1234 | 12.3k tok/s | 250 ms/step | ETA 3m 20s` for a running job, with
/// `held-out 4.5678 (acc 31.9%) | ` before the ETA once it has evaluated ([`heldout_text`]);
/// the state's name otherwise (no ETA while preparing or waiting).
pub fn progress_text(status: &JobStatus, eta_seconds: Option<f64>) -> String {
    let running = JobState::try_from(status.state) == Ok(JobState::Running);
    if !running {
        return state_name(status.state).to_string();
    }
    let mut m = String::new();
    if status.phases > 1 {
        m.push_str(&format!("phase {}/{} | ", status.phase, status.phases));
    }
    if status.loss.is_finite() {
        m.push_str(&format!(
            "loss {:.4} | {:.1}k tok/s | {:.0} ms/step | ",
            status.loss,
            status.tokens_per_second / 1e3,
            status.step_seconds * 1e3
        ));
    } else {
        m.push_str("running | ");
    }
    if let Some(heldout) = heldout_text(status) {
        m.push_str(&heldout);
        m.push_str(" | ");
    }
    m.push_str(&eta_text(eta_seconds));
    m
}

/// `checkpoint not stored: ...` when `status` reports a checkpoint problem that `last` did
/// not (or another one); `None` otherwise.
pub fn checkpoint_note(status: &JobStatus, last: Option<&JobStatus>) -> Option<String> {
    let problem = &status.checkpoint_problem;
    let new = last.is_none_or(|l| &l.checkpoint_problem != problem);
    (new && !problem.is_empty()).then(|| format!("checkpoint not stored: {problem}"))
}

/// What `watch` shows: a bar (terminal), plain lines (not a terminal), or nothing.
struct View {
    job: String,
    bar: Option<ProgressBar>,
    /// Whether the bar shows the step bar yet (else the spinner with the state).
    bar_style: bool,
    plain: bool,
    last_line: Option<Instant>,
    eta: Eta,
    started: Instant,
}

impl View {
    fn new(job: &str, bar: bool, plain: bool) -> View {
        let bar = bar.then(|| {
            let pb = ProgressBar::new_spinner();
            pb.set_style(spinner_style());
            pb.set_prefix(job.to_string());
            pb.enable_steady_tick(Duration::from_millis(200));
            pb
        });
        View {
            job: job.to_string(),
            bar,
            bar_style: false,
            plain,
            last_line: None,
            eta: Eta::default(),
            started: Instant::now(),
        }
    }

    fn show(&mut self, status: &JobStatus, last: Option<&JobStatus>) {
        let running = JobState::try_from(status.state) == Ok(JobState::Running);
        if running {
            self.eta
                .observe(self.started.elapsed().as_secs_f64(), status.step);
        } else {
            self.eta.reset();
        }
        let eta = self.eta.seconds_left(status.max_steps);
        let text = progress_text(status, eta);
        if let Some(pb) = &self.bar {
            // The bar once the job runs with a known length (and from then on, so that the
            // last frame shows where it ended); before that a spinner, so that the first frame
            // is not a full bar at "0/0 steps".
            let want_bar = status.max_steps > 0 && (running || self.bar_style);
            if want_bar != self.bar_style {
                pb.set_style(if want_bar {
                    bar_style()
                } else {
                    spinner_style()
                });
                self.bar_style = want_bar;
            }
            pb.set_length(status.max_steps);
            pb.set_position(status.step);
            pb.set_message(text.clone());
        }
        // A checkpoint the coordinator could not store (a full disk) is said once, when it
        // first shows or changes, above the bar or among the plain lines.
        if let Some(problem) = checkpoint_note(status, last) {
            self.note(&format!("{}: {problem}", self.job));
        }
        let changed = last.is_none_or(|l| l.state != status.state);
        let due = self.last_line.is_none_or(|t| t.elapsed() >= PLAIN_EVERY);
        if self.plain && (changed || due) {
            errln!(
                "{}: step {}/{} | {text}",
                self.job,
                status.step,
                status.max_steps
            );
            self.last_line = Some(Instant::now());
        }
    }

    /// A line outside the bar (lost connection), in either mode.
    fn note(&self, line: &str) {
        match &self.bar {
            Some(pb) => pb.println(line),
            None if self.plain => errln!("{line}"),
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish();
        }
    }
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix} {spinner} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps | {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
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

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: JobState, step: u64, max_steps: u64, loss: f64) -> JobStatus {
        JobStatus {
            job_id: "job-1".into(),
            state: state as i32,
            step,
            max_steps,
            loss,
            tokens_per_second: 12_345.0,
            step_seconds: 0.25,
            eval_loss: f64::NAN,
            ..Default::default()
        }
    }

    #[test]
    fn no_eta_while_preparing_and_dashes_until_an_estimate() {
        let preparing = status(JobState::Preparing, 0, 200, f64::NAN);
        assert_eq!(progress_text(&preparing, Some(10.0)), "preparing");
        let first = status(JobState::Running, 1, 200, 6.5);
        assert_eq!(
            progress_text(&first, None),
            "loss 6.5000 | 12.3k tok/s | 250 ms/step | ETA --"
        );
        assert!(progress_text(&first, Some(125.0)).ends_with("ETA 2m 05s"));
    }

    #[test]
    fn a_job_with_phases_shows_the_phase_it_is_in() {
        let mut s = status(JobState::Running, 1, 200, 6.5);
        s.phase = 2;
        s.phases = 2;
        assert!(
            progress_text(&s, None).starts_with("phase 2/2 | loss 6.5000"),
            "{}",
            progress_text(&s, None)
        );
    }

    #[test]
    fn the_outcome_names_state_step_and_loss() {
        let done = status(JobState::Completed, 200, 200, 5.25);
        assert_eq!(
            outcome_line(&done),
            "job-1: completed at step 200/200, loss 5.2500"
        );
        let failed = status(JobState::Failed, 0, 200, f64::NAN);
        assert_eq!(outcome_line(&failed), "job-1: failed at step 0/200");
        let evaluated = JobStatus {
            eval_loss: 4.56789,
            eval_accuracy: 0.3191,
            ..done
        };
        assert_eq!(
            outcome_line(&evaluated),
            "job-1: completed at step 200/200, loss 5.2500, held-out 4.5679 (acc 31.9%)"
        );
    }

    #[test]
    fn a_checkpoint_problem_is_noted_once_when_it_shows_or_changes() {
        let clean = status(JobState::Running, 5, 10, 3.0);
        let full = JobStatus {
            checkpoint_problem: "the checkpoint of step 10 could not be stored".into(),
            ..clean.clone()
        };
        assert_eq!(checkpoint_note(&clean, None), None);
        let note = checkpoint_note(&full, Some(&clean)).unwrap();
        assert!(note.contains("step 10 could not be stored"), "{note}");
        assert_eq!(checkpoint_note(&full, Some(&full)), None);
        assert!(checkpoint_note(&full, None).is_some());
    }

    #[test]
    fn held_out_evaluation_shows_only_once_there_is_one() {
        let mut s = status(JobState::Running, 100, 200, 6.5);
        assert_eq!(heldout_text(&s), None);
        assert!(!progress_text(&s, None).contains("held-out"));
        s.eval_loss = 5.25;
        s.eval_accuracy = 0.125;
        assert_eq!(
            heldout_text(&s).as_deref(),
            Some("held-out 5.2500 (acc 12.5%)")
        );
        assert_eq!(
            progress_text(&s, Some(125.0)),
            "loss 6.5000 | 12.3k tok/s | 250 ms/step | held-out 5.2500 (acc 12.5%) | ETA 2m 05s"
        );
        // A loss without an accuracy (an older coordinator): the loss alone.
        s.eval_accuracy = f64::NAN;
        assert_eq!(heldout_text(&s).as_deref(), Some("held-out 5.2500"));
        // Not running: the state's name only.
        s.state = JobState::WaitingForWorkers as i32;
        assert_eq!(progress_text(&s, None), "waiting-for-workers");
    }
}
