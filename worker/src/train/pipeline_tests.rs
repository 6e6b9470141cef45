//! Tests of the pipeline: its masking is the spec's, bit for bit.

use super::*;
use crate::data::MaskingMode;
use keel_proto::shard::{Sequence, ShardWriter};
use keel_proto::tokenizer::SpecialIds;

const VOCAB: usize = 64;
const SEQUENCES: u64 = 12;

fn spec(data: &str) -> JobSpec {
    let text = format!(
        "[data]\ncorpus = [\"/corpus.txt\"]\nvocab_size = 1000\nmax_seq_length = 32\n{data}\n\
         [model]\npreset = \"tiny\"\n[train]\nmicro_batch_size = 2\nmax_steps = 10\nseed = 77\n"
    );
    JobSpec::from_toml_str(&text, "job.toml").unwrap()
}

/// The masking config exactly as the training loop built it by hand before it used
/// `MaskingConfig::from_spec` (what today's checkpoints were trained with).
fn hand_built(spec: &JobSpec) -> MaskingConfig {
    MaskingConfig {
        masked_lm_prob: spec.data.masked_lm_prob,
        max_predictions_per_seq: spec.data.max_predictions_per_seq,
        whole_word: spec.data.whole_word_masking,
        mode: match spec.data.dupe_factor {
            0 => MaskingMode::Dynamic,
            d => MaskingMode::Static {
                dupe_factor: u64::from(d),
            },
        },
    }
}

fn vocab() -> MaskingVocab {
    let mut tokens: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for id in tokens.len()..VOCAB {
        tokens.push(if id % 3 == 0 {
            format!("##p{id}")
        } else {
            format!("w{id}")
        });
    }
    let special = SpecialIds {
        pad: 0,
        unk: 1,
        cls: 2,
        sep: 3,
        mask: 4,
    };
    MaskingVocab::new(&tokens, special)
}

/// A shard of [`SEQUENCES`] sequences of 20..30 tokens with global indices `0..`.
fn shard(dir: &std::path::Path) -> ShardReader {
    let path = dir.join("shard.keel");
    let mut w = ShardWriter::create(&path, [0; 32], VOCAB).unwrap();
    for g in 0..SEQUENCES {
        let len = 20 + (g as usize % 10);
        let mut ids: Vec<u32> = (0..len)
            .map(|k| 5 + ((g as u32 * 7 + k as u32 * 13) % (VOCAB as u32 - 5)))
            .collect();
        ids[0] = 2;
        ids[len / 2] = 3;
        ids[len - 1] = 3;
        let seq = Sequence {
            global_index: g,
            token_type_ids: (0..len).map(|k| u32::from(k > len / 2)).collect(),
            ids,
            nsp_label: None,
        };
        w.push(&seq, g).unwrap();
    }
    w.finish().unwrap();
    ShardReader::open(&path).unwrap()
}

fn pipeline(spec: &JobSpec, dir: &std::path::Path) -> Pipeline {
    let plan = WorkerPlan::with_global_batch(SEQUENCES, 4, 1, 0, 2).unwrap();
    Pipeline::new(spec, shard(dir), plan, vocab())
}

/// Micro-batch `j` of `step` built by hand from `masking`, as the loop did before the split.
fn by_hand(p: &Pipeline, masking: &MaskingConfig, step: u64, j: u32) -> Batch {
    let mb = p.plan.micro_batch(step, j).unwrap();
    let masked: Vec<_> = mb
        .sequence_indices
        .iter()
        .map(|&g| {
            let seq = p.shard.find_global(g).unwrap();
            let m = mask_sequence(&seq, 77, mb.epoch, masking, &p.vocab);
            (seq, m)
        })
        .collect();
    collate(&masked, &mb.sample_ids, 32).unwrap()
}

#[test]
fn the_pipeline_masks_exactly_as_the_spec_says() {
    let dir = tempfile::tempdir().unwrap();
    for data in [
        "masked_lm_prob = 0.4\nmax_predictions_per_seq = 7\nwhole_word_masking = true\ndupe_factor = 3",
        "masked_lm_prob = 0.25\nmax_predictions_per_seq = 3\nwhole_word_masking = false\ndupe_factor = 0",
        "",
    ] {
        let spec = spec(data);
        let p = pipeline(&spec, dir.path());
        assert_eq!(*p.masking(), hand_built(&spec), "{data}");
        assert_eq!(*p.masking(), MaskingConfig::from_spec(&spec.data), "{data}");
        assert_eq!(p.grad_accum(), 2);
        for step in [0u64, 1, 2, 5] {
            let batches = p.micro_batches(step).unwrap();
            assert_eq!(batches.len(), 2);
            for (j, batch) in batches.iter().enumerate() {
                assert_eq!(
                    *batch,
                    by_hand(&p, &hand_built(&spec), step, j as u32),
                    "{data}"
                );
                assert_eq!(batch.input_ids.dim(), (2, 32));
            }
        }
    }
}

#[test]
fn the_comparison_sees_a_masking_that_is_not_the_spec() {
    // The check above would fail if the pipeline masked with other settings: a config that
    // differs from the spec gives other batches.
    let dir = tempfile::tempdir().unwrap();
    let spec = spec("masked_lm_prob = 0.4\nmax_predictions_per_seq = 7\nwhole_word_masking = true");
    let p = pipeline(&spec, dir.path());
    let other = MaskingConfig {
        masked_lm_prob: 0.15,
        ..hand_built(&spec)
    };
    let differs =
        (0..3).any(|step| p.micro_batches(step).unwrap()[0] != by_hand(&p, &other, step, 0));
    assert!(differs);
}

#[test]
fn heldout_batches_use_the_salted_seed_at_epoch_zero() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec("");
    let p = pipeline(&spec, dir.path());
    let heldout_dir = dir.path().join("heldout");
    std::fs::create_dir(&heldout_dir).unwrap();
    let heldout = shard(&heldout_dir);
    let batch = p.heldout_batch(&heldout, &[0, 3, 5], 9).unwrap();
    let masked: Vec<_> = [0usize, 3, 5]
        .iter()
        .map(|&i| {
            let seq = heldout.get(i).unwrap();
            let m = mask_sequence(&seq, 77 ^ EVAL_SEED_SALT, 0, &hand_built(&spec), &p.vocab);
            (seq, m)
        })
        .collect();
    assert_eq!(batch, collate(&masked, &[0, 3, 5], 32).unwrap());
    assert!(matches!(
        p.heldout_batch(&heldout, &[SEQUENCES as usize], 9),
        Err(TrainError::Data { step: 9, .. })
    ));
}
