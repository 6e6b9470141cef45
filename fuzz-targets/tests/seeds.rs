//! Writes the seed inputs of `fuzz/corpus/` from the project's own writers and files (a real
//! shard, checkpoint, vocabulary, ring frames, job files). Run once by hand, then commit:
//!
//! `cargo test --release -p keel-fuzz-targets --test seeds -- --ignored`

use std::io::Write;
use std::path::{Path, PathBuf};

use keel_proto::checkpoint::Manifest;
use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};
use keel_proto::ring_rpc::RingFrame;
use keel_proto::rpc::{
    CancelJobRequest, HeartbeatRequest, RegisterRequest, StepReport, SubmitJobRequest, TrainingKey,
};
use keel_proto::shard::{Sequence, ShardWriter};
use keel_proto::tokenizer::KeelTokenizer;
use prost::Message;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn seed(target: &str, name: &str, bytes: &[u8]) {
    let dir = repo().join("fuzz/corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn prefixed(part: &[u8]) -> Vec<u8> {
    let mut out = (part.len() as u16).to_le_bytes().to_vec();
    out.extend_from_slice(part);
    out
}

/// gRPC's message prefix, then the message (what tonic and the worker's ring send).
fn grpc(frame: &RingFrame) -> Vec<u8> {
    let body = frame.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

fn frame(step: u64, ring_step: u32, offset: u64, data: Vec<u8>, dtype: i32) -> RingFrame {
    RingFrame {
        job_id: keel_fuzz_targets::RING_JOB_ID.into(),
        generation: keel_fuzz_targets::RING_GENERATION,
        step,
        bucket: 0,
        sender_rank: 1,
        ring_step,
        total_len: 8,
        offset,
        data: data.into(),
        dtype,
        collective: 0,
    }
}

fn ring_seeds() {
    // World 2, rank 0, frames of 4 elements: at ring step 0 rank 0 receives elements 4..8 of
    // an 8-element all-reduce, at ring step 1 elements 0..4.
    let f32s: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let shape = [0u8, 3];
    // Started all-reduce (step 7, bucket 0, 8 f32), one frame, in one DATA frame.
    let mut one = [&shape[..], &[1, 1, 0, 0, 0]].concat();
    one.extend(grpc(&frame(7, 0, 4, f32s.clone(), 0)));
    seed("ring_frame", "running-one-frame", &one);
    // Nothing started: both ring steps held ahead (only step 0 may be), cut at 3, then 5-byte
    // DATA frames.
    let mut ahead = [&shape[..], &[0, 0, 3, 0, 5]].concat();
    ahead.extend(grpc(&frame(40, 0, 4, f32s.clone(), 0)));
    ahead.extend(grpc(&frame(40, 1, 0, f32s.clone(), 0)));
    seed("ring_frame", "ahead-two-frames-split", &ahead);
    // A bf16 all-reduce started, its frame (8 bytes: 4 bf16) and a duplicate.
    let bf16 = vec![0x80, 0x3f, 0, 0x40, 0x40, 0x40, 0x80, 0x40];
    let mut b = [&shape[..], &[1 | 8, 1, 20, 0, 0]].concat();
    b.extend(grpc(&frame(7, 0, 4, bf16.clone(), 1)));
    b.extend(grpc(&frame(7, 0, 4, bf16, 1)));
    seed("ring_frame", "running-bf16-duplicate", &b);
    // Frames of another job and of an older generation, and a truncated message.
    let mut other = [&shape[..], &[1, 1, 0, 0, 0]].concat();
    other.extend(grpc(&RingFrame {
        job_id: "job-other".into(),
        ..frame(7, 0, 4, f32s.clone(), 0)
    }));
    other.extend(grpc(&RingFrame {
        generation: 1,
        ..frame(7, 0, 4, f32s.clone(), 0)
    }));
    let last = grpc(&frame(7, 1, 0, f32s, 0));
    other.extend(&last[..last.len() - 3]);
    seed("ring_frame", "refused-and-truncated", &other);
}

fn record(kind: u8, message: &[u8]) -> Vec<u8> {
    let mut out = vec![kind];
    out.extend((message.len() as u16).to_le_bytes());
    out.extend_from_slice(message);
    out
}

fn control_seeds() {
    let register = RegisterRequest {
        advertise_addr: "10.0.0.7:7301".into(),
        threads: 2,
        hostname: "node-7".into(),
        memory_limit_bytes: Some(8 << 30),
        ..Default::default()
    }
    .encode_to_vec();
    let heartbeat = HeartbeatRequest {
        worker_id: "w-1".into(),
        key: Some(TrainingKey {
            job_id: "job-1".into(),
            generation: 1,
            step: 3,
        }),
        last_step_seconds: 0.5,
        last_ring_wait_seconds: 0.1,
    }
    .encode_to_vec();
    // kjv-tiny.toml naming the corpus file the fuzzed coordinator's input root holds.
    let corpus =
        keel_fuzz_targets::control_input_root().join(keel_fuzz_targets::CONTROL_CORPUS_FILE);
    let toml = std::fs::read_to_string(repo().join("examples/kjv-tiny.toml"))
        .unwrap()
        .replace(
            "\"corpora/en-kjv\"",
            &format!("{:?}", corpus.display().to_string()),
        );
    assert!(toml.contains(&corpus.display().to_string()));
    let submit = SubmitJobRequest {
        spec_toml: toml,
        origin: "kjv-tiny.toml".into(),
    }
    .encode_to_vec();
    let step = StepReport {
        key: Some(TrainingKey {
            job_id: "job-1".into(),
            generation: 1,
            step: 1,
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let cancel = CancelJobRequest {
        job_id: "job-1".into(),
    }
    .encode_to_vec();
    let mut session = record(1, &register);
    session.extend(record(
        1,
        &RegisterRequest {
            advertise_addr: "10.0.0.8:7301".into(),
            ..Default::default()
        }
        .encode_to_vec(),
    ));
    session.extend(record(2, &heartbeat));
    session.extend(record(0, &submit));
    session.extend(record(3, &step));
    session.extend(record(9, &cancel));
    session.extend(record(8, &cancel));
    seed("control_request", "register-submit-report-cancel", &session);
    seed("control_request", "register", &record(1, &register));
    seed("control_request", "submit", &record(0, &submit));
}

fn shard_seeds(dir: &Path) {
    for (name, nsp) in [("mlm", false), ("nsp", true)] {
        let path = dir.join(format!("{name}.shard"));
        let mut writer = ShardWriter::create(&path, [7u8; 32], 512).unwrap();
        for i in 0..4u64 {
            let ids: Vec<u32> = [2, 10 + i as u32, 11, 3, 12, 3].to_vec();
            let token_type_ids = if nsp {
                vec![0, 0, 0, 0, 1, 1]
            } else {
                vec![0; 6]
            };
            let seq = Sequence {
                global_index: 100 + i,
                ids,
                token_type_ids,
                nsp_label: nsp.then_some((i % 2) as u32),
            };
            writer.push(&seq, i).unwrap();
        }
        writer.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        seed(
            "shard",
            &format!("{name}-4-sequences"),
            &[&[0u8][..], &bytes].concat(),
        );
        seed(
            "shard",
            &format!("{name}-4-sequences-crc-fixed"),
            &[&[1u8][..], &bytes].concat(),
        );
    }
}

fn micro_config() -> BertConfig {
    let mut config = BertConfig::preset("tiny", 16).unwrap();
    config.hidden_size = 4;
    config.num_attention_heads = 2;
    config.intermediate_size = 8;
    config.num_hidden_layers = 1;
    config.max_position_embeddings = 8;
    config.validate().unwrap();
    config
}

fn checkpoint_seeds(dir: &Path) {
    let config = micro_config();
    let layout = ParamLayout::bert(&config, Heads::MaskedLm);
    let params: Vec<f32> = (0..layout.total_len()).map(|i| i as f32 / 100.0).collect();
    let ckpt = dir.join("checkpoint");
    std::fs::create_dir_all(&ckpt).unwrap();
    keel_proto::weights::save_safetensors(ckpt.join("model.safetensors"), &layout, &params)
        .unwrap();
    let config_json = config.to_json_pretty();
    std::fs::write(ckpt.join("config.json"), &config_json).unwrap();
    let manifest = serde_json::to_string_pretty(&Manifest::compute(&ckpt).unwrap()).unwrap();
    let model = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    let all = [
        prefixed(manifest.as_bytes()),
        prefixed(config_json.as_bytes()),
        model.clone(),
    ]
    .concat();
    seed("checkpoint", "micro-with-manifest", &all);
    let no_manifest = [
        prefixed(b""),
        prefixed(config_json.as_bytes()),
        model.clone(),
    ]
    .concat();
    seed("checkpoint", "micro-without-manifest", &no_manifest);
    let model_only = [prefixed(b""), prefixed(b""), model].concat();
    seed("checkpoint", "model-only", &model_only);
}

fn job_seeds() {
    for name in [
        "kjv-tiny.toml",
        "kjv-tiny-two-phase.toml",
        "kjv-tiny-diloco.toml",
        "ttq-mini.toml",
    ] {
        let text = std::fs::read(repo().join("examples").join(name)).unwrap();
        seed("job_toml", name, &text);
    }
}

fn vocab_seeds(dir: &Path) {
    // The first 300 tokens of the WordPiece fixture's vocabulary (specials first).
    let full = std::fs::read_to_string(repo().join("fixtures/wordpiece/vocab.txt")).unwrap();
    let small: Vec<&str> = full.lines().take(300).collect();
    let mut text = small.join("\n");
    for special in keel_proto::tokenizer::SPECIAL_TOKENS {
        if !small.contains(&special) {
            text.push('\n');
            text.push_str(special);
        }
    }
    text.push('\n');
    seed(
        "vocab",
        "vocab-300-lowercase.txt",
        &[b"\x01", text.as_bytes()].concat(),
    );
    let path = dir.join("vocab.txt");
    std::fs::write(&path, &text).unwrap();
    let tokenizer = KeelTokenizer::from_vocab_file(&path, true).unwrap();
    let out = dir.join("tokenizer");
    tokenizer.save(&out).unwrap();
    let json = std::fs::read(out.join("tokenizer.json")).unwrap();
    seed(
        "vocab",
        "tokenizer-300.json",
        &[b"\x00", json.as_slice()].concat(),
    );
}

fn corpus_seeds() {
    let text = "In the beginning God created the heaven and the earth.\n\
                And the earth was without form, and void.\n\
                \n\
                And God said, Let there be light: and there was light.\n";
    seed("corpus", "text", &[b"\x00", text.as_bytes()].concat());
    seed(
        "corpus",
        "text-invalid-utf8-skipped",
        &[b"\x01", text.as_bytes(), b"\xff\xfe\n", text.as_bytes()].concat(),
    );
    let jsonl =
        "{\"text\": \"In the beginning.\\nAnd the earth.\"}\n{\"text\": \"Let there be light.\"}\n";
    seed("corpus", "jsonl", &[b"\x00", jsonl.as_bytes()].concat());
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(text.as_bytes()).unwrap();
    seed(
        "corpus",
        "text.gz",
        &[b"\x00", gz.finish().unwrap().as_slice()].concat(),
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(jsonl.as_bytes()).unwrap();
    seed(
        "corpus",
        "jsonl.gz",
        &[b"\x00", gz.finish().unwrap().as_slice()].concat(),
    );
}

#[test]
#[ignore = "writes fuzz/corpus/: run by hand"]
fn write_seeds() {
    let dir = tempfile::tempdir().unwrap();
    ring_seeds();
    control_seeds();
    shard_seeds(dir.path());
    checkpoint_seeds(dir.path());
    job_seeds();
    vocab_seeds(dir.path());
    corpus_seeds();
}
