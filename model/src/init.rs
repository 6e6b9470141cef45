//! Parameter initialisation as HF's `BertPreTrainedModel._init_weights`: Linear and Embedding
//! weights ~ N(0, initializer_range), biases 0, LayerNorm weight 1 and bias 0, the
//! `pad_token_id` row of the word embeddings 0, `cls.predictions.bias` 0.

use keel_proto::config::BertConfig;
use keel_proto::params::ParamLayout;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;

/// A flat parameter buffer `[layout.total_len()]` initialised from `seed`: a pure function of
/// `(config, layout, seed)`. Each tensor draws from its own ChaCha stream keyed by its name,
/// so adding a head does not change the other tensors.
pub fn init_params(config: &BertConfig, layout: &ParamLayout, seed: u64) -> Vec<f32> {
    let mut params = vec![0.0f32; layout.total_len()];
    let std = config.initializer_range;
    for entry in layout.entries() {
        let values = &mut params[entry.range()];
        if entry.name.contains("LayerNorm") {
            let fill = if entry.name.ends_with(".weight") {
                1.0
            } else {
                0.0
            };
            values.fill(fill);
        } else if entry.name.ends_with(".weight") {
            let mut rng = ChaCha12Rng::seed_from_u64(seed);
            rng.set_stream(fnv1a(&entry.name));
            for v in values.iter_mut() {
                *v = (std * standard_normal(&mut rng)) as f32;
            }
            if entry.offset == layout.modules().embeddings.word.offset {
                let c = entry.shape[1];
                let pad = config.pad_token_id as usize;
                values[pad * c..(pad + 1) * c].fill(0.0);
            }
        }
        // Biases (including cls.predictions.bias) stay 0.
    }
    params
}

/// FNV-1a 64 of a name: the stream id of its tensor.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// One N(0, 1) draw by the Box-Muller transform (Box & Muller 1958).
fn standard_normal(rng: &mut impl Rng) -> f64 {
    // u1 in (0, 1] so that ln(u1) is finite.
    let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_proto::params::Heads;

    #[test]
    fn follows_hf_init_and_is_a_function_of_the_seed() {
        let config = BertConfig::preset("tiny", 300).unwrap();
        let layout = ParamLayout::bert(&config, Heads::PreTraining);
        let a = init_params(&config, &layout, 5);
        assert_eq!(a, init_params(&config, &layout, 5));
        assert_ne!(a, init_params(&config, &layout, 6));
        for e in layout.entries() {
            let v = &a[e.range()];
            if e.name.contains("LayerNorm.weight") {
                assert!(v.iter().all(|&x| x == 1.0));
            } else if e.name.ends_with(".bias") {
                assert!(v.iter().all(|&x| x == 0.0), "{}", e.name);
            } else if e.len > 10_000 {
                let mean = v.iter().map(|&x| x as f64).sum::<f64>() / e.len as f64;
                let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / e.len as f64;
                assert!(mean.abs() < 0.002, "{} mean {mean}", e.name);
                assert!(
                    (var.sqrt() - 0.02).abs() < 0.001,
                    "{} std {}",
                    e.name,
                    var.sqrt()
                );
            }
        }
        let word = layout
            .find("bert.embeddings.word_embeddings.weight")
            .unwrap();
        assert!(a[word.offset..word.offset + 128].iter().all(|&x| x == 0.0));
        // MaskedLm layout: shared tensors get the same values.
        let mlm = ParamLayout::bert(&config, Heads::MaskedLm);
        let b = init_params(&config, &mlm, 5);
        let q = "bert.encoder.layer.1.attention.self.query.weight";
        assert_eq!(
            &a[layout.find(q).unwrap().range()],
            &b[mlm.find(q).unwrap().range()]
        );
    }
}
