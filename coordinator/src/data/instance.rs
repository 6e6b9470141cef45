//! A training instance as the builders produce it (before shuffling and global indexing).

/// One sequence built from the corpus: `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Token ids, `[t]`, `[CLS]` and `[SEP]` included.
    pub ids: Vec<u32>,
    /// Position where segment B starts (token type 1 from here on); `ids.len()` when none.
    pub segment_b: usize,
    /// NSP label (0 = B follows A, 1 = B is random); `None` for MLM-only instances.
    pub nsp_label: Option<u32>,
}

impl Instance {
    /// Spill words: `len, segment_b, nsp (u32::MAX = none), ids...`.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.ids.len() + 3);
        w.push(self.ids.len() as u32);
        w.push(self.segment_b as u32);
        w.push(self.nsp_label.unwrap_or(u32::MAX));
        w.extend_from_slice(&self.ids);
        w
    }

    /// Inverse of [`Self::to_words`] (malformed words give an empty instance).
    pub fn from_words(words: &[u32]) -> Instance {
        if words.len() < 3 {
            return Instance {
                ids: Vec::new(),
                segment_b: 0,
                nsp_label: None,
            };
        }
        let len = (words[0] as usize).min(words.len() - 3);
        Instance {
            ids: words[3..3 + len].to_vec(),
            segment_b: (words[1] as usize).min(len),
            nsp_label: (words[2] != u32::MAX).then_some(words[2]),
        }
    }

    /// Token type ids, `[t]`: 0 before segment B, 1 from it on.
    pub fn token_type_ids(&self) -> Vec<u32> {
        (0..self.ids.len())
            .map(|i| u32::from(i >= self.segment_b))
            .collect()
    }
}
