//! A deterministic, seeded simulation of a whole cluster's control plane: the coordinator's
//! real job machine (`keel_coordinator::machine::Machine`) and its real restart path
//! (`Machine::restore`, fed the `JobRecord`s that its `Save` effects wrote so far), driven
//! by a model of the driver and by 64 or 256 modelled workers, through seeded fault
//! schedules.
//!
//! # What is real and what is a model
//! - Real: the machine (membership, launch, recovery, watchdog, reports, storage) and its
//!   restore from saved records.
//! - Modelled: the driver (effects carried out after simulated delays, a record write that
//!   fails fed back as `SaveFailed`, a checkpoint write that fails as `UploadFailed`); the
//!   worker's side of the protocol as `worker/src/serve/` and `worker/src/job.rs` implement
//!   it (registration naming what it holds, heartbeats, Start/Suspend/Cancel, the reporter's
//!   ordered step/eval reports and uploads, the final upload's retries, the run's last word:
//!   done, failure with held steps, held, or nothing after a cancel); the ring as a lockstep
//!   that fails on every member when one leaves; the network (latency, per-connection
//!   order, lost RPCs, partitions).
//! - Not run: the real worker job loop, the real ring and all-reduce (those have their own
//!   in-memory-transport simulation in `worker/tests/ring_simulation.rs`), gRPC, files.
//!   "Training" is a hash chain `w_{s+1} = H(w_s, step, global batch id, world size)`, so
//!   every rank's weights can be compared at every step, and a job's final checkpoint with
//!   an uninterrupted run's.
//!
//! # Determinism
//! One `u64` seed gives the whole run: a self-written SplitMix64, a virtual clock (injected
//! `Instant`/`SystemTime` values, no sleeping), and an event queue ordered by (time, sequence
//! number). Every run is bounded in events and virtual time.
//!
//! # Invariants
//! Every step, in every ring: each rank applies exactly the next step to its own weights
//! (none skipped or applied twice) and all ranks agree. At the end: every job has ended
//! (completed, or failed for a reason naming an injected fault) by the deadline; a completed
//! job whose world size never changed holds the uninterrupted run's final weights; every
//! checkpoint the machine counts as stored is in the store and holds weights some rank
//! reached at that step; no worker is left attached to, or training, a finished job. And
//! at rest the machine is back at its baseline: its registry holds exactly the live workers'
//! sessions (nothing of a crashed incarnation), no effect waits, and every job's record on
//! disk says what the machine holds (state, generation, step, checkpoints, error). Two
//! deliberate bugs showed these checks fail: dead idle workers never removed (131 violations in
//! 100 seeds) and a failed record write never retried (38 in 200 seeds).
//!
//! # Findings
//! Bugs the simulation found keep their seeds as tests below, each describing the bug and
//! its fix: regroup holders beyond the cap, finished ranks blamed for a stall, pruned
//! checkpoints listed after a restart, generation numbers launched twice, and accepted
//! submissions lost (the last three: what must wait until a job's record is on disk).
//!
//! # Running many seeds
//! `KEEL_SIM_SEEDS=10000 cargo test --release -p keel-coordinator --test cluster_simulation
//! many_seeds -- --ignored --nocapture` runs seeds `0..N` alternately on 64 and 256 workers
//! (`KEEL_SIM_FIRST` moves the start) and prints a summary.

mod simulation;

use simulation::{Config, Report, Sim, Summary};

/// Runs `seed` on `workers` workers.
fn run(seed: u64, workers: usize) -> Report {
    Sim::new(Config::new(seed, workers)).run()
}

/// Runs every `(seed, workers)` on two threads; the summary.
fn run_all(cases: Vec<(u64, usize)>) -> Summary {
    let cases = std::sync::Arc::new(cases);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (cases, next) = (cases.clone(), next.clone());
            std::thread::spawn(move || {
                let mut reports = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some(&(seed, workers)) = cases.get(i) else {
                        return reports;
                    };
                    reports.push((i, run(seed, workers)));
                }
            })
        })
        .collect();
    let mut all: Vec<(usize, Report)> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("a simulation thread panicked"))
        .collect();
    all.sort_by_key(|(i, _)| *i);
    let mut summary = Summary::default();
    for (_, r) in &all {
        summary.add(r);
    }
    summary
}

/// A fixed set of seeds on 64 and 256 workers: every invariant holds in each.
#[test]
fn fixed_seeds_keep_every_invariant() {
    let mut cases: Vec<(u64, usize)> = (0..160).map(|s| (s, 64)).collect();
    cases.extend((10_000..10_060).map(|s| (s, 256)));
    let summary = run_all(cases);
    println!("{summary}");
    assert_eq!(summary.violations, 0, "{summary}");
    assert!(
        summary.outcomes.get("completed").copied().unwrap_or(0) > 0,
        "some job completed: {summary}"
    );
    assert!(
        summary.same_world_completed > 0,
        "some completed job was compared with an uninterrupted run: {summary}"
    );
}

/// The same seed gives the same run, event for event.
#[test]
fn a_seed_replays_exactly() {
    let a = run(7, 64);
    let b = run(7, 64);
    assert_eq!(
        (a.events, a.virtual_ms, &a.outcomes, &a.faults),
        (b.events, b.virtual_ms, &b.outcomes, &b.faults)
    );
    assert!(a.events > 1000, "the run did something: {a:?}");
}

/// Many seeds, by hand: `KEEL_SIM_SEEDS` of them (default 1000), alternately on 64 and 256
/// workers, from `KEEL_SIM_FIRST` (default 0); prints the summary and fails on any violation.
#[test]
#[ignore = "long: run by hand with KEEL_SIM_SEEDS"]
fn many_seeds() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (n, first) = (env("KEEL_SIM_SEEDS", 1000), env("KEEL_SIM_FIRST", 0));
    let cases = (first..first + n)
        .map(|s| (s, if s % 2 == 0 { 64 } else { 256 }))
        .collect();
    let started = std::time::Instant::now();
    let summary = run_all(cases);
    println!("{summary}");
    println!("wall time: {:.1} s", started.elapsed().as_secs_f64());
    assert_eq!(summary.violations, 0, "violations: {summary}");
}

/// One seed, by hand (`KEEL_SIM_SEED`, `KEEL_SIM_WORKERS`; `KEEL_SIM_TRACE=1` prints its
/// events): its report.
#[test]
#[ignore = "by hand: study one seed"]
fn one_seed() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let r = run(
        env("KEEL_SIM_SEED", 0),
        env("KEEL_SIM_WORKERS", 64) as usize,
    );
    println!("{r:#?}");
    assert!(r.violations.is_empty());
}

/// Asserts that `report` found no violation.
fn assert_clean(report: &Report) {
    assert!(
        report.violations.is_empty(),
        "seed {} ({} workers): {:#?}",
        report.seed,
        report.workers,
        report.violations
    );
}

/// Regression: a regroup that gathered more holders than the ring takes (here after a
/// coordinator restart) left the ones beyond the cap marked as the job's: out of every ring
/// for good, and still attached when the job ended. Fixed in `machine/recovery.rs` (`form`
/// lets them go).
#[test]
fn holders_beyond_the_cap_are_let_go() {
    assert_clean(&run(5, 256));
}

/// Regression: one rank's done report lost at the last step stalled the job; the watchdog
/// took every rank that had already reported done for one that never started the
/// generation (their heartbeats name no job once finished), dropped and excluded them all,
/// and the job failed for want of workers. Fixed in `machine/watchdog.rs` (a rank that
/// reported done is not a culprit).
#[test]
fn finished_ranks_are_not_blamed_for_a_stall() {
    let r = run(1559, 256);
    assert_clean(&r);
    assert!(r.outcomes.iter().all(|o| o == "completed"), "{r:#?}");
}

/// Regression: pruned checkpoint folders were removed before the record that drops them was
/// written. When that write failed and the coordinator died before a later one succeeded,
/// the restart read back the older record and listed checkpoints whose folders were gone.
/// Fixed in `machine/durability.rs`: the folders are removed once a record without them is
/// on disk.
#[test]
fn pruned_checkpoints_stay_until_a_record_without_them_is_written() {
    assert_clean(&run(96, 64));
}

/// Regression: a generation's `StartJob`s went out before the record naming it was written.
/// When that write failed and the coordinator died, the restart read back the older record
/// and launched the same generation number again with other members, while the old ring
/// still trained: its reports were taken as the new ring's (`Machine::current` compares
/// generation numbers). Seeds 9138 and 4927: an old ring's step report moved the reused
/// generation's start step, and the new ring skipped 11 and 36 steps. Fixed in
/// `machine/durability.rs`: a generation's ranks are started only once the record naming it
/// is on disk, so generation numbers are unique across restarts.
#[test]
fn a_generation_number_is_never_launched_twice() {
    assert_clean(&run(1036, 64));
    assert_clean(&run(9138, 64));
    assert_clean(&run(4927, 256));
}

/// Regression: a submission was answered even when the job's first record could not be
/// written; a restart before a later write succeeded lost the accepted job. Fixed in the
/// submit handler (`CoordinatorService::recorded_or_withdrawn`): the answer waits for the
/// record, and a job whose record cannot be written is withdrawn and refused.
#[test]
fn an_accepted_submission_survives_a_restart() {
    let r = run(1442, 64);
    assert_clean(&r);
}
