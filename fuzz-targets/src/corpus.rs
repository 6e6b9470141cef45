//! `corpus`: corpus files through the coordinator's reader ([`DocumentReader`], the first
//! stage of a job's preparation), as plain text, gzip and JSON Lines.

use keel_coordinator::data::corpus::{DocumentReader, resolve_inputs};

/// Documents read per file, at most.
const MAX_DOCUMENTS: usize = 1024;

/// The first byte chooses whether invalid UTF-8 lines are skipped (bit 0) rather than
/// refused; the rest is written as `file.txt`, `file.gz` and `file.jsonl` in a fresh folder,
/// which [`resolve_inputs`] takes as named, and each is read through a [`DocumentReader`].
pub fn corpus(data: &[u8]) {
    let Some((&flags, file)) = data.split_first() else {
        return;
    };
    let dir = crate::temp_dir();
    let named: Vec<_> = ["file.txt", "file.gz", "file.jsonl"]
        .map(|name| dir.path().join(name))
        .into();
    for path in &named {
        std::fs::write(path, file).expect("writing a temporary file");
    }
    // Files named explicitly are taken whatever their name (a folder lists only `*.txt`,
    // `*.text`, `*.jsonl`, optionally `.gz`).
    let files = resolve_inputs(&named).expect("the three files");
    assert_eq!(files.len(), 3, "resolve_inputs lists {files:?}");
    for path in files {
        let mut reader = DocumentReader::new(vec![path], flags & 1 == 1);
        for document in reader.by_ref().take(MAX_DOCUMENTS) {
            let Ok(document) = document else {
                break;
            };
            assert!(
                document.sentences.iter().all(|s| !s.trim().is_empty()),
                "a document holds a blank sentence"
            );
        }
        let _ = reader.stats();
    }
}
