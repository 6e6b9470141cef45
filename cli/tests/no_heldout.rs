//! A job without a held-out set (`data.heldout_fraction = 0`) evaluates nothing: its
//! `metrics.jsonl` has step lines and no eval lines (it had evals of 0 masked tokens, reported
//! as loss 0 and accuracy 0).

mod common;

use common::*;

#[test]
fn a_job_without_a_heldout_set_writes_no_eval_lines() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 1500);
    let mut job = JobFile::new(corpus);
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.max_steps = 6;
    job.warmup_steps = 2;
    job.eval_every = 2;
    job.checkpoint_every = 0;
    let path = job.write(dir.path());
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("heldout_fraction = 0.01"), "{text}");
    std::fs::write(
        &path,
        text.replace("heldout_fraction = 0.01", "heldout_fraction = 0"),
    )
    .unwrap();
    let out = dir.path().join("out");
    let result = keel_local(&path, 2, &out, &dir.path().join("work"));
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let lines = metrics(&out.join("metrics.jsonl"));
    let steps = lines.iter().filter(|l| l.get("loss").is_some()).count();
    assert_eq!(steps, 6, "one line per step");
    let evals: Vec<_> = lines
        .iter()
        .filter(|l| l.get("eval_loss").is_some())
        .collect();
    assert!(
        evals.is_empty(),
        "eval lines without a held-out set: {evals:?}"
    );
}
