//! The catalogue of bad inputs: every entry point of a real cluster (one coordinator and two
//! worker processes on 127.0.0.1) gets malformed, out-of-range, hostile or stale input and must
//! answer with a clear error — the right gRPC code and a message naming the field, file or
//! tensor — and the cluster must stay healthy: Ping answers and a small real job completes
//! at the end.
//!
//! # Layout
//! - `job_specs`: SubmitJob with TOML that cannot be a job (refused at submit).
//! - `prepared_inputs`: jobs whose corpus, vocabulary, model config or init_checkpoint is bad:
//!   a path that is not there is refused at submit, a file that is there but unusable fails
//!   the job while preparing, naming the file or field.
//! - `coordinator_rpcs`: RPC fields sent directly (unknown ids, stale generations, names outside
//!   the job, uploads with path names or NaN weights, oversized messages).
//! - `ring_frames`: frames sent directly to a worker's ring service.

mod common;

use common::*;
use keel_proto::checkpoint::{MANIFEST_FILE, MODEL_FILE, commit_dir, verify_dir};
use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};
use keel_proto::ring_rpc::RingFrame;
use keel_proto::ring_rpc::ring_client::RingClient;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::*;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::Code;
use tonic::transport::Channel;

/// The coordinator client every section uses (built only by [`coordinator`]).
type Coord = CoordinatorClient<keel_net::auth::AuthChannel>;
/// A worker's ring client (built only by [`ring`]).
type Ring = RingClient<keel_net::auth::AuthChannel>;

/// The test cluster's token on every call.
fn with_token(channel: Channel) -> keel_net::auth::AuthChannel {
    let token = keel_net::auth::ClusterToken::load(token_file()).unwrap();
    keel_net::security::ClientSecurity::new(&token, None).wrap(channel)
}

/// The one place clients are made (with the cluster token).
async fn coordinator(addr: &str) -> Coord {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    CoordinatorClient::new(with_token(channel))
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

/// A ring client to the worker at `addr` (see [`coordinator`]).
async fn ring(addr: &str) -> Ring {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    RingClient::new(with_token(channel))
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

/// Asserts a refusal with `code` whose message contains every one of `words`.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(
    what: &str,
    result: Result<T, tonic::Status>,
    code: Code,
    words: &[&str],
) {
    let status = match result {
        Ok(v) => panic!("{what}: accepted ({v:?}), expected {code:?}"),
        Err(s) => s,
    };
    assert_eq!(status.code(), code, "{what}: {}", status.message());
    for w in words {
        assert!(
            status.message().contains(w),
            "{what}: message {:?} does not name {w:?}",
            status.message()
        );
    }
    eprintln!("{what}: {:?}: {}", status.code(), status.message());
}

/// The shared uncased WordPiece vocabulary (30,522 entries).
fn vocab() -> PathBuf {
    fixture("wordpiece/vocab.txt")
}

/// A small corpus: the first 300 lines of the King James Bible.
fn small_corpus(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(corpus("en-kjv/kjv.txt")).unwrap();
    let lines: Vec<&str> = text.lines().take(300).collect();
    let path = dir.join("small.txt");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// A job over `corpus` with the vocabulary file `vocab`; `model` is the `[model]` body.
fn job_toml(corpus: &Path, vocab: &Path, model: &str, steps: u64, workers: usize) -> String {
    format!(
        r#"[data]
corpus = ["{corpus}"]
vocab = "{vocab}"
max_seq_length = 32
masked_lm_prob = 0.15
max_predictions_per_seq = 5
heldout_fraction = 0.02
[model]
{model}
[train]
micro_batch_size = 4
max_steps = {steps}
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = 1
checkpoint_every = {steps}
eval_every = {steps}
[cluster]
min_workers = {workers}
max_workers = {workers}
peer_timeout_seconds = 30
"#,
        corpus = corpus.display(),
        vocab = vocab.display(),
    )
}

async fn submit(client: &mut Coord, toml: String, origin: &str) -> Result<String, tonic::Status> {
    client
        .submit_job(SubmitJobRequest {
            spec_toml: toml,
            origin: origin.to_string(),
        })
        .await
        .map(|r| r.into_inner().job_id)
}

async fn job_status(client: &mut Coord, id: &str) -> JobStatus {
    client
        .get_job(GetJobRequest {
            job_id: id.to_string(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Waits (bounded) until the job is in one of `states`; returns its status.
async fn wait_for(client: &mut Coord, id: &str, states: &[JobState], limit: Duration) -> JobStatus {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let status = job_status(client, id).await;
        if states.iter().any(|s| *s as i32 == status.state) {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} did not reach {states:?} within {limit:?}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A tiny-preset model config for the shared vocabulary, as a prepared job writes it.
fn tiny_config() -> BertConfig {
    BertConfig::preset("tiny", 30522)
        .unwrap()
        .with_heads(Heads::MaskedLm)
}

/// A checkpoint folder (config.json + model.safetensors of small finite weights); with a
/// manifest when `manifest` is set.
fn checkpoint_folder(root: &Path, name: &str, config: &BertConfig, manifest: bool) -> PathBuf {
    let tmp = root.join(format!(".tmp-{name}"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("config.json"), config.to_json_pretty()).unwrap();
    let layout = ParamLayout::bert(config, Heads::MaskedLm);
    let params: Vec<f32> = (0..layout.total_len())
        .map(|i| ((i % 97) as f32 - 48.0) * 1e-3)
        .collect();
    keel_proto::weights::save_safetensors(tmp.join(MODEL_FILE), &layout, &params).unwrap();
    let dir = root.join(name);
    if manifest {
        commit_dir(&tmp, &dir).unwrap();
    } else {
        std::fs::rename(&tmp, &dir).unwrap();
    }
    dir
}

/// SubmitJob with text that cannot be a job: refused at once, naming the key.
async fn job_specs(client: &mut Coord, corpus: &Path) {
    let good = job_toml(corpus, &vocab(), "preset = \"tiny\"", 2, 2);
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "unknown key",
            good.replace("[train]\n", "[train]\nfrobnicate = 1\n"),
            vec!["bad.toml", "frobnicate"],
        ),
        (
            "wrong type",
            good.replace("max_steps = 2", "max_steps = \"two\""),
            vec!["bad.toml", "max_steps"],
        ),
        (
            "out-of-range value",
            good.replace("masked_lm_prob = 0.15", "masked_lm_prob = 1.5"),
            vec!["bad.toml", "data.masked_lm_prob", "1.5"],
        ),
        (
            "missing section",
            good.replace("[cluster]", "[clusters]"),
            vec!["bad.toml", "clusters"],
        ),
        (
            "not TOML",
            "\u{0}\u{1}garbage = = =".to_string(),
            vec!["bad.toml"],
        ),
    ];
    for (what, toml, words) in cases {
        let result = submit(client, toml, "bad.toml").await;
        assert_refused(
            &format!("job spec, {what}"),
            result,
            Code::InvalidArgument,
            &words,
        );
    }
}

/// Jobs whose inputs are bad: each fails while preparing, naming the file, field or tensor.
async fn prepared_inputs(client: &mut Coord, root: &Path, corpus: &Path) {
    let dir = root.join("inputs");
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = "preset = \"tiny\"";

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let binary = dir.join("binary.txt");
    let bytes: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(&binary, bytes).unwrap();
    let no_specials = dir.join("no-specials.txt");
    std::fs::write(&no_specials, "[PAD]\n[UNK]\n[SEP]\nthe\nand\nof\n").unwrap();

    let mut odd_heads = tiny_config();
    odd_heads.hidden_size = 129;
    let odd_heads_path = dir.join("odd-heads.json");
    std::fs::write(&odd_heads_path, odd_heads.to_json_pretty()).unwrap();
    let mut act: serde_json::Value = serde_json::from_str(&tiny_config().to_json_pretty()).unwrap();
    act["hidden_act"] = serde_json::json!("swishy");
    let act_path = dir.join("bad-act.json");
    std::fs::write(&act_path, act.to_string()).unwrap();

    let truncated = checkpoint_folder(&dir, "truncated-ckpt", &tiny_config(), true);
    let model = truncated.join(MODEL_FILE);
    let len = std::fs::metadata(&model).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let flipped = checkpoint_folder(&dir, "flipped-ckpt", &tiny_config(), true);
    let mut bytes = std::fs::read(flipped.join(MODEL_FILE)).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x01;
    std::fs::write(flipped.join(MODEL_FILE), bytes).unwrap();
    // Weights of a config with a smaller feed-forward block, under the tiny config.
    let mut narrow = tiny_config();
    narrow.intermediate_size /= 2;
    let misshaped = checkpoint_folder(&dir, "misshaped-ckpt", &narrow, false);
    std::fs::write(
        misshaped.join("config.json"),
        tiny_config().to_json_pretty(),
    )
    .unwrap();
    let nan = checkpoint_folder(&dir, "nan-ckpt", &tiny_config(), false);
    let layout = ParamLayout::bert(&tiny_config(), Heads::MaskedLm);
    let mut params = keel_proto::weights::load_safetensors(nan.join(MODEL_FILE), &layout).unwrap();
    let entry = layout
        .find("bert.encoder.layer.1.output.dense.weight")
        .unwrap()
        .clone();
    for k in 0..3 {
        params[entry.range().start + 7 * k] = f32::NAN;
    }
    keel_proto::weights::save_safetensors(nan.join(MODEL_FILE), &layout, &params).unwrap();

    let ckpt = |d: &Path| format!("init_checkpoint = \"{}\"", d.display());
    let cfg = |p: &Path| format!("config = \"{}\"", p.display());
    let missing_corpus = dir.join("no-such-corpus.txt");
    let missing_vocab = dir.join("no-such-vocab.txt");
    // Paths that are not there are refused at submit (not found later while preparing),
    // naming the key and the path.
    for (what, toml, key, path) in [
        (
            "missing corpus path",
            job_toml(&missing_corpus, &vocab(), tiny, 2, 2),
            "data.corpus",
            &missing_corpus,
        ),
        (
            "missing vocab file",
            job_toml(corpus, &missing_vocab, tiny, 2, 2),
            "data.vocab",
            &missing_vocab,
        ),
    ] {
        let result = submit(client, toml, what).await;
        let path = path.display().to_string();
        assert_refused(what, result, Code::InvalidArgument, &[key, &path]);
    }
    // A model config the coordinator can parse and check on its own is refused at submit too,
    // naming the key and what is wrong with it.
    for (what, toml, words) in [
        (
            "hidden_size not divisible by the heads",
            job_toml(corpus, &vocab(), &cfg(&odd_heads_path), 2, 2),
            ["model.config", "hidden_size", "num_attention_heads"],
        ),
        (
            "unknown hidden_act",
            job_toml(corpus, &vocab(), &cfg(&act_path), 2, 2),
            ["model.config", "bad-act.json", "swishy"],
        ),
    ] {
        let result = submit(client, toml, what).await;
        assert_refused(what, result, Code::InvalidArgument, &words);
    }
    // What needs the corpus, the vocabulary or the checkpoint's bytes read is found while
    // preparing: the job fails with the reason.
    let cases: Vec<(&str, String, Vec<String>)> = vec![
        (
            "empty corpus",
            job_toml(&empty, &vocab(), tiny, 2, 2),
            vec!["empty.txt".into()],
        ),
        (
            "binary corpus",
            job_toml(&binary, &vocab(), tiny, 2, 2),
            vec!["binary.txt".into()],
        ),
        (
            "vocab without [MASK] and [CLS]",
            job_toml(corpus, &no_specials, tiny, 2, 2),
            vec!["no-specials.txt".into(), "[CLS]".into()],
        ),
        (
            "truncated init_checkpoint",
            job_toml(corpus, &vocab(), &ckpt(&truncated), 2, 2),
            vec![
                "model.init_checkpoint".into(),
                model.display().to_string(),
                "truncated".into(),
            ],
        ),
        (
            "altered init_checkpoint",
            job_toml(corpus, &vocab(), &ckpt(&flipped), 2, 2),
            vec![
                "model.init_checkpoint".into(),
                "model.safetensors".into(),
                "sha256".into(),
            ],
        ),
        (
            "misshaped init_checkpoint tensor",
            job_toml(corpus, &vocab(), &ckpt(&misshaped), 2, 2),
            vec![
                "model.init_checkpoint".into(),
                "intermediate.dense.weight".into(),
                "shape".into(),
            ],
        ),
        (
            "init_checkpoint with NaN",
            job_toml(corpus, &vocab(), &ckpt(&nan), 2, 2),
            vec![
                "model.init_checkpoint".into(),
                "bert.encoder.layer.1.output.dense.weight has 3 non-finite values".into(),
            ],
        ),
    ];
    let mut ids = Vec::new();
    for (what, toml, words) in cases {
        let id = submit(client, toml, what).await.unwrap();
        ids.push((what, id, words));
    }
    for (what, id, words) in ids {
        let status = wait_for(
            client,
            &id,
            &[
                JobState::Failed,
                JobState::WaitingForWorkers,
                JobState::Running,
            ],
            Duration::from_secs(90),
        )
        .await;
        assert_eq!(status.state, JobState::Failed as i32, "{what}: {status:?}");
        for w in &words {
            assert!(
                status.error.contains(w.as_str()),
                "{what}: error {:?} does not name {w:?}",
                status.error
            );
        }
        eprintln!("{what}: FAILED: {}", status.error);
    }
}

/// One whole-file upload chunk.
fn upload_chunk(key: &TrainingKey, name: &str, data: &[u8]) -> FileChunk {
    keel_proto::transfer::whole_file_chunk(name, data, Some(key.clone()))
}

async fn upload(client: &mut Coord, chunks: Vec<FileChunk>) -> Result<Ack, tonic::Status> {
    client
        .upload_checkpoint(futures::stream::iter(chunks))
        .await
        .map(|r| r.into_inner())
}

/// Small safetensors bytes of the tiny layout, finite, or with NaN in one tensor.
fn weights_bytes(dir: &Path, with_nan: bool) -> Vec<u8> {
    let config = BertConfig::preset("tiny", 100)
        .unwrap()
        .with_heads(Heads::MaskedLm);
    let layout = ParamLayout::bert(&config, Heads::MaskedLm);
    let mut params = vec![0.01f32; layout.total_len()];
    if with_nan {
        let entry = layout
            .find("bert.encoder.layer.1.output.dense.weight")
            .unwrap();
        params[entry.range().start] = f32::INFINITY;
        params[entry.range().start + 1] = f32::NAN;
        params[entry.range().start + 2] = f32::NEG_INFINITY;
    }
    let path = dir.join(format!("w-{with_nan}.safetensors"));
    keel_proto::weights::save_safetensors(&path, &layout, &params).unwrap();
    std::fs::read(path).unwrap()
}

/// RPCs against a job that waits for more workers than exist (generation 0, never runs).
async fn rpcs_on_a_waiting_job(client: &mut Coord, root: &Path, corpus: &Path) {
    let id = submit(
        client,
        job_toml(corpus, &vocab(), "preset = \"tiny\"", 5, 5),
        "wait",
    )
    .await
    .unwrap();
    let status = wait_for(
        client,
        &id,
        &[JobState::WaitingForWorkers, JobState::Failed],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        status.state,
        JobState::WaitingForWorkers as i32,
        "{status:?}"
    );
    let job_dir = root.join("coordinator").join("jobs").join(&id);
    let key = |generation: u64, step: u64| TrainingKey {
        job_id: id.clone(),
        generation,
        step,
    };
    let generation = status.generation;

    for name in ["../job.toml", "/etc/passwd", "metrics.jsonl", ""] {
        let result = client
            .fetch_file(FetchFileRequest {
                key: Some(key(generation, 0)),
                name: name.to_string(),
                ..Default::default()
            })
            .await;
        assert_refused(
            &format!("FetchFile {name:?}"),
            result,
            Code::NotFound,
            &[name],
        );
    }
    let result = client
        .fetch_file(FetchFileRequest {
            key: Some(key(generation + 7, 0)),
            name: "shard".into(),
            ..Default::default()
        })
        .await;
    assert_refused(
        "FetchFile, stale generation",
        result,
        Code::FailedPrecondition,
        &["generation"],
    );
    let result = client
        .fetch_file(FetchFileRequest {
            key: None,
            name: "shard".into(),
            ..Default::default()
        })
        .await;
    assert_refused("FetchFile, no key", result, Code::InvalidArgument, &["key"]);

    let good = weights_bytes(root, false);
    let bad = weights_bytes(root, true);
    for name in ["../evil", "/tmp/evil", "a/b", ".."] {
        let result = upload(client, vec![upload_chunk(&key(generation, 1), name, b"x")]).await;
        assert_refused(
            &format!("upload named {name:?}"),
            result,
            Code::InvalidArgument,
            &[name],
        );
    }
    assert!(!job_dir.join("evil").exists() && !Path::new("/tmp/evil").exists());
    let result = upload(
        client,
        vec![upload_chunk(&key(generation + 3, 1), MODEL_FILE, &good)],
    )
    .await;
    assert_refused(
        "upload, stale generation",
        result,
        Code::FailedPrecondition,
        &["generation"],
    );
    let mut wrong_sum = upload_chunk(&key(generation, 1), MODEL_FILE, &good);
    wrong_sum.sha256 = keel_proto::checkpoint::sha256_hex(b"something else");
    let result = upload(client, vec![wrong_sum]).await;
    assert_refused(
        "upload, wrong sha256",
        result,
        Code::DataLoss,
        &[MODEL_FILE],
    );

    // A good checkpoint at step 1, then NaN at steps 2 and 1: refused, step 1 stays as it was.
    upload(
        client,
        vec![upload_chunk(&key(generation, 1), MODEL_FILE, &good)],
    )
    .await
    .unwrap();
    for step in [2, 1] {
        let result = upload(
            client,
            vec![upload_chunk(&key(generation, step), MODEL_FILE, &bad)],
        )
        .await;
        assert_refused(
            &format!("upload with NaN at step {step}"),
            result,
            Code::InvalidArgument,
            &[
                &format!("checkpoint upload of step {step}: {MODEL_FILE}: "),
                "bert.encoder.layer.1.output.dense.weight has 3 non-finite values",
            ],
        );
        let result = upload(
            client,
            vec![
                upload_chunk(&key(generation, step), MODEL_FILE, &good),
                upload_chunk(&key(generation, step), "optimizer.safetensors", &bad),
            ],
        )
        .await;
        assert_refused(
            &format!("upload with NaN optimizer state at step {step}"),
            result,
            Code::InvalidArgument,
            &[
                &format!("step {step}: optimizer.safetensors: "),
                "non-finite",
            ],
        );
    }
    assert_eq!(job_status(client, &id).await.checkpoints, vec![1]);
    let stored = job_dir.join("checkpoints").join("step-1");
    verify_dir(&stored).unwrap().expect("a manifest");
    assert_eq!(std::fs::read(stored.join(MODEL_FILE)).unwrap(), good);
    assert!(!stored.join("optimizer.safetensors").exists());
    let leftovers: Vec<_> = std::fs::read_dir(job_dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "refused uploads left folders: {leftovers:?}"
    );

    let cancelled = client
        .cancel_job(CancelJobRequest { job_id: id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cancelled.state, JobState::Cancelled as i32);
}

/// RPCs naming jobs, workers and checkpoints that do not exist, and oversized messages.
async fn coordinator_rpcs(client: &mut Coord) {
    for id in ["job-999", "../x", "", "job-1/../../etc"] {
        let req = || GetJobRequest { job_id: id.into() };
        assert_refused(
            &format!("GetJob {id:?}"),
            client.get_job(req()).await,
            Code::NotFound,
            &[id],
        );
        assert_refused(
            &format!("CancelJob {id:?}"),
            client
                .cancel_job(CancelJobRequest { job_id: id.into() })
                .await,
            Code::NotFound,
            &[id],
        );
        assert_refused(
            &format!("WatchJob {id:?}"),
            client.watch_job(req()).await,
            Code::NotFound,
            &[id],
        );
        assert_refused(
            &format!("PullMetrics {id:?}"),
            client.pull_metrics(req()).await,
            Code::NotFound,
            &[id],
        );
        assert_refused(
            &format!("PullTensorboard {id:?}"),
            client.pull_tensorboard(req()).await,
            Code::NotFound,
            &[id],
        );
        assert_refused(
            &format!("PullCheckpoint {id:?}"),
            client
                .pull_checkpoint(PullCheckpointRequest {
                    job_id: id.into(),
                    step: 0,
                })
                .await,
            Code::NotFound,
            &[id],
        );
        let key = TrainingKey {
            job_id: id.into(),
            generation: 1,
            step: 1,
        };
        let report = StepReport {
            key: Some(key),
            ..Default::default()
        };
        assert_refused(
            &format!("ReportStep {id:?}"),
            client.report_step(report).await,
            Code::NotFound,
            &[id],
        );
    }
    let result = client.report_step(StepReport::default()).await;
    assert_refused(
        "ReportStep without key",
        result,
        Code::InvalidArgument,
        &["key"],
    );
    let result = client
        .attach(AttachRequest {
            worker_id: "w-999".into(),
        })
        .await;
    assert_refused(
        "Attach unknown worker",
        result,
        Code::FailedPrecondition,
        &["w-999"],
    );
    let reply = client
        .heartbeat(HeartbeatRequest {
            worker_id: "w-999".into(),
            key: None,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !reply.known,
        "a heartbeat of an unknown worker must say 'register again'"
    );
    let result = client.register(RegisterRequest::default()).await;
    assert_refused(
        "Register without address",
        result,
        Code::InvalidArgument,
        &["advertise_addr"],
    );

    // Larger than keel_proto::protocol::MAX_MESSAGE_BYTES: tonic refuses it while decoding,
    // before the service sees it, with OUT_OF_RANGE (documented in the report and README).
    let huge = "#".repeat(keel_proto::protocol::MAX_MESSAGE_BYTES + 1024);
    let result = submit(client, huge, "huge.toml").await;
    assert_refused(
        "SubmitJob over MAX_MESSAGE_BYTES",
        result,
        Code::OutOfRange,
        &["message length too large"],
    );
}

/// RPCs about the completed job `id` (generation `generation`, `steps` steps).
async fn rpcs_on_a_completed_job(client: &mut Coord, id: &str, generation: u64, steps: u64) {
    let key = |step| TrainingKey {
        job_id: id.to_string(),
        generation,
        step,
    };
    let report = |step, rank| StepReport {
        key: Some(key(step)),
        rank,
        ..Default::default()
    };
    let result = client.report_step(report(1, 0)).await;
    assert_refused(
        "ReportStep out of order",
        result,
        Code::FailedPrecondition,
        &["step 1", "order"],
    );
    let result = client.report_step(report(0, 0)).await;
    assert_refused(
        "ReportStep step 0",
        result,
        Code::InvalidArgument,
        &["step 0"],
    );
    let result = client.report_step(report(steps + 5, 0)).await;
    assert_refused(
        "ReportStep past max_steps",
        result,
        Code::InvalidArgument,
        &["outside"],
    );
    let result = client.report_step(report(steps, 9)).await;
    assert_refused(
        "ReportStep from rank 9",
        result,
        Code::InvalidArgument,
        &["rank 9"],
    );
    let stale = StepReport {
        key: Some(TrainingKey {
            generation: generation + 1,
            ..key(steps)
        }),
        ..Default::default()
    };
    let result = client.report_step(stale).await;
    assert_refused(
        "ReportStep stale generation",
        result,
        Code::FailedPrecondition,
        &["generation"],
    );
    let result = upload(client, vec![upload_chunk(&key(steps), MODEL_FILE, b"x")]).await;
    assert_refused(
        "upload to a finished job",
        result,
        Code::FailedPrecondition,
        &["ended"],
    );
    let result = client
        .pull_checkpoint(PullCheckpointRequest {
            job_id: id.to_string(),
            step: 12345,
        })
        .await;
    assert_refused(
        "PullCheckpoint of a missing step",
        result,
        Code::NotFound,
        &["12345"],
    );
}

fn frame(job: &str, generation: u64, data_len: usize, total_len: u64, offset: u64) -> RingFrame {
    RingFrame {
        job_id: job.to_string(),
        generation,
        step: 1,
        bucket: 0,
        sender_rank: 1,
        ring_step: 0,
        total_len,
        offset,
        data: vec![0u8; data_len].into(),
        dtype: 0,
        collective: 0,
    }
}

/// Frames sent straight to a worker's ring service once it served job `id` generation `generation`.
async fn ring_frames(addr: &str, id: &str, generation: u64) {
    let mut ring = ring(addr).await;
    let cases = [
        (
            "wrong job",
            frame("job-999", generation, 16, 4, 0),
            Code::NotFound,
            "job-999",
        ),
        (
            "stale generation",
            frame(id, generation - 1, 16, 4, 0),
            Code::FailedPrecondition,
            "stale generation",
        ),
        (
            "payload not whole f32",
            frame(id, generation, 6, 4, 0),
            Code::InvalidArgument,
            "6 bytes",
        ),
        (
            "an element encoding that does not exist",
            RingFrame {
                dtype: 9,
                ..frame(id, generation, 16, 4, 0)
            },
            Code::InvalidArgument,
            "dtype 9",
        ),
        (
            "empty payload",
            frame(id, generation, 0, 4, 0),
            Code::InvalidArgument,
            "0 bytes",
        ),
        (
            "elements outside the buffer",
            frame(id, generation, 16, 4, 2),
            Code::InvalidArgument,
            "outside",
        ),
        (
            "unknown bucket of a past step",
            RingFrame {
                step: 0,
                bucket: 777,
                ..frame(id, generation, 16, 4, 0)
            },
            Code::InvalidArgument,
            "bucket 777",
        ),
        (
            "a step out of reach",
            RingFrame {
                step: 1000,
                ..frame(id, generation, 16, 4, 0)
            },
            Code::InvalidArgument,
            "step 1000",
        ),
        (
            "finished all-reduce",
            frame(id, generation, 16, 4, 0),
            // The sender takes it as delivered (the all-reduce ended there): see Ring::send.
            Code::Aborted,
            "finished",
        ),
    ];
    for (what, f, code, word) in cases.clone() {
        assert_refused(
            &format!("ring Push, {what}"),
            ring.push(f).await,
            code,
            &[word],
        );
    }
    // The streaming path answers each frame with an ack and goes on after a refusal.
    let frames: Vec<RingFrame> = cases.iter().map(|c| c.1.clone()).collect();
    let mut acks = ring
        .stream(futures::stream::iter(frames))
        .await
        .unwrap()
        .into_inner();
    for (what, _, code, word) in cases {
        let ack = acks.message().await.unwrap().expect("an ack per frame");
        assert_eq!(
            ack.code, code as u32,
            "ring Stream, {what}: {}",
            ack.message
        );
        assert!(
            ack.message.contains(word),
            "ring Stream, {what}: {}",
            ack.message
        );
    }
    assert!(acks.message().await.unwrap().is_none());
    // Over the ring's message limit (4 MiB + 64 KiB): tonic refuses it while decoding.
    let huge = frame(id, generation, (4 << 20) + (128 << 10), 2 << 20, 0);
    let result = ring.push(huge).await;
    assert_refused(
        "ring Push over the message limit",
        result,
        Code::OutOfRange,
        &["message length too large"],
    );
}

#[test]
fn every_entry_point_refuses_bad_input_clearly_and_the_cluster_stays_healthy() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let (coordinator_proc, addr) = start_coordinator(root);
    let workers: Vec<(Proc, String)> = (0..2).map(|i| start_worker(root, &addr, i)).collect();
    let corpus = small_corpus(root);
    poll(Duration::from_secs(60), || {
        std::net::TcpStream::connect(&addr).ok()
    })
    .expect("the coordinator listens");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut client = coordinator(&addr).await;
        job_specs(&mut client, &corpus).await;
        coordinator_rpcs(&mut client).await;
        prepared_inputs(&mut client, root, &corpus).await;
        rpcs_on_a_waiting_job(&mut client, root, &corpus).await;

        // Healthy afterwards: it answers, and a small real job completes on both workers.
        client.ping(PingRequest {}).await.unwrap();
        let steps = 3;
        let id = submit(
            &mut client,
            job_toml(&corpus, &vocab(), "preset = \"tiny\"", steps, 2),
            "final",
        )
        .await
        .unwrap();
        let status = wait_for(
            &mut client,
            &id,
            &[JobState::Completed, JobState::Failed, JobState::Cancelled],
            Duration::from_secs(90),
        )
        .await;
        assert_eq!(
            status.state,
            JobState::Completed as i32,
            "the final job: {status:?}\ncoordinator log:\n{}",
            coordinator_proc.log_text()
        );
        assert_eq!(status.step, steps);
        assert_eq!(status.checkpoints, vec![steps]);
        assert!(status.loss.is_finite());
        rpcs_on_a_completed_job(&mut client, &id, status.generation, steps).await;
        ring_frames(&workers[0].1, &id, status.generation).await;
        client.ping(PingRequest {}).await.unwrap();
        let after = job_status(&mut client, &id).await;
        assert_eq!(after.state, JobState::Completed as i32);
        assert_eq!(after.checkpoints, vec![steps]);
        let stored = root
            .join("coordinator/jobs")
            .join(&id)
            .join("checkpoints")
            .join(format!("step-{steps}"));
        assert!(stored.join(MANIFEST_FILE).is_file());
        verify_dir(&stored).unwrap();
    });
    for (w, _) in &workers {
        assert!(
            !w.log_text().contains("panicked"),
            "{} panicked:\n{}",
            w.name,
            w.log_text()
        );
    }
    assert!(!coordinator_proc.log_text().contains("panicked"));
}
