//! Client commands talking to a coordinator (to be written).

/// Subcommands that talk to a running coordinator.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print the jobs the coordinator knows.
    Jobs,
}

/// Runs a client command.
pub fn run(_cmd: Command) -> anyhow::Result<()> {
    anyhow::bail!("client commands are not built yet")
}
