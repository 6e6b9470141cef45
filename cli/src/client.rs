//! Client commands talking to a coordinator: submit, jobs, status, watch, cancel, pull; plus
//! `keel local` (a whole cluster on this machine) and `keel fill-mask` (try a checkpoint).

use crate::conn::{Conn, connect, finished_ok, submit};
use crate::output::outln;
use crate::{fill_mask, local, pull, watch};
use anyhow::Context;
use keel_proto::rpc::{CancelJobRequest, GetJobRequest, JobState, JobStatus, ListJobsRequest};
use keel_proto::status::{state_name, status_json};
use std::path::PathBuf;

/// A job id argument.
#[derive(clap::Args, Debug, Clone)]
pub struct JobArg {
    /// The job id (`keel jobs` lists them).
    pub job: String,
    #[command(flatten)]
    pub conn: Conn,
}

/// Subcommands that talk to a running coordinator.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Submit a job file (TOML); prints the job id. Relative paths in it are resolved against
    /// the current directory and read on the coordinator's machine.
    Submit {
        /// The job file.
        job_file: PathBuf,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print the jobs the coordinator knows (a failed job's reason after its row).
    Jobs {
        #[command(flatten)]
        conn: Conn,
    },
    /// Print one job's status as JSON.
    Status(JobArg),
    /// Follow a job until it ends: progress (step, loss, tokens/s, ETA) on stderr, a bar on a
    /// terminal and plain lines otherwise; the outcome line on stdout.
    Watch(JobArg),
    /// Cancel a job.
    Cancel(JobArg),
    /// Download a checkpoint (Hugging Face layout) plus metrics.jsonl and loss.png.
    Pull(pull::Args),
    /// Run a whole cluster on this machine (coordinator + N workers as real processes): run
    /// the job, pull the final checkpoint, stop.
    Local(local::Args),
    /// Fill each `[MASK]` of a text with a checkpoint, like the `transformers` fill-mask pipeline.
    FillMask(fill_mask::Args),
}

/// Runs a client command.
pub fn run(cmd: Command) -> anyhow::Result<()> {
    if let Command::FillMask(args) = cmd {
        return fill_mask::run(args);
    }
    let coordinator = match &cmd {
        Command::Submit { conn, .. } | Command::Jobs { conn } => Some(conn.coordinator.clone()),
        Command::Status(a) | Command::Watch(a) | Command::Cancel(a) => {
            Some(a.conn.coordinator.clone())
        }
        Command::Pull(args) => Some(args.conn.coordinator.clone()),
        Command::Local(_) | Command::FillMask(_) => None,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(async {
        match cmd {
            Command::Submit { job_file, conn } => {
                let mut client = connect(&conn)?;
                let id = submit(&mut client, &job_file).await?;
                outln!("{id}");
                Ok(())
            }
            Command::Jobs { conn } => {
                let mut client = connect(&conn)?;
                let jobs = client
                    .list_jobs(ListJobsRequest {})
                    .await
                    .context("listing jobs")?
                    .into_inner()
                    .jobs;
                outln!(
                    "{:<10} {:<20} {:>12} {:>9}  workers",
                    "job",
                    "state",
                    "step",
                    "loss"
                );
                for j in jobs {
                    // No step yet: no loss to show.
                    let loss = if j.loss.is_finite() {
                        format!("{:.4}", j.loss)
                    } else {
                        "-".to_string()
                    };
                    outln!(
                        "{:<10} {:<20} {:>12} {:>9}  {}{}",
                        j.job_id,
                        state_name(j.state),
                        format!("{}/{}", j.step, j.max_steps),
                        loss,
                        j.workers.join(", "),
                        failure_note(&j)
                    );
                }
                Ok(())
            }
            Command::Status(a) => {
                let mut client = connect(&a.conn)?;
                let s = client
                    .get_job(GetJobRequest {
                        job_id: a.job.clone(),
                    })
                    .await?
                    .into_inner();
                outln!("{}", serde_json::to_string_pretty(&status_json(&s))?);
                Ok(())
            }
            Command::Watch(a) => {
                let mut client = connect(&a.conn)?;
                let s = watch::watch(&mut client, &a.job, true).await?;
                // The result goes to stdout (`keel watch job > file` keeps it); the progress
                // went to stderr.
                outln!("{}", watch::outcome_line(&s));
                finished_ok(&s)
            }
            Command::Cancel(a) => {
                let mut client = connect(&a.conn)?;
                let s = client
                    .cancel_job(CancelJobRequest {
                        job_id: a.job.clone(),
                    })
                    .await?
                    .into_inner();
                outln!("{} {}", s.job_id, state_name(s.state));
                Ok(())
            }
            Command::Pull(args) => {
                let mut client = connect(&args.conn)?;
                let dir = pull::pull(&mut client, &args.job, args.step, &args.out).await?;
                outln!("{}", dir.display());
                Ok(())
            }
            Command::Local(args) => local::run(args).await,
            Command::FillMask(_) => Ok(()),
        }
    });
    match coordinator {
        Some(addr) => result
            .map_err(|e| crate::errors::explain(e, &keel_net::client::coordinator_address(&addr))),
        None => result,
    }
}

/// `  reason: ...` after a failed job's row in `keel jobs` (its error's first line), or
/// `  checkpoint not stored: ...` after a job whose latest checkpoint could not be stored;
/// empty for other jobs.
fn failure_note(job: &JobStatus) -> String {
    let failed = JobState::try_from(job.state) == Ok(JobState::Failed);
    match job.error.lines().next() {
        Some(reason) if failed && !reason.is_empty() => format!("  reason: {reason}"),
        _ if !job.checkpoint_problem.is_empty() => {
            format!("  checkpoint not stored: {}", job.checkpoint_problem)
        }
        _ => String::new(),
    }
}
