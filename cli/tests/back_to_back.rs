//! Jobs submitted one after another on the same workers, with recovery off: each must complete
//! without a loss. Regression test: a rank that joined the new job's ring first sent frames to
//! a peer still finishing its previous job (or fetching files); the peer answered `NotFound`
//! ("this worker is in job job-25, not job-26") and the sender failed the job at step 0. Such a
//! push is now retried within the ring timeout.

mod common;

use common::*;
use std::time::Duration;

#[test]
fn back_to_back_jobs_all_complete() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let (_coordinator, addr) = start_coordinator(root);
    let _workers: Vec<_> = (0..3).map(|i| start_worker(root, &addr, i)).collect();
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
    }
}
