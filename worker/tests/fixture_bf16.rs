//! bf16 GEMMs against PyTorch's fp32/fp64 reference gradients of the bert-micro fixtures.
//!
//! # The tolerance, derived
//! bf16 keeps 8 significant bits, so rounding an input to it (nearest even) has relative error
//! at most `u = 2^-8`. A product of two rounded inputs is exact in f32 (16 significant bits)
//! and off the exact product by at most `2u + u^2` of its size; the fp32 accumulation adds
//! `k * 2^-24` more, negligible here. So one bf16 GEMM's output errs by at most
//! `(2u + u^2) * sum_k |a_ik b_kj|`, i.e. at most `2.01 u * kappa` of its size, where `kappa`
//! (>= 1) is the cancellation factor `sum |a b| / |sum a b|`. To first order the errors of the
//! GEMMs a value passes through add up; the longest chain here (a word-embedding gradient) goes
//! through every GEMM of the forward (6 per layer in series: QKV, Q K^T, P V, output, FFN in,
//! FFN out; then the MLM transform and decoder) and of the backward (as many again), so
//! `N = 2 * (6 L + 2)` GEMMs; `L = 2` layers: `N = 28`. Summed in the worst case that is
//! `N * 2.01 u = 0.22` of a tensor's size; the rounding errors of different GEMMs are
//! independent with mean zero, so they add as a root sum of squares: `sqrt(N) * 2.01 u * kappa`.
//! The fixtures' activations and weights are O(1) and O(0.02) with no large cancellations, so
//! `kappa = 1`: the tolerance is `sqrt(28) * 2.01 / 256 = 0.041` for the largest error of a
//! tensor relative to its largest element (`common::rel_err`); measured 0.007-0.009 (printed).
//! The MLM loss, a sum over masked tokens of log-softmaxes of one decoder GEMM's output, gets
//! the single-GEMM bound `2.01 u = 0.0079`; measured ~1e-5 to 4e-5.
//!
//! The test also requires the bf16 errors to be larger than the fp32 test's tolerance (1e-4)
//! for some tensor: otherwise the GEMMs did not run in bf16 at all.

mod common;

use common::{Fixture, fixture, rel_err, tensors};
use keel_proto::precision::Precision;
use keel_proto::weights::{load_safetensors, load_safetensors_f64};
use keel_worker::model::{Bert, Element, StepOptions};

/// `u`: unit roundoff of bf16.
const U: f64 = 1.0 / 256.0;
/// Cancellation factor allowed for (see the module doc).
const KAPPA: f64 = 1.0;

/// bf16 gradients of the fixture vs PyTorch's; returns the largest per-tensor error.
fn check<A: Element>(f: &Fixture, params: &[A]) -> f64 {
    let mut model = Bert::<A>::new(&f.config, f.heads).unwrap();
    model.set_precision(Precision::Bf16);
    assert_eq!(model.precision(), Precision::Bf16);
    let mut grads = vec![A::zero(); f.layout.total_len()];
    let opts = StepOptions {
        mlm_scale: A::one() / A::of(f.batch.masked_positions.len() as f64),
        nsp_scale: A::one() / A::of(f.batch.batch_size() as f64),
        dropout: None,
        report_ready: false,
    };
    let sums = model
        .forward_backward(params, &mut grads, &f.batch, &opts, &mut |_, _| {})
        .unwrap();
    let layers = f.config.num_hidden_layers as f64;
    let n_gemms = 2.0 * (6.0 * layers + 2.0);
    let grad_tol = n_gemms.sqrt() * (2.0 * U + U * U) * KAPPA;
    let loss_tol = (2.0 * U + U * U) * KAPPA;

    let mlm_sum = f.expected["mlm_loss_sum"].as_f64().unwrap();
    let e = (sums.mlm_loss_sum.to64() - mlm_sum).abs() / mlm_sum;
    println!(
        "{}: mlm_loss_sum rel err {e:.3e} (tolerance {loss_tol:.3e})",
        f.dir
    );
    assert!(
        e < loss_tol,
        "mlm_loss_sum {} vs {mlm_sum}: {e:e}",
        sums.mlm_loss_sum
    );

    let want = tensors(f, "grads.safetensors");
    let mut worst: f64 = 0.0;
    for entry in f.layout.entries() {
        let got: Vec<f64> = grads[entry.range()].iter().map(|x| x.to64()).collect();
        let e = rel_err(&got, &want[&entry.name].1);
        worst = worst.max(e);
        assert!(
            e < grad_tol,
            "{}: bf16 grad rel err {e:e} > {grad_tol:e}",
            entry.name
        );
    }
    println!(
        "{}: largest bf16 gradient rel err {worst:.3e} (tolerance {grad_tol:.3e}, {n_gemms} GEMMs)",
        f.dir
    );
    assert!(
        worst > 1e-4,
        "bf16 gradients agree with fp32 to {worst:e}: the GEMMs did not round to bf16"
    );
    worst
}

#[test]
fn mlm_bf16_gradients_within_the_derived_tolerance() {
    let f = fixture("bert-micro-mlm");
    let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check::<f32>(&f, &params);
    // In f64 only the bf16 rounding of the GEMM inputs differs from the reference.
    let params = load_safetensors_f64(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check::<f64>(&f, &params);
}

#[test]
fn pretraining_bf16_gradients_within_the_derived_tolerance() {
    let f = fixture("bert-micro-pretraining");
    let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check::<f32>(&f, &params);
}

/// The same model with fp32 set explicitly reproduces the default path bit for bit; bf16
/// differs from it, and repeats itself bit for bit.
#[test]
fn explicit_fp32_is_the_default_path() {
    let f = fixture("bert-micro-mlm");
    let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    let run = |p: Option<Precision>| {
        let mut model = Bert::<f32>::new(&f.config, f.heads).unwrap();
        if let Some(p) = p {
            model.set_precision(p);
        }
        let mut grads = vec![0f32; f.layout.total_len()];
        let opts = StepOptions {
            mlm_scale: 1.0 / f.batch.masked_positions.len() as f32,
            nsp_scale: 1.0,
            dropout: None,
            report_ready: false,
        };
        model
            .forward_backward(&params, &mut grads, &f.batch, &opts, &mut |_, _| {})
            .unwrap();
        grads
    };
    let default = run(None);
    assert_eq!(run(Some(Precision::Fp32)), default);
    let bf16 = run(Some(Precision::Bf16));
    assert_ne!(bf16, default);
    // Deterministic: the same bf16 step twice gives the same bits.
    assert_eq!(run(Some(Precision::Bf16)), bf16);
}
