//! Checkpoints that cannot be stored (a full data folder) and the recovery back-off.

use super::*;
use crate::machine::UploadFailure;

/// A refusal for a full disk of the checkpoint of `step` of `job`'s current generation.
fn disk_full(h: &Harness, job: &str, step: u64) -> Input {
    Input::UploadFailed(UploadFailure {
        key: h.key(job, step),
        path: PathBuf::from("/data/jobs/job-1/checkpoints"),
        needed_bytes: Some(8 << 20),
        free_bytes: Some(1 << 20),
        error: "no room".into(),
    })
}

#[test]
fn a_failed_upload_is_counted_shown_and_written_until_one_is_stored() {
    // (step that failed, whether the status says the job waits)
    for (step, waits) in [(4, false), (20, true)] {
        let (mut h, job, _) = running(1, "");
        h.step(&job, step.min(19));
        h.take(|_| true);
        h.feed(disk_full(&h, &job, step)).unwrap();
        let status = h.m.job(&job).unwrap().status(h.now);
        assert_eq!(h.state(&job), JobState::Running, "step {step}");
        assert_eq!(status.checkpoint_failures, 1);
        let problem = &status.checkpoint_problem;
        for part in [
            &format!("checkpoint of step {step}"),
            "/data/jobs/job-1/checkpoints",
            "needs about 8.0 MiB",
            "1.0 MiB is free",
        ] {
            assert!(problem.contains(part), "{part:?} not in {problem}");
        }
        assert_eq!(problem.contains("the job waits"), waits, "{problem}");
        let lines: Vec<serde_json::Value> = h
            .take(|e| matches!(e, Effect::AppendMetrics { .. }))
            .into_iter()
            .filter_map(|e| match e {
                Effect::AppendMetrics { line, .. } => Some(line.to_value()),
                _ => None,
            })
            .collect();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0]["event"], "checkpoint_failed");
        assert_eq!(lines[0]["needed_bytes"], 8 << 20);
        assert_eq!(lines[0]["free_bytes"], 1 << 20);
        assert_eq!(lines[0]["waiting"], waits);
        // Stored again: the problem goes, the count stays.
        let key = h.key(&job, step);
        h.feed(Input::CheckpointStored(key)).unwrap();
        let status = h.m.job(&job).unwrap().status(h.now);
        assert_eq!(status.checkpoint_problem, "");
        assert_eq!(status.checkpoint_failures, 1);
    }
}

#[test]
fn a_late_failure_of_another_generation_or_an_ended_job_is_ignored() {
    let (mut h, job, _) = running(1, "");
    let mut stale = disk_full(&h, &job, 4);
    if let Input::UploadFailed(f) = &mut stale {
        f.key.generation += 1;
    }
    h.feed(stale).unwrap();
    assert_eq!(h.m.job(&job).unwrap().status(h.now).checkpoint_failures, 0);
    h.feed(Input::Cancel {
        job_id: job.clone(),
    })
    .unwrap();
    h.feed(disk_full(&h, &job, 4)).unwrap();
    assert_eq!(h.m.job(&job).unwrap().status(h.now).checkpoint_failures, 0);
}

/// The final checkpoint cannot be stored for ten minutes: rank 0 keeps trying (every 3 s),
/// the other ranks are done. The job neither fails nor stalls; once there is room it
/// completes with its final checkpoint.
#[test]
fn a_job_waits_for_room_for_its_final_checkpoint_then_completes() {
    let (mut h, job, w) = running(2, "progress_timeout_seconds = 60");
    h.step(&job, 20);
    let key = h.key(&job, 20);
    h.feed(Input::Done(DoneReport {
        key: Some(key.clone()),
        rank: 1,
        ..Default::default()
    }))
    .unwrap();
    let mut t = 0.0;
    while t < 600.0 {
        t += 3.0;
        h.at(t);
        h.heartbeats(&job, &[&w[0], &w[1]], 20);
        h.feed(disk_full(&h, &job, 20)).unwrap();
        h.tick();
        assert_eq!(h.state(&job), JobState::Running, "at {t} s");
    }
    let status = h.m.job(&job).unwrap().status(h.now);
    assert_eq!(status.checkpoint_failures, 200);
    assert!(status.checkpoint_problem.contains("the job waits"));
    assert!(h.sent(is_cancel).is_empty(), "nothing is cancelled");
    h.feed(Input::CheckpointStored(key.clone())).unwrap();
    h.feed(Input::Done(DoneReport {
        key: Some(key),
        rank: 0,
        ..Default::default()
    }))
    .unwrap();
    assert_eq!(h.state(&job), JobState::Completed);
    assert_eq!(h.m.job(&job).unwrap().status(h.now).checkpoint_problem, "");
}

#[test]
fn recoveries_in_a_row_back_off_and_a_step_trained_resets_them() {
    // (recovery in a row, how long its generation waits)
    let table = [
        (1, 0.0),
        (2, 0.5),
        (3, 1.0),
        (4, 2.0),
        (5, 4.0),
        (6, 8.0),
        (7, 16.0),
        (8, 30.0),
        (9, 30.0),
    ];
    let (mut h, job, w) = running(1, "min_workers = 1\nmax_recoveries = 16");
    let mut t = 0.0;
    for (n, wait) in table {
        let failure = FailureReport {
            key: Some(h.key(&job, 0)),
            rank: 0,
            worker_id: w[0].clone(),
            error: "ring broke".into(),
            recoverable: true,
            held_steps: vec![],
        };
        h.at(t).feed(Input::Failure(failure)).unwrap();
        h.tick();
        if wait > 0.0 {
            h.at(t + wait - 0.01);
            h.heartbeats(&job, &[&w[0]], 0);
            h.tick();
            assert_eq!(h.state(&job), JobState::Recovering, "recovery {n}");
        }
        h.at(t + wait);
        h.heartbeats(&job, &[&w[0]], 0);
        h.tick();
        assert_eq!(h.state(&job), JobState::Running, "recovery {n}");
        t += wait;
    }
    // A step trained: the next recovery starts at once again.
    h.step(&job, 1);
    let failure = FailureReport {
        key: Some(h.key(&job, 1)),
        rank: 0,
        worker_id: w[0].clone(),
        error: "ring broke".into(),
        recoverable: true,
        held_steps: vec![1],
    };
    h.feed(Input::Failure(failure)).unwrap();
    h.tick();
    assert_eq!(h.state(&job), JobState::Running);
}

/// The run: a fault that persists spent all 16 recoveries in 1.07 s. Now they take
/// minutes (of injected time).
#[test]
fn a_persistent_fault_cannot_spend_max_recoveries_in_a_second() {
    let (mut h, job, w) = running(1, "min_workers = 1\nmax_recoveries = 16");
    let mut t = 0.0;
    while h.state(&job) != JobState::Failed && t < 3600.0 {
        if h.state(&job) == JobState::Running {
            let failure = FailureReport {
                key: Some(h.key(&job, 0)),
                rank: 0,
                worker_id: w[0].clone(),
                error: "no space left on device".into(),
                recoverable: true,
                held_steps: vec![],
            };
            h.at(t).feed(Input::Failure(failure)).unwrap();
        }
        t += 0.25;
        h.at(t);
        h.heartbeats(&job, &[&w[0]], 0);
        h.tick();
    }
    assert_eq!(h.state(&job), JobState::Failed);
    let error = h.m.job(&job).unwrap().status(h.now).error;
    assert!(error.contains("max_recoveries = 16 reached"), "{error}");
    assert!(t > 240.0, "16 recoveries were spent in {t} s");
}
