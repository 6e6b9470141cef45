//! AdamW (5 steps, global-norm clip 1.0) and LAMB (1 step) against the PyTorch reference
//! fixtures, in f64 (to ~1e-9) and f32, starting from the fixture model on its batch.

mod common;

use common::{Fixture, fixture, rel_err, tensors};
use keel_proto::weights::{load_safetensors, load_safetensors_f64};
use keel_worker::model::{Bert, Element, StepOptions};
use keel_worker::optim::{AdamW, AdamWConfig, Lamb, LambConfig, Optimizer, clip_grad_norm};

fn f64s(v: &serde_json::Value) -> Vec<f64> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Gradient of the HF loss (mean MLM + mean NSP) at `params`, and that loss.
fn grad<A: Element>(model: &mut Bert<A>, f: &Fixture, params: &[A]) -> (f64, Vec<A>) {
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
    let mut loss = sums.mlm_loss_sum.to64() / sums.mlm_count as f64;
    if sums.nsp_count > 0 {
        loss += sums.nsp_loss_sum.to64() / sums.nsp_count as f64;
    }
    (loss, grads)
}

fn check_params<A: Element>(f: &Fixture, params: &[A], file: &str, tol: f64) {
    let want = tensors(f, file);
    for entry in f.layout.entries() {
        let got: Vec<f64> = params[entry.range()].iter().map(|x| x.to64()).collect();
        let e = rel_err(&got, &want[&entry.name].1);
        assert!(e < tol, "{file} {}: rel err {e:e}", entry.name);
    }
}

fn adamw_five_steps<A: Element>(f: &Fixture, mut params: Vec<A>, tol: f64) {
    let cfg = &f.expected["optimizer"]["adamw"];
    let betas = f64s(&cfg["betas"]);
    let config = AdamWConfig {
        beta1: betas[0],
        beta2: betas[1],
        eps: cfg["eps"].as_f64().unwrap(),
        weight_decay: cfg["weight_decay"].as_f64().unwrap(),
        bias_correction: cfg["bias_correction"].as_bool().unwrap(),
    };
    let lr = A::of(cfg["lr"].as_f64().unwrap());
    let clip = A::of(cfg["clip_global_norm"].as_f64().unwrap());
    let losses = f64s(&cfg["losses_before_each_step"]);
    let norms = f64s(&cfg["grad_norms_before_clipping"]);
    let mut model = Bert::<A>::new(&f.config, f.heads).unwrap();
    let mut opt = AdamW::<A>::new(&f.layout, config);
    for step in 0..cfg["steps"].as_u64().unwrap() as usize {
        let (loss, mut grads) = grad(&mut model, f, &params);
        assert!(
            (loss - losses[step]).abs() / losses[step] < tol,
            "step {step}: loss {loss} vs {}",
            losses[step]
        );
        let norm = clip_grad_norm(&mut grads, clip).to64();
        assert!(
            (norm - norms[step]).abs() / norms[step] < tol,
            "step {step}: norm {norm} vs {}",
            norms[step]
        );
        opt.step(&mut params, &grads, lr);
    }
    assert_eq!(opt.steps_taken(), 5);
    check_params(f, &params, "adamw_step5.safetensors", tol);

    // Restoring the state into a fresh optimizer continues identically.
    let mut again = AdamW::<A>::new(&f.layout, config);
    again.load_state(opt.steps_taken(), &opt.state()).unwrap();
    let (_, grads) = grad(&mut model, f, &params);
    let mut p1 = params.clone();
    opt.step(&mut p1, &grads, lr);
    let mut p2 = params.clone();
    again.step(&mut p2, &grads, lr);
    assert_eq!(p1, p2);
}

fn lamb_one_step<A: Element>(f: &Fixture, mut params: Vec<A>, tol: f64) {
    let cfg = &f.expected["optimizer"]["lamb"];
    assert_eq!(cfg["steps"].as_u64(), Some(1));
    assert_eq!(cfg["no_clipping"].as_bool(), Some(true));
    let betas = f64s(&cfg["betas"]);
    let config = LambConfig {
        beta1: betas[0],
        beta2: betas[1],
        eps: cfg["eps"].as_f64().unwrap(),
        weight_decay: cfg["weight_decay"].as_f64().unwrap(),
    };
    let mut model = Bert::<A>::new(&f.config, f.heads).unwrap();
    let mut opt = Lamb::<A>::new(&f.layout, config);
    let (_, grads) = grad(&mut model, f, &params);
    opt.step(&mut params, &grads, A::of(cfg["lr"].as_f64().unwrap()));
    check_params(f, &params, "lamb_step1.safetensors", tol);
    let ratios = cfg["trust_ratios"].as_object().unwrap();
    for (entry, &got) in f.layout.entries().iter().zip(opt.last_trust_ratios()) {
        let want = ratios
            .get(&entry.name)
            .map(|v| v.as_f64().unwrap())
            .unwrap_or(1.0);
        assert!(
            (got - want).abs() / want < tol,
            "{}: trust ratio {got} vs {want}",
            entry.name
        );
    }
}

#[test]
fn adamw_matches_torch_f64() {
    for name in ["bert-micro-mlm", "bert-micro-pretraining"] {
        let f = fixture(name);
        let params =
            load_safetensors_f64(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
        adamw_five_steps(&f, params, 1e-9);
    }
}

#[test]
fn adamw_matches_torch_f32() {
    for name in ["bert-micro-mlm", "bert-micro-pretraining"] {
        let f = fixture(name);
        let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
        adamw_five_steps(&f, params, 1e-4);
    }
}

#[test]
fn lamb_matches_reference_f64() {
    for name in ["bert-micro-mlm", "bert-micro-pretraining"] {
        let f = fixture(name);
        let params =
            load_safetensors_f64(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
        lamb_one_step(&f, params, 1e-9);
    }
}

#[test]
fn lamb_matches_reference_f32() {
    for name in ["bert-micro-mlm", "bert-micro-pretraining"] {
        let f = fixture(name);
        let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
        lamb_one_step(&f, params, 1e-4);
    }
}
