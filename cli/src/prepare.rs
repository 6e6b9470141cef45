//! `keel prepare` (to be written).

/// Arguments of `keel prepare`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `keel prepare`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("keel prepare is not built yet")
}
