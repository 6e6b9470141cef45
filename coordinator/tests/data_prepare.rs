//! `prepare` on the real corpora: token counts, no token dropped, NSP structure,
//! determinism, balanced shards, integrity checks, per-rank shards.

use std::path::{Path, PathBuf};

use keel_coordinator::data::{
    Objective, PrepareOptions, PreparedData, VocabSource, build_worker_heldout_shard,
    build_worker_shard, prepare,
};
use keel_proto::shard::{Sequence, ShardReader};
use keel_proto::split::WorkerPlan;
use keel_proto::tokenizer::KeelTokenizer;

#[path = "../../fixtures/testdata.rs"]
mod testdata;
use testdata::in_repo;

fn bert_vocab() -> VocabSource {
    VocabSource::File {
        path: in_repo("fixtures/wordpiece/vocab.txt"),
        lowercase: true,
    }
}

/// The first `max_bytes` of a corpus file, cut at a document boundary.
fn corpus_prefix(rel: &str, max_bytes: usize, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(in_repo(rel)).unwrap();
    let mut cut = max_bytes.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let end = text[..cut].rfind("\n\n").map(|i| i + 2).unwrap_or(cut);
    let path = dir.join(Path::new(rel).file_name().unwrap());
    std::fs::write(&path, &text[..end]).unwrap();
    path
}

/// Documents of a BERT-layout file, tokenised independently of the pipeline.
fn reference_docs(path: &Path, tok: &KeelTokenizer) -> Vec<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut docs = Vec::new();
    let mut doc: Vec<Vec<u32>> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !doc.is_empty() {
                docs.push(std::mem::take(&mut doc));
            }
            continue;
        }
        let ids = tok.encode(line);
        if !ids.is_empty() {
            doc.push(ids);
        }
    }
    if !doc.is_empty() {
        docs.push(doc);
    }
    docs
}

/// All sequences of a prepared folder (training + heldout) sorted by corpus position.
fn all_in_corpus_order(dir: &Path) -> Vec<Sequence> {
    let data = PreparedData::open(dir).unwrap();
    let mut all = Vec::new();
    let mut readers: Vec<ShardReader> = (0..data.num_shards())
        .map(|i| data.open_shard(i).unwrap())
        .collect();
    readers.push(data.open_heldout().unwrap());
    for r in &readers {
        for i in 0..r.len() {
            all.push((r.source_index(i).unwrap(), r.get(i).unwrap()));
        }
    }
    all.sort_by_key(|(s, _)| *s);
    for (k, (s, _)) in all.iter().enumerate() {
        assert_eq!(*s, k as u64, "source indices must be 0..S without gaps");
    }
    all.into_iter().map(|(_, s)| s).collect()
}

fn options(corpus: Vec<PathBuf>, out: &Path, objective: Objective) -> PrepareOptions {
    let mut o = PrepareOptions::new(corpus, bert_vocab(), objective, out.to_path_buf());
    o.threads = 2;
    o.seed = 7;
    o
}

#[test]
fn mlm_packing_drops_no_token_on_the_real_corpora() {
    let tok =
        KeelTokenizer::from_vocab_file(&in_repo("fixtures/wordpiece/vocab.txt"), true).unwrap();
    let sep = tok.special().sep;
    let cls = tok.special().cls;
    for (rel, max_len) in [
        ("corpora/en-kjv/kjv.txt", 128usize),
        ("corpora/en-fortunes/fortunes.txt", 64),
        ("corpora/zh-poetry/poetry.txt", 128),
    ] {
        let out = tempfile::tempdir().unwrap();
        let mut o = options(vec![in_repo(rel)], out.path(), Objective::Mlm);
        o.max_seq_length = max_len;
        o.shards = 3;
        let manifest = prepare(&o).unwrap();
        let docs = reference_docs(&in_repo(rel), &tok);
        let corpus_tokens: u64 = docs.iter().flatten().map(|s| s.len() as u64).sum();
        assert_eq!(manifest.corpus.tokens, corpus_tokens, "{rel}");
        assert_eq!(manifest.corpus.documents, docs.len() as u64, "{rel}");
        assert!(corpus_tokens > 500_000, "{rel}: {corpus_tokens} tokens");
        // Expected stream: documents joined by [SEP].
        let mut expected = Vec::new();
        for (d, doc) in docs.iter().enumerate() {
            if d > 0 {
                expected.push(sep);
            }
            for s in doc {
                expected.extend_from_slice(s);
            }
        }
        let mut got = Vec::new();
        for seq in all_in_corpus_order(out.path()) {
            assert!(seq.ids.len() <= max_len && seq.ids.len() >= 3);
            assert_eq!(seq.ids[0], cls);
            assert_eq!(*seq.ids.last().unwrap(), sep);
            assert!(seq.token_type_ids.iter().all(|&t| t == 0));
            assert_eq!(seq.nsp_label, None);
            got.extend_from_slice(&seq.ids[1..seq.ids.len() - 1]);
        }
        // A document boundary inside a sequence is a [SEP]; at a sequence edge it needs
        // none. The corpora contain no literal "[SEP]", so removing all [SEP]s from both
        // streams must leave exactly the corpus's tokens in order.
        assert!(docs.iter().flatten().flatten().all(|&t| t != sep));
        let boundaries = got.iter().filter(|&&t| t == sep).count();
        assert!(
            boundaries < docs.len(),
            "{rel}: {boundaries} boundary [SEP]s"
        );
        got.retain(|&t| t != sep);
        expected.retain(|&t| t != sep);
        assert_eq!(got.len() as u64, corpus_tokens, "{rel}");
        assert!(got == expected, "{rel}: token streams differ");
        // Sequences are full except where a sentence or the corpus ended.
        let full =
            manifest.total_tokens as f64 / (manifest.total_sequences as f64 * max_len as f64);
        assert!(full > 0.85, "{rel}: packing fill {full}");
        // Shards balanced by tokens: within one sequence of the mean.
        let mean = manifest.total_tokens as f64 / manifest.shards.len() as f64;
        for s in &manifest.shards {
            assert!(
                (s.tokens as f64 - mean).abs() <= max_len as f64,
                "{rel}: {s:?} vs {mean}"
            );
        }
        let held = manifest.heldout.sequences as f64;
        let total = held + manifest.total_sequences as f64;
        assert!(
            (held / total - 0.01).abs() < 0.002,
            "{rel}: heldout {held}/{total}"
        );
    }
}

#[test]
fn nsp_instances_follow_bert() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = corpus_prefix("corpora/en-fortunes/fortunes.txt", 700_000, dir.path());
    let out = dir.path().join("out");
    let mut o = options(vec![corpus], &out, Objective::MlmNsp);
    o.shards = 2;
    let manifest = prepare(&o).unwrap();
    let data = PreparedData::open(&out).unwrap();
    let (cls, sep) = (
        data.tokenizer().special().cls,
        data.tokenizer().special().sep,
    );
    let mut labels = [0u64; 2];
    let mut short = 0;
    let mut n = 0;
    for i in 0..data.num_shards() {
        let r = data.open_shard(i).unwrap();
        assert!(r.has_nsp());
        for seq in r.iter() {
            n += 1;
            let len = seq.ids.len();
            assert!(len <= 128);
            assert_eq!(seq.ids[0], cls);
            assert_eq!(seq.ids[len - 1], sep);
            let b = seq.token_type_ids.iter().position(|&t| t == 1).unwrap();
            assert!(b >= 3 && b < len - 1, "both segments non-empty");
            assert_eq!(seq.ids[b - 1], sep);
            assert!(seq.token_type_ids[b..].iter().all(|&t| t == 1));
            assert_eq!(seq.ids.iter().filter(|&&t| t == sep).count(), 2);
            labels[seq.nsp_label.unwrap() as usize] += 1;
            if len < 64 {
                short += 1;
            }
        }
    }
    assert_eq!(n, manifest.total_sequences);
    let random = labels[1] as f64 / n as f64;
    // Random next: 50% of pairs, plus every single-sentence chunk (fortunes are short).
    assert!(
        random > 0.45 && random < 0.8,
        "random-next fraction {random}"
    );
    assert!(short > 0);
}

#[test]
fn same_seed_gives_byte_identical_shards_whatever_the_threads() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = corpus_prefix("corpora/en-fortunes/fortunes.txt", 400_000, dir.path());
    let zh = corpus_prefix("corpora/zh-poetry/poetry.txt", 200_000, dir.path());
    let mut outs = Vec::new();
    for (k, threads) in [1usize, 2, 2].into_iter().enumerate() {
        let out = dir.path().join(format!("out{k}"));
        let mut o = options(vec![corpus.clone(), zh.clone()], &out, Objective::MlmNsp);
        o.threads = threads;
        o.shards = 3;
        prepare(&o).unwrap();
        outs.push(out);
    }
    for file in [
        "shard-00000.keel",
        "shard-00001.keel",
        "shard-00002.keel",
        "heldout.keel",
        "manifest.json",
        "vocab.txt",
        "tokenizer.json",
    ] {
        let a = std::fs::read(outs[0].join(file)).unwrap();
        for o in &outs[1..] {
            assert!(a == std::fs::read(o.join(file)).unwrap(), "{file} differs");
        }
    }
    // Another seed gives another order.
    let out = dir.path().join("other-seed");
    let mut o = options(vec![corpus, zh], &out, Objective::MlmNsp);
    o.seed = 8;
    o.shards = 3;
    prepare(&o).unwrap();
    assert_ne!(
        std::fs::read(out.join("shard-00000.keel")).unwrap(),
        std::fs::read(outs[0].join("shard-00000.keel")).unwrap()
    );
}

#[test]
fn trained_vocabulary_is_saved_in_hf_layout_and_used() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = corpus_prefix("corpora/zh-poetry/poetry.txt", 500_000, dir.path());
    let out = dir.path().join("out");
    let mut o = options(vec![corpus], &out, Objective::Mlm);
    o.vocab = VocabSource::Train {
        vocab_size: 4000,
        lowercase: false,
    };
    let manifest = prepare(&o).unwrap();
    assert!(manifest.vocab_size <= 4000 && manifest.vocab_size > 3000);
    assert!(!manifest.lowercase);
    for f in [
        "vocab.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let data = PreparedData::open(&out).unwrap();
    let s = data.tokenizer().special();
    assert_eq!((s.pad, s.unk, s.cls, s.sep, s.mask), (0, 1, 2, 3, 4));
    let seq = data.sequence(0).unwrap();
    assert_eq!(seq.ids[0], 2);
    // CJK text: one token per character.
    let ids = data.tokenizer().encode("春眠不觉晓");
    assert_eq!(ids.len(), 5);
    // A model too small for the vocabulary is refused before training.
    let mut o2 = o.clone();
    o2.out_dir = dir.path().join("out2");
    o2.model_vocab_size = Some(1000);
    let err = prepare(&o2).unwrap_err().to_string();
    assert!(err.contains("4000") && err.contains("1000"), "{err}");
}

#[test]
fn corrupted_or_truncated_shards_are_refused_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = corpus_prefix("corpora/en-kjv/kjv.txt", 300_000, dir.path());
    let out = dir.path().join("out");
    let mut o = options(vec![corpus], &out, Objective::Mlm);
    o.shards = 2;
    prepare(&o).unwrap();
    let shard = out.join("shard-00001.keel");
    let bytes = std::fs::read(&shard).unwrap();
    let data = PreparedData::open(&out).unwrap();
    data.open_shard(1).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 100]).unwrap();
    let err = data.open_shard(1).unwrap_err().to_string();
    assert!(
        err.contains("shard-00001.keel") && err.contains("truncated"),
        "{err}"
    );
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 1;
    std::fs::write(&shard, &flipped).unwrap();
    let err = data.open_shard(1).unwrap_err().to_string();
    assert!(
        err.contains("shard-00001.keel") && err.contains("corrupted"),
        "{err}"
    );
}

#[test]
fn worker_shards_hold_exactly_each_ranks_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = corpus_prefix("corpora/en-kjv/kjv.txt", 400_000, dir.path());
    let out = dir.path().join("out");
    let mut o = options(vec![corpus], &out, Objective::Mlm);
    o.shards = 2;
    o.heldout_fraction = 0.05;
    prepare(&o).unwrap();
    let data = PreparedData::open(&out).unwrap();
    let n = data.total_sequences();
    let all: Vec<Sequence> = (0..data.num_shards())
        .flat_map(|i| data.open_shard(i).unwrap().iter().collect::<Vec<_>>())
        .collect();
    assert_eq!(all.len() as u64, n);
    for (g, s) in all.iter().enumerate() {
        assert_eq!(s.global_index, g as u64);
    }
    for world in 1..=3u32 {
        let mut covered = 0u64;
        let mut held = 0u64;
        for rank in 0..world {
            let plan = WorkerPlan::new(n, world, rank, 4, 2).unwrap();
            let path = dir.path().join(format!("w{world}-{rank}.keel"));
            let entry = build_worker_shard(&data, &plan, &path).unwrap();
            let r = ShardReader::open(&path).unwrap();
            let want = plan.sequence_indices();
            assert_eq!(r.len(), want.len());
            assert_eq!(entry.sequences, want.len() as u64);
            for (i, g) in want.iter().enumerate() {
                assert_eq!(r.get(i).unwrap(), all[*g as usize]);
            }
            // Every micro-batch of the plan is found in the rank's shard.
            for step in 0..plan.steps_per_epoch() {
                for j in 0..2 {
                    for g in plan.micro_batch(step, j).unwrap().sequence_indices {
                        assert_eq!(r.find_global(g).as_ref(), Some(&all[g as usize]));
                    }
                }
            }
            covered += r.len() as u64;
            let hpath = dir.path().join(format!("h{world}-{rank}.keel"));
            held += build_worker_heldout_shard(&data, world, rank, &hpath)
                .unwrap()
                .sequences;
        }
        let b = u64::from(world) * 8;
        assert_eq!(covered, n / b * b);
        assert_eq!(held, data.manifest().heldout.sequences);
    }
}
