//! `keel`: the user's command. Prepares data, submits and watches jobs, pulls checkpoints,
//! runs a whole local cluster, and tries a checkpoint with fill-mask.

// The doc comments of this binary are mostly clap's help text, where `[MASK]` is literal text
// a user types, not a link.
#![allow(rustdoc::broken_intra_doc_links)]

use clap::{Parser, Subcommand};

mod client;
mod conn;
mod errors;
mod eta;
mod fill_mask;
mod inspect;
mod local;
mod output;
mod plot;
mod prepare;
mod pull;
mod watch;

#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    about = "Keel: synchronous data-parallel BERT pretraining on CPU machines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Tokenize a corpus into training shards (like BERT's create_pretraining_data.py).
    Prepare(prepare::Args),
    /// Print the sequences of prepared shards as JSON lines.
    Inspect(inspect::Args),
    #[command(flatten)]
    Client(client::Command),
}

/// Runs the command. An error ends as one line on stderr (`Error: ` and its causes) and exit
/// status 1, with no backtrace even when `RUST_BACKTRACE` is set: a missing file or an unknown
/// job is not a crash (panics still print theirs).
fn main() -> std::process::ExitCode {
    keel_proto::report::exit_on_error(run())
}

fn run() -> anyhow::Result<()> {
    // SIGPIPE stays ignored (Rust's default): a closed pipe on our output is handled where we
    // print (see output.rs), and a socket the coordinator closes must be an error, not death.
    let cli = Cli::parse();
    // Warnings only (e.g. a token file others can read); progress is the commands' own output.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .init();
    let result = match cli.command {
        Command::Prepare(args) => prepare::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Client(cmd) => client::run(cmd),
    };
    match result {
        // `keel jobs | head`: the reader is done; so are we (the command cleaned up on its way
        // out).
        Err(e) if output::is_closed_pipe(&e) => Ok(()),
        other => other,
    }
}
