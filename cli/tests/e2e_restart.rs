//! A coordinator restart keeps its jobs: each job's `job-state.json` brings it back. A finished
//! job is listed, described and pullable as before (after `kill -9`); a running job comes back
//! recovering with its generation, step and checkpoints (after SIGTERM, which saves first); a
//! corrupt record is skipped with an error naming it.

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// A coordinator on a free port over `root/coordinator` (the same data dir every time), its
/// log named after `name`.
fn coordinator(root: &Path, name: &str) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let p = Proc::spawn(
        name,
        &sibling("keel-coordinator"),
        &[
            "--listen".into(),
            addr.clone(),
            "--data-dir".into(),
            root.join("coordinator").display().to_string(),
        ],
        &logs,
    );
    wait_serving(&addr, root);
    (p, addr)
}

/// Waits (bounded) until `keel jobs` answers.
fn wait_serving(addr: &str, root: &Path) {
    let up = poll(Duration::from_secs(30), || {
        let out = command(&keel())
            .args(["jobs", "--coordinator", addr])
            .current_dir(root)
            .output()
            .ok()?;
        out.status.success().then_some(())
    });
    assert!(up.is_some(), "the coordinator at {addr} never answered");
}

/// `keel jobs` output.
fn jobs(addr: &str, root: &Path) -> String {
    String::from_utf8(run_keel(&["jobs", "--coordinator", addr], root).stdout).unwrap()
}

/// Sends SIGTERM and waits (bounded) for a clean exit.
fn terminate(p: &mut Proc) {
    let pid = p.child.id().to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(term.success());
    let exited = poll(Duration::from_secs(20), || p.child.try_wait().unwrap());
    let code = exited.unwrap_or_else(|| panic!("SIGTERM ignored:\n{}", p.log_text()));
    assert!(code.success(), "exit {code:?}:\n{}", p.log_text());
}

/// Every file of a folder, by name.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The coordinator's "job restored" log line for `job_id` (it names the restored state,
/// generation, step and checkpoints).
fn restored_line(log: &str, job_id: &str) -> String {
    log.lines()
        .find(|l| l.contains("job restored") && l.contains(&format!("job={job_id} ")))
        .unwrap_or_else(|| panic!("no 'job restored' line for {job_id}:\n{log}"))
        .to_string()
}

/// The first 3000 lines of the KJV in `root`.
fn small_corpus(root: &Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(3000).collect();
    let path = root.join("kjv-part.txt");
    std::fs::write(&path, part.join("\n") + "\n").unwrap();
    path
}

fn submit(job: &Path, addr: &str, root: &Path) -> String {
    let out = run_keel(
        &["submit", job.to_str().unwrap(), "--coordinator", addr],
        root,
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_completed_job_survives_kill_9_of_the_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut coord, addr) = coordinator(root, "coordinator-1");
    let (_worker, _) = start_worker(root, &addr, 0);
    let mut job = JobFile::new(small_corpus(root));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = 12;
    job.warmup_steps = 2;
    job.checkpoint_every = 5;
    job.eval_every = 0;
    let job_id = submit(&job.write(root), &addr, root);

    let done = poll(Duration::from_secs(240), || {
        let s = status(&job_id, &addr, root);
        matches!(s["state"].as_str(), Some("completed" | "failed")).then_some(s)
    })
    .unwrap_or_else(|| panic!("the job did not end: {}", status(&job_id, &addr, root)));
    assert_eq!(done["state"], "completed", "{done}");
    // `train.precision = "auto"`: decided once, from what the worker reported (bf16 where
    // oneDNN's bf16 is faster than fp32 on the worker, else fp32), shown by `keel status`, and kept across the restart (below).
    let precision = done["precision"].as_str().unwrap_or_default().to_string();
    assert!(precision == "fp32" || precision == "bf16", "{done}");
    let before_out = root.join("pull-before");
    run_keel(
        &[
            "pull",
            &job_id,
            "--out",
            before_out.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(before_out.join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["precision"], precision.as_str(), "trainer_state.json");

    coord.child.kill().unwrap();
    coord.child.wait().unwrap();
    let (coord2, addr2) = coordinator(root, "coordinator-2");
    assert_ne!(addr, addr2);

    let listed = jobs(&addr2, root);
    println!("{listed}");
    let line = listed
        .lines()
        .find(|l| l.starts_with(&job_id))
        .unwrap_or_else(|| panic!("{job_id} is not listed after the restart:\n{listed}"));
    assert!(line.contains("completed"), "{line}");
    let after = status(&job_id, &addr2, root);
    println!("before: {done}\nafter:  {after}");
    for key in [
        "state",
        "generation",
        "step",
        "max_steps",
        "checkpoints",
        "workers",
        "loss",
        "error",
        "precision",
    ] {
        assert_eq!(after[key], done[key], "{key} changed across the restart");
    }
    assert_eq!(after["checkpoints"], serde_json::json!([5, 10, 12]));

    let after_out = root.join("pull-after");
    run_keel(
        &[
            "pull",
            &job_id,
            "--out",
            after_out.to_str().unwrap(),
            "--coordinator",
            &addr2,
        ],
        root,
    );
    let (a, b) = (files(&before_out), files(&after_out));
    let names: Vec<&str> = a.iter().map(|(n, _)| n.as_str()).collect();
    println!("pulled twice, byte-identical: {names:?}");
    assert!(names.contains(&"model.safetensors"), "{names:?}");
    assert_eq!(a, b, "the checkpoint pulled after the restart differs");

    // New jobs get new numbers.
    let next = submit(&job.write(root), &addr2, root);
    assert_ne!(next, job_id);
    assert!(
        coord2.log_text().contains("job restored"),
        "{}",
        coord2.log_text()
    );
}

#[test]
fn sigterm_saves_a_running_job_which_comes_back_recovering() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut coord, addr) = coordinator(root, "coordinator-1");
    let workers = vec![start_worker(root, &addr, 0), start_worker(root, &addr, 1)];
    let mut job = JobFile::new(small_corpus(root));
    job.vocab_size = 500;
    job.max_steps = 1_000_000;
    job.checkpoint_every = 2;
    job.eval_every = 0;
    let job_id = submit(&job.write(root), &addr, root);
    let running = poll(Duration::from_secs(240), || {
        let s = status(&job_id, &addr, root);
        (!s["checkpoints"].as_array()?.is_empty() && s["step"].as_u64()? >= 3).then_some(s)
    })
    .unwrap_or_else(|| panic!("no step 3: {}", status(&job_id, &addr, root)));

    terminate(&mut coord);
    let log = coord.log_text();
    assert!(log.contains("job state saved before exit"), "{log}");
    drop(workers);
    let saved: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            root.join("coordinator/jobs")
                .join(&job_id)
                .join("job-state.json"),
        )
        .unwrap(),
    )
    .unwrap();
    println!("saved: {saved}");
    assert_eq!(saved["state"], "JOB_STATE_RUNNING");
    // Progress held back by the 2 s interval was written at exit: the saved step is the last
    // one the coordinator logged ("step N | loss ...").
    let last_logged = log
        .lines()
        .filter_map(|l| {
            l.split(" step ")
                .nth(1)?
                .split(" |")
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or_else(|| panic!("no step line in the log:\n{log}"));
    assert_eq!(saved["step"].as_u64(), Some(last_logged), "{log}");

    let (coord2, addr2) = coordinator(root, "coordinator-2");
    let after = status(&job_id, &addr2, root);
    println!("before: {running}\nafter:  {after}");
    assert_eq!(after["state"], "recovering");
    assert_eq!(saved["generation"], running["generation"]);
    // It came back with the saved generation; recovery then starts the next one.
    let restored = restored_line(&coord2.log_text(), &job_id);
    let generation = saved["generation"].as_u64().unwrap();
    assert!(
        restored.contains(&format!("generation={generation} step={}", saved["step"])),
        "{restored}"
    );
    let now = after["generation"].as_u64().unwrap();
    assert!(now == generation || now == generation + 1, "{after}");
    assert_eq!(after["step"], saved["step"]);
    assert!(after["step"].as_u64().unwrap() >= running["step"].as_u64().unwrap());
    assert_eq!(after["checkpoints"], saved["checkpoints"]);
    assert_eq!(after["workers"], saved["worker_names"]);
    assert_eq!(after["workers"], running["workers"]);
    assert_eq!(after["max_steps"], running["max_steps"]);
    // The checkpoints it lists are on disk.
    for step in after["checkpoints"].as_array().unwrap() {
        let d = root
            .join("coordinator/jobs")
            .join(&job_id)
            .join(format!("checkpoints/step-{step}"));
        assert!(d.is_dir(), "{} missing", d.display());
    }
    let listed = jobs(&addr2, root);
    println!("{listed}");
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with(&job_id) && l.contains("recovering")),
        "{listed}"
    );
}

#[test]
fn a_corrupt_job_state_is_skipped_with_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut coord, addr) = coordinator(root, "coordinator-1");
    // A job that fails at preparation (a corpus with no text; a path that is not there is
    // refused at submit): finished without any worker.
    let empty = root.join("empty-corpus.txt");
    std::fs::write(&empty, "").unwrap();
    let job = JobFile::new(empty);
    let job_id = submit(&job.write(root), &addr, root);
    let failed = poll(Duration::from_secs(60), || {
        let s = status(&job_id, &addr, root);
        (s["state"] == "failed").then_some(s)
    })
    .unwrap_or_else(|| panic!("did not fail: {}", status(&job_id, &addr, root)));
    terminate(&mut coord);

    let jobs_dir = root.join("coordinator/jobs");
    let corrupt = jobs_dir.join("job-7");
    std::fs::create_dir_all(&corrupt).unwrap();
    std::fs::write(
        corrupt.join("job-state.json"),
        b"{\"version\": 1, \"id\": \"jo",
    )
    .unwrap();

    let (coord2, addr2) = coordinator(root, "coordinator-2");
    let log = coord2.log_text();
    let error_line = log
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("job-7/job-state.json"))
        .unwrap_or_else(|| panic!("no error names the corrupt file:\n{log}"));
    println!("{error_line}");
    let after = status(&job_id, &addr2, root);
    assert_eq!(after["state"], "failed");
    assert_eq!(after["error"], failed["error"]);
    let listed = jobs(&addr2, root);
    println!("{listed}");
    assert!(!listed.contains("job-7"), "{listed}");
    // Still serving, and ids stay unique past the corrupt folder.
    let next = submit(&job.write(root), &addr2, root);
    assert_eq!(next, "job-8");
}

#[test]
fn a_job_waiting_for_workers_comes_back_after_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut coord, addr) = coordinator(root, "coordinator-1");
    // Prepared, but no worker ever comes.
    let mut job = JobFile::new(small_corpus(root));
    job.vocab_size = 500;
    let job_id = submit(&job.write(root), &addr, root);
    let waiting = poll(Duration::from_secs(120), || {
        let s = status(&job_id, &addr, root);
        (s["state"] == "waiting-for-workers").then_some(s)
    })
    .unwrap_or_else(|| panic!("never waited: {}", status(&job_id, &addr, root)));
    terminate(&mut coord);
    assert!(coord.log_text().contains("job state saved before exit"));

    let (coord2, addr2) = coordinator(root, "coordinator-2");
    // Restored as recovering, then, having never had a ring, back to waiting for workers.
    let after = poll(Duration::from_secs(10), || {
        let s = status(&job_id, &addr2, root);
        (s["state"] == "waiting-for-workers").then_some(s)
    })
    .unwrap_or_else(|| panic!("not waiting again: {}", status(&job_id, &addr2, root)));
    println!("before: {waiting}\nafter:  {after}");
    let restored = restored_line(&coord2.log_text(), &job_id);
    assert!(restored.contains("generation=0 step=0"), "{restored}");
    for key in ["step", "max_steps", "checkpoints", "workers"] {
        assert_eq!(after[key], waiting[key], "{key} changed across the restart");
    }
    // Its prepared data was found again, not redone.
    let log = coord2.log_text();
    assert!(!log.contains("prepared data is incomplete"), "{log}");
    assert!(!log.contains("cannot be reused"), "{log}");
}
