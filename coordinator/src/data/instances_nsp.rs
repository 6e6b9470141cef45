//! MLM + NSP instances, as BERT's `create_pretraining_data.py` builds them
//! (`create_instances_from_document`, Devlin et al. 2019, section 3.1 "Task #2" and A.2).
//!
//! Per document: a target length of `max_seq_length - 3` tokens, or with probability
//! `short_seq_prob` a random length in `[2, max_seq_length - 3]`; sentences are gathered until
//! the target is reached, split at a random sentence boundary into A and B; with probability
//! 0.5 (always when only one sentence was gathered) B is replaced by text from a random
//! position of another document (never the same one; label 1) and the unused sentences are
//! put back; then the pair is truncated to fit, one token at a time from the longer segment,
//! from its front or back at random. Label 0 = B follows A.
//!
//! Differences from the reference, on purpose: the random document is drawn from the other
//! documents directly (the reference retries 10 times and may end with the same document).

use rand::RngExt;
use rand_chacha::ChaCha8Rng;

use super::instance::Instance;
use super::spill::TokenizedDoc;

/// Settings of the NSP instance builder.
#[derive(Debug, Clone, Copy)]
pub struct NspSettings {
    /// Sequence length including `[CLS]` and two `[SEP]`s.
    pub max_seq_length: usize,
    /// Probability of a shorter target length (BERT: 0.1).
    pub short_seq_prob: f64,
    /// `[CLS]` id.
    pub cls: u32,
    /// `[SEP]` id.
    pub sep: u32,
}

/// Builds the NSP instances of document `doc_index` (of `num_docs`, at least 2);
/// `random_doc(i)` fetches document `i` for random next segments.
///
/// Errors: whatever `random_doc` returns.
pub fn create_nsp_instances<E>(
    doc_index: usize,
    doc: &TokenizedDoc,
    num_docs: usize,
    settings: &NspSettings,
    rng: &mut ChaCha8Rng,
    mut random_doc: impl FnMut(usize) -> Result<TokenizedDoc, E>,
) -> Result<Vec<Instance>, E> {
    let max_num_tokens = settings.max_seq_length.saturating_sub(3).max(2);
    let mut target = max_num_tokens;
    if rng.random::<f64>() < settings.short_seq_prob {
        target = rng.random_range(2..=max_num_tokens);
    }
    let mut out = Vec::new();
    let mut chunk: Vec<&Vec<u32>> = Vec::new();
    let mut chunk_len = 0usize;
    let mut i = 0usize;
    while i < doc.len() {
        let segment = &doc[i];
        chunk.push(segment);
        chunk_len += segment.len();
        if i == doc.len() - 1 || chunk_len >= target {
            let a_end = if chunk.len() >= 2 {
                rng.random_range(1..chunk.len())
            } else {
                1
            };
            let mut a: Vec<u32> = chunk[..a_end]
                .iter()
                .flat_map(|s| s.iter().copied())
                .collect();
            let mut b: Vec<u32> = Vec::new();
            let is_random_next = num_docs >= 2 && (chunk.len() == 1 || rng.random::<f64>() < 0.5);
            if is_random_next {
                let target_b = target.saturating_sub(a.len()).max(1);
                let mut other = rng.random_range(0..num_docs - 1);
                if other >= doc_index {
                    other += 1;
                }
                let other_doc = random_doc(other)?;
                if !other_doc.is_empty() {
                    let start = rng.random_range(0..other_doc.len());
                    for s in &other_doc[start..] {
                        b.extend_from_slice(s);
                        if b.len() >= target_b {
                            break;
                        }
                    }
                }
                // The sentences not used for A go back to the document.
                i -= chunk.len() - a_end;
            } else {
                b = chunk[a_end..]
                    .iter()
                    .flat_map(|s| s.iter().copied())
                    .collect();
            }
            truncate_pair(&mut a, &mut b, max_num_tokens, rng);
            if !a.is_empty() && !b.is_empty() {
                let mut ids = Vec::with_capacity(a.len() + b.len() + 3);
                ids.push(settings.cls);
                ids.extend_from_slice(&a);
                ids.push(settings.sep);
                let segment_b = ids.len();
                ids.extend_from_slice(&b);
                ids.push(settings.sep);
                out.push(Instance {
                    ids,
                    segment_b,
                    nsp_label: Some(u32::from(is_random_next)),
                });
            }
            chunk.clear();
            chunk_len = 0;
        }
        i += 1;
    }
    Ok(out)
}

/// Truncates a pair to at most `max_num_tokens` tokens, removing one token at a time from the
/// longer segment (B on a tie), from its front or back with equal probability (BERT's
/// `truncate_seq_pair`).
pub fn truncate_pair(
    a: &mut Vec<u32>,
    b: &mut Vec<u32>,
    max_num_tokens: usize,
    rng: &mut ChaCha8Rng,
) {
    // Work on index windows so that a very long segment costs O(removed), not O(n^2).
    let (mut a0, mut a1, mut b0, mut b1) = (0, a.len(), 0, b.len());
    while (a1 - a0) + (b1 - b0) > max_num_tokens {
        let (lo, hi) = if a1 - a0 > b1 - b0 {
            (&mut a0, &mut a1)
        } else {
            (&mut b0, &mut b1)
        };
        if *lo == *hi {
            break;
        }
        if rng.random::<f64>() < 0.5 {
            *lo += 1;
        } else {
            *hi -= 1;
        }
    }
    a.truncate(a1);
    a.drain(..a0);
    b.truncate(b1);
    b.drain(..b0);
}
