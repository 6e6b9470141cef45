//! A full data folder is an event, not a hidden warning, and costs no model. The
//! coordinator's data folder is a 40 MB tmpfs the test mounts (root only; skipped otherwise)
//! and fills while a job runs:
//! - the checkpoint that cannot be stored shows in `keel status`, `keel jobs`, `keel watch`,
//!   `metrics.jsonl` and Prometheus within one checkpoint interval, naming the folder and the
//!   space needed;
//! - the final checkpoint waits for room (the job does not fail at max_steps/max_steps);
//!   once room is made the job completes, and its final checkpoint is pulled and loads;
//! - no half-written upload (`checkpoints/.tmp-step-*`) is left after a failed one, and any
//!   left by a coordinator that stopped mid-upload is removed when it starts again.

mod common;

use common::disk::{Tmpfs, fill};
use common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// `keel status` of `job`, whatever the job's state.
fn job_status(job: &str, addr: &str, root: &Path) -> serde_json::Value {
    status(job, addr, root)
}

/// Names in `dir` that start with `.tmp-step-`.
fn partial_uploads(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp-step-"))
                .collect()
        })
        .unwrap_or_default()
}

/// The step a checkpoint problem names: `the checkpoint of step N ...`.
fn failed_step(problem: &str) -> u64 {
    let rest = problem
        .split("checkpoint of step ")
        .nth(1)
        .unwrap_or_else(|| panic!("no step in {problem:?}"));
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in {problem:?}"))
}

#[test]
fn a_full_data_folder_is_reported_and_the_final_checkpoint_waits_for_room() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("coordinator");
    let Some(_tmpfs) = Tmpfs::mount(&data, "40m") else {
        return;
    };
    let http_port = free_port();
    let (coordinator, addr) = start_coordinator_with(
        root,
        &["--metrics-listen".into(), format!("127.0.0.1:{http_port}")],
    );
    let (worker, _) = start_worker(root, &addr, 0);
    let every = 50;
    let max_steps = 300;
    let mut job = JobFile::new(kjv_lines(root, 2000));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = max_steps;
    job.warmup_steps = 5;
    job.checkpoint_every = every;
    job.eval_every = 0;
    let case = root.join("case");
    std::fs::create_dir_all(&case).unwrap();
    let path = job.write(&case);
    let out = run_keel(
        &["submit", path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    // `keel watch` follows the job from the start (plain lines: not a terminal).
    let watch_log = root.join("logs/watch.log");
    let mut watch = command(&keel())
        .args(["watch", &id, "--coordinator", &addr])
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&watch_log).unwrap())
        .spawn()
        .unwrap();

    // Mid-job: once it trains (its data prepared), the data folder fills up.
    let running = poll(Duration::from_secs(300), || {
        let s = job_status(&id, &addr, root);
        assert_ne!(s["state"], "failed", "{s}");
        (s["state"] == "running" && s["step"].as_u64().unwrap_or(0) >= 1).then_some(s)
    });
    let running = running.unwrap_or_else(|| panic!("never trained:\n{}", worker.log_text()));
    let filler = fill(&data, 2 << 20);
    let filled_at = running["step"].as_u64().unwrap_or(0);
    println!("filled the data folder at step {filled_at}");

    // Reported within one checkpoint interval of the checkpoint that failed.
    let seen = poll(Duration::from_secs(300), || {
        let s = job_status(&id, &addr, root);
        assert_ne!(s["state"], "failed", "{s}");
        s.get("checkpoint_problem").is_some().then_some(s)
    });
    let seen = seen.unwrap_or_else(|| {
        panic!(
            "no checkpoint problem in the status; coordinator log:\n{}",
            coordinator.log_text()
        )
    });
    let problem = seen["checkpoint_problem"].as_str().unwrap().to_string();
    let step_seen = seen["step"].as_u64().unwrap();
    let failed = failed_step(&problem);
    println!("status at step {step_seen}: {problem}");
    assert!(
        step_seen < failed + every,
        "the checkpoint of step {failed} was reported at step {step_seen}"
    );
    let checkpoints_dir = data.join("jobs").join(&id).join("checkpoints");
    assert!(
        problem.contains(&checkpoints_dir.display().to_string()),
        "{problem}"
    );
    assert!(
        problem.contains("needs about") && problem.contains("is free"),
        "{problem}"
    );
    assert!(seen["checkpoint_failures"].as_u64().unwrap() >= 1, "{seen}");
    let jobs = String::from_utf8(run_keel(&["jobs", "--coordinator", &addr], root).stdout).unwrap();
    assert!(jobs.contains("checkpoint not stored"), "{jobs}");
    let lines = metrics(&data.join("jobs").join(&id).join("metrics.jsonl"));
    let event = lines
        .iter()
        .find(|l| l["event"] == "checkpoint_failed")
        .unwrap_or_else(|| panic!("no checkpoint_failed line in metrics.jsonl"));
    assert!(
        event["needed_bytes"].as_u64().unwrap() > event["free_bytes"].as_u64().unwrap(),
        "{event}"
    );
    assert!(
        event["path"].as_str().unwrap().ends_with("checkpoints"),
        "{event}"
    );
    let (code, page) = http_get(http_port, "/metrics", None);
    assert_eq!(code, 200, "{page}");
    let counter = page
        .lines()
        .find(|l| {
            l.starts_with(&format!(
                "keel_job_checkpoint_upload_failures_total{{job_id=\"{id}\"}}"
            ))
        })
        .unwrap_or_else(|| panic!("no failure counter in\n{page}"));
    let count: f64 = counter.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(count >= 1.0, "{counter}");

    // The final checkpoint cannot be stored: the job waits at max_steps, and says so.
    let waiting = poll(Duration::from_secs(300), || {
        let s = job_status(&id, &addr, root);
        assert_ne!(s["state"], "failed", "{s}");
        let problem = s["checkpoint_problem"].as_str().unwrap_or("");
        (s["step"] == max_steps && problem.contains("the job waits")).then_some(s)
    });
    let waiting = waiting.unwrap_or_else(|| panic!("never waited:\n{}", worker.log_text()));
    println!("waiting: {}", waiting["checkpoint_problem"]);
    let hold = Instant::now();
    while hold.elapsed() < Duration::from_secs(10) {
        let s = job_status(&id, &addr, root);
        assert_eq!(s["state"], "running", "it must wait, not end: {s}");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        worker
            .log_text()
            .contains("the final checkpoint is not stored"),
        "{}",
        worker.log_text()
    );
    assert_eq!(partial_uploads(&checkpoints_dir), Vec::<String>::new());

    // Room again: the job completes with its final checkpoint, which is pulled and loads.
    std::fs::remove_file(&filler).unwrap();
    let freed = Instant::now();
    let done = poll(Duration::from_secs(120), || {
        let s = job_status(&id, &addr, root);
        assert_ne!(s["state"], "failed", "{s}");
        (s["state"] == "completed").then_some(s)
    });
    let done = done.unwrap_or_else(|| panic!("not completed after room was made"));
    println!(
        "completed {:.1} s after room was made: {done}",
        freed.elapsed().as_secs_f64()
    );
    assert!(
        done["checkpoints"]
            .as_array()
            .unwrap()
            .contains(&max_steps.into()),
        "{done}"
    );
    let pulled = root.join("pulled");
    run_keel(
        &[
            "pull",
            &id,
            "--out",
            pulled.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pulled.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], max_steps);
    run_keel(
        &[
            "fill-mask",
            "--checkpoint",
            pulled.to_str().unwrap(),
            "in the [MASK]",
        ],
        root,
    );
    let watched = poll(Duration::from_secs(30), || watch.try_wait().unwrap());
    if watched.is_none() {
        let _ = watch.kill();
        let _ = watch.wait();
    }
    let watched = std::fs::read_to_string(&watch_log).unwrap();
    assert!(watched.contains("checkpoint not stored"), "{watched}");
}

#[test]
fn half_written_uploads_are_removed_when_the_coordinator_starts() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let checkpoints = root.join("coordinator/jobs/job-1/checkpoints");
    let partial = checkpoints.join(".tmp-step-40-Xy12ab");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("model.safetensors"), vec![0u8; 1 << 20]).unwrap();
    let stored = checkpoints.join("step-20");
    std::fs::create_dir_all(&stored).unwrap();
    std::fs::write(stored.join("model.safetensors"), b"kept").unwrap();
    let (coordinator, _addr) = start_coordinator(root);
    let removed = poll(Duration::from_secs(10), || {
        (!partial.exists()).then_some(())
    });
    assert!(
        removed.is_some(),
        "{} is still there; log:\n{}",
        partial.display(),
        coordinator.log_text()
    );
    assert!(stored.join("model.safetensors").is_file());
    // The removal's log line may reach the file a moment after the folder is gone.
    let logged = poll(Duration::from_secs(10), || {
        coordinator
            .log_text()
            .contains("removed a half-written checkpoint upload")
            .then_some(())
    });
    assert!(logged.is_some(), "{}", coordinator.log_text());
}
