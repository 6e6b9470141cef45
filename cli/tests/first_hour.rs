//! What a new user meets in the first hour, with real processes: errors that read as
//! sentences (no gRPC wording, no backtrace even with RUST_BACKTRACE=1), a job refused at
//! submit time when its corpus is not there, a failed job's reason in `keel jobs`, and `keel
//! watch` writing progress to stderr and its outcome to stdout.

mod common;

use common::*;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

/// Runs `exe ARGS` with `RUST_BACKTRACE=1` and returns its output (success or not).
fn run_with_backtrace(exe: &Path, args: &[&str], cwd: &Path) -> Output {
    command(exe)
        .args(args)
        .current_dir(cwd)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Asserts that `out` failed with exactly one `Error: ` line on stderr holding `expected`,
/// none of gRPC's wording, and no backtrace; returns that line.
fn one_line_error(out: &Output, expected: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(!stderr.contains("backtrace"), "a backtrace:\n{stderr}");
    assert!(!stderr.contains("code: '"), "gRPC wording:\n{stderr}");
    assert!(!stderr.contains("Caused by"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected:\n{stderr}");
    assert!(lines[0].starts_with("Error: "), "{stderr}");
    assert!(
        lines[0].contains(expected),
        "{expected:?} not in:\n{stderr}"
    );
    lines[0].to_string()
}

#[test]
fn errors_read_as_sentences_and_bad_paths_are_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    let keel = keel();

    for verb in ["status", "cancel"] {
        let out = run_with_backtrace(&keel, &[verb, "job-99", "--coordinator", &addr], root);
        let line = one_line_error(&out, "no job job-99");
        assert_eq!(line, "Error: no job job-99", "{verb}");
    }

    // A job file that is not there: named once, its OS error once.
    let out = run_with_backtrace(
        &keel,
        &["submit", "nojob.toml", "--coordinator", &addr],
        root,
    );
    let line = one_line_error(&out, "nojob.toml");
    assert_eq!(line.matches("nojob.toml").count(), 1, "{line}");
    assert_eq!(line.matches("os error 2").count(), 1, "{line}");

    // A corpus that is not there is refused now, naming the key and the path.
    let missing = root.join("no-such-corpus.txt");
    let job = JobFile::new(missing.clone()).write(root);
    let out = run_with_backtrace(
        &keel,
        &["submit", job.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let line = one_line_error(&out, "data.corpus");
    assert!(line.contains(&missing.display().to_string()), "{line}");
    assert!(line.contains("no such file"), "{line}");
    let jobs = run_keel(&["jobs", "--coordinator", &addr], root);
    let listed = String::from_utf8_lossy(&jobs.stdout).lines().count();
    assert_eq!(listed, 1, "only the header: the job was not taken");

    // A corpus that exists but holds no text passes the submit check and fails at preparation:
    // `keel jobs` says why.
    let empty = root.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let job = JobFile::new(empty).write(root);
    let out = run_keel(
        &["submit", job.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let row = poll(Duration::from_secs(60), || {
        let out = run_keel(&["jobs", "--coordinator", &addr], root);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.lines()
            .find(|l| l.starts_with(&id) && l.contains("failed"))
            .map(str::to_string)
    })
    .unwrap_or_else(|| panic!("{id} did not fail: {}", status(&id, &addr, root)));
    let error = status(&id, &addr, root)["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!error.is_empty());
    assert!(
        row.contains(&format!("reason: {}", error.lines().next().unwrap())),
        "{row}"
    );

    // A worker's port answers gRPC, but not the coordinator's calls.
    let (worker, worker_addr) = start_worker(root, &addr, 0);
    wait_listening(&worker_addr, &worker);
    let out = run_with_backtrace(&keel, &["jobs", "--coordinator", &worker_addr], root);
    let line = one_line_error(&out, "not a Keel coordinator");
    assert!(
        line.contains(&worker_addr) && line.contains("worker"),
        "{line}"
    );
    assert!(!line.contains("not implemented"), "{line}");

    // The coordinator logs the worker's registration without empty fields.
    let registered = poll(Duration::from_secs(30), || {
        coordinator
            .log_text()
            .lines()
            .find(|l| l.contains("worker registered"))
            .map(str::to_string)
    })
    .expect("the worker registered");
    assert!(!registered.contains("holds="), "{registered}");
    assert!(!registered.contains("host= "), "{registered}");
    assert!(!registered.trim_end().ends_with('='), "{registered}");

    // The servers' own start-up errors: one line, no backtrace.
    let out = run_with_backtrace(
        &sibling("keel-coordinator"),
        &[
            "--listen",
            &addr,
            "--data-dir",
            "d",
            "--token-file",
            "no.token",
        ],
        root,
    );
    one_line_error(&out, "no.token");
    let out = run_with_backtrace(&sibling("keel-worker"), &["--coordinator", &addr], root);
    one_line_error(&out, "--advertise-addr");
}

#[test]
fn watch_writes_progress_to_stderr_and_the_outcome_to_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (_coordinator, addr) = start_coordinator(root);
    let _worker = start_worker(root, &addr, 0);
    let mut job = JobFile::new(kjv_lines(root, 1500));
    job.vocab_size = 500;
    job.workers = 1;
    job.micro_batch_size = 4;
    job.max_steps = 12;
    job.warmup_steps = 1;
    job.checkpoint_every = 4;
    job.eval_every = 0;
    let path = job.write(root);
    let out = run_keel(
        &["submit", path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    // Both streams piped: stderr is not a terminal, so progress comes as plain lines.
    let out = run_keel(&["watch", &id, "--coordinator", &addr], root);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        lines[0].starts_with(&format!("{id}: completed at step 12/12, loss ")),
        "{stdout}"
    );
    assert!(!stderr.contains("completed at step"), "{stderr}");
    // The first running line has no estimate yet (one step seen), and no line before the job
    // runs shows an ETA at all.
    let first_running = stderr
        .lines()
        .find(|l| l.contains("ETA"))
        .unwrap_or_else(|| panic!("no progress line with an ETA:\n{stderr}"));
    assert!(first_running.ends_with("ETA --"), "{stderr}");
    for line in stderr.lines().filter(|l| !l.contains("ETA")) {
        assert!(!line.contains("step 0/0"), "{stderr}");
    }

    // A step without a checkpoint: the error lists the steps that have one.
    let pulled = root.join("pulled");
    let out = run_with_backtrace(
        &keel(),
        &[
            "pull",
            &id,
            "--step",
            "3",
            "--out",
            pulled.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    let line = one_line_error(&out, "no checkpoint at step 3");
    assert!(line.contains("steps 4, 8, 12"), "{line}");
    assert!(!pulled.exists());
}

/// `keel local` whose coordinator cannot start (its dashboard address is taken) says why and
/// keeps the logs it names; it used to remove its temporary folder on such an early failure,
/// so the log it pointed to was gone.
#[test]
fn keel_local_keeps_the_logs_it_names_when_the_cluster_cannot_start() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let job = JobFile::new(kjv_lines(dir.path(), 200)).write(dir.path());
    let out = command(&keel())
        .args(["local", "--quiet", "--dashboard", &addr])
        .arg(&job)
        .arg("--out")
        .arg(dir.path().join("out"))
        .env_remove("KEEL_LOCAL_DIR")
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("Address already in use"), "{stderr}");
    let kept = stderr
        .lines()
        .find_map(|l| l.strip_prefix("keel local: logs kept in "))
        .unwrap_or_else(|| panic!("no kept logs named:\n{stderr}"));
    let log = Path::new(kept.trim()).join("coordinator.log");
    let text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    assert!(text.contains("--metrics-listen"), "{text}");
    std::fs::remove_dir_all(Path::new(kept.trim()).parent().unwrap()).unwrap();
    drop(taken);
}
