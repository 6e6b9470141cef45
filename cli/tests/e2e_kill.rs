//! A worker killed mid-job: the job fails within the peer timeout with an error naming the
//! dead worker and the step; nothing hangs. A worker stopped by SIGTERM says so itself.

mod common;

use common::*;
use std::time::Duration;

#[test]
fn killing_a_worker_fails_the_job_naming_the_worker_and_step() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(3000).collect();
    let corpus_path = root.join("kjv-part.txt");
    std::fs::write(&corpus_path, part.join("\n") + "\n").unwrap();

    let (_coordinator, addr) = start_coordinator(root);
    let mut workers = vec![start_worker(root, &addr, 0), start_worker(root, &addr, 1)];
    let mut job = JobFile::new(corpus_path);
    job.vocab_size = 500;
    job.max_steps = 1_000_000;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.peer_timeout_seconds = 5.0;
    let job_path = job.write(root);
    let out = run_keel(
        &["submit", job_path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let job_id = String::from_utf8(out.stdout).unwrap().trim().to_string();

    // Wait until training runs (data preparation included).
    let running = poll(Duration::from_secs(180), || {
        let s = status(&job_id, &addr, root);
        (s["step"].as_u64()? >= 3).then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the job never reached step 3: {}",
            status(&job_id, &addr, root)
        )
    });
    // workers[r] = "w-N (host:port)" of rank r: kill the process behind rank 1.
    let rank1 = running["workers"][1].as_str().unwrap().to_string();
    let victim = workers
        .iter()
        .position(|(_, a)| rank1.contains(a.as_str()))
        .expect("rank 1 is one of our workers");
    let (mut proc, victim_addr) = workers.remove(victim);
    proc.child.kill().unwrap();
    proc.child.wait().unwrap();

    let failed = poll(Duration::from_secs(60), || {
        let s = status(&job_id, &addr, root);
        (s["state"] == "failed").then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the job did not fail after its worker was killed: {}",
            status(&job_id, &addr, root)
        )
    });
    let error = failed["error"].as_str().unwrap();
    println!("error: {error}");
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
    let (survivor, _) = &mut workers[0];
    assert!(
        survivor.child.try_wait().unwrap().is_none(),
        "the surviving worker exited:\n{}",
        survivor.log_text()
    );
}

#[test]
fn sigterm_makes_a_worker_leave_its_job_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(3000).collect();
    let corpus_path = root.join("kjv-part.txt");
    std::fs::write(&corpus_path, part.join("\n") + "\n").unwrap();

    let (_coordinator, addr) = start_coordinator(root);
    let mut workers = vec![start_worker(root, &addr, 0), start_worker(root, &addr, 1)];
    let mut job = JobFile::new(corpus_path);
    job.vocab_size = 500;
    job.max_steps = 1_000_000;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    // Long, so that a failure within a few seconds can only come from the worker's own report.
    job.peer_timeout_seconds = 120.0;
    let job_path = job.write(root);
    let out = run_keel(
        &["submit", job_path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let job_id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let running = poll(Duration::from_secs(180), || {
        let s = status(&job_id, &addr, root);
        (s["step"].as_u64()? >= 3).then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the job never reached step 3: {}",
            status(&job_id, &addr, root)
        )
    });
    let rank1 = running["workers"][1].as_str().unwrap().to_string();
    let victim = workers
        .iter()
        .position(|(_, a)| rank1.contains(a.as_str()))
        .expect("rank 1 is one of our workers");
    let (mut proc, victim_addr) = workers.remove(victim);
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
    let failed = poll(Duration::from_secs(30), || {
        let s = status(&job_id, &addr, root);
        (s["state"] == "failed").then_some(s)
    })
    .unwrap_or_else(|| panic!("the job did not fail: {}", status(&job_id, &addr, root)));
    let error = failed["error"].as_str().unwrap();
    println!("error: {error}");
    assert!(error.contains("shut down by a signal"), "{error}");
    assert!(error.contains(&victim_addr), "{error}");
    assert!(error.contains("step"), "{error}");
}
