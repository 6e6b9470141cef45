//! `keel-worker bench-allreduce` (to be written).

/// Arguments of `keel-worker bench-allreduce`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Arguments of one benchmark peer process.
#[derive(clap::Args, Debug)]
pub struct PeerArgs {}

/// Runs the benchmark.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("bench-allreduce is not built yet")
}

/// Runs one benchmark peer.
pub fn run_peer(_args: PeerArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench-allreduce is not built yet")
}
