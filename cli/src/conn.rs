//! Where the coordinator is ([`Conn`]) and the calls the commands share: connecting, submitting
//! a job file, and a finished job's outcome.

use keel_net::auth::{AuthChannel, TokenArgs};
use keel_net::security::ClientSecurity;
use keel_net::tls::ClientTlsArgs;
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{JobState, JobStatus, SubmitJobRequest};
use keel_proto::status::state_name;
use std::path::Path;

/// Where the coordinator is and how to prove membership of its cluster.
#[derive(clap::Args, Debug, Clone)]
pub struct Conn {
    /// The coordinator, host:port (a host alone means port 7070).
    #[arg(long, env = "KEEL_COORDINATOR", default_value = "127.0.0.1:7070")]
    pub coordinator: String,
    #[command(flatten)]
    pub token: TokenArgs,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
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
    Ok(keel_net::client::coordinator_client(addr, security)?)
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
        // No context of our own: the coordinator's refusal already names the job file
        // (`origin`), and errors::explain keeps its message and drops gRPC's wrapping.
        .await?;
    Ok(reply.into_inner().job_id)
}

/// Ok for a completed job; the job's error otherwise.
pub fn finished_ok(s: &JobStatus) -> anyhow::Result<()> {
    match JobState::try_from(s.state) {
        Ok(JobState::Completed) => Ok(()),
        _ => anyhow::bail!("job {} {}: {}", s.job_id, state_name(s.state), s.error),
    }
}
