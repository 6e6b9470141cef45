//! Cancel in every phase, completion, the watchdog, saving, membership.

use super::*;

#[test]
fn cancel_ends_the_job_in_every_phase_and_tells_its_workers() {
    type Setup = fn() -> (Harness, String, Vec<String>);
    let queued: Setup = || {
        let mut h = Harness::new();
        let id = h.submit(spec(""));
        (h, id, vec![])
    };
    let preparing: Setup = || {
        let mut h = Harness::new();
        let id = h.submit(spec(""));
        h.tick();
        (h, id, vec![])
    };
    let waiting: Setup = || {
        let mut h = Harness::new();
        let id = h.job(spec(""));
        (h, id, vec![])
    };
    let run: Setup = || running(2, "min_workers = 2");
    let recovering: Setup = || {
        let (mut h, id, w) = running(3, "min_workers = 2");
        h.feed(Input::Detached {
            worker_id: w[2].clone(),
            attach: 1,
        })
        .unwrap();
        h.tick();
        (h, id, w[..2].to_vec())
    };
    let cases: [(Setup, JobState); 5] = [
        (queued, JobState::Queued),
        (preparing, JobState::Preparing),
        (waiting, JobState::WaitingForWorkers),
        (run, JobState::Running),
        (recovering, JobState::Recovering),
    ];
    for (setup, before) in cases {
        let (mut h, job, members) = setup();
        assert_eq!(h.state(&job), before);
        h.take(|_| true);
        let Ok(Reply::Status(status)) = h.feed(Input::Cancel {
            job_id: job.clone(),
        }) else {
            panic!()
        };
        assert_eq!(status.state, JobState::Cancelled as i32, "from {before:?}");
        assert_eq!(status.error, "cancelled by the user");
        assert_eq!(h.sent(is_cancel), members, "from {before:?}");
        // A late preparation or build result changes nothing.
        h.feed(Input::Prepared {
            job_id: job.clone(),
            result: Ok(prepared()),
        })
        .unwrap();
        assert_eq!(h.state(&job), JobState::Cancelled);
    }
    // A finished job stays as it ended.
    let (mut h, job, _) = running(1, "");
    h.feed(Input::Failure(FailureReport {
        key: Some(h.key(&job, 1)),
        error: "bad".into(),
        ..Default::default()
    }))
    .unwrap();
    h.feed(Input::Cancel {
        job_id: job.clone(),
    })
    .unwrap();
    assert_eq!(h.state(&job), JobState::Failed);
}

#[test]
fn a_job_completes_only_with_its_final_checkpoint() {
    for (final_stored, expected) in [(true, JobState::Completed), (false, JobState::Failed)] {
        let mut h = Harness::new();
        h.worker("127.0.0.1:7001", None);
        h.worker("127.0.0.1:7002", None);
        let job = h.job(spec_with("keep_checkpoints = 1", "min_workers = 2"));
        h.tick();
        for step in [4, 8, 20].into_iter().filter(|&s| final_stored || s != 20) {
            let key = h.key(&job, step);
            h.feed(Input::CheckpointStored(key)).unwrap();
        }
        // keep_checkpoints = 1: step 4 is removed once step 8 is stored; the final one stays.
        let removed = h.take(|e| matches!(e, Effect::RemoveCheckpoints { .. }));
        assert_eq!(removed.len(), 1);
        h.done(&job, 2, 20);
        assert_eq!(h.state(&job), expected);
        let kept: Vec<u64> = if final_stored { vec![8, 20] } else { vec![8] };
        assert_eq!(h.m.job(&job).unwrap().checkpoints(), kept);
    }
}

#[test]
fn a_finished_jobs_clock_stops_and_stays_stopped_after_a_restart() {
    let (mut h, job, _) = running(1, "");
    h.at(5.0);
    for step in [4, 8, 12, 16, 20] {
        let key = h.key(&job, step);
        h.feed(Input::CheckpointStored(key)).unwrap();
    }
    h.at(7.0).done(&job, 1, 20);
    assert_eq!(h.state(&job), JobState::Completed);
    h.at(60.0);
    let elapsed = h.m.job(&job).unwrap().status(h.now).elapsed_seconds;
    assert!((elapsed - 7.0).abs() < 1e-3, "elapsed {elapsed} s");

    // Restarted 53 s after the end: still 7 s.
    let record = h.m.job(&job).unwrap().record();
    let ended = record.finished_unix_ms.expect("the end is saved");
    assert_eq!(ended - record.submitted_unix_ms, 7000);
    let mut h2 = Harness::new();
    let wall = std::time::UNIX_EPOCH + Duration::from_millis(ended + 53_000);
    let restored = Restored {
        spec: spec(""),
        dir: PathBuf::from("/nonexistent/jobs/job-1"),
        prepared: None,
        interrupted_preparations: 0,
        refused: None,
        record,
    };
    h2.m.restore(h2.now, wall, vec![restored], 1);
    h2.at(100.0);
    let elapsed = h2.m.job(&job).unwrap().status(h2.now).elapsed_seconds;
    assert!(
        (elapsed - 7.0).abs() < 1e-2,
        "elapsed after a restart {elapsed} s"
    );
}

#[test]
fn a_stalled_job_drops_the_worker_that_never_started_and_regroups() {
    let (mut h, job, w) = running(2, "min_workers = 1\nprogress_timeout_seconds = 30");
    // w[0] heartbeats the generation; w[1] heartbeats but never names it.
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
    let effects = h.take(|_| true);
    let cancelled: Vec<&String> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send { worker_id, command } if is_cancel(command) => Some(worker_id),
            _ => None,
        })
        .collect();
    assert_eq!(cancelled, [&w[1]]);
    assert!(effects.iter().any(
        |e| matches!(e, Effect::AppendMetrics { line, .. } if line.to_value()["event"] == "stall")
    ));
    let Phase::Recovering(r) = h.m.job(&job).unwrap().phase() else {
        panic!()
    };
    assert!(matches!(&r.stage, Stage::Collecting { asked, .. } if asked == &[w[0].clone()]));
}

#[test]
fn records_are_saved_at_once_for_changes_and_every_2_s_for_progress() {
    let (mut h, job, _) = running(1, "");
    let saves = |h: &mut Harness| h.take(|e| matches!(e, Effect::Save { .. })).len();
    h.take(|_| true);
    h.at(0.5);
    h.step(&job, 1);
    assert_eq!(
        saves(&mut h),
        0,
        "progress within 2 s of the last save waits"
    );
    h.at(1.0).tick();
    assert_eq!(saves(&mut h), 0);
    h.at(2.5).tick();
    assert_eq!(saves(&mut h), 1, "the tick saves progress that waited");
    h.feed(Input::CheckpointStored(h.key(&job, 4))).unwrap();
    assert_eq!(saves(&mut h), 1, "a checkpoint is saved at once");
    h.feed(Input::SaveFailed {
        job_id: job.clone(),
        error: "disk full".into(),
        storage_full: true,
    })
    .unwrap();
    h.tick();
    assert_eq!(saves(&mut h), 1, "a failed save is handed out again");
    assert_eq!(h.m.save_all(h.now), 0, "nothing changed since");
    h.step(&job, 2);
    assert_eq!(saves(&mut h), 0);
    assert_eq!(h.m.save_all(h.now), 1, "the shutdown's save does not wait");
}

#[test]
fn a_live_address_is_refused_and_a_silent_one_taken_over() {
    let mut h = Harness::new();
    let a = h.worker("127.0.0.1:7001", None);
    let err = h.feed(Input::Register(Registration {
        advertise_addr: "127.0.0.1:7001".into(),
        ..Default::default()
    }));
    assert!(
        matches!(err, Err(CoordinatorError::AddressInUse { .. })),
        "{err:?}"
    );
    h.at(4.0);
    let b = h.worker("127.0.0.1:7001", None);
    assert_ne!(a, b);
    h.tick();
    assert!(
        h.m.worker(&a).is_none(),
        "the silent registration was dropped"
    );
    assert!(h.m.worker(&b).is_some());
}

#[test]
fn a_detach_of_a_replaced_stream_is_ignored() {
    let mut h = Harness::new();
    let a = h.worker("127.0.0.1:7001", None);
    h.feed(Input::Attached {
        worker_id: a.clone(),
        attach: 2,
    })
    .unwrap();
    h.feed(Input::Detached {
        worker_id: a.clone(),
        attach: 1,
    })
    .unwrap();
    h.tick();
    assert!(h.m.worker(&a).is_some_and(|w| w.reachable()));
    let outcome = Outcome::Completed;
    assert_eq!(Phase::Finished(outcome).state(), JobState::Completed);
}

#[test]
fn late_step_reports_to_a_finished_job_are_refused_for_what_they_are() {
    let (mut h, job, _) = running(2, "min_workers = 2");
    for step in [4, 20] {
        let key = h.key(&job, step);
        h.feed(Input::CheckpointStored(key)).unwrap();
    }
    h.step(&job, 20);
    h.done(&job, 2, 20);
    assert_eq!(h.state(&job), JobState::Completed);
    let report = |step, rank| {
        Input::Step(StepReport {
            key: Some(h.key(&job, step)),
            rank,
            ..Default::default()
        })
    };
    let cases = [
        (report(1, 0), "order"),
        (report(20, 9), "rank 9"),
        (report(0, 0), "step 0"),
    ];
    for (input, needle) in cases {
        let err = h.feed(input).unwrap_err().to_string();
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
}
