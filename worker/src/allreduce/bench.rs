//! `keel-worker bench-allreduce`: the ring all-reduce between real processes on loopback.
//!
//! The parent spawns `workers` hidden `keel-worker allreduce-peer` processes. Each binds
//! 127.0.0.1:0, serves the ring service and prints `LISTEN host:port`; the parent answers every
//! peer with `PEERS a,b,...` on its stdin. Each peer then runs, per size, warm-up plus timed
//! all-reduces of rank-dependent integer-valued inputs (the sum is known exactly and checked),
//! each between two one-element all-reduces as barriers (so that no rank checks its sum
//! or refills its input while another is still reducing), and prints one JSON line of its
//! per-iteration seconds. The parent takes, per iteration, the slowest rank, then the median,
//! and prints one JSON line per (workers, size):
//! `{"workers","bytes","seconds","seconds_per_ring_step","algbw_gb_s","busbw_gb_s","dtype",...}` where
//! busbw = algbw * 2 (n - 1) / n (NCCL's bus bandwidth; GB = 1e9 bytes). `bytes` is the f32
//! buffer reduced (the gradient's size) whatever `--dtype` says, so bf16's bandwidth figures
//! are gradient bytes per second, which the wire carries at half that.
//!
//! Every wait is bounded: all-reduces by the ring timeout, the parent's reads by
//! `--timeout-secs`; a peer exits by itself when its stdin closes (the parent is done, or died).
//! A peer that has printed its last report does not exit at once: it keeps serving the ring until
//! the parent closes its stdin. Its left neighbour's last frame may still be waiting for its
//! reply; exiting on the spot reset that call, the neighbour retried against a closed port and
//! failed with "peer rank 0 ... is unreachable (step 5 ...)": a flaky test under load.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use keel_proto::precision::AllReduceDtype;
use tokio::net::TcpListener;

use super::{Mailbox, Ring, RingConfig, ring_service, tune_server};

/// Arguments of `keel-worker bench-allreduce`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// World sizes to measure (processes on 127.0.0.1).
    #[arg(long, value_delimiter = ',', default_value = "2,3,4")]
    pub workers: Vec<usize>,
    /// Buffer sizes, MiB of f32; fractions allowed (0.000004 is one element: the ring's
    /// latency, 2 (n - 1) hops of nothing).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    pub sizes_mib: Vec<f64>,
    /// Timed all-reduces per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Untimed all-reduces per size before the timed ones.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// HTTP/2 connections per ring link.
    #[arg(long, default_value_t = 4)]
    pub streams_per_link: usize,
    /// Frame payload, KiB.
    #[arg(long, default_value_t = 512)]
    pub frame_kib: usize,
    /// Network runtime threads per peer process, 1 to 64, as a worker's `--io-threads` (1:
    /// every task on one thread, the worker's default).
    #[arg(long, default_value_t = crate::io_runtime::DEFAULT_IO_THREADS, value_parser = crate::io_runtime::parse_io_threads)]
    pub threads: usize,
    /// Ring timeout, and the bound on each wait of the parent, seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// Elements on the wire: `fp32`, or `bf16` (half the bytes; `train.allreduce_dtype`).
    #[arg(long, default_value_t = AllReduceDtype::Fp32)]
    pub dtype: AllReduceDtype,
}

/// Arguments of one benchmark peer process (started by `bench-allreduce`).
#[derive(clap::Args, Debug, Clone)]
pub struct PeerArgs {
    /// This peer's rank.
    #[arg(long)]
    pub rank: usize,
    /// Number of peers.
    #[arg(long)]
    pub world: usize,
    /// Buffer sizes, MiB of f32.
    #[arg(long, value_delimiter = ',')]
    pub sizes_mib: Vec<f64>,
    /// Timed all-reduces per size.
    #[arg(long)]
    pub iters: usize,
    /// Untimed all-reduces per size.
    #[arg(long)]
    pub warmup: usize,
    /// HTTP/2 connections per ring link.
    #[arg(long)]
    pub streams_per_link: usize,
    /// Frame payload, KiB.
    #[arg(long)]
    pub frame_kib: usize,
    /// Network runtime threads (see [`Args::threads`]).
    #[arg(long)]
    pub threads: usize,
    /// Ring timeout, seconds.
    #[arg(long)]
    pub timeout_secs: u64,
    /// Elements on the wire.
    #[arg(long, default_value_t = AllReduceDtype::Fp32)]
    pub dtype: AllReduceDtype,
}

/// One peer's report for one size, as printed on its stdout.
#[derive(serde::Serialize, serde::Deserialize)]
struct PeerReport {
    rank: usize,
    bytes: usize,
    /// Seconds of each timed all-reduce.
    seconds: Vec<f64>,
    /// CPU seconds (user + system, all threads) this process spent in each timed all-reduce.
    cpu_seconds: Vec<f64>,
    /// Whether every result equalled the known sum.
    correct: bool,
}

/// A spawned peer: the process, its stdin (kept open: closing it tells the peer to exit) and
/// its stdout lines.
struct PeerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl PeerProcess {
    fn next_line(&self, timeout: Duration, rank: usize) -> anyhow::Result<String> {
        self.lines
            .recv_timeout(timeout)
            .with_context(|| format!("peer rank {rank} said nothing for {timeout:?} (or exited)"))
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        drop(self.stdin.take());
        // The peer exits on stdin EOF; make sure of it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the benchmark: one JSON line per (workers, size) on stdout.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.iters == 0 || args.streams_per_link == 0 || args.frame_kib == 0 {
        bail!("--iters, --streams-per-link and --frame-kib must be positive");
    }
    if let Some(bad) = args
        .sizes_mib
        .iter()
        .find(|m| !(m.is_finite() && **m > 0.0))
    {
        bail!("--sizes-mib must be positive numbers, got {bad}");
    }
    if let Some(bad) = args.workers.iter().find(|&&n| n < 2) {
        bail!("--workers must be world sizes of 2 or more (a ring needs a neighbour), got {bad}");
    }
    for &n in &args.workers {
        run_world(&args, n)?;
    }
    Ok(())
}

/// f32 elements in `mib` MiB, at least one.
fn elements(mib: f64) -> usize {
    ((mib * f64::from(1u32 << 20) / 4.0).round() as usize).max(1)
}

fn run_world(args: &Args, n: usize) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding the keel-worker executable")?;
    let wait = Duration::from_secs(args.timeout_secs);
    let sizes = args
        .sizes_mib
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut peers = Vec::with_capacity(n);
    for rank in 0..n {
        let mut child = Command::new(&exe)
            .arg("allreduce-peer")
            .args(["--rank", &rank.to_string(), "--world", &n.to_string()])
            .args(["--sizes-mib", &sizes])
            .args([
                "--iters",
                &args.iters.to_string(),
                "--warmup",
                &args.warmup.to_string(),
            ])
            .args(["--streams-per-link", &args.streams_per_link.to_string()])
            .args(["--frame-kib", &args.frame_kib.to_string()])
            .args(["--threads", &args.threads.to_string()])
            .args(["--timeout-secs", &args.timeout_secs.to_string()])
            .args(["--dtype", args.dtype.as_str()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawning peer rank {rank} ({})", exe.display()))?;
        let stdout = child.stdout.take().context("peer stdout")?;
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        peers.push(PeerProcess {
            child,
            stdin,
            lines,
        });
    }
    let mut addrs = Vec::with_capacity(n);
    for (rank, peer) in peers.iter().enumerate() {
        let line = peer.next_line(wait, rank)?;
        let addr = line
            .strip_prefix("LISTEN ")
            .with_context(|| format!("peer rank {rank}: expected `LISTEN addr`, got {line:?}"))?;
        addrs.push(addr.to_string());
    }
    let peer_line = format!("PEERS {}\n", addrs.join(","));
    for (rank, peer) in peers.iter_mut().enumerate() {
        let stdin = peer.stdin.as_mut().context("peer stdin")?;
        stdin
            .write_all(peer_line.as_bytes())
            .and_then(|()| stdin.flush())
            .with_context(|| format!("telling peer rank {rank} its ring"))?;
    }
    for _ in &args.sizes_mib {
        let mut reports = Vec::with_capacity(n);
        for (rank, peer) in peers.iter().enumerate() {
            let line = peer.next_line(wait, rank)?;
            let report: PeerReport = serde_json::from_str(&line)
                .with_context(|| format!("peer rank {rank}: bad report {line:?}"))?;
            reports.push(report);
        }
        if let Some(bad) = reports.iter().find(|r| !r.correct) {
            bail!(
                "peer rank {} computed a wrong sum at {} bytes",
                bad.rank,
                bad.bytes
            );
        }
        // Per iteration the slowest rank (the all-reduce is done when all are), then the median.
        let mut slowest: Vec<f64> = (0..args.iters)
            .map(|i| {
                reports
                    .iter()
                    .map(|r| r.seconds.get(i).copied().unwrap_or(f64::NAN))
                    .fold(0.0, f64::max)
            })
            .collect();
        slowest.sort_by(f64::total_cmp);
        let seconds = slowest[slowest.len() / 2];
        let bytes = reports[0].bytes;
        // CPU of all ranks per all-reduce (median over iterations): the cost on a busy machine.
        let mut cpu: Vec<f64> = (0..args.iters)
            .map(|i| {
                reports
                    .iter()
                    .map(|r| r.cpu_seconds.get(i).copied().unwrap_or(f64::NAN))
                    .sum()
            })
            .collect();
        cpu.sort_by(f64::total_cmp);
        let cpu_seconds = cpu[cpu.len() / 2];
        let algbw = bytes as f64 / seconds / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "{}",
            serde_json::json!({
                "workers": n,
                "bytes": bytes,
                "seconds": seconds,
                // A ring step is one hop of a chunk; for a one-element buffer this is the
                // per-hop latency.
                "seconds_per_ring_step": (n > 1).then(|| seconds / (2.0 * (n as f64 - 1.0))),
                "algbw_gb_s": (algbw * 1000.0).round() / 1000.0,
                "busbw_gb_s": (busbw * 1000.0).round() / 1000.0,
                "cpu_seconds_all_ranks": (cpu_seconds * 1e4).round() / 1e4,
                "iters": args.iters,
                "streams_per_link": args.streams_per_link,
                "frame_bytes": args.frame_kib * 1024,
                "threads": args.threads,
                "dtype": args.dtype.as_str(),
            })
        );
    }
    Ok(())
}

/// Set once this peer has printed its last report: from then on stdin EOF is the parent's
/// "done", not its death.
static REPORTED_ALL: AtomicBool = AtomicBool::new(false);

/// Runs one benchmark peer (see the module docs for its stdin/stdout protocol).
pub fn run_peer(args: PeerArgs) -> anyhow::Result<()> {
    let rt = crate::io_runtime::io_runtime(args.threads).context("starting the tokio runtime")?;
    // Spawned, as a worker's all-reduces are (`ringlink`): on a multi-threaded runtime it then
    // runs on the worker threads, not on this one.
    rt.block_on(async {
        tokio::spawn(peer_main(args))
            .await
            .context("the benchmark peer's task")?
    })
}

async fn peer_main(args: PeerArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding 127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let mailbox = Mailbox::new();
    let service = ring_service(Arc::clone(&mailbox));
    tokio::spawn(
        tune_server(tonic::transport::Server::builder())
            .add_service(service)
            .serve_with_incoming(keel_net::incoming::nodelay_incoming(listener)),
    );
    println!("LISTEN {addr}");
    std::io::stdout().flush()?;

    // Read the ring from stdin, then keep watching it: EOF means the parent is done or gone.
    let (peers_tx, peers_rx) = tokio::sync::oneshot::channel();
    let (eof_tx, eof_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut line = String::new();
        let _ = stdin.read_line(&mut line);
        let _ = peers_tx.send(line);
        let mut rest = String::new();
        while matches!(stdin.read_line(&mut rest), Ok(k) if k > 0) {
            rest.clear();
        }
        // After the last report `peer_main` waits for this; before it, the parent died.
        if !REPORTED_ALL.load(Ordering::SeqCst) || eof_tx.send(()).is_err() {
            std::process::exit(3);
        }
    });
    let timeout = Duration::from_secs(args.timeout_secs);
    let line = tokio::time::timeout(timeout, peers_rx)
        .await
        .context("no PEERS line from the parent")??;
    let peers: Vec<String> = line
        .trim()
        .strip_prefix("PEERS ")
        .with_context(|| format!("expected `PEERS a,b,...`, got {line:?}"))?
        .split(',')
        .map(str::to_string)
        .collect();
    let cfg = RingConfig {
        job_id: "bench-allreduce".to_string(),
        generation: 1,
        rank: u32::try_from(args.rank)?,
        world_size: u32::try_from(args.world)?,
        peers,
        streams_per_link: args.streams_per_link,
        frame_bytes: args.frame_kib * 1024,
        timeout,
    };
    let ring = Ring::connect(cfg, mailbox).await?;
    let n = args.world;
    let mut step = 0u64;
    for &mib in &args.sizes_mib {
        let len = elements(mib);
        let mut data = vec![0.0f32; len];
        let mut seconds = Vec::with_capacity(args.iters);
        let mut cpu_seconds = Vec::with_capacity(args.iters);
        let mut correct = true;
        for it in 0..args.warmup + args.iters {
            fill_input(&mut data, args.rank);
            let token = ring.all_reduce_sum(step, 1, vec![1.0f32]).await?;
            let cpu_before = process_cpu_seconds();
            let started = Instant::now();
            data = ring
                .all_reduce_sum_as(step, 0, data, args.dtype.wire())
                .await?;
            let elapsed = started.elapsed().as_secs_f64();
            if it >= args.warmup {
                seconds.push(elapsed);
                cpu_seconds.push(process_cpu_seconds() - cpu_before);
            }
            // A second barrier before checking the sum and refilling the input: a rank that
            // finished first would otherwise do that work (a pass over the buffer each) on
            // cores the slower ranks still need for their last frames.
            let done = ring.all_reduce_sum(step, 2, vec![1.0f32]).await?;
            correct &= done[0] == n as f32;
            correct &= token[0] == n as f32 && is_known_sum(&data, n);
            step += 1;
        }
        let report = PeerReport {
            rank: args.rank,
            bytes: len * 4,
            seconds,
            cpu_seconds,
            correct,
        };
        println!("{}", serde_json::to_string(&report)?);
        std::io::stdout().flush()?;
    }
    REPORTED_ALL.store(true, Ordering::SeqCst);
    // Keep serving the ring until the parent has every report and closes stdin (see the module
    // docs), bounded by the ring timeout.
    let _ = tokio::time::timeout(timeout, eof_rx).await;
    Ok(())
}

/// User + system CPU time of this process (all threads), seconds.
fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct we pass; an all-zero rusage is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer cannot fail.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Rank `r`'s input: `r + 1 + (i mod 13)`, integer-valued so the sum is exact (in bf16 too: it
/// stays below 256 up to 8 ranks).
fn fill_input(data: &mut [f32], rank: usize) {
    for block in data.chunks_mut(13) {
        for (k, v) in block.iter_mut().enumerate() {
            *v = (rank + 1 + k) as f32;
        }
    }
}

/// Whether `data` is the sum over `n` ranks of [`fill_input`]: `n (n + 1) / 2 + n (i mod 13)`.
fn is_known_sum(data: &[f32], n: usize) -> bool {
    data.chunks(13).all(|block| {
        block
            .iter()
            .enumerate()
            .all(|(k, &x)| x == (n * (n + 1) / 2 + n * k) as f32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn a_world_of_one_is_refused_before_any_world_runs() {
        // `--workers 1` used to time a no-op and print 17,476 GB/s; `2,0` ran world 2 first.
        for workers in ["1", "2,1", "2,0"] {
            let cli = Cli::try_parse_from(["bench", "--workers", workers]).expect("parse");
            let err = run(cli.args).expect_err(workers).to_string();
            assert!(err.contains("2 or more"), "{workers}: {err}");
        }
    }

    #[test]
    fn threads_outside_1_to_64_do_not_parse() {
        for threads in ["0", "65", "100000"] {
            assert!(
                Cli::try_parse_from(["bench", "--threads", threads]).is_err(),
                "{threads}"
            );
        }
        let cli = Cli::try_parse_from(["bench", "--threads", "2"]).expect("parse");
        assert_eq!(cli.args.threads, 2);
    }
}
