//! Abuse cases 1, 2 and 8 (`scripts/abuse.sh`) against real processes: a model too large for the cluster is
//! refused at submit (naming the field) or failed at assignment; inputs past their bounds
//! (a multi-GB corpus without a newline, `/dev/zero` as vocabulary, a huge config.json) fail
//! the job with the file and the limit, and a failed preparation stays failed across a
//! coordinator restart; `keel pull` stops at the first byte past the manifest's size, and
//! `keel fill-mask` checks the safetensors header against the file size.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// `keel ARGS` whatever its exit status (bounded by the CLI's own timeouts).
fn keel_any(args: &[&str], cwd: &Path) -> Output {
    command(&keel())
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// `keel submit` of `job`: `Ok(job id)` or `Err(stderr)`.
fn submit(job: &Path, addr: &str, root: &Path) -> Result<String, String> {
    let out = keel_any(
        &["submit", job.to_str().unwrap(), "--coordinator", addr],
        root,
    );
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        Err(text(&out.stderr))
    }
}

/// Waits (at most `limit`) until the job is completed, failed or cancelled; its status.
fn wait_end(job: &str, addr: &str, root: &Path, limit: Duration) -> serde_json::Value {
    poll(limit, || {
        let s = status(job, addr, root);
        matches!(
            s["state"].as_str(),
            Some("completed" | "failed" | "cancelled")
        )
        .then_some(s)
    })
    .unwrap_or_else(|| panic!("{job} did not end within {limit:?}"))
}

/// A job file using `model.config = config` instead of the tiny preset.
fn job_with_config(root: &Path, corpus: PathBuf, config: &Path) -> PathBuf {
    let path = JobFile::new(corpus).write(root);
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "preset = \"tiny\"",
        &format!("config = \"{}\"", config.display()),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The micro fixture's config.json with `fields` set.
fn config_with(root: &Path, name: &str, fields: &[(&str, u64)]) -> PathBuf {
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("bert-micro-mlm").join("config.json")).unwrap(),
    )
    .unwrap();
    for (field, value) in fields {
        config[*field] = serde_json::json!(value);
    }
    let path = root.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    path
}

#[test]
fn models_too_large_are_refused_at_submit_or_failed_at_assignment() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (_coord, addr) = start_coordinator(root);
    // One worker that says it has 512 MiB.
    let (_worker, _) = start_worker_with(root, &addr, 0, &["--memory-limit".into(), "512M".into()]);
    let corpus = kjv_lines(root, 2000);
    let registered = poll(Duration::from_secs(30), || {
        let log = std::fs::read_to_string(root.join("logs/coordinator.log")).ok()?;
        log.contains("worker registered").then_some(())
    });
    assert!(registered.is_some(), "the worker never registered");

    // The cases: over a cap, and sizes whose products wrap 64 bits.
    for (field, value) in [
        ("hidden_size", 1u64 << 20),
        ("hidden_size", 1 << 62),
        ("num_hidden_layers", 1 << 40),
        ("vocab_size", 1 << 40),
    ] {
        let config = config_with(root, &format!("{field}-{value}.json"), &[(field, value)]);
        let job = job_with_config(root, corpus.clone(), &config);
        let err = submit(&job, &addr, root).expect_err(field);
        assert!(err.contains(field) && err.contains("cap"), "{field}: {err}");
    }
    // Within the caps but larger than the worker's 512 MiB: refused, with both numbers.
    let config = config_with(
        root,
        "wide.json",
        &[("hidden_size", 4096), ("intermediate_size", 16384)],
    );
    let job = job_with_config(root, corpus.clone(), &config);
    let err = submit(&job, &addr, root).expect_err("a model larger than every worker");
    assert!(
        err.contains("largest memory limit") && err.contains("512.0 MiB"),
        "{err}"
    );

    // A preset with a vocabulary file is only known after preparation: then the job fails
    // with the reason instead of being handed to a worker that cannot hold it.
    let mut job = JobFile::new(corpus);
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.workers = 1;
    let path = job.write(root);
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("preset = \"tiny\"", "preset = \"large\"");
    std::fs::write(&path, text).unwrap();
    let id = submit(&path, &addr, root).expect("accepted: the vocabulary is not known yet");
    let end = wait_end(&id, &addr, root, Duration::from_secs(120));
    assert_eq!(end["state"], "failed", "{end}");
    let error = end["error"].as_str().unwrap_or_default();
    assert!(error.contains("largest memory limit"), "{error}");
}

#[test]
fn unbounded_inputs_fail_the_job_which_stays_failed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut coord, addr) = start_coordinator(root);

    // 3 GiB without a newline, sparse: it costs no disk, and reading it all would cost 3 GiB.
    let sparse = root.join("no-newline.txt");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(3 << 30)
        .unwrap();
    let line_job = JobFile::new(sparse).write(root);
    let line_id = submit(&line_job, &addr, root).unwrap();

    // /dev/zero as the vocabulary.
    let mut job = JobFile::new(kjv_lines(root, 500));
    job.vocab = Some(PathBuf::from("/dev/zero"));
    let sub = root.join("zero");
    std::fs::create_dir_all(&sub).unwrap();
    // The coordinator's submit-time path check refuses it at once (preparation, which would
    // refuse it too, is tested in coordinator/tests/corpus_errors.rs).
    let err = submit(&job.write(&sub), &addr, root).expect_err("/dev/zero as vocab");
    assert!(
        err.contains("data.vocab")
            && err.contains("/dev/zero")
            && err.contains("not a regular file"),
        "{err}"
    );

    // A 2 MiB config.json (valid JSON padded with spaces): refused at submit.
    let config = config_with(root, "huge.json", &[]);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&" ".repeat(2 << 20));
    std::fs::write(&config, text).unwrap();
    let err = submit(
        &job_with_config(&sub, kjv_lines(root, 500), &config),
        &addr,
        root,
    )
    .expect_err("a 2 MiB config");
    assert!(
        err.contains("huge.json") && err.contains("1048576-byte limit"),
        "{err}"
    );

    let started = Instant::now();
    let line_end = wait_end(&line_id, &addr, root, Duration::from_secs(120));
    println!(
        "3 GiB line refused in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(line_end["state"], "failed", "{line_end}");
    let line_error = line_end["error"].as_str().unwrap().to_string();
    assert!(
        line_error.contains("no-newline.txt") && line_error.contains("16777216-byte line limit"),
        "{line_error}"
    );

    // Restart: the job stays failed with its reason, and is not prepared again.
    let _ = coord.child.kill();
    let _ = coord.child.wait();
    let (coord2, addr2) = start_coordinator_with(root, &[]);
    let again = status(&line_id, &addr2, root);
    assert_eq!(again["state"], "failed", "{again}");
    assert_eq!(again["error"].as_str().unwrap(), line_error);
    std::thread::sleep(Duration::from_secs(2));
    let log = coord2.log_text();
    assert!(
        !log.contains("preparing data and model"),
        "a failed job was prepared again:\n{log}"
    );
}

#[test]
fn pull_stops_past_the_manifest_size_and_fill_mask_checks_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (_coord, addr) = start_coordinator(root);
    let (_worker, _) = start_worker(root, &addr, 0);
    let mut job = JobFile::new(kjv_lines(root, 2000));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = 4;
    job.warmup_steps = 1;
    job.checkpoint_every = 4;
    job.eval_every = 0;
    let id = submit(&job.write(root), &addr, root).unwrap();
    let end = wait_end(&id, &addr, root, Duration::from_secs(300));
    assert_eq!(end["state"], "completed", "{end}");

    // A good pull first (the manifest comes first now), kept for fill-mask below.
    let good = root.join("good");
    run_keel(
        &[
            "pull",
            &id,
            "--out",
            good.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    let model = good.join("model.safetensors");
    let size = std::fs::metadata(&model).unwrap().len();

    // The stored model.safetensors grows to 2 GiB (sparse) on the coordinator.
    let stored = root
        .join("coordinator/jobs")
        .join(&id)
        .join("checkpoints/step-4/model.safetensors");
    assert!(stored.is_file(), "{}", stored.display());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&stored)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let out = root.join("bad");
    let started = Instant::now();
    let pulled = keel_any(
        &[
            "pull",
            &id,
            "--out",
            out.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    let seconds = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&pulled.stderr);
    assert!(!pulled.status.success());
    assert!(
        stderr.contains("model.safetensors")
            && (stderr.contains(&format!("the manifest records {size}"))
                || stderr.contains(&format!("{size} bytes recorded"))),
        "{stderr}"
    );
    println!(
        "pull of a 2 GiB model.safetensors recorded as {size} bytes refused in {seconds:.2} s"
    );
    assert!(!out.exists(), "nothing is left at --out");
    // Nothing past the recorded size was written anywhere under root.
    let mut written = 0u64;
    for entry in std::fs::read_dir(root).unwrap().flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".keel-pull-")
        {
            for f in std::fs::read_dir(entry.path()).unwrap().flatten() {
                written = written.max(f.metadata().unwrap().len());
            }
        }
    }
    assert!(written <= size, "{written} bytes written");

    // fill-mask on a folder without a manifest whose weights grew past their header.
    std::fs::remove_file(good.join("manifest.json")).unwrap();
    let ok = keel_any(
        &[
            "fill-mask",
            "--checkpoint",
            good.to_str().unwrap(),
            "in the [MASK]",
        ],
        root,
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    let started = Instant::now();
    let refused = keel_any(
        &[
            "fill-mask",
            "--checkpoint",
            good.to_str().unwrap(),
            "in the [MASK]",
        ],
        root,
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        stderr.contains("model.safetensors") && stderr.contains("truncated or grown"),
        "{stderr}"
    );
    println!(
        "fill-mask refused a 2 GiB grown model.safetensors in {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn a_job_whose_preparation_keeps_being_interrupted_is_failed_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (mut coord, addr) = start_coordinator(root);
    let id = submit(&JobFile::new(kjv_lines(root, 500)).write(root), &addr, root).unwrap();
    let job_dir = root.join("coordinator/jobs").join(&id);
    // No worker: once prepared it waits; the attempt marker is gone by then.
    let waiting = poll(Duration::from_secs(60), || {
        (status(&id, &addr, root)["state"] == "waiting-for-workers").then_some(())
    });
    assert!(waiting.is_some(), "{}", status(&id, &addr, root));
    assert!(!job_dir.join("preparation-attempts").exists());
    let _ = coord.child.kill();
    let _ = coord.child.wait();
    // As a coordinator killed twice while preparing leaves it: state preparing, two attempts
    // begun and never ended.
    let record = job_dir.join("job-state.json");
    let text = std::fs::read_to_string(&record).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    value["state"] = serde_json::json!("JOB_STATE_PREPARING");
    std::fs::write(&record, serde_json::to_string(&value).unwrap()).unwrap();
    std::fs::remove_dir_all(job_dir.join("data")).unwrap();
    std::fs::write(job_dir.join("preparation-attempts"), "2").unwrap();
    let (coord2, addr2) = start_coordinator_with(root, &[]);
    let s = status(&id, &addr2, root);
    assert_eq!(s["state"], "failed", "{s}");
    assert!(
        s["error"].as_str().unwrap().contains("interrupted 2 times"),
        "{s}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(!coord2.log_text().contains("preparing data and model"));
    assert!(!job_dir.join("data").exists(), "it was prepared again");
}
