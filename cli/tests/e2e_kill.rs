//! A worker killed mid-job, with recovery off (`max_recoveries = 0`): the job fails within
//! the peer timeout with an error naming the dead worker and the step; nothing hangs. A worker
//! stopped by SIGTERM says so itself. (Recovery is tested in `recovery.rs`.)

mod common;

use common::*;
use std::time::Duration;

/// A coordinator and two workers running a long job on part of the KJV, at step >= 3.
struct RunningJob {
    dir: tempfile::TempDir,
    _coordinator: Proc,
    addr: String,
    workers: Vec<(Proc, String)>,
    job_id: String,
    /// The job's status once it runs.
    status: serde_json::Value,
}

fn start_running_job(peer_timeout_seconds: f64) -> RunningJob {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(3000).collect();
    let corpus_path = root.join("kjv-part.txt");
    std::fs::write(&corpus_path, part.join("\n") + "\n").unwrap();

    let (coordinator, addr) = start_coordinator(root);
    let workers = vec![start_worker(root, &addr, 0), start_worker(root, &addr, 1)];
    let mut job = JobFile::new(corpus_path);
    job.vocab_size = 500;
    job.max_steps = 1_000_000;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.peer_timeout_seconds = peer_timeout_seconds;
    // Recovery off: these tests are about detection and the failure message.
    job.cluster_extra = "max_recoveries = 0".into();
    let job_path = job.write(root);
    let out = run_keel(
        &["submit", job_path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let job_id = String::from_utf8(out.stdout).unwrap().trim().to_string();

    // Wait until training runs (data preparation included).
    let status = poll(Duration::from_secs(180), || {
        let s = status(&job_id, &addr, root);
        (s["step"].as_u64()? >= 3).then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the job never reached step 3: {}",
            status(&job_id, &addr, root)
        )
    });
    RunningJob {
        dir,
        _coordinator: coordinator,
        addr,
        workers,
        job_id,
        status,
    }
}

impl RunningJob {
    /// Takes out the worker process behind rank 1 (workers[r] = "w-N (host:port)" of rank r).
    fn take_rank1(&mut self) -> (Proc, String) {
        let rank1 = self.status["workers"][1].as_str().unwrap().to_string();
        let victim = self
            .workers
            .iter()
            .position(|(_, a)| rank1.contains(a.as_str()))
            .expect("rank 1 is one of our workers");
        self.workers.remove(victim)
    }

    /// Waits for the job to fail; returns its error.
    fn failure(&self, limit: Duration) -> String {
        let root = self.dir.path();
        let failed = poll(limit, || {
            let s = status(&self.job_id, &self.addr, root);
            (s["state"] == "failed").then_some(s)
        })
        .unwrap_or_else(|| {
            panic!(
                "the job did not fail: {}",
                status(&self.job_id, &self.addr, root)
            )
        });
        let error = failed["error"].as_str().unwrap().to_string();
        println!("error: {error}");
        error
    }
}

#[test]
fn killing_a_worker_fails_the_job_naming_the_worker_and_step() {
    let mut job = start_running_job(5.0);
    let (mut proc, victim_addr) = job.take_rank1();
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();

    let error = job.failure(Duration::from_secs(60));
    let cause = error.split(" [ring:").next().unwrap();
    assert!(
        cause.contains(&victim_addr),
        "the error does not name the dead worker {victim_addr}: {error}"
    );
    assert!(
        cause.contains("step"),
        "the error does not name the step: {error}"
    );
    // The surviving worker is still alive and free for the next job.
    let (survivor, _) = &mut job.workers[0];
    assert!(
        survivor.child.try_wait().unwrap().is_none(),
        "the surviving worker exited:\n{}",
        survivor.log_text()
    );
}

#[test]
fn sigterm_makes_a_worker_leave_its_job_and_say_so() {
    // A long peer timeout, so that a failure within seconds can only come from the worker's
    // own report.
    let mut job = start_running_job(120.0);
    let (mut proc, victim_addr) = job.take_rank1();
    let pid = proc.child.id().to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(term.success());

    // The worker exits by itself, cleanly.
    let exited = poll(Duration::from_secs(15), || proc.child.try_wait().unwrap());
    let code = exited.unwrap_or_else(|| panic!("the worker ignored SIGTERM:\n{}", proc.log_text()));
    assert!(code.success(), "exit {code:?}:\n{}", proc.log_text());

    // And the job fails at once (well inside the 120 s peer timeout), naming it and the step.
    let error = job.failure(Duration::from_secs(30));
    assert!(error.contains("shut down by a signal"), "{error}");
    assert!(error.contains(&victim_addr), "{error}");
    assert!(error.contains("step"), "{error}");
}
