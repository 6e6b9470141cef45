//! Training a WordPiece vocabulary twice on the same corpus with the same settings gives the
//! same `vocab.txt`, byte for byte: twice in one process, and in separate processes (a hash
//! map's seed is chosen once per process, so an order that depends on it differs only there).
//!
//! The second-process runs are this test binary started again on the
//! `child_prints_the_vocabulary_hash` test with `KEEL_VOCAB_CHILD` set; without that variable
//! that test does nothing.

use std::process::Command;

use keel_proto::tokenizer::{KeelTokenizer, TrainOptions};

#[path = "../../fixtures/testdata.rs"]
mod testdata;

/// Set (to any value) in a child process: train and print the hash.
const CHILD_ENV: &str = "KEEL_VOCAB_CHILD";
/// What the child prints before the hash.
const HASH_PREFIX: &str = "keel-vocab-sha256=";

/// The King James Bible as `keel local` and the demo train on it: every non-empty line, an
/// 8,000-token uncased vocabulary.
fn kjv_vocabulary() -> KeelTokenizer {
    let text = std::fs::read_to_string(testdata::corpus("en-kjv/kjv.txt")).unwrap();
    let lines = text.lines().filter(|l| !l.trim().is_empty());
    KeelTokenizer::train(&TrainOptions::new(8000), lines).unwrap()
}

/// The vocabulary's hash as trained by a fresh process.
fn hash_in_child() -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_prints_the_vocabulary_hash",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once(HASH_PREFIX))
        .map(|(_, hash)| hash.trim().to_string())
        .unwrap_or_else(|| panic!("no {HASH_PREFIX} in the child's output: {stdout}"))
}

#[test]
fn child_prints_the_vocabulary_hash() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // On a line of its own: libtest has printed "test ... " without a newline.
    println!("\n{HASH_PREFIX}{}", kjv_vocabulary().vocab_hash_hex());
}

#[test]
fn training_twice_in_one_process_gives_the_same_vocabulary() {
    let a = kjv_vocabulary();
    let b = kjv_vocabulary();
    let first_difference = a
        .vocab()
        .iter()
        .zip(b.vocab().iter())
        .position(|(x, y)| x != y);
    assert_eq!(
        first_difference,
        None,
        "the two vocabularies differ from line {:?} on",
        first_difference.map(|i| i + 1)
    );
    assert_eq!(a.vocab_hash_hex(), b.vocab_hash_hex());
}

#[test]
fn training_in_separate_processes_gives_the_same_vocabulary() {
    let here = kjv_vocabulary().vocab_hash_hex();
    let first = hash_in_child();
    let second = hash_in_child();
    assert_eq!(
        (first.as_str(), second.as_str()),
        (here.as_str(), here.as_str()),
        "vocab.txt hashes of two child processes and this one differ"
    );
}
