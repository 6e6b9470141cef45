//! Padded batches and the model config shared by the unpadding tests (`unpadding.rs`,
//! `unpadding_threads.rs`).

use keel_proto::config::BertConfig;
use keel_worker::batch::Batch;
use ndarray::Array2;

/// Vocabulary of [`config`].
pub const VOCAB: u32 = 97;

/// BERT-tiny with vocabulary [`VOCAB`] and dropout on.
pub fn config() -> BertConfig {
    BertConfig {
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        ..BertConfig::preset("tiny", VOCAB as usize).unwrap()
    }
}

/// Sequences of these real lengths padded to `t` (pad id 0); masked positions on real tokens
/// (every fifth position), and with `masked_on_padding` one more on the first padded
/// sequence's last (padding) position, which the model must refuse to pack; NSP labels.
pub fn batch(lens: &[usize], t: usize, masked_on_padding: bool) -> Batch {
    let b = lens.len();
    let mut masked: Vec<usize> = (0..b * t)
        .filter(|p| p % 5 == 2 && p % t < lens[p / t])
        .collect();
    if masked_on_padding && let Some(i) = lens.iter().position(|&l| l < t) {
        masked.push(i * t + t - 1);
    }
    Batch {
        input_ids: Array2::from_shape_fn((b, t), |(i, j)| {
            if j < lens[i] {
                5 + ((i * 31 + j * 17) as u32 % (VOCAB - 5))
            } else {
                0
            }
        }),
        token_type_ids: Array2::from_shape_fn((b, t), |(i, j)| {
            u32::from(j >= lens[i] / 2 && j < lens[i])
        }),
        attention_mask: Array2::from_shape_fn((b, t), |(i, j)| u8::from(j < lens[i])),
        masked_labels: masked
            .iter()
            .map(|&p| 5 + (p as u32 * 13) % (VOCAB - 5))
            .collect(),
        masked_positions: masked,
        next_sentence_labels: Some((0..b as u32).map(|i| i % 2).collect()),
        sample_ids: (100..100 + b as u64).collect(),
    }
}
