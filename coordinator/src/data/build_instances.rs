//! Documents -> instances (step 4 of `super::prepare`), and which documents are held out when
//! the held-out set is chosen by document ([`heldout_documents`]).
//!
//! By default the held-out set is a fraction of the shuffled instances. A job with several
//! phases (`keel_proto::phases`) prepares the corpus once per sequence length; instances of
//! different lengths cut the text differently, so a split by instance would let one phase
//! train on text another phase holds out. Held out by document, the same documents are held
//! out at every length, whatever the phase.

use super::error::PrepareError;
use super::instance::Instance;
use super::instances_mlm::MlmPacker;
use super::instances_nsp::{NspSettings, create_nsp_instances};
use super::manifest::Objective;
use super::prepare_options::PrepareOptions;
use super::spill::{Spill, SpillWriter, words_to_doc};
use keel_proto::tokenizer::KeelTokenizer;
use rand_chacha::ChaCha8Rng;

/// Which documents are held out, given each one's size in tokens (`doc_tokens`,
/// `[num_docs]`): documents are taken in the order of their hash of `(seed, index)` until
/// they hold `fraction` of all tokens. A document that would take the held-out share past
/// twice `fraction` is passed over (one long book among short ones must not hold out most of
/// the corpus); at least `min_docs` documents are held out (the smallest passed-over ones
/// complete the count) and at least `min_docs` are left to train on. Deterministic in its
/// arguments; returns `[num_docs]` flags.
///
/// Errors: [`PrepareError::TooSmall`] when the corpus has fewer than `2 * min_docs`
/// documents to split, saying how to give it more (documents are separated by blank lines)
/// or to hold out nothing.
pub fn heldout_documents(
    doc_tokens: &[u64],
    fraction: f64,
    seed: u64,
    min_docs: usize,
) -> Result<Vec<bool>, PrepareError> {
    let num_docs = doc_tokens.len();
    let mut flags = vec![false; num_docs];
    if fraction <= 0.0 {
        return Ok(flags);
    }
    if num_docs < 2 * min_docs {
        return Err(PrepareError::TooSmall {
            reason: format!(
                "a job with [[phase]] sections holds out whole documents (the same text at \
                 every max_seq_length), which needs at least {} documents; the corpus has \
                 {num_docs}. Separate its documents with blank lines (or give one file per \
                 document), or set data.heldout_fraction = 0",
                2 * min_docs
            ),
        });
    }
    let total: u64 = doc_tokens.iter().sum();
    let target = fraction * total as f64;
    let cap = 2.0 * target;
    let mut ranked: Vec<(u64, usize)> = (0..num_docs)
        .map(|d| (splitmix64(seed ^ splitmix64(d as u64)), d))
        .collect();
    ranked.sort_unstable();
    let (mut held, mut count) = (0u64, 0usize);
    for &(_, d) in &ranked {
        if held as f64 >= target || num_docs - count == min_docs {
            break;
        }
        if (held + doc_tokens[d]) as f64 <= cap {
            flags[d] = true;
            held += doc_tokens[d];
            count += 1;
        }
    }
    // Too few fit under the cap: complete the count with the smallest of the others.
    if count < min_docs {
        let mut rest: Vec<usize> = (0..num_docs).filter(|&d| !flags[d]).collect();
        rest.sort_by_key(|&d| (doc_tokens[d], d));
        for &d in &rest[..min_docs - count] {
            flags[d] = true;
        }
    }
    Ok(flags)
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Builds the instances of `docs` in corpus order into a spill: MLM packing, or BERT's NSP
/// pairs with `nsp_rng`. `held_docs` (`[num_docs]`, or empty: none) splits the documents in
/// two groups built apart: a packed sequence or an NSP pair (its random next segment
/// included) never mixes them. Returns the spill, each instance's length in tokens and
/// whether it comes from held-out documents (`[instances]`).
///
/// Errors: `TooSmall` (NSP with fewer than 2 documents in a group), `Spill`, `Io`.
pub fn build_instances(
    docs: &Spill,
    options: &PrepareOptions,
    tokenizer: &KeelTokenizer,
    held_docs: &[bool],
    nsp_rng: &mut ChaCha8Rng,
) -> Result<(Spill, Vec<u32>, Vec<bool>), PrepareError> {
    let special = tokenizer.special();
    let mut out = SpillWriter::new(&options.out_dir)?;
    let mut lengths: Vec<u32> = Vec::new();
    let mut held: Vec<bool> = Vec::new();
    let mut emit = |inst: Instance, h: bool, out: &mut SpillWriter| -> Result<(), PrepareError> {
        lengths.push(inst.ids.len() as u32);
        held.push(h);
        out.push(&inst.to_words())?;
        Ok(())
    };
    let group_of = |d: usize| usize::from(held_docs.get(d).copied().unwrap_or(false));
    match options.objective {
        Objective::Mlm => {
            let mut packers =
                [0, 1].map(|_| MlmPacker::new(options.max_seq_length, special.cls, special.sep));
            for d in 0..docs.len() {
                let g = group_of(d);
                let doc = words_to_doc(&docs.read(d)?);
                for inst in packers[g].push_document(&doc) {
                    emit(inst, g == 1, &mut out)?;
                }
            }
            for (g, packer) in packers.into_iter().enumerate() {
                for inst in packer.finish() {
                    emit(inst, g == 1, &mut out)?;
                }
            }
        }
        Objective::MlmNsp => {
            // Each group's documents in corpus order, and each document's place in its group.
            let mut groups: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
            let mut place = Vec::with_capacity(docs.len());
            for d in 0..docs.len() {
                let g = group_of(d);
                place.push(groups[g].len());
                groups[g].push(d);
            }
            for group in &groups {
                if !group.is_empty() && group.len() < 2 {
                    return Err(PrepareError::TooSmall {
                        reason: format!(
                            "the mlm+nsp objective needs at least 2 documents (random next \
                             segments come from another document), the corpus has {}; use \
                             --objective mlm or add documents",
                            group.len()
                        ),
                    });
                }
            }
            let settings = NspSettings {
                max_seq_length: options.max_seq_length,
                short_seq_prob: options.short_seq_prob,
                cls: special.cls,
                sep: special.sep,
            };
            for (d, &at) in place.iter().enumerate() {
                let g = group_of(d);
                let group = &groups[g];
                let doc = words_to_doc(&docs.read(d)?);
                let instances =
                    create_nsp_instances(at, &doc, group.len(), &settings, nsp_rng, |o| {
                        docs.read(group[o]).map(|w| words_to_doc(&w))
                    })?;
                for inst in instances {
                    emit(inst, g == 1, &mut out)?;
                }
            }
        }
    }
    Ok((out.finish()?, lengths, held))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share of `tokens` that `flags` hold out.
    fn share(flags: &[bool], tokens: &[u64]) -> f64 {
        let held: u64 = (0..tokens.len())
            .filter(|&d| flags[d])
            .map(|d| tokens[d])
            .sum();
        held as f64 / tokens.iter().sum::<u64>() as f64
    }

    #[test]
    fn heldout_documents_are_a_fraction_of_the_tokens_chosen_by_seed() {
        let equal = vec![100u64; 1000];
        let a = heldout_documents(&equal, 0.05, 7, 1).unwrap();
        assert_eq!(a.iter().filter(|&&h| h).count(), 50);
        assert_eq!(a, heldout_documents(&equal, 0.05, 7, 1).unwrap());
        assert_ne!(a, heldout_documents(&equal, 0.05, 8, 1).unwrap());
        // At least `min_docs` each side, and none without a fraction.
        let ten = vec![100u64; 10];
        let held = heldout_documents(&ten, 0.01, 7, 2).unwrap();
        assert_eq!(held.iter().filter(|&&h| h).count(), 2);
        assert!(!heldout_documents(&ten, 0.0, 7, 2).unwrap().contains(&true));
        assert!(heldout_documents(&ten[..3], 0.5, 7, 2).is_err());
        // Two documents: one held out, one left to train on, whatever their sizes.
        for sizes in [[100, 100], [10, 100], [100, 10]] {
            let f = heldout_documents(&sizes, 0.45, 7, 1).unwrap();
            assert_eq!(f.iter().filter(|&&h| h).count(), 1, "{sizes:?}: {f:?}");
        }
    }

    /// A fresh user's corpus: a few long books and many short texts; by count of documents
    /// the books were held out and took 68% of the text.
    #[test]
    fn long_documents_do_not_take_the_heldout_share_past_twice_the_fraction() {
        let mut tokens = vec![200_000u64; 3];
        tokens.extend(std::iter::repeat_n(500u64, 200));
        for seed in 0..20 {
            let flags = heldout_documents(&tokens, 0.05, seed, 1).unwrap();
            let s = share(&flags, &tokens);
            assert!(s <= 0.10, "seed {seed}: {s} of the tokens held out");
            assert!(s >= 0.04, "seed {seed}: only {s} of the tokens held out");
        }
        // Only long documents: the smallest completes the count of one.
        let flags = heldout_documents(&[900, 1000, 800], 0.01, 3, 1).unwrap();
        assert_eq!(flags, [false, false, true]);
    }
}
