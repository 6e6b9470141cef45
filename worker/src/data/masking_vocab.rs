//! What masking needs to know about the vocabulary.

use keel_proto::tokenizer::{KeelTokenizer, SpecialIds};

/// Per-id facts for masking, built once from the vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskingVocab {
    /// Special token ids (`[CLS]`, `[SEP]`, `[PAD]` are never chosen; `[MASK]` replaces).
    pub special: SpecialIds,
    /// `is_continuation[id]`: the token is a `##` piece (continues the previous word).
    pub is_continuation: Vec<bool>,
    /// `is_cjk[id]`: the token is one CJK ideograph (a word of its own for whole-word masking).
    pub is_cjk: Vec<bool>,
    /// Ids a chosen token may be replaced with in the "10% random" case: every id except the
    /// five special tokens and other bracketed reserved tokens (`[unused0]`...).
    pub replacement_ids: Vec<u32>,
}

/// BERT's `_is_chinese_char`: the CJK Unified Ideographs blocks (not Hangul, kana or
/// full-width punctuation).
pub fn is_cjk_char(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        | 0x2B820..=0x2CEAF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

impl MaskingVocab {
    /// Builds the tables from the vocabulary in id order and the special ids.
    pub fn new(vocab: &[String], special: SpecialIds) -> Self {
        let specials = special.all();
        let mut is_continuation = Vec::with_capacity(vocab.len());
        let mut is_cjk = Vec::with_capacity(vocab.len());
        let mut replacement_ids = Vec::with_capacity(vocab.len());
        for (id, token) in vocab.iter().enumerate() {
            let id = id as u32;
            is_continuation.push(token.starts_with("##") && token.len() > 2);
            let mut chars = token.trim_start_matches("##").chars();
            let one_cjk = matches!((chars.next(), chars.next()), (Some(c), None) if is_cjk_char(c));
            is_cjk.push(one_cjk);
            let reserved = token.len() > 2 && token.starts_with('[') && token.ends_with(']');
            if !specials.contains(&id) && !reserved {
                replacement_ids.push(id);
            }
        }
        Self {
            special,
            is_continuation,
            is_cjk,
            replacement_ids,
        }
    }

    /// Builds the tables from a tokenizer.
    pub fn from_tokenizer(tokenizer: &KeelTokenizer) -> Self {
        Self::new(tokenizer.vocab_slice(), tokenizer.special())
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.is_continuation.len()
    }

    /// Whether `id` may be chosen for prediction (not `[CLS]`, `[SEP]`, `[PAD]`, `[MASK]`).
    pub fn is_candidate(&self, id: u32) -> bool {
        id != self.special.cls
            && id != self.special.sep
            && id != self.special.pad
            && id != self.special.mask
    }

    /// Whether `id` continues the previous word (a `##` piece that is not CJK).
    pub fn continues_word(&self, id: u32) -> bool {
        let i = id as usize;
        self.is_continuation.get(i).copied().unwrap_or(false)
            && !self.is_cjk.get(i).copied().unwrap_or(false)
    }
}
