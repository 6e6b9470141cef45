//! `keel-worker bench` (to be written).

/// Arguments of `keel-worker bench`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs the benchmark.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("bench is not built yet")
}
