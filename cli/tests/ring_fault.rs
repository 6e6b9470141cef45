//! A ring failure at a chosen step (abuse case 3, `scripts/abuse.sh`): one worker's all-reduce fails as when
//! its left neighbour sends a malformed frame (the worker's hidden `--fault-bad-frame-at-step`).
//! The failing worker reports the failure while the coordinator is already suspending the ring;
//! it used to miss that `Suspend` (it was still waiting for its failure report's answer), so the
//! coordinator waited `peer_timeout_seconds` for it, dropped it, and the job lost the steps since
//! its last checkpoint. Now the recovery forms the next generation at once, from the workers'
//! memory, with all three workers, and the result is bit for bit that of an uninterrupted run.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// 0-based step at which worker 1's all-reduce fails.
const FAULT_STEP: u64 = 6;
/// The job's peer timeout, seconds: the coordinator's wait for a suspended worker's answer.
const PEER_TIMEOUT_SECONDS: f64 = 30.0;

fn submit(root: &Path, addr: &str, corpus: &Path, name: &str) -> String {
    let case = root.join(name);
    std::fs::create_dir_all(&case).unwrap();
    let mut job = JobFile::new(corpus.to_path_buf());
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.workers = 3;
    job.micro_batch_size = 4;
    job.max_steps = 14;
    job.warmup_steps = 2;
    // No checkpoint before the end: a resume from a checkpoint would restart from step 0.
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.peer_timeout_seconds = PEER_TIMEOUT_SECONDS;
    job.cluster_extra = "max_recoveries = 2".into();
    let path = job.write(&case);
    let out = run_keel(
        &["submit", path.to_str().unwrap(), "--coordinator", addr],
        root,
    );
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn pull(root: &Path, addr: &str, job: &str, name: &str) -> PathBuf {
    let out_dir = root.join(name);
    let out = run_keel(
        &[
            "pull",
            job,
            "--out",
            out_dir.to_str().unwrap(),
            "--coordinator",
            addr,
        ],
        root,
    );
    assert!(out.status.success(), "{out:?}");
    out_dir
}

#[test]
fn a_ring_failure_recovers_at_once_from_memory_with_every_worker() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let corpus = kjv_lines(root, 1500);
    let (_coordinator, addr) = start_coordinator(root);
    let _w0 = start_worker(root, &addr, 0);
    let _w1 = start_worker_with(
        root,
        &addr,
        1,
        &["--fault-bad-frame-at-step".into(), FAULT_STEP.to_string()],
    );
    let _w2 = start_worker(root, &addr, 2);

    let job = submit(root, &addr, &corpus, "faulty");
    // Poll quickly, so the recovery's length is seen to within a fraction of a second.
    let mut began: Option<Instant> = None;
    let mut recovered_after: Option<Duration> = None;
    let deadline = Instant::now() + Duration::from_secs(600);
    let done = loop {
        assert!(Instant::now() < deadline, "the job did not end");
        let s = status(&job, &addr, root);
        let recoveries = s["recoveries"].as_u64().unwrap_or(0);
        if recoveries >= 1 && began.is_none() {
            began = Some(Instant::now());
        }
        if let Some(t0) = began
            && recovered_after.is_none()
            && s["state"] == "running"
        {
            recovered_after = Some(t0.elapsed());
        }
        if matches!(s["state"].as_str(), Some("completed" | "failed")) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(done["step"], 14, "{done}");
    assert_eq!(done["recoveries"], 1, "{done}");
    let took = recovered_after.expect("the job never ran again after its recovery began");
    println!("recovery took {:.2} s", took.as_secs_f64());
    // The old race made the coordinator wait the whole peer timeout for the failed worker.
    assert!(
        took < Duration::from_secs_f64(PEER_TIMEOUT_SECONDS / 2.0),
        "the recovery took {took:?}: it waited for a worker that did not answer its Suspend"
    );

    let faulty = pull(root, &addr, &job, "faulty-checkpoint");
    let lines = metrics(&faulty.join("metrics.jsonl"));
    let resumes: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l["event"] == "resume").collect();
    assert_eq!(resumes.len(), 1, "{resumes:?}");
    assert_eq!(resumes[0]["source"], "STATE_SOURCE_MEMORY", "{resumes:?}");
    assert_eq!(resumes[0]["step"], FAULT_STEP, "{resumes:?}");
    assert_eq!(resumes[0]["world_size"], 3, "{resumes:?}");

    // The fault fires once per worker process: this run is uninterrupted.
    let reference = submit(root, &addr, &corpus, "reference");
    let done = poll(Duration::from_secs(600), || {
        let s = status(&reference, &addr, root);
        matches!(s["state"].as_str(), Some("completed" | "failed")).then_some(s)
    })
    .expect("the reference job did not end");
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(done["recoveries"], 0, "{done}");
    let expected = pull(root, &addr, &reference, "reference-checkpoint");
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            std::fs::read(expected.join(f)).unwrap() == std::fs::read(faulty.join(f)).unwrap(),
            "{f} differs from the uninterrupted run"
        );
    }
}
