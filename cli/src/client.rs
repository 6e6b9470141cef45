//! Client commands talking to a coordinator: submit, jobs, status, watch, cancel, pull; plus
//! `keel local` (a whole cluster on this machine) and `keel fill-mask` (try a checkpoint).

use crate::output::outln;
use crate::{fill_mask, local, pull, watch};
use anyhow::Context;
use keel_proto::auth::{AuthChannel, TokenArgs};
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{
    CancelJobRequest, GetJobRequest, JobState, JobStatus, ListJobsRequest, SubmitJobRequest,
};
use keel_proto::security::ClientSecurity;
use keel_proto::tls::ClientTlsArgs;
use std::path::{Path, PathBuf};

/// Where the coordinator is and how to prove membership of its cluster.
#[derive(clap::Args, Debug, Clone)]
pub struct Conn {
    /// The coordinator, host:port.
    #[arg(long, env = "KEEL_COORDINATOR", default_value = "127.0.0.1:7070")]
    pub coordinator: String,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

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
    /// Print the jobs the coordinator knows.
    Jobs {
        #[command(flatten)]
        conn: Conn,
    },
    /// Print one job's status as JSON.
    Status(JobArg),
    /// Follow a job with a progress bar (step, loss, tokens/s, ETA) until it ends.
    Watch(JobArg),
    /// Cancel a job.
    Cancel(JobArg),
    /// Download a checkpoint (Hugging Face layout) plus metrics.jsonl and loss.png.
    Pull(pull::Args),
    /// Run a whole cluster on this machine (coordinator + N workers as real processes): run
    /// the job, pull the final checkpoint, stop.
    Local(local::Args),
    /// Fill each [MASK] of a text with a checkpoint, like the `transformers` fill-mask pipeline.
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
                        "{:<10} {:<20} {:>12} {:>9}  {}",
                        j.job_id,
                        state_name(j.state),
                        format!("{}/{}", j.step, j.max_steps),
                        loss,
                        j.workers.join(", ")
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
                    .await
                    .with_context(|| format!("job {}", a.job))?
                    .into_inner();
                outln!("{}", serde_json::to_string_pretty(&status_json(&s))?);
                Ok(())
            }
            Command::Watch(a) => {
                let mut client = connect(&a.conn)?;
                let s = watch::watch(&mut client, &a.job, true).await?;
                finished_ok(&s)
            }
            Command::Cancel(a) => {
                let mut client = connect(&a.conn)?;
                let s = client
                    .cancel_job(CancelJobRequest {
                        job_id: a.job.clone(),
                    })
                    .await
                    .with_context(|| format!("cancelling {}", a.job))?
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
        Some(addr) => result.map_err(|e| explain_unreachable(e, &addr)),
        None => result,
    }
}

/// Turns "the coordinator is not there" (gRPC UNAVAILABLE from a failed connect) and "the
/// coordinator refused our token" (UNAUTHENTICATED) into one plain sentence naming the
/// address; other errors pass through unchanged.
fn explain_unreachable(e: anyhow::Error, addr: &str) -> anyhow::Error {
    if crate::output::is_closed_pipe(&e) {
        return e;
    }
    let unavailable = e.chain().any(|cause| {
        cause
            .downcast_ref::<tonic::Status>()
            .is_some_and(|s| s.code() == tonic::Code::Unavailable)
    });
    let refusal = e.chain().find_map(|cause| {
        cause
            .downcast_ref::<tonic::Status>()
            .filter(|s| s.code() == tonic::Code::Unauthenticated)
    });
    if let Some(status) = refusal {
        return anyhow::anyhow!(
            "the coordinator at {addr} refused the cluster token: {}; give the cluster's token \
             file with --token-file or KEEL_TOKEN_FILE",
            status.message()
        );
    }
    // A plaintext call to a TLS server ends in an HTTP/2 framing error, or (depending on
    // timing) in the server closing the connection under the client, which surfaces as a
    // cancelled call or as a broken pipe deep in the transport error's sources: say what it may
    // mean.
    let tls_mismatch = e.chain().any(|cause| {
        let m = cause.to_string().to_ascii_lowercase();
        let cancelled = cause
            .downcast_ref::<tonic::Status>()
            .is_some_and(|s| s.code() == tonic::Code::Cancelled);
        m.contains("h2 protocol error")
            || m.contains("broken pipe")
            || m.contains("connection reset")
            || (cancelled && m.contains("cancel"))
    });
    if tls_mismatch {
        return anyhow::anyhow!(
            "the coordinator at {addr} broke off the connection ({}): if it serves TLS, pass \
             --tls-ca (or KEEL_TLS_CA) with the CA that signed its certificate",
            e.root_cause()
        );
    }
    if unavailable {
        anyhow::anyhow!(
            "cannot reach the coordinator at {addr} ({}): is keel-coordinator running there? \
             (set it with --coordinator or KEEL_COORDINATOR)",
            e.root_cause()
        )
    } else {
        e
    }
}

/// A client for the coordinator `conn` names, with its token and TLS settings.
///
/// Errors: no or a bad token file, a bad TLS file, a malformed address.
pub fn connect(conn: &Conn) -> anyhow::Result<CoordinatorClient<AuthChannel>> {
    let security = ClientSecurity::new(&conn.token.load()?, conn.tls.load()?);
    connect_with(&conn.coordinator, &security)
}

/// A client for the coordinator at `addr` calling with `security`.
///
/// Errors: a malformed address.
pub fn connect_with(
    addr: &str,
    security: &ClientSecurity,
) -> anyhow::Result<CoordinatorClient<AuthChannel>> {
    Ok(keel_worker::client::coordinator_client(addr, security)?)
}

/// Reads and validates a job file, makes its paths absolute against the current directory,
/// and submits it. Returns the job id.
///
/// Errors: the job file's own error (naming the key), or the coordinator's refusal.
pub async fn submit(
    client: &mut CoordinatorClient<AuthChannel>,
    job_file: &Path,
) -> anyhow::Result<String> {
    let mut spec = JobSpec::from_file(job_file)?;
    let cwd = std::env::current_dir()?;
    spec.resolve_paths(&cwd);
    let text = spec.to_toml_string()?;
    let reply = client
        .submit_job(SubmitJobRequest {
            spec_toml: text,
            origin: job_file.display().to_string(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("submitting {}: {}", job_file.display(), s.message()))?;
    Ok(reply.into_inner().job_id)
}

/// `running`, `completed`, ...
pub fn state_name(state: i32) -> &'static str {
    match JobState::try_from(state) {
        Ok(JobState::Queued) => "queued",
        Ok(JobState::Preparing) => "preparing",
        Ok(JobState::WaitingForWorkers) => "waiting-for-workers",
        Ok(JobState::Running) => "running",
        Ok(JobState::Completed) => "completed",
        Ok(JobState::Failed) => "failed",
        Ok(JobState::Cancelled) => "cancelled",
        Ok(JobState::Recovering) => "recovering",
        _ => "unknown",
    }
}

/// A job status as JSON (NaN as null).
pub fn status_json(s: &JobStatus) -> serde_json::Value {
    let num = |x: f64| {
        if x.is_finite() {
            serde_json::json!(x)
        } else {
            serde_json::Value::Null
        }
    };
    serde_json::json!({
        "job_id": s.job_id,
        "state": state_name(s.state),
        "generation": s.generation,
        "step": s.step,
        "max_steps": s.max_steps,
        "loss": num(s.loss),
        "learning_rate": num(s.learning_rate),
        "tokens_per_second": num(s.tokens_per_second),
        "step_seconds": num(s.step_seconds),
        "eval_loss": num(s.eval_loss),
        "eval_accuracy": num(s.eval_accuracy),
        "workers": s.workers,
        "checkpoints": s.checkpoints,
        "error": s.error,
        "elapsed_seconds": s.elapsed_seconds,
        "recoveries": s.recoveries,
        "skipped_steps": s.skipped_steps,
        // "fp32" or "bf16" once the job's first generation started; null before.
        "precision": (!s.precision.is_empty()).then_some(&s.precision),
    })
}

/// Ok for a completed job; the job's error otherwise.
pub fn finished_ok(s: &JobStatus) -> anyhow::Result<()> {
    match JobState::try_from(s.state) {
        Ok(JobState::Completed) => Ok(()),
        _ => anyhow::bail!("job {} {}: {}", s.job_id, state_name(s.state), s.error),
    }
}
