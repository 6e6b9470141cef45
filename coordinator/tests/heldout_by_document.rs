//! The held-out set by document (`PrepareOptions::heldout_by_document`, used by jobs with
//! `[[phase]]`): preparing the same corpus at two sequence lengths holds out the same text, so
//! no phase trains on what another phase evaluates on. MLM packing drops no token, so "the same
//! text" is checked as the same multiset of word-piece ids in the held-out sets (and in the
//! training sets), special tokens aside. Split by instance (the default), the two lengths hold
//! out different text, which this check tells apart.

use std::path::Path;

use keel_coordinator::data::{Objective, PrepareOptions, PreparedData, VocabSource, prepare};

#[path = "../../fixtures/testdata.rs"]
mod testdata;
use testdata::in_repo;

/// The sorted word-piece ids (special tokens aside) of the held-out set and of the training
/// set of `corpus` prepared at `max_seq_length`.
fn token_multisets(corpus: &Path, max_seq_length: usize, by_document: bool) -> [Vec<u32>; 2] {
    let out = tempfile::tempdir().unwrap();
    let vocab = VocabSource::File {
        path: in_repo("fixtures/wordpiece/vocab.txt"),
        lowercase: true,
    };
    let mut o = PrepareOptions::new(
        vec![corpus.to_path_buf()],
        vocab,
        Objective::Mlm,
        out.path().to_path_buf(),
    );
    o.max_seq_length = max_seq_length;
    o.seed = 11;
    o.shards = 2;
    o.heldout_fraction = 0.05;
    o.heldout_by_document = by_document;
    let manifest = prepare(&o).unwrap();
    let special = [manifest.special.cls, manifest.special.sep];
    let data = PreparedData::open(out.path()).unwrap();
    let ids = |reader: keel_proto::shard::ShardReader| {
        let mut ids: Vec<u32> = (0..reader.len())
            .flat_map(|i| reader.get(i).unwrap().ids)
            .filter(|id| !special.contains(id))
            .collect();
        ids.sort_unstable();
        ids
    };
    let held = ids(data.open_heldout().unwrap());
    let train = (0..manifest.shards.len())
        .flat_map(|k| ids(data.open_shard(k).unwrap()))
        .collect::<Vec<_>>();
    let mut train = train;
    train.sort_unstable();
    [held, train]
}

#[test]
fn by_document_the_same_text_is_held_out_at_every_length() {
    let dir = tempfile::tempdir().unwrap();
    // The first 6,000 lines of the KJV: about 200 chapters, its documents.
    let text = std::fs::read_to_string(in_repo("corpora/en-kjv/kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(6000).collect();
    let corpus = dir.path().join("kjv-part.txt");
    std::fs::write(&corpus, part.join("\n") + "\n").unwrap();

    let [held_64, train_64] = token_multisets(&corpus, 64, true);
    let [held_128, train_128] = token_multisets(&corpus, 128, true);
    assert!(!held_64.is_empty() && held_64.len() * 10 < train_64.len());
    assert_eq!(
        held_64, held_128,
        "the held-out text differs between lengths"
    );
    assert_eq!(
        train_64, train_128,
        "the training text differs between lengths"
    );

    // By instance, the two lengths hold out different text: the check above can fail.
    let [held_64, _] = token_multisets(&corpus, 64, false);
    let [held_128, _] = token_multisets(&corpus, 128, false);
    assert_ne!(held_64, held_128);
}
