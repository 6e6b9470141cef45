//! Jobs submitted one after another on the same workers, with recovery off: each must complete
//! without a loss. Regression test: a rank that joined the new job's ring first sent frames to
//! a peer still finishing its previous job (or fetching files); the peer answered `NotFound`
//! ("this worker is in job job-25, not job-26") and the sender failed the job at step 0. Such a
//! push is now retried within the ring timeout.
//!
//! The processes' open files (sockets included) must come back to what they were after the
//! first jobs: a connection or file kept per job would grow without bound on a long-lived
//! cluster.

mod common;

use common::*;
use std::time::Duration;

/// Open file descriptors of process `pid` (sockets, files, pipes).
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn back_to_back_jobs_all_complete() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let (coordinator, addr) = start_coordinator(root);
    let workers: Vec<_> = (0..3).map(|i| start_worker(root, &addr, i)).collect();
    let pids: Vec<u32> = std::iter::once(coordinator.child.id())
        .chain(workers.iter().map(|(w, _)| w.child.id()))
        .collect();
    let mut fds_after: Vec<Vec<usize>> = Vec::new();
    for n in 0..5 {
        // A different slice each time: every job prepares (and workers fetch) new files.
        let part: Vec<&str> = text.lines().skip(n * 400).take(1500).collect();
        let case = root.join(format!("job-{n}"));
        std::fs::create_dir_all(&case).unwrap();
        let corpus_path = case.join("kjv-part.txt");
        std::fs::write(&corpus_path, part.join("\n") + "\n").unwrap();
        let mut job = JobFile::new(corpus_path);
        job.vocab_size = 500;
        job.workers = 3;
        job.micro_batch_size = 4;
        job.max_steps = 6;
        job.warmup_steps = 1;
        job.checkpoint_every = 0;
        job.eval_every = 0;
        job.cluster_extra = "max_recoveries = 0".into();
        let path = job.write(&case);
        let out = run_keel(
            &["submit", path.to_str().unwrap(), "--coordinator", &addr],
            root,
        );
        let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let end = poll(Duration::from_secs(180), || {
            let s = status(&id, &addr, root);
            matches!(s["state"].as_str(), Some("completed" | "failed")).then_some(s)
        })
        .unwrap_or_else(|| panic!("{id} did not end: {}", status(&id, &addr, root)));
        assert_eq!(end["state"], "completed", "job {n} ({id}): {end}");
        // Give the ring's connections the time to close (the peers' idle timeouts are longer:
        // what stays open is what is kept).
        std::thread::sleep(Duration::from_secs(2));
        fds_after.push(pids.iter().map(|&p| open_fds(p)).collect());
        println!(
            "open fds after job {n} (coordinator, workers): {:?}",
            fds_after[n]
        );
    }
    // The first two jobs set up what a cluster keeps (connections to the coordinator, pools);
    // three more jobs must not add to it.
    for (p, name) in ["coordinator", "worker 0", "worker 1", "worker 2"]
        .iter()
        .enumerate()
    {
        let settled = fds_after[0][p].max(fds_after[1][p]);
        let last = fds_after[4][p];
        assert!(
            last <= settled + 2,
            "{name}: {last} open files after 5 jobs, {settled} after 2: {fds_after:?}"
        );
    }
}
