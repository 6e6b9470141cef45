//! Masked-LM masking (Devlin et al. 2019, section 3.1 "Task #1" and appendix A.1; BERT's
//! `create_masked_lm_predictions`).
//!
//! Number of predictions per sequence: `min(max_predictions_per_seq, max(1,
//! round(len * masked_lm_prob)))` with `len` the sequence length including `[CLS]`/`[SEP]` and
//! Python's round-half-to-even, as BERT; never more than the candidates. Candidates are all
//! positions except `[CLS]`, `[SEP]`, `[PAD]` (and `[MASK]`). Words (or single tokens) are
//! taken in a random order until the count is reached, skipping a word that would overshoot.
//! Each chosen token becomes `[MASK]` with probability 0.8, stays itself with 0.1, and becomes
//! a random non-special token with 0.1.
//!
//! Whole-word masking (`whole_word`): a `##` piece joins the word of the token before it, so
//! a word's pieces are chosen together. CJK rule: each CJK character is a word of its own (the
//! tokenizer splits CJK text one character per token and never makes them `##` pieces; this is
//! BERT-Chinese's whole-word masking without a word segmenter).
//!
//! Reproducibility: the mask is a pure function of `(seed, e, global_index)`, with `e` the
//! epoch (dynamic masking, RoBERTa section 4.1) or `epoch % dupe_factor` (static masking, BERT's
//! `dupe_factor` copies), so any worker can recompute it. The ChaCha8 key is those three
//! numbers themselves (no collisions).

use keel_proto::shard::Sequence;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::masking_vocab::MaskingVocab;

/// When a sequence gets a new mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskingMode {
    /// A fresh mask every epoch (RoBERTa).
    Dynamic,
    /// `dupe_factor` fixed masks, cycled over epochs (BERT's static masking).
    Static {
        /// Number of distinct masks per sequence (at least 1).
        dupe_factor: u64,
    },
}

/// Masking settings (HF/BERT names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskingConfig {
    /// Fraction of tokens to predict (BERT: 0.15).
    pub masked_lm_prob: f64,
    /// Cap on predictions per sequence (BERT: 20 for 128 tokens, 80 for 512).
    pub max_predictions_per_seq: usize,
    /// Mask all pieces of a word together.
    pub whole_word: bool,
    /// Dynamic or static masks.
    pub mode: MaskingMode,
}

impl Default for MaskingConfig {
    /// BERT's settings for 128-token sequences, dynamic masking.
    fn default() -> Self {
        Self {
            masked_lm_prob: 0.15,
            max_predictions_per_seq: 20,
            whole_word: false,
            mode: MaskingMode::Dynamic,
        }
    }
}

impl MaskingConfig {
    /// Settings from a job file's `[data]` section (`dupe_factor` 0 = dynamic masking).
    pub fn from_spec(spec: &keel_proto::jobspec::DataSpec) -> Self {
        Self {
            masked_lm_prob: spec.masked_lm_prob,
            max_predictions_per_seq: spec.max_predictions_per_seq,
            whole_word: spec.whole_word_masking,
            mode: if spec.dupe_factor == 0 {
                MaskingMode::Dynamic
            } else {
                MaskingMode::Static {
                    dupe_factor: u64::from(spec.dupe_factor),
                }
            },
        }
    }
}

/// Errors of [`MaskingConfig::validate`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MaskingError {
    /// A setting is out of range.
    #[error("invalid masking setting {field}: {reason}")]
    InvalidSetting {
        /// The setting.
        field: &'static str,
        /// What was expected.
        reason: String,
    },
}

impl MaskingConfig {
    /// Checks ranges: `masked_lm_prob` in (0, 1], `max_predictions_per_seq >= 1`,
    /// `dupe_factor >= 1`. Errors: `InvalidSetting`.
    pub fn validate(&self) -> Result<(), MaskingError> {
        if !(self.masked_lm_prob > 0.0 && self.masked_lm_prob <= 1.0) {
            return Err(MaskingError::InvalidSetting {
                field: "masked_lm_prob",
                reason: format!("{} is not in (0, 1]", self.masked_lm_prob),
            });
        }
        if self.max_predictions_per_seq == 0 {
            return Err(MaskingError::InvalidSetting {
                field: "max_predictions_per_seq",
                reason: "must be at least 1".into(),
            });
        }
        if let MaskingMode::Static { dupe_factor: 0 } = self.mode {
            return Err(MaskingError::InvalidSetting {
                field: "dupe_factor",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    /// The epoch that keys the mask: `epoch` (dynamic) or `epoch % dupe_factor` (static).
    pub fn mask_epoch(&self, epoch: u64) -> u64 {
        match self.mode {
            MaskingMode::Dynamic => epoch,
            MaskingMode::Static { dupe_factor } => epoch % dupe_factor.max(1),
        }
    }
}

/// A sequence after masking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedSequence {
    /// Token ids after masking, `[t]`.
    pub input_ids: Vec<u32>,
    /// Positions (0..t) of the tokens to predict, increasing, `[m]`.
    pub masked_positions: Vec<usize>,
    /// Original ids at those positions, `[m]`.
    pub masked_labels: Vec<u32>,
}

/// The ChaCha8 generator of `(seed, mask_epoch, global_index)`.
pub fn mask_rng(seed: u64, mask_epoch: u64, global_index: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[0..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&mask_epoch.to_le_bytes());
    key[16..24].copy_from_slice(&global_index.to_le_bytes());
    key[24..32].copy_from_slice(b"keelmask");
    ChaCha8Rng::from_seed(key)
}

/// Python's `round` (half to even), as BERT's `int(round(len * prob))`.
fn round_half_even(x: f64) -> usize {
    x.round_ties_even().max(0.0) as usize
}

/// Groups the candidate positions of `ids` into words (whole-word) or single tokens.
pub fn candidate_words(ids: &[u32], whole_word: bool, vocab: &MaskingVocab) -> Vec<Vec<usize>> {
    let mut words: Vec<Vec<usize>> = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        if !vocab.is_candidate(id) {
            continue;
        }
        if whole_word
            && vocab.continues_word(id)
            && let Some(last) = words.last_mut()
            && last.last() == Some(&(i.wrapping_sub(1)))
        {
            last.push(i);
            continue;
        }
        words.push(vec![i]);
    }
    words
}

/// Masks `seq` for `epoch` (see the module docs). A pure function of its arguments.
pub fn mask_sequence(
    seq: &Sequence,
    seed: u64,
    epoch: u64,
    config: &MaskingConfig,
    vocab: &MaskingVocab,
) -> MaskedSequence {
    let mut rng = mask_rng(seed, config.mask_epoch(epoch), seq.global_index);
    let mut words = candidate_words(&seq.ids, config.whole_word, vocab);
    let candidates: usize = words.iter().map(Vec::len).sum();
    let wanted = round_half_even(seq.ids.len() as f64 * config.masked_lm_prob).max(1);
    let num_to_predict = wanted.min(config.max_predictions_per_seq).min(candidates);
    words.shuffle(&mut rng);
    let mut input_ids = seq.ids.clone();
    let mut chosen: Vec<(usize, u32)> = Vec::with_capacity(num_to_predict);
    for word in &words {
        if chosen.len() >= num_to_predict {
            break;
        }
        if chosen.len() + word.len() > num_to_predict {
            continue;
        }
        for &pos in word {
            let original = seq.ids[pos];
            let replacement = if rng.random::<f64>() < 0.8 {
                vocab.special.mask
            } else if rng.random::<f64>() < 0.5 {
                original
            } else {
                // An empty replacement list (a vocabulary of only special tokens) keeps the token.
                let n = vocab.replacement_ids.len();
                if n == 0 {
                    original
                } else {
                    vocab.replacement_ids[rng.random_range(0..n)]
                }
            };
            input_ids[pos] = replacement;
            chosen.push((pos, original));
        }
    }
    chosen.sort_unstable_by_key(|&(pos, _)| pos);
    MaskedSequence {
        input_ids,
        masked_positions: chosen.iter().map(|&(p, _)| p).collect(),
        masked_labels: chosen.iter().map(|&(_, id)| id).collect(),
    }
}
