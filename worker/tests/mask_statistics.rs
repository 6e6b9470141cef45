//! Masking on real text: counts, 80/10/10 split, never special tokens, reproducibility,
//! static vs dynamic, whole-word grouping (English pieces, CJK characters), and collation.

use keel_proto::shard::Sequence;
use keel_proto::tokenizer::KeelTokenizer;
use keel_worker::data::masking::candidate_words;
use keel_worker::data::{
    CollateError, MaskedSequence, MaskingConfig, MaskingMode, MaskingVocab, collate, mask_sequence,
};

#[path = "../../fixtures/testdata.rs"]
mod testdata;
use testdata::in_repo;

fn tokenizer() -> KeelTokenizer {
    KeelTokenizer::from_vocab_file(&in_repo("fixtures/wordpiece/vocab.txt"), true).unwrap()
}

/// `[CLS] line [SEP]` sequences (at most 128 tokens) from the first lines of a corpus.
fn sequences(tok: &KeelTokenizer, rel: &str, count: usize) -> Vec<Sequence> {
    let text = std::fs::read_to_string(in_repo(rel)).unwrap();
    let s = tok.special();
    let mut out = Vec::new();
    for line in text.lines() {
        if out.len() == count {
            break;
        }
        let mut ids = tok.encode(line);
        if ids.len() < 4 {
            continue;
        }
        ids.truncate(126);
        let mut seq = vec![s.cls];
        seq.extend(ids);
        seq.push(s.sep);
        out.push(Sequence {
            global_index: out.len() as u64,
            token_type_ids: vec![0; seq.len()],
            ids: seq,
            nsp_label: None,
        });
    }
    out
}

#[test]
fn counts_and_80_10_10_split_match_bert() {
    let tok = tokenizer();
    let vocab = MaskingVocab::from_tokenizer(&tok);
    let s = tok.special();
    let config = MaskingConfig::default();
    let mut chosen = 0u64;
    let mut as_mask = 0u64;
    let mut kept = 0u64;
    let mut random = 0u64;
    let mut tokens = 0u64;
    for rel in ["corpora/en-kjv/kjv.txt", "corpora/en-fortunes/fortunes.txt"] {
        for seq in sequences(&tok, rel, 3000) {
            let m = mask_sequence(&seq, 42, 0, &config, &vocab);
            let len = seq.ids.len();
            let expected = ((len as f64 * 0.15).round_ties_even() as usize).clamp(1, 20);
            assert_eq!(m.masked_positions.len(), expected, "len {len}");
            assert!(m.masked_positions.windows(2).all(|w| w[0] < w[1]));
            tokens += len as u64;
            for (&p, &label) in m.masked_positions.iter().zip(&m.masked_labels) {
                assert_eq!(label, seq.ids[p]);
                assert!(label != s.cls && label != s.sep && label != s.pad);
                chosen += 1;
                let now = m.input_ids[p];
                if now == s.mask {
                    as_mask += 1;
                } else if now == label {
                    kept += 1;
                } else {
                    random += 1;
                    assert!(
                        !s.all().contains(&now),
                        "random replacement {now} is special"
                    );
                }
            }
            for p in 0..len {
                if !m.masked_positions.contains(&p) {
                    assert_eq!(m.input_ids[p], seq.ids[p], "unchosen tokens stay");
                }
            }
        }
    }
    let f = |x: u64| x as f64 / chosen as f64;
    let rate = chosen as f64 / tokens as f64;
    assert!((rate - 0.15).abs() < 0.02, "masked rate {rate}");
    assert!((f(as_mask) - 0.8).abs() < 0.015, "[MASK] {}", f(as_mask));
    assert!((f(kept) - 0.1).abs() < 0.01, "kept {}", f(kept));
    assert!((f(random) - 0.1).abs() < 0.01, "random {}", f(random));
}

#[test]
fn masks_are_pure_functions_of_seed_epoch_and_index() {
    let tok = tokenizer();
    let vocab = MaskingVocab::from_tokenizer(&tok);
    let seqs = sequences(&tok, "corpora/en-kjv/kjv.txt", 200);
    let dynamic = MaskingConfig::default();
    let static3 = MaskingConfig {
        mode: MaskingMode::Static { dupe_factor: 3 },
        ..MaskingConfig::default()
    };
    let mut differ_epoch = 0;
    let mut differ_seed = 0;
    let mut differ_index = 0;
    for seq in &seqs {
        let a = mask_sequence(seq, 1, 0, &dynamic, &vocab);
        assert_eq!(a, mask_sequence(seq, 1, 0, &dynamic, &vocab));
        if a != mask_sequence(seq, 1, 1, &dynamic, &vocab) {
            differ_epoch += 1;
        }
        if a != mask_sequence(seq, 2, 0, &dynamic, &vocab) {
            differ_seed += 1;
        }
        // Static: epoch 4 reuses epoch 1's mask (4 % 3 == 1), which dynamic masking keys
        // as epoch 1 too.
        let s1 = mask_sequence(seq, 1, 1, &static3, &vocab);
        assert_eq!(s1, mask_sequence(seq, 1, 4, &static3, &vocab));
        assert_eq!(s1, mask_sequence(seq, 1, 1, &dynamic, &vocab));
        // The mask is keyed by the global index (not by which worker holds the sequence).
        let mut moved = seq.clone();
        moved.global_index += 1_000_000;
        if a != mask_sequence(&moved, 1, 0, &dynamic, &vocab) {
            differ_index += 1;
        }
    }
    assert!(
        differ_epoch > 190,
        "dynamic masks change per epoch: {differ_epoch}"
    );
    assert!(differ_seed > 190, "{differ_seed}");
    assert!(differ_index > 190, "{differ_index}");
}

#[test]
fn whole_word_masking_takes_all_pieces_of_a_word() {
    let tok = tokenizer();
    let vocab = MaskingVocab::from_tokenizer(&tok);
    let config = MaskingConfig {
        whole_word: true,
        ..MaskingConfig::default()
    };
    let seqs = sequences(&tok, "corpora/en-fortunes/fortunes.txt", 2000);
    let mut multi_piece_words_masked = 0;
    for seq in &seqs {
        let words = candidate_words(&seq.ids, true, &vocab);
        // Grouping: a word is a head followed by its ## pieces.
        for w in &words {
            assert!(!vocab.continues_word(seq.ids[w[0]]) || w[0] == 1);
            for &p in &w[1..] {
                assert!(vocab.continues_word(seq.ids[p]));
            }
        }
        let m = mask_sequence(seq, 5, 0, &config, &vocab);
        let masked: std::collections::HashSet<usize> = m.masked_positions.iter().copied().collect();
        for w in &words {
            let hit = w.iter().filter(|p| masked.contains(p)).count();
            assert!(hit == 0 || hit == w.len(), "word {w:?} partly masked");
            if hit > 1 {
                multi_piece_words_masked += 1;
            }
        }
        assert!(m.masked_positions.len() <= 20);
    }
    assert!(multi_piece_words_masked > 50, "{multi_piece_words_masked}");
}

#[test]
fn cjk_characters_are_words_of_their_own() {
    let tok = tokenizer();
    let vocab = MaskingVocab::from_tokenizer(&tok);
    let seqs = sequences(&tok, "corpora/zh-poetry/poetry.txt", 500);
    let config = MaskingConfig {
        whole_word: true,
        ..MaskingConfig::default()
    };
    let mut cjk_tokens = 0;
    for seq in &seqs {
        for w in candidate_words(&seq.ids, true, &vocab) {
            if w.iter().any(|&p| vocab.is_cjk[seq.ids[p] as usize]) {
                assert_eq!(w.len(), 1, "a CJK character is one word");
                cjk_tokens += 1;
            }
        }
        // All-single-token words: whole-word masking reaches the exact BERT count.
        let m = mask_sequence(seq, 3, 0, &config, &vocab);
        assert!(!m.masked_positions.is_empty());
    }
    assert!(cjk_tokens > 1000, "{cjk_tokens}");
}

fn pair(ids: Vec<u32>, b: usize, nsp: Option<u32>, g: u64) -> Sequence {
    Sequence {
        global_index: g,
        token_type_ids: (0..ids.len()).map(|i| u32::from(i >= b)).collect(),
        ids,
        nsp_label: nsp,
    }
}

#[test]
fn collate_pads_and_flattens_positions() {
    let tok = tokenizer();
    let vocab = MaskingVocab::from_tokenizer(&tok);
    let config = MaskingConfig::default();
    let a = pair(vec![101, 2000, 2001, 102, 3000, 102], 4, Some(0), 10);
    let b = pair(
        vec![101, 2500, 102, 2600, 2700, 2800, 2900, 102],
        3,
        Some(1),
        11,
    );
    let rows: Vec<(Sequence, MaskedSequence)> = [a, b]
        .into_iter()
        .map(|s| {
            let m = mask_sequence(&s, 9, 2, &config, &vocab);
            (s, m)
        })
        .collect();
    let batch = collate(&rows, &[100, 101], 10).unwrap();
    assert_eq!(batch.input_ids.dim(), (2, 10));
    assert_eq!(batch.real_tokens(), 14);
    assert_eq!(batch.input_ids[[0, 7]], 0, "[PAD] after the sequence");
    assert_eq!(
        batch.token_type_ids.row(0).to_vec(),
        [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    );
    assert_eq!(
        batch.attention_mask.row(1).to_vec(),
        [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    );
    let mut expected = Vec::new();
    for (r, (_, m)) in rows.iter().enumerate() {
        expected.extend(m.masked_positions.iter().map(|&c| r * 10 + c));
    }
    assert_eq!(batch.masked_positions, expected);
    assert!(batch.masked_positions.windows(2).all(|w| w[0] < w[1]));
    for (&flat, &label) in batch.masked_positions.iter().zip(&batch.masked_labels) {
        assert_eq!(rows[flat / 10].0.ids[flat % 10], label);
    }
    assert_eq!(batch.next_sentence_labels, Some(vec![0, 1]));
    assert_eq!(batch.sample_ids, vec![100, 101]);
    // pad_to 0: the longest row.
    assert_eq!(collate(&rows, &[1, 2], 0).unwrap().seq_len(), 8);
    assert!(matches!(
        collate(&rows, &[1, 2], 7),
        Err(CollateError::TooLong { row: 1, .. })
    ));
    assert!(matches!(
        collate(&rows, &[1], 10),
        Err(CollateError::SampleIdsMismatch { .. })
    ));
    assert!(matches!(collate(&[], &[], 10), Err(CollateError::Empty)));
    let mut mixed = rows.clone();
    mixed[1].0.nsp_label = None;
    assert!(matches!(
        collate(&mixed, &[1, 2], 10),
        Err(CollateError::MixedNsp)
    ));
}

#[test]
fn masking_config_follows_the_job_file() {
    let spec: keel_proto::jobspec::DataSpec = serde_json::from_value(serde_json::json!({
        "corpus": ["c.txt"], "vocab_size": 1000, "dupe_factor": 3, "whole_word_masking": true,
        "masked_lm_prob": 0.2, "max_predictions_per_seq": 30
    }))
    .unwrap();
    let c = MaskingConfig::from_spec(&spec);
    assert_eq!(c.mode, MaskingMode::Static { dupe_factor: 3 });
    assert!(c.whole_word);
    assert_eq!((c.masked_lm_prob, c.max_predictions_per_seq), (0.2, 30));
    c.validate().unwrap();
    let dynamic: keel_proto::jobspec::DataSpec =
        serde_json::from_value(serde_json::json!({ "corpus": ["c.txt"], "vocab_size": 1000 }))
            .unwrap();
    let d = MaskingConfig::from_spec(&dynamic);
    assert_eq!(d.mode, MaskingMode::Dynamic);
    assert!(!d.whole_word);
    let bad = MaskingConfig {
        mode: MaskingMode::Static { dupe_factor: 0 },
        ..d
    };
    assert!(bad.validate().is_err());
}
