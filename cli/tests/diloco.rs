//! DiLoCo (`[diloco]` in the job file) with real coordinator and worker processes:
//!
//! - With one worker, an outer learning rate of 1 and no momentum, an outer step sets the
//!   weights to `anchor - (anchor - params)`, i.e. the local weights up to rounding, so the
//!   job must end within rounding of the same job trained synchronously. This checks the
//!   rounds' plumbing (anchor, outer gradient, averaging, checkpointing) end to end.
//! - With two workers and the paper's outer settings, a job completes, learns, keeps its
//!   outer state in the checkpoint, and moves far fewer bytes through the ring than
//!   synchronous training (its all-reduce seconds are printed beside synchronous ones).

mod common;

use common::*;
use std::path::{Path, PathBuf};

/// Runs the KJV tiny job with `workers` workers, `diloco` appended as its `[diloco]` section
/// (empty: synchronous); returns the checkpoint folder.
fn run(dir: &Path, corpus: &Path, workers: usize, diloco: &str, name: &str) -> PathBuf {
    let case = dir.join(name);
    std::fs::create_dir_all(&case).unwrap();
    let mut job = JobFile::new(corpus.to_path_buf());
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.workers = workers;
    job.micro_batch_size = 8;
    job.max_steps = 40;
    job.warmup_steps = 4;
    job.checkpoint_every = 20;
    job.eval_every = 20;
    job.train_extra = "precision = \"fp32\"".into();
    if !diloco.is_empty() {
        job.cluster_extra = format!("[diloco]\n{diloco}");
    }
    let path = job.write(&case);
    let out = case.join("checkpoint");
    keel_local(&path, workers, &out, &case.join("work"));
    out
}

/// `(eval step, held-out loss)` of every eval in a run's metrics.
fn evals(out: &Path) -> Vec<(u64, f64)> {
    metrics(&out.join("metrics.jsonl"))
        .iter()
        .filter_map(|l| Some((l.get("step")?.as_u64()?, l.get("eval_loss")?.as_f64()?)))
        .collect()
}

/// Mean of a per-step metric over a run.
fn mean_of(out: &Path, field: &str) -> f64 {
    let values: Vec<f64> = metrics(&out.join("metrics.jsonl"))
        .iter()
        .filter(|l| l.get("loss").is_some())
        .map(|l| {
            l[field]
                .as_f64()
                .unwrap_or_else(|| panic!("{field} in {l}"))
        })
        .collect();
    assert!(!values.is_empty(), "no step lines");
    values.iter().sum::<f64>() / values.len() as f64
}

/// The tensor names of a checkpoint's `optimizer.safetensors`.
fn optimizer_tensors(out: &Path) -> Vec<String> {
    // safetensors: an 8-byte little-endian header length, then a JSON header keyed by name.
    let bytes = std::fs::read(out.join("optimizer.safetensors")).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let mut names: Vec<String> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    names
}

#[test]
fn one_worker_with_plain_averaging_matches_synchronous_training() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 3000);
    let sync = run(dir.path(), &corpus, 1, "", "sync");
    let rounds = run(
        dir.path(),
        &corpus,
        1,
        "inner_steps = 5\nouter_learning_rate = 1.0\nouter_momentum = 0.0",
        "diloco",
    );
    let d = max_relative_difference(&rounds, &sync);
    println!("1 worker, DiLoCo (H = 5, lr 1, no momentum) against synchronous: {d:.2e}");
    assert!(d <= 1e-5, "DiLoCo with plain averaging differs by {d:e}");
    assert!(
        optimizer_tensors(&rounds).contains(&"diloco_velocity".to_string()),
        "the outer state is in the checkpoint"
    );
    assert!(!optimizer_tensors(&sync).contains(&"diloco_velocity".to_string()));
}

/// Mean of every LayerNorm weight (gamma) of a checkpoint: 1 at initialisation, and after
/// 40 steps of this job within a few percent of 1.
fn mean_layer_norm_weight(out: &Path) -> f64 {
    let tensors = keel_proto::weights::load_tensors_f64(out.join("model.safetensors")).unwrap();
    let gammas: Vec<f64> = tensors
        .iter()
        .filter(|(name, _)| name.ends_with("LayerNorm.weight"))
        .flat_map(|(_, (_, values))| values.iter().copied())
        .collect();
    assert!(!gammas.is_empty());
    gammas.iter().sum::<f64>() / gammas.len() as f64
}

/// A round starts from the weights the job holds, also the first round of a fresh job. With
/// one worker, an outer learning rate of 0.5 and no momentum, each outer step lands half-way
/// between the round's start and the local weights, so the LayerNorm weights stay near their
/// initial 1 as in synchronous training. With the anchor left at zero for the first round
/// (the old code) the first outer step halved every weight: LayerNorm weights near 0.5.
#[test]
fn the_first_round_starts_from_the_initial_weights_not_zero() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 3000);
    let sync = run(dir.path(), &corpus, 1, "", "sync");
    let rounds = run(
        dir.path(),
        &corpus,
        1,
        "inner_steps = 20\nouter_learning_rate = 0.5\nouter_momentum = 0.0",
        "diloco-half",
    );
    let (g_sync, g_rounds) = (
        mean_layer_norm_weight(&sync),
        mean_layer_norm_weight(&rounds),
    );
    println!("mean LayerNorm weight: synchronous {g_sync:.4}, DiLoCo outer lr 0.5 {g_rounds:.4}");
    assert!(
        (g_sync - 1.0).abs() < 0.1,
        "synchronous moved gamma to {g_sync}"
    );
    assert!(
        (g_rounds - g_sync).abs() < 0.1,
        "DiLoCo's mean LayerNorm weight {g_rounds} is far from synchronous training's {g_sync}"
    );
}

#[test]
fn two_workers_learn_with_outer_steps_and_talk_less() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 3000);
    let sync = run(dir.path(), &corpus, 2, "", "sync");
    // The paper's momentum of 0.9 is for long runs (hundreds of outer steps): over the 8 outer
    // steps of this job it overshoots (held-out 8.8 after 20 steps, seen on a Zen 4 EPYC).
    let rounds = run(
        dir.path(),
        &corpus,
        2,
        "inner_steps = 5\nouter_momentum = 0.5",
        "diloco",
    );
    let (e_sync, e_rounds) = (evals(&sync), evals(&rounds));
    println!("held-out loss, synchronous: {e_sync:?}; DiLoCo H = 5: {e_rounds:?}");
    let (ring_sync, ring_rounds) = (
        mean_of(&sync, "allreduce_seconds"),
        mean_of(&rounds, "allreduce_seconds"),
    );
    println!(
        "mean all-reduce seconds per step: synchronous {ring_sync:.4}, DiLoCo {ring_rounds:.4}"
    );
    let last = |e: &[(u64, f64)]| e.last().copied().expect("an eval");
    assert_eq!(last(&e_rounds).0, 40, "the DiLoCo job ran to its end");
    // ln(1000) = 6.9 is a uniform guess over the vocabulary; DiLoCo must end well below it.
    assert!(
        last(&e_rounds).1 < 6.5,
        "DiLoCo did not learn: {e_rounds:?}"
    );
    assert!(
        last(&e_rounds).1 < last(&e_sync).1 * 1.15,
        "DiLoCo ends far above synchronous training: {e_rounds:?} against {e_sync:?}"
    );
    assert!(
        ring_rounds < ring_sync,
        "DiLoCo's ring time per step ({ring_rounds}) is not below synchronous ({ring_sync})"
    );
    let names = optimizer_tensors(&rounds);
    for want in ["diloco_anchor", "diloco_velocity", "exp_avg", "exp_avg_sq"] {
        assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
    }
}
