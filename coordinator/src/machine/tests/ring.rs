//! The first ring, reports, and a loss while running.

use super::*;

#[test]
fn the_first_ring_waits_for_min_workers_then_starts_every_rank_in_order() {
    let mut h = Harness::new();
    let a = h.worker("127.0.0.1:7001", None);
    let job = h.job(spec("min_workers = 2\nmax_workers = 2"));
    h.tick();
    assert_eq!(h.state(&job), JobState::WaitingForWorkers);
    assert!(h.starts().is_empty());
    let b = h.worker("127.0.0.1:7002", None);
    h.tick();
    let starts = h.starts();
    let order: Vec<(&str, u32)> = starts.iter().map(|(w, s)| (w.as_str(), s.rank)).collect();
    assert_eq!(order, [(a.as_str(), 0), (b.as_str(), 1)]);
    assert_eq!(starts[0].1.peers, ["127.0.0.1:7001", "127.0.0.1:7002"]);
    assert_eq!(starts[0].1.state_source, StateSource::Init as i32);
    assert_eq!((h.generation(&job), h.state(&job)), (1, JobState::Running));
}

#[test]
fn reports_of_a_stale_generation_a_bad_rank_or_out_of_order_are_refused() {
    let (mut h, job, _) = running(2, "min_workers = 2");
    h.step(&job, 1);
    let report = |generation, rank, step| {
        Input::Step(StepReport {
            key: Some(TrainingKey {
                job_id: job.clone(),
                generation,
                step,
            }),
            rank,
            ..Default::default()
        })
    };
    let cases: [(Input, &str); 4] = [
        (report(0, 0, 2), "generation 0 is not the current one"),
        (report(1, 5, 2), "rank 5 is not in job"),
        (report(1, 0, 21), "outside 1..=20"),
        (report(1, 0, 1), "arrives after step 1"),
    ];
    for (input, needle) in cases {
        let err = h.feed(input).unwrap_err().to_string();
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    assert_eq!(h.m.job(&job).unwrap().step(), 1);
}

#[test]
fn a_worker_lost_while_running_regroups_from_the_newest_step_held() {
    let (mut h, job, w) = running(3, "min_workers = 2");
    h.step(&job, 6);
    // w[2] goes silent; the others heartbeat. Past the peer timeout (5 s) it is lost.
    h.at(4.0).heartbeats(&job, &[&w[0], &w[1]], 6);
    h.at(5.5).tick();
    assert_eq!(h.state(&job), JobState::Recovering);
    assert_eq!(h.generation(&job), 2);
    assert!(h.m.worker(&w[2]).is_none());
    assert_eq!(h.sent(is_suspend), [w[0].clone(), w[1].clone()]);
    h.held(&job, &w[0], &[5]);
    h.held(&job, &w[1], &[5, 6]);
    h.tick();
    let starts = h.starts();
    assert_eq!(starts.len(), 2);
    let s = &starts[0].1;
    assert_eq!(
        (s.state_source, s.start_step, s.state_root_rank),
        (StateSource::Memory as i32, 6, 1)
    );
    assert_eq!(h.m.job(&job).unwrap().record().recoveries, 1);
}
