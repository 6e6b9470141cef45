//! `keel-worker`: a Keel worker process, plus its benchmarks.
//!
//! Without a subcommand it runs a worker (`keel_worker::serve`); `bench` runs training steps
//! (`keel_worker::bench`); `bench-allreduce` measures the ring all-reduce (`keel_worker::allreduce::bench`).

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "keel-worker",
    version,
    about = "Keel worker: computes BERT gradients and all-reduces them with its ring peers"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: keel_worker::serve::Args,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Benchmark full training steps (forward, backward, AdamW) on random tokens; prints one JSON line.
    Bench(keel_worker::bench::Args),
    /// Benchmark the ring all-reduce on loopback with several local processes; prints JSON lines.
    BenchAllreduce(keel_worker::allreduce::bench::Args),
    /// Internal: one peer of `bench-allreduce` (started by it, not by users).
    #[command(hide = true)]
    AllreducePeer(keel_worker::allreduce::bench::PeerArgs),
    /// Print how this machine runs bf16 GEMMs (oneDNN's kernel: AMX, AVX512_BF16, or emulated
    /// in fp32) and why, as the worker decides at start-up; one line.
    Bf16Probe,
}

fn main() -> std::process::ExitCode {
    // First: OpenBLAS and glibc read their settings only when they load (see startup).
    keel_worker::startup::reexec_if_needed();
    keel_worker::allocator::keep_freed_memory();
    let cli = Cli::parse();
    // Errors end as one line (keel_proto::report): a bad flag is not a crash, no backtrace.
    keel_proto::report::exit_on_error(match cli.command {
        Some(Command::Bench(args)) => keel_worker::bench::run(args),
        Some(Command::BenchAllreduce(args)) => keel_worker::allreduce::bench::run(args),
        Some(Command::AllreducePeer(args)) => keel_worker::allreduce::bench::run_peer(args),
        Some(Command::Bf16Probe) => {
            let support = keel_worker::model::bf16::support();
            let route = if support.native { "native" } else { "emulated" };
            println!("bf16 GEMMs: {route}: {}", support.detail);
            Ok(())
        }
        None => keel_worker::serve::main(cli.serve),
    })
}
