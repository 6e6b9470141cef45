//! The tokenizer against HF's reference ids (fixtures/wordpiece/cases.json), plus training,
//! saving and reloading on a real corpus.

use keel_proto::tokenizer::{KeelTokenizer, TokenizerError, TrainOptions, check_fits};

#[path = "../../fixtures/testdata.rs"]
mod testdata;
use testdata::in_repo;

fn cases() -> serde_json::Value {
    let text = std::fs::read_to_string(in_repo("fixtures/wordpiece/cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn reference_tokenizer() -> KeelTokenizer {
    KeelTokenizer::from_vocab_file(&in_repo("fixtures/wordpiece/vocab.txt"), true).unwrap()
}

fn check_all_cases(tok: &KeelTokenizer) {
    let cases = cases();
    let single = cases["single"].as_array().unwrap();
    assert!(single.len() >= 130, "expected the 130+ reference cases");
    let s = tok.special();
    for case in single {
        let text = case["text"].as_str().unwrap();
        let expected = ids_of(&case["ids"]);
        let mut got = vec![s.cls];
        got.extend(tok.encode(text));
        got.push(s.sep);
        assert_eq!(got, expected, "ids differ for {text:?}");
        let tokens: Vec<String> = got.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        let expected_tokens: Vec<String> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        assert_eq!(tokens, expected_tokens, "tokens differ for {text:?}");
    }
    let pair = &cases["pair"];
    let (ids, types) = tok.encode_pair(pair["a"].as_str().unwrap(), pair["b"].as_str().unwrap());
    assert_eq!(ids, ids_of(&pair["ids"]));
    assert_eq!(types, ids_of(&pair["token_type_ids"]));
}

#[test]
fn every_reference_case_matches_hf() {
    let tok = reference_tokenizer();
    assert_eq!(tok.vocab_size(), 30_522);
    let s = tok.special();
    assert_eq!(
        (s.pad, s.unk, s.cls, s.sep, s.mask),
        (0, 100, 101, 102, 103)
    );
    check_all_cases(&tok);
}

#[test]
fn saved_tokenizer_json_reloads_with_identical_ids_and_hf_files() {
    let tok = reference_tokenizer();
    let dir = tempfile::tempdir().unwrap();
    tok.save(dir.path()).unwrap();
    let vocab_txt = std::fs::read(dir.path().join("vocab.txt")).unwrap();
    let original = std::fs::read(in_repo("fixtures/wordpiece/vocab.txt")).unwrap();
    assert_eq!(
        vocab_txt, original,
        "vocab.txt must round-trip byte for byte"
    );
    let reloaded = KeelTokenizer::from_tokenizer_json(&dir.path().join("tokenizer.json")).unwrap();
    assert!(reloaded.lowercase());
    assert_eq!(reloaded.vocab_hash(), tok.vocab_hash());
    check_all_cases(&reloaded);
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["do_lower_case"], true);
    assert_eq!(config["tokenizer_class"], "BertTokenizer");
    let map: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("special_tokens_map.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(map["mask_token"], "[MASK]");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("tokenizer.json")).unwrap())
            .unwrap();
    assert_eq!(json["model"]["type"], "WordPiece");
    assert_eq!(json["normalizer"]["type"], "BertNormalizer");
    assert_eq!(json["normalizer"]["lowercase"], true);
}

#[test]
fn cased_vocab_keeps_case() {
    let tok =
        KeelTokenizer::from_vocab_file(&in_repo("fixtures/wordpiece/vocab.txt"), false).unwrap();
    // The uncased vocabulary has no "God": cased tokenisation must not lowercase it.
    assert_ne!(tok.encode("God"), reference_tokenizer().encode("God"));
    let dir = tempfile::tempdir().unwrap();
    tok.save(dir.path()).unwrap();
    let config = std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap();
    assert!(config.contains("\"do_lower_case\": false"), "{config}");
    let reloaded = KeelTokenizer::from_tokenizer_json(&dir.path().join("tokenizer.json")).unwrap();
    assert!(!reloaded.lowercase());
}

fn corpus_lines(rel: &str, max_bytes: usize) -> Vec<String> {
    let text = std::fs::read_to_string(in_repo(rel)).unwrap();
    let mut out = Vec::new();
    let mut n = 0;
    for line in text.lines() {
        n += line.len() + 1;
        if n > max_bytes {
            break;
        }
        out.push(line.to_string());
    }
    out
}

#[test]
fn trained_vocabulary_has_specials_first_and_round_trips() {
    let lines = corpus_lines("corpora/en-kjv/kjv.txt", 1_000_000);
    let options = TrainOptions::new(3000);
    let a = KeelTokenizer::train(&options, lines.iter()).unwrap();
    // That training twice gives the same vocabulary, also in another process, is
    // tests/vocab_determinism.rs's.
    let s = a.special();
    assert_eq!((s.pad, s.unk, s.cls, s.sep, s.mask), (0, 1, 2, 3, 4));
    assert_eq!(
        &a.vocab()[..5],
        &["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    );
    assert!(
        a.vocab_size() <= 3000 && a.vocab_size() > 2500,
        "{}",
        a.vocab_size()
    );
    assert!(a.vocab().iter().any(|t| t.starts_with("##")));
    // Frequent words of the corpus are single tokens; text round-trips through decode.
    let ids = a.encode("And God said, Let there be light");
    assert_eq!(a.decode(&ids), "and god said, let there be light");
    assert!(ids.iter().all(|&i| i != s.unk));
    // Save + reload gives the same ids.
    let dir = tempfile::tempdir().unwrap();
    a.save(dir.path()).unwrap();
    let from_txt = KeelTokenizer::from_vocab_file(&dir.path().join("vocab.txt"), true).unwrap();
    let from_json = KeelTokenizer::from_tokenizer_json(&dir.path().join("tokenizer.json")).unwrap();
    for line in lines.iter().take(500) {
        assert_eq!(from_txt.encode(line), a.encode(line));
        assert_eq!(from_json.encode(line), a.encode(line));
    }
    assert_eq!(from_txt.vocab_hash_hex(), a.vocab_hash_hex());
}

#[test]
fn chinese_characters_are_one_token_each() {
    let lines = corpus_lines("corpora/zh-poetry/poetry.txt", 400_000);
    let tok = KeelTokenizer::train(&TrainOptions::new(8000), lines.iter()).unwrap();
    let ids = tok.encode("床前明月光，疑是地上霜。");
    let tokens: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    assert_eq!(
        tokens,
        [
            "床", "前", "明", "月", "光", "，", "疑", "是", "地", "上", "霜", "。"
        ]
    );
}

#[test]
fn vocabulary_larger_than_the_model_is_refused() {
    let err = check_fits(30_522, 512).unwrap_err();
    assert!(matches!(err, TokenizerError::VocabTooLarge { .. }));
    assert!(err.to_string().contains("30522") && err.to_string().contains("512"));
    assert!(reference_tokenizer().check_fits(512).is_err());
    assert!(reference_tokenizer().check_fits(30_522).is_ok());
}

#[test]
fn vocab_without_special_tokens_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vocab.txt");
    std::fs::write(&path, "[PAD]\n[UNK]\nhello\n").unwrap();
    let err = KeelTokenizer::from_vocab_file(&path, true).unwrap_err();
    assert!(err.to_string().contains("[CLS]"), "{err}");
}

#[test]
fn grouped_line_encoding_equals_line_by_line() {
    let tok = reference_tokenizer();
    let mut lines = corpus_lines("corpora/en-fortunes/fortunes.txt", 200_000);
    lines.extend(corpus_lines("corpora/zh-poetry/poetry.txt", 100_000));
    // Lines that tokenise to nothing, and a literal "[SEP]" (forces the fallback).
    lines.insert(3, "\u{200d}".to_string());
    lines.insert(7, "   ".to_string());
    for group in lines.chunks(64) {
        let per_line: Vec<Vec<u32>> = group.iter().map(|l| tok.encode(l)).collect();
        assert_eq!(tok.encode_lines(group), per_line);
    }
    let with_sep = ["a [SEP] b".to_string(), "c".to_string()];
    let per_line: Vec<Vec<u32>> = with_sep.iter().map(|l| tok.encode(l)).collect();
    assert_eq!(tok.encode_lines(&with_sep), per_line);
    assert_eq!(
        per_line[0].len(),
        3,
        "a literal [SEP] is the special token, as in HF"
    );
}
