//! What waits until a job's record is on disk (`machine::durability`): a generation's
//! `StartJob`s, the removal of pruned checkpoints, a queued job's preparation. The harness
//! leaves records unwritten here (`writes_records = false`) and confirms them one by one.

use super::*;

/// The records handed out among `effects`: (save number, generation, checkpoints listed).
fn saves(effects: &[Effect]) -> Vec<(u64, u64, Vec<u64>)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Save { record, seq, .. } => {
                Some((*seq, record.generation, record.checkpoints.clone()))
            }
            _ => None,
        })
        .collect()
}

/// The StartJob commands among `effects`.
fn starts(effects: &[Effect]) -> Vec<StartJob> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send {
                command: worker_command::Command::Start(s),
                ..
            } => Some(s.clone()),
            _ => None,
        })
        .collect()
}

fn written(h: &mut Harness, job: &str, seq: u64, generation: u64) {
    h.feed(Input::Saved {
        job_id: job.into(),
        seq,
        generation,
    })
    .unwrap();
}

#[test]
fn a_generations_ranks_start_only_once_the_record_naming_it_is_written() {
    let mut h = Harness::new();
    h.worker("127.0.0.1:7001", None);
    h.worker("127.0.0.1:7002", None);
    h.writes_records = false;
    let job = h.submit(spec("min_workers = 2"));
    let first = saves(&h.take(|_| true));
    assert_eq!(first.len(), 1, "the submission hands out its first record");
    written(&mut h, &job, first[0].0, 0);
    h.tick();
    h.feed(Input::Prepared {
        job_id: job.clone(),
        result: Ok(prepared()),
    })
    .unwrap();
    h.tick();
    assert_eq!(h.state(&job), JobState::Running);
    assert_eq!(h.generation(&job), 1);
    let effects = h.take(|_| true);
    assert!(
        starts(&effects).is_empty(),
        "no StartJob goes out while the record on disk names generation 0"
    );
    let launch = saves(&effects);
    let (seq, generation, _) = *launch.last().expect("the launch hands out a record");
    assert_eq!(generation, 1);

    // The write fails: it is handed out again at the next tick, and still nothing starts.
    h.feed(Input::SaveFailed {
        job_id: job.clone(),
        error: "no space left on device".into(),
        storage_full: true,
    })
    .unwrap();
    assert_eq!(
        h.m.job(&job)
            .unwrap()
            .save_error()
            .map(|e| e.message.as_str()),
        Some("no space left on device")
    );
    h.tick();
    let effects = h.take(|_| true);
    assert!(starts(&effects).is_empty());
    let again = saves(&effects);
    assert_eq!(again.len(), 1, "a failed save is handed out again");
    assert!(again[0].0 > seq && again[0].1 == 1);

    // An older save confirmed late changes nothing; the launch's record starts the ranks.
    written(&mut h, &job, seq - 1, 0);
    assert!(starts(&h.take(|_| true)).is_empty());
    written(&mut h, &job, again[0].0, 1);
    let started = starts(&h.take(|_| true));
    assert_eq!(
        started.len(),
        2,
        "both ranks start once generation 1 is on disk"
    );
    assert!(
        started
            .iter()
            .all(|s| s.key.as_ref().unwrap().generation == 1)
    );
    assert_eq!(h.m.job(&job).unwrap().save_error(), None);
}

#[test]
fn pruned_checkpoints_are_removed_only_once_a_record_without_them_is_written() {
    let mut h = Harness::new();
    h.worker("127.0.0.1:7001", None);
    let job = h.job(spec_with("keep_checkpoints = 2", "min_workers = 1"));
    h.tick();
    assert_eq!(h.state(&job), JobState::Running);
    h.writes_records = false;
    h.take(|_| true);
    // keep_checkpoints = 2: store 4, 8, 12; 4 is pruned.
    let mut handed = Vec::new();
    for step in [4, 8, 12] {
        h.feed(Input::CheckpointStored(h.key(&job, step))).unwrap();
        handed.extend(saves(&h.take(|_| true)));
    }
    let listed: Vec<Vec<u64>> = handed.iter().map(|s| s.2.clone()).collect();
    assert_eq!(listed.last().unwrap(), &vec![8, 12], "{listed:?}");
    // The record listing 4 is written: 4 must stay on disk.
    let with_4 = handed
        .iter()
        .rev()
        .find(|s| s.2.contains(&4))
        .unwrap()
        .clone();
    written(&mut h, &job, with_4.0, with_4.1);
    assert!(
        h.take(|e| matches!(e, Effect::RemoveCheckpoints { .. }))
            .is_empty(),
        "a written record still lists step 4"
    );
    let without = handed.last().unwrap().clone();
    written(&mut h, &job, without.0, without.1);
    let removed = h.take(|e| matches!(e, Effect::RemoveCheckpoints { .. }));
    let [Effect::RemoveCheckpoints { dirs }] = removed.as_slice() else {
        panic!("{removed:?}")
    };
    let job_dir = PathBuf::from("/nonexistent/jobs").join(&job);
    assert_eq!(dirs, &vec![crate::layout::checkpoint_dir(&job_dir, 4)]);
}

#[test]
fn a_queued_job_waits_for_its_record_and_can_be_withdrawn_only_before_it() {
    let mut h = Harness::new();
    h.worker("127.0.0.1:7001", None);
    h.writes_records = false;
    let job = h.submit(spec("min_workers = 1"));
    h.tick();
    assert!(
        h.take(|e| matches!(e, Effect::Prepare { .. })).is_empty(),
        "nothing is prepared for a job a restart would not know"
    );
    assert!(!h.m.job(&job).unwrap().is_recorded());
    h.feed(Input::Withdraw {
        job_id: job.clone(),
    })
    .unwrap();
    assert!(h.m.job(&job).is_err(), "the withdrawn job is forgotten");
    assert_eq!(h.m.jobs().count(), 0);

    let other = h.submit(spec("min_workers = 1"));
    let first = saves(&h.take(|_| true));
    written(&mut h, &other, first[0].0, 0);
    h.tick();
    assert_eq!(h.take(|e| matches!(e, Effect::Prepare { .. })).len(), 1);
    let refused = h.feed(Input::Withdraw {
        job_id: other.clone(),
    });
    assert!(
        matches!(refused, Err(CoordinatorError::BadRequest(_))),
        "{refused:?}"
    );
    assert!(h.m.job(&other).is_ok());
}

#[test]
fn a_generation_waiting_for_its_record_blames_no_worker() {
    let mut h = Harness::new();
    let a = h.worker("127.0.0.1:7001", None);
    let b = h.worker("127.0.0.1:7002", None);
    let job = h.job(spec("min_workers = 2\nprogress_timeout_seconds = 30"));
    h.writes_records = false;
    h.tick();
    assert_eq!(h.state(&job), JobState::Running);
    let launch = saves(&h.take(|_| true));
    let (seq, generation, _) = *launch.last().unwrap();
    // The data folder is full for ten minutes: the workers keep heartbeating, idle.
    for second in 1..=600 {
        h.at(second as f64);
        for w in [&a, &b] {
            h.feed(Input::Heartbeat {
                worker_id: w.clone(),
                key: None,
                times: None,
            })
            .unwrap();
        }
        h.tick();
    }
    let effects = h.take(|_| true);
    assert!(starts(&effects).is_empty());
    assert_eq!(
        h.state(&job),
        JobState::Running,
        "no stall while nothing was sent"
    );
    assert_eq!(h.generation(&job), generation);
    // Room again: the record is written and both ranks start.
    written(&mut h, &job, seq, generation);
    assert_eq!(starts(&h.take(|_| true)).len(), 2);
}
