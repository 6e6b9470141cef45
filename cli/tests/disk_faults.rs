//! A full disk where Keel writes, other than a checkpoint upload (`disk_full.rs`): each is a
//! clear error naming the folder, leaves no half-written file that a later start trusts, and
//! the job either goes on or fails with that reason. The full file systems are tmpfs mounts the
//! tests make (root only; skipped otherwise):
//! - the coordinator's data folder full when a job is submitted (its first record);
//! - the coordinator's data folder full while a job is prepared;
//! - the data folder full while job records (`job-state.json`) are written mid-job;
//! - a worker's cache full while it receives the job's files.

mod common;

use common::disk::{Tmpfs, fill};
use common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// `keel submit` of `job` (written to `dir/job.toml`); the job id.
fn submit(job: &JobFile, dir: &Path, addr: &str, root: &Path) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let path = job.write(dir);
    let out = run_keel(
        &["submit", path.to_str().unwrap(), "--coordinator", addr],
        root,
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Polls `keel status` of `job` until `done` accepts it (at most `limit`).
fn wait_status(
    job: &str,
    addr: &str,
    root: &Path,
    limit: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> Option<serde_json::Value> {
    poll(limit, || {
        let s = status(job, addr, root);
        done(&s).then_some(s)
    })
}

/// The job's folder and `job.toml` fit, its first record (`job-state.json`) does not: the
/// submission must be refused naming the record's file, and leave no job behind (before, it
/// was accepted, and a coordinator restart lost it: the restart knows only folders with a
/// record).
#[test]
fn a_submission_whose_record_cannot_be_written_is_refused_and_leaves_no_job() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("coordinator");
    let Some(_tmpfs) = Tmpfs::mount(&data, "16m") else {
        return;
    };
    let (coordinator, addr) = start_coordinator(root);
    let (_worker, _) = start_worker(root, &addr, 0);
    let mut job = JobFile::new(kjv_lines(root, 2000));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = 5;
    job.warmup_steps = 1;
    let case = root.join("case");
    std::fs::create_dir_all(&case).unwrap();
    let path = job.write(&case);
    // One page left: job.toml takes it, the record's temporary file finds none.
    let filler = fill(&data, 4096);
    let out = command(&keel())
        .args(["submit", path.to_str().unwrap(), "--coordinator", &addr])
        .current_dir(root)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "accepted although its record could not be written: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        coordinator.log_text()
    );
    println!("refused: {stderr}");
    assert!(
        stderr.contains("job-state.json") && stderr.contains("No space left on device"),
        "the refusal does not name the record and the full disk: {stderr}"
    );
    let jobs = data.join("jobs");
    let left: Vec<_> = std::fs::read_dir(&jobs)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "a refused job left {left:?} in {}",
        jobs.display()
    );
    let listed = run_keel(&["jobs", "--coordinator", &addr], root);
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains("job-1"),
        "the refused job is listed"
    );

    // Room again: the same job is accepted and trains to the end.
    std::fs::remove_file(&filler).unwrap();
    let id = submit(&job, &root.join("case-2"), &addr, root);
    assert!(jobs.join(&id).join("job-state.json").is_file());
    let done = wait_status(&id, &addr, root, Duration::from_secs(300), |s| {
        assert_ne!(s["state"], "failed", "{s}");
        s["state"] == "completed"
    });
    assert!(done.is_some(), "not completed:\n{}", coordinator.log_text());
}

#[test]
fn a_preparation_on_a_full_data_folder_fails_naming_it_and_leaves_nothing_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("coordinator");
    let Some(_tmpfs) = Tmpfs::mount(&data, "16m") else {
        return;
    };
    let corpus = kjv_lines(root, 20000);
    let (mut coordinator, addr) = start_coordinator(root);
    // 64 KiB left: the vocabulary and the shards of 20,000 lines need far more.
    let filler = fill(&data, 64 << 10);
    let mut job = JobFile::new(corpus);
    job.workers = 1;
    job.max_steps = 20;
    let id = submit(&job, &root.join("case"), &addr, root);
    let failed = wait_status(&id, &addr, root, Duration::from_secs(120), |s| {
        s["state"] == "failed"
    })
    .unwrap_or_else(|| panic!("the preparation did not fail:\n{}", coordinator.log_text()));
    let error = failed["error"].as_str().unwrap();
    println!("failed: {error}");
    assert!(
        error.contains(&data.display().to_string()),
        "the error does not name the data folder: {error}"
    );
    assert!(
        error.contains("No space left on device") || error.contains("no room"),
        "the error does not say the disk is full: {error}"
    );

    // Restarted, the coordinator does not take the half-prepared folder for a prepared one:
    // the job stays failed with its reason.
    drop(coordinator);
    let (restarted, addr) = start_coordinator(root);
    coordinator = restarted;
    let s = status(&id, &addr, root);
    assert_eq!(s["state"], "failed", "{s}");
    assert_eq!(s["error"], failed["error"], "{s}");

    // With room again, the same job submitted again is prepared and trains.
    std::fs::remove_file(&filler).unwrap();
    let (_worker, _) = start_worker(root, &addr, 0);
    let again = submit(&job, &root.join("case-2"), &addr, root);
    let done = wait_status(&again, &addr, root, Duration::from_secs(300), |s| {
        assert_ne!(s["state"], "failed", "{s}");
        s["state"] == "completed"
    });
    assert!(
        done.is_some(),
        "not completed with room:\n{}",
        coordinator.log_text()
    );
}

#[test]
fn job_records_written_on_a_full_disk_are_never_half_written_and_the_job_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("coordinator");
    let Some(_tmpfs) = Tmpfs::mount(&data, "40m") else {
        return;
    };
    let (coordinator, addr) = start_coordinator(root);
    let (worker, _) = start_worker(root, &addr, 0);
    let mut job = JobFile::new(kjv_lines(root, 2000));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = 400;
    job.warmup_steps = 5;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    let id = submit(&job, &root.join("case"), &addr, root);
    let record = data.join("jobs").join(&id).join("job-state.json");
    wait_status(&id, &addr, root, Duration::from_secs(300), |s| {
        assert_ne!(s["state"], "failed", "{s}");
        s["state"] == "running" && s["step"].as_u64().unwrap_or(0) >= 1
    })
    .unwrap_or_else(|| panic!("never trained:\n{}", worker.log_text()));

    // Not a byte left. Progress is saved every 2 s: for 8 s every save fails, and the record
    // on disk must read back whole every time it is looked at.
    let filler = fill(&data, 0);
    let full_from = status(&id, &addr, root)["step"].as_u64().unwrap_or(0);
    let until = Instant::now() + Duration::from_secs(8);
    let mut reads = 0;
    while Instant::now() < until {
        let text = std::fs::read_to_string(&record).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not whole: {e}\n{text}", record.display()));
        assert_eq!(parsed["id"], id.as_str());
        reads += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = status(&id, &addr, root);
    assert_eq!(s["state"], "running", "the job must go on: {s}");
    let step_full = s["step"].as_u64().unwrap_or(0);
    let log = coordinator.log_text();
    assert!(
        log.contains("cannot save the job's state") && log.contains("job-state.json"),
        "no error naming the record's file in the log:\n{log}"
    );
    println!(
        "disk full from step {full_from} to {step_full}: {reads} reads of the record, all whole"
    );
    assert!(step_full > full_from, "training stopped on the full disk");

    // Room again: the job completes (its final checkpoint stored) and its record says so.
    std::fs::remove_file(&filler).unwrap();
    let done = wait_status(&id, &addr, root, Duration::from_secs(300), |s| {
        assert_ne!(s["state"], "failed", "{s}");
        s["state"] == "completed"
    });
    assert!(done.is_some(), "not completed:\n{}", coordinator.log_text());
    let saved = poll(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(&record).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        (v["state"] == "JOB_STATE_COMPLETED").then_some(v)
    });
    assert!(saved.is_some(), "the record never said completed");
}

#[test]
fn a_worker_whose_cache_is_full_fails_the_job_naming_its_folder_and_the_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // The worker's cache (`--cache-dir root/worker-0`): 64 KiB, less than the job's shard.
    let cache = root.join("worker-0");
    let Some(_tmpfs) = Tmpfs::mount(&cache, "64k") else {
        return;
    };
    let (coordinator, addr) = start_coordinator(root);
    let (worker, _) = start_worker(root, &addr, 0);
    let mut job = JobFile::new(kjv_lines(root, 4000));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = 20;
    job.cluster_extra = "max_recoveries = 0".into();
    let id = submit(&job, &root.join("case"), &addr, root);
    let failed = wait_status(&id, &addr, root, Duration::from_secs(300), |s| {
        assert_ne!(s["state"], "completed", "{s}");
        s["state"] == "failed"
    })
    .unwrap_or_else(|| {
        panic!(
            "the job did not fail; worker log:\n{}\ncoordinator log:\n{}",
            worker.log_text(),
            coordinator.log_text()
        )
    });
    let error = failed["error"].as_str().unwrap();
    println!("failed: {error}");
    let files = cache.join("files");
    assert!(
        error.contains(&files.display().to_string()) && error.contains("has no room for"),
        "{error}"
    );
    assert!(
        error.contains("needs") && error.contains("free"),
        "the error does not give the bytes: {error}"
    );
    // Nothing half-received is left to be mistaken for a cached file.
    let left: Vec<String> = std::fs::read_dir(&files)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    for name in &left {
        let path = files.join(name);
        let bytes = std::fs::read(&path).unwrap();
        let sum = sha256_hex(&bytes);
        assert_eq!(
            &sum,
            name,
            "{} is not a whole cached file (its name is not its checksum)",
            path.display()
        );
    }
}

/// SHA-256 of `bytes`, lower-case hex (the cache's file names).
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
