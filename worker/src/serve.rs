//! The worker process (to be written).

/// Settings of a worker process.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs a worker until it is told to stop.
pub fn main(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("the worker is not built yet")
}
