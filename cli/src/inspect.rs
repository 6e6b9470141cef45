//! `keel inspect` (to be written).

/// Arguments of `keel inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `keel inspect`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("keel inspect is not built yet")
}
