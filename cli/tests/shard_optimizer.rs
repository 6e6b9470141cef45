//! Optimizer-state sharding (`train.shard_optimizer`, ZeRO stage 1) with real
//! coordinator and worker processes on 127.0.0.1:
//! - 2 and 3 workers, AdamW and LAMB: the sharded job ends within 1e-5 of the unsharded one,
//!   weights and the optimizer moments its checkpoint gathers (the sums and the clipping norm
//!   are only reordered; LAMB's per-tensor norms are summed across ranks in f32);
//! - a sharded job that loses a worker (kill -9) resumes from its newest checkpoint, as a
//!   sharded optimizer must (the lost rank's moments existed nowhere else), and ends bit for
//!   bit where the uninterrupted sharded run ended;
//! - a sharded job whose coordinator is restarted (kill -9), and which then grows from 2 to 3
//!   workers, goes on from the ranks' memory both times (the shares gathered again, re-cut
//!   for 3 ranks), and ends where the uninterrupted run ended (bit for bit with the same world
//!   size, within 1e-5 across the growth).
//!
//! The comparisons run in fp32 (`train.precision = "fp32"`), as `equivalence.rs` explains.

mod common;

use common::cluster::Cluster;
use common::*;
use std::path::{Path, PathBuf};

/// A 10-step job of `workers` workers, micro-batch `mbs`, with `optimizer`, sharded or not.
fn job(corpus: &Path, workers: usize, mbs: usize, optimizer: &str, sharded: bool) -> JobFile {
    let mut job = JobFile::new(corpus.to_path_buf());
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.workers = workers;
    job.micro_batch_size = mbs;
    job.max_steps = 10;
    job.warmup_steps = 2;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.train_extra = format!("precision = \"fp32\"\nshard_optimizer = {sharded}");
    if optimizer == "lamb" {
        job.learning_rate = 5e-3;
    }
    job
}

/// Runs `job` with `keel local` in folder `name`, with `optimizer`; returns the checkpoint.
fn run(dir: &Path, name: &str, job: &JobFile, optimizer: &str) -> PathBuf {
    let case = dir.join(name);
    std::fs::create_dir_all(&case).unwrap();
    let path = job.write(&case);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("optimizer = \"adamw\""), "{text}");
    let text = text.replace(
        "optimizer = \"adamw\"",
        &format!("optimizer = \"{optimizer}\""),
    );
    std::fs::write(&path, text).unwrap();
    let out = case.join("checkpoint");
    let result = keel_local(&path, job.workers, &out, &case.join("work"));
    assert!(
        result.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// `[P]` buffers of a checkpoint's `optimizer.safetensors`, by name.
fn moments(dir: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    keel_proto::weights::load_tensors_f64(dir.join("optimizer.safetensors")).unwrap()
}

/// `max |a - b| / max |b|` of each optimizer buffer, the largest.
fn moments_difference(a: &Path, b: &Path) -> f64 {
    let (ma, mb) = (moments(a), moments(b));
    assert_eq!(ma.keys().collect::<Vec<_>>(), mb.keys().collect::<Vec<_>>());
    let mut worst = 0f64;
    for (name, (shape, va)) in &ma {
        let (shape_b, vb) = &mb[name];
        assert_eq!(
            shape, shape_b,
            "{name}: the gathered buffer has another shape"
        );
        let scale = vb.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{name} is all zeros");
        let diff = va
            .iter()
            .zip(vb)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

#[test]
fn sharded_adamw_and_lamb_on_2_and_3_workers_end_within_1e_5_of_unsharded() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 3000);
    for optimizer in ["adamw", "lamb"] {
        for (workers, mbs) in [(2, 6), (3, 4)] {
            let case = format!("{optimizer}-w{workers}");
            let plain = run(
                dir.path(),
                &format!("{case}-plain"),
                &job(&corpus, workers, mbs, optimizer, false),
                optimizer,
            );
            let sharded = run(
                dir.path(),
                &format!("{case}-sharded"),
                &job(&corpus, workers, mbs, optimizer, true),
                optimizer,
            );
            let weights = max_relative_difference(&sharded, &plain);
            let state = moments_difference(&sharded, &plain);
            println!(
                "{optimizer}, {workers} workers, 10 steps: sharded vs unsharded, max relative \
                 difference {weights:.2e} in the weights, {state:.2e} in the moments"
            );
            assert!(weights <= 1e-5, "{case}: weights differ by {weights:e}");
            assert!(state <= 1e-5, "{case}: moments differ by {state:e}");
            // The weights moved: the comparison is not between two initialisations.
            let init = run_init_free_check(&plain);
            assert!(init, "{case}: cls.predictions.bias is still all zeros");
        }
    }
}

/// Whether training moved a tensor that starts at zero.
fn run_init_free_check(dir: &Path) -> bool {
    keel_proto::weights::load_tensors_f64(dir.join("model.safetensors")).unwrap()
        ["cls.predictions.bias"]
        .1
        .iter()
        .any(|x| *x != 0.0)
}

#[test]
fn a_sharded_job_that_loses_a_worker_resumes_from_its_checkpoint_and_ends_bit_for_bit() {
    let mut cluster = Cluster::new(2);
    let corpus = kjv_lines(cluster.root(), 2000);
    let mut spec = job(&corpus, 2, 8, "adamw", true);
    spec.max_steps = 40;
    spec.checkpoint_every = 10;
    spec.eval_every = 10;
    spec.peer_timeout_seconds = 10.0;
    spec.cluster_extra = "max_recoveries = 4".into();

    let reference = cluster.submit_job("reference", &spec, "");
    let expected = cluster.completed(&reference);

    let job = cluster.submit_job("interrupted", &spec, "");
    cluster.step_at_least(&job, 15);
    let mut victim = cluster.workers.remove(1);
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    println!("killed a worker at step >= 15");
    cluster.wait(&job, "the loss to be noticed", |s| {
        s["recoveries"].as_u64() == Some(1)
    });
    cluster.add_worker();
    let got = cluster.completed(&job);
    assert_same_checkpoint(&got, &expected);
    // It went on from its checkpoint at once, not from the survivor's memory (the lost rank's
    // share of the moments was gone): one recovery, and no generation that failed on it (a
    // fresh user found two recoveries spent on one loss, and a job with max_recoveries = 1
    // failed).
    let s = status(&job, &cluster.addr, cluster.root());
    assert_eq!(s["recoveries"].as_u64(), Some(1), "{s}");
    // (The survivor either holds its step, and the coordinator sees one rank of two holding
    // it, or held nothing: its update was cut half-way by the loss.)
    let coordinator = cluster.coordinator.log_text();
    for line in coordinator.lines().filter(|l| {
        l.contains("held state reported") || l.contains("going on from the newest checkpoint")
    }) {
        println!("coordinator: {line}");
    }
    assert!(
        coordinator.contains("generation=2 world_size=2 start_step=10 source=Checkpoint"),
        "generation 2 did not start from the step-10 checkpoint:\n{coordinator}"
    );
    let survivor = cluster.workers[0].log_text();
    assert!(
        !survivor.contains("sharded optimizer state is incomplete"),
        "a generation was spent finding the share missing:\n{survivor}"
    );
}

#[test]
fn a_sharded_job_goes_on_from_its_ranks_memory_after_a_coordinator_restart_and_a_growth() {
    let mut cluster = Cluster::new(2);
    let corpus = kjv_lines(cluster.root(), 2000);
    let mut spec = job(&corpus, 2, 8, "lamb", true);
    spec.max_steps = 40;
    spec.checkpoint_every = 100;
    spec.eval_every = 0;
    spec.peer_timeout_seconds = 10.0;
    spec.cluster_extra = "max_recoveries = 4".into();

    let reference = cluster.submit_job("reference", &spec, "");
    let expected = cluster.completed(&reference);

    // The coordinator dies and comes back: the same two workers go on from their memory.
    let job = cluster.submit_job("restarted", &spec, "");
    cluster.step_at_least(&job, 12);
    cluster.restart_coordinator();
    println!("killed and restarted the coordinator at step >= 12");
    let got = cluster.completed(&job);
    assert_same_checkpoint(&got, &expected);
    let logs: String = cluster.workers.iter().map(|w| w.log_text()).collect();
    assert!(
        logs.contains("regathered the sharded optimizer state"),
        "no rank gathered its shares again:\n{logs}"
    );

    // A job that may grow to 3 workers: a third joins, the shares are re-cut for 3 ranks.
    let grown = cluster.submit_edited("grown", &spec, |text| {
        assert!(text.contains("max_workers = 2"), "{text}");
        text.replace("max_workers = 2", "max_workers = 3")
    });
    cluster.step_at_least(&grown, 12);
    cluster.add_worker();
    cluster.wait(&grown, "the third worker", |s| {
        s["workers"].as_array().is_some_and(|w| w.len() == 3)
    });
    let got = cluster.completed(&grown);
    let d = max_relative_difference(&got, &expected);
    println!("grown from 2 to 3 workers at step >= 12: max relative difference {d:.2e}");
    assert!(d <= 1e-5, "the grown job differs by {d:e}");
    let third = cluster.workers[2].log_text();
    assert!(
        third.contains("regathered the sharded optimizer state") && third.contains("to_world=3"),
        "the third worker did not get its share from the others:\n{third}"
    );
}
