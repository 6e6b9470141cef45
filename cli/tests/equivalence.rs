//! Data parallelism changes nothing but speed: after 10 steps, 1, 2 and 3 workers with the
//! same global batch, and 2 workers reaching it with 2 micro-batches each, give the same
//! weights (within 1e-5 relative, the sums are only reordered), and the same job run twice on the same world size gives bit-identical
//! checkpoints.
//!
//! The weight comparison runs in fp32 (`train.precision = "fp32"`): its claim is that only
//! the order of the sums changes, and bf16 rounds each GEMM input to 8 bits, so a last-bit
//! difference in an activation can move its rounded value by 2^-8 (measured with native bf16
//! on a Zen 5 EPYC: 1.3e-2 after 10 steps). The bit-identical repeat runs in `auto`, so in
//! bf16 where the workers have native bf16: a bf16 job is deterministic too.
//!
//! The jobs use a fixed vocabulary file (the uncased BERT vocab.txt fixture), so that both
//! sides of each comparison train on byte-identical prepared data.

mod common;

use common::*;
use std::path::{Path, PathBuf};

/// Runs 10 steps with `workers` workers of micro-batch `mbs`, `accum` micro-batches per
/// step, in `precision`; returns the checkpoint folder.
fn run(
    dir: &Path,
    corpus: &Path,
    (workers, mbs, accum): (usize, usize, usize),
    precision: &str,
    name: &str,
) -> PathBuf {
    let case = dir.join(name);
    std::fs::create_dir_all(&case).unwrap();
    let mut job = JobFile::new(corpus.to_path_buf());
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.workers = workers;
    job.micro_batch_size = mbs;
    job.grad_accum = accum;
    job.max_steps = 10;
    job.warmup_steps = 2;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.train_extra = format!("precision = \"{precision}\"");
    let path = job.write(&case);
    let out = case.join("checkpoint");
    keel_local(&path, workers, &out, &case.join("work"));
    out
}

fn weights(dir: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    keel_proto::weights::load_tensors_f64(dir.join("model.safetensors")).unwrap()
}

#[test]
fn one_two_and_three_workers_with_the_same_global_batch_give_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 3000);
    let one = run(dir.path(), &corpus, (1, 12, 1), "fp32", "w1");
    let two = run(dir.path(), &corpus, (2, 6, 1), "fp32", "w2");
    let three = run(dir.path(), &corpus, (3, 4, 1), "fp32", "w3");
    let two_accum = run(dir.path(), &corpus, (2, 3, 2), "fp32", "w2x2");
    let d2 = max_relative_difference(&two, &one);
    let d3 = max_relative_difference(&three, &one);
    let d2a = max_relative_difference(&two_accum, &one);
    println!(
        "max relative weight difference after 10 steps: 2 vs 1 workers {d2:.2e}, 3 vs 1 workers {d3:.2e}, 2 workers x 2 micro-batches vs 1 worker {d2a:.2e}"
    );
    assert!(d2 <= 1e-5, "2 workers differ from 1 by {d2:e}");
    assert!(d3 <= 1e-5, "3 workers differ from 1 by {d3:e}");
    assert!(
        d2a <= 1e-5,
        "2 workers with 2 micro-batches each differ from 1 worker by {d2a:e}"
    );
    // The weights did move: the comparison is not between two untouched initialisations.
    let init_vs_trained = weights(&one)["cls.predictions.bias"]
        .1
        .iter()
        .any(|x| *x != 0.0);
    assert!(
        init_vs_trained,
        "cls.predictions.bias is still all zeros after 10 steps"
    );
}

#[test]
fn the_same_job_twice_gives_bit_identical_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 3000);
    let a = run(dir.path(), &corpus, (2, 6, 1), "auto", "a");
    let b = run(dir.path(), &corpus, (2, 6, 1), "auto", "b");
    // `auto` is each worker's start-up race of bf16 against fp32 (model/src/bf16_cpu.rs):
    // the two runs must have chosen alike for their checkpoints to be comparable at all.
    let precision = |dir: &Path| -> String {
        let state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("trainer_state.json")).unwrap())
                .unwrap();
        state["precision"].as_str().unwrap_or("missing").to_string()
    };
    assert_eq!(
        precision(&a),
        precision(&b),
        "the two runs of one job chose different precisions (the workers' start-up race)"
    );
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs between two runs of the same job");
    }
}
