//! Replays every committed input of `fuzz/corpus/NAME/` (the seeds, and every input a fuzzer
//! found a bug with) through its target, on stable: a decoder that panics on one fails here.

use std::path::PathBuf;
use std::time::Instant;

#[test]
fn every_corpus_input_replays_without_a_panic() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus");
    for (name, target) in keel_fuzz_targets::TARGETS {
        let dir = root.join(name);
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a folder entry").path())
            .filter(|path| path.is_file())
            .collect();
        inputs.sort();
        assert!(
            !inputs.is_empty(),
            "{}: no input to replay (a replay of nothing tests nothing)",
            dir.display()
        );
        let started = Instant::now();
        for input in &inputs {
            let data = std::fs::read(input).expect("a corpus input");
            eprintln!("replaying {}", input.display());
            target(&data);
        }
        println!(
            "{name}: replayed {} inputs in {:.2} s",
            inputs.len(),
            started.elapsed().as_secs_f64()
        );
    }
}

#[test]
fn every_target_has_a_corpus_folder_and_a_fuzz_target() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    for (name, _) in keel_fuzz_targets::TARGETS {
        assert!(
            root.join("corpus").join(name).is_dir(),
            "no corpus for {name}"
        );
        let source = root.join("fuzz_targets").join(format!("{name}.rs"));
        let text = std::fs::read_to_string(&source)
            .unwrap_or_else(|e| panic!("{}: {e}", source.display()));
        assert!(
            text.contains(&format!("keel_fuzz_targets::{name}(")),
            "{} does not call keel_fuzz_targets::{name}",
            source.display()
        );
    }
}
