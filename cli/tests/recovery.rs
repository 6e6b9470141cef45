//! Losing workers mid-job: `kill -9` of a random worker at a random step, several
//! times in one job. The survivors are suspended at once, the ring re-forms, and the job goes
//! on from the newest step a survivor holds in memory:
//! - with `min_workers = max_workers`, the job waits for a replacement worker, which receives
//!   the weights and optimizer state by broadcast; the final checkpoint is bit for bit that
//!   of an uninterrupted run of the same job;
//! - with `min_workers` below, the job goes on with fewer workers (same global batch), grows
//!   back when a new worker registers, and ends close to the uninterrupted run (the ring sums
//!   in another order while the world is smaller);
//! - `kill -9` of the coordinator: restarted on the same address and data folder, it restores
//!   the job, the workers register again saying what they hold, and the job goes on from
//!   their memory, again bit for bit.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A small pseudo-random generator (SplitMix64), seeded and printed so a failure replays.
struct Rng(u64);

impl Rng {
    fn from_time() -> Rng {
        let seed = std::env::var("KEEL_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("random seed: {seed} (set KEEL_TEST_SEED to replay)");
        Rng(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n.max(1)
    }
}

/// A coordinator and workers on 127.0.0.1.
struct Cluster {
    dir: tempfile::TempDir,
    _coordinator: Proc,
    addr: String,
    workers: Vec<(Proc, String)>,
    started: usize,
    corpus: PathBuf,
    /// `train.precision` of the jobs submitted.
    precision: &'static str,
    /// The `[diloco]` section of the jobs submitted (none: synchronous).
    diloco: Option<&'static str>,
}

impl Cluster {
    fn new(workers: usize) -> Cluster {
        Cluster::with_precision(workers, "auto")
    }

    fn with_precision(workers: usize, precision: &'static str) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let corpus = kjv_lines(dir.path(), 2000);
        let (coordinator, addr) = start_coordinator(dir.path());
        let mut c = Cluster {
            dir,
            _coordinator: coordinator,
            addr,
            workers: Vec::new(),
            started: 0,
            corpus,
            precision,
            diloco: None,
        };
        for _ in 0..workers {
            c.add_worker();
        }
        c
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Starts a worker and waits until it has registered. Submitting before every worker has
    /// registered starts the job on fewer and grows it later, which sums in another order: the
    /// reference runs then differed from the runs they were compared with (seen on an Intel
    /// Xeon where the worker's bf16 start-up race delays its registration by seconds).
    fn add_worker(&mut self) {
        let w = start_worker(self.dir.path(), &self.addr, self.started);
        self.started += 1;
        let registered = poll(Duration::from_secs(120), || {
            w.0.log_text().contains("registered").then_some(())
        });
        assert!(
            registered.is_some(),
            "worker {} did not register:\n{}",
            w.1,
            w.0.log_text()
        );
        self.workers.push(w);
    }

    /// The job: 3 workers' global batch, fixed vocabulary (byte-identical data every time).
    fn submit(&self, name: &str, min_workers: usize) -> String {
        self.submit_sized(name, 3, min_workers, None)
    }

    /// The job on `workers` workers' global batch (at most that many, at least `min_workers`),
    /// with `train_extra` lines in `[train]` (else the precision rule below).
    fn submit_sized(
        &self,
        name: &str,
        workers: usize,
        min_workers: usize,
        train_extra: Option<&str>,
    ) -> String {
        let case = self.root().join(name);
        std::fs::create_dir_all(&case).unwrap();
        let mut job = JobFile::new(self.corpus.clone());
        job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
        job.workers = workers;
        job.micro_batch_size = 4;
        job.max_steps = 40;
        job.warmup_steps = 4;
        job.checkpoint_every = 10;
        job.eval_every = 0;
        job.peer_timeout_seconds = 10.0;
        job.cluster_extra = format!("min_workers = {min_workers}\nmax_recoveries = 8");
        if let Some(diloco) = self.diloco {
            job.cluster_extra += &format!("\n[diloco]\n{diloco}");
        }
        if min_workers < job.workers {
            // A smaller world sums in another order; its 1e-3 bound below is fp32's (bf16's
            // 8-bit rounding of every GEMM input amplifies a reordering: see equivalence.rs).
            job.train_extra = "precision = \"fp32\"".into();
        } else {
            // The bit-for-bit cases run in `auto`: bf16 where the workers have it natively.
            job.train_extra = format!("precision = \"{}\"", self.precision);
        }
        if let Some(extra) = train_extra {
            job.train_extra = extra.to_string();
        }
        let text = std::fs::read_to_string(job.write(&case))
            .unwrap()
            .replace(&format!("min_workers = {workers}\n"), "");
        let path = case.join("job.toml");
        std::fs::write(&path, text).unwrap();
        let out = run_keel(
            &[
                "submit",
                path.to_str().unwrap(),
                "--coordinator",
                &self.addr,
            ],
            self.root(),
        );
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    fn status(&self, job: &str) -> serde_json::Value {
        status(job, &self.addr, self.root())
    }

    /// Waits until `f(status)` holds; panics with the status and logs after `limit`.
    fn wait(
        &self,
        job: &str,
        what: &str,
        limit: Duration,
        f: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        poll(limit, || {
            let s = self.status(job);
            assert_ne!(
                s["state"], "failed",
                "job failed while waiting for {what}: {s}"
            );
            f(&s).then_some(s)
        })
        .unwrap_or_else(|| panic!("{what}: not within {limit:?}: {}", self.status(job)))
    }

    fn pull(&self, job: &str, name: &str) -> PathBuf {
        let out_dir = self.root().join(name);
        let out = run_keel(
            &[
                "pull",
                job,
                "--out",
                out_dir.to_str().unwrap(),
                "--coordinator",
                &self.addr,
            ],
            self.root(),
        );
        assert!(out.status.success(), "{out:?}");
        out_dir
    }

    /// Runs the job uninterrupted (`min_workers` as given) and pulls its final checkpoint.
    fn reference_checkpoint(&self, min_workers: usize) -> PathBuf {
        let job = self.submit("reference", min_workers);
        self.wait(
            &job,
            "the reference job to complete",
            Duration::from_secs(600),
            |s| s["state"] == "completed",
        );
        self.pull(&job, "reference-checkpoint")
    }

    /// kill -9 of the coordinator, then a new one on the same address and data folder.
    fn restart_coordinator(&mut self, n: usize) {
        self._coordinator.child.kill().unwrap();
        self._coordinator.child.wait().unwrap();
        self._coordinator = Proc::spawn(
            &format!("coordinator-{n}"),
            &sibling("keel-coordinator"),
            &[
                "--listen".into(),
                self.addr.clone(),
                "--data-dir".into(),
                self.root().join("coordinator").display().to_string(),
            ],
            &self.root().join("logs"),
        );
        // A status call right after the spawn would race the bind (seen in CI: "Connection
        // refused" from the poll after a restart).
        wait_listening(&self.addr, &self._coordinator);
    }

    /// kill -9 of the worker at `index` (of those alive); returns its address.
    fn kill(&mut self, index: usize) -> String {
        let (mut proc, addr) = self.workers.remove(index);
        proc.child.kill().unwrap();
        proc.child.wait().unwrap();
        addr
    }
}

/// Asserts that `got` holds the same weights and optimizer state as `expected`, byte for byte.
fn assert_bit_identical(expected: &Path, got: &Path) {
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let (x, y) = (
            std::fs::read(expected.join(f)).unwrap(),
            std::fs::read(got.join(f)).unwrap(),
        );
        assert!(
            x == y,
            "{f} differs from the uninterrupted run (max relative weight difference {:e})",
            max_relative_difference(got, expected)
        );
    }
}

#[test]
fn killed_workers_are_replaced_and_the_result_is_bit_identical() {
    let mut cluster = Cluster::new(3);
    let limit = Duration::from_secs(600);

    let expected = cluster.reference_checkpoint(3);

    let mut rng = Rng::from_time();
    let job = cluster.submit("killed", 3);
    let mut at = 0;
    for round in 1..=3u64 {
        // A random step in the next stretch of the job, then a random worker.
        let target = at + 2 + rng.below(8);
        let s = cluster.wait(&job, "the job to reach the kill step", limit, |s| {
            s["state"] == "running" && s["step"].as_u64().unwrap_or(0) >= target
        });
        let victim = rng.below(cluster.workers.len() as u64) as usize;
        let killed_at = Instant::now();
        let addr = cluster.kill(victim);
        println!(
            "round {round}: killed {addr} at step >= {} ({s})",
            s["step"]
        );
        // The survivors are suspended and wait for a replacement (min_workers = 3).
        cluster.wait(
            &job,
            "the job to notice the loss",
            Duration::from_secs(30),
            |s| s["recoveries"].as_u64() == Some(round),
        );
        println!(
            "round {round}: loss noticed after {:.1} s",
            killed_at.elapsed().as_secs_f64()
        );
        cluster.add_worker();
        let s = cluster.wait(
            &job,
            "the job to run again with the replacement",
            limit,
            |s| s["state"] == "running" && s["workers"].as_array().is_some_and(|w| w.len() == 3),
        );
        println!(
            "round {round}: running again at step {} after {:.1} s",
            s["step"],
            killed_at.elapsed().as_secs_f64()
        );
        at = s["step"].as_u64().unwrap();
    }
    let done = cluster.wait(&job, "the job to complete", limit, |s| {
        s["state"] == "completed"
    });
    assert_eq!(done["step"], 40, "{done}");
    assert_eq!(done["recoveries"], 3, "{done}");
    let got = cluster.pull(&job, "killed-checkpoint");
    assert_bit_identical(&expected, &got);
    // The survivors of every round are still alive.
    for (proc, addr) in &mut cluster.workers {
        assert!(
            proc.child.try_wait().unwrap().is_none(),
            "worker {addr} exited:\n{}",
            proc.log_text()
        );
    }
}

#[test]
fn a_job_goes_on_with_fewer_workers_and_grows_back() {
    let mut cluster = Cluster::new(3);
    let limit = Duration::from_secs(600);
    let expected = cluster.reference_checkpoint(2);

    let mut rng = Rng::from_time();
    let job = cluster.submit("shrunk", 2);
    let target = 3 + rng.below(8);
    cluster.wait(&job, "the job to reach the kill step", limit, |s| {
        s["state"] == "running" && s["step"].as_u64().unwrap_or(0) >= target
    });
    let victim = rng.below(3) as usize;
    let addr = cluster.kill(victim);
    println!("killed {addr} at step >= {target}");
    // It goes on with the two survivors, without waiting for anyone.
    let s = cluster.wait(&job, "the job to go on with 2 workers", limit, |s| {
        s["state"] == "running" && s["workers"].as_array().is_some_and(|w| w.len() == 2)
    });
    let resumed_at = s["step"].as_u64().unwrap();
    cluster.wait(&job, "two steps with 2 workers", limit, |s| {
        s["step"].as_u64().unwrap_or(0) >= resumed_at + 2 || s["state"] == "completed"
    });
    // A new worker joins the running job in a new generation.
    cluster.add_worker();
    let done = cluster.wait(&job, "the job to complete", limit, |s| {
        s["state"] == "completed"
    });
    println!("final status: {done}");
    assert_eq!(done["step"], 40, "{done}");
    assert_eq!(done["recoveries"], 1, "{done}");
    let got = cluster.pull(&job, "shrunk-checkpoint");
    let grew = std::fs::read_to_string(got.join("metrics.jsonl"))
        .unwrap()
        .contains("\"event\":\"grow\"");
    assert!(grew, "no generation added the new worker");
    let d = max_relative_difference(&got, &expected);
    println!(
        "max relative weight difference from the uninterrupted run: {d:.2e} (grew back: {grew})"
    );
    assert!(
        d < 1e-3,
        "the recovered run drifted from the uninterrupted one: {d:e}"
    );
}

#[test]
fn a_restarted_coordinator_resumes_the_job_from_the_workers_memory() {
    let mut cluster = Cluster::new(3);
    let limit = Duration::from_secs(600);
    let expected = cluster.reference_checkpoint(3);

    let mut rng = Rng::from_time();
    let job = cluster.submit("restarted", 3);
    let target = 3 + rng.below(20);
    cluster.wait(&job, "the job to reach the kill step", limit, |s| {
        s["state"] == "running" && s["step"].as_u64().unwrap_or(0) >= target
    });
    cluster.restart_coordinator(2);
    println!("killed and restarted the coordinator at step >= {target}");
    let s = cluster.wait(&job, "the restored job to run again", limit, |s| {
        s["state"] == "running" || s["state"] == "completed"
    });
    println!("after the restart: {s}");
    let done = cluster.wait(&job, "the job to complete", limit, |s| {
        s["state"] == "completed"
    });
    assert_eq!(done["step"], 40, "{done}");
    let got = cluster.pull(&job, "restarted-checkpoint");
    assert_bit_identical(&expected, &got);
}

/// Two runs of one job on the same worker processes end bit for bit the same, in bf16 (the
/// reference runs above rely on it). This failed (max relative difference 1.389) while the
/// cluster was not waited for: see `Cluster::add_worker`.
#[test]
fn two_runs_of_one_bf16_job_on_the_same_workers_are_bit_identical() {
    let cluster = Cluster::with_precision(3, "bf16");
    let first = cluster.reference_checkpoint(3);
    let kept = cluster.root().join("first-run");
    std::fs::rename(&first, &kept).unwrap();
    let second = cluster.reference_checkpoint(3);
    assert_bit_identical(&kept, &second);
}

/// Many workers: eight train, two are killed at once (`kill -9`, back to back), the
/// job goes on with the six survivors without waiting, a newcomer joins it mid-job in a new
/// generation, and it completes every step. The gradients travel as bf16 on the 8-rank ring
/// (`train.allreduce_dtype`) in buckets of 1 MiB (`train.bucket_mib`, several per step), so
/// those paths run through recoveries too.
#[test]
fn eight_workers_lose_two_at_once_and_take_a_newcomer() {
    let mut cluster = Cluster::new(8);
    let limit = Duration::from_secs(600);
    let mut rng = Rng::from_time();
    let job = cluster.submit_sized(
        "eight",
        8,
        6,
        Some("precision = \"fp32\"\nallreduce_dtype = \"bf16\"\nbucket_mib = 1"),
    );
    let target = 3 + rng.below(8);
    let s = cluster.wait(&job, "8 workers to reach the kill step", limit, |s| {
        s["state"] == "running"
            && s["step"].as_u64().unwrap_or(0) >= target
            && s["workers"].as_array().is_some_and(|w| w.len() == 8)
    });
    let first = rng.below(8) as usize;
    let second = (first + 1 + rng.below(7) as usize) % 8;
    // Remove the higher index first, so the lower one still names the same worker.
    let (hi, lo) = (first.max(second), first.min(second));
    let killed_at = Instant::now();
    let addrs = [cluster.kill(hi), cluster.kill(lo)];
    println!("killed {addrs:?} at step >= {} ({s})", s["step"]);
    let s = cluster.wait(&job, "the job to go on with 6 workers", limit, |s| {
        s["state"] == "running" && s["workers"].as_array().is_some_and(|w| w.len() == 6)
    });
    println!(
        "running with 6 workers at step {} after {:.1} s",
        s["step"],
        killed_at.elapsed().as_secs_f64()
    );
    let resumed_at = s["step"].as_u64().unwrap();
    cluster.wait(&job, "two steps with 6 workers", limit, |s| {
        s["step"].as_u64().unwrap_or(0) >= resumed_at + 2 || s["state"] == "completed"
    });
    cluster.add_worker();
    let done = cluster.wait(&job, "the job to complete", limit, |s| {
        s["state"] == "completed"
    });
    println!("final status: {done}");
    assert_eq!(done["step"], 40, "{done}");
    // The two deaths may be noticed together (one recovery) or one after the other (two).
    let recoveries = done["recoveries"].as_u64().unwrap_or(0);
    assert!((1..=2).contains(&recoveries), "{done}");
    let got = cluster.pull(&job, "eight-checkpoint");
    let metrics = std::fs::read_to_string(got.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.contains("\"event\":\"grow\""),
        "no generation added the newcomer"
    );
    let losses: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
        .collect();
    assert!(
        losses.iter().all(|l| l.is_finite()) && losses.last() < losses.first(),
        "losses {losses:?}"
    );
}

/// DiLoCo through a worker's death inside a round: the replacement receives the
/// root's replica with the outer state (anchor and momentum) by broadcast, the round goes on,
/// and the job completes every step. The result is not bit-identical to an uninterrupted run
/// (the survivors go on from the root's local weights, not each from its own), so it is
/// compared by its held-out loss.
#[test]
fn a_diloco_job_survives_a_worker_killed_inside_a_round() {
    let mut cluster = Cluster::new(3);
    cluster.diloco = Some("inner_steps = 10\nouter_momentum = 0.5");
    let limit = Duration::from_secs(600);
    let reference = cluster.submit_sized("diloco-reference", 3, 3, Some("precision = \"fp32\""));
    cluster.wait(&reference, "the reference to complete", limit, |s| {
        s["state"] == "completed"
    });
    let expected = cluster.pull(&reference, "diloco-reference-checkpoint");
    let job = cluster.submit_sized("diloco-killed", 3, 3, Some("precision = \"fp32\""));
    // Inside the second round (steps 10..20), past its first local step.
    let s = cluster.wait(&job, "the job to reach step 13", limit, |s| {
        s["state"] == "running" && s["step"].as_u64().unwrap_or(0) >= 13
    });
    let addr = cluster.kill(1);
    println!("killed {addr} at step >= {} ({s})", s["step"]);
    cluster.wait(&job, "the job to notice the loss", limit, |s| {
        s["recoveries"].as_u64() == Some(1)
    });
    cluster.add_worker();
    let done = cluster.wait(&job, "the job to complete", limit, |s| {
        s["state"] == "completed"
    });
    assert_eq!(done["step"], 40, "{done}");
    let got = cluster.pull(&job, "diloco-killed-checkpoint");
    let last_loss = |dir: &Path| -> f64 {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
            .expect("step lines")
    };
    let (want, have) = (last_loss(&expected), last_loss(&got));
    let d = max_relative_difference(&got, &expected);
    println!("last training loss: uninterrupted {want:.4}, killed {have:.4}; weights {d:.2e}");
    assert!(
        have.is_finite() && (have - want).abs() <= 0.1 * want,
        "{have} vs {want}"
    );
}
