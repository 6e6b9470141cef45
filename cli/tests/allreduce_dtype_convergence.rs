//! Gradients summed with bf16 on the wire train as well as with f32: the same small job (tiny
//! BERT, the first 4,000 lines of the King James Bible, 2 workers of micro-batch 8, 300 steps)
//! run by `keel local` once with `train.allreduce_dtype = "bf16"` and once with `"fp32"` ends
//! within 1% in training loss (mean of the last 20 steps) and in held-out loss (the final
//! eval), while the bf16 run's curve is its own (the rounding really happened). Both curves
//! and the mean all-reduce seconds per step are printed as a table and written to
//! `$CARGO_TARGET_TMPDIR/allreduce_dtype_convergence.md`.

mod common;

use common::*;
use std::fmt::Write as _;
use std::path::Path;

const STEPS: u64 = 300;

/// What one run left in its metrics: per-step losses and all-reduce seconds, and the evals.
struct Run {
    losses: Vec<f64>,
    allreduce_seconds: Vec<f64>,
    evals: Vec<(u64, f64)>,
}

/// Runs the job with gradients sent as `dtype` (with the vocabulary file `vocab`, or a trained
/// one when `None`).
fn run(dir: &Path, corpus: &Path, dtype: &str, vocab: Option<&Path>) -> Run {
    let dir = dir.join(dtype);
    std::fs::create_dir_all(&dir).unwrap();
    let mut job = JobFile::new(corpus.to_path_buf());
    job.workers = 2;
    job.micro_batch_size = 8;
    job.max_steps = STEPS;
    job.warmup_steps = 30;
    job.checkpoint_every = 0;
    job.eval_every = 100;
    job.train_extra = format!("precision = \"fp32\"\nallreduce_dtype = \"{dtype}\"");
    job.vocab = vocab.map(Path::to_path_buf);
    let job_path = job.write(&dir);
    let out = dir.join("checkpoint");
    let output = keel_local(&job_path, 2, &out, &dir.join("work"));
    assert!(output.status.success(), "keel local ({dtype} wire) failed");
    let lines = metrics(&out.join("metrics.jsonl"));
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len() as u64, STEPS, "one metrics line per step");
    let field = |name: &str| -> Vec<f64> {
        steps
            .iter()
            .map(|l| l[name].as_f64().unwrap_or_else(|| panic!("{name} in {l}")))
            .collect()
    };
    let evals: Vec<(u64, f64)> = lines
        .iter()
        .filter_map(|l| Some((l.get("step")?.as_u64()?, l.get("eval_loss")?.as_f64()?)))
        .collect();
    assert!(!evals.is_empty(), "no eval in the {dtype} run");
    Run {
        losses: field("loss"),
        allreduce_seconds: field("allreduce_seconds"),
        evals,
    }
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

#[test]
fn bf16_and_fp32_gradients_on_the_wire_end_within_one_percent() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 4000);
    // The bf16 run reuses the vocabulary of the fp32 one (see bf16_convergence.rs: a vocabulary
    // trained twice is not the same, which alone moves the loss by ~2%).
    let fp32 = run(dir.path(), &corpus, "fp32", None);
    let vocab = dir.path().join("fp32").join("checkpoint").join("vocab.txt");
    let bf16 = run(dir.path(), &corpus, "bf16", Some(&vocab));

    let mut table = String::from(
        "| step | fp32 wire: train loss (mean of 20 steps) | bf16 wire: train loss (mean of 20 steps) |\n|---|---|---|\n",
    );
    for end in (20..=STEPS as usize).step_by(20) {
        let (a, b) = (
            mean(&fp32.losses[end - 20..end]),
            mean(&bf16.losses[end - 20..end]),
        );
        writeln!(table, "| {end} | {a:.4} | {b:.4} |").unwrap();
    }
    table.push_str(
        "\n| step | fp32 wire: held-out loss | bf16 wire: held-out loss |\n|---|---|---|\n",
    );
    for ((s, a), (_, b)) in fp32.evals.iter().zip(&bf16.evals) {
        writeln!(table, "| {s} | {a:.4} | {b:.4} |").unwrap();
    }
    let last = |r: &Run| mean(&r.losses[r.losses.len() - 20..]);
    let train = (last(&fp32), last(&bf16));
    let heldout = (fp32.evals.last().unwrap().1, bf16.evals.last().unwrap().1);
    let rel = |(a, b): (f64, f64)| (b - a).abs() / a;
    writeln!(
        table,
        "\nfinal: train fp32 {:.4} bf16 {:.4} ({:+.2}%); held-out fp32 {:.4} bf16 {:.4} ({:+.2}%)\n\
         mean all-reduce seconds per step (loopback, 2 workers on one machine): fp32 {:.4}, bf16 {:.4}",
        train.0,
        train.1,
        100.0 * (train.1 - train.0) / train.0,
        heldout.0,
        heldout.1,
        100.0 * (heldout.1 - heldout.0) / heldout.0,
        mean(&fp32.allreduce_seconds),
        mean(&bf16.allreduce_seconds),
    )
    .unwrap();
    println!("{table}");
    let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("allreduce_dtype_convergence.md");
    std::fs::write(&file, &table).unwrap();
    println!("written to {}", file.display());

    assert!(
        train.0 < mean(&fp32.losses[..20]) - 1.0,
        "fp32 run did not learn"
    );
    assert!(
        train.1 < mean(&bf16.losses[..20]) - 1.0,
        "bf16 run did not learn"
    );
    assert!(
        rel(train) < 0.01,
        "training losses differ by {:.2}%",
        100.0 * rel(train)
    );
    assert!(
        rel(heldout) < 0.01,
        "held-out losses differ by {:.2}%",
        100.0 * rel(heldout)
    );
    // The bf16 run's gradients were rounded: its curve is not the fp32 one.
    assert_ne!(
        bf16.losses, fp32.losses,
        "bf16 and fp32 wire gave identical losses"
    );
}
