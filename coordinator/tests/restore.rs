//! Restoring jobs from `job-state.json` over a real prepared data folder: a job that was
//! running comes back recovering with its prepared data; one that was preparing comes back
//! queued and its preparation reuses the complete folder instead of redoing it.

use keel_coordinator::input_roots::InputRoots;
use keel_coordinator::machine::Machine;
use keel_coordinator::persist::{self, FORMAT_VERSION, JOB_STATE_FILE, JobRecord, LastMetrics};
use keel_coordinator::prepare_job;
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::JobState;
use std::path::Path;
use std::time::{Instant, SystemTime};

#[path = "../../fixtures/testdata.rs"]
mod testdata;

fn corpus_part(root: &Path) -> std::path::PathBuf {
    let src = testdata::corpus("en-fortunes/fortunes.txt");
    let text = std::fs::read_to_string(src).unwrap();
    let part: Vec<&str> = text.lines().take(1500).collect();
    let path = root.join("part.txt");
    std::fs::write(&path, part.join("\n") + "\n").unwrap();
    path
}

fn spec(corpus: &Path) -> JobSpec {
    JobSpec::from_toml_str(
        &format!(
            r#"[data]
corpus = ["{}"]
vocab_size = 300
max_seq_length = 64
max_predictions_per_seq = 10
[model]
preset = "tiny"
[train]
micro_batch_size = 4
max_steps = 50
"#,
            corpus.display()
        ),
        "test",
    )
    .unwrap()
}

/// Rewrites the saved state of the job in `dir` as `state`.
fn set_saved_state(dir: &Path, state: JobState) {
    let path = dir.join(JOB_STATE_FILE);
    let mut record = JobRecord::read(&path).unwrap();
    record.state = state.as_str_name().to_string();
    record.write(dir).unwrap();
}

#[test]
fn restored_jobs_keep_their_prepared_data() {
    let root = tempfile::tempdir().unwrap();
    let jobs_dir = root.path().join("jobs");
    let dir = jobs_dir.join("job-1");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = spec(&corpus_part(root.path()));
    let prepared = prepare_job::prepare("job-1", &spec, &dir).unwrap();
    let manifest = std::fs::read(dir.join("data/manifest.json")).unwrap();

    JobRecord {
        version: FORMAT_VERSION,
        id: "job-1".into(),
        spec: serde_json::to_value(&spec).unwrap(),
        state: JobState::Running.as_str_name().into(),
        generation: 1,
        step: 7,
        checkpoints: vec![5],
        error: None,
        worker_names: vec!["w-1 (127.0.0.1:1)".into()],
        recoveries: 0,
        skipped_steps: 0,
        global_batch_size: Some(8),
        precision: None,
        submitted_unix_ms: 1,
        step_heard_unix_ms: None,
        excluded_workers: Vec::new(),
        finished_unix_ms: None,
        metrics: LastMetrics::default(),
    }
    .write(&dir)
    .unwrap();

    // Running -> recovering (its next generation), with the prepared data found again.
    let jobs = persist::load_jobs(&jobs_dir, &InputRoots::default());
    assert_eq!(jobs.len(), 1);
    let mut machine = Machine::new(jobs_dir.clone());
    machine.restore(Instant::now(), SystemTime::now(), jobs, 1);
    let job = machine.job("job-1").unwrap();
    assert_eq!(job.state(), JobState::Recovering);
    assert_eq!((job.generation(), job.step()), (2, 7));
    assert_eq!(job.checkpoints(), [5]);
    assert_eq!(job.record().global_batch_size, Some(8));
    let again = job.prepared().expect("prepared data restored");
    assert_eq!(again.total_sequences, prepared.total_sequences);
    assert_eq!(again.model_config_json, prepared.model_config_json);
    assert_eq!(again.shared_files, prepared.shared_files);
    drop(machine);

    // Preparing -> queued; preparing again reuses the folder (the manifest, which records
    // the preparation's timings, is untouched).
    set_saved_state(&dir, JobState::Preparing);
    let mut machine = Machine::new(jobs_dir.clone());
    machine.restore(
        Instant::now(),
        SystemTime::now(),
        persist::load_jobs(&jobs_dir, &InputRoots::default()),
        1,
    );
    let job = machine.job("job-1").unwrap();
    assert_eq!(job.state(), JobState::Queued);
    assert!(job.prepared().is_none());
    let reused = prepare_job::prepare("job-1", &spec, &dir).unwrap();
    assert_eq!(reused.total_sequences, prepared.total_sequences);
    assert_eq!(
        std::fs::read(dir.join("data/manifest.json")).unwrap(),
        manifest
    );

    // Without its manifest the folder is not reused.
    std::fs::remove_file(dir.join("data/manifest.json")).unwrap();
    assert!(prepare_job::reuse("job-1", &spec, &dir).unwrap().is_none());
}
