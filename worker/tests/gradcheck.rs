//! Finite-difference gradient checks of the whole model in f64 (every parameter of a small
//! BERT, padding, masked positions, NSP, dropout on), for each activation; and the
//! micro-batch invariance of dropout.

use keel_proto::config::{BertConfig, HiddenAct};
use keel_proto::params::{Heads, ParamLayout};
use keel_worker::batch::Batch;
use keel_worker::model::{Bert, DropoutKey, LossSums, StepOptions, init_params};
use ndarray::Array2;

fn small_config(act: HiddenAct) -> BertConfig {
    BertConfig {
        vocab_size: 23,
        hidden_size: 8,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 12,
        hidden_act: act,
        max_position_embeddings: 9,
        // Larger weights than BERT's 0.02 so every path carries signal.
        initializer_range: 0.4,
        layer_norm_eps: 1e-12,
        ..BertConfig::preset("tiny", 23).unwrap()
    }
}

/// Three sequences of 7 tokens, the last two padded, 5 masked positions, NSP labels.
fn small_batch() -> Batch {
    let ids = [
        [2, 5, 9, 4, 11, 3, 7],
        [2, 4, 13, 3, 8, 0, 0],
        [2, 17, 4, 3, 0, 0, 0],
    ];
    let types = [
        [0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
    ];
    let lens = [7, 5, 4];
    let (b, t) = (3, 7);
    Batch {
        input_ids: Array2::from_shape_fn((b, t), |(i, j)| ids[i][j]),
        token_type_ids: Array2::from_shape_fn((b, t), |(i, j)| types[i][j]),
        attention_mask: Array2::from_shape_fn((b, t), |(i, j)| u8::from(j < lens[i])),
        masked_positions: vec![1, 3, 5, 8, 16],
        masked_labels: vec![6, 20, 3, 1, 12],
        next_sentence_labels: Some(vec![0, 1, 1]),
        sample_ids: vec![10, 11, 12],
    }
}

fn params_f64(config: &BertConfig, layout: &ParamLayout, seed: u64) -> Vec<f64> {
    let mut p: Vec<f64> = init_params(config, layout, seed)
        .into_iter()
        .map(f64::from)
        .collect();
    // Jitter the biases and LayerNorms (zeros and ones at init) so their gradients are generic.
    for (i, v) in p.iter_mut().enumerate() {
        *v += 0.1 * ((i as f64 * 0.7).sin());
    }
    p
}

fn loss(
    model: &mut Bert<f64>,
    params: &[f64],
    batch: &Batch,
    opts: &StepOptions<f64>,
) -> (f64, Vec<f64>) {
    let mut grads = vec![0.0; params.len()];
    let s: LossSums<f64> = model
        .forward_backward(params, &mut grads, batch, opts, &mut |_, _| {})
        .unwrap();
    (
        opts.mlm_scale * s.mlm_loss_sum + opts.nsp_scale * s.nsp_loss_sum,
        grads,
    )
}

fn gradcheck(act: HiddenAct, heads: Heads, dropout: Option<DropoutKey>) {
    let config = small_config(act);
    let layout = ParamLayout::bert(&config, heads);
    let mut params = params_f64(&config, &layout, 3);
    let batch = small_batch();
    let mut model = Bert::<f64>::new(&config, heads).unwrap();
    let opts = StepOptions {
        mlm_scale: 0.3,
        nsp_scale: 0.7,
        dropout,
        report_ready: false,
    };
    let (_, grads) = loss(&mut model, &params, &batch, &opts);
    let scale = grads.iter().fold(0.0f64, |m, g| m.max(g.abs()));
    assert!(scale > 1e-3);
    let h = 1e-5;
    let mut worst = (0.0, String::new());
    for entry in layout.entries() {
        for i in entry.range() {
            let orig = params[i];
            params[i] = orig + h;
            let up = loss(&mut model, &params, &batch, &opts).0;
            params[i] = orig - h;
            let down = loss(&mut model, &params, &batch, &opts).0;
            params[i] = orig;
            let fd = (up - down) / (2.0 * h);
            let err = (fd - grads[i]).abs() / scale;
            if err > worst.0 {
                worst = (
                    err,
                    format!(
                        "{}[{}]: fd {fd} analytic {}",
                        entry.name,
                        i - entry.offset,
                        grads[i]
                    ),
                );
            }
        }
    }
    assert!(
        worst.0 < 1e-7,
        "{act:?} {heads:?} dropout {dropout:?}: worst {:e} at {}",
        worst.0,
        worst.1
    );
}

#[test]
fn whole_model_gelu_pretraining_with_dropout() {
    gradcheck(
        HiddenAct::Gelu,
        Heads::PreTraining,
        Some(DropoutKey { seed: 1, step: 2 }),
    );
}

#[test]
fn whole_model_gelu_masked_lm_eval() {
    gradcheck(HiddenAct::Gelu, Heads::MaskedLm, None);
}

#[test]
fn whole_model_gelu_new_pretraining() {
    gradcheck(
        HiddenAct::GeluNew,
        Heads::PreTraining,
        Some(DropoutKey { seed: 5, step: 0 }),
    );
}

#[test]
fn whole_model_relu_masked_lm() {
    gradcheck(
        HiddenAct::Relu,
        Heads::MaskedLm,
        Some(DropoutKey { seed: 9, step: 7 }),
    );
}

/// The rows of `batch` in `rows`, cut to `t` tokens, with the masked positions renumbered.
fn sub_batch(batch: &Batch, rows: std::ops::Range<usize>, t: usize) -> Batch {
    let full_t = batch.seq_len();
    let (mut pos, mut labels) = (Vec::new(), Vec::new());
    for (&p, &l) in batch.masked_positions.iter().zip(&batch.masked_labels) {
        let (r, c) = (p / full_t, p % full_t);
        if rows.contains(&r) {
            assert!(c < t);
            pos.push((r - rows.start) * t + c);
            labels.push(l);
        }
    }
    let cut = |a: &Array2<u32>| a.slice(ndarray::s![rows.clone(), ..t]).to_owned();
    Batch {
        input_ids: cut(&batch.input_ids),
        token_type_ids: cut(&batch.token_type_ids),
        attention_mask: batch
            .attention_mask
            .slice(ndarray::s![rows.clone(), ..t])
            .to_owned(),
        masked_positions: pos,
        masked_labels: labels,
        next_sentence_labels: batch
            .next_sentence_labels
            .as_ref()
            .map(|l| l[rows.clone()].to_vec()),
        sample_ids: batch.sample_ids[rows].to_vec(),
    }
}

#[test]
fn dropout_depends_on_samples_not_on_the_micro_batch_split() {
    let config = small_config(HiddenAct::Gelu);
    let layout = ParamLayout::bert(&config, Heads::PreTraining);
    let params = params_f64(&config, &layout, 4);
    let batch = small_batch();
    let mut model = Bert::<f64>::new(&config, Heads::PreTraining).unwrap();
    let opts = StepOptions {
        mlm_scale: 1.0,
        nsp_scale: 1.0,
        dropout: Some(DropoutKey { seed: 3, step: 1 }),
        report_ready: false,
    };
    let (whole, whole_grads) = loss(&mut model, &params, &batch, &opts);
    // Split 1 + 2 rows, the second micro-batch padded only to its own longest row (5).
    let mut grads = vec![0.0; params.len()];
    let mut total = 0.0;
    for part in [sub_batch(&batch, 0..1, 7), sub_batch(&batch, 1..3, 5)] {
        let s = model
            .forward_backward(&params, &mut grads, &part, &opts, &mut |_, _| {})
            .unwrap();
        total += s.mlm_loss_sum + s.nsp_loss_sum;
    }
    assert!(
        (total - whole).abs() < 1e-12 * whole.abs(),
        "{total} vs {whole}"
    );
    let diff = grads
        .iter()
        .zip(&whole_grads)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(diff < 1e-12, "grad diff {diff:e}");
    // Dropout is really on: eval mode gives another loss, and another step another mask.
    let eval = loss(
        &mut model,
        &params,
        &batch,
        &StepOptions {
            dropout: None,
            ..opts
        },
    )
    .0;
    assert!((eval - whole).abs() > 1e-6);
    let other = loss(
        &mut model,
        &params,
        &batch,
        &StepOptions {
            dropout: Some(DropoutKey { seed: 3, step: 2 }),
            ..opts
        },
    )
    .0;
    assert!((other - whole).abs() > 1e-6);
}

#[test]
fn bad_batches_are_errors() {
    let config = small_config(HiddenAct::Gelu);
    let layout = ParamLayout::bert(&config, Heads::PreTraining);
    let params = params_f64(&config, &layout, 4);
    let mut model = Bert::<f64>::new(&config, Heads::PreTraining).unwrap();
    let mut grads = vec![0.0; params.len()];
    let opts = StepOptions {
        mlm_scale: 1.0,
        nsp_scale: 1.0,
        dropout: None,
        report_ready: false,
    };
    let mut run = |b: &Batch| {
        model
            .forward_backward(&params, &mut grads, b, &opts, &mut |_, _| {})
            .map(|_| ())
    };
    let mut b = small_batch();
    b.input_ids[[1, 2]] = 23;
    assert!(matches!(
        run(&b),
        Err(keel_worker::model::ModelError::OutOfRange {
            field: "input_ids",
            ..
        })
    ));
    let mut b = small_batch();
    b.masked_positions[0] = 21;
    assert!(matches!(
        run(&b),
        Err(keel_worker::model::ModelError::OutOfRange {
            field: "masked_positions",
            ..
        })
    ));
    let mut b = small_batch();
    b.next_sentence_labels = None;
    assert!(matches!(
        run(&b),
        Err(keel_worker::model::ModelError::MissingNextSentenceLabels)
    ));
    let mut long = small_batch();
    long.input_ids = Array2::zeros((3, 10));
    long.token_type_ids = Array2::zeros((3, 10));
    long.attention_mask = Array2::ones((3, 10));
    assert!(matches!(
        run(&long),
        Err(keel_worker::model::ModelError::SequenceTooLong { .. })
    ));
    let mut short = vec![0.0; 5];
    assert!(matches!(
        model.forward_backward(&params, &mut short, &small_batch(), &opts, &mut |_, _| {}),
        Err(keel_worker::model::ModelError::BufferLength {
            buffer: "grads",
            ..
        })
    ));
}
