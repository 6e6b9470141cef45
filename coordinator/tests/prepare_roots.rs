//! Abuse case 6 (a) at preparation: the input roots are checked again when a job is
//! prepared, so a symlink to a file outside them that appears in a corpus folder after the
//! submit-time check is refused there, naming the file, instead of being tokenized.

use keel_coordinator::input_roots::InputRoots;
use keel_coordinator::{CoordinatorError, prepare_job, submit_check};
use keel_proto::jobspec::JobSpec;

#[path = "../../fixtures/testdata.rs"]
mod testdata;

#[test]
fn a_symlink_out_of_the_roots_added_after_submit_fails_the_preparation() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().canonicalize().unwrap();
    let (data, outside) = (base.join("data"), base.join("outside"));
    std::fs::create_dir_all(data.join("corpus")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let text = std::fs::read_to_string(testdata::corpus("en-fortunes/fortunes.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(800).collect();
    std::fs::write(data.join("corpus/part.txt"), part.join("\n") + "\n").unwrap();
    let secret = outside.join("secret.txt");
    std::fs::write(&secret, "a secret that must not be tokenized.\n").unwrap();
    let spec = JobSpec::from_toml_str(
        &format!(
            "[data]\ncorpus = [{:?}]\nvocab_size = 300\nmax_seq_length = 64\n\
             max_predictions_per_seq = 10\n[model]\npreset = \"tiny\"\n[train]\n\
             micro_batch_size = 4\nmax_steps = 5\n",
            data.join("corpus").display().to_string()
        ),
        "job.toml",
    )
    .unwrap();
    let roots = InputRoots::new(std::slice::from_ref(&data)).unwrap();
    submit_check::check_job(&spec, "job.toml", &roots).expect("inside the root at submit");

    std::os::unix::fs::symlink(&secret, data.join("corpus/zz.txt")).unwrap();
    let job_dir = base.join("job-1");
    std::fs::create_dir_all(&job_dir).unwrap();
    let err = prepare_job::prepare_within("job-1", &spec, &job_dir, &roots).unwrap_err();
    assert!(matches!(err, CoordinatorError::Prepare { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&secret.display().to_string()), "{text}");
    assert!(
        text.contains("outside") && text.contains(&data.display().to_string()),
        "{text}"
    );
    assert!(!job_dir.join("data").exists(), "nothing was prepared");

    // Without the symlink the same job prepares.
    std::fs::remove_file(data.join("corpus/zz.txt")).unwrap();
    prepare_job::prepare_within("job-1", &spec, &job_dir, &roots)
        .expect("prepares inside the root");
}
