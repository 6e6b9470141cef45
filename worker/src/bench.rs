//! `keel-worker bench`: full training steps (forward, backward, AdamW) of a preset BERT on
//! random tokens, 15% of them masked, MLM head only; prints one JSON line.
//!
//! Fields: `config`, `threads`, `batch`, `seq`, `vocab`, `steps`, `s_per_step` (seconds,
//! mean over the timed steps after one warm-up step), `tokens_per_s`, `gflops` (GEMM
//! GFLOP per second of step time), `sgemm_share` (fraction of step time inside GEMM calls),
//! `peak_rss_mib` (VmHWM after the steps, before the bandwidth probe below allocates its
//! buffers), and `cpu_s_per_step` (process CPU seconds per step: on a shared
//! machine the wall time includes waiting for a core). Precision: `precision_setting` (the
//! `--precision` given), `precision` (what ran: `auto` resolves as the coordinator would, bf16
//! only with native bf16), `bf16_support` (what the probe found), `gemm_backends` (per GEMM
//! class, `linear` = projections, FFN, MLM transform; `attention` = Q K^T, P V and their
//! gradients; `mlm_head` = the tied decoder: the backends its flops ran on), and
//! `bf16_rate_share` (fraction of GEMM flops that ran natively in bf16), `onednn_reference_calls`
//! (native bf16 GEMMs that oneDNN ran on a slow reference kernel: should be 0), and `gemm_classes`
//! (per class: its share of the step's GEMM flops, of the step's time, and its GFLOP/s while
//! inside its calls: the profile that says which GEMMs hold a step back). Memory: `passes`
//! (per pass of the step: time, bytes moved, GB/s and its fraction of `copy_bandwidth_gb_s`,
//! this machine's copy bandwidth on the same threads: `crate::bench_roofline`), and
//! `saved_activation_mib` / `saved_activation_bytes_per_token` (what the forward keeps for the
//! backward, bf16 copies included: `Bert::saved_activation_bytes`).

use std::time::Instant;

use anyhow::Context;
use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};
use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use keel_proto::precision::{PrecisionSetting, WorkerBf16};

use crate::batch::Batch;
use crate::bench_roofline;
use crate::model::bf16;
use crate::model::pass_profile::{self, Pass};
use crate::model::{Bert, DropoutKey, StepOptions, gemm, init_params, set_blas_threads};
use crate::optim::{AdamW, AdamWConfig, Optimizer, clip_grad_norm};

/// Arguments of `keel-worker bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model preset: tiny, mini, small, medium, base, large.
    #[arg(long, default_value = "mini")]
    pub config: String,
    /// Compute threads (GEMMs cut among them; OpenBLAS itself runs single-threaded).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 30522)]
    pub vocab: usize,
    /// GEMM precision: auto (bf16 only where this CPU has native bf16), bf16 or fp32.
    #[arg(long, default_value = "auto")]
    pub precision: PrecisionSetting,
    /// Mean share of padding per sequence, 0 to 0.5: each sequence's real length is drawn
    /// uniformly from `t - 2 * pad_fraction * t` to `t` (real corpora have short sequences;
    /// the time-to-quality corpus at 32 tokens has 17% padding).
    #[arg(long, default_value_t = 0.0)]
    pub pad_fraction: f64,
    /// Compute the padding rows too (what the model did before it left them out).
    #[arg(long)]
    pub keep_padding: bool,
}

/// A random batch: ids in `[5, vocab)`, two segments, padding after each sequence's real
/// length (`pad_fraction` of the positions on average; the pad id 0), 15% of the real tokens
/// masked.
fn random_batch(
    rng: &mut ChaCha8Rng,
    b: usize,
    t: usize,
    vocab: usize,
    pad_fraction: f64,
    first_sample: u64,
) -> Batch {
    let low = 5.min(vocab as u64 - 1);
    let id = |rng: &mut ChaCha8Rng| (low + rng.next_u64() % (vocab as u64 - low)) as u32;
    let span = (2.0 * pad_fraction * t as f64).round() as u64;
    let lens: Vec<usize> = (0..b)
        .map(|_| {
            t.saturating_sub((rng.next_u64() % (span + 1)) as usize)
                .max(1)
        })
        .collect();
    let real = |i: usize, j: usize| j < lens[i];
    let input_ids = Array2::from_shape_fn((b, t), |(i, j)| if real(i, j) { id(rng) } else { 0 });
    let token_type_ids =
        Array2::from_shape_fn((b, t), |(i, j)| u32::from(j >= lens[i] / 2 && real(i, j)));
    let mut masked_positions = Vec::new();
    let mut masked_labels = Vec::new();
    for p in 0..b * t {
        if real(p / t, p % t) && rng.next_u64() % 100 < 15 {
            masked_positions.push(p);
            masked_labels.push(id(rng));
        }
    }
    Batch {
        input_ids,
        token_type_ids,
        attention_mask: Array2::from_shape_fn((b, t), |(i, j)| u8::from(real(i, j))),
        masked_positions,
        masked_labels,
        next_sentence_labels: None,
        sample_ids: (first_sample..first_sample + b as u64).collect(),
    }
}

/// CPU time of this process so far (seconds, all threads).
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec; the clock id is a constant Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Peak resident set size (MiB) from `/proc/self/status` (`VmHWM`), if available.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Runs the benchmark and prints its JSON line.
///
/// Errors: an unknown preset, a sequence longer than the preset's positions, a model error.
pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.batch > 0 && args.seq > 0 && args.steps > 0,
        "batch, seq and steps must be positive"
    );
    anyhow::ensure!(
        (0.0..=0.5).contains(&args.pad_fraction),
        "--pad-fraction must be between 0 and 0.5, got {}",
        args.pad_fraction
    );
    set_blas_threads(args.threads);
    let config = BertConfig::preset(&args.config, args.vocab).context("model preset")?;
    let layout = ParamLayout::bert(&config, Heads::MaskedLm);
    let mut params = init_params(&config, &layout, 0);
    let mut grads = vec![0.0f32; layout.total_len()];
    let mut model = Bert::<f32>::new(&config, Heads::MaskedLm)?;
    let support = bf16::support();
    let (precision, _) = args.precision.decide(&[WorkerBf16 {
        worker: "this machine".into(),
        native: support.native,
        detail: support.detail.clone(),
    }]);
    model.set_precision(precision);
    model.set_unpadding((!args.keep_padding).then_some(crate::model::UNPAD_ROW_MULTIPLE));
    let mut opt = AdamW::<f32>::new(&layout, AdamWConfig::default());
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let batches: Vec<Batch> = (0..2)
        .map(|i| {
            random_batch(
                &mut rng,
                args.batch,
                args.seq,
                args.vocab,
                args.pad_fraction,
                i * args.batch as u64,
            )
        })
        .collect();

    let mut step = |step: u64| -> anyhow::Result<()> {
        let _hot = crate::model::parallel::hot();
        let batch = &batches[step as usize % batches.len()];
        {
            let _zero = pass_profile::region(Pass::ZeroGradients, 0, grads.len() * 4);
            crate::model::parallel::fill(&mut grads, 0.0);
        }
        let opts = StepOptions {
            mlm_scale: 1.0 / batch.masked_positions.len().max(1) as f32,
            nsp_scale: 0.0,
            dropout: Some(DropoutKey { seed: 0, step }),
            report_ready: false,
        };
        model.forward_backward(&params, &mut grads, batch, &opts, &mut |_, _| {})?;
        clip_grad_norm(&mut grads, 1.0);
        opt.step(&mut params, &grads, 1e-4);
        Ok(())
    };
    step(0)?;
    gemm::reset_stats();
    bench_roofline::reset();
    let start = Instant::now();
    let cpu_start = cpu_seconds();
    for s in 1..=args.steps as u64 {
        step(s)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_start;
    let stats = gemm::stats();
    let passes = pass_profile::totals();
    let s_per_step = elapsed / args.steps as f64;
    let real_tokens: usize = batches.iter().map(Batch::real_tokens).sum();
    let real_per_step = real_tokens as f64 / batches.len() as f64;
    let backends: serde_json::Map<String, serde_json::Value> = gemm::CLASSES
        .iter()
        .zip(stats.class_flops)
        .filter(|(_, flops)| flops.iter().any(|&f| f > 0))
        .map(|(class, flops)| {
            let used: Vec<&str> = gemm::BACKENDS
                .iter()
                .zip(flops)
                .filter(|(_, f)| *f > 0)
                .map(|(b, _)| *b)
                .collect();
            (class.to_string(), serde_json::json!(used.join("+")))
        })
        .collect();
    let total_flops = stats.flops.max(1) as f64;
    let classes: serde_json::Map<String, serde_json::Value> = gemm::CLASSES
        .iter()
        .enumerate()
        .filter(|(c, _)| stats.class_flops[*c].iter().any(|&f| f > 0))
        .map(|(c, class)| {
            let flops: u64 = stats.class_flops[c].iter().sum();
            let secs = stats.class_seconds[c];
            let value = serde_json::json!({
                "flop_share": flops as f64 / total_flops,
                "time_share": secs / elapsed,
                "gflops": if secs > 0.0 { flops as f64 / secs / 1e9 } else { 0.0 },
            });
            (class.to_string(), value)
        })
        .collect();
    // The step's peak, read before the bandwidth probe: its buffers (256 MiB a thread) would
    // be the peak's largest share.
    let peak_rss = peak_rss_mib();
    let bandwidth = bench_roofline::copy_bandwidth_gb_s(args.threads);
    let saved = model.saved_activation_bytes();
    let line = serde_json::json!({
        "config": args.config,
        "threads": args.threads,
        "batch": args.batch,
        "seq": args.seq,
        "vocab": args.vocab,
        "steps": args.steps,
        "s_per_step": s_per_step,
        "cpu_s_per_step": cpu / args.steps as f64,
        "tokens_per_s": (args.batch * args.seq) as f64 / s_per_step,
        "pad_fraction": 1.0 - real_per_step / (args.batch * args.seq) as f64,
        "real_tokens_per_s": real_per_step / s_per_step,
        "unpadding": !args.keep_padding,
        "gflops": stats.flops as f64 / elapsed / 1e9,
        "sgemm_share": stats.seconds / elapsed,
        "peak_rss_mib": peak_rss,
        "openblas_core": crate::blas_core::core_name(),
        "precision_setting": args.precision.as_str(),
        "precision": precision.as_str(),
        "bf16_support": support.detail,
        "gemm_backends": backends,
        "gemm_classes": classes,
        "bf16_rate_share": stats.bf16_native_share(),
        "onednn_reference_calls": bf16::reference_kernel_calls(),
        "onednn_gemm_jit_calls": bf16::gemm_jit_kernel_calls(),
        "copy_bandwidth_gb_s": bandwidth,
        "passes": bench_roofline::table(&passes, args.steps, s_per_step, bandwidth),
        "saved_activation_mib": saved as f64 / (1 << 20) as f64,
        "saved_activation_bytes_per_token": saved as f64 / (args.batch * args.seq) as f64,
    });
    println!("{line}");
    Ok(())
}
