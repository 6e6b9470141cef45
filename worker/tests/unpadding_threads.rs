//! Leaving padding rows out, against computing every padded row (f64, dropout on, MLM and NSP
//! heads): one model reused across batches of other shapes and layouts (packed, unpacked,
//! refused), with and without the split word-embedding lookup; and with 2 to 16 threads, where
//! the packing's copies and dropout are cut among them. A separate test binary, because the
//! thread count is process-wide. (First written by a reviewer of the change, 2026-12-04.)

use keel_proto::params::{Heads, ParamLayout};
use keel_worker::batch::Batch;
use keel_worker::model::{
    Bert, DropoutKey, LookupGrads, StepOptions, init_params, set_blas_threads,
};

mod padded;
use padded::{VOCAB, batch, config};

fn lengths(b: usize, t: usize, seed: usize) -> Vec<usize> {
    (0..b).map(|i| 1 + (i * 7 + seed * 3) % t).collect()
}

fn params() -> Vec<f64> {
    let config = config();
    let layout = ParamLayout::bert(&config, Heads::PreTraining);
    init_params(&config, &layout, 3)
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

/// A training step's loss, its gradients (the lookup share added back when `split`) and the
/// eval loss.
fn step(model: &mut Bert<f64>, params: &[f64], batch: &Batch, split: bool) -> (f64, Vec<f64>, f64) {
    let opts = StepOptions {
        mlm_scale: 1.0,
        nsp_scale: 1.0,
        dropout: Some(DropoutKey { seed: 5, step: 9 }),
        report_ready: false,
    };
    let mut grads = vec![0.0; params.len()];
    let sums = if split {
        let mut presence = vec![0f32; VOCAB as usize];
        for &id in batch.input_ids.iter() {
            presence[id as usize] = 1.0;
        }
        let mut lookup = LookupGrads::<f64>::from_presence(&presence, config().hidden_size);
        let sums = model
            .forward_backward_split_lookup(
                params,
                &mut grads,
                &mut lookup,
                batch,
                &opts,
                &mut |_, _| {},
            )
            .unwrap();
        lookup
            .add_into(&mut grads[model.word_embeddings_range()])
            .unwrap();
        sums
    } else {
        model
            .forward_backward(params, &mut grads, batch, &opts, &mut |_, _| {})
            .unwrap()
    };
    let eval = model.forward_loss(params, batch).unwrap();
    (
        sums.mlm_loss_sum + sums.nsp_loss_sum,
        grads,
        eval.mlm_loss_sum + eval.nsp_loss_sum,
    )
}

/// The same step on a fresh model that computes every padded row.
fn padded(params: &[f64], batch: &Batch, split: bool) -> (f64, Vec<f64>, f64) {
    let mut model = Bert::<f64>::new(&config(), Heads::PreTraining).unwrap();
    model.set_unpadding(None);
    step(&mut model, params, batch, split)
}

fn assert_same(what: &str, got: (f64, Vec<f64>, f64), want: (f64, Vec<f64>, f64)) {
    let scale = want.1.iter().fold(1e-300f64, |m, x| m.max(x.abs()));
    let diff = got
        .1
        .iter()
        .zip(&want.1)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(
        got.1.iter().all(|x| x.is_finite()),
        "{what}: finite gradients"
    );
    assert!(
        diff <= 1e-12 * scale,
        "{what}: gradients differ by {:e}",
        diff / scale
    );
    assert!(
        (got.0 - want.0).abs() <= 1e-12 * want.0.abs(),
        "{what}: training loss"
    );
    assert!(
        (got.2 - want.2).abs() <= 1e-12 * want.2.abs(),
        "{what}: eval loss"
    );
}

/// The thread count is process-wide and this file's tests run in parallel.
static THREAD_COUNT: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn one_model_across_batches_of_other_shapes() {
    let _threads = THREAD_COUNT.lock().unwrap_or_else(|e| e.into_inner());
    set_blas_threads(1);
    let params = params();
    // (lengths, t, a masked position on padding, packed with a multiple of 1)
    let batches = [
        (lengths(23, 32, 0), 32, false, true),
        (vec![16; 4], 16, false, false),
        (lengths(7, 20, 1), 20, false, true),
        (lengths(30, 48, 2), 48, true, false),
        (lengths(40, 40, 3), 40, false, true),
        (lengths(9, 64, 4), 64, false, true),
        (lengths(23, 32, 0), 32, false, true),
    ];
    for multiple in [1usize, 8, 64] {
        for split in [false, true] {
            let mut model = Bert::<f64>::new(&config(), Heads::PreTraining).unwrap();
            model.set_unpadding(Some(multiple));
            for (k, (lens, t, on_padding, packs)) in batches.iter().enumerate() {
                let batch = batch(lens, *t, *on_padding);
                let what = format!("multiple {multiple}, split {split}, batch {k}");
                let got = step(&mut model, &params, &batch, split);
                let rows = model.rows_computed();
                let real = batch.real_tokens().next_multiple_of(multiple);
                if *packs && real < batch.input_ids.len() {
                    assert_eq!(rows, real, "{what}: rows");
                } else if !*packs {
                    assert_eq!(rows, batch.input_ids.len(), "{what}: rows");
                }
                assert_same(&what, got, padded(&params, &batch, split));
            }
        }
    }
}

#[test]
fn many_threads() {
    let _threads = THREAD_COUNT.lock().unwrap_or_else(|e| e.into_inner());
    let params = params();
    for (b, t) in [(64usize, 32usize), (97, 24), (5, 128)] {
        let lens: Vec<usize> = (0..b)
            .map(|i| if i % 13 == 0 { t } else { 1 + (i * 11) % t })
            .collect();
        let batch = batch(&lens, t, false);
        set_blas_threads(1);
        let want = padded(&params, &batch, false);
        for threads in [2usize, 3, 4, 7, 16] {
            set_blas_threads(threads);
            for multiple in [1usize, 64] {
                let mut model = Bert::<f64>::new(&config(), Heads::PreTraining).unwrap();
                model.set_unpadding(Some(multiple));
                let got = step(&mut model, &params, &batch, false);
                assert!(model.rows_computed() < b * t, "packed");
                let what = format!("b {b}, t {t}, {threads} threads, multiple {multiple}");
                assert_same(&what, got, want.clone());
            }
        }
        set_blas_threads(1);
    }
}
