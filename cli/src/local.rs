//! `keel local`: a whole Keel cluster of real processes on this machine. Starts
//! `keel-coordinator` and N `keel-worker`s (found next to this executable) on 127.0.0.1 with
//! free ports, submits the job, shows its progress, pulls the final checkpoint, and stops the
//! processes, also on error or Ctrl-C. The cluster gets a fresh random token, written to
//! `keel.token` (mode 600) in the work folder and given to every process.

use crate::conn::{finished_ok, submit};
use crate::output::{errln, outln};
use crate::{pull, watch};
use anyhow::Context;
use keel_proto::jobspec::JobSpec;
use keel_proto::metrics::{EvalLine, MetricsLine};
use keel_proto::rpc::PingRequest;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `keel local`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job file (its `[cluster]` is set to exactly --workers workers).
    pub job_file: PathBuf,
    /// Worker processes to start.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Folder to write the final checkpoint to (with metrics.jsonl and loss.png).
    #[arg(long)]
    pub out: PathBuf,
    /// Compute threads per worker; default: available cores / workers (at least 1).
    #[arg(long, env = "KEEL_THREADS")]
    pub threads: Option<usize>,
    /// Folder for the coordinator's data, the workers' caches and all logs; default: a
    /// temporary folder, removed after a successful run.
    #[arg(long, env = "KEEL_LOCAL_DIR")]
    pub work_dir: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Serve the coordinator's live dashboard (and Prometheus metrics) at this address, e.g.
    /// 127.0.0.1:9470; off when not given. Off loopback the page asks for the cluster token
    /// (in `WORK_DIR/keel.token`).
    #[arg(long, value_name = "ADDR")]
    pub dashboard: Option<String>,
}

/// The started processes; dropping it kills and reaps them.
struct Cluster {
    /// (name, process), coordinator first.
    children: Vec<(String, Child)>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (name, child) in self.children.iter_mut().rev() {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            if let Err(e) = child.wait() {
                errln!("warning: reaping {name}: {e}");
            }
        }
    }
}

impl Cluster {
    /// Fails if a process has exited (naming it and its log).
    fn check_alive(&mut self, logs: &Path) -> anyhow::Result<()> {
        for (name, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "{name} exited ({status}); its log: {}\n{}",
                    logs.join(format!("{name}.log")).display(),
                    tail(&logs.join(format!("{name}.log")), 15)
                );
            }
        }
        Ok(())
    }
}

/// The last `n` lines of a file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A free TCP port on 127.0.0.1 (bound and released; the OS does not hand it out again soon).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// `name` next to the running `keel` executable.
fn sibling_exe(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("locating the keel executable")?;
    let dir = me.parent().context("the keel executable has no folder")?;
    let path = dir.join(name);
    if !path.is_file() {
        anyhow::bail!(
            "{} not found next to {} (build all binaries: cargo build --release --bins)",
            path.display(),
            me.display()
        );
    }
    Ok(path)
}

fn spawn(
    cluster: &mut Cluster,
    name: &str,
    exe: &Path,
    args: &[String],
    logs: &Path,
) -> anyhow::Result<()> {
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    let child = Command::new(exe)
        .args(args)
        // The local cluster is plaintext on 127.0.0.1: TLS settings meant for another
        // cluster must not leak into its processes.
        .env_remove("KEEL_TLS_CERT")
        .env_remove("KEEL_TLS_KEY")
        .env_remove("KEEL_TLS_CA")
        // Nor a metrics port meant for one process (every worker would try to bind it).
        .env_remove("KEEL_METRICS_LISTEN")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    cluster.children.push((name.to_string(), child));
    Ok(())
}

/// Runs `keel local`.
///
/// Errors: a process that fails to start or dies, the job failing (its error), or the pull.
pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    // Take Ctrl-C from the start, so that it stops the cluster (dropping `Cluster` kills the
    // processes) instead of ending this process with the workers left running.
    let (interrupted_tx, mut interrupted) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = interrupted_tx.send(true);
        }
    });
    let mut spec = JobSpec::from_file(&args.job_file)?;
    spec.resolve_paths(&std::env::current_dir()?);
    spec.cluster.min_workers = args.workers;
    spec.cluster.max_workers = args.workers;
    let (tmp, root) = match &args.work_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            (None, dir.clone())
        }
        None => {
            let t = tempfile::Builder::new().prefix("keel-local-").tempdir()?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    };
    // From here on, any failure (a process that cannot start, a port taken) keeps the logs.
    let tmp = KeptOnFailure(tmp);
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs)?;
    let token_path = root.join("keel.token");
    // A token left by an earlier run in a reused --work-dir is replaced: each cluster its own.
    match std::fs::remove_file(&token_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", token_path.display()));
        }
        _ => {}
    }
    let token = keel_net::auth::ClusterToken::create_file(&token_path)?;
    let security = keel_net::security::ClientSecurity::new(&token, None);
    let job_path = root.join("job.toml");
    std::fs::write(&job_path, spec.to_toml_string()?)?;

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = args.threads.unwrap_or(cores / args.workers).max(1);
    let coordinator_exe = sibling_exe("keel-coordinator")?;
    let worker_exe = sibling_exe("keel-worker")?;
    let mut cluster = Cluster {
        children: Vec::new(),
    };
    let port = free_port()?;
    let coord_addr = format!("127.0.0.1:{port}");
    let mut coordinator_args: Vec<String> = vec![
        "--listen".into(),
        coord_addr.clone(),
        "--data-dir".into(),
        root.join("coordinator").display().to_string(),
        "--token-file".into(),
        token_path.display().to_string(),
    ];
    if let Some(addr) = &args.dashboard {
        coordinator_args.extend(["--metrics-listen".to_string(), addr.clone()]);
    }
    spawn(
        &mut cluster,
        "coordinator",
        &coordinator_exe,
        &coordinator_args,
        &logs,
    )?;
    let mut client = crate::conn::connect_with(&coord_addr, &security)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        cluster.check_alive(&logs)?;
        anyhow::ensure!(!*interrupted.borrow(), "interrupted");
        if client.ping(PingRequest {}).await.is_ok() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the coordinator did not answer within 30 s (log: {})",
            logs.join("coordinator.log").display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Some(addr) = &args.dashboard {
        // The coordinator has bound it by now (it binds before serving gRPC). An unspecified
        // host (0.0.0.0, [::]) is reached on this machine at loopback.
        let addr = addr
            .replacen("0.0.0.0:", "127.0.0.1:", 1)
            .replacen("[::]:", "[::1]:", 1);
        errln!(
            "dashboard: http://{addr}/ (token: {})",
            token_path.display()
        );
    }
    for i in 0..args.workers {
        let addr = format!("127.0.0.1:{}", free_port()?);
        spawn(
            &mut cluster,
            &format!("worker-{i}"),
            &worker_exe,
            &[
                "--coordinator".into(),
                coord_addr.clone(),
                "--listen".into(),
                addr.clone(),
                "--advertise-addr".into(),
                addr,
                "--threads".into(),
                threads.to_string(),
                "--cache-dir".into(),
                root.join(format!("worker-{i}")).display().to_string(),
                "--token-file".into(),
                token_path.display().to_string(),
            ],
            &logs,
        )?;
    }
    if !args.quiet {
        // A temporary work folder is removed after a successful run: name it only where it
        // stays (--work-dir); on failure its logs are kept and named below.
        let where_logs = if tmp.0.is_some() {
            "logs are kept if the run fails (or give --work-dir)".to_string()
        } else {
            format!("logs in {}", logs.display())
        };
        errln!(
            "keel local: coordinator {coord_addr}, {} worker(s) x {threads} thread(s); {where_logs}",
            args.workers,
        );
    }
    let started = Instant::now();
    let work = async {
        let job = submit(&mut client, &job_path).await?;
        if !args.quiet {
            errln!("keel local: submitted {job}");
        }
        let status = watch::watch(&mut client, &job, !args.quiet).await?;
        finished_ok(&status)?;
        let out = pull::pull(&mut client, &job, Some(spec.train.max_steps), &args.out).await?;
        let (throughput, steps) = mean_throughput(&out.join("metrics.jsonl"));
        outln!(
            "{job}: completed {} steps on {} worker(s) in {:.1} s; final loss {:.4}; throughput {:.0} tok/s (mean of steps {}..{}); checkpoint in {}",
            status.max_steps,
            args.workers,
            started.elapsed().as_secs_f64(),
            status.loss,
            throughput,
            steps.0,
            steps.1,
            out.display()
        );
        if let Some(eval) = last_eval(&out.join("metrics.jsonl")) {
            outln!(
                "{job}: held-out MLM at step {}: loss {:.4}, accuracy {:.1}% ({} masked tokens)",
                eval.step,
                eval.eval_loss,
                eval.eval_accuracy * 100.0,
                eval.eval_masked_tokens
            );
        }
        Ok(())
    };
    let result = tokio::select! {
        r = work => r,
        _ = interrupted.wait_for(|i| *i) => Err(anyhow::anyhow!("interrupted")),
    };
    drop(cluster);
    if result.is_ok() {
        tmp.remove();
    }
    result
}

/// `keel local`'s temporary work folder (`None` with `--work-dir`): removed by
/// [`KeptOnFailure::remove`] after a successful run; dropped otherwise (an error returned
/// anywhere), it stays and its logs folder is named.
struct KeptOnFailure(Option<tempfile::TempDir>);

impl KeptOnFailure {
    /// Removes the folder (the run succeeded).
    fn remove(mut self) {
        drop(self.0.take());
    }
}

impl Drop for KeptOnFailure {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            let kept = t.keep();
            errln!("keel local: logs kept in {}", kept.join("logs").display());
        }
    }
}

/// The last held-out evaluation (`eval` line) of a metrics.jsonl that masked at least one token,
/// if the job evaluated; lines this version cannot read are skipped (a summary, not a check).
pub fn last_eval(metrics: &Path) -> Option<EvalLine> {
    let text = std::fs::read_to_string(metrics).ok()?;
    // An eval of 0 masked tokens measured nothing (no held-out set: data.heldout_fraction = 0);
    // printed, it read "loss 0.0000, accuracy 0.0%".
    text.lines()
        .filter_map(|l| match MetricsLine::parse(l) {
            Ok(MetricsLine::Eval(e)) if e.eval_masked_tokens > 0 => Some(e),
            _ => None,
        })
        .max_by_key(|e| e.step)
}

/// Mean `tokens_per_s` over the step lines of a metrics.jsonl, leaving out the first 20% of
/// steps (warm-up: allocation, first connections). Returns (mean, (first step, last step)).
pub fn mean_throughput(metrics: &Path) -> (f64, (u64, u64)) {
    let text = std::fs::read_to_string(metrics).unwrap_or_default();
    // A line this version cannot read counts for nothing here (a summary, not a check).
    let rows: Vec<(u64, f64)> = text
        .lines()
        .filter_map(|l| MetricsLine::parse(l).ok())
        .filter_map(|line| match line {
            MetricsLine::Step(s) if !s.tokens_per_s.is_nan() => Some((s.step, s.tokens_per_s)),
            _ => None,
        })
        .collect();
    if rows.is_empty() {
        return (f64::NAN, (0, 0));
    }
    let skip = rows.len() / 5;
    let kept = &rows[skip..];
    let mean = kept.iter().map(|r| r.1).sum::<f64>() / kept.len() as f64;
    (mean, (kept[0].0, kept[kept.len() - 1].0))
}

#[cfg(test)]
mod tests {
    use super::last_eval;

    #[test]
    fn last_eval_takes_the_latest_step_and_skips_other_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        let lines = [
            r#"{"eval_accuracy":0.2,"eval_loss":5.5,"eval_masked_tokens":100,"eval_perplexity":244.7,"step":200}"#,
            r#"{"loss":5.0,"lr":0.001,"step":300,"tokens_per_s":1000.0}"#,
            "not json",
            r#"{"eval_accuracy":0.3,"eval_loss":4.5,"eval_masked_tokens":120,"eval_perplexity":90.0,"step":400}"#,
            r#"{"eval_accuracy":0.1,"eval_loss":6.5,"eval_masked_tokens":90,"eval_perplexity":665.1,"step":100}"#,
            r#"{"eval_accuracy":0.0,"eval_loss":0.0,"eval_masked_tokens":0,"eval_perplexity":1.0,"step":500}"#,
        ];
        std::fs::write(&path, lines.join("\n")).expect("write");
        let eval = last_eval(&path).expect("an eval line");
        assert_eq!(eval.step, 400);
        assert_eq!(eval.eval_loss, 4.5);
        assert_eq!(eval.eval_masked_tokens, 120);
        assert!(last_eval(&dir.path().join("missing.jsonl")).is_none());
    }
}
