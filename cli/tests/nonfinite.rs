//! A step whose loss or gradient is not finite is skipped on every rank (no update), reported,
//! and counted; past `[train] max_skipped_steps` the job fails with a clear message. The
//! worker's hidden `--fault-nan-at-step N` makes its own loss NaN at step N (fault injection).

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// A coordinator and two workers; the second poisons its loss at 0-based step 3.
fn cluster(root: &Path) -> (Proc, String, Vec<Proc>) {
    let (coordinator, addr) = start_coordinator(root);
    let (w0, _) = start_worker(root, &addr, 0);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let w1 = Proc::spawn(
        "worker-1",
        &sibling("keel-worker"),
        &[
            "--coordinator".into(),
            addr.clone(),
            "--listen".into(),
            listen.clone(),
            "--advertise-addr".into(),
            listen,
            "--threads".into(),
            "1".into(),
            "--cache-dir".into(),
            root.join("worker-1").display().to_string(),
            "--fault-nan-at-step".into(),
            "3".into(),
        ],
        &root.join("logs"),
    );
    (coordinator, addr, vec![w0, w1])
}

fn submit(root: &Path, addr: &str, name: &str, max_skipped: u64) -> String {
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(1500).collect();
    let corpus_path = root.join("kjv-part.txt");
    std::fs::write(&corpus_path, part.join("\n") + "\n").unwrap();
    let case = root.join(name);
    std::fs::create_dir_all(&case).unwrap();
    let mut job = JobFile::new(corpus_path);
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.max_steps = 8;
    job.warmup_steps = 2;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.train_extra = format!("max_skipped_steps = {max_skipped}");
    let path = job.write(&case);
    let out = run_keel(
        &["submit", path.to_str().unwrap(), "--coordinator", addr],
        root,
    );
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_nan_step_is_skipped_and_too_many_fail_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (_coordinator, addr, _workers) = cluster(root);

    let job = submit(root, &addr, "tolerant", 10);
    let done = poll(Duration::from_secs(300), || {
        let s = status(&job, &addr, root);
        matches!(s["state"].as_str(), Some("completed" | "failed")).then_some(s)
    })
    .expect("the job did not end");
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(done["skipped_steps"], 1, "{done}");
    let out_dir = root.join("tolerant-checkpoint");
    let out = run_keel(
        &[
            "pull",
            &job,
            "--out",
            out_dir.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    assert!(out.status.success(), "{out:?}");
    let lines = metrics(&out_dir.join("metrics.jsonl"));
    let skipped: Vec<u64> = lines
        .iter()
        .filter(|l| l["skipped"] == true)
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(skipped, vec![4], "steps reported skipped (1-based)");
    // Every weight in the checkpoint is finite.
    let weights = keel_proto::weights::load_tensors_f64(out_dir.join("model.safetensors")).unwrap();
    for (name, (_, values)) in &weights {
        assert!(
            values.iter().all(|x| x.is_finite()),
            "{name} holds a non-finite value"
        );
    }

    let strict = submit(root, &addr, "strict", 0);
    let failed = poll(Duration::from_secs(300), || {
        let s = status(&strict, &addr, root);
        matches!(s["state"].as_str(), Some("completed" | "failed")).then_some(s)
    })
    .expect("the strict job did not end");
    assert_eq!(failed["state"], "failed", "{failed}");
    let error = failed["error"].as_str().unwrap();
    assert!(
        error.contains("max_skipped_steps") && error.contains("not finite"),
        "{error}"
    );
}
