//! `keel ... | head`: output into a pipe whose reader has gone ends keel quietly and keeps its
//! work, instead of a panic (Rust's `println!`) or a silent death by SIGPIPE.

mod common;

use common::{command, keel, kjv_lines};
use std::process::Stdio;

#[test]
fn prepare_into_a_closed_pipe_exits_quietly_and_writes_its_shards() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = kjv_lines(dir.path(), 400);
    let out_dir = dir.path().join("prepared");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader); // every write to `writer` now fails with EPIPE
    let out = command(&keel())
        .args(["prepare", "--corpus"])
        .arg(&corpus)
        .args(["--vocab-size", "200", "--max-seq-length", "32", "--out"])
        .arg(&out_dir)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out_dir.join("vocab.txt").is_file(), "no vocab.txt");
    assert!(out_dir.join("heldout.keel").is_file(), "no heldout.keel");
}
