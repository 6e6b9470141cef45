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
//! reached at that step; no worker is left attached to, or training, a finished job.
//!
//! # Findings
//! Bugs the simulation found and that are fixed keep their seeds as tests below
//! (`holders_beyond_the_cap_are_let_go`, `finished_ranks_are_not_blamed_for_a_stall`). Known
//! bugs not fixed here keep theirs as `#[ignore]`d tests describing them; the long runs
//! count them apart from the other violations ([`simulation::Known`]).
//!
//! # Running many seeds
//! `KEEL_SIM_SEEDS=10000 cargo test --release -p keel-coordinator --test cluster_simulation
//! many_seeds -- --ignored --nocapture` runs seeds `0..N` alternately on 64 and 256 workers
//! (`KEEL_SIM_FIRST` moves the start) and prints a summary.

mod simulation;

use simulation::{Config, Known, Report, Sim, Summary};

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
/// workers, from `KEEL_SIM_FIRST` (default 0); prints the summary and fails on any violation
/// but those of runs that launched a generation number twice (a known bug: see
/// `a_reused_generation_takes_the_old_rings_step`).
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
    assert_eq!(
        summary.violations - summary.violations_with_reused_generation,
        0,
        "violations outside the known bug of a reused generation number: {summary}"
    );
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

/// Runs `seed` on `workers` workers with the known, unfixed bug `known` counted as a
/// violation.
fn run_strict(seed: u64, workers: usize, known: Known) -> Report {
    let mut cfg = Config::new(seed, workers);
    cfg.strict_known = Some(known);
    Sim::new(cfg).run()
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

/// Known bug, not fixed (the fix is not small): pruned checkpoint folders are removed before
/// the record that drops them is written. When that record's write fails and the coordinator
/// dies before a later write succeeds, the restart reads back the older record, and the
/// machine lists (and would offer to verify) checkpoints whose folders are gone, while the
/// newer ones it had stored are forgotten on disk. Removal should wait until a record
/// without them has been saved (`RemoveCheckpoints` after a confirmed `Save`).
#[test]
#[ignore = "known bug: pruned checkpoints come back after a restart from an older record"]
fn pruned_checkpoint_comes_back_after_a_restart() {
    assert_clean(&run_strict(96, 64, Known::PrunedCheckpointListed));
}

/// Known bug, not fixed (the fix is not small): a generation's launch is not durable before
/// its `StartJob`s go out. When its record's write fails and the coordinator dies, the restart
/// reads back the older record and launches the same generation number again, with other
/// members and world size, while the old ring may still be running: reports of the two are
/// indistinguishable to the machine (`Machine::current` compares generation numbers only).
/// Generation numbers should be unique across restarts (e.g. raised past every generation
/// a registering worker names, or the launch saved before it is sent).
#[test]
#[ignore = "known bug: a restarted coordinator may launch a generation number again"]
fn a_generation_number_is_reused_after_a_restart() {
    assert_clean(&run_strict(1036, 64, Known::GenerationReused));
}

/// Known bug, a consequence of the one above: the old ring of a reused generation number
/// still trains and reports. Here a step report of the old generation 1 (step 11) reached the
/// restarted coordinator between its launch of the new generation 1 and the files being
/// built; it was taken as current and moved the job's step, and the `StartJob`s then said
/// "start at step 11" with `StateSource::Init`: the new ring applied step 12 to initial
/// weights, skipping 11 steps (the simulation's weight chain shows it). Seed 4927 on 256
/// workers does the same (36 steps skipped, then the job fails without a final checkpoint).
#[test]
#[ignore = "known bug: an old ring's report moves a reused generation's start step"]
fn a_reused_generation_takes_the_old_rings_step() {
    assert_clean(&run(9138, 64));
    assert_clean(&run(4927, 256));
}

/// Known gap, not fixed (outside the machine: the submit handler): a submission is answered
/// after the driver flushed its effects even when the job's first record could not be
/// written; if the coordinator dies before a later write succeeds, the restart skips the
/// folder without `job-state.json` and the accepted job is gone.
#[test]
#[ignore = "known gap: an accepted submission whose first record write failed is lost in a restart"]
fn a_submission_whose_record_was_never_written_is_lost() {
    assert_clean(&run_strict(1442, 64, Known::SubmissionLost));
}
