//! Recoveries: losses while recovering, replacements, growth, restarts.

use super::*;

#[test]
fn losses_while_recovering_and_twice_in_a_row_count_against_max_recoveries() {
    let (mut h, job, w) = running(3, "min_workers = 1\nmax_recoveries = 1");
    h.feed(Input::Detached {
        worker_id: w[2].clone(),
        attach: 1,
    })
    .unwrap();
    h.tick();
    assert_eq!(h.state(&job), JobState::Recovering);
    // A second loss while collecting answers: it is dropped from the regroup, not counted.
    h.feed(Input::Detached {
        worker_id: w[1].clone(),
        attach: 1,
    })
    .unwrap();
    h.tick();
    let Phase::Recovering(r) = h.m.job(&job).unwrap().phase() else {
        panic!()
    };
    assert_eq!(r.stage.members(), [w[0].clone()]);
    h.held(&job, &w[0], &[3]);
    h.tick();
    assert_eq!(h.state(&job), JobState::Running);
    assert_eq!(h.starts().len(), 1);
    // The next loss is a second recovery: over the limit, the job fails saying so.
    let failure = FailureReport {
        key: Some(h.key(&job, 4)),
        rank: 0,
        worker_id: w[0].clone(),
        error: "ring broke".into(),
        recoverable: true,
        held_steps: vec![3],
    };
    h.feed(Input::Failure(failure)).unwrap();
    assert_eq!(h.state(&job), JobState::Failed);
    let status = h.m.job(&job).unwrap().status(h.now);
    assert!(
        status.error.contains("max_recoveries = 1 reached"),
        "{}",
        status.error
    );
    assert!(status.error.contains("ring broke"), "{}", status.error);
}

#[test]
fn a_replacement_before_the_timeout_joins_after_it_the_job_fails() {
    for (arrives_at, expected) in [(Some(20.0), JobState::Running), (None, JobState::Failed)] {
        let (mut h, job, w) = running(2, "min_workers = 2\nreplacement_timeout_seconds = 30");
        h.feed(Input::Detached {
            worker_id: w[1].clone(),
            attach: 1,
        })
        .unwrap();
        h.tick();
        h.held(&job, &w[0], &[2]);
        h.tick();
        assert_eq!(
            h.state(&job),
            JobState::Recovering,
            "one worker is below min_workers"
        );
        // w[0] heartbeats every 4 s (the peer timeout is 5 s) while the job waits.
        let mut t = 4.0;
        while t <= 32.0 && h.state(&job) == JobState::Recovering {
            h.at(t).heartbeats(&job, &[&w[0]], 2);
            if arrives_at == Some(t) {
                h.take(|_| true);
                let newcomer = h.worker("127.0.0.1:7999", None);
                h.tick();
                let starts = h.starts();
                let ranks: Vec<&str> = starts.iter().map(|(w, _)| w.as_str()).collect();
                assert_eq!(ranks, [w[0].as_str(), newcomer.as_str()]);
            } else {
                h.tick();
            }
            if t < 30.0 {
                assert!(
                    h.state(&job) != JobState::Failed,
                    "failed before the timeout, at {t} s"
                );
            }
            t += 4.0;
        }
        if arrives_at.is_none() {
            let error = h.m.job(&job).unwrap().status(h.now).error;
            assert!(
                error.contains("replacement_timeout_seconds = 30"),
                "{error}"
            );
        }
        assert_eq!(h.state(&job), expected);
    }
}

#[test]
fn a_running_job_grows_to_max_workers_without_counting_a_recovery() {
    let (mut h, job, w) = running(1, "min_workers = 1\nmax_workers = 2");
    h.step(&job, 3);
    h.take(|_| true);
    let newcomer = h.worker("127.0.0.1:7500", None);
    h.tick();
    assert_eq!(h.state(&job), JobState::Recovering);
    assert_eq!(h.metrics_events(), ["grow"]);
    h.held(&job, &w[0], &[3]);
    h.tick();
    let starts = h.starts();
    let ranks: Vec<&str> = starts.iter().map(|(w, _)| w.as_str()).collect();
    assert_eq!(ranks, [w[0].as_str(), newcomer.as_str()]);
    assert_eq!(starts[1].1.start_step, 3);
    assert_eq!(h.m.job(&job).unwrap().record().recoveries, 0);
    // At max_workers, a third worker stays idle.
    h.worker("127.0.0.1:7501", None);
    h.tick();
    assert_eq!(h.state(&job), JobState::Running);
}

/// A machine restored from a record of a running job (generation 3, step 9, checkpoints 4
/// and 8, two workers), with its prepared data found.
pub(super) fn restored() -> (Harness, String) {
    let mut h = Harness::new();
    let record = crate::persist::JobRecord {
        version: FORMAT_VERSION,
        id: "job-1".into(),
        spec: serde_json::to_value(spec("min_workers = 1")).unwrap(),
        state: JobState::Running.as_str_name().into(),
        generation: 3,
        step: 9,
        checkpoints: vec![4, 8],
        error: None,
        worker_names: vec!["w-1 (127.0.0.1:7001)".into(), "w-2 (127.0.0.1:7002)".into()],
        recoveries: 0,
        skipped_steps: 0,
        global_batch_size: Some(4),
        precision: None,
        submitted_unix_ms: 1,
        step_heard_unix_ms: None,
        excluded_workers: Vec::new(),
        finished_unix_ms: None,
        metrics: LastMetrics::default(),
    };
    let restored = Restored {
        spec: spec("min_workers = 1"),
        dir: PathBuf::from("/nonexistent/jobs/job-1"),
        prepared: Some(prepared()),
        interrupted_preparations: 0,
        refused: None,
        record,
    };
    h.m.restore(h.now, SystemTime::now(), vec![restored], 1);
    h.drain();
    assert_eq!(h.state("job-1"), JobState::Recovering);
    assert_eq!(h.generation("job-1"), 4);
    (h, "job-1".into())
}

#[test]
fn after_a_restart_the_newest_surviving_replica_wins() {
    let (mut h, job) = restored();
    let holds = |step| {
        Some(TrainingKey {
            job_id: job.clone(),
            generation: 3,
            step,
        })
    };
    let a = h.worker("127.0.0.1:7001", holds(8));
    let b = h.worker("127.0.0.1:7002", holds(9));
    assert!(
        a != "w-1" && b != "w-2",
        "worker numbers continue after the saved ones"
    );
    h.tick();
    assert_eq!(h.sent(is_suspend), [a.clone(), b.clone()]);
    h.held(&job, &a, &[8]);
    h.held(&job, &b, &[9]);
    h.tick();
    let starts = h.starts();
    let s = &starts[0].1;
    assert_eq!(
        (s.state_source, s.start_step),
        (StateSource::Memory as i32, 9)
    );
    assert_eq!(starts[s.state_root_rank as usize].0, b);
    assert_eq!(s.key.as_ref().unwrap().generation, 4);
}

#[test]
fn after_a_restart_with_no_replica_the_newest_intact_checkpoint_is_used() {
    for (intact, source, step) in [
        (Some(8), StateSource::Checkpoint, 8),
        (Some(4), StateSource::Checkpoint, 4),
        (None, StateSource::Init, 0),
    ] {
        let (mut h, job) = restored();
        let w = h.worker("127.0.0.1:7001", None);
        h.tick();
        assert!(h.starts().is_empty(), "it gathers for a few seconds first");
        h.at(6.0).heartbeats(&job, &[], 0);
        h.tick();
        h.tick();
        let verify = h.take(|e| matches!(e, Effect::VerifyCheckpoints { .. }));
        let [
            Effect::VerifyCheckpoints {
                steps, generation, ..
            },
        ] = verify.as_slice()
        else {
            panic!("{verify:?}")
        };
        assert_eq!(steps, &[4, 8]);
        let generation = *generation;
        h.feed(Input::CheckpointsVerified {
            job_id: job.clone(),
            generation,
            newest: intact,
        })
        .unwrap();
        let launches = h.take(|_| true);
        let built: Vec<&Launch> = launches
            .iter()
            .filter_map(|e| match e {
                Effect::BuildFiles(l) => Some(l.as_ref()),
                _ => None,
            })
            .collect();
        assert_eq!(built.len(), 1);
        assert_eq!((built[0].source, built[0].start_step), (source, step));
        assert_eq!(built[0].workers, std::slice::from_ref(&w));
        assert_eq!(
            built[0].state_files.len(),
            if intact.is_some() { 3 } else { 0 }
        );
    }
}
