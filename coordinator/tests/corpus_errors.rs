//! Bad and unusual corpus input: clear errors naming file, line and offset; formats that work.

use std::io::Write;
use std::path::{Path, PathBuf};

use keel_coordinator::data::{Objective, PrepareError, PrepareOptions, VocabSource, prepare};

#[path = "../../fixtures/testdata.rs"]
mod testdata;
use testdata::in_repo;

fn opts(corpus: Vec<PathBuf>, out: &Path, objective: Objective) -> PrepareOptions {
    let mut o = PrepareOptions::new(
        corpus,
        VocabSource::File {
            path: in_repo("fixtures/wordpiece/vocab.txt"),
            lowercase: true,
        },
        objective,
        out.to_path_buf(),
    );
    o.heldout_fraction = 0.0;
    o
}

/// A few real documents of the KJV.
fn kjv_head(lines: usize) -> String {
    let text = std::fs::read_to_string(in_repo("corpora/en-kjv/kjv.txt")).unwrap();
    text.lines().take(lines).collect::<Vec<_>>().join("\n") + "\n"
}

#[test]
fn invalid_utf8_names_file_and_byte_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.txt");
    let good = "In the beginning.\nAnd the earth.\n";
    let mut bytes = good.as_bytes().to_vec();
    bytes.extend_from_slice(b"caf\xc3 x\n");
    bytes.extend_from_slice(b"\nSecond document here.\n");
    std::fs::write(&path, &bytes).unwrap();
    let err = prepare(&opts(
        vec![path.clone()],
        &dir.path().join("o"),
        Objective::Mlm,
    ))
    .unwrap_err()
    .to_string();
    let offset = good.len() + 3;
    assert!(err.contains("bad.txt"), "{err}");
    assert!(err.contains(&format!("byte offset {offset}")), "{err}");
    assert!(err.contains("line 3"), "{err}");
    // Opt-in skipping counts the line and goes on.
    let mut o = opts(vec![path], &dir.path().join("o2"), Objective::Mlm);
    o.skip_invalid_lines = true;
    let m = prepare(&o).unwrap();
    assert_eq!(m.corpus.skipped_invalid_lines, 1);
    assert_eq!(m.corpus.documents, 2);
    assert_eq!(m.corpus.sentences, 3);
}

#[test]
fn empty_and_contentless_corpora_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n   \n").unwrap();
    let err = prepare(&opts(vec![empty], &dir.path().join("o"), Objective::Mlm)).unwrap_err();
    assert!(matches!(err, PrepareError::EmptyCorpus { .. }), "{err}");
    assert!(err.to_string().contains("empty corpus"));
    let zw = dir.path().join("zw.txt");
    std::fs::write(&zw, "\u{200d}\n\u{200d}\u{200d}\n\n\u{7}\n").unwrap();
    let err = prepare(&opts(vec![zw], &dir.path().join("o"), Objective::Mlm)).unwrap_err();
    assert!(err.to_string().contains("tokenise to nothing"), "{err}");
    let err = prepare(&opts(
        vec![dir.path().join("missing.txt")],
        &dir.path().join("o"),
        Objective::Mlm,
    ))
    .unwrap_err();
    assert!(err.to_string().contains("missing.txt"), "{err}");
}

#[test]
fn lines_that_tokenise_to_nothing_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.txt");
    std::fs::write(
        &path,
        format!("{}\u{200d}\n\n\u{200d}\n\n{}", kjv_head(5), kjv_head(3)),
    )
    .unwrap();
    let m = prepare(&opts(vec![path], &dir.path().join("o"), Objective::Mlm)).unwrap();
    assert_eq!(m.corpus.dropped_lines, 2);
    assert_eq!(
        m.corpus.documents, 2,
        "a document of dropped lines vanishes"
    );
    assert_eq!(m.corpus.sentences, 8);
}

#[test]
fn bad_json_line_names_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.jsonl");
    std::fs::write(
        &path,
        "{\"text\": \"In the beginning God created the heaven.\"}\n\n{\"text\": 3}\n",
    )
    .unwrap();
    let err = prepare(&opts(
        vec![path.clone()],
        &dir.path().join("o"),
        Objective::Mlm,
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("c.jsonl") && err.contains("line 3"), "{err}");
    std::fs::write(&path, "{\"text\": \"ok\"}\nnot json\n").unwrap();
    let err = prepare(&opts(vec![path], &dir.path().join("o"), Objective::Mlm))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("line 2") && err.contains("invalid JSON"),
        "{err}"
    );
}

#[test]
fn jsonl_gzip_directories_and_globs_read_the_same_documents() {
    let dir = tempfile::tempdir().unwrap();
    let text = kjv_head(60);
    let plain_dir = dir.path().join("plain");
    std::fs::create_dir(&plain_dir).unwrap();
    std::fs::write(plain_dir.join("a.txt"), &text).unwrap();
    std::fs::write(plain_dir.join("README.md"), "not a corpus file\n").unwrap();
    // The same documents as JSON Lines (one document per line) ...
    let docs: Vec<String> = text
        .split("\n\n")
        .map(|d| d.trim().to_string())
        .filter(|d| !d.is_empty())
        .collect();
    let jsonl = dir.path().join("c.jsonl");
    let mut f = std::fs::File::create(&jsonl).unwrap();
    for d in &docs {
        writeln!(f, "{}", serde_json::json!({ "text": d, "id": 1 })).unwrap();
    }
    drop(f);
    // ... and gzipped text.
    let gz = dir.path().join("c.txt.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::default(),
    );
    enc.write_all(text.as_bytes()).unwrap();
    enc.finish().unwrap();
    let glob = PathBuf::from(format!("{}/plain/*.txt", dir.path().display()));
    let mut shards = Vec::new();
    for (k, input) in [plain_dir, jsonl, gz, glob].into_iter().enumerate() {
        let out = dir.path().join(format!("o{k}"));
        let m = prepare(&opts(vec![input], &out, Objective::MlmNsp)).unwrap();
        assert_eq!(m.corpus.documents, docs.len() as u64);
        shards.push(std::fs::read(out.join("shard-00000.keel")).unwrap());
    }
    for s in &shards[1..] {
        assert!(s == &shards[0], "same documents must give the same shard");
    }
}

#[test]
fn one_document_corpus_works_for_mlm_and_explains_nsp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one.txt");
    std::fs::write(&path, kjv_head(20)).unwrap();
    let m = prepare(&opts(
        vec![path.clone()],
        &dir.path().join("o"),
        Objective::Mlm,
    ))
    .unwrap();
    assert_eq!(m.corpus.documents, 1);
    assert!(m.total_sequences >= 1);
    let err = prepare(&opts(
        vec![path.clone()],
        &dir.path().join("o2"),
        Objective::MlmNsp,
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("at least 2 documents"), "{err}");
    let mut o = opts(vec![path], &dir.path().join("o3"), Objective::Mlm);
    o.shards = 1000;
    let err = prepare(&o).unwrap_err().to_string();
    assert!(err.contains("1000 shards"), "{err}");
}

#[test]
fn options_follow_the_job_file() {
    let spec: keel_proto::jobspec::DataSpec = serde_json::from_value(serde_json::json!({
        "corpus": ["a.txt", "dir/"], "vocab_size": 8000, "lowercase": false,
        "objective": "mlm+nsp", "max_seq_length": 64, "heldout_fraction": 0.02
    }))
    .unwrap();
    let o = PrepareOptions::from_spec(&spec, PathBuf::from("out"), 3, 9, 2);
    assert_eq!(
        o.vocab,
        VocabSource::Train {
            vocab_size: 8000,
            lowercase: false
        }
    );
    assert_eq!(o.objective, Objective::MlmNsp);
    assert_eq!(
        o.corpus,
        vec![PathBuf::from("a.txt"), PathBuf::from("dir/")]
    );
    assert_eq!(
        (o.max_seq_length, o.shards, o.seed, o.threads),
        (64, 3, 9, 2)
    );
    assert_eq!(o.heldout_fraction, 0.02);
}

#[test]
fn a_multi_gigabyte_line_a_device_or_a_fifo_is_refused_naming_the_file_and_limit() {
    let dir = tempfile::tempdir().unwrap();
    // 3 GiB without a newline, sparse (no disk): refused after 16 MiB, not buffered whole.
    let sparse = dir.path().join("no-newline.txt");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(3 << 30)
        .unwrap();
    let started = std::time::Instant::now();
    let err = prepare(&opts(vec![sparse], &dir.path().join("o1"), Objective::Mlm))
        .unwrap_err()
        .to_string();
    println!(
        "3 GiB line refused in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert!(err.contains("no-newline.txt"), "{err}");
    assert!(
        err.contains("line 1") && err.contains("16777216-byte line limit"),
        "{err}"
    );

    // /dev/zero as the vocabulary, and as a corpus named explicitly.
    let mut o = opts(
        vec![kjv_file(dir.path())],
        &dir.path().join("o2"),
        Objective::Mlm,
    );
    o.vocab = VocabSource::File {
        path: PathBuf::from("/dev/zero"),
        lowercase: true,
    };
    let err = prepare(&o).unwrap_err().to_string();
    assert!(
        err.contains("/dev/zero") && err.contains("not a regular file"),
        "{err}"
    );
    let err = prepare(&opts(
        vec![PathBuf::from("/dev/zero")],
        &dir.path().join("o3"),
        Objective::Mlm,
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("/dev/zero"), "{err}");

    // A FIFO vocabulary with no writer: refused at once instead of blocking forever.
    let fifo = dir.path().join("vocab.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let mut o = opts(
        vec![kjv_file(dir.path())],
        &dir.path().join("o4"),
        Objective::Mlm,
    );
    o.vocab = VocabSource::File {
        path: fifo,
        lowercase: true,
    };
    let err = prepare(&o).unwrap_err().to_string();
    assert!(
        err.contains("vocab.fifo") && err.contains("a FIFO"),
        "{err}"
    );
}

/// A few KJV documents in `dir/kjv.txt`.
fn kjv_file(dir: &Path) -> PathBuf {
    let path = dir.join("kjv.txt");
    std::fs::write(&path, kjv_head(200)).unwrap();
    path
}
