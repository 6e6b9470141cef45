//! BERT's two phases in one job (`[[phase]]`) with real coordinator and worker
//! processes on 127.0.0.1: 64-token sequences for steps 0..16, then 128-token sequences with
//! another micro-batch, learning rate and warmup for steps 16..60, the switch at step 16
//! without a restart. One run goes uninterrupted; another loses a worker inside phase 2 (kill
//! -9, a replacement joins) and then its coordinator (kill -9, restarted on the same address
//! and folder), and must end bit for bit where the uninterrupted run ended.

mod common;

use common::cluster::Cluster;
use common::*;
use std::path::Path;

/// The job's phase 2, appended to the job file.
const PHASE_2: &str = "\n[[phase]]\nstart_step = 16\nmax_seq_length = 128\n\
                       max_predictions_per_seq = 20\nmicro_batch_size = 4\n\
                       learning_rate = 0.001\nwarmup_steps = 4\n";

/// Submits the two-phase job (2 workers, fixed vocabulary: the same data every time).
fn submit(cluster: &Cluster, name: &str, corpus: &Path) -> String {
    submit_phases(cluster, name, corpus, 60, PHASE_2)
}

/// Submits a job of `max_steps` steps whose later phases are `phases` (`[[phase]]` text).
fn submit_phases(
    cluster: &Cluster,
    name: &str,
    corpus: &Path,
    max_steps: u64,
    phases: &str,
) -> String {
    let mut job = JobFile::new(corpus.to_path_buf());
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.workers = 2;
    job.micro_batch_size = 8;
    job.max_steps = max_steps;
    job.warmup_steps = 4;
    job.checkpoint_every = 10;
    job.eval_every = 8;
    job.peer_timeout_seconds = 10.0;
    job.cluster_extra = "max_recoveries = 4".into();
    cluster.submit_job(name, &job, phases)
}

/// A step line's `(step, phase, lr, tokens)`.
type StepFacts = (u64, u64, f64, u64);

/// `(step, phase, lr, tokens)` of every step line, and `(step, eval loss)` of every eval.
fn lines(out: &Path) -> (Vec<StepFacts>, Vec<(u64, f64)>) {
    let all = metrics(&out.join("metrics.jsonl"));
    let steps = all
        .iter()
        .filter(|l| l.get("loss").is_some())
        .map(|l| {
            let phase = l.get("phase").and_then(|p| p.as_u64()).unwrap_or(0);
            let tokens = l["tokens"].as_u64().unwrap();
            (
                l["step"].as_u64().unwrap(),
                phase,
                l["lr"].as_f64().unwrap(),
                tokens,
            )
        })
        .collect();
    let evals = all
        .iter()
        .filter_map(|l| Some((l.get("step")?.as_u64()?, l.get("eval_loss")?.as_f64()?)))
        .collect();
    (steps, evals)
}

#[test]
fn two_phases_switch_at_their_step_and_survive_a_lost_worker_and_coordinator() {
    let mut cluster = Cluster::new(2);
    let corpus = kjv_lines(cluster.root(), 2000);

    let reference = submit(&cluster, "reference", &corpus);
    let expected = cluster.completed(&reference);
    let (steps, evals) = lines(&expected);
    assert_eq!(steps.len(), 60, "one line per step");
    for &(step, phase, lr, tokens) in &steps {
        // Lines count steps from 1: step 17 is the 0-based step 16, phase 2's first.
        let want = if step <= 16 { 1 } else { 2 };
        assert_eq!(phase, want, "step {step}: phase {phase}");
        // Phase 2's warmup starts from 0 at its first step (HF's LambdaLR).
        if step == 17 {
            assert_eq!(lr, 0.0, "phase 2's first step");
        }
        if step == 21 {
            assert!(
                (lr - 0.001).abs() < 1e-9,
                "phase 2's peak after its warmup: {lr}"
            );
        }
        // A global batch of 16 sequences of at most 64 tokens, then 8 of at most 128.
        let (rows, len) = if step <= 16 { (16, 64) } else { (8, 128) };
        assert!(tokens <= rows * len, "step {step}: {tokens} tokens");
        // Phase 2's 8 sequences average more than 64 tokens: none of phase 1's data could.
        if step > 16 {
            assert!(
                tokens > 8 * 64,
                "step {step}: {tokens} tokens in 8 sequences"
            );
        }
    }
    println!("held-out loss of the uninterrupted run: {evals:?}");
    let eval_steps: Vec<u64> = evals.iter().map(|e| e.0).collect();
    assert_eq!(eval_steps, [8, 16, 24, 32, 40, 48, 56, 60]);
    assert!(evals.iter().all(|e| e.1.is_finite()));
    assert!(evals[7].1 < evals[0].1, "it learns: {evals:?}");

    // The same job, losing a worker and then the coordinator inside phase 2.
    let job = submit(&cluster, "interrupted", &corpus);
    cluster.step_at_least(&job, 20);
    let s = status(&job, &cluster.addr, cluster.root());
    assert_eq!(
        (s["phase"].as_u64(), s["phases"].as_u64()),
        (Some(2), Some(2)),
        "{s}"
    );
    let mut victim = cluster.workers.remove(1);
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    println!("killed a worker at step >= 20");
    cluster.wait(&job, "the loss to be noticed", |s| {
        s["recoveries"].as_u64() == Some(1)
    });
    cluster.add_worker();
    cluster.step_at_least(&job, 30);
    cluster.restart_coordinator();
    println!("killed and restarted the coordinator at step >= 30");
    let got = cluster.completed(&job);
    assert_same_checkpoint(&got, &expected);
    let (steps, _) = lines(&got);
    assert!(
        steps
            .iter()
            .all(|&(s, p, ..)| p == if s <= 16 { 1 } else { 2 }),
        "phases of the interrupted run"
    );
}

/// 64 -> 128 -> 64: phase 3 has phase 1's data and must evaluate on phase 1's held-out set,
/// not on phase 2's 128-token one (it did, and failed at its first eval: "sequence of 118
/// tokens does not fit pad_to 64").
#[test]
fn a_phase_back_at_phase_1s_length_evaluates_on_phase_1s_heldout_set() {
    let cluster = Cluster::new(2);
    let corpus = kjv_lines(cluster.root(), 2000);
    let phases = format!("{PHASE_2}\n[[phase]]\nstart_step = 20\nmax_seq_length = 64\n");
    let job = submit_phases(&cluster, "back", &corpus, 24, &phases);
    let out = cluster.completed(&job);
    let (steps, evals) = lines(&out);
    let phases: Vec<u64> = steps.iter().map(|s| s.1).collect();
    let want: Vec<u64> = (1..=24)
        .map(|s| match s {
            ..=16 => 1,
            17..=20 => 2,
            _ => 3,
        })
        .collect();
    assert_eq!(phases, want);
    let eval_steps: Vec<u64> = evals.iter().map(|e| e.0).collect();
    assert_eq!(eval_steps, [8, 16, 24], "phase 3 evaluates");
    assert!(evals.iter().all(|e| e.1.is_finite()), "{evals:?}");
    // The eval masks with a fixed seed: the same set gives the same count of masked tokens.
    let masked: Vec<u64> = metrics(&out.join("metrics.jsonl"))
        .iter()
        .filter_map(|l| l.get("eval_masked_tokens")?.as_u64())
        .collect();
    assert_eq!(masked.len(), 3, "{masked:?}");
    assert_eq!(masked[2], masked[0], "phase 3 reads phase 1's held-out set");
}
