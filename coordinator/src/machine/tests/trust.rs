//! What the machine does not take on a worker's word: a held-step claim the ring cannot have
//! reached, and a worker the watchdog excluded coming back after a coordinator restart.

use super::*;

/// The machine's last StartJob round: (source, start step, the root rank's worker).
fn started_from(h: &mut Harness) -> (i32, u64, String) {
    let starts = h.starts();
    let s = &starts.first().expect("a generation started").1;
    let root = starts[s.state_root_rank as usize].0.clone();
    (s.state_source, s.start_step, root)
}

#[test]
fn a_forged_claim_among_honest_members_does_not_move_the_job_ahead() {
    let (mut h, job, w) = running(3, "min_workers = 1");
    h.at(1.0).step(&job, 5);
    h.feed(Input::Detached {
        worker_id: w[2].clone(),
        attach: 1,
    })
    .unwrap();
    h.tick();
    // w[1] claims step 19 (below max_steps = 20); w[0], the honest survivor, holds 5.
    h.held(&job, &w[0], &[5]);
    h.held(&job, &w[1], &[19]);
    h.tick();
    assert_eq!(
        started_from(&mut h),
        (StateSource::Memory as i32, 5, w[0].clone())
    );
}

#[test]
fn a_sole_claim_is_trusted_only_as_far_as_the_ring_could_have_run() {
    // 0.5 s steps, rank 0 last heard at step 5 at 1 s; the survivor answers at 1.5 s: the
    // ring can have run 1 + 0.5 / 0.25 = 3 steps since.
    for (claim, expected) in [(8, 8), (9, 0)] {
        let (mut h, job, w) = running(2, "min_workers = 1");
        h.at(1.0);
        h.feed(Input::Step(StepReport {
            key: Some(h.key(&job, 5)),
            rank: 0,
            loss: 1.0,
            step_seconds: 0.5,
            ..Default::default()
        }))
        .unwrap();
        h.feed(Input::Detached {
            worker_id: w[1].clone(),
            attach: 1,
        })
        .unwrap();
        h.at(1.5).tick();
        h.held(&job, &w[0], &[claim]);
        h.tick();
        let source = if expected > 0 {
            StateSource::Memory
        } else {
            StateSource::Init
        };
        assert_eq!(
            started_from(&mut h),
            (source as i32, expected, w[0].clone()),
            "claim {claim}"
        );
    }
}

#[test]
fn after_a_restart_a_claim_may_be_as_far_ahead_as_the_time_since_the_saved_step() {
    // The record says step 9, heard 60 s before the restart, at 1 s a step: the survivors
    // may have run up to 1 + 60 / 0.5 = 121 steps further while the coordinator was down.
    let (mut h, job) = restored_heard(60, Some(1.0));
    let holds = Some(TrainingKey {
        job_id: job.clone(),
        generation: 3,
        step: 19,
    });
    let a = h.worker("127.0.0.1:7001", holds);
    h.tick();
    h.held(&job, &a, &[19]);
    h.tick();
    assert_eq!(
        started_from(&mut h),
        (StateSource::Memory as i32, 19, a.clone())
    );
}

/// [`super::recovery::restored`], with the step heard `seconds_ago` and a last step time.
fn restored_heard(seconds_ago: u64, step_seconds: Option<f64>) -> (Harness, String) {
    let mut h = Harness::new();
    let wall = SystemTime::now();
    let heard = wall - Duration::from_secs(seconds_ago);
    let ms = |t: SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let record = crate::persist::JobRecord {
        version: FORMAT_VERSION,
        id: "job-1".into(),
        spec: serde_json::to_value(spec("min_workers = 1")).unwrap(),
        state: JobState::Running.as_str_name().into(),
        generation: 3,
        step: 9,
        checkpoints: vec![],
        error: None,
        worker_names: vec!["w-1 (127.0.0.1:7001)".into()],
        recoveries: 0,
        skipped_steps: 0,
        global_batch_size: Some(4),
        precision: None,
        submitted_unix_ms: ms(heard) - 1000,
        step_heard_unix_ms: Some(ms(heard)),
        excluded_workers: Vec::new(),
        finished_unix_ms: None,
        metrics: LastMetrics {
            loss: Some(1.0),
            step_seconds,
            ..Default::default()
        },
    };
    let restored = Restored {
        spec: spec("min_workers = 1"),
        dir: PathBuf::from("/nonexistent/jobs/job-1"),
        prepared: Some(prepared()),
        interrupted_preparations: 0,
        refused: None,
        record,
    };
    h.m.restore(h.now, wall, vec![restored], 1);
    h.drain();
    (h, "job-1".into())
}

#[test]
fn a_worker_the_watchdog_excluded_stays_excluded_after_a_restart() {
    let (mut h, job, w) = running(2, "min_workers = 1\nprogress_timeout_seconds = 30");
    // w[0] heartbeats the generation; w[1] (127.0.0.1:7101) heartbeats but never names it.
    for t in [3.0, 9.0, 15.0, 21.0, 27.0, 31.0] {
        h.at(t).heartbeats(&job, &[&w[0]], 0);
        h.feed(Input::Heartbeat {
            worker_id: w[1].clone(),
            key: None,
            times: None,
        })
        .unwrap();
        h.tick();
    }
    assert_eq!(h.state(&job), JobState::Recovering);
    let record = h.m.job(&job).unwrap().record();
    assert_eq!(record.excluded_workers, ["127.0.0.1:7101"]);

    // The coordinator restarts with the saved record; nothing else survives.
    let mut h = Harness::new();
    let restored = Restored {
        spec: spec("min_workers = 1\nprogress_timeout_seconds = 30"),
        dir: PathBuf::from("/nonexistent/jobs/job-1"),
        prepared: Some(prepared()),
        interrupted_preparations: 0,
        refused: None,
        record,
    };
    h.m.restore(h.now, SystemTime::now(), vec![restored], 1);
    h.drain();
    // The stalling machine registers again (a new worker id) and waits through the gathering.
    let stalled = h.worker("127.0.0.1:7101", None);
    for t in [1.0, 6.0, 12.0, 20.0] {
        h.at(t).heartbeats(&job, &[], 0);
        h.feed(Input::Heartbeat {
            worker_id: stalled.clone(),
            key: None,
            times: None,
        })
        .unwrap();
        h.tick();
    }
    assert!(
        h.starts().is_empty(),
        "the excluded address was given the job"
    );
    // A different machine is.
    let fresh = h.worker("127.0.0.1:7300", None);
    h.tick();
    let starts = h.starts();
    let ranks: Vec<&str> = starts.iter().map(|(w, _)| w.as_str()).collect();
    assert_eq!(ranks, [fresh.as_str()]);
}
