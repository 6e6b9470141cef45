//! Abuse case 6 (a), `scripts/abuse.sh`, against real coordinator processes: with `--input-root`
//! (`KEEL_INPUT_ROOT`), a job naming a path outside the roots — directly, through `..`, a
//! symlink in a corpus folder, a glob, or a vocabulary, config or checkpoint — is refused at
//! submit with INVALID_ARGUMENT naming the key, the path and the roots; a relative path sent
//! over raw gRPC is refused with or without roots; without roots the coordinator warns at
//! startup; a job restored after a restart whose paths now lie outside the roots is failed.

mod common;

use common::*;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::{GetJobRequest, JobState, SubmitJobRequest};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// Job TOML with `corpus` and extra `[data]` / `[model]` lines (tiny preset unless `model`
/// names another source).
fn job_toml(corpus: &str, data: &str, model: &str) -> String {
    let model = if model.is_empty() {
        "preset = \"tiny\""
    } else {
        model
    };
    format!(
        "[data]\ncorpus = [{corpus:?}]\nmax_seq_length = 64\nmax_predictions_per_seq = 10\n{data}\n\
         [model]\n{model}\n[train]\nmicro_batch_size = 4\nmax_steps = 5\n"
    )
}

/// Submits `toml` over raw gRPC (no path rewriting by the CLI): the job id or the status.
fn submit_raw(addr: &str, toml: String) -> Result<String, tonic::Status> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let token = keel_net::auth::ClusterToken::load(token_file()).unwrap();
        let mut client = CoordinatorClient::new(
            keel_net::security::ClientSecurity::new(&token, None).wrap(channel),
        );
        let reply = client
            .submit_job(SubmitJobRequest {
                spec_toml: toml,
                origin: "job.toml".into(),
            })
            .await?;
        Ok(reply.into_inner().job_id)
    })
}

/// The job's state and error over raw gRPC.
fn job_state(addr: &str, id: &str) -> (JobState, String) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let token = keel_net::auth::ClusterToken::load(token_file()).unwrap();
        let mut client = CoordinatorClient::new(
            keel_net::security::ClientSecurity::new(&token, None).wrap(channel),
        );
        let s = client
            .get_job(GetJobRequest { job_id: id.into() })
            .await
            .unwrap()
            .into_inner();
        (JobState::try_from(s.state).unwrap(), s.error)
    })
}

/// Asserts that `toml` is refused with INVALID_ARGUMENT whose message holds every `needle`.
fn assert_refused(addr: &str, toml: String, needles: &[&str]) {
    let status = submit_raw(addr, toml).expect_err("the job was accepted");
    assert_eq!(
        status.code(),
        tonic::Code::InvalidArgument,
        "{}",
        status.message()
    );
    for needle in needles {
        assert!(
            status.message().contains(needle),
            "{needle:?} not in: {}",
            status.message()
        );
    }
}

/// A coordinator with `env` in its environment and `extra` flags; its address.
fn coordinator_env(
    root: &Path,
    name: &str,
    extra: &[String],
    env: &[(&str, &str)],
) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let log = logs.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).unwrap();
    let mut command = common::command(&sibling("keel-coordinator"));
    command
        .args(["--listen", &addr, "--data-dir"])
        .arg(root.join("coordinator"))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file);
    for (k, v) in env {
        command.env(k, v);
    }
    let p = Proc {
        name: name.to_string(),
        child: command.spawn().unwrap(),
        log,
    };
    wait_listening(&addr, &p);
    (p, addr)
}

/// `(root, outside)`: a data folder with a small corpus, and a folder beside it with files a
/// job must not read (a "secret", a vocabulary, a config, a checkpoint folder).
fn layout(base: &Path) -> (PathBuf, PathBuf) {
    let data = base.join("data");
    let outside = base.join("outside");
    std::fs::create_dir_all(data.join("corpus")).unwrap();
    std::fs::create_dir_all(outside.join("ckpt")).unwrap();
    kjv_lines(&data.join("corpus"), 400);
    std::fs::write(
        outside.join("secret.txt"),
        "root:x:0:0:root:/root:/bin/bash\n",
    )
    .unwrap();
    std::fs::copy(
        fixture("wordpiece").join("vocab.txt"),
        outside.join("vocab.txt"),
    )
    .unwrap();
    std::fs::copy(
        fixture("bert-micro-mlm").join("config.json"),
        outside.join("config.json"),
    )
    .unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(
            fixture("bert-micro-mlm").join(f),
            outside.join("ckpt").join(f),
        )
        .unwrap();
    }
    (data, outside)
}

#[test]
fn job_paths_outside_the_input_roots_are_refused_naming_key_path_and_roots() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let (data, outside) = layout(&base);
    let (coordinator, addr) =
        start_coordinator_with(&base, &["--input-root".into(), data.display().to_string()]);
    let root = data.display().to_string();
    let secret = outside.join("secret.txt").display().to_string();

    // Directly, through `..`, and a path that does not even exist (refused alike: no oracle).
    for path in [
        secret.clone(),
        format!("{root}/../outside/secret.txt"),
        outside.join("nope.txt").display().to_string(),
        "/etc/passwd".to_string(),
    ] {
        let toml = job_toml(&path, "vocab_size = 300", "");
        assert_refused(&addr, toml, &["data.corpus", &path, &root, "outside"]);
    }
    // A glob whose folder is outside, and one inside that matches a symlink to outside.
    let glob = format!("{}/*.txt", outside.display());
    assert_refused(
        &addr,
        job_toml(&glob, "vocab_size = 300", ""),
        &["data.corpus", &glob, &root],
    );
    let linked = data.join("linked");
    std::fs::create_dir_all(&linked).unwrap();
    std::fs::write(linked.join("a.txt"), "a sentence inside.\n").unwrap();
    std::os::unix::fs::symlink(&secret, linked.join("b.txt")).unwrap();
    let folder = linked.display().to_string();
    assert_refused(
        &addr,
        job_toml(&folder, "vocab_size = 300", ""),
        &["data.corpus", &folder, &secret, &root],
    );
    let glob = format!("{folder}/*.txt");
    assert_refused(
        &addr,
        job_toml(&glob, "vocab_size = 300", ""),
        &["data.corpus", &secret],
    );

    // Vocabulary, model config and init checkpoint outside; a checkpoint inside whose
    // weights are a symlink to outside.
    let corpus = data.join("corpus").display().to_string();
    let vocab = outside.join("vocab.txt").display().to_string();
    assert_refused(
        &addr,
        job_toml(&corpus, &format!("vocab = {vocab:?}"), ""),
        &["data.vocab", &vocab, &root],
    );
    let config = outside.join("config.json").display().to_string();
    assert_refused(
        &addr,
        job_toml(&corpus, "vocab_size = 300", &format!("config = {config:?}")),
        &["model.config", &config, &root],
    );
    let ckpt = outside.join("ckpt").display().to_string();
    assert_refused(
        &addr,
        job_toml(
            &corpus,
            "vocab_size = 300",
            &format!("init_checkpoint = {ckpt:?}"),
        ),
        &["model.init_checkpoint", &ckpt, &root],
    );
    let inside_ckpt = data.join("ckpt");
    std::fs::create_dir_all(&inside_ckpt).unwrap();
    std::fs::copy(
        outside.join("ckpt/config.json"),
        inside_ckpt.join("config.json"),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        outside.join("ckpt/model.safetensors"),
        inside_ckpt.join("model.safetensors"),
    )
    .unwrap();
    let shown = inside_ckpt.display().to_string();
    assert_refused(
        &addr,
        job_toml(
            &corpus,
            "vocab_size = 300",
            &format!("init_checkpoint = {shown:?}"),
        ),
        &["model.init_checkpoint", "model.safetensors", &root],
    );

    // A relative path over raw gRPC is refused, not resolved against the coordinator's folder.
    assert_refused(
        &addr,
        job_toml("../../etc/passwd", "vocab_size = 300", ""),
        &["data.corpus", "relative"],
    );

    // Inside the root: accepted, by raw gRPC and by `keel submit` (which sends absolute paths).
    submit_raw(&addr, job_toml(&corpus, "vocab_size = 300", "")).expect("a job inside the root");
    std::fs::write(
        data.join("job.toml"),
        job_toml("corpus", "vocab_size = 300", ""),
    )
    .unwrap();
    run_keel(&["submit", "job.toml", "--coordinator", &addr], &data);
    let log = coordinator.log_text();
    assert!(
        log.contains("jobs may read only inside the input roots"),
        "{log}"
    );
    assert!(!log.contains("no --input-root"), "{log}");
}

#[test]
fn without_roots_relative_paths_are_refused_and_the_start_warns() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let (coordinator, addr) = start_coordinator(&base);
    assert_refused(
        &addr,
        job_toml("../../etc/passwd", "vocab_size = 300", ""),
        &["data.corpus", "../../etc/passwd", "relative"],
    );
    let log = coordinator.log_text();
    assert_eq!(log.matches("no --input-root").count(), 1, "{log}");
    drop(coordinator);

    // KEEL_INPUT_ROOT: colon-separated, like PATH.
    let (a, b) = (base.join("a"), base.join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    std::fs::write(b.join("c.txt"), "a sentence.\n").unwrap();
    let roots = format!("{}:{}", a.display(), b.display());
    let (coordinator, addr) = coordinator_env(&base, "env", &[], &[("KEEL_INPUT_ROOT", &roots)]);
    let log = coordinator.log_text();
    assert!(!log.contains("no --input-root"), "{log}");
    assert!(
        log.contains(&a.display().to_string()) && log.contains(&b.display().to_string()),
        "{log}"
    );
    let inside_b = b.join("c.txt").display().to_string();
    submit_raw(&addr, job_toml(&inside_b, "vocab_size = 300", "")).expect("inside the second root");
}

#[test]
fn a_restored_job_outside_the_new_input_roots_is_failed_not_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let (data, outside) = layout(&base);
    std::fs::copy(data.join("corpus/kjv-part.txt"), outside.join("kjv.txt")).unwrap();
    let corpus = outside.join("kjv.txt").display().to_string();
    // No roots yet: the job is accepted and prepared; it waits for workers (there are none).
    let (mut first, addr) = coordinator_env(&base, "first", &[], &[]);
    let mut job = job_toml(&corpus, "vocab_size = 300", "");
    job.push_str("[cluster]\nmin_workers = 1\nmax_workers = 1\n");
    let id = submit_raw(&addr, job).expect("accepted without roots");
    poll(Duration::from_secs(120), || {
        (job_state(&addr, &id).0 == JobState::WaitingForWorkers).then_some(())
    })
    .unwrap_or_else(|| panic!("never prepared: {}", first.log_text()));
    // SIGTERM (saves the job), then a coordinator that reads only `data`.
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    unsafe { libc::kill(first.child.id() as i32, libc::SIGTERM) };
    first.child.wait().unwrap();
    let (second, addr) =
        start_coordinator_with(&base, &["--input-root".into(), data.display().to_string()]);
    let (state, error) = job_state(&addr, &id);
    assert_eq!(state, JobState::Failed, "{error}\n{}", second.log_text());
    assert!(
        error.contains("data.corpus")
            && error.contains(&corpus)
            && error.contains(&data.display().to_string()),
        "{error}"
    );
}
