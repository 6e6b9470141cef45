//! The bf16 copies a layer keeps from its forward for its backward (`super::bf16_shared::keep`) give
//! the same bits as rounding every GEMM operand where it is used: they are the same roundings
//! of the same values, made fewer times. A stale or misplaced copy (an activation changed after
//! it was kept, a copy lent for the wrong slice) would change the gradients.

use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};
use keel_proto::precision::Precision;
use ndarray::Array2;

use super::{Bert, DropoutKey, StepOptions, init_params};
use crate::batch::Batch;

/// 3 sequences of 24 tokens with padding, masked positions in every real stretch.
fn batch(b: usize, t: usize, vocab: u32) -> Batch {
    let lens: Vec<usize> = (0..b).map(|i| t - (i * 5) % (t / 2)).collect();
    let masked: Vec<usize> = (0..b * t)
        .filter(|p| p % 6 == 2 && p % t < lens[p / t])
        .collect();
    Batch {
        input_ids: Array2::from_shape_fn((b, t), |(i, j)| {
            if j < lens[i] {
                5 + ((i * 31 + j * 17) as u32 % (vocab - 5))
            } else {
                0
            }
        }),
        token_type_ids: Array2::from_shape_fn((b, t), |(i, j)| u32::from(j >= lens[i] / 2)),
        attention_mask: Array2::from_shape_fn((b, t), |(i, j)| u8::from(j < lens[i])),
        masked_labels: masked
            .iter()
            .map(|&p| 5 + (p as u32 * 13) % (vocab - 5))
            .collect(),
        masked_positions: masked,
        next_sentence_labels: Some((0..b as u32).map(|i| i % 2).collect()),
        sample_ids: (40..40 + b as u64).collect(),
    }
}

/// One bf16 training step (dropout on): the loss and the gradients' bits.
/// `keep_copies: false` keeps no copy (every GEMM rounds its own operands, the reference).
fn step(config: &BertConfig, params: &[f32], batch: &Batch, keep_copies: bool) -> (f32, Vec<u32>) {
    let mut model = Bert::<f32>::new(config, Heads::PreTraining).expect("a valid config");
    model.set_precision(Precision::Bf16);
    if !keep_copies {
        model.keep_no_bf16_copies();
    }
    let mut grads = vec![0f32; params.len()];
    let opts = StepOptions {
        mlm_scale: 1.0,
        nsp_scale: 1.0,
        dropout: Some(DropoutKey { seed: 7, step: 3 }),
        report_ready: false,
    };
    let sums = model
        .forward_backward(params, &mut grads, batch, &opts, &mut |_, _| {})
        .expect("a valid batch");
    let loss = sums.mlm_loss_sum + sums.nsp_loss_sum;
    (loss, grads.iter().map(|g| g.to_bits()).collect())
}

#[test]
fn kept_bf16_copies_give_the_bits_of_rounding_at_each_gemm() {
    // BERT-tiny (2 layers, hidden 128, 2 heads) with a small vocabulary.
    let config = BertConfig::preset("tiny", 300).expect("a known preset");
    let layout = ParamLayout::bert(&config, Heads::PreTraining);
    let params = init_params(&config, &layout, 11);
    let batch = batch(3, 24, config.vocab_size as u32);
    if !super::bf16::support().native {
        println!(
            "SKIPPED: no native bf16 GEMM here ({}): nothing is kept on the emulated route",
            super::bf16::support().detail
        );
        return;
    }
    let kept = step(&config, &params, &batch, true);
    let rounded_at_each_gemm = step(&config, &params, &batch, false);
    assert_eq!(kept.0.to_bits(), rounded_at_each_gemm.0.to_bits(), "loss");
    let differ = kept
        .1
        .iter()
        .zip(&rounded_at_each_gemm.1)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(differ, 0, "{differ} of {} gradients differ", kept.1.len());
    assert!(
        kept.1.iter().any(|&g| f32::from_bits(g).abs() > 0.0),
        "gradients were computed"
    );
}
