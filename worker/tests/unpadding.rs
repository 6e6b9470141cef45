//! Leaving padding rows out (`Bert::set_unpadding`, on by default) gives the losses and
//! gradients of computing every padded row: in f64 to 1e-12, in f32 and with bf16 GEMMs to
//! the rounding of GEMMs whose blocking depends on the row count. A batch with sequences of
//! many lengths, dropout on, both heads (MLM and NSP).

use keel_proto::params::{Heads, ParamLayout};
use keel_proto::precision::Precision;
use keel_worker::batch::Batch;
use keel_worker::model::bf16;
use keel_worker::model::{
    Bert, DropoutKey, Element, LossSums, StepOptions, UNPAD_ROW_MULTIPLE, init_params,
};

mod padded;
use padded::config;

/// `b` sequences of lengths from `t` down to 2 (every tenth full), padded to `t`; masked
/// positions on real tokens only.
fn batch(b: usize, t: usize) -> Batch {
    let lens: Vec<usize> = (0..b)
        .map(|i| {
            if i % 10 == 0 {
                t
            } else {
                2 + (i * 11) % (t - 2)
            }
        })
        .collect();
    padded::batch(&lens, t, false)
}

/// One training step's loss sums and gradients, then the eval losses, in one layout, and
/// the rows computed.
fn step<A: Element>(
    unpad: Option<usize>,
    precision: Precision,
    params: &[A],
    batch: &Batch,
) -> (LossSums<A>, Vec<A>, LossSums<A>, usize) {
    let mut model = Bert::<A>::new(&config(), Heads::PreTraining).unwrap();
    model.set_precision(precision);
    model.set_unpadding(unpad);
    let mut grads = vec![A::zero(); params.len()];
    let opts = StepOptions {
        mlm_scale: A::one(),
        nsp_scale: A::one(),
        dropout: Some(DropoutKey { seed: 5, step: 9 }),
        report_ready: false,
    };
    let sums = model
        .forward_backward(params, &mut grads, batch, &opts, &mut |_, _| {})
        .unwrap();
    let rows = model.rows_computed();
    let eval = model.forward_loss(params, batch).unwrap();
    assert_eq!(
        model.rows_computed(),
        rows,
        "eval computes the rows training did"
    );
    (sums, grads, eval, rows)
}

/// Largest difference of the two gradients, relative to the largest gradient.
fn rel_diff<A: Element>(a: &[A], b: &[A]) -> f64 {
    let scale = a.iter().fold(0.0f64, |m, x| m.max(x.to64().abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x.to64() - y.to64()).abs()));
    diff / scale
}

fn compare<A: Element>(precision: Precision, loss_tol: f64, grad_tol: f64) {
    let config = config();
    let layout = ParamLayout::bert(&config, Heads::PreTraining);
    let params: Vec<A> = init_params(&config, &layout, 3)
        .iter()
        .map(|&x| A::of(x as f64))
        .collect();
    let batch = batch(23, 32);
    let padding = batch.attention_mask.iter().filter(|&&m| m == 0).count();
    assert!(
        padding > 23 * 32 / 4,
        "a quarter of the batch or more should be padding"
    );
    let real = batch.real_tokens();
    let (padded, g_padded, eval_padded, rows) = step(None, precision, &params, &batch);
    assert_eq!(rows, 23 * 32);
    let (packed, g_packed, eval_packed, rows) =
        step(Some(UNPAD_ROW_MULTIPLE), precision, &params, &batch);
    assert_eq!(
        rows,
        real.next_multiple_of(UNPAD_ROW_MULTIPLE),
        "{real} real tokens"
    );
    assert!(rows < 23 * 32);
    assert!(g_padded.iter().all(|g| g.to64().is_finite()));
    assert!(g_padded.iter().any(|g| g.to64() != 0.0));
    for (what, a, b) in [
        ("train", &padded, &packed),
        ("eval", &eval_padded, &eval_packed),
    ] {
        assert_eq!(a.mlm_count, b.mlm_count, "{what}");
        assert_eq!(a.nsp_count, b.nsp_count, "{what}");
        for (name, x, y) in [
            ("mlm", a.mlm_loss_sum, b.mlm_loss_sum),
            ("nsp", a.nsp_loss_sum, b.nsp_loss_sum),
        ] {
            let (x, y) = (x.to64(), y.to64());
            assert!(
                (x - y).abs() <= loss_tol * x.abs(),
                "{what} {name} loss: padded {x}, packed {y}"
            );
        }
    }
    let d = rel_diff(&g_padded, &g_packed);
    assert!(
        d <= grad_tol,
        "gradients differ by {d:e} (tolerance {grad_tol:e})"
    );
}

#[test]
fn same_losses_and_gradients_in_f64() {
    compare::<f64>(Precision::Fp32, 1e-12, 1e-12);
}

/// f32: a GEMM's accumulation order may change with its row count, ~1e-7 relative per
/// product (measured here: 1.1e-8 of the largest gradient, losses equal).
#[test]
fn same_losses_and_gradients_in_f32() {
    compare::<f32>(Precision::Fp32, 1e-6, 1e-5);
}

/// bf16 GEMMs: the same bf16 roundings of the same values; where an accumulation order
/// changes, a different rounding of an fp32 sum can move a later bf16 rounding by one unit
/// (2^-8 relative) on the odd element (measured here: 3.1e-9 of the largest gradient, losses
/// equal, on an Intel Xeon with AMX).
#[test]
fn same_losses_and_gradients_with_bf16_gemms() {
    if !bf16::support().native {
        eprintln!(
            "skipped: this CPU has no native bf16 GEMMs ({})",
            bf16::support().detail
        );
        return;
    }
    compare::<f32>(Precision::Bf16, 1e-5, 1e-3);
}
