//! `keel-coordinator`: the control plane of a Keel cluster.

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "keel-coordinator",
    version,
    about = "Keel coordinator: takes jobs, prepares data, forms workers into a ring, stores checkpoints"
)]
struct Args {
    /// Address to listen on for clients and workers.
    #[arg(long, env = "KEEL_LISTEN", default_value = "0.0.0.0:7070")]
    listen: String,
    /// Folder for jobs: prepared data, metrics.jsonl, checkpoints.
    #[arg(long, env = "KEEL_DATA_DIR", default_value = "keel-data")]
    data_dir: PathBuf,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "KEEL_LOG", default_value = "info")]
    log: String,
    /// A folder jobs may read from (repeatable; in the variable, colon-separated like PATH):
    /// every corpus, vocabulary, model config and init checkpoint a job names must lie inside
    /// one, symlinks resolved. Without any, a job may name any file this process can read.
    #[arg(
        long = "input-root",
        env = "KEEL_INPUT_ROOT",
        value_name = "DIR",
        value_delimiter = ':'
    )]
    input_root: Vec<PathBuf>,
    #[command(flatten)]
    token: keel_net::auth::TokenArgs,
    #[command(flatten)]
    tls: keel_net::tls::ServerTlsArgs,
    #[command(flatten)]
    connections: keel_net::incoming::ConnectionArgs,
    #[command(flatten)]
    metrics: keel_net::http_port::MetricsArgs,
}

fn main() -> std::process::ExitCode {
    keel_proto::report::exit_on_error(run(Args::parse()))
}

/// Runs the coordinator until a shutdown signal; errors are printed by `main` as one line
/// (a bad flag or a busy port is not a crash: no backtrace).
fn run(args: Args) -> anyhow::Result<()> {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&args.log))
        .with_writer(keel_coordinator::log_writer::EscapingStderr::new(ansi))
        .with_ansi(ansi)
        .init();
    let input_roots = keel_coordinator::input_roots::InputRoots::new(&args.input_root)?;
    let security = keel_net::security::ServerSecurity::new(args.token.load()?, args.tls.load()?)
        .with_connection_limits(args.connections.limits()?);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
        tracing::info!(addr = %listener.local_addr()?, data_dir = %args.data_dir.display(), tls = security.is_tls(), "coordinator listening");
        let metrics_listener = args.metrics.bind().await?;
        let config = keel_coordinator::Config {
            data_dir: args.data_dir,
            security,
            input_roots,
            metrics_listener,
        };
        keel_coordinator::run(config, listener, keel_net::admin::shutdown_signal()).await?;
        Ok(())
    })
}
